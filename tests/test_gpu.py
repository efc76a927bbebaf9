"""The compiled kernel at its default (GPU) tile configuration, on LLM-like shapes.

Runs only where CUDA exists (the device tool); the CPU suite runs the same checks at small
shapes under the interpreter (test_kernel.py), and those tests also run compiled on a GPU via
the `device` fixture. Tolerances are test_kernel.py's (see its docstring).
"""
import pytest
import torch

from forge_engine.kernels import StateTensor, fused_wgrad_update
from forge_engine.kernels.reference import materialized_step
from forge_engine.optim import rules as R
from test_kernel import ADAM, check_int8, check_values, initial_state

pytestmark = pytest.mark.gpu

SHAPES = [
    (512, 1000, 1536),   # not multiples of 128
    (2048, 1024, 4096),  # a projection at 2k tokens
    (256, 32003, 512),   # LM-head-like N (odd vocab)
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("wfmt,sfmt", [("bf16", "bf16"), ("bf16", "int8"), ("fp32", "fp32")])
def test_compiled_kernel_matches_float64(shape, wfmt, sfmt, monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    dev = torch.device("cuda")
    dt = torch.bfloat16 if wfmt == "bf16" else torch.float32
    T, N, K = shape
    spec = R.rule_spec(R.ADAMW, 0)
    w = (torch.randn(N, K, device=dev) * 0.02).to(dt)
    states = initial_state(spec, (N, K), sfmt, dev)
    for step in (1, 2):
        x = torch.randn(T, K, device=dev).to(dt)
        dy = (torch.randn(T, N, device=dev) * 1e-3).to(dt)
        w_in = w.float().clone()
        s_in = [st.fp32().clone() if st is not None else None for st in states]
        hp = R.hparams(R.ADAMW, ADAM, step, {})
        sumsq = torch.zeros(1, device=dev)
        fused_wgrad_update(x, dy, w, states, spec, torch.tensor(hp, device=dev), sumsq,
                           seed=step, stochastic=True)
        torch.cuda.synchronize()
        w_ref, s_ref, g = materialized_step(x, dy, w_in, s_in, spec, hp, torch.float64)
        w_32, s_32, _ = materialized_step(x, dy, w_in, s_in, spec, hp, torch.float32)
        check_values(f"step {step} w", w, w_ref, float((w_32.double() - w_ref).abs().max()),
                     wfmt == "bf16")
        for i, st in enumerate(states):
            if st is None:
                continue
            base = float((s_32[i].double() - s_ref[i]).abs().max())
            if sfmt == "int8":
                check_int8(f"step {step} s{i}", st, s_ref[i], base)
            else:
                check_values(f"step {step} s{i}", st.data, s_ref[i], base, sfmt == "bf16")
        torch.testing.assert_close(sumsq.double(), (g * g).sum().reshape(1), rtol=1e-3, atol=0)


def test_cached_launch_matches_triton_launch(monkeypatch):
    """The second launch of a key skips Triton's argument binding (fused_update._launch) and
    must compute bitwise what Triton's own launch computes for the same inputs."""
    from forge_engine.kernels import fused_update as fu
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    dev = torch.device("cuda")
    T, N, K = 300, 200, 320  # no tile multiples
    spec = R.rule_spec(R.ADAMW, 0)
    w0 = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
    states0 = initial_state(spec, (N, K), "int8", dev)
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    dy = (torch.randn(T, N, device=dev) * 1e-3).to(torch.bfloat16)
    hp = torch.tensor(R.hparams(R.ADAMW, ADAM, 3, {}), device=dev)
    outs = []
    for cached in (False, True):
        w = w0.clone()
        states = [StateTensor(st.data.clone(), st.scale.clone(), st.nonneg) if st is not None
                  else None for st in states0]
        if cached:  # Triton's own launch path must not run now
            keys = len(fu._LAUNCHES)
            monkeypatch.setattr(fu._fused_wgrad_update_kernel, "run",
                                lambda *a, **k: pytest.fail("Triton's launch path ran"))
        else:
            fu._LAUNCHES.clear()
        fused_wgrad_update(x, dy, w, states, spec, hp, torch.zeros(1, device=dev), seed=7,
                           stochastic=True)
        torch.cuda.synchronize()
        outs.append((w, states))
    assert len(fu._LAUNCHES) == keys
    (wa, sa), (wb, sb) = outs
    assert torch.equal(wa, wb) and not torch.equal(wa, w0)
    for a, b in zip(sa, sb):
        if a is not None:
            assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)

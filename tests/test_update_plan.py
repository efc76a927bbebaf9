"""kernels.PlannedUpdate / fused_update.UpdatePlan: a weight's update with its unchanging
operands bound once must do exactly what fused_wgrad_update does with the same operands, for
every kind of call a training run makes (fresh segments each step, another sequence length,
an operand that is not 16-byte aligned, a materialized gradient, the first kind again), and
keep nothing of a call's tensors past the call.

Both run the same kernel with the same arguments, so the comparison is bitwise: a plan that
launched with a stale pointer, a stale shape or the wrong bound launch would differ (the
segments are fresh random values at every call). On CPU the Triton kernel interprets and the
bound launch substitutes its arguments; on CUDA (the gpu variant) it calls the compiled
launcher's C function with the arguments it expanded itself."""
import gc
import weakref

import pytest
import torch

from forge_engine.kernels import PlannedUpdate, StateTensor, clone_states, fused_wgrad_update
from forge_engine.kernels import rules as R

ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
N, K = 50, 70  # not multiples of any tile


def _states(spec, fmt, device):
    return [StateTensor.from_fp32(torch.rand(N, K, device=device) * 1e-3 + (1e-6 if s[1] else
                                                                             -5e-4),
                                  fmt, s[1]) if s is not None else None for s in spec.slots]


def _calls(dtype, device):
    """The kinds of call of a run, each with fresh random operands: (x, dy, grad)."""
    def dense(T, offset=0):
        buf = torch.randn(T * K + offset, device=device).to(dtype)
        x = buf[offset:].view(T, K)  # offset 1: x is not 16-byte aligned (no descriptor)
        return x, torch.randn(T, N, device=device).to(dtype) * 0.1, None
    yield dense(37)
    yield dense(37)  # the same kind: the bound launch with new tensors
    yield dense(19)  # another sequence length
    yield dense(37, offset=1)
    yield None, None, torch.randn(N, K, device=device)  # a materialized gradient alone
    yield dense(37)  # the first kind again


def _run(plan_it, wfmt, sfmt, device):
    torch.manual_seed(0)
    spec = R.rule_spec(R.ADAMW, 0)
    dtype = torch.float32 if wfmt == "fp32" else torch.bfloat16
    w = torch.randn(N, K, device=device).to(dtype)
    states = _states(spec, sfmt, device)
    w_ref, s_ref = w.clone(), clone_states(states)
    plan = PlannedUpdate(w, states, spec, seed=1234, stochastic=True)
    sums, sums_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    for step, (x, dy, grad) in enumerate(_calls(dtype, device), start=1):
        hp = R.set_seed_bits(torch.tensor(R.hparams(R.ADAMW, ADAM, step, {}),
                                          dtype=torch.float32), step * 7919).to(device)
        plan_it(plan, x, dy, hp, sums, grad)
        fused_wgrad_update(x, dy, w_ref, s_ref, spec, hp.clone(), sums_ref, 1234, True,
                           grad=grad)
        assert torch.equal(w, w_ref), f"call {step}: the weights differ"
        for i, (a, b) in enumerate(zip(states, s_ref)):
            if a is not None:
                assert torch.equal(a.data, b.data), f"call {step}: state {i} differs"
                if a.scale is not None:
                    assert torch.equal(a.scale, b.scale), f"call {step}: scales {i} differ"
        assert torch.equal(sums, sums_ref), f"call {step}: the squared norms differ"
    return plan


def _call(plan, x, dy, hp, sums, grad):
    plan(x, dy, hp, sums, grad)


@pytest.mark.parametrize("wfmt,sfmt", [("bf16", "bf16"), ("bf16", "int8"), ("fp32", "fp32")])
def test_plan_equals_fused_wgrad_update_bitwise(wfmt, sfmt, backend, device):
    _run(_call, wfmt, sfmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("sfmt", ["bf16", "int8"])
def test_plan_equals_fused_wgrad_update_bitwise_on_cuda(sfmt, monkeypatch):
    """The compiled launcher's own argument expansion is replaced on CUDA only: the same
    comparison there, the bound launches checked to take that path."""
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    plan = _run(_call, "bf16", sfmt, torch.device("cuda"))
    bound = [b for b in plan._triton._launches.values() if hasattr(b, "raw")]
    assert bound and all(b.raw is not None for b in bound)


def test_plan_keeps_no_tensor_of_a_call(backend, device):
    """A bound launch must not hold a call's segments (an activation per weight kept alive
    until the next step) or its hyperparameter and norm tensors."""
    refs = []

    def call(plan, x, dy, hp, sums, grad):
        plan(x, dy, hp, sums, grad)
        refs.extend(weakref.ref(t) for t in (x, dy, grad, hp) if t is not None)

    _run(call, "bf16", "bf16", device)
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_plan_binds_its_weight_states_and_seed():
    spec = R.rule_spec(R.ADAMW, 0)
    w = torch.randn(N, K)
    states = _states(spec, "fp32", "cpu")
    refs = tuple(st.data for st in states if st is not None)
    plan = PlannedUpdate(w, states, spec, 7, True, refs)
    assert plan.binds(w.detach(), refs, 7)  # a new view of the same memory
    assert not plan.binds(w.clone(), refs, 7)  # replaced .data
    assert not plan.binds(w.t().contiguous().t(), refs, 7)
    assert not plan.binds(w, (refs[0].clone(), refs[1]), 7)  # a loaded state
    assert not plan.binds(w, refs, 8)


@pytest.mark.gpu
def test_plan_reuses_a_descriptor_only_at_its_address_on_cuda(monkeypatch):
    """A bound launch keeps the tensor descriptors it encoded by the segment's address (a
    training loop's activations come back at a few addresses): segments alternating between
    addresses, more of them than it keeps, fresh values at every call, bitwise as
    fused_wgrad_update. A descriptor of another address would read other values."""
    from forge_engine.kernels.launch import BoundLaunch
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n, k, t = 56, 72, 40  # rows of 16 bytes (descriptors), no multiple of a tile
    spec = R.rule_spec(R.ADAMW, 0)
    w = torch.randn(n, k, device=dev).to(torch.bfloat16)
    states = [StateTensor.from_fp32(torch.rand(n, k, device=dev) * 1e-3, "bf16", s[1])
              if s is not None else None for s in spec.slots]
    w_ref, s_ref = w.clone(), clone_states(states)
    plan = PlannedUpdate(w, states, spec, seed=99, stochastic=True)
    sums, sums_ref = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    bufs = [(torch.empty(t, k, device=dev, dtype=torch.bfloat16),
             torch.empty(t, n, device=dev, dtype=torch.bfloat16))
            for _ in range(BoundLaunch.ENCODED + 2)]
    order = [0, 1, 0, 1, *range(len(bufs)), 1, 0, 1]
    for step, i in enumerate(order, start=1):
        x, dy = bufs[i]
        x.copy_(torch.randn(t, k, device=dev))
        dy.copy_(torch.randn(t, n, device=dev) * 0.1)
        hp = R.set_seed_bits(torch.tensor(R.hparams(R.ADAMW, ADAM, step, {}),
                                          dtype=torch.float32), step * 7919).to(dev)
        plan(x, dy, hp, sums)
        fused_wgrad_update(x, dy, w_ref, s_ref, spec, hp.clone(), sums_ref, 99, True)
        assert torch.equal(w, w_ref), f"call {step} (buffer {i}): the weights differ"
        assert torch.equal(sums, sums_ref), f"call {step}: the squared norms differ"
    bound = [b for b in plan._triton._launches.values() if getattr(b, "raw", None)]
    assert bound and all(b.blocks for b in bound), "the launch took no descriptors"


@pytest.mark.gpu
@pytest.mark.parametrize("sfmt", ["bf16", "int8"])
def test_plan_binds_the_warp_specialized_launch_on_cuda(sfmt, monkeypatch):
    """Above WS_AUTO_TOKENS tokens the split Gluon kernel takes the update, and the plan
    binds its launch as it binds the Triton kernel's: W's and the states' descriptors once,
    the segments' by address. Bitwise as fused_wgrad_update (the Gluon launch checked anew)
    over fresh values, alternating addresses, another token count and a segment that is not
    16-byte aligned (the Triton kernel's route)."""
    from forge_engine.kernels import fused_update as fu
    from forge_engine.kernels import fused_ws
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    monkeypatch.setattr(fu, "_WS_FLAG", "auto")
    monkeypatch.setattr(fu, "_WS_SPLIT", "auto")
    monkeypatch.setattr(fu, "_WS_LARGE", None)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n, k = 200, 272  # int8 code rows of 16 bytes; no multiple of a tile
    spec = R.rule_spec(R.ADAMW, 0)
    w = torch.randn(n, k, device=dev).to(torch.bfloat16)
    states = [StateTensor.from_fp32(torch.rand(n, k, device=dev) * 1e-3, sfmt, s[1])
              if s is not None else None for s in spec.slots]
    w_ref, s_ref = w.clone(), clone_states(states)
    plan = PlannedUpdate(w, states, spec, seed=5, stochastic=True)
    sums, sums_ref = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    t1, t2 = fu.WS_AUTO_TOKENS + 76, fu.WS_AUTO_TOKENS + 277
    bufs = {t: [(torch.empty(t * k + 1, device=dev, dtype=torch.bfloat16),
                 torch.empty(t, n, device=dev, dtype=torch.bfloat16)) for _ in range(2)]
            for t in (t1, t2)}
    calls = [(t1, 0, 0), (t1, 1, 0), (t1, 0, 0), (t2, 0, 0), (t1, 1, 1), (t1, 1, 0)]
    for step, (t, i, offset) in enumerate(calls, start=1):
        flat, dy = bufs[t][i]
        x = flat[offset:offset + t * k].view(t, k)
        x.copy_(torch.randn(t, k, device=dev))
        dy.copy_(torch.randn(t, n, device=dev) * 0.1)
        hp = R.set_seed_bits(torch.tensor(R.hparams(R.ADAMW, ADAM, step, {}),
                                          dtype=torch.float32), step * 7919).to(dev)
        sums.zero_(), sums_ref.zero_()
        plan(x, dy, hp, sums)
        fused_wgrad_update(x, dy, w_ref, s_ref, spec, hp.clone(), sums_ref, 5, True)
        assert torch.equal(w, w_ref), f"call {step}: the weights differ"
        for j, (a, b) in enumerate(zip(states, s_ref)):
            if a is not None:
                assert torch.equal(a.data, b.data), f"call {step}: state {j} differs"
                if a.scale is not None:
                    assert torch.equal(a.scale, b.scale), f"call {step}: scales {j} differ"
        # the kernel's programs add their tiles' norms atomically, in an order that varies
        # from launch to launch: a sum of m positive fp32 terms in any order is within
        # g = (m - 1) 2^-24 / (1 - (m - 1) 2^-24) of the exact one (Higham), so two orders
        # differ by at most 2 g / (1 - g); m: the tiles at the split design's smallest
        g = (-(-n // 64) * -(-k // 128) - 1) * 2.0 ** -24
        g = g / (1 - g)
        assert abs(float(sums) - float(sums_ref)) <= 2 * g / (1 - g) * float(sums_ref), \
            f"call {step}: the squared norms differ"
    kernels = [b.kernel for b in plan._triton._launches.values()]
    assert kernels.count(fused_ws._ws_split_kernel) == 2  # t1 and t2; offset 1: Triton's
    assert all(b.raw is not None for b in plan._triton._launches.values())


def test_plan_norm_parts_sum_to_the_norm_only_pass_bitwise(backend, device):
    """plan.norm writes the norm-only pass's parts where the caller says (Clipping batches a
    step's weights: GradPolicyMixin._measure): their sum in one order is what
    fused_wgrad_update(norm_only=True) adds, bitwise, for every kind of dense call; nothing
    past norm_tiles parts and nothing of w or its states is written; a parts tensor too short
    is refused before any launch; no tensor of a call is kept."""
    torch.manual_seed(0)
    spec = R.rule_spec(R.ADAMW, 0)
    w = torch.randn(N, K, device=device).to(torch.bfloat16)
    states = _states(spec, "int8", device)
    w0, s0 = w.clone(), clone_states(states)
    plan = PlannedUpdate(w, states, spec, seed=3, stochastic=True)
    hp = torch.zeros(R.HP_LEN, device=device)
    refs = []
    for step, (x, dy, grad) in enumerate(_calls(torch.bfloat16, device), start=1):
        if x is None:  # (a materialized gradient has no norm-only pass: its own norm)
            continue
        tiles = plan.norm_tiles(x, dy)
        parts = torch.full((tiles + 5,), float("nan"), device=device)
        plan.norm(x, dy, parts)
        ref = torch.zeros(1, device=device)
        fused_wgrad_update(x, dy, w0.clone(), clone_states(s0), spec, hp, ref, 0, False,
                           norm_only=True)
        assert torch.equal(parts[:tiles].sum().reshape(1), ref), f"call {step}"
        assert parts[tiles:].isnan().all(), f"call {step}: wrote past its parts"
        with pytest.raises(ValueError, match="norm parts: need"):
            plan.norm(x, dy, torch.zeros(tiles - 1, device=device) if tiles > 1 else
                      torch.zeros(4, dtype=torch.float64, device=device))
        refs.extend(weakref.ref(t) for t in (x, dy, parts))
    assert torch.equal(w, w0)
    for a, b in zip(states, s0):
        if a is not None:
            assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
    del x, dy, grad, parts
    gc.collect()
    assert refs and all(r() is None for r in refs)

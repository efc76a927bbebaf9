"""The fused kernel (both backends) against "materialize dW in float64, then step in float64".

The float64 step is tests/ref64.py: the optimizers' published algorithms with their own
per-step scalars, independent of forge_engine.optim.rules (whose update rules and hparams the
kernel and the torch backend share), so a wrong rule or a wrong folding of the
hyperparameters fails here, not only in the torch.optim parity tests.

Every case runs 3 consecutive steps on fresh random inputs; each step is checked against the
float64 reference started from the kernel's own (dequantized) state before that step, so every
element of w and of every state must have been written correctly at every step (an element left
unwritten keeps its old value, which differs from the reference's).

Tolerances, per quantity (base = max error of the same computation done by torch in fp32, i.e.
dW by a torch fp32 GEMM then ref64's step in fp32, against float64; it measures how much fp32
rounding of the token-axis sum legitimately moves the result for this very input; in the main
test, the largest over three token orders, see fp32_bases. The base comes from ref64 too: from
the code under test, a wrong rule would widen its own tolerance by its own error):
  fp32 values           max|ours - ref| <= 2 base + 2 ulp_fp32(max|ref|)  (order of summation;
                        the rule's own few fp32 roundings)
  bf16 values (w or s)  |ours - ref| <= ulp_bf16(|ref| + 2 base) + 2 base (one of the 2
                        neighbours: stochastic rounding never goes further; the spacing is
                        taken at |ref| + 2 base because the fp32 value may lie in the binade
                        above ref's; a 5.6e-8 excess seen once on the H200 fits this case,
                        which the failure message could not confirm)
  int8 signed states    |u(deq) - u(ref)| <= scale / 2 + sqrt(2 base), u(x) = sign(x) sqrt|x|
                        (the stored code is u: round to nearest)
  int8 nonnegative      |sqrt(deq) - sqrt(ref)| <= scale / 2 + sqrt(2 base), or <= scale where
                        the code was raised to 1 (a nonzero value is never stored as 0)
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from forge_engine.kernels import StateTensor, clone_states, fused_wgrad_update
from forge_engine.kernels import quant
from forge_engine.kernels.quant import QBLOCK, round_codes as _codes
from forge_engine.kernels import rules as R
import ref64

ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
RULES = {
    "sgd": (R.SGD, 0, dict(lr=1e-1, weight_decay=0.1)),
    "sgd_momentum": (R.SGD_MOMENTUM, 0, dict(lr=1e-1, momentum=0.9, dampening=0.0,
                                             nesterov=True, weight_decay=0.0)),
    "adamw": (R.ADAMW, 0, ADAM),
    "adamw_amsgrad": (R.ADAMW, R.AMSGRAD, ADAM),
    "nadam": (R.NADAM, 0, dict(ADAM, momentum_decay=4e-3, decoupled_weight_decay=False)),
    # beta2 0.9: rho_t crosses 5 between steps 5 and 6 (FIRST_STEP), both branches are run
    "radam": (R.RADAM, 0, dict(ADAM, betas=(0.9, 0.9), decoupled_weight_decay=True)),
    "lion": (R.LION, 0, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
    "rmsprop_centered_momentum": (R.RMSPROP, R.RMS_MOMENTUM | R.RMS_CENTERED,
                                  dict(lr=1e-3, alpha=0.99, eps=1e-8, momentum=0.9,
                                       weight_decay=0.0)),
    # slots 0 and 2 with slot 1 empty: kernels must take the states by slot, not packed
    "rmsprop_centered": (R.RMSPROP, R.RMS_CENTERED,
                         dict(lr=1e-3, alpha=0.9, eps=1e-8, momentum=0.0, weight_decay=0.01)),
    "adagrad": (R.ADAGRAD, 0, dict(lr=1e-2, lr_decay=0.01, eps=1e-10, weight_decay=0.0)),
}
# the optimizer of ref64 and the torch.optim options that RULES' kernel variants stand for
REF = {"sgd": ("sgd", {}), "sgd_momentum": ("sgd", {}), "adamw": ("adamw", {}),
       "adamw_amsgrad": ("adamw", dict(amsgrad=True)), "nadam": ("nadam", {}),
       "radam": ("radam", {}), "lion": ("lion", {}),
       "rmsprop_centered_momentum": ("rmsprop", dict(centered=True)),
       "rmsprop_centered": ("rmsprop", dict(centered=True)), "adagrad": ("adagrad", {})}
FIRST_STEP = {"radam": 5}  # the main test's steps are FIRST_STEP, +1, +2 (default 1)
# per step of the main test: the clipping factor hp[GRAD_SCALE] (1 = no clipping)
GRAD_SCALES = (1.0, 0.37, 1.0)
# (weight dtype, state format)
FORMATS = [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "int8"), ("fp32", "int8"),
           ("fp32", "bf16")]
SHAPES = [(45, 37, 70), (70, 64, 130), (3, 1, 5)]  # (T, N, K); none needs to fit a tile
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ulp_bf16(x):
    _, e = torch.frexp(x.abs().double())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


def initial_state(spec, shape, fmt, device="cpu"):
    """Random, type-consistent state values (never zeros: zeros hide unwritten outputs)."""
    out = []
    vals = {}
    for slot in spec.slots:
        if slot is None:
            out.append(None)
            continue
        name, nonneg = slot
        if name == "grad_avg":
            v = torch.randn(shape) * 0.01
        elif nonneg:
            v = torch.rand(shape) * 1e-3 + 1e-6
        else:
            v = torch.randn(shape) * 0.05
        vals[name] = v
        out.append(v)
    if "max_exp_avg_sq" in vals:
        out[2] = vals["exp_avg_sq"] + torch.rand(shape) * 1e-3
    if "grad_avg" in vals:
        out[0] = out[0] + vals["grad_avg"] ** 2
    return [StateTensor.from_fp32(v.to(device), fmt, s[1]) if v is not None else None
            for v, s in zip(out, spec.slots)]


def reference(rule, step, x, dy, w_in, s_in, dtype=torch.float64, onehot=None, grad=None,
              grad_scale=1.0):
    """ref64's step of RULES[rule] at 1-based `step` on dW = dy^T x (+ onehot(ids)^T e)
    (+ grad), from w_in and the slot states s_in (fp32 values, None where unused), in dtype.
    Slots are handed to ref64 by the torch state name rule_spec gives them (a slot mix-up in
    the kernel shows). Returns (w, states by slot, the unscaled gradient)."""
    kind, variant, group = RULES[rule]
    name, extra = REF[rule]
    spec = R.rule_spec(kind, variant)
    g = ref64.gradient(w_in.shape, x, dy, onehot, grad, dtype)
    named = {sl[0]: s.to(dtype) for sl, s in zip(spec.slots, s_in) if sl is not None}
    w, named = ref64.step(name, dict(group, **extra), step, w_in.to(dtype), g, named,
                          grad_scale)
    return w, [named[sl[0]] if sl is not None else None for sl in spec.slots], g


def fp32_bases(x, dy, w_in, s_in, rule, step, w_ref, s_ref, grad_scale=1.0):
    """base for w and each state: the largest error against float64 of torch's fp32 step over
    three token orders (as given, reversed, shuffled). The kernel sums the tokens in yet another
    order; under cancellation (centered RMSprop's v - avg^2) one order's worst element can err
    2.8x another's (seen once in 15 runs with the given order alone), so one order is too
    small a sample of fp32's spread."""
    T = x.shape[0]
    base_w, base_s = 0.0, [0.0] * len(s_in)
    for order in (None, torch.arange(T - 1, -1, -1), torch.randperm(T)):
        xo, dyo = (x, dy) if order is None else (x[order.to(x.device)], dy[order.to(x.device)])
        w_32, s_32, _ = reference(rule, step, xo, dyo, w_in, s_in, torch.float32,
                                  grad_scale=grad_scale)
        base_w = max(base_w, float((w_32.double() - w_ref).abs().max()))
        for i, s in enumerate(s_32):
            if s is not None:
                base_s[i] = max(base_s[i], float((s.double() - s_ref[i]).abs().max()))
    return base_w, base_s


def check_values(name, ours, ref, base, is_bf16):
    err = (ours.double() - ref).abs()
    if is_bf16:
        # our fp32 value v lies within 2 base of ref and is rounded to one of ITS two bf16
        # neighbours; v may sit above a power of two that ref is just below, where the bf16
        # spacing is twice ref's: hence the spacing at |ref| + 2 base
        bound = ulp_bf16(ref.abs() + 2 * base) + 2 * base + 1e-30
        bad = err > bound
        assert not bad.any(), (f"{name}: {int(bad.sum())} elements off by more than one bf16 "
                               f"ulp; worst {float((err - bound).max()):.3e}")
    else:
        # + 4 half-ulps at the largest magnitude: the rule's own few fp32 roundings, which the
        # fp32 baseline may happen to avoid on a small input (seen with T=3)
        bound = 2 * base + 4 * 2.0 ** -24 * float(ref.abs().max())
        assert err.max() <= bound, f"{name}: max error {err.max():.3e}, base {base:.3e}"


def check_int8(name, st, ref, base):
    n, k = ref.shape
    scale = st.scale.double().repeat_interleave(QBLOCK, dim=1)[:, :k]
    deq = st.fp32().double()
    if st.nonneg:
        refu, ours = ref.clamp(min=0).sqrt(), deq.sqrt()
        raised = st.data == 1
        bound = torch.where(raised, scale, scale / 2) + math.sqrt(2 * base) + 1e-12
        err = (ours - refu).abs()
        qmax, absref = 255.0, refu
    else:  # signed square root codes: half a quantum of u = sign(x) sqrt(|x|)
        refu, ours = ref.sign() * ref.abs().sqrt(), deq.sign() * deq.abs().sqrt()
        bound = scale / 2 + math.sqrt(2 * base) + 1e-12
        err = (ours - refu).abs()
        qmax, absref = 127.0, refu.abs()
    bad = err > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} int8 elements outside half a quantum"
    # the stored scale is the block absmax / qmax of the (reference) values
    pad = (-k) % QBLOCK
    amax = torch.nn.functional.pad(absref, (0, pad)).view(n, -1, QBLOCK).amax(dim=2)
    torch.testing.assert_close(st.scale.double() * qmax, amax, rtol=1e-5,
                               atol=2 * math.sqrt(base) + 1e-12)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("wfmt,sfmt", FORMATS, ids=lambda f: f)
@pytest.mark.parametrize("rule", list(RULES))
def test_fused_step_matches_float64(rule, wfmt, sfmt, shape, backend, device):
    kind, variant, group = RULES[rule]
    spec = R.rule_spec(kind, variant)
    T, N, K = shape
    dt = DT[wfmt]
    w = (torch.randn(N, K) * 0.5).to(device, dt)
    states = initial_state(spec, (N, K), sfmt, device)
    scalars = {}
    first = FIRST_STEP.get(rule, 1)
    for step in range(1, first):  # NAdam's host scalars before the first step taken here
        R.hparams(kind, group, step, scalars)
    for step, scale in zip(range(first, first + 3), GRAD_SCALES):
        x = torch.randn(T, K).to(device, dt)
        dy = (torch.randn(T, N) * 0.1).to(device, dt)
        w_in = w.float().clone()
        s_in = [st.fp32().clone() if st is not None else None for st in states]
        hp = R.hparams(kind, group, step, scalars, scale)
        sumsq = torch.full((1,), 0.25, device=device)
        fused_wgrad_update(x, dy, w, states, spec, torch.tensor(hp, device=device),
                           sumsq, seed=1000 + step, stochastic=True)
        w_ref, s_ref, g = reference(rule, step, x, dy, w_in, s_in, grad_scale=scale)
        base_w, base_s = fp32_bases(x, dy, w_in, s_in, rule, step, w_ref, s_ref, scale)
        check_values(f"step {step} w", w, w_ref, base_w, wfmt == "bf16")
        for i, st in enumerate(states):
            if st is None:
                continue
            base = base_s[i]
            label = f"step {step} state {spec.slots[i][0]}"
            if sfmt == "int8":
                check_int8(label, st, s_ref[i], base)
            else:
                check_values(label, st.data, s_ref[i], base, sfmt == "bf16")
        # the norm of the gradient the rule applied: scale * g (0.25: added to, not set)
        torch.testing.assert_close(sumsq.double(), 0.25 + scale ** 2 * (g * g).sum().reshape(1),
                                   rtol=1e-4, atol=0)  # fp32 sum of N*K <= 8320 squares


def test_strided_and_broadcast_operands(backend, device):
    """x as a transposed view, dy with a zero stride (the gradient of a .sum())."""
    spec = R.rule_spec(R.ADAMW, 0)
    N, K, T = 33, 65, 40
    x = torch.randn(K, T, device=device).t()
    dy = torch.randn(1, N, device=device).expand(T, N)
    w = torch.randn(N, K, device=device)
    states = initial_state(spec, (N, K), "fp32", device)
    s_in = [st.fp32().clone() if st is not None else None for st in states]
    hp = R.hparams(R.ADAMW, ADAM, 1, {})
    w_ref, _, _ = reference("adamw", 1, x, dy, w, s_in)
    w_32, _, _ = reference("adamw", 1, x, dy, w, s_in, torch.float32)
    fused_wgrad_update(x, dy, w, states, spec, torch.tensor(hp, device=device),
                       torch.zeros(1, device=device), 7, False)
    check_values("w", w, w_ref, float((w_32.double() - w_ref).abs().max()), False)


@pytest.mark.parametrize("K", [130, 132], ids=["unaligned", "aligned"])
def test_nonfinite_gradient_is_not_written(K, backend, device):
    """Elements whose gradient is NaN/inf keep their weight and states; the norm says so.
    K = 132: fp32 rows of 528 bytes, so the token tiles come through tensor descriptors."""
    spec = R.rule_spec(R.ADAMW, 0)
    N, T = 40, 20
    x = torch.randn(T, K, device=device)
    x[3, 100] = float("nan")  # dW[:, 100] is NaN for every row
    dy = torch.randn(T, N, device=device)
    w = torch.randn(N, K, device=device)
    states = initial_state(spec, (N, K), "fp32", device)
    w0, m0 = w.clone(), states[0].data.clone()
    sumsq = torch.zeros(1, device=device)
    hp = torch.tensor(R.hparams(R.ADAMW, ADAM, 1, {}), device=device)
    fused_wgrad_update(x, dy, w, states, spec, hp, sumsq, 3, False)
    assert not torch.isfinite(sumsq).all()
    assert torch.equal(w[:, 100], w0[:, 100]) and torch.equal(states[0].data[:, 100], m0[:, 100])
    assert torch.isfinite(w).all() and torch.isfinite(states[0].data).all()


@pytest.mark.parametrize("K", [70, 72], ids=["unaligned", "aligned"])
def test_poisoned_window_is_fully_written_and_nothing_outside(K, backend, device):
    """w is a strided window of a NaN-poisoned bf16 buffer: every element inside must come out
    finite (written from finite inputs), every element outside must stay NaN (never written).
    K = 72: x's rows are 16-byte aligned too, so the token tiles come through tensor descriptors."""
    N, T = 40, 33  # N not a tile multiple; dy rows of 80 bytes: aligned
    buf = torch.full((N + 2, K + 64), float("nan"), device=device, dtype=torch.bfloat16)
    w = buf[1:N + 1, 32:32 + K]
    w.copy_(torch.randn(N, K, device=device))
    spec = R.rule_spec(R.SGD_MOMENTUM, 0)
    group = dict(lr=1e-2, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0)
    hp = torch.tensor(R.hparams(R.SGD_MOMENTUM, group, 1, {}), device=device)
    # step 1 computes buf = 0 * buf + g: a NaN-poisoned buffer would leak in, so it starts at 0
    states = [StateTensor(torch.zeros(N, K, device=device), None, False), None, None]
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=device, dtype=torch.bfloat16)
    fused_wgrad_update(x, dy, w, states, spec, hp, torch.zeros(1, device=device), 1, True)
    assert torch.isfinite(w).all() and torch.isfinite(states[0].data).all()
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[1:N + 1, 32:32 + K] = False
    assert torch.isnan(buf[outside].float()).all()


# (BLOCK_K, DESC, EPI_SPLIT, PERSISTENT): token tiles by pointers or tensor descriptors, the
# epilogue whole or in column halves / quarters, one program per tile or persistent programs
# (4 under the interpreter) walking several tiles each. BLOCK_K 256 > K = 144: the last quarter
# lies wholly right of K (its int8 scale column would be the next row's).
VARIANTS = [(64, False, 1, False), (64, True, 1, False), (64, True, 2, False),
            (128, True, 2, False), (256, False, 2, False), (256, True, 4, False),
            (64, True, 1, True), (128, True, 2, True)]


@pytest.mark.parametrize("wfmt,sfmt", [("bf16", "bf16"), ("bf16", "int8"), ("fp32", "fp32")],
                         ids=lambda f: f)
def test_kernel_variants_agree_bitwise(wfmt, sfmt, device, monkeypatch):
    """Every way of loading the token tiles, of splitting the epilogue and of handing tiles to
    programs computes the same step: the same gradient tile sums (same BLOCK_T), the same rule
    per element, the same random bits per element. Under the interpreter w and every state
    (codes and scales) agree bitwise with the first variant of the same BLOCK_K, and each
    BLOCK_K's first variant is checked against float64: the interpreter's dot is numpy's
    matmul, whose BLAS may sum a product of another width in another order (1-ulp
    differences in a few elements between BLOCK_K 64 and 128, numpy 2.2.6 on a 2-core
    machine of the CI's kind, 2026-11-30); compiled, every variant is checked against float64
    (multiply-add contraction may differ by variant). Shapes: rows 16-byte aligned (descriptors apply) but no dimension a tile
    multiple; a stale write to a neighbouring row or scale column shows as a mismatch (it is
    order dependent, so a reference run would not catch it alone)."""
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    from forge_engine.kernels.fused_update import fused_wgrad_update as triton_impl
    from forge_engine.kernels.fused_update import tma_capable
    spec = R.rule_spec(R.ADAMW, 0)
    T, N, K = 45, 40, 144
    dt = DT[wfmt]
    w0 = (torch.randn(N, K) * 0.5).to(device, dt)
    states0 = initial_state(spec, (N, K), sfmt, device)
    x = torch.randn(T, K).to(device, dt)
    dy = (torch.randn(T, N) * 0.1).to(device, dt)
    assert tma_capable(x) and tma_capable(dy)
    hp = R.hparams(R.ADAMW, ADAM, 2, {})
    hpt = torch.tensor(hp, device=device)
    results = []
    for bk, desc, split, persistent in VARIANTS:
        if sfmt == "int8" and (bk // split) % QBLOCK:
            continue
        w = w0.clone()
        states = clone_states(states0)
        sumsq = torch.zeros(1, device=device)
        cfg = dict(BLOCK_T=32, BLOCK_N=32, BLOCK_K=bk, GROUP_N=2, num_warps=4, num_stages=2,
                   DESC=desc, EPI_SPLIT=split, PERSISTENT=persistent)
        triton_impl(x, dy, w, states, spec, hpt, sumsq, 11, True, cfg)
        results.append(((bk, desc, split, persistent), w, states, sumsq))
    assert len(results) >= 4
    s_in = [st.fp32() if st is not None else None for st in states0]
    w_ref, s_ref, _ = reference("adamw", 2, x, dy, w0.float(), s_in)
    w_32, s_32, _ = reference("adamw", 2, x, dy, w0.float(), s_in, torch.float32)

    def check_float64(name, w, states):
        check_values(f"{name} w", w, w_ref, float((w_32.double() - w_ref).abs().max()),
                     wfmt == "bf16")
        for i, st in enumerate(states[:2]):
            base = float((s_32[i].double() - s_ref[i]).abs().max())
            if sfmt == "int8":
                check_int8(f"{name} state {i}", st, s_ref[i], base)
            else:
                check_values(f"{name} state {i}", st.data, s_ref[i], base, sfmt == "bf16")

    (name0, w_a, st_a, sq_a) = results[0]
    check_float64(name0, w_a, st_a)
    first = {}  # BLOCK_K -> its first variant's results
    for name, w, states, sumsq in results:
        first.setdefault(name[0], (name, w, states))
    assert all(len([r for r in results if r[0][0] == bk]) >= 2 for bk in first)
    for name, w, states, sumsq in results[1:]:
        if device.type == "cpu":  # the interpreter: the same dot width rounds alike
            name_b, w_b, st_b = first[name[0]]
            if name_b == name:  # a BLOCK_K's first variant: against float64
                check_float64(name, w, states)
            else:
                assert torch.equal(w, w_b), f"{name}: w differs from {name_b}"
                for i in (0, 1):
                    assert torch.equal(states[i].data, st_b[i].data), \
                        f"{name}: state {i} differs from {name_b}"
                    if sfmt == "int8":
                        assert torch.equal(states[i].scale, st_b[i].scale), \
                            f"{name}: scales differ from {name_b}"
        else:  # compiled: each variant contracts multiply-adds its own way; each must still
            # be within the float64 bounds (a stale write to a neighbour's scale fails these)
            check_float64(name, w, states)
        # only the order of the fp32 sum of squares may differ (another BLOCK_K)
        torch.testing.assert_close(sumsq, sq_a, rtol=1e-5, atol=0)


def test_descriptor_and_split_arguments_are_checked(device, monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    from forge_engine.kernels.fused_update import fused_wgrad_update as triton_impl
    spec = R.rule_spec(R.ADAMW, 0)
    hp = torch.tensor(R.hparams(R.ADAMW, ADAM, 1, {}), device=device)
    w = torch.randn(8, 70, device=device)
    states = initial_state(spec, (8, 70), "int8", device)
    x, dy = torch.randn(5, 70, device=device), torch.randn(5, 8, device=device)
    cfg = dict(BLOCK_T=32, BLOCK_N=32, BLOCK_K=128, GROUP_N=2, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="DESC=True needs"):  # rows of 280 bytes: unaligned
        triton_impl(x, dy, w, states, spec, hp, torch.zeros(1, device=device), 1, False,
                    dict(cfg, DESC=True))
    with pytest.raises(ValueError, match="BLOCK_K / EPI_SPLIT a multiple of 64"):
        triton_impl(x, dy, w, states, spec, hp, torch.zeros(1, device=device), 1, False,
                    dict(cfg, EPI_SPLIT=4))
    with pytest.raises(ValueError, match="PERSISTENT=True needs"):  # unaligned: no DESC
        triton_impl(x, dy, w, states, spec, hp, torch.zeros(1, device=device), 1, False,
                    dict(cfg, PERSISTENT=True))
    with pytest.raises(ValueError, match="EPI_SPLIT must be 1, 2 or 4"):
        triton_impl(x, dy, w, states, spec, hp, torch.zeros(1, device=device), 1, False,
                    dict(cfg, EPI_SPLIT=3))


def test_bad_arguments_are_rejected():
    spec = R.rule_spec(R.SGD, 0)
    hp = torch.tensor(R.hparams(R.SGD, dict(lr=0.1, weight_decay=0.0), 1, {}))
    w = torch.randn(4, 5)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_wgrad_update(torch.randn(3, 6), torch.randn(3, 4), w, [None] * 3, spec, hp,
                           torch.zeros(1), 0, False)
    with pytest.raises(ValueError, match="dtype"):
        from forge_engine.kernels.fused_update import fused_wgrad_update as triton_impl
        triton_impl(torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 4), w, [None] * 3,
                    spec, hp, torch.zeros(1), 0, False)


def segment_step(w, states, seed, step=1, x=None, dy=None, onehot=None, grad=None):
    """One AdamW step (ADAM at `step`, stochastic rounding) of w with the given segments (a
    dense one x, dy; a one-hot one (ids, e); a materialized gradient), and its references:
    returns sumsq, the float64 step (w, states, gradient) and the fp32 step's (w, states)."""
    spec = R.rule_spec(R.ADAMW, 0)
    w_in = w.float().clone()
    s_in = [st.fp32().clone() if st is not None else None for st in states]
    hp = R.hparams(R.ADAMW, ADAM, step, {})
    sumsq = torch.zeros(1, device=w.device)
    fused_wgrad_update(x, dy, w, states, spec, torch.tensor(hp, device=w.device), sumsq, seed,
                       True, onehot=onehot, grad=grad)
    ref = reference("adamw", step, x, dy, w_in, s_in, onehot=onehot, grad=grad)
    w_32, s_32, _ = reference("adamw", step, x, dy, w_in, s_in, torch.float32, onehot=onehot,
                              grad=grad)
    return sumsq, ref, (w_32, s_32)


def onehot_step(w, states, ids, e, seed, x=None, dy=None):
    """segment_step at step 1 with the one-hot segment (ids, e), after a dense one if given."""
    return segment_step(w, states, seed, 1, x, dy, onehot=(ids, e))


@pytest.mark.parametrize("dense", [False, True], ids=["embedding", "tied"])
@pytest.mark.parametrize("wfmt", ["fp32", "bf16"])
def test_onehot_segment_matches_float64(dense, wfmt, backend, device):
    """An embedding's gradient onehot(ids)^T dE generated inside the kernel (ids of -1 belong
    to another rank's rows), alone or after a dense segment (the tied LM head)."""
    spec = R.rule_spec(R.ADAMW, 0)
    N, K, T, T1 = 67, 70, 20, 53
    dt = DT[wfmt]
    w = (torch.randn(N, K) * 0.5).to(device, dt)
    states = initial_state(spec, (N, K), "fp32", device)
    ids = torch.randint(-1, N, (T1,), device=device)
    ids[:5] = 3  # a repeated token accumulates
    e = torch.randn(T1, K, device=device).to(dt)
    x = torch.randn(T, K, device=device).to(dt) if dense else None
    dy = (torch.randn(T, N, device=device) * 0.1).to(dt) if dense else None
    sumsq, (w_ref, s_ref, g), (w_32, s_32) = onehot_step(w, states, ids, e, 5, x, dy)
    check_values("w", w, w_ref, float((w_32.double() - w_ref).abs().max()), wfmt == "bf16")
    check_values("m", states[0].data, s_ref[0], float((s_32[0].double() - s_ref[0]).abs().max()),
                 False)
    torch.testing.assert_close(sumsq.double(), (g * g).sum().reshape(1), rtol=1e-4, atol=0)


def _sparse_ids(N, T1, device):
    """ids of an embedding's tokens that leave most row tiles and most token blocks without a
    hit: runs of a few rows, -1 (another rank's rows) and the last row (a partial tile)."""
    ids = torch.full((T1,), -1, dtype=torch.int64)  # tokens 60 to 95: -1
    ids[:40] = 40 + torch.arange(40) % 7  # rows 40 to 46: one row tile (32 or 64 rows)
    ids[40:60] = N - 1
    ids[96:] = torch.randint(200, 210, (T1 - 96,))
    return ids.to(device)


@pytest.mark.parametrize("T1", [0, 1, 97])
def test_onehot_index_lists_each_tiles_tokens_in_token_order(T1):
    """_onehot_index (the kernel's view of an embedding's tokens): per tile of block_n rows,
    exactly the tokens whose id is one of its rows, in token order within a row; -1 in no
    tile; ids on tile boundaries; no tokens at all."""
    from forge_engine.kernels.fused_update import onehot_index as _onehot_index
    N, bn = 130, 32
    num_n = -(-N // bn)
    ids = torch.randint(-1, N, (T1,))
    if T1 > 2:
        ids[:3] = torch.tensor([31, 32, 31])  # a boundary, and a row seen twice
    index = _onehot_index(ids, num_n, bn)
    assert index.dtype == torch.int64 and index.shape == (2 * T1 + num_n + 1,)
    sids, order, bounds = index[:T1], index[T1:2 * T1], index[2 * T1:]
    assert torch.equal(sids, ids[order])
    for i in range(num_n):
        mine = [t for t in range(T1) if i * bn <= int(ids[t]) < (i + 1) * bn]
        got = order[bounds[i]:bounds[i + 1]].tolist()
        assert sorted(got, key=lambda t: (int(ids[t]), t)) == got  # by row, then token
        assert sorted(got) == mine
    assert int(bounds[-1]) == T1


@pytest.mark.parametrize("wfmt", ["fp32", "bf16"])
def test_onehot_segment_tiles_without_tokens(wfmt, backend, device):
    """Each tile reads only its own tokens: tiles without a token, runs of -1, a partial last
    block of tokens, the last (partial) row tile. The same step as float64's."""
    spec = R.rule_spec(R.ADAMW, 0)
    N, K, T1 = 301, 70, 117
    dt = DT[wfmt]
    w = (torch.randn(N, K) * 0.5).to(device, dt)
    states = initial_state(spec, (N, K), "fp32", device)
    ids = _sparse_ids(N, T1, device)
    e = torch.randn(T1, K, device=device).to(dt)
    sumsq, (w_ref, s_ref, g), (w_32, s_32) = onehot_step(w, states, ids, e, 5)
    assert (g[:100].abs().sum(1) > 0).sum() == 7  # most rows' gradient is zero: still stepped
    check_values("w", w, w_ref, float((w_32.double() - w_ref).abs().max()), wfmt == "bf16")
    check_values("v", states[1].data, s_ref[1],
                 float((s_32[1].double() - s_ref[1]).abs().max()), False)
    torch.testing.assert_close(sumsq.double(), (g * g).sum().reshape(1), rtol=1e-4, atol=0)


def test_onehot_nonfinite_row_stays_in_its_tile(device, monkeypatch):
    """A non-finite row of e reaches only its token's row (the reference's index_add): the
    kernel's tile holding that row is not written, every other tile is stepped as float64's
    step without that token. (The torch backend skips whole blocks of rows: not checked.)"""
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    spec = R.rule_spec(R.ADAMW, 0)
    N, K, T1 = 301, 70, 117
    w = torch.randn(N, K, device=device)
    states = initial_state(spec, (N, K), "fp32", device)
    ids = _sparse_ids(N, T1, device)
    e = torch.randn(T1, K, device=device)
    bad = int((ids == N - 1).nonzero()[0])
    e[bad, 3] = float("inf")  # row N - 1, columns 0..63: one tile of the last row block
    w_in = w.clone()
    s_in = [st.fp32().clone() if st is not None else None for st in states]
    hp = R.hparams(R.ADAMW, ADAM, 1, {})
    sumsq = torch.zeros(1, device=device)
    fused_wgrad_update(None, None, w, states, spec, torch.tensor(hp, device=device), sumsq, 5,
                       False, onehot=(ids, e))
    assert not torch.isfinite(sumsq).all()
    ok = ids != N - 1
    w_ref, _, _ = reference("adamw", 1, None, None, w_in, s_in, onehot=(ids[ok], e[ok]))
    w_32, _, _ = reference("adamw", 1, None, None, w_in, s_in, torch.float32,
                           onehot=(ids[ok], e[ok]))
    assert torch.equal(w[N - 1, :64], w_in[N - 1, :64])  # the tile of the inf: not written
    assert not torch.equal(w[N - 1, 64:], w_in[N - 1, 64:])  # its other column tile: written
    base = float((w_32[:256].double() - w_ref[:256]).abs().max())
    check_values("w", w[:256], w_ref[:256], base, False)


@pytest.mark.parametrize("dense,wfmt", [(False, "fp32"), (True, "fp32"), (False, "bf16")],
                         ids=["grad-only", "dense+grad", "bf16-grad"])
@pytest.mark.parametrize("sfmt", ["fp32", "int8"])
def test_materialized_gradient_segment_matches_float64(dense, wfmt, sfmt, backend, device):
    """A materialized gradient (a reduce-scattered row shard, an accumulation buffer: fp32; a
    standard-path .grad: the weight's dtype, bf16 here) fed to the kernel as it is, alone or
    added to a dense segment: the same update, the same per-tile norm and non-finite skip as
    dy^T x. Shapes not multiples of any tile."""
    spec = R.rule_spec(R.ADAMW, 0)
    N, K, T = 67, 130, 20
    dt = DT[wfmt]
    w = (torch.randn(N, K) * 0.5).to(device, dt)
    states = initial_state(spec, (N, K), sfmt, device)
    grad = (torch.randn(N, K, device=device) * 0.3).to(dt)
    x = torch.randn(T, K, device=device) if dense else None
    dy = (torch.randn(T, N, device=device) * 0.1) if dense else None
    sumsq, (w_ref, s_ref, g), (w_32, s_32) = segment_step(w, states, 5, 3, x, dy, grad=grad)
    check_values("w", w, w_ref, float((w_32.double() - w_ref).abs().max()), wfmt == "bf16")
    if sfmt == "fp32":
        check_values("m", states[0].data, s_ref[0],
                     float((s_32[0].double() - s_ref[0]).abs().max()), False)
    torch.testing.assert_close(sumsq.double(), (g * g).sum().reshape(1), rtol=1e-4, atol=0)
    hp = torch.tensor(R.hparams(R.ADAMW, ADAM, 3, {}), device=device)
    for bad in (grad[:, :-1], grad.half()):
        with pytest.raises(ValueError, match=r"grad must be \[67, 130\] in fp32 or w's"):
            fused_wgrad_update(x, dy, w, states, spec, hp, sumsq, 5, True, grad=bad)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("value,nonneg", [(0.0, False), (0.0, True), (0.1, True), (-0.3, False)])
def test_state_full_equals_quantizing_a_full_tensor(fmt, value, nonneg):
    """StateTensor.full builds the storage format directly (no full-shape fp32 temporary); it
    must store exactly what quantizing the full fp32 tensor stores. K = 130: a partial block."""
    from forge_engine.kernels.quant import StateTensor
    a = StateTensor.full((7, 130), value, fmt, nonneg, "cpu")
    b = StateTensor.from_fp32(torch.full((7, 130), value), fmt, nonneg)
    assert a.data.dtype == b.data.dtype and torch.equal(a.data, b.data)
    assert (a.scale is None) == (b.scale is None)
    if a.scale is not None:
        assert torch.equal(a.scale, b.scale) and a.scale.is_contiguous()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("nonneg", [False, True])
def test_state_clone_is_equal_and_independent(fmt, nonneg):
    """StateTensor.clone (what the variant and A/B comparisons step from): the same stored
    values, format and sign flag, in storage of its own, so stepping the clone in place leaves
    the original as it was."""
    from forge_engine.kernels.quant import StateTensor
    v = torch.randn(9, 130)
    a = StateTensor.from_fp32(v.abs() if nonneg else v, fmt, nonneg)
    b = a.clone()
    assert (b.fmt, b.nonneg) == (a.fmt, a.nonneg) and torch.equal(b.data, a.data)
    assert b.data.data_ptr() != a.data.data_ptr()
    if fmt == "int8":
        assert torch.equal(b.scale, a.scale) and b.scale.data_ptr() != a.scale.data_ptr()
    before = a.fp32().clone()
    b.data.zero_()
    if b.scale is not None:
        b.scale.fill_(7.0)
    assert torch.equal(a.fp32(), before) and not torch.equal(b.fp32(), before)


def test_launch_key_separates_what_triton_specializes_on():
    """fused_update._launch reuses a compiled kernel for an equal key: the key must differ
    wherever Triton's specialization can (dtype, 16-byte alignment, exact integers, descriptor
    geometry) and stay equal for fresh tensors of the same kind (a new step's activations)."""
    from forge_engine.kernels.launch import TensorDescriptor, arg_key as _arg_key
    a = torch.randn(8, 64, dtype=torch.bfloat16)
    b = torch.randn(8, 64, dtype=torch.bfloat16)
    assert _arg_key(a) == _arg_key(b)  # fresh allocations: aligned alike
    assert _arg_key(a) != _arg_key(a.float())
    assert _arg_key(a.view(-1)[1:]) != _arg_key(a)  # 2-byte offset: not 16-byte aligned
    assert _arg_key(16) != _arg_key(32) and _arg_key(1) != _arg_key(17)
    da = TensorDescriptor.from_tensor(a, [8, 32])
    assert _arg_key(da) == _arg_key(TensorDescriptor.from_tensor(b, [8, 32]))
    assert _arg_key(da) != _arg_key(TensorDescriptor.from_tensor(a, [8, 64]))
    assert _arg_key(da) != _arg_key(TensorDescriptor.from_tensor(a[:4], [8, 32]))


@triton.jit
def _codes_of(c_ptr, out_ptr, n, NONNEG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    c = tl.load(c_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, _codes(c, c > 0, NONNEG).to(tl.int32), mask=m)


@pytest.mark.parametrize("nonneg", [False, True])
def test_int8_codes_round_half_to_even(nonneg, device):
    """quant._codes (the kernels' int8 codes: the low byte of c + 1.5 * 2^23, or c + 2^23)
    gives what quantize() computes, torch.round (ties to even) clamped to the code range, and a
    positive value of a nonnegative state at least 1: on exact ties, their fp32 neighbours, the
    range's edges and fresh random values, over the domain _block_codes makes (|c| below
    qmax + 0.5)."""
    hi = 255.0 if nonneg else 127.0
    ties = torch.arange(0, hi, dtype=torch.float32) + 0.5
    edge = torch.tensor([0.0, 1e-30, 0.49999997, 0.5, 1.5, hi - 0.5, hi, hi + 0.49])
    c = torch.cat([ties, torch.nextafter(ties, torch.zeros(1)), torch.nextafter(ties, ties + 1),
                   edge, torch.rand(2000) * (hi + 0.5)])
    if not nonneg:
        c = torch.cat([c, -c])
    want = torch.clamp(torch.round(c), 0 if nonneg else -127, hi)
    if nonneg:
        want = torch.where(c > 0, torch.clamp(want, min=1.0), want)
    assert (want != torch.sign(c) * torch.floor(c.abs() + 0.5)).any()  # ties do differ
    out = torch.empty(c.numel(), dtype=torch.int32, device=device)
    block = triton.next_power_of_2(c.numel())
    _codes_of[(1,)](c.to(device), out, c.numel(), NONNEG=nonneg, BLOCK=block)
    assert torch.equal(out.cpu(), want.to(torch.int32))



@pytest.mark.parametrize("nonneg", [False, True])
def test_quantize_rounds_ties_to_even(nonneg):
    """quantize() (the host side of the int8 format) rounds the scaled square roots to nearest
    with ties to even, as the kernels' _codes: blocks whose first entry is qmax^2 (scale
    qmax * (1 / qmax), exactly 1.0) hold exact ties k + 1/2 and their neighbours, squared."""
    hi = 255 if nonneg else 127
    ties = torch.arange(0, hi, dtype=torch.float32) + 0.5
    u = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    u = u[torch.randperm(u.numel())]
    if not nonneg:
        u = u * (torch.randint(0, 2, u.shape) * 2 - 1)
    rows = -(-u.numel() // (QBLOCK - 1))
    u = torch.nn.functional.pad(u, (0, rows * (QBLOCK - 1) - u.numel())).view(rows, QBLOCK - 1)
    u = torch.cat([torch.full((rows, 1), float(hi)), u], dim=1)
    codes, scale = quant.quantize(u * u.abs(), nonneg)
    assert torch.equal(scale, torch.ones_like(scale))
    want = torch.round(u)
    if nonneg:
        want = torch.where(u > 0, torch.clamp(want, min=1.0), want)
    assert torch.equal(codes.float(), want)


def test_kernel_builds_for_sm90_with_unit_dimensions(compile_tool):
    """A launch makes an int argument equal to 1 a constexpr (N = 1 for a norm weight, K = 1 for
    a one-input linear), and the kernel must still build for the GPU (a .to() on K broke it
    once, unseen by the interpreter, which does not specialize). Built offline for sm_90 by
    benchmarks/ptxas_report.py (triton.compile and the bundled ptxas, no GPU), in a subprocess:
    the tests' Triton interprets."""
    code = ("from forge_engine.kernels import ptxas_report as P; "
            "print(P.ptxas(90, 'bf16', P.CONFIGS['T<=1024'], False, False, unit=('N', 'K')))")
    out = compile_tool("-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "regs" in out.stdout, out.stdout


@pytest.mark.parametrize("config,match", [
    (dict(EPI_GROUPS=3), "SPLIT needs EPI_GROUPS 1 or 2"),
    (dict(EPI_GROUPS=2, EPI_BUFS=1), "at least EPI_GROUPS"),
    (dict(EPI_GROUPS=2, EPI_BUFS=2, EPI_WARPS=8), "at most 8 epilogue warps"),
    (dict(EPI_WARPS=16), "EPI_WARPS 4 or 8"),
    (dict(EPI_PIPE=True, EPI_BUFS=2), "EPI_PIPE needs EPI_BUFS 1"),
    (dict(EPI_PIPE=True, EPI_GLOBAL=True), "EPI_PIPE needs EPI_BUFS 1, EPI_GROUPS 1 and "
                                           "EPI_GLOBAL off"),
    (dict(BLOCK_N=96), "BLOCK_N 64 or 128"),  # a key SPLIT_DEFAULT sets too
    (dict(EPI_GROUPS=2, EPI_BUFS=2, EPI_WARPS=4, STAGES=4), "bytes of shared memory"),
    (dict(EPI_SPLIT=2), "config takes")])
def test_ws_split_config_refused_before_any_launch(config, match):
    """The warp-specialized kernel's split design (fused_ws.py, Hopper only) checks its
    configuration on the host before building descriptors or launching: a one-line error, on
    any machine (here CPU tensors)."""
    from forge_engine.kernels.fused_ws import fused_wgrad_update_ws
    spec = R.rule_spec(R.ADAMW, 0)
    N, K, T = 128, 256, 64
    w = torch.zeros(N, K, dtype=torch.bfloat16)
    x, dy = torch.zeros(T, K, dtype=torch.bfloat16), torch.zeros(T, N, dtype=torch.bfloat16)
    hp = torch.tensor(R.hparams(R.ADAMW, ADAM, 1, {}))
    with pytest.raises(ValueError, match=match):
        fused_wgrad_update_ws(x, dy, w, initial_state(spec, (N, K), "bf16"), spec, hp,
                              torch.zeros(1), 1, True, dict(SPLIT=True, **config))


@pytest.mark.parametrize("config", [dict(SPLIT=False),
                                    dict(SPLIT=True, EPI_GROUPS=2, EPI_BUFS=2, EPI_WARPS=4)])
def test_ws_int8_states_refused_outside_the_split_design(config):
    """int8 states go only through the split design with one epilogue group (W and the
    states staged in shared memory or from global memory): elsewhere a one-line error on the
    host, before any launch (here CPU tensors)."""
    from forge_engine.kernels.fused_ws import fused_wgrad_update_ws
    spec = R.rule_spec(R.ADAMW, 0)
    N, K, T = 128, 256, 64
    w = torch.zeros(N, K, dtype=torch.bfloat16)
    x, dy = torch.zeros(T, K, dtype=torch.bfloat16), torch.zeros(T, N, dtype=torch.bfloat16)
    hp = torch.tensor(R.hparams(R.ADAMW, ADAM, 1, {}))
    with pytest.raises(ValueError, match="int8 states need the split design"):
        fused_wgrad_update_ws(x, dy, w, initial_state(spec, (N, K), "int8"), spec, hp,
                              torch.zeros(1), 1, True, config)


def _wavefronts(word_of, lanes, nbytes, per_phase):
    """Shared-memory wavefronts of one warp instruction under the bank model: 32 banks of 4
    bytes; lane i accesses nbytes from the fp32 element lanes[i] (word word_of[element]) on,
    and the hardware serves per_phase lanes at a time (8-byte accesses: half a warp, 16-byte:
    a quarter), each phase taking as many wavefronts as the most distinct words on one bank."""
    total = 0
    for first in range(0, 32, per_phase):
        banks: dict = {}
        for r, c in lanes[first:first + per_phase]:
            for k in range(nbytes // 4):
                word = word_of[(r, c)] + k
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in banks.values())
    return total


def _layout_words(bases, rows):
    """{(row, col): word} of a shared linear layout's offset bases (offset bit i -> the
    element bases[i]; an offset holds the XOR of its bits' elements), checked to be a
    bijection onto the [rows, 64] half."""
    word_of = {}
    for off in range(rows * 64):
        r = c = 0
        for i, (br, bc) in enumerate(bases):
            if off >> i & 1:
                r, c = r ^ br, c ^ bc
        word_of[(r, c)] = off
    assert sorted(word_of) == [(r, c) for r in range(rows) for c in range(64)]
    return word_of


@pytest.mark.parametrize("rows", [64, 128])
def test_gradient_handover_layout_is_free_of_bank_conflicts(rows):
    """The split design hands each fp32 gradient half [rows, 64] from the MMA partition's
    wgmma registers to the epilogue through shared memory laid out by
    fused_ws._gradient_layout: every word once, 4-word groups kept whole (the 8- and 16-byte
    accesses), and both sides at the fewest wavefronts their bytes need under the bank model:
    a wgmma store (lane: row base + lane // 4, columns 8 n + 2 (lane % 4), 8 bytes) 2, an
    epilogue load (its BlockedLayout [1, 8] x [8, 4]: row base + lane // 4, columns
    8 (lane % 4) + h, 16 bytes) 4. On the H200, ncu counted 2.0 and 4.0. A
    row-major half would take 8 for the stores, which the model must see."""
    from forge_engine.kernels.fused_ws import gradient_layout as _gradient_layout
    word_of = _layout_words(_gradient_layout(rows).offset_bases, rows)
    for (r, c), word in word_of.items():
        if c % 4:
            assert word == word_of[(r, c - 1)] + 1  # groups of 4 words contiguous
        else:
            assert word % 4 == 0
    for base in range(0, rows, 8):
        for n in range(8):  # one column block of the wgmma layout per store instruction
            lanes = [(base + i // 4, 8 * n + 2 * (i % 4)) for i in range(32)]
            assert _wavefronts(word_of, lanes, 8, 16) == 2, (base, n)
        for c0 in (0, 4, 32, 36):  # the two 16-byte loads of each of a thread's two chunks
            lanes = [(base + i // 4, c0 + 8 * (i % 4)) for i in range(32)]
            assert _wavefronts(word_of, lanes, 16, 8) == 4, (base, c0)
    row_major = {(r, c): 64 * r + c for r in range(rows) for c in range(64)}
    assert _wavefronts(row_major, [(i // 4, 2 * (i % 4)) for i in range(32)], 8, 16) == 8


@pytest.mark.parametrize("value,match", [("[1]", "must be a JSON object, got \\[1\\]"),
                                         ("{x", "must be a JSON object, got '{x': Expecting")])
def test_forge_ws_large_must_be_a_json_object(value, match):
    """FORGE_WS_LARGE is read at import: a value that is not a JSON object stops the import
    with one line saying so (not a failure at the first large update)."""
    env = dict(os.environ, FORGE_WS_LARGE=value)
    p = subprocess.run([sys.executable, "-c", "import forge_engine.kernels.fused_update"],
                       env=env, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 1
    assert re.search("ValueError: FORGE_WS_LARGE " + match, p.stderr.splitlines()[-1])


def test_even_programs_fills_every_round_or_keeps_one_per_sm():
    """fused_ws.even_programs (the persistent grid of the warp-specialized kernels with int8
    states): against a search over every program count, for fresh random tile and SM counts,
    it is the fewest programs that keep one-per-SM's ceil(tiles / sms) rounds and give every
    program the same number of tiles, and one per SM (or per tile) where no count does. On
    132 SMs proj's 1024 tiles go to 128 programs; fc1's 7168 and the LM head's 32064 stay on
    132. Counts that are not positive are refused."""
    import random
    from forge_engine.kernels.fused_ws import even_programs
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    cases = [(rng.randint(1, 5000), rng.randint(1, 200)) for _ in range(300)]
    cases += [(1, 132), (132, 132), (133, 132), (1024, 132), (7168, 132), (32064, 132)]
    moved = 0
    for tiles, sms in cases:
        rounds = -(-tiles // sms)
        even = [p for p in range(1, sms + 1) if -(-tiles // p) == rounds and tiles % p == 0]
        expect = min(even) if even else min(tiles, sms)
        got = even_programs(tiles, sms)
        assert got == expect, (seed, tiles, sms, got, expect)
        moved += got < min(tiles, sms)
    # (1024, 132) moves, and the random draws too: about 18 of 300 do (fewer than 2: p < 1e-6)
    assert moved >= 3, seed
    assert (even_programs(1024, 132), even_programs(7168, 132), even_programs(32064, 132),
            even_programs(7, 132)) == (128, 132, 132, 7)
    for tiles, sms in [(0, 132), (10, 0), (-3, 4)]:
        with pytest.raises(ValueError, match="at least one tile and one SM"):
            even_programs(tiles, sms)

"""Stochastic rounding of bf16 weight writes is unbiased; round-to-nearest is not.

Every element of a [64, 128] bf16 weight starts at 1.0 and takes the same SGD step
w <- 1 - lr * g with g = 1.25 * 2^-10 (x = 1, dy = g: exact in bf16 and fp32). The exact result
0.998779296875 lies between the bf16 neighbours 0.99609375 and 1.0, 0.6875 of the gap above the
lower one. Each element draws its own random bits, so the 8192 elements are 8192 trials:
  stochastic   mean within 5 sigma of the exact value, sigma = gap * sqrt(p (1 - p) / 8192)
               (about 2.0e-5; a false failure has probability < 1e-6), and the fraction
               rounded up within 5 sigma of p = 0.6875;
  nearest      every element is 1.0 (bias +1.2e-3, 60 sigma): what SR exists to avoid.
"""
import math

import torch

from forge_engine.kernels import StateTensor, fused_wgrad_update
from forge_engine.kernels import rules as R

N, K = 64, 128
G = 1.25 * 2 ** -10
EXACT = 1.0 - G
LOW, HIGH = 0.99609375, 1.0
P_UP = (EXACT - LOW) / (HIGH - LOW)


def sgd_step(stochastic, seed, device):
    spec = R.rule_spec(R.SGD, 0)
    hp = torch.tensor(R.hparams(R.SGD, dict(lr=1.0, weight_decay=0.0), 1, {}), device=device)
    w = torch.ones(N, K, dtype=torch.bfloat16, device=device)
    x = torch.ones(1, K, dtype=torch.bfloat16, device=device)
    dy = torch.full((1, N), G, dtype=torch.bfloat16, device=device)
    fused_wgrad_update(x, dy, w, [None] * 3, spec, hp,
                       torch.zeros(1, device=device), seed, stochastic)
    return w.double().cpu()


def test_stochastic_rounding_is_unbiased(backend, device):
    w = sgd_step(True, 1234, device)
    assert set(w.unique().tolist()) <= {LOW, HIGH}
    sigma = (HIGH - LOW) * math.sqrt(P_UP * (1 - P_UP) / w.numel())
    assert abs(w.mean().item() - EXACT) < 5 * sigma
    up = (w == HIGH).double().mean().item()
    assert abs(up - P_UP) < 5 * math.sqrt(P_UP * (1 - P_UP) / w.numel())
    # another seed gives another pattern (the stream is seeded per step and weight)
    assert not torch.equal(w, sgd_step(True, 4321, device))


def test_round_to_nearest_is_biased(backend, device):
    w = sgd_step(False, 1234, device)
    assert torch.all(w == HIGH)


def _up_fraction_bound(p, n):
    return 5 * math.sqrt(p * (1 - p) / n)


def test_paired_roundings_are_unbiased_and_independent(backend, device):
    """One random draw serves two stochastic roundings: those of a pair of adjacent columns
    (quant.random_pairs: one hash per pair and rounding, its low 16 bits round the even
    column, its high 16 bits the odd one; the weight and states 0, 1, 2 draw from streams 0,
    1, 2, 3). Each rounding must stay unbiased, the two columns of a pair independent, and the
    roundings of one element (different streams) independent too.

    SGD with momentum, step 1: buf = g and w = 1 - g (lr 1), with g = 2^-10 + 2^-19 for every
    element (x = 1, dy = two tokens: 2^-10, 2^-19; exact in fp32, not in bf16): buf rounds up
    with p = 0.25, w with p = 1 - 2^-2 - 2^-11. AdamW with amsgrad, step 1: state 2 =
    max(0, v) = v, so states 1 and 2 round the same fp32 value with their own bits: with
    independent bits they disagree in a fraction 2p(1 - p) of the elements (shared bits: never).
    8192 elements; bounds at 5 sigma (a false failure has probability < 1e-5 per check)."""
    n = N * K
    x = torch.ones(2, K, dtype=torch.bfloat16, device=device)
    dy = torch.tensor([[2.0 ** -10], [2.0 ** -19]], dtype=torch.bfloat16,
                      device=device).expand(2, N).contiguous()
    g = 2.0 ** -10 + 2.0 ** -19
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))

    spec = R.rule_spec(R.SGD_MOMENTUM, 0)
    group = dict(lr=1.0, weight_decay=0.0, momentum=0.9, dampening=0.0, nesterov=False)
    hp = torch.tensor(R.hparams(R.SGD_MOMENTUM, group, 1, {}), device=device)
    w = torch.ones(N, K, dtype=torch.bfloat16, device=device)
    buf = StateTensor.full((N, K), 0.0, "bf16", False, device)
    fused_wgrad_update(x, dy, w, [buf, None, None], spec, hp, torch.zeros(1, device=device),
                       seed, True)
    w, b = w.double().cpu().flatten(), buf.data.double().cpu().flatten()
    w_lo, w_hi = 1.0 - 2.0 ** -8, 1.0
    b_lo, b_hi = 2.0 ** -10, 2.0 ** -10 * (1 + 2.0 ** -7)
    assert set(w.unique().tolist()) <= {w_lo, w_hi} and set(b.unique().tolist()) <= {b_lo, b_hi}
    for vals, hi, p in ((w, w_hi, 1 - 2.0 ** -2 - 2.0 ** -11), (b, b_hi, 0.25)):
        assert abs((vals == hi).double().mean().item() - p) < _up_fraction_bound(p, n)
    assert abs(((1 - g) - w.mean().item())) < 5 * (w_hi - w_lo) * math.sqrt(0.25 / n)
    # independence: the up indicators' correlation (sd 1 / sqrt(n) when independent)
    uw, ub = (w == w_hi).double(), (b == b_hi).double()
    corr = ((uw - uw.mean()) * (ub - ub.mean())).mean() / (uw.std() * ub.std())
    assert abs(corr.item()) < 5 / math.sqrt(n)
    # the two halves of one draw: even and odd columns of a pair (n / 2 pairs)
    for u in (uw, ub):
        ev, od = u[0::2], u[1::2]
        corr = ((ev - ev.mean()) * (od - od.mean())).mean() / (ev.std() * od.std())
        assert abs(corr.item()) < 5 / math.sqrt(n / 2)

    spec = R.rule_spec(R.ADAMW, R.AMSGRAD)
    group = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    hp = torch.tensor(R.hparams(R.ADAMW, group, 1, {}), device=device)
    w = torch.ones(N, K, dtype=torch.bfloat16, device=device)
    st = [StateTensor.full((N, K), 0.0, "bf16", nn, device) for nn in (False, True, True)]
    fused_wgrad_update(x, dy, w, st, spec, hp, torch.zeros(1, device=device), seed, True)
    v, vmax = st[1].data.double().cpu().flatten(), st[2].data.double().cpu().flatten()
    vals = sorted(set(v.tolist()) | set(vmax.tolist()))
    assert len(vals) == 2  # the two bf16 neighbours of one fp32 value
    p = (v == vals[1]).double().mean().item()
    assert 0.05 < p < 0.95, p  # (v = 0.001 g^2 lies well inside its bf16 gap)
    pm = (vmax == vals[1]).double().mean().item()
    assert abs(pm - p) < 2 * _up_fraction_bound(p, n)
    disagree = (v != vmax).double().mean().item()
    want = 2 * p * (1 - p)
    assert abs(disagree - want) < _up_fraction_bound(want, n)

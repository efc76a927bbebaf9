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

from forge_engine.kernels import fused_wgrad_update
from forge_engine.optim import rules as R

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

"""The same training loop with torch.optim and with forge_engine.optim gives the same weights.

Model: odd widths (13 -> 37 -> 29 -> 5, none a multiple of a tile), a LayerNorm and biases on the
standard path, three fused linears. fp32, 5 steps, fresh random data each step, both backends.

Tolerance: tests/closeness.py (FORGE's and torch.optim's distances to the same loop in float64).
"""
import copy

import pytest
import torch
from torch import nn

import forge_engine
from closeness import assert_fp32_close, reversed_rows

CONFIGS = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.0, amsgrad=True)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1)),
    ("RAdam", dict(lr=1e-2, betas=(0.9, 0.5), weight_decay=0.1, decoupled_weight_decay=True)),
    ("RMSprop", dict(lr=1e-3)),
    ("RMSprop", dict(lr=1e-3, momentum=0.9, weight_decay=0.01)),
    ("RMSprop", dict(lr=1e-3, centered=True)),
    ("Adagrad", dict(lr=1e-2, lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.1)),
    ("SGD", dict(lr=1e-2)),
    ("SGD", dict(lr=1e-2, weight_decay=0.1)),
    ("SGD", dict(lr=1e-2, momentum=0.9, dampening=0.1)),
    ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)),
]


def make_model():
    return nn.Sequential(nn.Linear(13, 37), nn.LayerNorm(37), nn.GELU(),
                         nn.Linear(37, 29, bias=False), nn.Tanh(), nn.Linear(29, 5))


def train(model, opt, data, sched=None):
    losses = []
    for x, y in data:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def batches(n=5, device="cpu"):
    return [(torch.randn(7, 3, 13, device=device), torch.randn(7, 3, 5, device=device))
            for _ in range(n)]


@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in
                                                     enumerate(CONFIGS)])
def test_matches_torch_optim(name, kw, backend, device):
    ref = make_model().to(device)
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    opt_ref = getattr(torch.optim, name)(ref.parameters(), **kw)
    opt64 = getattr(torch.optim, name)(ref64.parameters(), **kw)
    opt_r = getattr(torch.optim, name)(ref_r.parameters(), **kw)
    opt = getattr(forge_engine.optim, name)(ours, **kw)
    assert len(opt.fused_names) == 3
    data = batches(device=device)
    l_ref, l_ours = train(ref, opt_ref, data), train(ours, opt, data)
    train(ref64, opt64, [(x.double(), y.double()) for x, y in data])
    train(ref_r, opt_r, [reversed_rows(xy) for xy in data])
    torch.testing.assert_close(torch.tensor(l_ours), torch.tensor(l_ref), rtol=1e-5, atol=1e-7)
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_lr_scheduler_drives_fused_updates(backend, device):
    """lr is read from param_groups at backward time, so a torch scheduler works unchanged."""
    ref = make_model().to(device)
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-2, weight_decay=0.1)
    opt = forge_engine.optim.AdamW(ours, lr=3e-2, weight_decay=0.1)
    lam = lambda s: min(1.0, (s + 1) / 3) * 0.5 ** s  # noqa: E731
    s_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lam)
    s_ours = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    data = batches(6, device)
    train(ref, opt_ref, data, s_ref)
    train(ours, opt, data, s_ours)
    assert opt.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"]
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def lion_reference(params, grads, m, lr, b1, b2, wd):
    """Lion as written in the paper (Chen et al. 2023, Alg. 2), independent of rules.py."""
    for p, g, mm in zip(params, grads, m):
        c = b1 * mm + (1 - b1) * g
        p.mul_(1 - lr * wd).add_(torch.sign(c), alpha=-lr)
        mm.mul_(b2).add_(g, alpha=1 - b2)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_matches_paper(wd, backend, device):
    ref = make_model().to(device)
    ours = copy.deepcopy(ref)
    lr, betas = 1e-3, (0.9, 0.99)
    opt = forge_engine.optim.Lion(ours, lr=lr, betas=betas, weight_decay=wd)
    m = [torch.zeros_like(p) for p in ref.parameters()]
    for x, y in batches(device=device):
        loss = ((ref(x) - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        with torch.no_grad():
            lion_reference(list(ref.parameters()), grads, m, lr, *betas, wd)
        ((ours(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    # Lion's step is lr * sign(c): a sign flip of an element with c within rounding of 0 would
    # differ by 2 lr; with continuous random data that has probability ~1e-7 per element.
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

"""Deferred token segments (docs/design.md, "The identity"): gradient accumulation, exact
global-norm clipping and a module applied twice, each against torch.optim on materialized
gradients. Tolerance: tests/closeness.py (FORGE's and torch.optim's distances to the same loop in
float64)."""
import copy

import pytest
import torch
from torch import nn

import forge_engine
from closeness import assert_fp32_close, reversed_rows
from test_optim_parity import make_model


def run_torch(model, opt, steps, clip=None):
    norms = []
    for micro in steps:
        for x, y in micro:
            (((model(x) - y) ** 2).mean() / len(micro)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms


def run_forge(model, opt, steps, clip=None):
    norms = []
    for micro in steps:
        opt.defer_updates()
        for x, y in micro:
            (((model(x) - y) ** 2).mean() / len(micro)).backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    return norms


def data(steps=3, micro=3, device="cpu"):
    return [[(torch.randn(5, 13, device=device), torch.randn(5, 5, device=device))
             for _ in range(micro)] for _ in range(steps)]


@pytest.mark.parametrize("clip", [None, 0.05, 1e3], ids=["accumulate", "clip-active",
                                                        "clip-inactive"])
@pytest.mark.parametrize("name,kw", [("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                     ("SGD", dict(lr=0.1, momentum=0.9))])
def test_accumulation_and_clipping_match_torch(name, kw, clip, backend, device):
    ref = make_model().to(device)
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    opt = getattr(forge_engine.optim, name)(ours, **kw)
    steps = data(device=device)
    n_ref = run_torch(ref, getattr(torch.optim, name)(ref.parameters(), **kw), steps, clip)
    run_torch(ref64, getattr(torch.optim, name)(ref64.parameters(), **kw),
              [[(x.double(), y.double()) for x, y in m] for m in steps], clip)
    run_torch(ref_r, getattr(torch.optim, name)(ref_r.parameters(), **kw),
              reversed_rows(steps), clip)
    n_ours = run_forge(ours, opt, steps, clip)
    assert_fp32_close(ours, ref, ref64, also=[ref_r])
    assert n_ours == pytest.approx(n_ref, rel=1e-5)
    if clip == 0.05:
        assert all(n > 0.05 for n in n_ref)  # clipping really happened
    if clip is not None:
        assert float(opt.grad_norm) == pytest.approx(n_ref[-1], rel=1e-5)  # pre-clip norm


def test_module_applied_twice_is_exact_with_deferred_updates(backend, device):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).to(device)
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    opt = forge_engine.optim.AdamW(ours, lr=1e-2)
    runs = [(m, torch.optim.AdamW(m.parameters(), lr=1e-2)) for m in (ref, ref64, ref_r)]
    for _ in range(3):
        x = torch.randn(4, 6, device=device)
        for m, o in runs:
            xm = reversed_rows(x) if m is ref_r else x
            m(m(xm.to(m[0].weight.dtype))).sum().backward()
            o.step()
            o.zero_grad()
        opt.defer_updates()
        ours(ours(x)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_clipping_needs_deferred_updates():
    model = make_model()
    opt = forge_engine.optim.AdamW(model, updates="backward")
    ((model(torch.randn(2, 13)) - 1) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="needs optimizer.defer_updates"):
        opt.clip_grad_norm_(1.0)


def test_accumulation_memory_choice_is_automatic_logged_and_exact(backend, device, caplog):
    """Per weight: token segments while they take less memory than an fp32 gradient buffer
    (N K x 4 bytes), the buffer from then on. 3 micro-batches of 16 tokens, fp32:
    big [256, 200]: segments 3 x 16 x (200 + 256) x 4 = 87552 B < buffer 204800 B -> segments;
    small [3, 256]: after the first micro-batch 16 x (256 + 3) x 4 = 16576 B > 3072 B -> buffer.
    Either way the result is the materialized-gradient accumulation's."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(200, 256), nn.Tanh(), nn.Linear(256, 3)).to(device)
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    opt = forge_engine.optim.AdamW(ours, lr=1e-2)
    steps = [[(torch.randn(16, 200, device=device), torch.randn(16, 3, device=device))
              for _ in range(3)] for _ in range(2)]
    run_torch(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), steps)
    run_torch(ref64, torch.optim.AdamW(ref64.parameters(), lr=1e-2),
              [[(x.double(), y.double()) for x, y in m] for m in steps])
    run_torch(ref_r, torch.optim.AdamW(ref_r.parameters(), lr=1e-2), reversed_rows(steps))
    with caplog.at_level("INFO", logger="forge_engine"):
        for micro in steps:
            opt.defer_updates()
            for x, y in micro:
                (((ours(x) - y) ** 2).mean() / len(micro)).backward()
            held = opt.deferred_bytes()
            assert held == 3 * 16 * (200 + 256) * 4 + 3 * 256 * 4
            opt.step()
            opt.zero_grad()
            assert opt.deferred_bytes() == 0
    assert opt.accumulation == {"0.weight": "segments", "2.weight": "fp32 buffer"}
    assert "2.weight accumulates in an fp32 gradient buffer" in caplog.text
    assert_fp32_close(ours, ref, ref64, also=[ref_r])

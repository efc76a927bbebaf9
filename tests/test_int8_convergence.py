"""int8 optimizer states keep AdamW's convergence: 200 steps of a small regression problem.

Teacher: a fixed random 2-layer MLP; student: Linear(64, 256) - GELU - Linear(256, 32), trained
with forge_engine AdamW (lr 3e-3, weight decay 0.01) on fresh minibatches of 128 samples, fp32
weights. The same seed and data are used for fp32 states and int8 states; the loss is measured on
a held-out set of 2048 samples. Requirement (issue 2): int8 loss within 5% of the fp32-state loss.

The 200-step runs take the torch backend (seconds). The Triton kernel's int8 path (interpreted
on CPU: about 1.4 s a step, 9 minutes for both 200-step runs) is held to the torch backend's
int8 run instead: the same 20 steps from the same seed must give the same per-step and
held-out losses to rel 1e-4. Both store the same int8 format; they differ only in the order of
the token-axis sums (fp32) and, through it, in the odd code that lands on the other side of a
rounding boundary: measured 8e-6 relative on the held-out loss after 20 steps. A kernel int8
path that stored or read its codes or scales wrongly moves every step by a fraction of a
quantum (about 1/127 of a block's largest moment), far above that. Every single step of the
kernel's int8 path is also checked against float64 in test_kernel.py.
"""
import pytest
import torch
from torch import nn

import forge_engine


def run(state_dtype, seed=0, steps=200, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 32))
    student = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32))
    teacher, student = teacher.to(device), student.to(device)
    opt = forge_engine.optim.AdamW(student, lr=3e-3, weight_decay=0.01,
                                   state_dtype=state_dtype, seed=seed)
    x_test = torch.randn(2048, 64, generator=g).to(device)
    with torch.no_grad():
        y_test = teacher(x_test)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 64, generator=g).to(device)
        with torch.no_grad():
            y = teacher(x)
        loss = ((student(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        final = ((student(x_test) - y_test) ** 2).mean().item()
    return losses, final


def test_int8_states_converge_like_fp32(device, monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    (first32, *_), loss32 = run("fp32", device=device)
    (first8, *_), loss8 = run("int8", device=device)
    assert first8 == pytest.approx(first32, rel=1e-6)  # same model, same data at step 1
    assert loss32 < 0.2 * first32, "the problem must actually be learned for this to mean much"
    assert abs(loss8 - loss32) <= 0.05 * loss32, (loss8, loss32)


@pytest.mark.slow
def test_kernel_int8_training_tracks_torch_backend(device, monkeypatch):
    """The Triton kernel's int8 states over 20 steps against the torch backend's (module
    docstring): per-step training losses and the held-out loss to rel 1e-4."""
    runs = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("FORGE_BACKEND", impl)
        runs[impl] = run("int8", steps=20, device=device)
    (l_torch, f_torch), (l_triton, f_triton) = runs["torch"], runs["triton"]
    assert l_torch[-1] < 0.5 * l_torch[0]  # 20 steps already learn: the runs are not idle
    assert l_triton == pytest.approx(l_torch, rel=1e-4)
    assert f_triton == pytest.approx(f_torch, rel=1e-4)


def test_small_second_moments_do_not_explode(backend, device):
    """The failure mode of linear absmax int8 for v: in a block with one large v (1.0) the small
    ones (1e-6) round to code 0, the step becomes lr * m / eps = 1e3 * lr. Stored as sqrt(v) with
    nonzero codes raised to 1, the denominator can only grow, so no element of the int8 step
    exceeds its fp32-state step (checked), while m / sqrt(v) of the small elements is kept at
    O(1) (here 1e-3 / 1e-3)."""
    from forge_engine.kernels import StateTensor, fused_wgrad_update
    from forge_engine.kernels import rules as R

    N, K = 8, 128
    m = torch.full((N, K), 1e-3)
    v = torch.full((N, K), 1e-6)
    v[:, ::64] = 1.0  # one large second moment per block of 64; m stays 1e-3 everywhere
    spec = R.rule_spec(R.ADAMW, 0)
    group = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    hp = torch.tensor(R.hparams(R.ADAMW, group, 10, {}), device=device)
    x = torch.zeros(4, K, device=device)  # zero gradient: the step is driven by the states
    dy = torch.zeros(4, N, device=device)
    steps = {}
    for fmt in ("fp32", "int8"):
        w = torch.zeros(N, K, device=device)
        states = [StateTensor.from_fp32(m.to(device), fmt, False),
                  StateTensor.from_fp32(v.to(device), fmt, True), None]
        fused_wgrad_update(x, dy, w, states, spec, hp, torch.zeros(1, device=device), 0, False)
        steps[fmt] = w.abs().cpu()
    assert torch.isfinite(steps["int8"]).all()
    assert (steps["int8"] <= steps["fp32"] * 1.01 + 1e-12).all()
    assert steps["int8"].max() < 10 * group["lr"]  # the naive layout would give about 1e3 * lr
    assert (steps["int8"] > 0).all()  # small elements still move

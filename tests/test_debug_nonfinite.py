"""FORGE_DEBUG_NONFINITE=1 (forge_engine/optim/debug_nonfinite.py): a step whose gradient norm
is not finite says, for each weight named, which of its inputs were not finite and what the
kernel gives when run again on the same inputs."""
import logging
import math

import torch
from torch import nn

import forge_engine
from forge_engine.engine import Engine
from forge_engine.optim import base


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 72)  # 72 rows: not a multiple of the kernel's tile
        self.fc2 = nn.Linear(72, 40)
        self.poison = False

    def forward(self, x):
        h = self.fc1(x)
        if self.poison:  # NaN in fc1's output gradient, rows 3 and 5 only: the forward and
            # the loss stay finite, and fc2's update never sees it
            h.register_hook(lambda g: g.index_fill(0, torch.tensor([3, 5]), float("nan")))
        return self.fc2(torch.tanh(h)).pow(2).mean()


def _engine(monkeypatch, seed):
    monkeypatch.setenv("FORGE_DEBUG_NONFINITE", "1")
    monkeypatch.delenv("FORGE_DEBUG_DIR", raising=False)
    torch.manual_seed(seed)
    net = Net()
    return net, Engine(net, "adamw", lr=1e-3)


def test_names_the_weight_and_finds_the_nonfinite_input(monkeypatch, caplog):
    net, eng = _engine(monkeypatch, 1)
    x = torch.randn(10, 24)
    assert math.isfinite(eng.train_step(lambda: net(x)).grad_norm)
    net.poison = True
    w0 = net.fc1.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="forge_engine"):
        stats = eng.train_step(lambda: net(x))
    assert math.isfinite(stats.loss) and not math.isfinite(stats.grad_norm)
    assert stats.nonfinite == ["fc1.weight", "fc1.bias"]  # the bias: standard path
    lines = [r.getMessage() for r in caplog.records]
    # two rows of dy times 72 columns, nothing else
    assert any("fc1.weight (update 1 of 1 in step 2): non-finite inputs: x 0, dy 144, W 0, "
               "states [0, 0, 0]" in ln for ln in lines), lines
    again = [ln for ln in lines if ": again, " in ln]
    assert len(again) == 3 and all("norm^2 nan" in ln for ln in again), again
    assert not any("fc2.weight" in ln for ln in lines)
    # NaN rows of dy make every element of dW NaN: no tile of fc1 was written
    assert torch.equal(net.fc1.weight, w0)


def test_a_transient_fault_comes_back_finite(monkeypatch, caplog):
    """A launch that went wrong in training (here: its norm overwritten with NaN afterwards,
    as a race would leave it) runs again on the same recorded inputs to the float64 norm."""
    net, eng = _engine(monkeypatch, 2)
    x = torch.randn(10, 24)
    real = base.PlannedUpdate.__call__  # the launch of a weight's update in training
    calls = []

    def faulty(plan, x_, dy, hp, sumsq, *a, **k):
        real(plan, x_, dy, hp, sumsq, *a, **k)
        calls.append(tuple(plan.w.shape))
        if calls.count((40, 72)) == 2 and calls[-1] == (40, 72):  # fc2, second step only
            sumsq.fill_(float("nan"))
    monkeypatch.setattr(base.PlannedUpdate, "__call__", faulty)
    eng.train_step(lambda: net(x))
    with caplog.at_level(logging.WARNING, logger="forge_engine"):
        stats = eng.train_step(lambda: net(x))
    assert stats.nonfinite == ["fc2.weight"]
    lines = [r.getMessage() for r in caplog.records]
    assert any("non-finite inputs: x 0, dy 0, W 0, states [0, 0, 0]" in ln for ln in lines)
    ref = next(float(ln.rsplit("= ", 1)[1].split(",")[0]) for ln in lines if "float64" in ln)
    again = [float(ln.split("norm^2 ")[1].split(",")[0]) for ln in lines if ": again, " in ln]
    assert len(again) == 3 and ref > 0
    # fp32 accumulation of 10 tokens against float64: a few ulps of the sum, 1e-5 is wide
    assert all(math.isclose(v, ref, rel_tol=1e-5) for v in again), (again, ref)
    # step() lets go of the step's inputs (activation-sized): nothing is kept between steps
    assert not eng.optimizer._recorder._saved


def test_replay_of_a_scaled_gradient_reports_its_norm_and_scale(monkeypatch, caplog):
    """A loop that scales a fused .grad (as GradScaler's unscale_ and clip_grad_norm_ do, by a
    device tensor) updates with that scale in its hp row: the replay runs the recorded row,
    the scale included, and reports dY^T X's own norm (comparable with the float64 line)
    beside the applied one."""
    monkeypatch.setenv("FORGE_DEBUG_NONFINITE", "1")
    monkeypatch.delenv("FORGE_DEBUG_DIR", raising=False)
    torch.manual_seed(4)
    net = Net()
    opt = forge_engine.optim.AdamW(net, lr=1e-3, updates="step")
    real = base.PlannedUpdate.__call__

    def faulty(plan, x_, dy, hp, sumsq, *a, **k):
        real(plan, x_, dy, hp, sumsq, *a, **k)
        if tuple(plan.w.shape) == (40, 72):
            sumsq.fill_(float("nan"))
    monkeypatch.setattr(base.PlannedUpdate, "__call__", faulty)
    net(torch.randn(10, 24)).backward()
    net.fc2.weight.grad.mul_(torch.tensor(0.25))
    opt.flush()  # the updates, as step() runs them first
    with caplog.at_level(logging.WARNING, logger="forge_engine"):
        assert opt.nonfinite_weights() == ["fc2.weight"]
    lines = [r.getMessage() for r in caplog.records]
    ref = next(float(ln.rsplit("= ", 1)[1].split(",")[0]) for ln in lines if "float64" in ln)
    again = [ln for ln in lines if ": again, " in ln]
    assert len(again) == 3
    for ln in again:
        raw = float(ln.split("norm^2 ")[1].split(",")[0])
        applied = float(ln.split("applied ")[1].split(" ")[0])
        scale = float(ln.split("gradient scale ")[1].split(",")[0])
        assert scale == 0.25  # the FusedGrad scaling reached the recorded row
        # fp32 accumulation against float64, as above
        assert math.isclose(raw, ref, rel_tol=1e-5) and math.isclose(applied, ref / 16,
                                                                       rel_tol=1e-5), ln
    opt.step()


def test_saves_the_inputs_for_a_replay_elsewhere(monkeypatch, caplog, tmp_path):
    net, eng = _engine(monkeypatch, 3)
    monkeypatch.setenv("FORGE_DEBUG_DIR", str(tmp_path))
    x = torch.randn(10, 24)
    net.poison = True
    with caplog.at_level(logging.WARNING, logger="forge_engine"):
        eng.train_step(lambda: net(x))
    (path,) = tmp_path.iterdir()
    saved = torch.load(path)
    assert path.name == "nonfinite_step1_fc1.weight_0.pt"
    assert saved["x"].shape == (10, 24) and saved["dy"].shape == (10, 72)
    assert int(torch.isnan(saved["dy"]).sum()) == 144
    assert saved["w"].shape == (72, 24) and len(saved["states"]) == 3

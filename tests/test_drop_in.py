"""The FORGE optimizer in the training loops people already run: torch.amp.GradScaler,
torch.nn.utils.clip_grad_norm_, gradient accumulation, zero_grad in odd places, copies of the
model, torch's nn.Embedding and nn.MultiheadAttention, Hugging Face's Trainer and accelerate.
Each loop runs once with torch.optim and once with forge_engine.optim on a copy of the same
model and the same fresh random batches (fp32); weights must agree with torch.optim's by
tests/closeness.py's rule (each run's distance to the same loop in float64), or the pattern
must be refused before any weight changes.

The loops' mechanics (FusedGrad, stashed segments) do not depend on the backend, whose kernel
tests/test_kernel.py checks: they run on the torch backend, and the GradScaler loop on both."""
import copy
import io
import os
import weakref

import pytest
import torch
from torch import nn

import forge_engine
from closeness import assert_fp32_close, reversed_rows
from nets import Net, next_token_loss as loss_fn, tiny_gpt2


@pytest.fixture(autouse=True)
def torch_backend(request, monkeypatch):
    if "backend" not in request.fixturenames:
        monkeypatch.setenv("FORGE_BACKEND", "torch")


def batches(steps, micro=1, vocab=37):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    return [[torch.randint(0, vocab, (4, 6), generator=g) for _ in range(micro)]
            for _ in range(steps)]


def loop(model, opt, data, *, scaler=None, clip=None, inf_at=(), clip_kw=None, twice=False,
         applied=None):
    """The AMP recipe of torch's docs: scale, backward (accumulated), unscale_, clip, step.
    twice: each loss's backward twice, through the graph retained by the first. applied: a
    list, given each step's norm of the gradients step() applies (torch.optim: of .grad as
    step() finds it; FORGE: its grad_norm after step())."""
    norms = []
    for s, micro in enumerate(data):
        for ids in micro:
            loss = loss_fn(model, ids) / len(micro)
            if s in inf_at:
                loss = loss * float("inf")
            loss = scaler.scale(loss) if scaler is not None else loss
            if twice:
                loss.backward(retain_graph=True)
            loss.backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip,
                                                              **(clip_kw or {}))))
        forge = isinstance(opt, forge_engine.optim.ForgeOptimizer)
        if applied is not None and not forge:
            applied.append(float(torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None])))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if applied is not None and forge:
            applied.append(float(opt.grad_norm) if s not in inf_at else float("nan"))
        opt.zero_grad()
    return norms


def compare(make, data, name="AdamW", kw=None, forge_kw=None, **loop_kw):
    """Run the loop with torch.optim (fp32, fp32 on the batches' rows reversed, float64) and
    FORGE; check the weights."""
    kw = kw or dict(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    ref = make()
    ours, ref64 = copy.deepcopy(ref), copy.deepcopy(ref).double()
    scaler = loop_kw.pop("scaler", None)
    ref_r = copy.deepcopy(ref)
    runs = [(m, getattr(torch.optim, name)(m.parameters(), **kw), d)
            for m, d in ((ref, data), (ref64, data), (ref_r, reversed_rows(data)))]
    a_ref, a_ours = [], []
    n_ref, _, _ = [loop(m, o, d, scaler=copy.deepcopy(scaler), applied=a if m is ref else None,
                        **loop_kw) for (m, o, d), a in zip(runs, (a_ref, None, None))]
    opt = getattr(forge_engine.optim, name)(ours, **kw, **(forge_kw or {}))
    n_ours = loop(ours, opt, data, scaler=copy.deepcopy(scaler), applied=a_ours, **loop_kw)
    assert_fp32_close(ours, ref, ref64, also=[ref_r])
    assert n_ours == pytest.approx(n_ref, rel=1e-5, nan_ok=True)
    # opt.grad_norm: the gradient step() applied (unscaled, clipped), as torch's .grad held it
    skipped = loop_kw.get("inf_at", ())
    assert [a for i, a in enumerate(a_ours) if i not in skipped] == \
        pytest.approx([a for i, a in enumerate(a_ref) if i not in skipped], rel=1e-5)
    return opt, n_ref


@pytest.mark.parametrize("updates", ["auto", "step"])
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_grad_scaler_trains_like_torch_and_skips_a_nonfinite_step(name, updates, backend):
    """Loss scale 2^12 (exact in fp32), unscale_ then clipping, and one step whose loss is
    inf: GradScaler skips it (torch.optim's weights stay), FORGE's must too."""
    kw = dict(lr=1e-2, weight_decay=0.1) if name == "AdamW" else dict(lr=0.5, momentum=0.9)
    data = batches(5, micro=2)
    opt, norms = compare(Net, data, name, kw, dict(updates=updates),
                         scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 12),
                         clip=1.0, inf_at=(2,))
    assert norms[2] != norms[2]  # the skipped step: torch's norm is not finite either
    assert opt._mode == "step"


@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_on_model_parameters_clips_the_fused_weights(foreach):
    data = batches(4)
    _, norms = compare(Net, data, clip=0.3, clip_kw=dict(foreach=foreach))
    assert all(n > 0.3 for n in norms)  # clipping really happened


def test_accumulation_with_clipping_like_torch():
    _, norms = compare(Net, batches(3, micro=3), "SGD", dict(lr=0.3, momentum=0.9), clip=0.2)
    assert all(n > 0.2 for n in norms)


def test_get_total_norm_and_clip_grads_with_norm():
    """torch's two-part clipping API (norm first, scaling later) on the fused weights."""
    torch.manual_seed(0)
    ref = Net()
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    opt = forge_engine.optim.SGD(ours, lr=0.5)
    runs = [(m, torch.optim.SGD(m.parameters(), lr=0.5)) for m in (ref, ref64, ref_r)]
    for (ids,) in batches(3):
        for m, o in runs + [(ours, opt)]:
            loss_fn(m, reversed_rows(ids) if m is ref_r else ids).backward()
            grads = [p.grad for p in m.parameters() if p.grad is not None]
            total = torch.nn.utils.get_total_norm(grads)
            torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.1, total)
            o.step()
            o.zero_grad()
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_factors_of_their_own_and_one_changed_in_place_scale_like_torch():
    """One tensor scales two gradients and is changed in place in between, then
    clip_grad_norm_ (one coefficient tensor for every .grad) and a factor tensor of each
    weight's own: each fused update uses the factors as they were when its gradient was
    scaled, as torch's materialized .grad does (FORGE keeps a copy of a factor, made once per
    step, and shares scaled hyperparameter rows between weights: neither may go stale)."""
    torch.manual_seed(0)
    ref = Net()
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt = forge_engine.optim.AdamW(ours, **kw)
    runs = [(m, torch.optim.AdamW(m.parameters(), **kw)) for m in (ref, ref64, ref_r)]
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    for (ids,) in batches(3):
        own = 0.25 + torch.rand(4, generator=g)  # one factor per weight matrix
        for m, o in runs + [(ours, opt)]:
            loss_fn(m, reversed_rows(ids) if m is ref_r else ids).backward()
            mats = [m.emb.weight, m.up.weight, m.down.weight, m.head.weight]
            shared = torch.tensor(0.5, dtype=m.emb.weight.dtype)
            mats[1].grad.mul_(shared)  # this gradient's first scaling
            shared.mul_(3.0)  # in place, between two gradients' scaling
            mats[2].grad.mul_(shared)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3)
            for p, f in zip(mats, own.to(m.emb.weight.dtype)):
                p.grad.mul_(f)
            o.step()
            o.zero_grad()
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_unscale_finds_a_nonfinite_fused_gradient_by_itself(backend):
    """GradScaler's inf check on the fused .grads alone (no standard-path gradient to give
    it away), one of them made infinite in its stashed segment: found_inf is set exactly
    when the list holds it, whether the list is every pending fused weight (one check over
    the norm batch) or a part of them (one check each)."""
    names = ["emb.weight", "up.weight", "down.weight", "head.weight"]
    for poison in (False, True):
        torch.manual_seed(0)
        model = Net(h=96)  # wide enough that its linears keep token segments
        opt = forge_engine.optim.AdamW(model, updates="step")
        params = dict(model.named_parameters())
        assert opt.fused_names == names
        loss_fn(model, batches(1)[0][0]).backward()
        if poison:  # (a fresh optimizer: no norm pass ran in this backward)
            opt._segments[model.head.weight][0][2][1, 2] = float("inf")  # its dY
        for picked in (names, names[:3], names[1:]):
            found = torch.zeros(1, device=model.head.weight.device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [params[n].grad for n in picked], found, torch.full((1,), 1.0))
            assert float(found) == float(poison and "head.weight" in picked), picked


@pytest.mark.parametrize("factor", ["number", "tensor"])
def test_a_gradient_scaled_before_another_backward_accumulates_like_torch(factor):
    """.grad scaled between two backward passes: torch scales what it holds then and adds
    the next gradient unscaled. FORGE's pending scaling must not reach the later segment:
    the weight folds its segments, scaled, into an fp32 buffer first."""
    torch.manual_seed(0)
    ref = Net(h=96)  # wide enough that its linears keep token segments
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    opt = forge_engine.optim.SGD(ours, lr=0.5, momentum=0.9)
    runs = [(m, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9))
            for m in (ref, ref64, ref_r)]
    for a, b in batches(3, micro=2):
        for m, o in runs + [(ours, opt)]:
            loss_fn(m, reversed_rows(a) if m is ref_r else a).backward()
            for p in m.parameters():
                f = 0.25 if factor == "number" else torch.tensor(0.25, dtype=p.dtype)
                p.grad.mul_(f)
            loss_fn(m, reversed_rows(b) if m is ref_r else b).backward()
            o.step()
            o.zero_grad()
    assert opt.accumulation["up.weight"] == "fp32 buffer"
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_fused_norms_are_measured_once_each_and_kept_from_edits(backend, monkeypatch):
    """clip_grad_norm_ asks each .grad for its norm, one at a time; FORGE measures every
    pending fused gradient at the first ask (one norm-only pass each, batched) and answers
    the others from that batch. Each weight's norm against float64 of torch's materialized
    gradient, rtol 1e-5 (fp32 sums of squares in another order, as compare() bounds
    clip_grad_norm_'s): after a backward, asked again after an in-place change to the norm
    the caller got (the answer is unchanged, with no pass again), and after a second backward
    added to the gradients (measured anew, once per weight)."""
    from forge_engine.kernels import PlannedUpdate
    from forge_engine.optim.base import ForgeOptimizer
    passes, planned = [], PlannedUpdate.norm
    for cls, name in ((PlannedUpdate, "norm"), (ForgeOptimizer, "_norm_only")):
        def counted(*a, _real=getattr(cls, name), **k):
            passes.append(_real)
            return _real(*a, **k)
        monkeypatch.setattr(cls, name, counted)
    torch.manual_seed(0)
    ours = Net(h=96)  # wide enough that its weights keep token segments, not fp32 buffers
    ref64 = copy.deepcopy(ours).double()
    opt = forge_engine.optim.AdamW(ours, updates="step")
    fused = [(n, p, q) for (n, p), q in zip(ours.named_parameters(), ref64.parameters())
             if n in opt.fused_names]
    assert len(fused) == 4
    for (ids,) in batches(2):
        loss_fn(ours, ids).backward()
        loss_fn(ref64, ids).backward()
        segs = {n for n, p, _ in fused if p in opt._segments}  # the rest: fp32 buffers
        assert {"up.weight", "down.weight"} <= segs
        passes.clear()
        for _, p, q in fused:
            n = p.grad.norm()
            assert n.dtype == p.dtype and float(n) == pytest.approx(float(q.grad.norm()),
                                                                     rel=1e-5)
            first = float(n)
            n.mul_(2.0)  # the caller's tensor: FORGE's answer must not change with it
            assert float(torch.linalg.vector_norm(p.grad)) == first
        assert len(passes) == len(segs)  # each weight's pass ran once
        # all but the embedding's (a one-hot segment) through the weights' update plans
        assert passes.count(planned) == len(segs - {"emb.weight"})
    opt.step()
    del opt


def test_norm_passes_run_in_backward_once_a_step_asked_for_them(monkeypatch):
    """After a step whose clipping asked for the fused norms at some count of segments, the
    next step runs each planned weight's norm-only pass in backward once it has that many
    (the device idles there), and clipping only sums the parts: one micro-batch per step,
    then two (the passes at the first backward are in vain, clipping runs them again; the
    next step runs them at the second backward). The weights against torch.optim
    (compare()'s rule), the norms to rel 1e-5 as compare() checks them."""
    from forge_engine.kernels import PlannedUpdate
    where, real = [], PlannedUpdate.norm

    def counted(*a, **k):
        where.append(1)
        return real(*a, **k)
    monkeypatch.setattr(PlannedUpdate, "norm", counted)
    data = batches(2) + batches(2, micro=2)
    kw = dict(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    ref = Net(h=96)  # wide enough that its linears keep token segments
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    n_ref = [loop(m, torch.optim.AdamW(m.parameters(), **kw), d, clip=0.3)
             for m, d in ((ref, data), (ref64, data), (ref_r, reversed_rows(data)))][0]
    opt = forge_engine.optim.AdamW(ours, **kw, updates="step")
    norms, seen = [], []
    for micro in data:
        where.clear()
        for ids in micro:
            (loss_fn(ours, ids) / len(micro)).backward()
        in_backward = len(where)
        planned = [n for n, p in ours.named_parameters()
                   if p in opt._segments and n != "emb.weight"]  # (a one-hot segment)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.3)))
        seen.append((in_backward, len(where) - in_backward, len(planned)))
        opt.step()
        opt.zero_grad()
    assert_fp32_close(ours, ref, ref64, also=[ref_r])
    assert norms == pytest.approx(n_ref, rel=1e-5)
    (b1, c1, n1), (b2, c2, n2), (b3, c3, n3), (b4, c4, n4) = seen
    assert min(n1, n2, n3, n4) >= 2  # up and down at least
    assert (b1, c1) == (0, n1) and (b2, c2) == (n2, 0)
    assert b3 == n2 and c3 == n3  # in vain at the first backward, then in clipping
    assert (b4, c4) == (n4, 0)


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model, before):
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_clip_grad_value_is_refused_before_any_weight_changes():
    model = Net()
    opt = forge_engine.optim.AdamW(model)
    before = snapshot(model)
    loss_fn(model, batches(1)[0][0]).backward()
    with pytest.raises(RuntimeError, match=r"clip_grad_value_.*'emb.weight'.*standard=\["):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    assert unchanged(model, before)
    del opt


def test_reading_a_fused_grad_is_refused_naming_the_weight():
    model = Net()
    opt = forge_engine.optim.AdamW(model)
    loss_fn(model, batches(1)[0][0]).backward()
    with pytest.raises(RuntimeError, match=r"abs on the .grad of FORGE weight 'up.weight'.*"
                                           r"never materialized"):
        model.up.weight.grad.abs()
    with pytest.raises(RuntimeError, match=r"never materialized"):
        model.up.weight.grad + 1
    with pytest.raises(RuntimeError, match=r"ord=inf"):
        torch.linalg.vector_norm(model.up.weight.grad, float("inf"))
    del opt


def test_standard_keyword_keeps_named_weights_on_the_standard_path():
    torch.manual_seed(0)
    model = Net()
    ref, ref64, ref_r = copy.deepcopy(model), copy.deepcopy(model).double(), copy.deepcopy(model)
    opt = forge_engine.optim.SGD(model, lr=0.5, standard=["up.weight", model.head.weight])
    assert opt.fused_names == ["emb.weight", "down.weight"]
    assert "up.weight (asked for (standard=...))" in opt.forge_summary()
    runs = [(m, torch.optim.SGD(m.parameters(), lr=0.5)) for m in (ref, ref64, ref_r)]
    for (ids,) in batches(2):
        for m, o in [(model, opt)] + runs:
            loss_fn(m, reversed_rows(ids) if m is ref_r else ids).backward()
            torch.nn.utils.clip_grad_value_([m.up.weight], 0.001)  # a standard-path weight
            o.step()
            o.zero_grad()
    assert_fp32_close(model, ref, ref64, also=[ref_r])


def test_clipping_after_a_plain_first_step_is_an_error_naming_the_fix():
    """updates='auto' saw a plain first step and updates in backward from then on: a loop
    that starts clipping later is refused (that step's fused updates have run)."""
    model = Net()
    opt = forge_engine.optim.AdamW(model)
    (a,), (b,) = batches(2)
    loss_fn(model, a).backward()
    opt.step()
    opt.zero_grad()
    assert opt._mode == "backward"
    loss_fn(model, b).backward()
    with pytest.raises(RuntimeError, match=r"after its update.*updates='auto' chose "
                                           r"'backward'.*updates='step'"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_plain_loop_after_the_first_step_updates_in_backward():
    torch.manual_seed(0)
    model = Net()
    opt = forge_engine.optim.AdamW(model)
    (a,), (b,) = batches(2)
    loss_fn(model, a).backward()
    assert opt.deferred_bytes() > 0  # the first step waits for step()
    opt.step()
    before = model.up.weight.detach().clone()
    loss_fn(model, b).backward()
    assert not torch.equal(model.up.weight, before)  # updated in backward
    assert opt.deferred_bytes() == 0
    opt.step()


@pytest.mark.parametrize("how", ["optimizer", "model", "set_to_none_false"])
def test_zero_grad_between_backward_passes_drops_the_first_as_torch_does(how):
    torch.manual_seed(0)
    ref = Net()
    ours, ref64 = copy.deepcopy(ref), copy.deepcopy(ref).double()
    opt = forge_engine.optim.AdamW(ours, lr=1e-2, updates="step")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o64 = torch.optim.AdamW(ref64.parameters(), lr=1e-2)
    ref_r = copy.deepcopy(ref)
    o_r = torch.optim.AdamW(ref_r.parameters(), lr=1e-2)
    for micro in batches(3, micro=2):
        for m, o in ((ref, o_ref), (ref64, o64), (ours, opt), (ref_r, o_r)):
            a, b = reversed_rows(micro) if m is ref_r else micro
            loss_fn(m, a).backward()
            if how == "optimizer":
                o.zero_grad()
            elif how == "model":
                m.zero_grad()
            else:
                o.zero_grad(set_to_none=False)
            loss_fn(m, b).backward()
            o.step()
            o.zero_grad()
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_a_gradient_cleared_before_step_updates_nothing():
    """model.zero_grad() (grads to None) between backward and step: torch.optim skips every
    parameter without a gradient, so FORGE updates none of the fused weights either."""
    model = Net()
    opt = forge_engine.optim.AdamW(model, updates="step")
    before = snapshot(model)
    loss_fn(model, batches(1)[0][0]).backward()
    model.zero_grad()
    opt.step()
    assert unchanged(model, before)


class _Checkpointed(nn.Module):
    """Net with its up and down linears under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.net, self.reentrant = Net(), reentrant

    def forward(self, ids):
        from torch.utils.checkpoint import checkpoint
        n = self.net
        h = checkpoint(lambda t: n.down(torch.tanh(n.up(t))), n.emb(ids),
                       use_reentrant=self.reentrant)
        return n.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_trains_like_torch(reentrant, monkeypatch):
    """torch.utils.checkpoint around fused linears trains as with torch.optim. Without
    reentrancy the forward runs under saved-tensor hooks: the linears inside must take
    ForgeLinearFunction, whose saved input the checkpoint drops and recomputes, not the
    hooked node (linear._hooked_linear), whose hook would keep it alive; the head outside,
    and the reentrant recomputation inside backward, take the hooked node."""
    from forge_engine import linear
    taken = []
    hooked, apply = linear._hooked_linear, linear.ForgeLinearFunction.apply
    monkeypatch.setattr(linear, "_hooked_linear",
                        lambda *a: (taken.append("hook"), hooked(*a))[1])
    monkeypatch.setattr(linear.ForgeLinearFunction, "apply",
                        lambda *a: (taken.append("function"), apply(*a))[1])
    steps = 3
    compare(lambda: _Checkpointed(reentrant), batches(steps))
    if reentrant:  # the no-grad forward: F.linear; its recomputation: hooked
        assert taken.count("function") == 0 and taken.count("hook") == 3 * steps
    else:  # up and down in the forward and in the recomputation; the head
        assert taken.count("function") == 4 * steps and taken.count("hook") == steps


def test_a_fused_linears_input_is_freed_by_its_backward():
    """A linear's input is released once backward has used it, as torch frees a saved input,
    though the graph (held by the loss) outlives the backward: the fused update's hook on
    torch's node must not keep it (on a GPU, every linear's input through all of backward)."""
    model = Net()
    forge_engine.optim.AdamW(model, updates="step")
    inputs = []
    model.down.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    loss = loss_fn(model, batches(1)[0][0])
    assert inputs[0]() is not None  # alive in the graph before backward: tanh saves it
    loss.backward()
    assert inputs[0]() is None and loss.grad_fn is not None


@pytest.mark.parametrize("updates", ["auto", "step"])
def test_backward_twice_through_a_retained_graph_trains_like_torch(updates):
    """loss.backward(retain_graph=True) and loss.backward(): torch accumulates the gradient
    twice; FORGE's fused linears must see their input in the second backward too."""
    compare(Net, batches(3), forge_kw=dict(updates=updates), twice=True)


def _edit(how, model, opt):
    """One change that code between two steps makes to an optimizer's state or a weight."""
    params = list(model.parameters())
    if how == "state cleared":
        opt.state.clear()
    elif how == "moments reset":
        for p in params:
            opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])
    elif how == "step counts rewound in place":
        for p in params:
            opt.state[p]["step"].fill_(1.0)
    else:  # weights moved to new memory
        for p in params:
            p.data = p.data.clone()


@pytest.mark.parametrize("how", ["state cleared", "moments reset",
                                 "step counts rewound in place", "weights moved"])
def test_state_and_weight_edits_between_steps_are_followed_as_torch_does(how):
    """torch.optim reads its state and the weights afresh at every step; FORGE keeps what an
    update looks up from step to step, and must notice each of these edits made after a plain
    step (the fused weights then update in backward): its weights agree with torch.optim's."""
    torch.manual_seed(0)
    ref = Net()
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    runs = [(m, o(m.parameters() if o is torch.optim.AdamW else m, lr=1e-2, weight_decay=0.1))
            for m, o in ((ref, torch.optim.AdamW), (ref64, torch.optim.AdamW),
                         (ours, forge_engine.optim.AdamW), (ref_r, torch.optim.AdamW))]
    for s, (ids,) in enumerate(batches(5)):
        for m, o in runs:
            if s == 3:
                _edit(how, m, o)
            loss_fn(m, reversed_rows(ids) if m is ref_r else ids).backward()
            o.step()
            o.zero_grad()
    assert runs[2][1]._mode == "backward"
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_copies_are_plain_modules_that_no_optimizer_updates():
    torch.manual_seed(0)
    model = Net()
    opt = forge_engine.optim.AdamW(model, lr=1e-2)
    (a,), (b,) = batches(2)
    loss_fn(model, a).backward()  # a pending FusedGrad while the copies are taken
    deep = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = Net()
    fresh.load_state_dict(model.state_dict())
    for c in (deep, loaded, fresh):
        assert type(c.up) is nn.Linear and type(c.emb) is nn.Embedding
        assert c.up.weight.grad is None
        with torch.no_grad():
            torch.testing.assert_close(c(b), model(b), rtol=0, atol=0)
    frozen = snapshot(deep)
    opt.step()
    loss_fn(model, b).backward()
    opt.step()
    assert unchanged(deep, frozen)
    loss_fn(deep, b).backward()  # an ordinary module: ordinary gradients
    assert type(deep.up.weight.grad) is torch.Tensor


def test_embedding_options_that_cannot_fuse_are_named():
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 3))
    with pytest.warns(UserWarning, match=r"1 of the model's 2 weight matrices stays .*0\.weight "
                                         r"\(nn\.Embedding with max_norm"):
        opt = forge_engine.optim.SGD(model, lr=0.1)
    assert opt.forge_summary().endswith(
        "standard path: 0.weight (nn.Embedding with max_norm (renormalizes rows in forward))")
    model = nn.Sequential(nn.Linear(4, 3))
    model.w = nn.Parameter(torch.randn(3, 3))
    with pytest.warns(UserWarning, match=r"1 of the model's 2 weight matrices stays .*: w "):
        opt = forge_engine.optim.SGD(model, lr=0.1)
    assert "w (not the weight of an nn.Linear, nn.Embedding, nn.MultiheadAttention or " \
        "Conv1D)" in opt.forge_summary()


class Encoder(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 40, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 5)
        self.batch_first = batch_first

    def forward(self, x):
        seq = x.shape[1] if self.batch_first else x.shape[0]
        mask = nn.Transformer.generate_square_subsequent_mask(seq)
        return self.head(self.enc(x, mask=mask, is_causal=True))


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_fuses_every_matrix_and_trains_like_torch(batch_first):
    """AdamW on nn.TransformerEncoder. The keys' in-projection bias has an exact gradient of 0
    (softmax ignores a shift shared by all keys), so AdamW turns rounding noise there into
    lr-sized steps, in torch.optim's fp32 runs too: tests/closeness.py's bound, a multiple of
    their own error against float64, covers that and stays tight elsewhere."""
    torch.manual_seed(0)
    ref = Encoder(batch_first)
    ours, ref64, ref_r = copy.deepcopy(ref), copy.deepcopy(ref).double(), copy.deepcopy(ref)
    opt = forge_engine.optim.AdamW(ours, lr=1e-2)
    assert opt.forge_summary().startswith("FORGE: fused 9 of 9 weight matrices")
    runs = [(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)), (ours, opt),
            (ref64, torch.optim.AdamW(ref64.parameters(), lr=1e-2)),
            (ref_r, torch.optim.AdamW(ref_r.parameters(), lr=1e-2))]
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    batch = 0 if batch_first else 1
    for _ in range(3):
        shape = (3, 7, 16) if batch_first else (7, 3, 16)
        x, y = torch.randn(shape, generator=g), torch.randn(shape[:2] + (5,), generator=g)
        for m, o in runs:
            dt = next(m.parameters()).dtype
            xm, ym = (x.flip(batch), y.flip(batch)) if m is ref_r else (x, y)
            ((m(xm.to(dt)) - ym.to(dt)) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


@pytest.mark.parametrize("case", ["cross-weights-per-head", "self-bool-masks", "unbatched"])
def test_multihead_attention_gives_torchs_outputs_and_gradients(case):
    """nn.MultiheadAttention directly: cross attention (query unlike key and value),
    need_weights with per-head weights, bool attn_mask and key_padding_mask, unbatched."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(12, 3, bias=case != "unbatched")
    ours = copy.deepcopy(ref)
    opt = forge_engine.optim.SGD(ours, lr=0.1)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    q, kv, float_mask = torch.randn(5, 2, 12), torch.randn(6, 2, 12), torch.randn(5, 6)
    for m, o in ((ref, o_ref), (ours, opt)):
        if case == "cross-weights-per-head":
            out, w = m(q, kv, kv, attn_mask=float_mask, average_attn_weights=False)
        elif case == "self-bool-masks":
            am = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
            kpm = torch.zeros(2, 5, dtype=torch.bool)
            kpm[1, -1] = True
            out, w = m(q, q, q, attn_mask=am, key_padding_mask=kpm)
        else:
            out, w = m(q[:, 0], q[:, 0], q[:, 0])
        (out.square().sum() + w.square().sum()).backward()
        m.outputs = (out.detach(), w.detach())
        o.step()
        o.zero_grad()
    for a, b in zip(ours.outputs, ref.outputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ Hugging Face loops
transformers = pytest.importorskip("transformers")


def tiny_llama(tied):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
        self.ids = torch.randint(0, 97, (16, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_runs(base, data, tmp_path, **args):
    """Trainer(optimizers=(opt, scheduler)) with its defaults (max_grad_norm 1.0) and `args`:
    torch.optim.AdamW in fp32, the same in float64, FORGE, and torch.optim.AdamW in fp32 on each
    batch's rows reversed. Each run's model, losses and gradient norms."""
    runs = []
    for name in ("torch", "torch64", "forge", "torch-reversed"):
        model = copy.deepcopy(base).to(torch.float64 if name == "torch64" else torch.float32)
        opt = (forge_engine.optim.AdamW(model, lr=1e-3, weight_decay=0.1) if name == "forge"
               else torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
        if name == "forge":
            assert opt.forge_summary().endswith("standard path: none")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        targs = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=4, per_device_train_batch_size=2,
            logging_steps=1, report_to=[], save_strategy="no", seed=0,
            dataloader_num_workers=0, disable_tqdm=True, **args)
        collate = ((lambda rows: transformers.default_data_collator(rows[::-1]))
                   if name == "torch-reversed" else None)
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=data,
                                       optimizers=(opt, sched), data_collator=collate)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        runs.append((model, [h["loss"] for h in logs], [h["grad_norm"] for h in logs]))
    return runs


def assert_trainer_runs_alike(runs, max_norm: float = 1.0):
    (ref, l_ref, n_ref), (ref64, _, _), (ours, l_ours, n_ours), (ref_r, _, _) = runs
    assert len(l_ref) == 4 and all(n > max_norm for n in n_ref)  # clipped at every step
    assert l_ours == pytest.approx(l_ref, rel=1e-5)
    assert n_ours == pytest.approx(n_ref, rel=1e-5)
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


@pytest.mark.parametrize("ga,tied", [(1, True), (2, False)])
def test_hf_trainer_with_its_defaults_trains_like_torch_adamw(ga, tied, tmp_path):
    """Trainer(optimizers=(opt, scheduler)) with its defaults: max_grad_norm 1.0 (active here:
    every step's norm is above it), gradient accumulation 1 and 2. Same losses, gradient
    norms and weights as torch.optim.AdamW."""
    assert_trainer_runs_alike(trainer_runs(tiny_llama(tied), Tokens(), tmp_path, use_cpu=True,
                                           gradient_accumulation_steps=ga))


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_weight_gradients_are_exact_products_of_the_operands(dtype, clip):
    """torch.autocast on an fp32 model (Trainer's bf16=True / fp16=True): a fused linear's
    forward is autocast's, and its weight gradient is dY^T X from the operands autograd
    hands the linear's node (dY in the autocast dtype; X the input: fp32 after an RMSNorm,
    the autocast dtype after attention or the MLP's product), summed in fp32, where torch's
    own is a bf16 / fp16 GEMM of X cast down. With SGD at lr 1 one step moves each fused
    weight by its gradient: against the float64 product of the operands captured in torch's
    run (the same forward: the losses are equal), each element is within fp32 summation's
    bound over T tokens, T 2^-24 (|dY|^T |X|), plus the rounding of w - g (2^-23 |w|).
    torch's gradient is far outside that bound, so the bound tells them apart.
    clip: clip_grad_norm_ (at a norm it does not reach) before step(), as Trainer does, so
    the segments are stashed and updated in step(): its norm is the float64 norm of those
    products and of the other gradients (fp32's rtol)."""
    base = tiny_llama(False)
    ids = torch.randint(0, 97, (2, 12))
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    seen = {}
    for name, m in ref.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(
                lambda m, i, o, name=name: seen.update({name: [i[0].detach()]}))
            m.register_full_backward_hook(
                lambda m, gi, go, name=name: seen[name].append(go[0].detach()))
    opt = forge_engine.optim.SGD(ours, lr=1.0)
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    losses = []
    for model in (ref, ours):
        with torch.autocast("cpu", dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e9)
    opt.step()
    assert torch.equal(*losses) and opt._mode == ("step" if clip else "backward")
    assert opt.forge_summary().endswith("standard path: none") and len(seen) == 2 * 7 + 1
    weights, grads = dict(ours.named_parameters()), dict(ref.named_parameters())
    torch_worst = 0.0
    for name, (x, dy) in seen.items():
        assert dy.dtype == dtype and x.dtype in (torch.float32, dtype)
        x, dy = x.reshape(-1, x.shape[-1]).double(), dy.reshape(-1, dy.shape[-1]).double()
        exact, scale = dy.t() @ x, dy.abs().t() @ x.abs()
        w0 = before[name + ".weight"].double()
        bound = x.shape[0] * 2.0 ** -24 * scale + 2.0 ** -23 * w0.abs()
        g = w0 - weights[name + ".weight"].detach().double()
        assert bool(((g - exact).abs() <= bound).all()), name
        torch_worst = max(torch_worst, float(((grads[name + ".weight"].grad.double() - exact)
                                               .abs() / bound).max()))
    assert torch_worst > 10
    assert {x.dtype for x, _ in seen.values()} == {torch.float32, dtype}
    if clip:  # the linears' exact products; the embedding's and norms' gradients are torch's
        sumsq = sum(float((dy.reshape(-1, dy.shape[-1]).double().t()
                           @ x.reshape(-1, x.shape[-1]).double()).pow(2).sum())
                    for x, dy in seen.values())
        sumsq += sum(float(p.grad.double().pow(2).sum()) for n, p in ref.named_parameters()
                     if n.removesuffix(".weight") not in seen)
        assert float(norm) == pytest.approx(sumsq ** 0.5, rel=1e-5)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_trainer_with_gradient_checkpointing_trains_like_torch_adamw(reentrant, tmp_path):
    """Trainer(activation_checkpointing=True), the memory saving fine-tuning turns on: every
    decoder layer's forward runs again in backward (through torch.utils.checkpoint, reentrant
    or not), so each FORGE linear's backward sees the recomputed input. Same losses, norms
    and weights as torch.optim.AdamW."""
    runs = trainer_runs(tiny_llama(False), Tokens(), tmp_path, use_cpu=True,
                        activation_checkpointing=True,  # (gradient_checkpointing before 5.23)
                        activation_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
               for model, _, _ in runs)  # (what transformers' own check of it looks at)
    assert_trainer_runs_alike(runs)


def test_hf_trainer_resumes_from_its_checkpoint_exactly(tmp_path):
    """Trainer(save_steps=2), then trainer.train(resume_from_checkpoint=...) on a fresh model
    and FORGE optimizer: Trainer saves the optimizer's state_dict with the model and loads
    both back. bf16 weights with int8 moments (stochastic rounding, whose seeds follow the
    step count, and quantized states) end bitwise where four uninterrupted steps end."""
    base, data = tiny_llama(False).to(torch.bfloat16), Tokens()

    def train(out, resume=None, save=False):
        model = copy.deepcopy(base)
        opt = forge_engine.optim.AdamW(model, lr=1e-3, weight_decay=0.1, state_dtype="int8")
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=2, report_to=[],
            save_strategy="steps" if save else "no", save_steps=2, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, use_cpu=True)
        transformers.Trainer(model=model, args=args, train_dataset=data,
                             optimizers=(opt, None)).train(resume_from_checkpoint=resume)
        return model

    straight = train(tmp_path / "straight")
    train(tmp_path / "saved", save=True)
    assert (tmp_path / "saved" / "checkpoint-2" / "optimizer.pt").exists()
    resumed = train(tmp_path / "saved", resume=str(tmp_path / "saved" / "checkpoint-2"))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), base.parameters()))


def test_hf_trainer_on_a_peft_lora_model_trains_like_torch_adamw(tmp_path):
    """A PEFT LoRA model (peft.get_peft_model): the base weights are frozen, the adapters'
    lora_A / lora_B are the only trained matrices, and FORGE fuses exactly those. Trainer,
    clipping every step, gives the same losses, norms and weights as torch.optim.AdamW,
    and leaves every frozen weight as it was."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "down_proj"]
    base = peft.get_peft_model(tiny_llama(False), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():  # (lora_B starts at zero: lora_A's first gradient would be zero)
        for n, p in base.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    # (the adapters' gradient norm is about 0.5: clipped at 0.1, every step clips)
    runs = trainer_runs(base, Tokens(), tmp_path, use_cpu=True, max_grad_norm=0.1)
    assert_trainer_runs_alike(runs, max_norm=0.1)
    ours = runs[2][0]
    assert all(torch.equal(p, frozen[n]) for n, p in ours.named_parameters() if n in frozen)
    trained = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * len(targets) * 2 and all("lora_" in n for n in trained)


class Logits(nn.Module):
    """A causal LM as the plain loops here call it: ids -> logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids).logits


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "clipped"])
def test_gpt2_conv1d_weights_fuse_and_train_like_torch(clip, recwarn):
    """Every weight matrix of GPT-2 fuses, its Conv1D ones as W [in, out] (dW = X^T dY), with
    no warning; the plain loop (each update in backward, through the hook on torch's node) and
    the clipped one (segments stashed, the norm pass, the update in step()) train as
    torch.optim does."""
    opt, _ = compare(lambda: Logits(tiny_gpt2()), batches(4, micro=2 if clip else 1, vocab=97),
                     clip=clip)
    assert opt.forge_summary().startswith("FORGE: fused 10 of 10 weight matrices")
    assert [s.transposed for s in opt._slots.values()].count(True) == 8
    assert not [w for w in recwarn if "forge_engine" in str(w.message)]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hf_trainer_on_gpt2_trains_like_torch_adamw(checkpointing, tmp_path):
    """GPT-2 under Trainer with its defaults (clipping at 1.0 every step), with activation
    checkpointing too (the Conv1D's recomputed forward, its backward through the Function):
    same losses, norms and weights as torch.optim.AdamW."""
    args = dict(activation_checkpointing=True) if checkpointing else {}
    assert_trainer_runs_alike(trainer_runs(tiny_gpt2(), Tokens(), tmp_path, use_cpu=True,
                                           **args))


def tiny_gemma3():
    """transformers' Gemma 3: its token embedding (a Gemma3TextScaledWordEmbedding, whose
    forward scales nn.Embedding's by sqrt(hidden)) is tied to the LM head."""
    cfg = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "clipped"])
def test_gemma3_scaled_embedding_fuses_and_trains_like_torch(clip, recwarn):
    """transformers' *ScaledWordEmbedding (Gemma, BART, ...) is an nn.Embedding subclass whose
    forward scales super().forward(ids): FORGE's lookup runs inside it, so Gemma 3's
    embedding, tied to its LM head (the model's largest matrix), fuses with every other
    weight, with no warning, and trains as torch.optim does."""
    model = Logits(tiny_gemma3())
    assert type(model.lm.model.embed_tokens).__name__ == "Gemma3TextScaledWordEmbedding"
    opt, _ = compare(lambda: copy.deepcopy(model), batches(4, vocab=97), clip=clip)
    assert opt.forge_summary().startswith("FORGE: fused 15 of 15 weight matrices")
    assert "lm.model.embed_tokens.weight" in opt.fused_names
    assert not [w for w in recwarn if "forge_engine" in str(w.message)]


def test_hf_trainer_on_gemma3_trains_like_torch_adamw(tmp_path):
    """Gemma 3 under Trainer with its defaults: same losses, norms and weights as
    torch.optim.AdamW."""
    assert_trainer_runs_alike(trainer_runs(tiny_gemma3(), Tokens(), tmp_path, use_cpu=True))


def test_a_scaled_embedding_that_bypasses_its_lookup_is_refused():
    """A *ScaledWordEmbedding whose forward does not call nn.Embedding's gives the weight a
    gradient FORGE's update never sees: refused at the first backward, naming the weight
    and standard=[...], before any weight changes."""
    class OddScaledWordEmbedding(nn.Embedding):
        def forward(self, ids):
            return nn.functional.embedding(ids, self.weight) * 2.0
    OddScaledWordEmbedding.__module__ = "transformers.models.odd.modeling_odd"
    model = nn.Sequential(OddScaledWordEmbedding(11, 4), nn.Linear(4, 11))
    opt = forge_engine.optim.SGD(model, lr=0.1)
    assert opt.forge_summary().endswith("standard path: none")
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"'0\.weight' received a gradient from outside its "
                                           r"FORGE linear .*standard=\['0\.weight'\]"):
        model(torch.randint(0, 11, (3,))).sum().backward()
    assert unchanged(model, before)
    forge_engine.optim.SGD(model := copy.deepcopy(model), lr=0.1, standard=["0.weight"])
    model(torch.randint(0, 11, (3,))).sum().backward()


def test_accelerate_loop_with_clipping_and_accumulation_like_torch():
    accelerate = pytest.importorskip("accelerate")
    base, data = tiny_llama(False), Tokens()
    out = []
    for name in ("torch", "torch64", "forge", "torch-reversed"):
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = copy.deepcopy(base).to(torch.float64 if name == "torch64" else torch.float32)
        opt = (forge_engine.optim.AdamW(model, lr=1e-3) if name == "forge"
               else torch.optim.AdamW(model.parameters(), lr=1e-3))
        model, opt = acc.prepare(model, opt)
        for i in range(0, 16, 2):
            with acc.accumulate(model):
                batch = data[slice(i, i + 2)]
                if name == "torch-reversed":
                    batch = {k: reversed_rows(v) for k, v in batch.items()}
                loss = model(**batch).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        out.append(model)
    assert_fp32_close(out[2], out[0], out[1], also=[out[3]])


# ------------------------------------------------------------------ the same loops on a GPU
# On CUDA, torch takes other paths through the same loops: clip_grad_norm_ groups the gradients
# by device and calls _foreach_norm / _foreach_mul_, GradScaler unscales with its CUDA kernel,
# and Trainer moves the model to the card. The compiled Triton kernel applies the updates.

@pytest.mark.gpu
@pytest.mark.parametrize("updates", ["auto", "step"])
@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_grad_scaler_and_clipping_on_cuda_like_torch(name, updates, monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    kw = dict(lr=1e-2, weight_decay=0.1) if name == "AdamW" else dict(lr=0.5, momentum=0.9)
    data = [[ids.cuda() for ids in micro] for micro in batches(5, micro=2)]
    opt, norms = compare(lambda: Net().cuda(), data, name, kw, dict(updates=updates),
                         scaler=torch.amp.GradScaler("cuda", init_scale=2.0 ** 12),
                         clip=1.0, inf_at=(2,))
    assert norms[2] != norms[2] and opt._mode == "step"


@pytest.mark.gpu
@pytest.mark.parametrize("ga,model", [(1, "llama"), (2, "llama"), (1, "gpt2"), (1, "gemma3")])
def test_hf_trainer_on_cuda_like_torch_adamw(ga, model, tmp_path, monkeypatch):
    """Trainer on the card, fp32, its default clipping at 1.0: FORGE's losses, norms and weights
    against torch.optim.AdamW's, within the CPU test's tolerances; GPT-2's Conv1D weights
    through the kernel with the operands' roles swapped, Gemma 3's scaled embedding."""
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    base = tiny_llama(False) if model == "llama" else {"gpt2": tiny_gpt2,
                                                       "gemma3": tiny_gemma3}[model]()
    runs = trainer_runs(base, Tokens(), tmp_path, gradient_accumulation_steps=ga)
    assert all(next(model.parameters()).is_cuda for model, _, _ in runs)
    assert_trainer_runs_alike(runs)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,split", [(200, "0"), (200, "auto"), (1100, "auto")])
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_plain_loop_makes_no_synchronizing_cuda_call(state_dtype, tokens, split, monkeypatch):
    """transformers' Llama in bf16, every weight fused, the plain loop: once the first steps
    have compiled the kernels and bound the plans, its forward, backward, step() and
    zero_grad() make no CUDA call that waits for the device (torch's sync debug mode set to
    "error" raises at one; the loss's .item() shows that it does). Where the card has the
    warp-specialized kernel, it takes the updates at FORGE_WS_SPLIT=auto (the split design
    at 200 tokens, SPLIT_LARGE above 1024); FORGE_WS_SPLIT=0 sends those of 200 tokens to the
    Triton kernel."""
    from forge_engine.kernels import fused_update as fu
    monkeypatch.setenv("FORGE_BACKEND", "triton")
    monkeypatch.setattr(fu, "_WS_SPLIT", split)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    opt = forge_engine.optim.AdamW(model, lr=1e-3, weight_decay=0.1, state_dtype=state_dtype)
    assert len(opt._fused) == len(list(model.parameters())) - 5  # all but the 5 norm weights
    ids = torch.randint(0, 1000, (4, 1, tokens), device="cuda")

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for x in ids[:3]:
        step(x)
    before = [p.detach().clone() for p in opt._fused]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step(ids[3])
        with pytest.raises(RuntimeError, match="synchroniz"):
            loss.item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(not torch.equal(a, p) for a, p in zip(before, opt._fused))

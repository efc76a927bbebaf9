"""CUDA graph steps (forge_engine/graphs.py) and what they rest on.

A replayed graph runs no Python, so FORGE keeps a step's changing values in device memory: each
parameter's hp row (lr, bias corrections, and the step's part of the rounding seed), written by
advance_static_step() before each replay. On the CPU the host half is checked by running the
same Python step with those static rows (what capture records) and comparing with eager steps
bit for bit; on a GPU the real capture and replay are compared with eager steps."""
import copy
import math
import os

import pytest
import torch
from torch import nn

import forge_engine
from forge_engine.engine import Engine
from forge_engine.graphs import CudaGraphStep, device_step
from forge_engine.kernels import StateTensor, fused_wgrad_update
from forge_engine.model import GPT, preset
from forge_engine.kernels import rules as R

ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def schedule(i):  # a changing lr: every step's hp differs
    return 1e-2 * (i + 1) / 7


def tiny_gpt(device="cpu", dtype=torch.bfloat16):
    torch.manual_seed(0)
    return GPT(preset("tiny"), params_dtype=dtype, seed=0, init_device=str(device)).to(device)


def batches(n, device="cpu", seed=5, shape=(2, 33)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, shape, generator=g).to(device) for _ in range(n)]


def loss_of(model):
    return lambda b: model(b[:, :-1], labels=b[:, 1:]).mean()


def weights_and_states(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        st = opt.state.get(p, {})
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    return out


def static_steps(eng, model, data, applied=None):
    """What CudaGraphStep does per replay, with the captured body (device_step) run again on
    the CPU: lr from the schedule, the host half (advance_static_step), the step, and the
    fresh .grad a replay would overwrite. applied: a list that gets each step's
    optimizer.grad_norm (the norm of the gradients the step applied)."""
    out = []
    for x in data:
        for g in eng.optimizer.param_groups:
            g["lr"] = schedule(eng.iteration)
        eng.optimizer.advance_static_step()
        loss, norm_sq, _ = device_step(eng, lambda: loss_of(model)(x))
        eng.optimizer.replayed_static_step()
        if applied is not None:
            applied.append(float(eng.optimizer.grad_norm))
        eng.optimizer.zero_grad(set_to_none=True)
        eng.iteration += 1
        out.append((float(loss), math.sqrt(float(norm_sq))))
    return out


@pytest.mark.parametrize("optimizer,clip", [("adamw", 0.0), ("nadam", 0.0), ("sgd", 0.0),
                                            ("adamw", 0.05)])
def test_static_rows_reproduce_eager_steps_bitwise(optimizer, clip):
    """Tied embedding (deferred), QK/RMS norms (standard path), fused linears; bf16 weights
    with stochastic rounding, so every step's seed must be the eager one; an lr schedule and
    (NAdam) the host scalar mu_product must advance exactly as in eager steps. clip 0.05 is
    below every step's norm here: the factor, computed on the device in float64 as Engine does
    on the host, must scale the fused updates (their hp rows) and the norms' .grad alike, and
    the norm each step applied (optimizer.grad_norm: the kernels' sums scaled by the factor
    in the hp rows) must be the eager step's."""
    kw = dict(lr=1e-2, weight_decay=0.1, seed=11, lr_schedule=schedule, clip_grad=clip)
    if optimizer == "sgd":
        kw["momentum"] = 0.9
    data = batches(6)
    a_model = tiny_gpt()
    b_model = copy.deepcopy(a_model)
    a = Engine(a_model, optimizer, **kw)
    b = Engine(b_model, optimizer, **kw)
    sa, applied_a, applied_b = [], [], []
    for x in data:
        sa.append(a.train_step(lambda: loss_of(a_model)(x)))
        applied_a.append(float(a.optimizer.grad_norm))
    sb = [b.train_step(lambda: loss_of(b_model)(x)) for x in data[:2]]
    b.optimizer.capture_static_step()
    got = [(s.loss, s.grad_norm) for s in sb] + static_steps(b, b_model, data[2:], applied_b)
    assert got == [(s.loss, s.grad_norm) for s in sa]
    assert applied_b == applied_a[2:]
    if clip:
        assert all(s.grad_norm > clip for s in sa)  # every step was clipped
        assert all(n == pytest.approx(clip, rel=1e-4) for n in applied_a)  # clipped to it
    for u, v in zip(weights_and_states(a_model, a.optimizer),
                    weights_and_states(b_model, b.optimizer)):
        assert torch.equal(u, v)
    assert a.optimizer._global_step == b.optimizer._global_step == 6


class ThreeLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(24, 72), nn.Linear(72, 40), nn.Linear(40, 16)
        self.poison = False

    def forward(self, x):
        h = self.fc1(x)
        if self.poison:  # NaN in rows 3 and 5 of fc1's output gradient: fc1's alone
            h.register_hook(lambda g: g.index_fill(0, torch.tensor([3, 5]), float("nan")))
        return self.fc3(torch.tanh(self.fc2(torch.tanh(h)))).pow(2).mean()


def test_static_clipped_step_with_a_nonfinite_gradient_is_the_eager_one():
    """A clipped step whose norm is NaN has a NaN clip factor. The eager Engine scales nothing
    then (scale_gradients(nan) does not clip); a captured step, which computes the factor on
    the device, must do the same: else the NaN reaches every fused weight's hp row, every
    update and norm slot (all fused weights named, the finite ones' weights made NaN)."""
    torch.manual_seed(3)
    a_net = ThreeLinears()
    b_net = copy.deepcopy(a_net)
    a = Engine(a_net, "adamw", lr=1e-3, clip_grad=0.05)
    b = Engine(b_net, "adamw", lr=1e-3, clip_grad=0.05)
    x = torch.randn(10, 24)
    a.train_step(lambda: a_net(x))
    b.train_step(lambda: b_net(x))
    b.optimizer.capture_static_step()
    a_net.poison = b_net.poison = True
    stats = a.train_step(lambda: a_net(x))
    b.optimizer.advance_static_step()
    _, norm_sq, sums = device_step(b, lambda: b_net(x))
    b.optimizer.replayed_static_step()
    assert not math.isfinite(float(norm_sq)) and not math.isfinite(stats.grad_norm)
    assert b._nonfinite_names(sums) == stats.nonfinite == ["fc1.weight", "fc1.bias"]
    for (name, u), v in zip(a_net.named_parameters(), b_net.parameters()):
        torch.testing.assert_close(v, u, rtol=0, atol=0, equal_nan=True, msg=name)
    assert all(torch.isfinite(p).all() for n, p in a_net.named_parameters() if n != "fc1.bias")


@pytest.mark.parametrize("regroup", [True, False], ids=["regrouped", "stale-classes"])
def test_static_rows_follow_a_step_count_set_by_hand(regroup, monkeypatch):
    """advance_static_step() computes one hp row per class of parameters that share their step
    tensors. A step count replaced by hand (a fused weight's and a norm's, in both runs, after
    the third step) must split those two off into a class of their own: the static steps then
    still reproduce the eager ones bit for bit. With the class check switched off
    (stale-classes) they would not: the check is what the comparison rests on."""
    data = batches(6)
    a_model = tiny_gpt()
    b_model = copy.deepcopy(a_model)
    kw = dict(lr=1e-2, weight_decay=0.1, seed=11, lr_schedule=schedule)
    a, b = Engine(a_model, "adamw", **kw), Engine(b_model, "adamw", **kw)
    fused = next(name for p, name in a.optimizer._fused.items())
    norm = next(n for n, p in a_model.named_parameters() if p.dim() == 1)

    def set_steps(eng):
        params = dict(eng.model.named_parameters())
        for name in (fused, norm):
            eng.optimizer.state[params[name]]["step"] = torch.tensor(40.0)

    sa = []
    for i, x in enumerate(data):
        if i == 3:
            set_steps(a)
        sa.append(a.train_step(lambda: loss_of(a_model)(x)))
    sb = [b.train_step(lambda: loss_of(b_model)(x)) for x in data[:2]]
    b.optimizer.capture_static_step()
    got = static_steps(b, b_model, data[2:3])
    assert len(b.optimizer._static.classes) == 1
    if not regroup:
        monkeypatch.setattr(b.optimizer._static, "_classes_hold", lambda: True)
    set_steps(b)
    got = [(s.loss, s.grad_norm) for s in sb] + got + static_steps(b, b_model, data[3:])
    same = all(torch.equal(u, v) for u, v in zip(weights_and_states(a_model, a.optimizer),
                                                 weights_and_states(b_model, b.optimizer)))
    if regroup:
        assert len(b.optimizer._static.classes) == 2
        assert got == [(s.loss, s.grad_norm) for s in sa] and same
    else:
        assert not same


def test_a_wrong_step_seed_would_be_caught(monkeypatch):
    """The comparison above can fail: with the step's seed part left out of the rows (every
    step rounding with the same bits), the weights differ from eager training."""
    data = batches(3)
    a_model = tiny_gpt()
    b_model = copy.deepcopy(a_model)
    a = Engine(a_model, "adamw", lr=1e-2, seed=11)
    b = Engine(b_model, "adamw", lr=1e-2, seed=11)
    for x in data:
        a.train_step(lambda: loss_of(a_model)(x))
    b.train_step(lambda: loss_of(b_model)(data[0]))
    b.optimizer.capture_static_step()
    monkeypatch.setattr(b.optimizer, "_seed_offset", lambda step: 0)
    for x in data[1:]:
        b.optimizer.advance_static_step()
        b.train_step(lambda: loss_of(b_model)(x))
    assert not all(torch.equal(u, v) for u, v in zip(a_model.parameters(),
                                                      b_model.parameters()))


def test_seed_offset_in_hp_is_added_to_the_seed_argument(backend, device):
    """hp[HP_SEED] holds the step's seed part as int32 bits; the random bits follow
    (seed + offset) mod 2**31 on both backends, including the wrap past 2**31."""
    torch.manual_seed(3)
    T, N, K = 37, 45, 70  # no tile multiple
    x = torch.randn(T, K, dtype=torch.bfloat16, device=device)
    dy = torch.randn(T, N, dtype=torch.bfloat16, device=device)
    w0 = torch.randn(N, K, dtype=torch.bfloat16, device=device)
    spec = R.rule_spec(R.ADAMW)
    hp = R.hparams(R.ADAMW, dict(ADAM, lr=1e-3), 1, {})

    def run(seed, offset):
        w = w0.clone()
        states = [StateTensor.full((N, K), 0.0, "bf16", nn_, w.device)
                  for nn_ in (False, True)] + [None]
        hp_t = R.set_seed_bits(torch.tensor(hp, dtype=torch.float32), offset).to(device)
        fused_wgrad_update(x, dy, w, states, spec, hp_t, torch.zeros(1, device=device), seed,
                           True)
        return [w] + [s.data for s in states[:2]]

    base, off = 2 ** 31 - 5, 100
    shifted = run(base, off)
    same = run((base + off) % 2 ** 31, 0)
    plain = run(base, 0)
    assert all(torch.equal(u, v) for u, v in zip(shifted, same))
    assert not torch.equal(shifted[0], plain[0])  # the offset does change the rounding


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, use_b=True):
        return self.b(self.a(x)) if use_b else self.a(x)


def test_static_step_errors():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    m = Branchy()
    opt = forge_engine.optim.AdamW(m, lr=1e-3)
    opt.capture_static_step()
    with pytest.raises(RuntimeError, match=r"already called"):
        opt.capture_static_step()
    opt.advance_static_step()
    with pytest.raises(RuntimeError, match=r"parameter 'b.weight' has no optimizer state yet"):
        m(x).sum().backward()

    def one_eager_step():
        m = Branchy()
        opt = forge_engine.optim.AdamW(m, lr=1e-3)
        with pytest.raises(RuntimeError, match=r"needs capture_static_step"):
            opt.advance_static_step()
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        opt.capture_static_step()
        return m, opt

    m, opt = one_eager_step()
    w = m.b.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"'b.weight' updated after capture_static_step\(\) "
                                           r"without advance_static_step\(\)"):
        m(x).sum().backward()  # an eager step would read stale rows: refused, nothing written
    assert torch.equal(m.b.weight, w)

    m, opt = one_eager_step()
    with opt.recording_static_step():  # a capture records the step: no rows needed yet
        m(x).sum().backward()
        opt.step()
    with pytest.raises(RuntimeError, match=r"without advance_static_step"):
        m(x).sum().backward()  # and after it, each step needs its rows again
    opt.advance_static_step()
    opt.replayed_static_step()  # what CudaGraphStep reports after each replay
    with pytest.raises(RuntimeError, match=r"without advance_static_step"):
        m(x).sum().backward()  # an eager step mixed in between replays: refused

    with pytest.raises(RuntimeError, match=r"scale_gradients\(tensor\) needs "
                                           r"capture_static_step"):
        forge_engine.optim.AdamW(Branchy()).scale_gradients(torch.tensor(0.5))

    m, opt = one_eager_step()
    opt.advance_static_step()
    m(x, use_b=False).sum().backward()  # b is not updated in this step
    with pytest.raises(RuntimeError, match=r"parameter\(s\) with optimizer state were not "
                                           r"updated in this step, e.g. 'b.weight'"):
        opt.step()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scale_grad_forms_the_product_in_fp32(device):
    """optim.base.scale_grad_: a gradient times a clip factor, formed in fp32 and rounded once to
    the gradient's dtype, for a float factor (eager steps) and a 0-d fp32 device factor (a
    captured step) alike. On CUDA a plain .mul_(0-d fp32 tensor) of a bf16 gradient rounds the
    factor to bf16 first, and a captured clipped step drifted from the eager one (the GPU case
    below)."""
    from forge_engine.optim.base import scale_grad_
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in ((), (1,), (37, 129)):
            g = torch.randn(shape, generator=gen).to(device, dtype)
            f = float(torch.rand((), generator=gen)) * 0.9 + 0.05
            ft = torch.tensor(f, dtype=torch.float32, device=device)
            want = (g.double() * float(ft)).float().to(dtype)  # one fp32 product, one rounding
            got = scale_grad_(g.clone(), ft)
            assert got.dtype == dtype and got.shape == g.shape
            assert torch.equal(got, want), (dtype, shape)
            assert torch.equal(scale_grad_(g.clone(), float(ft)), want), (dtype, shape)


def test_cuda_graph_step_rejects_what_it_cannot_capture():
    model = tiny_gpt(dtype=torch.float32)
    eng = Engine(model, "adamw", lr=1e-3)
    with pytest.raises(ValueError, match=r"need the model on a CUDA device, it is on cpu"):
        CudaGraphStep(eng, loss_of(model))


# ------------------------------------------------------------------------------------ GPU

def _sdpa_math():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)  # flash attention's backward is not deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("mode,shape,clip", [
    ("forge-bf16", (2, 33), 0.0), ("forge-int8", (2, 33), 0.0), ("torch", (2, 33), 0.0),
    ("forge-bf16", (4, 129), 0.0), ("forge-bf16", (2, 33), 0.05), ("torch", (2, 33), 0.05)])
def test_cuda_graph_replay_matches_eager_steps(mode, shape, clip):
    """Capture after 2 eager steps, replay 4: losses, weights and optimizer states equal those
    of 6 eager steps bit for bit (the same kernels on the same inputs). The tied embedding
    keeps token segments at 64 tokens a step; at 512 they would outweigh an fp32 buffer, so it
    accumulates there (the one-hot segment added by index_add_ on the device). clip 0.05 clips
    every step, with the factor computed on the device as a 0-d fp32 tensor: it scales the
    bf16 gradients in fp32 (optim.base.scale_grad_), as the eager steps' float factor does;
    a plain .mul_ rounded it to bf16 first, and the first replayed clipped step differed."""
    dev = torch.device("cuda")
    forge = mode != "torch"
    kw = dict(lr=1e-2, weight_decay=0.1, clip_grad=clip)
    if forge:
        kw.update(seed=11, lr_schedule=schedule,
                  state_dtype="int8" if mode == "forge-int8" else None)
    else:  # torch's fused AdamW, capturable; constant lr (a float lr is baked into the graph
        kw.update(capturable=True)  # the same way in eager steps)
    data = batches(6, dev, shape=shape)
    a_model = tiny_gpt(dev)
    b_model = copy.deepcopy(a_model)
    a = Engine(a_model, "adamw", forge=forge, **kw)
    b = Engine(b_model, "adamw", forge=forge, **kw)
    with _sdpa_math():
        sa = [a.train_step(lambda: loss_of(a_model)(x)) for x in data]
        if forge and not clip:  # (clipping defers every fused weight)
            assert a.optimizer.accumulation == {
                "embedding.weight": "segments" if shape[0] == 2 else "fp32 buffer"}
        if clip:
            assert all(s.grad_norm > clip for s in sa)
        step = CudaGraphStep(b, loss_of(b_model), warmup=2)
        sb = [step(x) for x in data]
    assert step.graph is not None and step.steps == 6
    assert [s.loss for s in sa] == [s.loss for s in sb]
    # the fused tiles add their squared norms with fp32 atomics in whatever order they finish:
    # a sum of n terms moves by at most n - 1 roundings (n < 200 tiles here), 1.2e-5 relative,
    # halved by the square root
    for u, v in zip(sa, sb):
        assert math.isclose(u.grad_norm, v.grad_norm, rel_tol=1e-5), (u, v)
    assert [s.lr for s in sa] == [s.lr for s in sb]
    for u, v in zip(weights_and_states(a_model, a.optimizer),
                    weights_and_states(b_model, b.optimizer)):
        assert torch.equal(u, v)
    with pytest.raises(ValueError, match=r"one batch layout"):
        step(data[0][:1])


def test_capture_failure_names_a_compiled_region_that_would_recompile():
    """A compiled region whose guards fail on the capture's inputs (transformers builds an
    attention mask only while a stream captures) is named in one line with the failed guard
    and the fix, from Dynamo's own RecompileError as the capture's end wraps it."""
    from forge_engine.graphs import _capture_failure

    def attend(x, attention_mask=None):
        return x * 2 if attention_mask is None else x * attention_mask
    torch._dynamo.reset()
    region = torch.compile(attend, backend="eager")
    x = torch.randn(5)
    region(x)
    try:
        with pytest.raises(torch._dynamo.exc.RecompileError) as info, \
                torch._dynamo.config.patch(error_on_recompile=True):
            region(x, attention_mask=torch.ones(5))
    finally:
        torch._dynamo.reset()
    ended = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    ended.__context__ = info.value
    msg = _capture_failure(ended)
    assert "\n" not in msg
    assert "would compile again during the capture (attend (" in msg
    assert "guard failed: attention_mask is None)" in msg and "4-D attention_mask" in msg
    other = _capture_failure(RuntimeError("operation not permitted when stream is capturing"))
    assert other.startswith("forge_engine: capturing the training step as a CUDA graph "
                            "failed (RuntimeError: operation not permitted") and "\n" not in other


def _compiled_hf_llama(dev, state_dtype="bf16"):
    """A tiny transformers Llama in bf16 on dev, its Engine, and a counter of what Inductor
    compiled: every decoder layer compiled (layer.compile(), after the optimizer has put
    FORGE's modules in place), as the README's Hugging Face recipe does."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.testing import CompileCounterWithBackend
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=88,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dev, torch.bfloat16).train()
    eng = Engine(model, "adamw", lr=1e-2, weight_decay=0.1, seed=11, lr_schedule=schedule,
                 state_dtype=state_dtype)
    counter = CompileCounterWithBackend("inductor")
    for layer in model.model.layers:
        layer.compile(backend=counter)
    return model, eng, counter


def _regions(loss) -> int:
    """The compiled regions in loss's autograd graph: bench_hf.py's count, which its
    compiled modes report."""
    from bench_hf import compiled_nodes
    return compiled_nodes(loss)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_cuda_graph_replay_of_compiled_hf_layers_matches_eager_steps(state_dtype):
    """transformers' Llama with every decoder layer compiled by Inductor and the step graphed,
    the model given a 4-D causal mask (the same mask in eager steps and in the capture): 4
    replays after 2 eager steps give the losses, weights and states of 6 eager steps of the
    same compiled layers bit for bit, and every layer ran compiled."""
    dev = torch.device("cuda")
    torch._dynamo.reset()
    a_model, a, _ = _compiled_hf_llama(dev, state_dtype)
    b_model, b, counter = _compiled_hf_llama(dev, state_dtype)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    data = [torch.randint(0, 97, (2, 33), generator=g).to(dev) for _ in range(6)]
    causal = torch.ones(33, 33, dtype=torch.bool, device=dev).tril().expand(2, 1, 33, 33)
    regions = []

    def lm_loss(model):
        def loss(ids):
            out = model(input_ids=ids, labels=ids, attention_mask=causal).loss
            regions.append(_regions(out))
            return out
        return loss

    try:
        with _sdpa_math():
            sa = [a.train_step(lambda: lm_loss(a_model)(x)) for x in data]
            step = CudaGraphStep(b, lm_loss(b_model), warmup=2)
            sb = [step(x) for x in data]
    finally:
        torch._dynamo.reset()
    assert step.graph is not None and step.steps == 6
    assert counter.frame_count >= 1 and set(regions) == {2}  # the eager steps and the capture
    assert [s.loss for s in sa] == [s.loss for s in sb]
    for u, v in zip(weights_and_states(a_model, a.optimizer),
                    weights_and_states(b_model, b.optimizer)):
        assert torch.equal(u, v)


@pytest.mark.gpu
def test_cuda_graph_capture_of_compiled_hf_layers_without_a_mask_is_refused_in_one_line():
    """Without an attention_mask, transformers skips the causal mask in eager steps and builds
    one while a stream captures: the compiled layers would recompile inside the capture, and
    the capture stops with one line naming the guard and the 4-D mask, not the compiler's
    CUDA error from inside the capture."""
    dev = torch.device("cuda")
    torch._dynamo.reset()
    model, eng, _ = _compiled_hf_llama(dev)
    step = CudaGraphStep(eng, lambda ids: model(input_ids=ids, labels=ids).loss, warmup=1)
    ids = torch.randint(0, 97, (2, 33), device=dev)
    try:
        step(ids)
        with pytest.raises(RuntimeError, match=r"would compile again during the capture .*"
                                               r"4-D attention_mask") as info:
            step(ids)
    finally:
        torch._dynamo.reset()
    assert "\n" not in str(info.value)

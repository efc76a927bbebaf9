"""forge_engine.model on one rank (CPU, no torch.distributed): configs and presets, shapes, the
loss at init, causality, GQA attention against a float64 reference, activation recompute, tied
weights, TP bookkeeping, and a short FORGE training run of the tiny preset."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import forge_engine
import forge_engine.model as model_mod
from forge_engine.model import (GPT, MLP, PRESETS, Attention, ModelConfig, RMSNorm, preset)
from forge_engine.parallel import ParallelConfig


def batch(cfg, b=4, s=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    return ids, labels


def count_params(c: ModelConfig):
    """(total, non-embedding) parameters of a config, by formula: fused QKV, out proj, optional
    QK-norms, SwiGLU, two norms per layer; final norm; embedding (+ LM head when untied)."""
    h, f, nh, ng, hd = (c.hidden_size, c.ffn_hidden_size, c.num_attention_heads,
                        c.num_query_groups, c.kv_channels)
    layer = h * (nh + 2 * ng) * hd + nh * hd * h + 3 * h * f + 2 * h
    layer += 2 * hd if c.qk_layernorm else 0
    body = c.num_layers * layer + h
    heads = 2 if c.untie_embeddings_and_output_weights else 1
    return body + heads * c.vocab_size * h, body


# ---------------------------------------------------------------------------------- configs

BIG = [n for n in PRESETS if n != "tiny"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_construct_and_validate_tp(name):
    cfg = preset(name)
    assert cfg == PRESETS[name] and cfg is not PRESETS[name]
    assert cfg.kv_channels == (16 if name == "tiny" else 128)
    if name == "tiny":  # 4 heads, 2 query groups
        cfg.validate_tp(1)
        cfg.validate_tp(2)
        with pytest.raises(ValueError, match=r"size 4 .*num_query_groups=2"):
            cfg.validate_tp(4)
        with pytest.raises(ValueError, match=r"num_attention_heads=4, num_query_groups=2"):
            cfg.validate_tp(8)
    else:
        for tp in (1, 2, 4, 8):
            cfg.validate_tp(tp)
        with pytest.raises(ValueError, match=r"size 16 .*num_query_groups=8"):
            cfg.validate_tp(16)  # 8 KV heads everywhere


def test_preset_parameter_counts_match_the_public_models():
    # the formula is the model's: check it on built tiny models, tied and untied
    for untie in (False, True):
        cfg = preset("tiny", untie_embeddings_and_output_weights=untie)
        assert GPT(cfg, seed=0).num_parameters() == count_params(cfg)[0]
    # exact totals of the HF checkpoints
    assert count_params(preset("llama3.1-8b"))[0] == 8_030_261_248
    assert count_params(preset("qwen3-8b"))[0] == 8_190_735_360
    # Qwen3 model cards: (total, non-embedding) in billions, as rounded there
    card = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
            "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2)}
    for name, (total, body) in card.items():
        t, nb = count_params(preset(name))
        assert round(t / 1e9, 1) == total, name
        assert round(nb / 1e9, len(str(body).split(".")[1])) == body, name


def test_preset_errors_and_overrides():
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt5'.*tiny, qwen3-0.6b"):
        preset("gpt5")
    assert preset("tiny", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by "
                                         r"num_query_groups \(3\)"):
        preset("tiny", num_query_groups=3)  # overrides are validated
    with pytest.raises(TypeError):
        preset("tiny", num_heads=4)  # unknown field


@pytest.mark.parametrize("kwargs, msg", [
    (dict(num_attention_heads=6, num_query_groups=4), r"num_attention_heads \(6\) is not "
                                                      r"divisible by num_query_groups \(4\)"),
    (dict(hidden_size=0), r"hidden_size must be positive, got 0"),
    (dict(num_query_groups=0), r"num_query_groups must be positive"),
    (dict(hidden_size=66, kv_channels=None), r"hidden_size \(66\) is not divisible by "
                                                  r"num_attention_heads \(4\); set kv_channels"),
    (dict(kv_channels=15), r"kv_channels must be even for RoPE"),
    (dict(norm_eps=0.0), r"norm_eps must be positive"),
    (dict(num_layers=2.0), r"num_layers must be an int, got 2.0"),
    (dict(qk_layernorm=1), r"qk_layernorm must be a bool"),
    (dict(rope_theta="1e4"), r"rope_theta must be a number"),
])
def test_bad_configs_raise_clear_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        preset("tiny", **kwargs)


def test_validate_tp_names_field_value_and_size():
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide ModelConfig "
                                         r"hidden_size=64, num_attention_heads=4, "
                                         r"num_query_groups=2, ffn_hidden_size=176, "
                                         r"vocab_size=512"):
        preset("tiny").validate_tp(3)
    with pytest.raises(ValueError, match="positive int"):
        preset("tiny").validate_tp(0)


def test_ints_become_floats_and_kv_channels_resolves():
    cfg = preset("tiny", rope_theta=500000)
    assert isinstance(cfg.rope_theta, float)
    assert preset("tiny", hidden_size=128, kv_channels=None).kv_channels == 32


# ---------------------------------------------------------------------------------- forward

def test_forward_shapes_and_loss_at_init():
    cfg = preset("tiny")
    model = GPT(cfg, seed=0)
    ids, labels = batch(cfg, b=8, s=64)
    with torch.no_grad():
        logits = model(ids)
        loss = model(ids, labels)
    assert logits.shape == (64, 8, cfg.vocab_size) and logits.dtype == torch.float32
    assert loss.shape == (8, 64) and loss.dtype == torch.float32
    # the vocab-parallel loss on one rank is plain cross entropy of the [s, b, V] logits
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.t().reshape(-1),
                          reduction="none").view(64, 8).t()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    # At init the logits are ~N(0, sigma^2) with sigma ~ init_std * sqrt(h) = 0.16 (unit-RMS
    # final norm times 0.02-std tied rows), so E[loss] = ln V + sigma^2 / 2 ~ ln V + 0.013; the
    # mean over 512 tokens scatters by ~0.01. 0.05 fails for a mis-scaled init (std 0.1 already
    # gives +0.3) or a broken norm.
    assert abs(loss.mean().item() - math.log(cfg.vocab_size)) < 0.05


def test_bf16_params_forward():
    cfg = preset("tiny")
    model = GPT(cfg, params_dtype=torch.bfloat16, seed=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids, labels = batch(cfg)
    with torch.no_grad():
        assert model(ids).dtype == torch.bfloat16
        loss = model(ids, labels)
    assert loss.dtype == torch.float32
    assert abs(loss.mean().item() - math.log(cfg.vocab_size)) < 0.1  # bf16 logits: ~1e-2 off


def test_same_seed_same_model_and_too_long_input():
    cfg = preset("tiny")
    a, b = GPT(cfg, seed=3).state_dict(), GPT(cfg, seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"sequence length 129 exceeds"):
        GPT(cfg, seed=0)(torch.zeros(1, 129, dtype=torch.long))


def test_causal():
    cfg = preset("tiny")
    model = GPT(cfg, seed=0)
    ids, _ = batch(cfg, b=2, s=24)
    t = 10
    ids2 = ids.clone()
    ids2[:, t] = (ids2[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(ids2)  # [s, b, V]
    # positions < t see identical inputs; only a different GEMM blocking could move them,
    # by fp32 rounding (~1e-7 of |logit| ~ 1)
    torch.testing.assert_close(a[:t], b[:t], rtol=0, atol=1e-6)
    assert (a[t:] - b[t:]).abs().amax(dim=-1).min() > 1e-3  # and every later position moves


def reference_attention(attn: Attention, x: torch.Tensor, cfg: ModelConfig):
    """Float64, head by head: y = [q; k; v] rows group-major, explicit group of each query
    head, RoPE as a complex rotation of pairs (j, j + hd/2), masked softmax."""
    nh, ng, hd = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    qpg = nh // ng
    s, b, _ = x.shape
    y = (x.double() @ attn.qkv.weight.double().t()).view(s, b, ng, qpg + 2, hd)

    def norm(t, w):
        if w is None:
            return t
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w.double()

    pos = torch.arange(s, dtype=torch.float64)
    freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(s, hd // 2, dtype=torch.float64), torch.outer(pos, freq))

    def rope(t):  # [s, b, hd]
        z = torch.complex(t[..., :hd // 2], t[..., hd // 2:]) * rot[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    qn = None if attn.q_norm is None else attn.q_norm.weight
    kn = None if attn.k_norm is None else attn.k_norm.weight
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for i in range(nh):
        g = i // qpg
        q = rope(norm(y[:, :, g, i % qpg], qn)).transpose(0, 1)  # [b, s, hd]
        k = rope(norm(y[:, :, g, qpg], kn)).transpose(0, 1)
        v = y[:, :, g, qpg + 1].transpose(0, 1)
        scores = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
        heads.append((scores.softmax(-1) @ v).transpose(0, 1))  # [s, b, hd]
    return torch.cat(heads, dim=-1) @ attn.proj.weight.double().t()  # [s, b, h]


@pytest.mark.parametrize("nh, ng, kv, qk", [(4, 2, None, True), (6, 2, None, False),
                                           (4, 4, 24, True), (4, 1, 8, False)],
                         ids=["gqa-qknorm", "gqa3", "mha-hd24", "mqa-hd8"])
def test_attention_matches_float64_reference(nh, ng, kv, qk):
    cfg = preset("tiny", num_attention_heads=nh, num_query_groups=ng, kv_channels=kv,
                 hidden_size=48, qk_layernorm=qk, init_std=0.2)  # peaked softmax
    torch.manual_seed(0)
    attn = Attention(cfg, ParallelConfig())
    if qk:  # non-trivial norm weights, distinct for q and k
        for n in (attn.q_norm, attn.k_norm):
            torch.nn.init.uniform_(n.weight, 0.5, 1.5)
    x = torch.randn(20, 3, 48)
    with torch.no_grad():
        out = attn(x)
    ref = reference_attention(attn, x, cfg)
    # fp32 vs fp64: dot products of length <= 48 with |terms| ~ 1 and a softmax: ~1e-6 absolute;
    # a wrong head-to-group mapping or RoPE pairing is O(1) off
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_swiglu_mlp_matches_reference():
    cfg = preset("tiny")
    torch.manual_seed(0)
    mlp = MLP(cfg, ParallelConfig())
    x = torch.randn(5, 2, cfg.hidden_size)
    w_gate, w_up = mlp.fc1.weight.double().chunk(2, dim=0)  # full rows [gate; up]
    ref = (F.silu(x.double() @ w_gate.t()) * (x.double() @ w_up.t())) @ mlp.fc2.weight.double().t()
    with torch.no_grad():
        torch.testing.assert_close(mlp(x).double(), ref, rtol=1e-5, atol=1e-6)


def test_rmsnorm():
    norm = RMSNorm(8, 1e-6, torch.bfloat16)
    assert torch.equal(norm.weight, torch.ones(8, dtype=torch.bfloat16))
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    xf = x.double()
    ref = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert norm(x).dtype == torch.bfloat16
    torch.testing.assert_close(norm(x).double(), ref, rtol=8e-3, atol=0)  # one bf16 rounding


def _saved_during(fn):
    """The tensors autograd keeps for backward while fn() runs (its saved tensors)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("piece", ["rmsnorm", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recomputed_pieces_keep_their_inputs_and_give_autograds_gradients(piece, dtype):
    """RMSNorm and SwiGLU keep only their inputs for backward and recompute the rest there
    (model._Recomputed). Their values and gradients must be those of the plain autograd graph
    of the same ops, bit for bit: backward reruns the same kernels on the same inputs."""
    g = torch.Generator().manual_seed(7)
    if piece == "rmsnorm":
        norm = RMSNorm(37, 1e-5, dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(37, generator=g))
        x = torch.randn(3, 5, 37, generator=g).to(dtype).requires_grad_()
        inputs = (x, norm.weight)

        def plain(x, w):
            return model_mod._rms_norm(x, w, 1e-5)
        out, saved = _saved_during(lambda: norm(x))
    else:
        x = torch.randn(3, 5, 2 * 23, generator=g).to(dtype).requires_grad_()
        inputs = (x,)
        plain = model_mod.swiglu
        out, saved = _saved_during(lambda: model_mod.recomputed(model_mod.swiglu, x))
    # kept: the inputs themselves, nothing computed from them
    assert len(saved) == len(inputs)
    assert all(s.data_ptr() == t.data_ptr() and s.shape == t.shape
               for s, t in zip(saved, inputs))
    dout = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_in = [t.detach().clone().requires_grad_() for t in inputs]
    ref = plain(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    # the plain graph would have kept more than the inputs (why this is worth doing)
    _, plain_saved = _saved_during(lambda: plain(*ref_in))
    assert sum(t.numel() * t.element_size() for t in plain_saved) > \
        sum(t.numel() * t.element_size() for t in saved)
    # no silent double backward: differentiating the gradient is refused
    out2 = norm(x) if piece == "rmsnorm" else model_mod.recomputed(model_mod.swiglu, x)
    (gx,) = torch.autograd.grad(out2, x, dout.clone().requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        gx.sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cross_entropy_gradient_against_float64(dtype):
    """vocab_parallel_cross_entropy (one rank) against F.cross_entropy in float64, loss and
    d loss / d logits, with a per-token upstream gradient. The kernel computes in fp32 (fp64
    for fp64 logits) and rounds each gradient element once to the logits' dtype. The input
    logits are not modified,
    and a retained graph gives the same gradient twice (the saved softmax is not written)."""
    from forge_engine.parallel.layers import vocab_parallel_cross_entropy
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    s, b, V = 7, 3, 1000
    logits = (torch.randn(s, b, V, generator=g) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, V, (s, b), generator=g)
    up = torch.randn(s, b, generator=g)
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, target)
    (grad,) = torch.autograd.grad(loss, logits, up.to(loss.dtype), retain_graph=True)
    (again,) = torch.autograd.grad(loss, logits, up.to(loss.dtype))
    assert torch.equal(logits.detach(), before) and torch.equal(grad, again)
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, V), target.reshape(-1),
                          reduction="none").view(s, b)
    (ref_grad,) = torch.autograd.grad(ref, ref_logits, up.double())
    assert grad.dtype == dtype
    # bf16: round to nearest is within 2^-8 relative, plus the fp32 computation's 1e-5 (300
    # seeds: worst 0.00389 of 0.00392); fp32: worst 1.4e-6 in 300 seeds; fp64: 3e-15
    rtol = {torch.bfloat16: 2.0**-8 + 1e-5, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5 if dtype != torch.float64
                               else 1e-12, atol=0)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=rtol, atol=1e-30)


def test_recompute_gives_identical_loss_and_grads():
    cfg = preset("tiny")
    ids, labels = batch(cfg)
    out = []
    for recompute in (False, True):
        model = GPT(preset("tiny", recompute_activations=recompute), seed=0)
        loss = model(ids, labels).mean()
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = out
    # recompute reruns the same CPU kernels on the same inputs (no dropout, no RNG): bitwise
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(g0[n] is not None for n in g0)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


# ------------------------------------------------------------------- tying and TP bookkeeping

def test_tied_and_untied_heads():
    tied = GPT(preset("tiny"), seed=0)
    assert tied.output_layer.weight is tied.embedding.weight
    assert sum(p is tied.embedding.weight for p in tied.parameters()) == 1
    untied = GPT(preset("tiny", untie_embeddings_and_output_weights=True), seed=0)
    assert untied.output_layer.weight is not untied.embedding.weight
    assert untied.output_layer.weight.shape == untied.embedding.weight.shape == (512, 64)


def test_tp_parameter_lists():
    model = GPT(preset("tiny"), seed=0)
    sharded = model.tp_sharded_parameters()
    # embedding (= LM head), and per layer qkv, proj, fc1, fc2
    assert len(sharded) == 1 + 4 * 2 and len({id(p) for p in sharded}) == len(sharded)
    assert sharded[0] is model.embedding.weight
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * (2 + 2) + 1  # per layer: norm1, norm2, q_norm, k_norm; final
    qk = [p for n, p in model.named_parameters() if ".q_norm." in n or ".k_norm." in n]
    assert [id(p) for p in model.tp_grad_sum_parameters()] == [id(p) for p in qk]
    # sharded + replicated cover every parameter exactly once
    assert {id(p) for p in model.parameters()} == {id(p) for p in sharded + norms}

    sp = GPT(preset("tiny"), sequence_parallel=True, seed=0)
    assert {id(p) for p in sp.tp_grad_sum_parameters()} == \
        {id(m.weight) for m in sp.modules() if isinstance(m, RMSNorm)}
    assert GPT(preset("tiny", qk_layernorm=False), seed=0).tp_grad_sum_parameters() == []


def test_sequence_parallel_flag_is_identity_on_one_rank():
    cfg = preset("tiny")
    ids, labels = batch(cfg)
    with torch.no_grad():
        a = GPT(cfg, seed=0)(ids, labels)
        b = GPT(cfg, sequence_parallel=True, seed=0)(ids, labels)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------- training

def train_tiny(recompute: bool, steps: int = 20):
    cfg = preset("tiny", recompute_activations=recompute)
    model = GPT(cfg, seed=0)
    with warnings.catch_warnings():  # the tied weight is fused: nothing to warn about
        warnings.simplefilter("error")
        opt = forge_engine.optim.AdamW(model, lr=3e-3)
    ids, labels = batch(cfg, b=4, s=32)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def test_tiny_memorizes_a_batch_with_forge_adamw():
    model, opt, losses = train_tiny(recompute=False)
    summary = opt.forge_summary()
    assert summary.startswith("FORGE: fused 9 of 9 weight matrices")  # 4 linears x 2 + tied
    assert summary.endswith("standard path: none")  # embedding / LM head: one weight, 2 segments
    assert model.output_layer.weight is model.embedding.weight
    assert all(math.isfinite(v) for v in losses)
    # 128 random tokens (a fixed batch) are memorized: ln 512 = 6.24 falls to 2.16 after 20
    # AdamW steps at lr 3e-3 (measured, monotonically); < 0.5x leaves a wide margin and still
    # fails if the fused or the standard-path weights stop learning or step the wrong way
    assert losses[-1] < 0.5 * losses[0], losses
    # recompute with FORGE: each layer is recomputed in backward before any of its weights is
    # updated (the fused update runs after its saved inputs are unpacked), so the run is the
    # same computation on the same kernels: bitwise equal losses
    assert train_tiny(recompute=True)[2] == losses


def test_apex_rms_norm_is_used_on_cuda_when_importable(monkeypatch):
    """apex exists only in NVIDIA's images: stand in for its function and check the wiring
    (arguments, CUDA-only dispatch, the CPU path untouched). The stand-in computes the same
    function, so the test also pins the contract the real one must meet."""
    import forge_engine.model as mdl

    calls = []

    def fake(x, weight, shape, eps):
        calls.append((tuple(shape), eps))
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)

    monkeypatch.setattr(mdl, "APEX_RMS_NORM", fake)
    assert mdl.norm_implementation().startswith("apex fused RMSNorm")
    norm = mdl.RMSNorm(16, 1e-6)
    x = torch.randn(3, 16)
    norm(x)
    assert calls == []  # CPU tensors keep the torch path

    class CudaLike(torch.Tensor):  # a CPU tensor that answers is_cuda = True
        @property
        def is_cuda(self):
            return True

    y = norm(x.as_subclass(CudaLike))
    assert calls == [((16,), 1e-6)]
    monkeypatch.setattr(mdl, "APEX_RMS_NORM", None)
    torch.testing.assert_close(torch.Tensor(y), norm(x), rtol=1e-6, atol=1e-6)

"""Decoder-only GPT for the Llama-3 and Qwen3 families, tensor/sequence parallel
(docs/design.md, "Module map": RMSNorm, RoPE, GQA attention, SwiGLU; TP-agnostic shapes).

Megatron layout: activations are [s, b, h] (sequence first). R = tensor-parallel size. With
sequence parallelism (SP) the activations between blocks are sequence shards [s/R, b, h]; each
ColumnParallelLinear gathers them, so attention and the MLP always see the full sequence s, and
each RowParallelLinear reduce-scatters back (forge_engine/parallel/layers.py).

    ids [b, s] -> .t() [s, b] -> embedding [s, b, h] (SP: [s/R, b, h])
      -> L x TransformerLayer:  h = h + Attention(RMSNorm(h));  h = h + MLP(RMSNorm(h))
      -> RMSNorm -> output_layer -> logits_local [s, b, V/R] -> per-token loss [b, s]

Every weight is drawn in FULL from the global RNG and sliced (layers.py), so one seed gives the
same model at TP=1 and TP=R. Parameter counts, Qwen3 QK-norm and tied heads follow the public
HF configs; checkpoints are read and written by forge_engine/hf.py (our fused QKV rows are
group-major and fc1 is [gate; up], HF keeps q/k/v and gate/up separate: hf.py maps them).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from forge_engine.kernels import backend_for
from forge_engine.parallel import mappings as M
from forge_engine.parallel.layers import (ColumnParallelLinear, ParallelConfig, RowParallelLinear,
                                          VocabParallelEmbedding, default_init,
                                          vocab_parallel_cross_entropy)

_TP_DIVISIBLE = ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                 "vocab_size")


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only GPT (Megatron's names)."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width h."""
    ffn_hidden_size: int
    """Width of the SwiGLU MLP (each of gate and up)."""
    num_attention_heads: int
    """Query heads nh."""
    num_query_groups: int
    """Key/value heads ng (GQA); nh % ng == 0. ng == nh is plain multi-head attention."""
    vocab_size: int
    """Vocabulary size V (already padded: TP needs V % R == 0)."""
    seq_length: int
    """Maximum sequence length s the model accepts."""
    kv_channels: int | None = None
    """Head dim hd; None means hidden_size // num_attention_heads, resolved at construction
    (so dataclasses.replace keeps the resolved value: pass kv_channels=None to re-derive)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling_factor: float | None = None
    """Llama-3.1's "llama3" RoPE scaling: None is plain RoPE; else the factor by which the
    low frequencies are divided (8.0 for Llama-3.1, 32.0 for Llama-3.2)."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_max / low_freq_factor are fully scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_max / high_freq_factor are kept."""
    rope_original_max_position: int = 8192
    """llama3 scaling: the context length the model was trained with before scaling."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    qk_layernorm: bool = False
    """Qwen3 QK-norm: RMSNorm over hd applied to each q and k head before RoPE."""
    untie_embeddings_and_output_weights: bool = False
    """False: the LM head is the embedding matrix (one Parameter); True: a separate weight."""
    init_std: float = 0.02
    """Std of the normal init; the output projections of each block use
    init_std / sqrt(2 * num_layers) (Megatron's output_layer_init_method, GPT-2)."""
    recompute_activations: bool = False
    """Recompute each transformer layer in backward (torch.utils.checkpoint, non-reentrant)."""

    def __post_init__(self):
        for f in fields(self):  # types (annotations are strings under `from __future__`)
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"ModelConfig.{f.name} must be a bool, got {v!r}")
            if f.type.startswith("int") and not (v is None and "None" in f.type) \
                    and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"ModelConfig.{f.name} must be an int, got {v!r}")
            if f.type == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"ModelConfig.{f.name} must be a number, got {v!r}")
                setattr(self, f.name, float(v))
        if self.kv_channels is None:
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
                raise ValueError(f"ModelConfig: hidden_size ({self.hidden_size}) is not divisible "
                                 f"by num_attention_heads ({self.num_attention_heads}); set "
                                 f"kv_channels (the head dim) explicitly")
            self.kv_channels = self.hidden_size // max(self.num_attention_heads, 1)
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "kv_channels", "vocab_size", "seq_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"ModelConfig: num_attention_heads ({self.num_attention_heads}) is "
                             f"not divisible by num_query_groups ({self.num_query_groups})")
        if self.rope_scaling_factor is not None:
            if isinstance(self.rope_scaling_factor, bool) or \
                    not isinstance(self.rope_scaling_factor, (int, float)) or \
                    not self.rope_scaling_factor > 0:
                raise ValueError(f"ModelConfig.rope_scaling_factor must be None or a positive "
                                 f"number, got {self.rope_scaling_factor!r}")
            self.rope_scaling_factor = float(self.rope_scaling_factor)
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(f"ModelConfig: need 0 < rope_low_freq_factor "
                                 f"({self.rope_low_freq_factor}) < rope_high_freq_factor "
                                 f"({self.rope_high_freq_factor})")
            if self.rope_original_max_position <= 0:
                raise ValueError(f"ModelConfig.rope_original_max_position must be positive, "
                                 f"got {self.rope_original_max_position}")
        if self.kv_channels % 2:
            raise ValueError(f"ModelConfig.kv_channels must be even for RoPE, got "
                             f"{self.kv_channels}")

    def validate_tp(self, tp: int) -> None:
        """Raise ValueError (one line naming every offending field) unless tensor-parallel size
        `tp` divides hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size and
        vocab_size. (Under SP the sequence length must divide by tp too; checked at runtime.)"""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise ValueError(f"tensor-parallel size must be a positive int, got {tp!r}")
        bad = [f"{n}={getattr(self, n)}" for n in _TP_DIVISIBLE if getattr(self, n) % tp]
        if bad:
            raise ValueError(f"tensor-parallel size {tp} does not divide ModelConfig "
                             f"{', '.join(bad)}")


_QWEN3 = dict(vocab_size=151936, seq_length=4096, kv_channels=128, rope_theta=1e6,
              norm_eps=1e-6, qk_layernorm=True)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                        num_query_groups=2, vocab_size=512, seq_length=128, rope_theta=10000.0,
                        qk_layernorm=True),
    "qwen3-0.6b": ModelConfig(num_layers=28, hidden_size=1024, ffn_hidden_size=3072,
                              num_attention_heads=16, num_query_groups=8, **_QWEN3),
    "qwen3-1.7b": ModelConfig(num_layers=28, hidden_size=2048, ffn_hidden_size=6144,
                              num_attention_heads=16, num_query_groups=8, **_QWEN3),
    "qwen3-4b": ModelConfig(num_layers=36, hidden_size=2560, ffn_hidden_size=9728,
                            num_attention_heads=32, num_query_groups=8, **_QWEN3),
    "qwen3-8b": ModelConfig(num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
                            num_attention_heads=32, num_query_groups=8,
                            untie_embeddings_and_output_weights=True, **_QWEN3),
    "qwen3-14b": ModelConfig(num_layers=40, hidden_size=5120, ffn_hidden_size=17408,
                             num_attention_heads=40, num_query_groups=8,
                             untie_embeddings_and_output_weights=True, **_QWEN3),
    "qwen3-32b": ModelConfig(num_layers=64, hidden_size=5120, ffn_hidden_size=25600,
                             num_attention_heads=64, num_query_groups=8,
                             untie_embeddings_and_output_weights=True, **_QWEN3),
    "llama3.1-8b": ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                               num_attention_heads=32, num_query_groups=8, kv_channels=128,
                               vocab_size=128256, seq_length=8192, rope_theta=500000.0,
                               rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                               rope_high_freq_factor=4.0, rope_original_max_position=8192,
                               norm_eps=1e-5, qk_layernorm=False,
                               untie_embeddings_and_output_weights=True),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A copy of PRESETS[name] with `overrides` applied (validated like any ModelConfig)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def _apex_rms_norm():
    """apex's fused RMSNorm (fused_rms_norm_affine(x, weight, shape, eps)) where NVIDIA apex is
    importable (NVIDIA's PyTorch images), else None. Never `pip install apex` (another project)."""
    try:
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine
    except Exception:  # not installed, or built without its CUDA extension
        return None
    return fused_rms_norm_affine


APEX_RMS_NORM = _apex_rms_norm()


def norm_implementation() -> str:
    if APEX_RMS_NORM is not None:
        return "apex fused RMSNorm, Triton fused SwiGLU and RoPE on CUDA"
    return "Triton fused RMSNorm, SwiGLU and RoPE on CUDA (torch elsewhere)"


class _Recomputed(torch.autograd.Function):
    """fn(*inputs) that keeps only its inputs for backward and runs fn again there (with the
    same ops, so the gradients are those of fn's own autograd graph bit for bit). For cheap
    element-wise pieces whose intermediates would otherwise stay alive from forward to
    backward: RMSNorm's fp32 copies (16 MB per norm at 512 x 4096) and SwiGLU's silu(gate),
    as apex's fused RMSNorm and Megatron's fused SwiGLU keep only their input."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)  # (a Function's forward runs without grad recording)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        need = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need)]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        wanted = [t for t, n in zip(inputs, need) if n]
        grads = iter(torch.autograd.grad(out, wanted, dout))
        return (None, *(next(grads) if n else None for n in need))


def recomputed(fn, *inputs):
    """fn(*inputs), its intermediates recomputed in backward instead of kept (_Recomputed)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _Recomputed.apply(fn, *inputs)
    return fn(*inputs)


def _rms_norm(x, weight, eps: float):
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(ct)).to(x.dtype)


def swiglu(y):
    """silu(gate) * up for y = [gate, up] along the last dim."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.lru_cache(maxsize=None)
def _fused_layers():
    """kernels/fused_layers.py, imported on first use (importing triton on a CPU machine needs
    TRITON_INTERPRET decided first) and then kept: every norm and SwiGLU call asks."""
    from forge_engine.kernels import fused_layers
    return fused_layers


def _fused(*tensors):
    """kernels/fused_layers.py where the Triton backend runs these tensors (CUDA, or the CPU
    under FORGE_BACKEND=triton with the interpreter) and their dtypes are the kernels'; else
    None (torch, with _Recomputed)."""
    if backend_for(tensors[0].device) != "triton":
        return None
    fused_layers = _fused_layers()
    return fused_layers if all(t.dtype in fused_layers.DTYPES for t in tensors) else None


def mlp_activation(y):
    """swiglu(y), fused where _fused allows, else recomputed in backward."""
    fused = _fused(y)
    return fused.swiglu(y) if fused is not None else recomputed(swiglu, y)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in (at least) fp32;
    on CUDA tensors through apex's fused kernel where apex is importable, else through
    kernels/fused_layers.py's (x, weight and one fp32 per row kept for backward). Elsewhere
    (the CPU, fp64) torch ops, recomputed in backward so that only x is kept (_Recomputed)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):  # x [..., dim] -> [..., dim], same dtype
        if APEX_RMS_NORM is not None and x.is_cuda:
            return APEX_RMS_NORM(x, self.weight, self.weight.shape, self.eps)
        fused = _fused(x, self.weight)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        eps = self.eps
        return recomputed(lambda x, w: _rms_norm(x, w, eps), x, self.weight)


def rope_scaling_of(config: ModelConfig):
    """The hashable llama3 scaling tuple (factor, low, high, original max) or None."""
    if config.rope_scaling_factor is None:
        return None
    return (config.rope_scaling_factor, config.rope_low_freq_factor,
            config.rope_high_freq_factor, config.rope_original_max_position)


def rope_inv_freq(head_dim: int, theta: float, scaling=None, device=None):
    """inv_freq [hd/2] fp32: theta^(-2j/hd), and with scaling = (factor, low, high, original)
    Llama-3.1's frequency-dependent stretch: wavelengths 2 pi / f longer than original / low
    are divided by factor, shorter than original / high kept, and in between interpolated
    linearly in original / wavelength between the two."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                         / head_dim)  # [hd/2]
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq
    ratio = original / wavelen
    smooth = ((ratio - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(s: int, head_dim: int, theta: float, device=None, scaling=None):
    """cos, sin [s, 1, 1, hd] in fp32 for positions 0..s-1 (Llama/HF rotate-half layout:
    dim j and j + hd/2 share the frequency rope_inv_freq()[j])."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    freqs = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, hd]
    return emb.cos(), emb.sin()


@functools.lru_cache(maxsize=16)
def _rope_tables(s: int, head_dim: int, theta: float, device: torch.device, scaling=None):
    half = head_dim // 2
    with torch.inference_mode(False):  # kept tensors, usable by later training steps
        cos, sin = rope_cos_sin(s, head_dim, theta, device, scaling)
        return cos[:, 0, 0, :half].contiguous(), sin[:, 0, 0, :half].contiguous()


def rope_tables(s: int, head_dim: int, theta: float, device, scaling=None):
    """cos, sin [s, hd/2] in fp32: rope_cos_sin's values, one half (the halves repeat), for
    kernels/fused_layers.rope. Computed once per (length, head dim, theta, device) and kept,
    except while a CUDA graph is being captured (a tensor made then would live in the graph's
    pool): every layer of every step reads the same two tables."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _rope_tables.__wrapped__(s, head_dim, theta, device, scaling)
    return _rope_tables(s, head_dim, theta, device, scaling)


def apply_rope(x, cos, sin):
    """x [s, b, heads, hd] rotated by position: x cos + rotate_half(x) sin; same dtype out."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos.to(ct) + rotated * sin.to(ct)).to(x.dtype)


def _scaled_init(config: ModelConfig):
    return default_init(config.init_std / math.sqrt(2.0 * config.num_layers))


def packed_attention_inputs(segment_ids: torch.Tensor):
    """segment_ids [b, s] -> (position_ids [b, s] int64, attn_mask [b, 1, s, s] bool).

    position_ids restart at 0 where a row's segment id changes (each packed sample is placed
    as if it were alone); attn_mask is the block-diagonal causal mask: query i attends key j
    iff j <= i and both are in one segment."""
    b, s = segment_ids.shape
    idx = torch.arange(s, device=segment_ids.device).expand(b, s)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    position_ids = idx - first  # [b, s]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [b, s, s]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return position_ids, (same & causal)[:, None]


class Attention(nn.Module):
    """Causal GQA self-attention with a fused, group-major QKV projection.

    Full QKV rows: for each of the ng groups, its nh/ng query heads, then 1 key head, then 1
    value head (hd rows each). The contiguous row shard of rank r is therefore ng/R whole groups,
    and the local head counts follow from the shard's size, not from R."""

    def __init__(self, config: ModelConfig, pconf: ParallelConfig, tp_group=None):
        super().__init__()
        nh, ng, hd = config.num_attention_heads, config.num_query_groups, config.kv_channels
        self.head_dim, self.q_per_group = hd, nh // ng
        self.theta, self.rope_scaling = config.rope_theta, rope_scaling_of(config)
        self.qkv = ColumnParallelLinear(config.hidden_size, (nh + 2 * ng) * hd, config=pconf,
                                        init_method=default_init(config.init_std), bias=False,
                                        tp_group=tp_group)
        self.q_norm = self.k_norm = None
        if config.qk_layernorm:
            self.q_norm = RMSNorm(hd, config.norm_eps, pconf.params_dtype)
            self.k_norm = RMSNorm(hd, config.norm_eps, pconf.params_dtype)
        self.proj = RowParallelLinear(nh * hd, config.hidden_size, config=pconf,
                                      init_method=_scaled_init(config), bias=False,
                                      input_is_parallel=True, tp_group=tp_group)

    def forward(self, x, position_ids=None, attn_mask=None):
        """x [s, b, h] (SP: [s/R, b, h]) -> same shape. position_ids [b, s] (int64): the RoPE
        position of each token (None: 0..s-1 in every row); attn_mask [b, 1, s, s] bool, True
        where query i may attend key j (None: causal over the whole row). Packed rows pass
        both (packed_attention_inputs), so each sample sees only itself from position 0."""
        qkv, _ = self.qkv(x)  # [s, b, ng_r * (qpg + 2) * hd], full sequence s
        s, b, _ = qkv.shape
        qpg, hd = self.q_per_group, self.head_dim
        ng_r = self.qkv.weight.shape[0] // ((qpg + 2) * hd)  # local groups, from the shard
        qkv = qkv.view(s, b, ng_r, qpg + 2, hd)
        q = qkv[:, :, :, :qpg].reshape(s, b, ng_r * qpg, hd)  # [s, b, nh_r, hd], group-major
        k, v = qkv[:, :, :, qpg], qkv[:, :, :, qpg + 1]  # [s, b, ng_r, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        fused = _fused(q, k)
        if fused is not None and (position_ids is None or b == 1):
            # one kernel each way for q and for k; its tables are per row position, so a
            # packed row (b == 1) passes the table rows of its own positions
            cos, sin = rope_tables(s, hd, self.theta, x.device, self.rope_scaling)
            if position_ids is not None:
                cos, sin = cos[position_ids[0]], sin[position_ids[0]]  # [s, hd/2]
            q, k = fused.rope(q, cos, sin), fused.rope(k, cos, sin)
        else:
            cos, sin = rope_cos_sin(s, hd, self.theta, x.device, self.rope_scaling)
            if position_ids is not None:  # [s, 1, 1, hd] -> [s, b, 1, hd] per token
                pos = position_ids.t()
                cos, sin = cos[:, 0, 0][pos][:, :, None], sin[:, 0, 0][pos][:, :, None]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # query head j belongs to group j // qpg: repeat each k/v head qpg times in place
        k = k.repeat_interleave(qpg, dim=2)  # [s, b, nh_r, hd]
        v = v.repeat_interleave(qpg, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, nh_r, s, hd]
        if attn_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, nh_r, s, hd]
        else:  # block-diagonal causal: masked scores are exactly 0 after the softmax
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        o = o.permute(2, 0, 1, 3).reshape(s, b, ng_r * qpg * hd)  # [s, b, nh_r * hd]
        out, _ = self.proj(o)  # [s, b, h] (SP: [s/R, b, h])
        return out


class MLP(nn.Module):
    """SwiGLU: proj(silu(gate) * up). Full fc1 rows are [gate; up]; with partition_chunks=2
    rank r holds [gate_r; up_r], so the local split is a chunk of the local output. Backward
    keeps fc1's output only (mlp_activation: the fused kernel, or silu(gate) recomputed)."""

    def __init__(self, config: ModelConfig, pconf: ParallelConfig, tp_group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, 2 * config.ffn_hidden_size,
                                        config=pconf, init_method=default_init(config.init_std),
                                        bias=False, tp_group=tp_group, partition_chunks=2)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, config=pconf,
                                     init_method=_scaled_init(config), bias=False,
                                     input_is_parallel=True, tp_group=tp_group)

    def forward(self, x):  # x [s, b, h] (SP: [s/R, b, h]) -> same shape
        y, _ = self.fc1(x)  # [s, b, 2 * ffn/R]: [gate, up], ffn/R each
        out, _ = self.fc2(mlp_activation(y))
        return out


class TransformerLayer(nn.Module):
    """Pre-norm block: h = h + attn(norm1(h)); h = h + mlp(norm2(h))."""

    def __init__(self, config: ModelConfig, pconf: ParallelConfig, tp_group=None):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.norm_eps, pconf.params_dtype)
        self.attn = Attention(config, pconf, tp_group)
        self.norm2 = RMSNorm(config.hidden_size, config.norm_eps, pconf.params_dtype)
        self.mlp = MLP(config, pconf, tp_group)

    def forward(self, h, position_ids=None, attn_mask=None):
        # h [s, b, h] (SP: [s/R, b, h]) -> same shape; position_ids, attn_mask: Attention's
        h = h + self.attn(self.norm1(h), position_ids, attn_mask)
        return h + self.mlp(self.norm2(h))


class GPT(nn.Module):
    """The decoder-only model. tp_group=None is one rank (every mapping is the identity).

    All TP ranks must pass the same `seed` (or seed the global RNG alike): the layers draw the
    FULL weights from the global RNG and keep their slice."""

    def __init__(self, config: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, seed: int | None = None,
                 init_device: str = "cpu"):
        super().__init__()
        config.validate_tp(M.world(tp_group))
        if seed is not None:
            torch.manual_seed(seed)
        self.config, self.tp_group = config, tp_group
        self.sequence_parallel = sequence_parallel
        pconf = ParallelConfig(sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                               init_device=init_device)
        self.embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                config=pconf, tp_group=tp_group,
                                                init_method=default_init(config.init_std))
        self.layers = nn.ModuleList(TransformerLayer(config, pconf, tp_group)
                                    for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps, params_dtype)
        tied = None if config.untie_embeddings_and_output_weights else self.embedding.weight
        self.output_layer = ColumnParallelLinear(config.hidden_size, config.vocab_size,
                                                 config=pconf, bias=False, gather_output=False,
                                                 init_method=default_init(config.init_std),
                                                 tp_group=tp_group, weight=tied)  # W_r [V/R, h]

    def forward(self, input_ids, labels=None, segment_ids=None):
        """input_ids [b, s] -> logits_local [s, b, V/R], or with labels [b, s] the per-token
        loss [b, s] (fp32). segment_ids [b, s] (int64, non-decreasing along each row): a
        packed row of several samples, one id each; every sample attends only to itself and
        its RoPE positions start at 0 (packed_attention_inputs)."""
        if input_ids.shape[1] > self.config.seq_length:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds "
                             f"ModelConfig.seq_length ({self.config.seq_length})")
        extra = ()
        if segment_ids is not None:
            if segment_ids.shape != input_ids.shape:
                raise ValueError(f"segment_ids {tuple(segment_ids.shape)} must have the shape "
                                 f"of input_ids {tuple(input_ids.shape)}")
            extra = packed_attention_inputs(segment_ids)
        h = self.embedding(input_ids.t())  # [s, b, h] (SP: [s/R, b, h])
        recompute = self.config.recompute_activations and torch.is_grad_enabled()
        for layer in self.layers:
            h = checkpoint(layer, h, *extra, use_reentrant=False) if recompute \
                else layer(h, *extra)
        logits, _ = self.output_layer(self.final_norm(h))  # [s, b, V/R] (full s)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group).t()  # [b, s]

    def tp_sharded_parameters(self) -> list[nn.Parameter]:
        """Parameters split across the TP group (each rank holds a different slice)."""
        out, seen = [], set()
        for m in self.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                for p in m.sharded_parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
        return out

    def tp_grad_sum_parameters(self) -> list[nn.Parameter]:
        """Replicated parameters whose local gradient is a partial sum over the TP ranks: sum
        (all-reduce) their .grad over the TP group before the optimizer step.

        - With sequence parallelism, every replicated parameter (all RMSNorm weights): norm1,
          norm2 and final_norm see only this rank's s/R tokens, and the QK-norms see only its
          heads, so each rank's gradient covers part of the tokens (heads).
        - Without it, only the QK-norm weights: the block norms see the full sequence and their
          output gradient is already all-reduced by the ColumnParallelLinear's copy_to_tp, so
          their gradients are complete and equal on every rank; but q_norm / k_norm act on this
          rank's heads only (nh/R of them), so their gradient sums over local heads only."""
        sharded = {id(p) for p in self.tp_sharded_parameters()}
        if self.sequence_parallel:
            return [p for p in self.parameters() if id(p) not in sharded]
        out = []
        for m in self.modules():
            if isinstance(m, Attention) and m.q_norm is not None:
                out += [m.q_norm.weight, m.k_norm.weight]
        return out

    def num_parameters(self) -> int:
        """Local (this rank's) parameter count; a tied weight counts once."""
        return sum(p.numel() for p in self.parameters())

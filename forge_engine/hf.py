"""Hugging Face checkpoints in and out: LlamaForCausalLM (Llama-3, 3.1, 3.2) and Qwen3ForCausalLM
directories of safetensors files, read and written with safetensors directly (docs/design.md,
"Module map").

    model = load_pretrained("Llama-3.2-1B", tp_group=g, sequence_parallel=True)  # -> GPT
    save_pretrained(model, "out")      # every TP rank calls it; rank 0 writes the directory

Name and layout map (HF -> forge_engine.model.GPT; R = TP size, r = this rank):

    model.embed_tokens.weight [V, h]            embedding.weight [Vp/R, h]  (rows padded to Vp)
    lm_head.weight [V, h] (absent when tied)    output_layer.weight [Vp/R, h]
    layers.i.self_attn.{q,k,v}_proj [*, h]      layers.i.attn.qkv.weight, group-major: per KV
                                                group its nh/ng query heads, its k, its v head;
                                                rank r holds groups [r ng/R, (r+1) ng/R)
    layers.i.self_attn.o_proj [h, nh hd]        layers.i.attn.proj.weight [h, nh hd/R]
    layers.i.self_attn.{q,k}_norm [hd]          layers.i.attn.{q,k}_norm.weight (Qwen3)
    layers.i.mlp.{gate,up}_proj [f, h]          layers.i.mlp.fc1.weight [gate_r; up_r]
    layers.i.mlp.down_proj [h, f]               layers.i.mlp.fc2.weight [h, f/R]
    layers.i.input_layernorm, post_attention_layernorm, model.norm -> norm1, norm2, final_norm

A config field the GPT does not implement is refused (UnsupportedConfig, one line naming it),
never ignored. Each rank reads only its own slices (safe_open(...).get_slice), so no rank holds
the whole model. Padded vocabulary rows (Vp > V) load as zeros and are dropped on save.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from forge_engine.model import GPT, ModelConfig
from forge_engine.parallel import mappings as M

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
SHARD_BYTES = 5 * 10 ** 9  # Hugging Face's default max_shard_size ("5GB")
INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedConfig(ValueError):
    """A config.json (or checkpoint) the GPT cannot reproduce; the message is one line."""


# ------------------------------------------------------------------------------------ config

def read_config(path: str) -> dict:
    """config.json of an HF directory as a dict (one-line errors)."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise UnsupportedConfig(f"{path}: no such directory (a Hugging Face model directory)")
    if not os.path.isfile(file):
        raise UnsupportedConfig(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise UnsupportedConfig(f"{file}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise UnsupportedConfig(f"{file}: expected a JSON object")
    return cfg


def _rope(cfg: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from the legacy rope_theta / rope_scaling fields or
    transformers 5's rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise UnsupportedConfig(f"{where}: rope_scaling type {kind!r} is not supported (only "
                                f"llama3)")
    return float(theta), scaling


def config_from_hf(cfg: dict, where: str = "config.json") -> ModelConfig:
    """ModelConfig of an HF config dict (vocab_size unpadded). Raises UnsupportedConfig naming
    the first field the GPT does not implement."""
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise UnsupportedConfig(f"{where}: architectures {archs} is not supported (one of "
                                f"{', '.join(ARCHITECTURES)})")
    kind = ARCHITECTURES[archs[0]]
    if cfg.get("model_type", kind) != kind:
        raise UnsupportedConfig(f"{where}: model_type {cfg.get('model_type')!r} does not match "
                                f"{archs[0]}")

    def refuse(field, why):
        raise UnsupportedConfig(f"{where}: {field} = {json.dumps(cfg.get(field))} is not "
                                f"supported ({why})")

    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the MLP is SwiGLU: silu")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            refuse(flag, "the linears have no bias")
    if cfg.get("attention_dropout", 0.0):
        refuse("attention_dropout", "attention has no dropout")
    if cfg.get("use_sliding_window"):
        refuse("use_sliding_window", "attention is full causal")
    if kind == "llama" and cfg.get("sliding_window"):
        refuse("sliding_window", "attention is full causal")
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        refuse("layer_types", "every layer is full attention")
    for moe in ("num_experts", "num_local_experts", "moe_intermediate_size",
                "num_experts_per_tok", "n_routed_experts"):
        if cfg.get(moe):
            refuse(moe, "mixture of experts")
    if cfg.get("pretraining_tp", 1) != 1:
        refuse("pretraining_tp", "only 1")
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "vocab_size")
    missing = [n for n in need if not isinstance(cfg.get(n), int)]
    if missing:
        raise UnsupportedConfig(f"{where}: missing or not an integer: {', '.join(missing)}")
    nh = cfg["num_attention_heads"]
    ng = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    theta, scaling = _rope(cfg, where)
    rope = {}
    if scaling is not None:
        rope = dict(rope_scaling_factor=float(scaling["factor"]),
                    rope_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                    rope_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                    rope_original_max_position=int(scaling.get(
                        "original_max_position_embeddings", 8192)))
    try:
        return ModelConfig(
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=nh,
            num_query_groups=ng, kv_channels=hd, vocab_size=cfg["vocab_size"],
            seq_length=int(cfg.get("max_position_embeddings", 4096)), rope_theta=theta,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), qk_layernorm=kind == "qwen3",
            untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
            init_std=float(cfg.get("initializer_range", 0.02)), **rope)
    except (ValueError, KeyError, TypeError) as e:
        raise UnsupportedConfig(f"{where}: {e}") from None


def config_to_hf(mcfg: ModelConfig, vocab_size: int | None = None, dtype=torch.float32,
                 base: dict | None = None) -> dict:
    """config.json that reproduces mcfg (Qwen3ForCausalLM when it has QK-norm, else
    LlamaForCausalLM); `base` (the config the model was loaded from) keeps its other fields
    (token ids, ...). vocab_size: the unpadded vocabulary (default mcfg's)."""
    qwen = mcfg.qk_layernorm
    out = dict(base or {})
    for k in ("rope_scaling", "rope_parameters", "torch_dtype", "dtype", "transformers_version"):
        out.pop(k, None)
    scaling = None
    if mcfg.rope_scaling_factor is not None:
        scaling = dict(rope_type="llama3", factor=mcfg.rope_scaling_factor,
                       low_freq_factor=mcfg.rope_low_freq_factor,
                       high_freq_factor=mcfg.rope_high_freq_factor,
                       original_max_position_embeddings=mcfg.rope_original_max_position)
    name = str(dtype).replace("torch.", "")
    out.update(
        architectures=["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
        model_type="qwen3" if qwen else "llama", hidden_act="silu",
        hidden_size=mcfg.hidden_size, intermediate_size=mcfg.ffn_hidden_size,
        num_hidden_layers=mcfg.num_layers, num_attention_heads=mcfg.num_attention_heads,
        num_key_value_heads=mcfg.num_query_groups, head_dim=mcfg.kv_channels,
        vocab_size=vocab_size or mcfg.vocab_size, max_position_embeddings=mcfg.seq_length,
        rms_norm_eps=mcfg.norm_eps, rope_theta=mcfg.rope_theta, rope_scaling=scaling,
        rope_parameters=dict(rope_theta=mcfg.rope_theta, **(scaling or {"rope_type": "default"})),
        tie_word_embeddings=not mcfg.untie_embeddings_and_output_weights,
        attention_bias=False, attention_dropout=0.0, initializer_range=mcfg.init_std,
        torch_dtype=name, dtype=name)
    if qwen:
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out.update(mlp_bias=False, pretraining_tp=1)
    return out


# ------------------------------------------------------------------------------ safetensors

class _Files:
    """Tensor name -> safetensors file of an HF directory; get(name, rows, cols) reads a slice."""

    def __init__(self, path: str):
        from safetensors import safe_open
        index = os.path.join(path, INDEX_NAME)
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
        elif os.path.isfile(single):
            weight_map = None
        else:
            raise UnsupportedConfig(f"{path}: neither model.safetensors nor {INDEX_NAME}")
        self.path, self._open, self._handles = path, safe_open, {}
        if weight_map is None:
            weight_map = {k: "model.safetensors" for k in self._handle("model.safetensors").keys()}
        self.weight_map = weight_map

    def _handle(self, file):
        if file not in self._handles:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise UnsupportedConfig(f"{self.path}: the index names {file}, which is missing")
            self._handles[file] = self._open(full, framework="pt")
        return self._handles[file]

    def __contains__(self, name):
        return name in self.weight_map

    def get(self, name, rows=None, cols=None, shape=None) -> torch.Tensor:
        if name not in self.weight_map:
            raise UnsupportedConfig(f"{self.path}: tensor {name} is missing")
        sl = self._handle(self.weight_map[name]).get_slice(name)
        full = tuple(sl.get_shape())
        if shape is not None and full != tuple(shape):
            raise UnsupportedConfig(f"{self.path}: {name} has shape {list(full)}, config.json "
                                    f"says {list(shape)}")
        r = slice(*rows) if rows else slice(None)
        c = slice(*cols) if cols else slice(None)
        return sl[r, c] if len(full) == 2 else sl[r]


def _hf_prefix(files: _Files) -> str:
    return "model." if "model.embed_tokens.weight" in files else ""


# ------------------------------------------------------------------------------------ load

def load_pretrained(path: str, *, dtype: torch.dtype | None = None, tp_group=None,
                    sequence_parallel: bool = False, vocab_size: int | None = None,
                    seq_length: int | None = None) -> GPT:
    """The GPT of a local Hugging Face directory (config.json + model.safetensors or shards with
    model.safetensors.index.json). dtype: fp32 or bf16 weights (None: the checkpoint's dtype,
    fp16 read as fp32). vocab_size: the padded vocabulary (>= the config's; default the
    config's rounded up to a multiple of the TP size); the extra rows are zeros. Every rank of
    tp_group calls it and reads only its slices. `model.hf_config` keeps the config dict."""
    cfg = read_config(path)
    mcfg = config_from_hf(cfg, os.path.join(path, "config.json"))
    files = _Files(path)
    pre = _hf_prefix(files)
    r, i = M.world(tp_group), M.rank_in(tp_group)
    v = mcfg.vocab_size
    vp = vocab_size or -(-v // r) * r
    if vp < v:
        raise UnsupportedConfig(f"vocab_size {vp} is smaller than the checkpoint's {v}")
    mcfg.vocab_size = vp
    if seq_length is not None:  # the training length (the rope tables follow the input)
        mcfg.seq_length = seq_length
    if dtype is None:
        stored = files.get(pre + "embed_tokens.weight", rows=(0, 1)).dtype
        dtype = torch.bfloat16 if stored == torch.bfloat16 else torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise UnsupportedConfig(f"dtype {dtype} is not supported (float32 or bfloat16)")
    try:
        mcfg.validate_tp(r)
    except ValueError as e:
        raise UnsupportedConfig(str(e)) from None
    model = GPT(mcfg, tp_group=tp_group, sequence_parallel=sequence_parallel,
                params_dtype=dtype, init_device="meta")
    h, f = mcfg.hidden_size, mcfg.ffn_hidden_size
    nh, ng, hd = mcfg.num_attention_heads, mcfg.num_query_groups, mcfg.kv_channels
    qpg, gr, fr = nh // ng, ng // r, f // r

    def vocab_rows(name):  # this rank's rows [i vp/R, (i+1) vp/R) of [V, h], zero padded
        lo, hi = i * vp // r, (i + 1) * vp // r
        out = torch.zeros(hi - lo, h, dtype=dtype)
        if lo < v:
            part = files.get(name, rows=(lo, min(hi, v)))
            out[:part.shape[0]] = part
        files.get(name, rows=(0, 0), shape=(v, h))
        return out

    state = {"embedding.weight": vocab_rows(pre + "embed_tokens.weight"),
             "final_norm.weight": files.get(pre + "norm.weight", shape=(h,))}
    if mcfg.untie_embeddings_and_output_weights:
        state["output_layer.weight"] = vocab_rows("lm_head.weight")
    for n in range(mcfg.num_layers):
        a, o = f"{pre}layers.{n}.self_attn.", f"layers.{n}."
        g0, g1 = i * gr, (i + 1) * gr
        q = files.get(a + "q_proj.weight", (g0 * qpg * hd, g1 * qpg * hd), shape=(nh * hd, h))
        k = files.get(a + "k_proj.weight", (g0 * hd, g1 * hd), shape=(ng * hd, h))
        vv = files.get(a + "v_proj.weight", (g0 * hd, g1 * hd), shape=(ng * hd, h))
        qkv = torch.cat([q.view(gr, qpg, hd, h), k.view(gr, 1, hd, h), vv.view(gr, 1, hd, h)],
                        dim=1)  # [ng/R, qpg + 2, hd, h]
        state[o + "attn.qkv.weight"] = qkv.reshape(-1, h)
        state[o + "attn.proj.weight"] = files.get(a + "o_proj.weight", None,
                                                  (i * nh * hd // r, (i + 1) * nh * hd // r))
        files.get(a + "o_proj.weight", (0, 0), shape=(h, nh * hd))
        if mcfg.qk_layernorm:
            state[o + "attn.q_norm.weight"] = files.get(a + "q_norm.weight", shape=(hd,))
            state[o + "attn.k_norm.weight"] = files.get(a + "k_norm.weight", shape=(hd,))
        m = f"{pre}layers.{n}.mlp."
        gate = files.get(m + "gate_proj.weight", (i * fr, (i + 1) * fr), shape=(f, h))
        up = files.get(m + "up_proj.weight", (i * fr, (i + 1) * fr), shape=(f, h))
        state[o + "mlp.fc1.weight"] = torch.cat([gate, up])
        state[o + "mlp.fc2.weight"] = files.get(m + "down_proj.weight", None,
                                                (i * fr, (i + 1) * fr), shape=(h, f))
        state[o + "norm1.weight"] = files.get(f"{pre}layers.{n}.input_layernorm.weight",
                                              shape=(h,))
        state[o + "norm2.weight"] = files.get(
            f"{pre}layers.{n}.post_attention_layernorm.weight", shape=(h,))
    _assign(model, state, dtype)
    model.hf_config = cfg
    return model


def train_config(path: str, overrides: dict, tokenizer_vocab: int | None,
                 tp: int) -> ModelConfig:
    """pretrain.py --hf-checkpoint: the ModelConfig of path's config.json (vocab_size
    unpadded). `overrides` (TrainConfig.model_overrides()) must agree with it, except
    seq_length (the training length, at most max_position_embeddings); the tokenizer's
    vocabulary must fit in the checkpoint's. Raises UnsupportedConfig (one line)."""
    mcfg = config_from_hf(read_config(path), os.path.join(path, "config.json"))
    for name, value in overrides.items():
        if name == "seq_length":
            if value > mcfg.seq_length:
                raise UnsupportedConfig(f"--seq-length {value} exceeds {path}'s "
                                        f"max_position_embeddings {mcfg.seq_length}")
            mcfg.seq_length = value
        elif name == "recompute_activations":
            mcfg.recompute_activations = value
        elif getattr(mcfg, name) != value:
            flag = name.replace("_", "-")
            raise UnsupportedConfig(f"--{flag} {value} contradicts --hf-checkpoint {path} "
                                    f"({getattr(mcfg, name)}); leave the flag out")
    if "seq_length" not in overrides:
        mcfg.seq_length = min(mcfg.seq_length, 4096)
    if tokenizer_vocab is not None and tokenizer_vocab > mcfg.vocab_size:
        raise UnsupportedConfig(f"the tokenizer has {tokenizer_vocab} ids, --hf-checkpoint "
                                f"{path} only {mcfg.vocab_size} embedding rows")
    return mcfg


def _assign(model: GPT, state: dict, dtype) -> None:
    """Replace every parameter (meta tensors after GPT(init_device="meta")) with state's
    tensor, keeping the tied LM head the embedding's Parameter."""
    modules = dict(model.named_modules())
    for name, t in state.items():
        mod, _, attr = name.rpartition(".")
        old = getattr(modules[mod], attr)
        if tuple(old.shape) != tuple(t.shape):
            raise UnsupportedConfig(f"{name}: shape {list(t.shape)} does not fit the model's "
                                    f"{list(old.shape)}")
        setattr(modules[mod], attr, nn.Parameter(t.to(dtype).contiguous()))
    if not model.config.untie_embeddings_and_output_weights:
        model.output_layer.weight = model.embedding.weight
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise UnsupportedConfig(f"no checkpoint tensor for {', '.join(left[:3])}")


# ------------------------------------------------------------------------------------ save

def hf_state_from_shards(shards: list[dict], mcfg: ModelConfig,
                         vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """HF tensors (names of LlamaForCausalLM / Qwen3ForCausalLM) from the GPT state dicts of
    the R tensor-parallel ranks, in rank order; the inverse of load_pretrained's slicing.
    vocab_size: rows of the embedding and head to keep (the unpadded vocabulary)."""
    v = vocab_size or mcfg.vocab_size
    nh, ng, hd = mcfg.num_attention_heads, mcfg.num_query_groups, mcfg.kv_channels
    h, qpg = mcfg.hidden_size, nh // ng

    def cat(name, dim):
        return torch.cat([s[name] for s in shards], dim=dim)

    out = {"model.embed_tokens.weight": cat("embedding.weight", 0)[:v],
           "model.norm.weight": shards[0]["final_norm.weight"]}
    if mcfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[:v]
    for n in range(mcfg.num_layers):
        a, o = f"model.layers.{n}.self_attn.", f"layers.{n}."
        qkv = cat(o + "attn.qkv.weight", 0).view(ng, qpg + 2, hd, h)  # group-major, all groups
        out[a + "q_proj.weight"] = qkv[:, :qpg].reshape(nh * hd, h)
        out[a + "k_proj.weight"] = qkv[:, qpg].reshape(ng * hd, h)
        out[a + "v_proj.weight"] = qkv[:, qpg + 1].reshape(ng * hd, h)
        out[a + "o_proj.weight"] = cat(o + "attn.proj.weight", 1)
        if mcfg.qk_layernorm:
            out[a + "q_norm.weight"] = shards[0][o + "attn.q_norm.weight"]
            out[a + "k_norm.weight"] = shards[0][o + "attn.k_norm.weight"]
        m = f"model.layers.{n}.mlp."
        fc1 = [s[o + "mlp.fc1.weight"].chunk(2) for s in shards]  # per rank [gate_r; up_r]
        out[m + "gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        out[m + "up_proj.weight"] = torch.cat([u for _, u in fc1])
        out[m + "down_proj.weight"] = cat(o + "mlp.fc2.weight", 1)
        out[f"model.layers.{n}.input_layernorm.weight"] = shards[0][o + "norm1.weight"]
        out[f"model.layers.{n}.post_attention_layernorm.weight"] = shards[0][o + "norm2.weight"]
    return {k: t.detach().cpu().contiguous().clone() for k, t in out.items()}


def write_hf_dir(path: str, tensors: dict[str, torch.Tensor], config: dict,
                 max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write config.json and the tensors as safetensors files of at most max_shard_bytes each
    (a tensor larger than that gets a file of its own): one model.safetensors, or
    model-0000k-of-0000n.safetensors with model.safetensors.index.json. Returns the files."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    groups, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else \
        [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for stale in os.listdir(path):  # an older save's shards would confuse the index
        if stale.endswith(".safetensors") or stale == INDEX_NAME:
            os.remove(os.path.join(path, stale))
    for file, group in zip(names, groups):
        save_file({k: tensors[k] for k in group}, os.path.join(path, file),
                  metadata={"format": "pt"})
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: file for file, g in zip(names, groups) for k in g}}
        with open(os.path.join(path, INDEX_NAME), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
    return names


def save_pretrained(model: GPT, path: str, *, vocab_size: int | None = None,
                    dtype: torch.dtype | None = None, max_shard_bytes: int = SHARD_BYTES) -> None:
    """Write `model` as a Hugging Face directory that transformers' from_pretrained loads.
    Every rank of model.tp_group calls it; the shards are gathered and rank 0 writes. vocab_size:
    the unpadded vocabulary (default: the loaded config's, else the model's); dtype: of the
    written tensors (default the model's)."""
    g = model.tp_group
    local = {k: t.detach().cpu() for k, t in model.state_dict().items()}
    if M.world(g) > 1:
        shards = [None] * M.world(g)
        torch.distributed.all_gather_object(shards, local, group=g)
    else:
        shards = [local]
    if M.rank_in(g) != 0:
        torch.distributed.barrier(group=g)
        return
    base = getattr(model, "hf_config", None)
    vocab = vocab_size or (base or {}).get("vocab_size") or model.config.vocab_size
    if vocab > model.config.vocab_size:
        raise ValueError(f"vocab_size {vocab} exceeds the model's {model.config.vocab_size}")
    dtype = dtype or model.embedding.weight.dtype
    tensors = {k: t.to(dtype) for k, t in hf_state_from_shards(shards, model.config,
                                                                vocab).items()}
    write_hf_dir(path, tensors, config_to_hf(model.config, vocab, dtype, base),
                 max_shard_bytes)
    if M.world(g) > 1:
        torch.distributed.barrier(group=g)

"""Turn a pretrain.py checkpoint (Megatron layout, any tensor-parallel size) into a Hugging Face
directory that transformers' from_pretrained loads (forge_engine/hf.py):

    python tools/export_hf.py --load checkpoints/run --out hf_out [--ckpt-step 300] [--bf16]

Reads every mp_rank_XX file of the iteration (the tracker's, or --ckpt-step), joins the shards
(hf.hf_state_from_shards) and writes safetensors shards, the index and config.json. The config
is the one the run started from (--hf-checkpoint) with the trained shape, else one built from
the model's shape; the vocabulary is cut back to the tokenizer's (the padding rows dropped).
The tokenizer files of the --hf-checkpoint directory are copied along.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch


def export(load: str, out: str, step: int | None = None, dtype: torch.dtype | None = None,
           max_shard_bytes: int | None = None) -> int:
    from forge_engine.checkpoint import _saved_tp_size, iteration_dir, latest_iteration, \
        load_checkpoint
    from forge_engine.hf import SHARD_BYTES, config_to_hf, hf_state_from_shards, write_hf_dir
    from forge_engine.model import ModelConfig
    if not os.path.isdir(load):
        raise FileNotFoundError(f"--load {load}: no such directory")
    it = step if step is not None else latest_iteration(load)
    if it is None:
        raise FileNotFoundError(f"--load {load}: no checkpoint tracker; pass --ckpt-step N")
    if not os.path.isdir(iteration_dir(load, it)):
        raise FileNotFoundError(f"--load {load}: no iteration {it}")
    tp = _saved_tp_size(iteration_dir(load, it))
    if tp is None:
        raise FileNotFoundError(f"--load {load}: iteration {it} has no readable rank file")
    states = [load_checkpoint(load, tp_rank=r, tp_size=tp, iteration=it)[1] for r in range(tp)]
    first = states[0]
    if "model_config" not in first:
        raise ValueError(f"--load {load}: the checkpoint has no model_config (written by an "
                         f"older pretrain.py); it cannot be exported")
    mcfg = ModelConfig(**first["model_config"])
    vocab = (first.get("hf_config") or {}).get("vocab_size") or first.get("vocab_unpadded")
    shards = [s["model"] for s in states]
    dtype = dtype or shards[0]["embedding.weight"].dtype
    tensors = {k: t.to(dtype) for k, t in hf_state_from_shards(shards, mcfg, vocab).items()}
    write_hf_dir(out, tensors, config_to_hf(mcfg, vocab, dtype, first.get("hf_config")),
                 max_shard_bytes or SHARD_BYTES)
    src = (first.get("args") or {}).get("hf_checkpoint")  # its tokenizer travels along
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if src and os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    return it


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory of pretrain.py --save")
    p.add_argument("--out", required=True, help="Hugging Face directory to write")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to export (default: the tracker's latest)")
    p.add_argument("--bf16", action="store_true", help="write bf16 tensors (default: as saved)")
    p.add_argument("--max-shard-bytes", type=int, default=None,
                   help="safetensors shard size (default: 5 GB, as Hugging Face)")
    a = p.parse_args(argv)
    try:
        it = export(a.load, a.out, a.ckpt_step, torch.bfloat16 if a.bf16 else None,
                    a.max_shard_bytes)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"export_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"exported iteration {it} of {a.load} to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fine-tuning steps on chat-shaped data: packed rows against padded micro-batches, FORGE
against --no-forge (docs/performance.md, "Fine-tuning"; pretrain.py --sft's step).

    python3 benchmarks/bench_sft.py --model qwen3-0.6b --seq 2048 --samples 32 --steps 40 \
        --warmup 5 --out $OUT/sft
    python3 benchmarks/bench_sft.py --tiny --out /tmp/sft          # CPU smoke test, seconds

One process, one card, TP = 1, random weights from the preset (bf16 on CUDA, fp32 with
--tiny). The data are synthetic conversations: sample lengths drawn log-normally (median
--median-len tokens, cut to [16, seq + 1]), tokens from MockGPTDataset's Markov chain (so the
loss falls and the curves can be compared), the loss counting the last 60% of each sample
(the "response"). Every step takes the next --samples samples, the same ones in every mode:

  packed   rows of --seq positions, samples next-fit in order (sft.pack_next_fit, as
           SFTDataset packs), one row per micro-batch, block-diagonal attention from segment
           ids (an sdpa boolean mask), positions restarting per sample
  padded   micro-batches of --padded-micro samples, each padded to its longest sample, plain
           causal attention, no segment ids

and each layout runs with FORGE (Engine(forge=True): fused updates, bf16 states for bf16
weights) and without (Engine(forge=False): torch.optim.AdamW(fused=True), fp32 master
weights for bf16, as pretrain.py --no-forge --main-params-dtype fp32). Every step's loss is
the masked token mean of the step (sft.sft_loss_fns), so all four modes train on the same
objective and their loss curves should agree to bf16 noise.

Reported per mode: median step time (ms, after --warmup steps), counted tokens/s (loss
tokens) and sample tokens/s (every position a sample fills), positions computed per sample
token (1.0 = no padding), peak memory (torch.cuda.max_memory_allocated over the mode), the
first and last losses. Files under --out: sft_modes.csv (one row per mode, with the card and
versions), sft_losses.csv (mode, step, loss). On the CPU (--tiny, FORGE_BACKEND=torch) times
are perf_counter and peak memory is the process's max RSS, which never falls: a smoke test.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_kernel import write_csv  # noqa: E402
from forge_engine.data import MockGPTDataset  # noqa: E402
from forge_engine.engine import Engine  # noqa: E402
from forge_engine.model import GPT, preset  # noqa: E402
from forge_engine.sft import pack_next_fit, pack_row, sft_loss_fns  # noqa: E402

MODES = ("packed-forge", "packed-noforge", "padded-forge", "padded-noforge")


def chat_samples(n: int, vocab: int, seq: int, median: int, seed: int):
    """n (ids, mask) pairs of chat-like lengths; the last 60% of each sample is counted."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.exp(rng.normal(math.log(median), 0.6, n)).astype(int), 16, seq + 1)
    chain = MockGPTDataset(vocab, seq, seed, n)
    out = []
    for i, L in enumerate(lengths.tolist()):
        ids = chain[i][:L].numpy()
        mask = np.zeros(L, np.float32)
        mask[L - max(1, int(0.6 * L)):] = 1
        out.append((ids, mask))
    return out


def padded_batch(pairs) -> dict[str, torch.Tensor]:
    """Samples one per row, each padded to the longest: no segment ids (causal attention
    keeps a sample from its padding, which follows it)."""
    s = max(len(ids) for ids, _ in pairs) - 1
    rows = [pack_row([p], s) for p in pairs]
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("tokens", "labels", "loss_mask")}
    return batch


def micro_batches(layout: str, pairs, seq: int, padded_micro: int):
    if layout == "packed":
        rows = pack_next_fit([len(ids) for ids, _ in pairs], seq)
        return [{k: v[None] for k, v in pack_row([pairs[j] for j in r], seq).items()}
                for r in rows]
    return [padded_batch(pairs[i:i + padded_micro]) for i in range(0, len(pairs), padded_micro)]


def loss_fns(model, batches, device):
    """sft_loss_fns for batches with segment ids; the same token mean without them."""
    if "segment_ids" in batches[0]:
        return sft_loss_fns(model, batches, device)
    total = sum(float(b["loss_mask"].sum()) for b in batches)
    scale = len(batches) / total

    def fn(b):
        b = {k: v.to(device) for k, v in b.items()}
        return (model(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() * scale
    return [lambda b=b: fn(b) for b in batches]


def peak_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def run_mode(mode: str, a, cfg, steps_data, device, dtype) -> tuple[dict, list]:
    layout, which = mode.split("-")
    forge = which == "forge"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = GPT(cfg, params_dtype=dtype, seed=a.seed,
                init_device=device.type).to(device)
    kw = dict(lr=a.lr, weight_decay=0.0)
    if forge:
        kw.update(seed=a.seed)
    elif dtype == torch.bfloat16:
        kw.update(main_params_dtype="fp32")
    engine = Engine(model, "adamw", forge=forge, **kw)
    times, losses, counted, filled, computed = [], [], 0, 0, 0
    for step, pairs in enumerate(steps_data):
        batches = micro_batches(layout, pairs, a.seq, a.padded_micro)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        stats = engine.train_step(loss_fns(model, batches, device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(stats.loss)
        if not math.isfinite(stats.loss):
            raise SystemExit(f"error: {mode}: non-finite loss at step {step + 1}")
        if step >= a.warmup:
            times.append(dt)
            counted += sum(int(b["loss_mask"].sum()) for b in batches)
            filled += sum(len(ids) - 1 for ids, _ in pairs)
            computed += sum(b["tokens"].numel() for b in batches)
    engine.synchronize()
    total = sum(times)
    row = {"mode": mode, "layout": layout, "forge": forge, "steps": len(times),
           "median_ms": 1e3 * statistics.median(times),
           "counted_tokens_per_s": counted / total, "sample_tokens_per_s": filled / total,
           "positions_per_sample_token": computed / filled, "peak_gib": peak_gib(device),
           "first_loss": losses[0], "last_loss": losses[-1]}
    del engine, model
    gc.collect()
    return row, losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="preset (random weights)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke test: the tiny preset, seq 128, 3 steps, fp32")
    p.add_argument("--seq", type=int, default=2048, help="packed row length (positions)")
    p.add_argument("--samples", type=int, default=32, help="samples per step")
    p.add_argument("--median-len", type=int, default=300, help="median sample length")
    p.add_argument("--padded-micro", type=int, default=4,
                   help="samples per padded micro-batch")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="directory for the CSVs (default: $OUT or .)")
    a = p.parse_args(argv)
    if a.tiny:
        a.model, a.seq, a.samples, a.median_len = "tiny", 128, 8, 30
        a.steps, a.warmup = min(a.steps, 3), min(a.warmup, 1)
        os.environ.setdefault("FORGE_BACKEND", "torch")
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"error: unknown mode {m!r}; modes: {', '.join(MODES)}")
    if a.warmup >= a.steps:
        raise SystemExit(f"error: --warmup {a.warmup} leaves no timed step of --steps {a.steps}")
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = preset(a.model, seq_length=a.seq)
    data = chat_samples(a.samples * a.steps, cfg.vocab_size, a.seq, a.median_len, a.seed)
    steps_data = [data[i * a.samples:(i + 1) * a.samples] for i in range(a.steps)]
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    env = {"card": card, "torch": torch.__version__, "model": a.model, "seq": a.seq,
           "samples_per_step": a.samples, "median_len": a.median_len,
           "dtype": str(dtype).split(".")[-1]}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "none"
    os.makedirs(a.out, exist_ok=True)
    rows, curves = [], []
    print(f"{card}, torch {torch.__version__}, {a.model} (random weights), seq {a.seq}, "
          f"{a.samples} samples per step, {env['dtype']}")
    print(f"{'mode':16s} {'ms/step':>9s} {'counted tok/s':>14s} {'sample tok/s':>13s} "
          f"{'pos/tok':>8s} {'peak GiB':>9s} {'loss first -> last':>20s}")
    for mode in modes:
        row, losses = run_mode(mode, a, cfg, steps_data, device, dtype)
        rows.append({**row, **env})
        curves += [{"mode": mode, "step": i + 1, "loss": v} for i, v in enumerate(losses)]
        print(f"{mode:16s} {row['median_ms']:9.1f} {row['counted_tokens_per_s']:14.0f} "
              f"{row['sample_tokens_per_s']:13.0f} {row['positions_per_sample_token']:8.2f} "
              f"{row['peak_gib']:9.2f} {row['first_loss']:9.4f} -> {row['last_loss']:.4f}",
              flush=True)
        write_csv(os.path.join(a.out, "sft_modes.csv"), rows, quiet=True)
        write_csv(os.path.join(a.out, "sft_losses.csv"), curves, quiet=True)
    by = {r["mode"]: r for r in rows}
    if "packed-forge" in by and "packed-noforge" in by:
        gap = max(abs(x["loss"] - y["loss"]) for x, y in
                  zip([c for c in curves if c["mode"] == "packed-forge"],
                      [c for c in curves if c["mode"] == "packed-noforge"]))
        print(f"packed: FORGE vs --no-forge, largest per-step loss difference {gap:.4f}")
    print(f"wrote {os.path.join(a.out, 'sft_modes.csv')} and "
          f"{os.path.join(a.out, 'sft_losses.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

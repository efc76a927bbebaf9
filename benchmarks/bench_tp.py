"""Tensor + sequence parallel training steps of a preset on GPUs: FORGE vs forge off.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --model qwen3-0.6b --steps 20

Builds the GPT preset (bf16 weights, random init from --seed) at TP = world size with sequence
parallelism, trains --steps steps on deterministic random tokens (the same on every run), once
with FORGE (fused updates, bf16 moments, stochastic rounding) and once with torch.optim AdamW on
materialized gradients, and prints per-step losses, the median step time and the peak memory of
every GPU. Rank 0 writes JSON to --out. Until pretrain.py lands this is the GPU TP check.
Without CUDA it runs on the CPU with gloo and fp32 weights (a smoke test: --model tiny --seq 64).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from forge_engine.engine import Engine  # noqa: E402
from forge_engine.model import GPT, preset  # noqa: E402
from forge_engine.parallel.state import init_parallel  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args, groups, forge: bool):
    cfg = preset(args.model)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = GPT(cfg, tp_group=groups.tp_group, sequence_parallel=groups.tp_size > 1,
                params_dtype=torch.bfloat16 if cuda else torch.float32, seed=args.seed).to(dev)
    eng = Engine(model, "adamw", forge=forge, tp_group=groups.tp_group, lr=args.lr,
                 betas=(0.9, 0.95), weight_decay=0.1,
                 **({"state_dtype": args.state_dtype} if forge else {}))
    if groups.tp_rank == 0 and dist.get_rank() == 0:
        print(eng.summary, flush=True)
    g = torch.Generator().manual_seed(args.seed)
    losses, times = [], []
    for step in range(args.steps):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(dev)
        sync()
        t0 = time.perf_counter()
        st = eng.train_step(lambda: model(ids[:, :-1], labels=ids[:, 1:]).mean())
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(st.loss)
        if dist.get_rank() == 0:
            print(f"  {'forge' if forge else 'no-forge'} step {step + 1:3d} | lm loss "
                  f"{st.loss:.6f} | grad norm {st.grad_norm:.4f} | {times[-1] * 1e3:.1f} ms",
                  flush=True)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0],
                        device=dev)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    eng = model = None
    return dict(losses=losses, median_ms=statistics.median(times[2:]) * 1e3,
                peak_gib=[round(p.item(), 3) for p in peaks])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--state-dtype", default="bf16", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--out", default="bench_tp.json")
    args = ap.parse_args()
    groups = init_parallel(int(os.environ.get("WORLD_SIZE", "1")))
    res = {"card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
           "world": dist.get_world_size(), "tp": groups.tp_size, "args": vars(args)}
    res["forge"] = run(args, groups, True)
    res["no_forge"] = run(args, groups, False)
    if dist.get_rank() == 0:
        for k in ("forge", "no_forge"):
            r = res[k]
            print(f"{k:9s} median step {r['median_ms']:.1f} ms | peak GiB per GPU {r['peak_gib']}"
                  f" | loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

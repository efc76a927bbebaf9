"""FORGE-DP vs ordinary data parallelism on two GPUs: bytes moved and step time.

    python3 benchmarks/bench_dp.py --nproc 2 --out benchmarks/results/dp/dp_h200x2.json

For each model (qwen3-0.6b, and llama3.1-8b shapes with fewer layers so that the no-forge
baseline's full gradients and moments fit beside the weights) and each mode, launches
`torchrun --nproc-per-node N pretrain.py --bf16 --mock-data ...` (world = DP = N, TP = 1) and
reads rank 0's output:
  - Megatron's log line per iteration: time per iteration, lm loss, peak memory, tokens/s;
  - the line "data-parallel bytes received per replica in iteration 1: ..." (FORGE-DP: token
    gathering, gradient reduce-scatter, weight-row all-gather, standard-path all-reduce;
    --no-forge: the gradient all-reduce, one flat all-reduce after backward as Megatron's DDP
    does without --overlap-grad-reduce).
Step time is the median over the iterations after the first two. Losses of both modes are kept
side by side (same seed and data: they agree to bf16 noise).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_headroom  # noqa: E402

BYTES = re.compile(r"data-parallel bytes received per replica in iteration \d+: (.*) \(total "
                   r"([\d.]+) MiB\)")
MODES = {"forge-bf16": [], "no-forge": ["--no-forge"]}
MODELS = {"qwen3-0.6b": [], "llama3.1-8b-8l": ["--num-layers", "8"]}


def launch(nproc, args, timeout):
    """tp_headroom.launch (torchrun, Megatron's log lines), plus the DP lines of rank 0."""
    r = tp_headroom.launch(nproc, args, timeout)
    b = BYTES.search(r["stdout"])
    moved = {}
    if b:
        for part in b.group(1).split(", "):
            k, v, _ = part.rsplit(" ", 2)
            moved[k] = float(v)
        moved["total"] = float(b.group(2))
    choices = re.findall(r"forge_engine: data-parallel (\S+): (gathers tokens|reduce-scatters "
                         r"its gradient|reduce-scatters its fp32 accumulation buffer)",
                         r["stdout"])
    return dict(rc=r["rc"], rows=r["rows"], moved_mib=moved, wall_s=round(r["wall"], 1),
                choices=choices, tail=r["tail"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=280)
    ap.add_argument("--out", default="dp.json")
    a = ap.parse_args()
    res = {"args": vars(a), "runs": {}}
    for model in a.models.split(","):
        name = model.rsplit("-", 1)[0] if model.endswith("l") and model[-2].isdigit() \
            else model
        for mode, extra in MODES.items():
            args = ["--model", name, *MODELS.get(model, []), "--bf16", "--mock-data",
                    "--seq-length", str(a.seq), "--micro-batch-size", str(a.micro_batch),
                    "--train-iters", str(a.iters), "--log-interval", "1", "--eval-iters", "0",
                    "--lr", "1e-4", "--lr-warmup-iters", "2", *extra]
            r = launch(a.nproc, args, a.timeout)
            steady = [x["ms"] for x in r["rows"][2:]]
            rec = dict(rc=r["rc"], median_ms=statistics.median(steady) if steady else None,
                       peak_gib=max((x["peak"] for x in r["rows"]), default=None),
                       tokens_s=r["rows"][-1]["tps"] if r["rows"] else None,
                       losses=[x["loss"] for x in r["rows"]], moved_mib=r["moved_mib"],
                       choices=r["choices"], wall_s=r["wall_s"], tail=r["tail"])
            res["runs"][f"{model}/{mode}"] = rec
            print(f"{model:>16} {mode:>10} rc {rec['rc']} median {rec['median_ms']} ms, peak "
                  f"{rec['peak_gib']} GiB, tokens/s {rec['tokens_s']}, MiB moved "
                  f"{rec['moved_mib']}", flush=True)
            if rec["tail"]:
                print(rec["tail"], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

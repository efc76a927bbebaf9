"""Configurations of the warp-specialized kernel (fused_ws.py) against the Triton kernel's
default and the unfused baseline, per Llama-3.1-8B linear shape and token count.

    python3 benchmarks/sweep_ws.py --out docs/runs/sweep_ws_h200.csv

Needs a Hopper GPU. Each cell is the median of triton.testing.do_bench over random inputs
(bench_kernel.problem: bf16 weights, bf16 moments, AdamW, stochastic rounding), all in one
process on one card; a configuration that fails (compile, launch) prints its error and is
skipped.
"""
import argparse
import csv
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import SHAPES, bench, moments, problem, unfused_ms  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402

VARIANTS = {
    "ws": {},  # WS_DEFAULT: one consumer of 8 warps, 128 x 128 tiles
    "ws-s3": dict(STAGES=3),
    "ws-g16": dict(GROUP_N=16),
    "pingpong": dict(CONSUMERS=2, BLOCK_N=64, CONSUMER_WARPS=4),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep_ws.csv")
    ap.add_argument("--tokens", default="512,2048,4096")
    ap.add_argument("--shapes", default="qkv,proj,fc1,fc2,head")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: sweep_ws.py needs a Hopper GPU")
    dev = torch.device("cuda")
    names = a.variants.split(",")
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(f"{'shape':>6} {'T':>5} | {'unfused':>8} {'triton':>8} | "
          + " ".join(f"{n:>8}" for n in names))
    rows = []
    for T in map(int, a.tokens.split(",")):
        for shape in a.shapes.split(","):
            N, K = SHAPES[shape]
            x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
            hp = torch.tensor(hp_list, device=dev)
            sumsq = torch.zeros(1, device=dev)
            states = moments(m0, v0, "bf16")
            row = dict(shape=shape, T=T, N=N, K=K, unfused_ms=unfused_ms(x, dy, w))
            row["triton_ms"] = bench(lambda: fused_wgrad_update(x, dy, w, states, spec, hp,
                                                                sumsq, 1, True,
                                                                config={"WS": False}))
            for n in names:
                cfg = dict(WS=True, **VARIANTS[n])
                try:
                    row[f"{n}_ms"] = bench(lambda: fused_wgrad_update(
                        x, dy, w, states, spec, hp, sumsq, 1, True, config=cfg))
                except Exception as e:  # report, keep sweeping
                    print(f"  {n}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    row[f"{n}_ms"] = float("nan")
            rows.append(row)
            print(f"{shape:>6} {T:>5} | {row['unfused_ms']:8.3f} {row['triton_ms']:8.3f} | "
                  + " ".join(f"{row[n + '_ms']:8.3f}" for n in names), flush=True)
            del x, dy, w, m0, v0, states
            torch.cuda.empty_cache()
    with open(a.out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""Launch the fused kernel a few times on one shape and state format: a target for Nsight
Compute (ncu), which profiles the last launches of a program.

    ncu --clock-control none -k regex:_fused --launch-skip 2 --launch-count 1 \
        --metrics gpu__time_duration.sum,... python3 benchmarks/kernel_once.py --fmt int8
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import moments, problem  # noqa: E402
from forge_engine.kernels import fused_wgrad_update  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16", choices=["bf16", "int8"])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--K", type=int, default=14336)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--config", default=None, help="JSON tile configuration (default: ours)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    x, dy, w, m0, v0, spec, hp_list = problem(a.T, a.N, a.K, dev)
    states = moments(m0, v0, a.fmt)
    del m0, v0
    hp = torch.tensor(hp_list, device=dev)
    cfg = json.loads(a.config) if a.config else {"WS": False}  # the Triton kernel by name
    for _ in range(a.calls):
        fused_wgrad_update(x, dy, w, states, spec, hp, torch.zeros(1, device=dev), 1, True,
                           cfg)
    torch.cuda.synchronize()
    print(f"ran {a.calls} launches: fmt {a.fmt}, T N K {a.T} {a.N} {a.K}")


if __name__ == "__main__":
    main()

"""Launch the fused kernel a few times on one shape and state format: a target for Nsight
Compute (ncu), which profiles the last launches of a program.

    ncu --clock-control none -k regex:_fused --launch-skip 2 --launch-count 1 \
        --metrics gpu__time_duration.sum,... python3 benchmarks/kernel_once.py --fmt int8
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
from forge_engine.kernels import StateTensor, fused_wgrad_update  # noqa: E402
from forge_engine.optim import rules as R  # noqa: E402


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
    x = torch.randn(a.T, a.K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(a.T, a.N, device=dev, dtype=torch.bfloat16) * 1e-2
    w = (torch.randn(a.N, a.K, device=dev) * 0.02).to(torch.bfloat16)
    m = StateTensor.from_fp32(torch.randn(a.N, a.K, device=dev) * 1e-3, a.fmt, False)
    v = StateTensor.from_fp32(torch.rand(a.N, a.K, device=dev) * 1e-6, a.fmt, True)
    spec = R.rule_spec(R.ADAMW, 0)
    hp = torch.tensor(R.hparams(R.ADAMW, dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                              weight_decay=0.1), 10, {}), device=dev)
    cfg = json.loads(a.config) if a.config else None
    for _ in range(a.calls):
        fused_wgrad_update(x, dy, w, [m, v, None], spec, hp, torch.zeros(1, device=dev), 1,
                           True, cfg)
    torch.cuda.synchronize()
    print(f"ran {a.calls} launches: fmt {a.fmt}, T N K {a.T} {a.N} {a.K}")


if __name__ == "__main__":
    main()

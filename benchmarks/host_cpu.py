"""Host time of one linear's forward + backward, layer by layer, on this machine's CPU (no GPU).

    python3 benchmarks/host_cpu.py [--layers 16] [--steps 50] [--reps 7]

The eager training step waits on the host (docs/benchmarks.md), so FORGE's Python path per
linear is worth measuring where it runs: on the CPU, with tiny shapes (8 tokens, 64 x 64 bf16
weights) so that the arithmetic is negligible. Rows, each the best of --reps runs of --steps
forward + backward passes through --layers linears, per linear:
  frozen nn.Linear       dX only (the floor every path pays)
  nn.Linear              dX and dW into .grad (torch's training path)
  FORGE, update stubbed  the autograd Function and the optimizer's per-weight bookkeeping,
                         with forge_engine.optim.base.fused_wgrad_update replaced by a no-op
  FORGE, launch stubbed  plus the kernel's host function (checks, configuration, tensor
                         descriptors), with fused_update._launch replaced by a no-op
The card's host is slower per operation than this one (docs/runs/host_overhead_h200*.txt, with
the real launches): compare rows of one run, not runs of two machines.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # the Triton host path on CPU tensors; nothing launches
os.environ["FORGE_BACKEND"] = "triton"
sys.path.insert(0, ".")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import forge_engine  # noqa: E402
import forge_engine.optim.base as base  # noqa: E402
from forge_engine.kernels import fused_update  # noqa: E402


def per_linear_us(model, opt, x, layers, steps, reps) -> float:
    def run(n):
        for _ in range(n):
            model(x).float().sum().backward()
            if opt is not None:
                opt._global_step += 1  # the next backward is a new step (no step() work)
            x.grad = None
    run(10)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run(steps)
        best = min(best, (time.perf_counter() - t0) / steps / layers)
    return best * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    if min(a.layers, a.steps, a.reps) <= 0:
        raise SystemExit("error: --layers, --steps and --reps must be positive")
    torch.manual_seed(0)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)

    def model():
        return nn.Sequential(*[nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
                               for _ in range(a.layers)])
    rows = []
    m = model()
    for p in m.parameters():
        p.requires_grad_(False)
    rows.append(("frozen nn.Linear (dX only)", per_linear_us(m, None, x, a.layers, a.steps,
                                                              a.reps)))
    rows.append(("nn.Linear, dX and dW", per_linear_us(model(), None, x, a.layers, a.steps,
                                                        a.reps)))
    m = model()
    opt = forge_engine.optim.AdamW(m, lr=1e-4)
    update, launch = base.fused_wgrad_update, fused_update._launch
    try:
        base.fused_wgrad_update = lambda *args, **kw: None
        rows.append(("FORGE, update stubbed", per_linear_us(m, opt, x, a.layers, a.steps,
                                                             a.reps)))
        base.fused_wgrad_update, fused_update._launch = update, lambda *args, **kw: None
        rows.append(("FORGE, launch stubbed", per_linear_us(m, opt, x, a.layers, a.steps,
                                                             a.reps)))
    finally:
        base.fused_wgrad_update, fused_update._launch = update, launch
    print(f"torch {torch.__version__}, {a.layers} linears, 8 x 64 -> 64 bf16, best of "
          f"{a.reps} x {a.steps} passes")
    for name, us in rows:
        print(f"{name:<28} {us:7.1f} us per linear")


if __name__ == "__main__":
    main()

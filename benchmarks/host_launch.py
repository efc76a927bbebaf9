"""Host time per fused update launch: the Triton kernel (cached launcher) against the Gluon
kernels (the WS kernel and its split design), on a tiny update whose GPU time is far below
its host time. Needs a Hopper GPU.

    python3 benchmarks/host_launch.py

Prints microseconds per call (500 back-to-back calls after 20 warm-up calls, two rounds).
"""
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import moments, problem  # noqa: E402
from graphed_small import KERNELS  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402


def main():
    dev = torch.device("cuda")
    x, dy, w, m0, v0, spec, hpl = problem(64, 256, 512, dev)  # tiny: the host decides the time
    hp, s, st = torch.tensor(hpl, device=dev), torch.zeros(1, device=dev), moments(m0, v0, "bf16")
    for name, cfg in KERNELS * 2:
        def f():
            fused_wgrad_update(x, dy, w, st, spec, hp, s, 1, True, config=cfg)
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(500):
            f()
        host = (time.perf_counter() - t) / 500 * 1e6
        torch.cuda.synchronize()
        print(f"host per call {name:>7}: {host:6.1f} us", flush=True)


if __name__ == "__main__":
    main()

"""The small Llama-3.1-8B shapes at T = 512 timed two ways: triton.testing.do_bench (host
launches in the timing loop) and do_bench_cudagraph (one captured launch replayed), for the
Triton kernel, the WS kernel and its split design. Needs a Hopper GPU.

    python3 benchmarks/graphed_small.py
"""
import sys

import torch
import triton.testing as tt

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import SHAPES, moments, problem  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402

KERNELS = (("triton", {"WS": False}), ("ws", {"WS": True}), ("split", {"WS": True, "SPLIT": True}))


def main():
    dev = torch.device("cuda")
    for shape in ("proj", "qkv", "fc2"):
        N, K = SHAPES[shape]
        x, dy, w, m0, v0, spec, hpl = problem(512, N, K, dev)
        hp, s = torch.tensor(hpl, device=dev), torch.zeros(1, device=dev)
        st = moments(m0, v0, "bf16")
        for name, cfg in KERNELS:
            def f():
                fused_wgrad_update(x, dy, w, st, spec, hp, s, 1, True, config=cfg)
            a = tt.do_bench(f, warmup=25, rep=200, return_mode="median")
            b = tt.do_bench_cudagraph(f, rep=200, return_mode="median")
            print(f"{shape} T=512 {name:>7}: do_bench {a:.3f} ms, cudagraph {b:.3f} ms",
                  flush=True)


if __name__ == "__main__":
    main()

"""Linear shapes of Llama-3.1-8B / Qwen3-8B timed two ways: triton.testing.do_bench (host
launches in the timing loop) and do_bench_cudagraph (the call captured once and replayed, as
a graphed training step runs it), for the unfused baseline (cuBLAS dW + torch's fused AdamW;
capturable=True in the graph), the Triton kernel, the WS kernel and its split design. Small
shapes at a few hundred tokens are host-bound in do_bench; the graph shows the device's time.
Needs a Hopper GPU.

    python3 benchmarks/graphed_small.py                       # proj, qkv, fc2 at 512 tokens
    python3 benchmarks/graphed_small.py --shapes qkv,proj,fc1,fc2,head,q-fc1,q-fc2,q-head \\
        --out graphed.csv
    python3 benchmarks/graphed_small.py --states int8 --shapes ...   # int8 moments (no WS)
"""
import argparse
import sys

import torch
import triton.testing as tt

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import ADAMW_GROUP, SHAPES, moments, problem, unfused_ms, write_csv  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402

KERNELS = (("triton", {"WS": False}), ("ws", {"WS": True}), ("split", {"WS": True, "SPLIT": True}))


def graph_bench(fn) -> float:
    """Median ms of fn replayed from a CUDA graph (do_bench_cudagraph), after one eager call
    outside the capture (compiles and launches once; the baseline's moments come to exist)."""
    fn()
    return tt.do_bench_cudagraph(fn, rep=200, return_mode="median")


def unfused_parts(x, dy, w):
    """The baseline's two parts on a copy of w, capturable: (gemm, adamw), dW into .grad
    (cuBLAS) and AdamW(fused, capturable) stepping it."""
    p = torch.nn.Parameter(w.clone())
    p.grad = torch.empty_like(p)
    opt = torch.optim.AdamW([p], fused=True, capturable=True, **ADAMW_GROUP)
    return (lambda: torch.matmul(dy.t(), x, out=p.grad)), opt.step


def graphed_unfused_ms(x, dy, w) -> float:
    """The baseline replayed from a CUDA graph: dW into .grad, then AdamW(fused, capturable)."""
    gemm, adamw = unfused_parts(x, dy, w)

    def step():
        gemm()
        adamw()
    return graph_bench(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="proj,qkv,fc2")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=None, help="CSV of the timings (ms)")
    ap.add_argument("--states", default="bf16", choices=("bf16", "int8"),
                    help="the moments' format (int8: no WS kernel, which takes bf16 only)")
    a = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: graphed_small.py needs a Hopper GPU")
    dev, T = torch.device("cuda"), a.tokens
    kernels = [k for k in KERNELS if a.states == "bf16" or k[0] != "ws"]
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__} | T = {T} | "
          f"{a.states} moments")
    rows = []
    for shape in a.shapes.split(","):
        N, K = SHAPES[shape]
        x, dy, w, m0, v0, spec, hpl = problem(T, N, K, dev)
        hp, s = torch.tensor(hpl, device=dev), torch.zeros(1, device=dev)
        st = moments(m0, v0, a.states)
        row = dict(shape=shape, T=T, N=N, K=K, states=a.states, unfused_ms=unfused_ms(x, dy, w),
                   unfused_graph_ms=graphed_unfused_ms(x, dy, w))
        for name, cfg in kernels:
            def f():
                fused_wgrad_update(x, dy, w, st, spec, hp, s, 1, True, config=cfg)
            row[f"{name}_ms"] = tt.do_bench(f, warmup=25, rep=200, return_mode="median")
            row[f"{name}_graph_ms"] = graph_bench(f)
        rows.append(row)
        base = row["unfused_graph_ms"]
        print(f"{shape:>6} | do_bench: unfused {row['unfused_ms']:.3f}, "
              + ", ".join(f"{n} {row[n + '_ms']:.3f}" for n, _ in kernels)
              + f" | graphed: unfused {base:.3f}, "
              + ", ".join(f"{n} {row[n + '_graph_ms']:.3f} ({row[n + '_graph_ms'] / base:.2f}x)"
                          for n, _ in kernels), flush=True)
        x = dy = w = m0 = v0 = st = None  # free them before the next shape
        torch.cuda.empty_cache()
    if a.out:
        write_csv(a.out, rows)


if __name__ == "__main__":
    main()

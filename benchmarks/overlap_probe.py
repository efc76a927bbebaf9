"""Can a fused update run beside the next dX GEMM? (issue 5's lead: overlap the fused update
with the rest of the backward on a second CUDA stream.)

For each Llama-3.1-8B linear shape and token count: the fused update alone, the dX GEMM
dY [T, N] @ W [N, K] alone, 8 (GEMM, update) pairs on one stream, and the same 8 pairs with
every update on a side stream (priority 0, the default streams' own, and -1, above them),
which is what running the updates beside the backward could gain at most. Times are medians
of CUDA-event timings, in ms per pair.

    python3 benchmarks/overlap_probe.py [--out CSV]
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import SHAPES, moments, problem, write_csv  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402

PAIRS = 8


def median_ms(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def probe(name: str, T: int, fmt: str, dev) -> dict:
    N, K = SHAPES[name]
    x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
    hp, sumsq = torch.tensor(hp_list, device=dev), torch.zeros(1, device=dev)
    states, w_upd, w_gemm = moments(m0, v0, fmt), w.clone(), w.clone()

    def update():
        fused_wgrad_update(x, dy, w_upd, states, spec, hp, sumsq, 1, True)

    def gemm():
        return dy @ w_gemm  # the dX of another linear's weight

    def serial():
        for _ in range(PAIRS):
            gemm()
            update()

    row = dict(shape=name, T=T, N=N, K=K, fmt=fmt, update_ms=median_ms(update),
               gemm_ms=median_ms(gemm), serial_ms=median_ms(serial) / PAIRS)
    for prio in (0, -1):
        side = torch.cuda.Stream(priority=prio)

        def overlapped():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            for _ in range(PAIRS):
                gemm()
                with torch.cuda.stream(side):
                    update()
            main.wait_stream(side)
        row[f"side_p{prio}_ms"] = median_ms(overlapped) / PAIRS
    row["best_side_vs_serial"] = min(row["side_p0_ms"], row["side_p-1_ms"]) / row["serial_ms"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qkv,fc1,fc2,head")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--out", default=None, metavar="CSV")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: overlap_probe.py times CUDA streams; no CUDA device here")
    names = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [n for n in names if n not in SHAPES]
    if bad:
        raise SystemExit(f"error: unknown shape(s) {bad}; known: {', '.join(SHAPES)}")
    dev = torch.device("cuda")
    print(f"card: {torch.cuda.get_device_name(dev)} | torch {torch.__version__}")
    print("| shape | T | states | update | dX GEMM | serial pair | side p0 | side p-1 | "
          "best side / serial |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in names:
        for T in (int(t) for t in a.tokens.split(",")):
            for fmt in ("bf16", "int8"):
                r = probe(name, T, fmt, dev)
                rows.append(r)
                print(f"| {name} | {T} | {fmt} | {r['update_ms']:.3f} | {r['gemm_ms']:.3f} | "
                      f"{r['serial_ms']:.3f} | {r['side_p0_ms']:.3f} | {r['side_p-1_ms']:.3f} | "
                      f"{r['best_side_vs_serial']:.3f} |", flush=True)
    if a.out:
        write_csv(a.out, rows)  # (prints where)


if __name__ == "__main__":
    main()

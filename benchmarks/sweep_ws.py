"""Configurations of the warp-specialized kernel (fused_ws.py) against the Triton kernel's
default and the unfused baseline, per Llama-3.1-8B linear shape and token count.

    python3 benchmarks/sweep_ws.py --out sweep_ws.csv
    python3 benchmarks/sweep_ws.py --plot x.png --plot-from a.csv,b.csv   # no GPU
    python3 benchmarks/sweep_ws.py --graph --tokens 2048 --variants glob-t64 \
        --shapes 4096x4096,6144x4096,8192x4096,12288x4096,16384x4096,28672x4096
        # the time against rounds of tiles

Needs a Hopper GPU (but --plot-from, which renders CSVs written before). Each cell is the
median of triton.testing.do_bench (--graph: do_bench_cudagraph, no host launch cost in the
timing) over random inputs
(bench_kernel.problem: bf16 weights, bf16 moments or --states int8, AdamW, stochastic
rounding), all in one
process on one card; a configuration that fails (compile, launch) prints its error and is
skipped.
"""
import argparse
import math
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import bench, moments, problem, pyplot, rows_from, save_ratio_figure, \
    shape_of, target_lines, unfused_ms, write_csv  # noqa: E402
from graphed_small import graph_bench, graphed_unfused_ms  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402
from forge_engine.kernels.fused_ws import SPLIT_LARGE  # noqa: E402

VARIANTS = {
    "ws": {},  # WS_DEFAULT: one consumer of 8 warps, 128 x 128 tiles
    "ws-s3": dict(STAGES=3),
    "ws-g16": dict(GROUP_N=16),
    "pingpong": dict(CONSUMERS=2, BLOCK_N=64, CONSUMER_WARPS=4),
    # the split design (fused_ws.SPLIT_DEFAULT: 128 x 128 tiles, 8 epilogue warps apart from
    # one MMA warpgroup, one W/state set, 32-token steps); the rest are variants of it spelled out
    "split": dict(SPLIT=True),
    "split-64": dict(SPLIT=True, BLOCK_N=64, BLOCK_T=64, STAGES=4, EPI_BUFS=2, MMA_REGS=128),
    "split-e4": dict(SPLIT=True, BLOCK_N=64, BLOCK_T=64, STAGES=4, EPI_BUFS=2, MMA_REGS=128,
                     EPI_WARPS=4),  # 4 epilogue warps, 168 registers each
    "split-b1": dict(SPLIT=True, BLOCK_N=64, BLOCK_T=64, STAGES=4, EPI_BUFS=1,
                     MMA_REGS=128),  # one set of W and state buffers
    "split-s3": dict(SPLIT=True, BLOCK_N=64, BLOCK_T=64, STAGES=3, EPI_BUFS=2, MMA_REGS=128),
    # two 4-warp epilogue groups taking the tiles in turn, each its own buffers
    "split-g2": dict(SPLIT=True, BLOCK_N=64, BLOCK_T=64, EPI_BUFS=2, EPI_GROUPS=2,
                     EPI_WARPS=4, EPI_REGS=176, MMA_REGS=120),
    # the epilogue loading and storing W and the states itself, from and to global memory
    # (shared memory left to the wgmma token loop)
    "split-glob": dict(SPLIT=True, BLOCK_N=64, BLOCK_T=64, STAGES=4, MMA_REGS=128,
                       EPI_GLOBAL=True),
    "split-g2g": dict(SPLIT=True, BLOCK_N=64, BLOCK_T=64, STAGES=4, EPI_GROUPS=2, EPI_WARPS=4,
                      EPI_REGS=192, MMA_REGS=104, EPI_GLOBAL=True),
    # 128-row tiles: twice the elements per epilogue tile (one W/state set)
    "split-128": dict(SPLIT=True, BLOCK_N=128, BLOCK_T=64, STAGES=2, EPI_BUFS=1, MMA_REGS=160),
    "split-128-m168": dict(SPLIT=True, BLOCK_N=128, BLOCK_T=64, STAGES=2, EPI_BUFS=1,
                           MMA_REGS=168),
    "split-128-t32": dict(SPLIT=True, BLOCK_N=128, EPI_BUFS=1, MMA_REGS=160, BLOCK_T=32,
                          STAGES=4),
    "split-128-t16": dict(SPLIT=True, BLOCK_N=128, EPI_BUFS=1, MMA_REGS=160, BLOCK_T=16,
                          STAGES=8),
    # SPLIT_DEFAULT with its W/state set refilled whole, not half by half (EPI_PIPE off)
    "split-nopipe": dict(SPLIT=True, EPI_PIPE=False),
    # fused_ws.SPLIT_LARGE (the default above 1024 tokens: 128-row tiles, W and the states from
    # and to global memory by the epilogue's warps, a 128 KB ring of 64-token steps), then
    # other rings and tile orders of it
    "glob-t64": dict(SPLIT=True, **SPLIT_LARGE),
    "glob-t32": dict(SPLIT=True, **SPLIT_LARGE) | dict(BLOCK_T=32, STAGES=8),
    "glob-t32s10": dict(SPLIT=True, **SPLIT_LARGE) | dict(BLOCK_T=32, STAGES=10),
    "glob-t16s20": dict(SPLIT=True, **SPLIT_LARGE) | dict(BLOCK_T=16, STAGES=20),
    "glob-g4": dict(SPLIT=True, GROUP_N=4, **SPLIT_LARGE),
    "glob-g16": dict(SPLIT=True, GROUP_N=16, **SPLIT_LARGE),
}


def ratio_series(rows: list, variants: list | None = None) -> dict:
    """From sweep rows (this script's CSV, one or more files, e.g. bf16 and int8 moments):
    {T: (shapes in first-seen order, {"<variant>, <states> moments": [time / unfused per
    shape]})}, for each variant column present (all, or those named in `variants`); a shape
    without a timing for a series gives NaN there."""
    out: dict = {}
    for r in rows:
        T = int(r["T"])
        shapes, series = out.setdefault(T, ([], {}))
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    for r in rows:
        shapes, series = out[int(r["T"])]
        for col in r:
            name = col[:-3] if col.endswith("_ms") else None
            if name in (None, "unfused") or (variants and name not in variants) \
                    or r[col] in ("", None):
                continue
            ys = series.setdefault(f"{name}, {r.get('states', 'bf16')} moments",
                                   [float("nan")] * len(shapes))
            ys[shapes.index(r["shape"])] = float(r[col]) / float(r["unfused_ms"])
    return out


def ratio_floor(data: dict) -> float:
    """The panels' lower y limit: 0.6, or under the lowest ratio of any series in steps of
    0.05 (a series below 0.6, e.g. the token loop alone, would otherwise draw no bar)."""
    ys = [y for _, series in data.values() for v in series.values() for y in v if y == y]
    return min(0.6, math.floor(20 * min(ys)) / 20 - 0.05) if ys else 0.6


def plot(rows: list, path: str, title: str, variants: list | None = None) -> None:
    """One panel per token count: each series' time / unfused per shape (ratio_series), with
    the kernel targets (0.85 bf16, 0.95 int8 moments) and parity as lines."""
    plt = pyplot(path)
    if plt is None:
        return
    data = ratio_series(rows, variants)
    labels = sorted({label for _, series in data.values() for label in series})
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4.2), sharey=True,
                             squeeze=False)
    for ax, T in zip(axes[0], sorted(data)):
        shapes, series = data[T]
        width = 0.8 / max(1, len(series))
        for i, (label, ys) in enumerate(series.items()):  # one color per series everywhere
            ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(shapes))], ys, width,
                   label=label, color=f"C{labels.index(label)}")
        target_lines(ax)
        ax.set_xticks(list(range(len(shapes))), shapes, rotation=45)
        ax.set_ylim(ratio_floor(data), 1.3)
        ax.set_title(f"T = {T} tokens")
    save_ratio_figure(fig, axes, title, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep_ws.csv")
    ap.add_argument("--tokens", default="512,2048,4096")
    ap.add_argument("--shapes", default="qkv,proj,fc1,fc2,head",
                    help="comma-separated bench_kernel.SHAPES names or NxK weights")
    ap.add_argument("--variants", default=None, help="comma-separated VARIANTS keys "
                                                      "(default: all of them)")
    ap.add_argument("--graph", action="store_true",
                    help="time each call replayed from a CUDA graph (do_bench_cudagraph; the "
                         "baseline with capturable AdamW), as a graphed step runs it: no host "
                         "launch cost in the timing")
    ap.add_argument("--states", default="bf16", choices=("bf16", "int8"),
                    help="the moments' format (int8: the split variants only)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="render time / unfused per shape (the --variants named, if any)")
    ap.add_argument("--plot-from", default=None, metavar="CSV[,CSV]",
                    help="only render --plot from CSVs this script wrote (no GPU needed)")
    a = ap.parse_args()
    if a.plot_from:
        plot(rows_from(a.plot, a.plot_from), a.plot, f"sweep_ws.py, {a.plot_from}",
             a.variants.split(",") if a.variants else None)
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: sweep_ws.py needs a Hopper GPU")
    dev = torch.device("cuda")
    names = a.variants.split(",") if a.variants else list(VARIANTS)
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"{a.states} moments")
    print(f"{'shape':>6} {'T':>5} | {'unfused':>8} {'triton':>8} | "
          + " ".join(f"{n:>8}" for n in names))
    rows = []
    for T in map(int, a.tokens.split(",")):
        for shape in a.shapes.split(","):
            N, K = shape_of(shape)
            x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
            hp = torch.tensor(hp_list, device=dev)
            sumsq = torch.zeros(1, device=dev)
            states = moments(m0, v0, a.states)
            timed = graph_bench if a.graph else bench
            row = dict(shape=shape, T=T, N=N, K=K, states=a.states,
                       unfused_ms=(graphed_unfused_ms if a.graph else unfused_ms)(x, dy, w))
            row["triton_ms"] = timed(lambda: fused_wgrad_update(x, dy, w, states, spec, hp,
                                                                sumsq, 1, True,
                                                                config={"WS": False}))
            for n in names:
                cfg = dict(WS=True, **VARIANTS[n])
                try:
                    row[f"{n}_ms"] = timed(lambda: fused_wgrad_update(
                        x, dy, w, states, spec, hp, sumsq, 1, True, config=cfg))
                except Exception as e:  # report, keep sweeping
                    print(f"  {n}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    row[f"{n}_ms"] = float("nan")
            rows.append(row)
            print(f"{shape:>6} {T:>5} | {row['unfused_ms']:8.3f} {row['triton_ms']:8.3f} | "
                  + " ".join(f"{row[n + '_ms']:8.3f}" for n in names), flush=True)
            x = dy = w = m0 = v0 = states = None  # free them before the next shape
            torch.cuda.empty_cache()
    write_csv(a.out, rows)
    if a.plot:
        plot(rows, a.plot, f"sweep_ws.py, {torch.cuda.get_device_name()}, "
                           f"{'graphed' if a.graph else 'do_bench'}")


if __name__ == "__main__":
    main()

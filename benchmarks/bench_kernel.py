"""Fused dW + optimizer kernel vs cuBLAS dW + torch's fused AdamW, on the linear shapes of
Llama-3.1-8B and Qwen3-8B.

For each (T tokens, weight [N, K]) it times, in one process on one card (median of
triton.testing.do_bench, random inputs, never zeros):
  gemm        dW = dY^T X through cuBLAS (bf16 in, fp32 out as torch's wgrad would be bf16; we
              time bf16 out, the cheaper one)
  unfused     gemm + torch.optim.AdamW(fused=True) step on bf16 weights / bf16 moments
  forge_bf16  the Triton kernel (config WS=False, its default tiles): bf16 weights with
              stochastic rounding, bf16 moments
  forge_int8  the Triton kernel: bf16 weights with stochastic rounding, int8 moments
  forge_ws    the warp-specialized Gluon kernel (fused_ws.py; Hopper only) at its own default
              design (config WS=True, not the split design): bf16 weights with stochastic
              rounding, bf16 moments
  route_bf16, route_int8
              fused_wgrad_update without a config, as the engine calls it eagerly: the
              default route (FORGE_WS=auto: the split design at fused_ws.SPLIT_LARGE above
              1024 tokens on Hopper, the Triton kernel otherwise; updates captured into a CUDA
              graph take the split design at 512 tokens too, which sweep_ws.py --graph times;
              do_bench times the Gluon launch's host work where the GPU waits for it, so the
              route's device time is sweep_ws.py --graph's)
(the named kernels are timed at every token count) and prints a table (ratio = forge /
unfused; TF/s of cuBLAS and of our token loop alone, the norm-only pass; the epilogue's W +
moment bytes over forge16 minus that loop, against the device copy ceiling measured first,
nan where do_bench timed host launches: bench_kernel's small shapes at 512 tokens are
host-bound, graphed_small.py gives their device times), writing CSV to --out and, with
--plot, a PNG of the ratios. Usage (GPU):
    python3 benchmarks/bench_kernel.py --out kernel.csv --plot kernel.png
and, anywhere, from a CSV it wrote:
    python3 benchmarks/bench_kernel.py --plot-from kernel.csv \
        --plot kernel.png
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, ".")
from forge_engine.kernels import StateTensor  # noqa: E402
from forge_engine.kernels.fused_update import default_config, fused_wgrad_update  # noqa: E402
from forge_engine.kernels import rules as R  # noqa: E402

# Llama-3.1-8B: hidden 4096, FFN 14336, 32 heads, 8 KV heads (head dim 128), vocab 128256
SHAPES = {
    "qkv": (6144, 4096), "proj": (4096, 4096), "fc1": (28672, 4096), "fc2": (4096, 14336),
    "head": (128256, 4096),
    # Qwen3-8B where it differs (qkv and proj are Llama's): FFN 12288, vocab 151936
    "q-fc1": (24576, 4096), "q-fc2": (4096, 12288), "q-head": (151936, 4096),
}


def shape_of(name: str) -> tuple[int, int]:
    """A weight's (N, K): a SHAPES name, or "NxK" (e.g. 8192x4096) for other shapes."""
    if name in SHAPES:
        return SHAPES[name]
    parts = name.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"error: shape {name!r} is neither one of {sorted(SHAPES)} nor NxK "
                         f"(two positive integers, e.g. 8192x4096)")
    return int(parts[0]), int(parts[1])


def bench(fn, reps_ms=200):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")


# one AdamW step of a bf16 weight, as every kernel benchmark here times it
ADAMW_GROUP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
ADAMW_STEP = 10
HOPPER = False  # main() sets it: whether the warp-specialized kernel is timed
COPY_TBPS = float("inf")  # main() sets it: the device copy ceiling, TB/s (read + write)


def problem(T, N, K, dev):
    """Random operands of one linear: x [T, K], dy [T, N] (bf16), w [N, K] bf16, and fp32
    moments m0, v0 [N, K] of a plausible scale (never zeros); plus AdamW's rule spec and hp
    list at step ADAMW_STEP."""
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16) * 1e-2
    w = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
    m0 = torch.randn(N, K, device=dev) * 1e-3
    v0 = torch.rand(N, K, device=dev) * 1e-6
    return x, dy, w, m0, v0, R.rule_spec(R.ADAMW, 0), R.hparams(R.ADAMW, ADAMW_GROUP,
                                                               ADAMW_STEP, {})


def moments(m0, v0, fmt):
    """AdamW's state slots in format fmt."""
    return [StateTensor.from_fp32(m0, fmt, False), StateTensor.from_fp32(v0, fmt, True), None]


def written(w, states) -> list:
    """What an update writes: W, then each present state's tensors (int8: codes and scales),
    for bit-for-bit comparisons (ab_ws.py, stress_kernel.py)."""
    return [w] + [t for q in states if q is not None for t in (q.data, q.scale) if t is not None]


def sumsq_tol(ref: float, N: int, K: int) -> float:
    """The fused kernels add their tiles' squared norms to sumsq atomically, in any order (each
    tile's own term the same in both runs: one fixed reduction). A sum of n positive terms in
    fp32, in any order, lies within g = (n - 1) u / (1 - (n - 1) u) relative of the exact sum
    (u = 2^-24; Higham, recursive summation), so two orders differ by at most 2 g / (1 - g)
    of either result; n = the tiles at the split design's smallest, 64 x 128."""
    g = max(-(-N // 64) * -(-K // 128) - 1, 0) * 2.0 ** -24
    g = g / (1.0 - g)
    return 2.0 * g / (1.0 - g) * abs(ref)


def sumsq_close(got: float, ref: float, N: int, K: int) -> bool:
    """Two sumsq of one update equal up to sumsq_tol (NaN never is)."""
    return abs(got - ref) <= sumsq_tol(ref, N, K)


def unfused_ms(x, dy, w, reps_ms=200) -> float:
    """The baseline: cuBLAS dW + torch.optim.AdamW(fused=True) on bf16 weights and moments."""
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([p], lr=ADAMW_GROUP["lr"], betas=ADAMW_GROUP["betas"],
                            eps=ADAMW_GROUP["eps"], weight_decay=ADAMW_GROUP["weight_decay"],
                            fused=True)
    p.grad = dy.t() @ x
    opt.step()  # create moments (bf16, like the weight)

    def unfused():
        p.grad = dy.t() @ x
        opt.step()
    return bench(unfused, reps_ms)


def run(T, N, K, dev):
    x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
    row = dict(T=T, N=N, K=K)
    row["gemm_ms"] = bench(lambda: dy.t() @ x)
    row["unfused_ms"] = unfused_ms(x, dy, w)
    hp = torch.tensor(hp_list, device=dev)
    sumsq = torch.zeros(1, device=dev)
    for fmt in ("bf16", "int8"):
        states = moments(m0, v0, fmt)
        ww = w.clone()
        row[f"forge_{fmt}_ms"] = bench(
            lambda: fused_wgrad_update(x, dy, ww, states, spec, hp, sumsq, 1, True,
                                       config={"WS": False}))
        row[f"route_{fmt}_ms"] = bench(  # the default route, as the engine calls it
            lambda: fused_wgrad_update(x, dy, ww, states, spec, hp, sumsq, 1, True))
        if fmt == "bf16":  # the token loop alone: the norm-only pass, no epilogue traffic
            row["forge_loop_ms"] = bench(lambda: fused_wgrad_update(
                x, dy, ww, states, spec, hp, sumsq, 1, True, norm_only=True))
            row["forge_ws_ms"] = bench(lambda: fused_wgrad_update(
                x, dy, ww, states, spec, hp, sumsq, 1, True, config={"WS": True})) \
                if HOPPER else float("nan")
        states = ww = None  # free them before the next format
    del m0, v0
    flops = 2.0 * T * N * K
    row["gemm_tflops"] = flops / row["gemm_ms"] / 1e9
    row["forge_bf16_tflops"] = flops / row["forge_bf16_ms"] / 1e9
    row["forge_loop_tflops"] = flops / row["forge_loop_ms"] / 1e9
    # update bytes: read x, dy once; read+write w (2 B) and 2 moments (2 B each)
    upd_bytes = N * K * (2 + 2 + 2 + 2) * 2 + (T * K + T * N) * 2
    row["forge_bf16_GBps"] = upd_bytes / row["forge_bf16_ms"] / 1e6
    row["epilogue_GBps"] = epilogue_gbps(N * K * 12, row["forge_bf16_ms"],
                                         row["forge_loop_ms"], COPY_TBPS)
    row["ratio_bf16"] = row["forge_bf16_ms"] / row["unfused_ms"]
    row["ratio_int8"] = row["forge_int8_ms"] / row["unfused_ms"]
    row["ratio_ws"] = row["forge_ws_ms"] / row["unfused_ms"]
    row["ratio_route_bf16"] = row["route_bf16_ms"] / row["unfused_ms"]
    row["ratio_route_int8"] = row["route_int8_ms"] / row["unfused_ms"]
    return row


def epilogue_gbps(nbytes: float, total_ms: float, loop_ms: float, copy_tbps: float) -> float:
    """The epilogue's W + moment bytes over its share of the time (the kernel's minus its token
    loop's alone), GB/s; NaN where that share is no time at all or would beat the device copy
    ceiling measured in the same run: there do_bench times the host's launches of both calls
    (small shapes at a few hundred tokens), not the device, and the difference means nothing
    (benchmarks/graphed_small.py times the device there)."""
    share = total_ms - loop_ms
    if share <= 0 or nbytes / share / 1e9 > copy_tbps:
        return float("nan")
    return nbytes / share / 1e6


def write_csv(path: str, rows: list, quiet: bool = False) -> None:
    """rows (dicts, the first one's keys the columns) to path as CSV, through a file beside it
    then renamed over path: a run killed while writing (or a row that does not fit) leaves
    the last complete file, not a truncated one. Says where unless quiet (a script rewriting
    its CSV after every cell says it once)."""
    tmp = f"{path}.part{os.getpid()}"
    try:
        with open(tmp, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if not quiet:
        print(f"wrote {path}")


def rows_from(plot: str | None, plot_from: str) -> list:
    """--plot-from's rows: every row of the comma-separated CSVs (written by the script
    before), each with "_src", the file it came from; --plot-from needs --plot."""
    if not plot:
        raise SystemExit("error: --plot-from needs --plot PNG")
    rows = []
    for path in plot_from.split(","):
        with open(path, newline="") as f:
            rows += [dict(r, _src=path) for r in csv.DictReader(f)]
    return rows


def pyplot(path: str):
    """matplotlib.pyplot on the Agg backend, or None (said once) where it is not importable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not importable; {path} not written")
        return None
    return plt


def target_lines(ax) -> None:
    """Parity (1.0) and the kernel targets (0.95 int8, 0.85 bf16 moments) on a panel."""
    for y, style, name in ((1.0, "-", "unfused"), (0.95, ":", "int8 target"),
                           (0.85, "--", "bf16 target")):
        ax.axhline(y, color="k", linestyle=style, linewidth=0.8, label=name)


def save_ratio_figure(fig, axes, title: str, path: str) -> None:
    """The ratio panels' shared label, legend and title; written to path. The legend has every
    label of every panel once (panels may show different series)."""
    axes[0][0].set_ylabel("time / (cuBLAS dW + fused AdamW)")
    seen = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    axes[0][-1].legend(list(seen.values()), list(seen), fontsize=7, loc="upper left",
                       bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# (CSV column, legend label) of the ratio series plot() draws where a CSV has them as numbers
SERIES = (("ratio_bf16", "Triton kernel, bf16 moments"),
          ("ratio_int8", "Triton kernel, int8 moments"),
          ("ratio_ws", "WS kernel, bf16 moments"),
          ("ratio_route_bf16", "default route, bf16 moments"),
          ("ratio_route_int8", "default route, int8 moments"))


def _numbers(sel: list, col: str) -> bool:
    """Whether the rows give column col as numbers, not absent (an older CSV) or NaN (no
    Hopper for the WS kernel)."""
    return any(r.get(col) not in (None, "") and float(r[col]) == float(r[col]) for r in sel)


def plot(rows: list, path: str, title: str) -> None:
    """One panel per token count: time / unfused per shape, each SERIES column the CSV has,
    with the issue-5 targets (0.85 and 0.95) and parity (1.0) as lines."""
    plt = pyplot(path)
    if plt is None:
        return
    tokens = sorted({int(r["T"]) for r in rows})
    fig, axes = plt.subplots(1, len(tokens), figsize=(4.5 * len(tokens), 4), sharey=True,
                             squeeze=False)
    for ax, T in zip(axes[0], tokens):
        sel = [r for r in rows if int(r["T"]) == T]
        shown = [(i, col, label) for i, (col, label) in enumerate(SERIES) if _numbers(sel, col)]
        width = 0.8 / max(1, len(shown))
        for k, (i, col, label) in enumerate(shown):
            ax.bar([x - 0.4 + width * (k + 0.5) for x in range(len(sel))],
                   [float(r[col]) for r in sel], width, label=label, color=f"C{i}")
        target_lines(ax)
        ax.set_xticks(list(range(len(sel))), [r["shape"] for r in sel], rotation=45)
        ax.set_title(f"T = {T} tokens")
    save_ratio_figure(fig, axes, title, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_kernel.csv")
    ap.add_argument("--tokens", default="512,2048,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--plot", default=None, metavar="PNG", help="render the ratios")
    ap.add_argument("--plot-from", default=None, metavar="CSV",
                    help="only render --plot from a CSV this script wrote (no GPU needed)")
    a = ap.parse_args()
    if a.plot_from:
        plot(rows_from(a.plot, a.plot_from), a.plot, f"bench_kernel.py, {a.plot_from}")
        return
    shapes = [(s, shape_of(s)) for s in a.shapes.split(",")]  # bad names fail before the GPU
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_kernel.py needs a CUDA GPU")
    dev = torch.device("cuda")
    global HOPPER, COPY_TBPS
    HOPPER = torch.cuda.get_device_capability()[0] == 9
    src = torch.randn(2 ** 28, device=dev)  # 1 GiB: the copy ceiling, bytes read + written
    dst = torch.empty_like(src)
    copy_tbps = COPY_TBPS = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e9
    src = dst = None
    print(f"device copy ceiling: {copy_tbps:.2f} TB/s (read + write)")
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__} | tiles: "
          f"default_config() per shape, e.g. T=4096 {default_config(torch.bfloat16, 4096, 0, 0)}")
    rows = []
    hdr = (f"{'shape':>6} {'T':>5} {'N':>6} {'K':>6} | {'gemm':>7} {'unfused':>8} "
           f"{'forge16':>8} {'forge8':>8} {'ws16':>8} {'route16':>8} {'route8':>8} | {'r16':>5} "
           f"{'r8':>5} {'rws':>5} {'rr16':>5} {'rr8':>5} | "
           f"{'TF/s gemm':>9} "
           f"{'TF/s loop':>9} | {'epi TB/s':>8}")
    print(hdr)
    for T in map(int, a.tokens.split(",")):
        for name, (N, K) in shapes:
            r = run(T, N, K, dev)
            r["shape"] = name
            rows.append(r)
            print(f"{name:>6} {T:>5} {N:>6} {K:>6} | {r['gemm_ms']:7.3f} {r['unfused_ms']:8.3f} "
                  f"{r['forge_bf16_ms']:8.3f} {r['forge_int8_ms']:8.3f} "
                  f"{r['forge_ws_ms']:8.3f} {r['route_bf16_ms']:8.3f} {r['route_int8_ms']:8.3f} | "
                  f"{r['ratio_bf16']:5.2f} {r['ratio_int8']:5.2f} {r['ratio_ws']:5.2f} "
                  f"{r['ratio_route_bf16']:5.2f} {r['ratio_route_int8']:5.2f} | "
                  f"{r['gemm_tflops']:9.1f} "
                  f"{r['forge_loop_tflops']:9.1f} | {r['epilogue_GBps'] / 1e3:8.2f}", flush=True)
            r["copy_TBps"] = copy_tbps
            torch.cuda.empty_cache()
    write_csv(a.out, rows)
    if a.plot:
        plot(rows, a.plot, f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                           f"bf16 weights with stochastic rounding, AdamW")


if __name__ == "__main__":
    main()

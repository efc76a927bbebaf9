"""SM clock and board power while one workload runs for a while, per shape and token count:
cuBLAS's dW GEMM alone, torch's fused AdamW alone (bf16 weights and moments), the two as the
unfused baseline, and the fused kernel on its default route (bf16 moments, and int8 with
--int8). Each workload is captured as a CUDA graph of several calls and replayed for
--seconds while a thread samples NVML every 10 ms: the median SM clock (MHz) and board power
(W, NVML's instantaneous reading where the driver has it) over the samples after the first
SETTLE_S, the clock event reasons seen in any of them (SW power cap, HW slowdown, thermal),
and the time per call over the whole replay (CUDA events).

    python3 benchmarks/power_probe.py --shapes fc1,fc2,proj --tokens 2048,4096 --int8 \\
        --out benchmarks/results/power/power_h200.csv
    python3 benchmarks/power_probe.py --plot x.png --plot-from a.csv,b.csv   # no GPU

The question it answers: does a kernel run at the board's power cap (the SW power cap among
its reasons, the clock held under the card's maximum), so that its time is its energy per
call over the cap's power, and how much of that energy is the fused update's (--ws-file with
a variant whose epilogue does nothing: the token loop alone)?
Needs a Hopper GPU and NVML (the nvidia-ml-py package, `import pynvml`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import moments, problem, rows_from, shape_of, write_csv  # noqa: E402
from graphed_small import unfused_parts  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402

# NVML's clock event reasons (nvml.h, nvmlClocksEventReason*), the ones that slow a busy GPU
REASONS = {0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x20: "sw-thermal", 0x40: "hw-thermal",
           0x80: "hw-power-brake"}


def reasons_text(mask: int) -> str:
    return "+".join(name for bit, name in REASONS.items() if mask & bit) or "none"


SETTLE_S = 1.5  # seconds of each workload's replay before its samples count
POWER_INSTANT = 186  # nvml.h NVML_FI_DEV_POWER_INSTANT: the board's power now, in mW


def instant_power_w(nvml, handle) -> float | None:
    """The board's power now (W), NVML's instantaneous field; None where the driver or the
    binding lacks it."""
    try:
        (fv,) = nvml.nvmlDeviceGetFieldValues(handle, [POWER_INSTANT])
    except (nvml.NVMLError, AttributeError):
        return None
    return fv.value.uiVal / 1000.0 if fv.nvmlReturn == 0 else None


def power_w(nvml, handle) -> float:
    """The board's power (W): instantaneous where NVML has it, else nvmlDeviceGetPowerUsage
    (on this H200's driver an average over about a second)."""
    now = instant_power_w(nvml, handle)
    return now if now is not None else nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0


def sampled(fn, seconds: float, nvml, handle, calls_per_graph: int) -> dict:
    """Replay fn (captured calls_per_graph times in one graph) for `seconds`, NVML sampled
    meanwhile: median clock and power, the reasons' union, ms per call."""
    fn()  # compile, create state
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    reason = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic(),
                            nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                            power_w(nvml, handle), reason(handle)))
            time.sleep(0.01)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = threading.Thread(target=sample)
    replays = 0
    start.record()
    t0 = time.monotonic()
    t.start()
    while time.monotonic() - t0 < seconds:
        for _ in range(8):
            g.replay()
        replays += 8
        end.record()
        end.synchronize()
    stop.set()
    t.join()
    # the first SETTLE_S: the clock still settling, and a power reading that averages over a
    # window (nvmlDeviceGetPowerUsage on Hopper: about a second) still holding the last workload
    steady = [smp for smp in samples if smp[0] - t0 >= SETTLE_S] or samples[-1:]
    mask = 0
    for *_, r in steady:
        mask |= r
    return dict(ms=start.elapsed_time(end) / (replays * calls_per_graph),
                clock_mhz=statistics.median(c for _, c, _, _ in steady),
                power_w=statistics.median(p for _, _, p, _ in steady),
                reasons=reasons_text(mask), samples=len(steady))


def energies(rows: list) -> dict:
    """Per (T, shape) cell of power_probe.py's rows: each workload's energy per call (J, time
    times median power) and the 0.85x target's time at the fused kernel's power as energy
    (what the fused kernel may spend per call at that power to take 0.85x of the unfused
    time). A cell is one run's: rows of a later source (their "_src", the CSV they came
    from) replace the cell's earlier ones wholesale, never mixing two cards in one cell."""
    cells: dict = {}
    for r in rows:
        key = (int(r["T"]), r["shape"])
        if cells.get(key, {}).get("_src", r.get("_src")) != r.get("_src"):
            del cells[key]
        cell = cells.setdefault(key, {"_src": r.get("_src")})
        cell[r["workload"]] = float(r["ms"]) * float(r["power_w"]) / 1000.0
        if r["workload"] == "unfused":
            cell["_unfused_ms"] = float(r["ms"])
        if r["workload"] == "fused-bf16":
            cell["_fused_w"] = float(r["power_w"])
    for cell in cells.values():
        if "_unfused_ms" in cell and "_fused_w" in cell:
            cell["budget-0.85"] = 0.85 * cell["_unfused_ms"] * cell["_fused_w"] / 1000.0
    return cells


def plot(rows: list, path: str, title: str) -> None:
    """Energy per call over the cuBLAS GEMM's, per shape, one panel per token count: the
    unfused baseline as its GEMM and AdamW parts (each run alone), the token loop alone
    where measured (a --ws-file named fws_loop_only), the fused kernel with bf16 and int8
    moments, and the 0.85x target's energy at the fused kernel's power."""
    from bench_kernel import pyplot
    plt = pyplot(path)
    if plt is None:
        return
    cells = energies(rows)
    tokens = sorted({t for t, _ in cells})
    fig, axes = plt.subplots(1, len(tokens), figsize=(4.2 * len(tokens), 3.8), squeeze=False)
    for ax, T in zip(axes[0], tokens):
        names = [s for t, s in cells if t == T]
        for i, name in enumerate(names):
            c = cells[(T, name)]
            g = c["gemm"]
            ax.bar(i - 0.3, 1.0, 0.2, color="0.55", label="cuBLAS GEMM alone")
            ax.bar(i - 0.3, c["adamw"] / g, 0.2, bottom=1.0, color="0.8",
                   label="+ fused AdamW alone")
            if "file:fws_loop_only" in c:
                ax.bar(i - 0.1, c["file:fws_loop_only"] / g, 0.2, color="tab:blue",
                       alpha=0.45, label="token loop alone (ours)")
            ax.bar(i + 0.1, c["fused-bf16"] / g, 0.2, color="tab:blue", fill=False,
                   edgecolor="tab:blue", label="fused, bf16 moments")
            if "fused-int8" in c:
                ax.bar(i + 0.3, c["fused-int8"] / g, 0.2, color="tab:orange", fill=False,
                       edgecolor="tab:orange", label="fused, int8 moments")
            if "budget-0.85" in c:
                ax.hlines(c["budget-0.85"] / g, i - 0.4, i + 0.4, colors="tab:red",
                          label="0.85x of unfused time at the fused power")
        ax.set_xticks(range(len(names)), names)
        ax.set_title(f"T = {T} tokens")
        ax.set_ylim(0, None)
    axes[0][0].set_ylabel("energy per call / cuBLAS GEMM's")
    seen = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), fontsize=7, loc="lower center",
               ncol=3, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="fc1,proj", help="bench_kernel.SHAPES names or NxK")
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--int8", action="store_true", help="also the fused kernel, int8 moments")
    ap.add_argument("--rn", action="store_true",
                    help="also the fused kernel, bf16 moments, rounding to nearest instead of "
                         "stochastically (no random draws: fewer instructions, the same bytes)")
    ap.add_argument("--ws-file", default=None, metavar="PY[,PY]",
                    help="also copies of fused_ws.py (variants, loaded as ab_ws.py loads its "
                         "--base), each at its own SPLIT_LARGE with bf16 moments: workload "
                         "'file:NAME' (NAME: the file's stem)")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help=f"replay time per workload (samples count after {SETTLE_S} s)")
    ap.add_argument("--out", default="power_probe.csv")
    ap.add_argument("--plot", default=None, metavar="PNG", help="render energy per call")
    ap.add_argument("--plot-from", default=None, metavar="CSV[,CSV]",
                    help="only render --plot from CSVs this script wrote (no GPU needed)")
    a = ap.parse_args()
    if a.plot_from:
        plot(rows_from(a.plot, a.plot_from), a.plot, f"power_probe.py, {a.plot_from}")
        return
    shapes = [(s, shape_of(s)) for s in a.shapes.split(",")]  # bad names fail before the GPU
    if a.seconds <= SETTLE_S:
        raise SystemExit(f"error: --seconds {a.seconds} leaves no samples: they count after "
                         f"the first {SETTLE_S} s of each replay")
    variants = {}
    if a.ws_file:
        from ab_ws import load_revision
        for path in a.ws_file.split(","):
            if not Path(path).is_file():
                raise SystemExit(f"error: --ws-file {path}: no such file")
            variants[f"file:{Path(path).stem}"] = load_revision(path)
    try:
        import pynvml as nvml
    except ImportError:
        raise SystemExit("error: power_probe.py needs NVML's Python binding (pip install "
                         "nvidia-ml-py)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: power_probe.py needs a Hopper GPU")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    dev = torch.device("cuda")
    limit = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    idle = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
    top = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)
    instant = instant_power_w(nvml, handle) is not None
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__} | power limit "
          f"{limit:.0f} W | SM clock max {top} MHz, now {idle} MHz | power: "
          f"{'instantaneous' if instant else 'NVML average (about 1 s)'}")
    print(f"{'shape':>6} {'T':>5} {'workload':>22} | {'ms/call':>8} {'MHz':>5} {'W':>5} | "
          f"reasons")
    rows = []
    for T in map(int, a.tokens.split(",")):
        for name, (N, K) in shapes:
            x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
            hp = torch.tensor(hp_list, device=dev)
            sumsq = torch.zeros(1, device=dev)
            gemm, adamw = unfused_parts(x, dy, w)
            gemm()
            adamw()  # the moments (bf16, like the weight)
            wf = w.clone()
            work = {"gemm": gemm, "adamw": adamw, "unfused": lambda: (gemm(), adamw())}
            fmts = ["bf16"] + (["int8"] if a.int8 else [])
            st = {f: moments(m0, v0, f) for f in fmts}
            for f in fmts:
                work[f"fused-{f}"] = (lambda f=f: fused_wgrad_update(x, dy, wf, st[f], spec, hp,
                                                                     sumsq, 1, True))
            if a.rn:
                work["fused-bf16-rn"] = lambda: fused_wgrad_update(x, dy, wf, st["bf16"], spec,
                                                                   hp, sumsq, 1, False)
            for vname, mod in variants.items():
                work[vname] = (lambda mod=mod: mod.fused_wgrad_update_ws(
                    x, dy, wf, st["bf16"], spec, hp, sumsq, 1, True,
                    config=dict(SPLIT=True, **mod.SPLIT_LARGE)))
            for wl, fn in work.items():
                r = sampled(fn, a.seconds, nvml, handle, calls_per_graph=10)
                rows.append(dict(shape=name, T=T, N=N, K=K, workload=wl, **r))
                print(f"{name:>6} {T:>5} {wl:>22} | {r['ms']:8.4f} {r['clock_mhz']:5.0f} "
                      f"{r['power_w']:5.0f} | {r['reasons']}", flush=True)
            x = dy = w = wf = m0 = v0 = st = gemm = adamw = None
            torch.cuda.empty_cache()
    write_csv(a.out, rows)
    if a.plot:
        plot(rows, a.plot, f"power_probe.py, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()

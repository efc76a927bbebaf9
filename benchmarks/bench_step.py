"""Whole training steps of a GPT, FORGE vs torch.optim's fused AdamW: time and memory
(docs/performance.md: the step and capacity figures).

    python3 benchmarks/bench_step.py --model llama3.1-8b --seq 512 --batch 1 \
        --out step.json --plot step.png

One process, one card, TP = 1, bf16 weights. For each mode in turn (a fresh model and optimizer
from the same seed; the previous one freed completely first) it runs --warmup steps, then
--steps timed steps of `Engine.train_step` (forward, backward, grad norm, optimizer.step,
zero_grad) on random token ids [batch, seq + 1] (uniform over the vocabulary, fresh every step,
the same stream in every mode):
  torch-fused  the baseline: Engine(forge=False), torch.optim.AdamW(fused=True) on materialized
               bf16 gradients; its moments are bf16 (torch keeps them in the weight's dtype)
  forge-bf16   Engine(forge=True): every weight matrix updated in backward by the fused kernel,
               bf16 moments, stochastic rounding
  forge-int8   the same with int8 blockwise moments
  *-graph      the same three, each step one replay of a captured CUDA graph
               (forge_engine/graphs.py, pretrain.py --enable-cuda-graph): the step costs its
               kernels, not Python's launches. The last warmup step captures (--warmup >= 2);
               torch-fused-graph is torch.optim.AdamW(fused=True, capturable=True)
--profile adds, per mode, 2 profiled steps: the sum of kernel time against the wall time, the
device's idle time (gaps under 0.5 ms, between kernels, and longer ones, waiting for the host)
with the kernel pairs around the largest gaps, and the 30 device kernels and 30 host
operations with the most time.
Each step is bracketed by torch.cuda.synchronize(); the table gives the median, min and max
(ms), tokens/s, and memory: peak = torch.cuda.max_memory_allocated() over the whole mode
(construction, warmup and timed steps), split into weights (every Parameter), optimizer states
(every device tensor in optimizer.state), gradients (the .grad tensors alive when
optimizer.step() starts, measured by a step pre-hook: all weights for torch, only the
standard-path ones, the norms, for FORGE) and other (peak minus those three: activations,
logits, the cross-entropy and grad-norm temporaries, allocator slack). Ratios are against
torch run the same way: torch-fused for the eager modes, torch-fused-graph for the graphed
ones (time: lower is faster; peak: lower is smaller). A mode that runs out of memory is
recorded as OOM and the next one runs; a non-finite loss marks the mode failed. The JSON
(--out, rewritten after every mode) holds every step time, every loss, the card and versions.

--device cpu is a smoke test only (tiny preset, FORGE_BACKEND=torch): times by perf_counter,
"peak" is the process's max RSS (it never decreases, so later modes inherit earlier peaks).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict

import torch

# this tree's forge_engine, wherever the process runs (bench_hf.py imports this module: a
# copy of the tree run from another checkout must measure its own code)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from forge_engine.engine import Engine  # noqa: E402
from forge_engine.kernels import backend_for  # noqa: E402
from forge_engine.model import GPT, PRESETS, norm_implementation, preset  # noqa: E402

MODES = {
    "torch-fused": dict(forge=False, fused=True),
    "forge-bf16": dict(forge=True, state_dtype="bf16"),
    "forge-int8": dict(forge=True, state_dtype="int8"),
    "torch-fused-graph": dict(forge=False, fused=True, capturable=True, graph=True),
    "forge-bf16-graph": dict(forge=True, state_dtype="bf16", graph=True),
    "forge-int8-graph": dict(forge=True, state_dtype="int8", graph=True),
}
DEFAULT_MODES = ["torch-fused", "forge-bf16", "forge-int8"]
BASE = "torch-fused"
GiB = 2 ** 30


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def allocated(dev) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def peak(dev) -> int:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def free_all(dev):
    gc.unfreeze()  # (--gc-freeze) the last mode's model and state can be collected again
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_bytes(optimizer, dev) -> int:
    """Bytes of every optimizer-state tensor on the model's device (host-side step counters and
    scalars are left out on CUDA; on CPU everything counts)."""
    return sum(tensor_bytes(v) for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.device.type == dev.type)


def run_mode(mode, cfg, a, dev, rec):
    """Build, warm up, time; fills rec in place (so an OOM keeps what was measured)."""
    rec["phase"] = "build"
    rec["alloc_before_gib"] = allocated(dev) / GiB  # leftovers of the previous mode: ~0
    model = GPT(cfg, params_dtype=torch.bfloat16, seed=a.seed, init_device=str(dev)).to(dev)
    kwargs = dict(MODES[mode])
    graph = kwargs.pop("graph", False)
    engine = Engine(model, "adamw", lr=a.lr, weight_decay=a.weight_decay, seed=a.seed,
                    **kwargs)
    def loss_of(ids):  # ids [b, s + 1]
        return model(ids[:, :-1], labels=ids[:, 1:]).mean()

    if graph:  # the last warmup step captures; every later step is one replay
        from forge_engine.graphs import CudaGraphStep
        step = CudaGraphStep(engine, loss_of, warmup=a.warmup - 1)
    else:
        def step(ids):
            return engine.train_step(lambda: loss_of(ids))
    rec["summary"] = engine.summary
    rec["weights_gib"] = sum(tensor_bytes(p) for p in model.parameters()) / GiB
    rec["alloc_after_build_gib"] = allocated(dev) / GiB
    print(f"[{mode}] {engine.summary}", flush=True)

    at_step = {}  # what is alive when optimizer.step() starts: gradients, allocation

    def pre_step(opt, args, kwargs):
        seen, grads = set(), 0
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    grads += tensor_bytes(p.grad)
        at_step["grads"] = max(at_step.get("grads", 0), grads)
        at_step["alloc"] = max(at_step.get("alloc", 0), allocated(dev))

    hook = engine.optimizer.register_step_pre_hook(pre_step)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed + 1)  # the same token stream in every mode
    V = cfg.vocab_size
    losses, norms, times = rec["losses"], rec["grad_norms"], rec["step_ms"] = [], [], []
    for i in range(a.warmup + a.steps):
        rec["phase"] = "warmup" if i < a.warmup else "timed"
        if i == a.warmup:  # split the peak: construction + warmup, then the timed steps
            rec["peak_warmup_gib"] = peak(dev) / GiB
            if a.gc_freeze:  # what exists now is never scanned by the collector again
                gc.collect()
                gc.freeze()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.randint(0, V, (a.batch, a.seq + 1), device=dev, generator=gen)  # [b, s+1]
        sync(dev)
        t0 = time.perf_counter()
        st = step(ids)
        sync(dev)
        dt = (time.perf_counter() - t0) * 1e3
        if i == 0:
            rec["first_step_ms"] = dt  # includes Triton compilation / autotuning
        if i >= a.warmup:
            times.append(dt)
        losses.append(st.loss)
        norms.append(st.grad_norm)
    hook.remove()
    if a.profile and dev.type == "cuda":
        rec["profile"] = profile_steps(step, model, gen, a, V)
    rec["phase"] = "done"
    rec["peak_timed_gib"] = peak(dev) / GiB
    rec["peak_gib"] = max(rec.get("peak_warmup_gib", 0.0), rec["peak_timed_gib"])
    if dev.type == "cuda":
        rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / GiB
    rec["states_gib"] = state_bytes(engine.optimizer, dev) / GiB
    rec["grads_gib"] = at_step.get("grads", 0) / GiB
    rec["alloc_at_opt_step_gib"] = at_step.get("alloc", 0) / GiB
    rec["alloc_after_steps_gib"] = allocated(dev) / GiB
    rec["other_gib"] = rec["peak_gib"] - rec["weights_gib"] - rec["states_gib"] - rec["grads_gib"]
    rec["median_ms"] = statistics.median(times)
    rec["min_ms"], rec["max_ms"] = min(times), max(times)
    rec["tokens_per_s"] = a.batch * a.seq / (rec["median_ms"] / 1e3)
    finite = all(math.isfinite(x) for x in losses + norms)
    rec["status"] = "ok" if finite else "failed: non-finite loss or grad norm"


def profile_steps(step, model, gen, a, V, steps=2, top=30):
    """Where a step's time goes, over `steps` profiled steps: the device kernels with the most
    time ([name, calls per step, ms per step]), the sum of all kernel time per step against the
    wall time per step (a step whose kernels sum to much less than its wall time waits on the
    host), and the host operations with the most self time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            ids = torch.randint(0, V, (a.batch, a.seq + 1),
                                device=next(model.parameters()).device, generator=gen)
            step(ids)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.events()
    dev_rows, host_rows = aggregate(events, steps)
    busy = sum(r[2] for r in dev_rows)
    dev_rows.sort(key=lambda r: -r[2])
    host_rows.sort(key=lambda r: -r[2])
    idle = device_gaps(events, steps)
    print(f"    profiled: wall {wall:.1f} ms/step (with profiler overhead), kernels "
          f"{busy:.1f} ms/step; device idle {idle['short_ms']:.2f} ms/step in "
          f"{idle['short_n']:.0f} gaps under 0.5 ms, {idle['long_ms']:.2f} in longer ones")
    for prev, nxt, n, ms in idle["pairs"][:8]:
        print(f"    gap    {ms:8.3f} ms/step  {n:6.1f} times  {prev[:40]} -> {nxt[:40]}")
    for name, n, ms in dev_rows[:top]:
        print(f"    device {ms:8.2f} ms/step  {n:6.0f} calls  {name}")
    for name, n, ms in host_rows[:top]:
        print(f"    host   {ms:8.2f} ms/step  {n:6.0f} calls  {name}")
    return dict(wall_ms=wall, kernel_ms=busy, idle=idle, device=dev_rows[:top],
                host=host_rows[:top])


def device_gaps(events, steps, long_us=500.0):
    """The device's idle time per step in the profiled window: the gaps between its busy
    intervals (kernels, copies, memsets; overlapping ones merged), those under long_us apart
    (the launch gaps between kernels, inside a replayed graph too) from the longer ones (the
    device waiting for the host), and the short gaps' total by the pair of operations around
    them: [[before, after, times per step, ms per step]], largest first."""
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in events
                   if ev.device_type == torch.autograd.DeviceType.CUDA
                   and not ev.is_user_annotation)
    short = long = 0.0
    n, pairs = 0, {}
    if spans:
        end, last = spans[0][1], spans[0][2]
        for start, stop, name in spans[1:]:
            gap = start - end
            if gap > long_us:
                long += gap
            elif gap > 0:
                short += gap
                n += 1
                row = pairs.setdefault((last, name), [0, 0.0])
                row[0] += 1
                row[1] += gap
            if stop > end:
                end, last = stop, name
    top = sorted(([a, b, k / steps, us / 1e3 / steps] for (a, b), (k, us) in pairs.items()),
                 key=lambda r: -r[3])
    return dict(short_ms=short / 1e3 / steps, short_n=n / steps, long_ms=long / 1e3 / steps,
                pairs=[[a[:90], b[:90], k, ms] for a, b, k, ms in top[:15]])


def aggregate(events, steps):
    """Profiler events -> ([name, calls per step, device ms per step] of every kernel, [name,
    calls per step, host self ms per step] of every host operation). Ranges such as
    Optimizer.step#AdamW.step also carry device time (their kernels'): left out."""
    dev, host = {}, {}
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if ev.is_user_annotation:
                continue
            row, t = dev.setdefault(ev.name, [0, 0.0]), ev.time_range.elapsed_us()
        elif ev.device_type == torch.autograd.DeviceType.CPU:
            row, t = host.setdefault(ev.name, [0, 0.0]), ev.self_cpu_time_total
        else:
            continue
        row[0] += 1
        row[1] += t
    return ([[k[:90], n / steps, us / 1e3 / steps] for k, (n, us) in d.items()]
            for d in (dev, host))


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def baseline(mode: str) -> str:
    """The torch mode a mode is compared with: torch run the same way (a graphed mode against
    torch-fused-graph, an eager one against torch-fused)."""
    return BASE + "-graph" if MODES[mode].get("graph") else BASE


def table(results) -> str:
    big = max((r.get("peak_gib") or 0.0 for r in results.values()), default=0.0) >= 1.0
    unit, scale = ("GiB", 1.0) if big else ("MiB", 1024.0)  # MiB for the CPU smoke test

    def mem(x):
        return None if x is None else x * scale
    rows = [f"| mode | status | median ms | min | max | tokens/s | peak {unit} | weights | "
            f"states | grads | other | time / torch | peak / torch | loss first -> last |",
            # (torch: torch-fused for eager modes, torch-fused-graph for graphed ones)
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        ok = r.get("status") == "ok"
        base = results.get(baseline(mode), {})
        base_ok = base.get("status") == "ok"
        g = (lambda k: r.get(k)) if ok else (lambda k: None)
        rt = g("median_ms") / base["median_ms"] if ok and base_ok else None
        rp = g("peak_gib") / base["peak_gib"] if ok and base_ok else None
        loss = f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}" if r.get("losses") else "-"
        rows.append(f"| {mode} | {r.get('status')} | {fmt(g('median_ms'), '.1f')} | "
                    f"{fmt(g('min_ms'), '.1f')} | {fmt(g('max_ms'), '.1f')} | "
                    f"{fmt(g('tokens_per_s'), '.0f')} | {fmt(mem(g('peak_gib')), '.2f')} | "
                    f"{fmt(mem(r.get('weights_gib')), '.2f')} | "
                    f"{fmt(mem(g('states_gib')), '.2f')} | {fmt(mem(g('grads_gib')), '.2f')} | "
                    f"{fmt(mem(g('other_gib')), '.2f')} | "
                    f"{fmt(rt, '.2f')} | {fmt(rp, '.2f')} | {loss} |")
    return "\n".join(rows)


def plot(results, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not importable; {path} not written")
        return
    ok = {m: r for m, r in results.items() if r.get("status") == "ok"}
    if not ok:
        print(f"--plot: no mode finished; {path} not written")
        return
    names = list(ok)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    ax1.bar(names, [ok[m]["median_ms"] for m in names], color="tab:blue")
    ax1.set_ylabel("median step time (ms)")
    bottom = [0.0] * len(names)
    for part, color in (("weights", "tab:gray"), ("states", "tab:orange"),
                        ("grads", "tab:red"), ("other", "tab:green")):
        vals = [max(ok[m][f"{part}_gib"], 0.0) for m in names]
        ax2.bar(names, vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylabel("peak memory (GiB)")
    ax2.legend()
    for ax in (ax1, ax2):  # mode names side by side would overlap
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(title.replace("; ", ";\n", 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3.1-8b", help=f"preset: {', '.join(PRESETS)}")
    ap.add_argument("--num-layers", type=int, default=None, help="override the preset's depth")
    ap.add_argument("--recompute-activations", action="store_true",
                    help="recompute each transformer layer in backward (every mode)")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=1, help="samples per step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--profile", action="store_true",
                    help="profile 2 extra steps per mode: kernel time against wall time, "
                    "top kernels and host operations")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="after the warmup steps, gc.freeze() what exists (the model, the "
                         "optimizer state): the timed steps' collections scan only new objects")
    ap.add_argument("--device", default="cuda", help="cuda (cuda:N) or cpu (smoke test)")
    ap.add_argument("--out", default="bench_step.json")
    ap.add_argument("--plot", default=None, metavar="PNG")
    a = ap.parse_args(argv)
    if a.model not in PRESETS:
        raise SystemExit(f"error: unknown model {a.model!r}; valid: {', '.join(PRESETS)}")
    a.mode_list = list(dict.fromkeys(m.strip() for m in a.modes.split(",") if m.strip()))
    bad = [m for m in a.mode_list if m not in MODES]
    if bad or not a.mode_list:
        raise SystemExit(f"error: unknown mode(s) {', '.join(bad) or '(none given)'}; valid: "
                         f"{', '.join(MODES)}")
    for name in ("seq", "batch", "steps"):
        if getattr(a, name) <= 0:
            raise SystemExit(f"error: --{name} must be positive, got {getattr(a, name)}")
    if a.warmup < 0:
        raise SystemExit(f"error: --warmup must be >= 0, got {a.warmup}")
    graphs = [m for m in a.mode_list if MODES[m].get("graph")]
    if graphs and a.warmup < 2:
        raise SystemExit(f"error: {graphs[0]} needs --warmup >= 2 (eager steps, then the "
                         f"capture), got {a.warmup}")
    if graphs and a.device.startswith("cpu"):
        raise SystemExit(f"error: {graphs[0]} needs --device cuda (CUDA graphs)")
    if a.num_layers is not None and a.num_layers <= 0:
        raise SystemExit(f"error: --num-layers must be positive, got {a.num_layers}")
    if not a.lr >= 0 or not a.weight_decay >= 0:
        raise SystemExit("error: --lr and --weight-decay must be >= 0")
    try:
        a.dev = torch.device(a.device)
    except RuntimeError as e:
        raise SystemExit(f"error: --device {a.device!r}: {e}")
    if a.dev.type not in ("cuda", "cpu"):
        raise SystemExit(f"error: --device must be cuda or cpu, got {a.device!r}")
    if a.dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda requested but CUDA is not available "
                         "(use --device cpu for a smoke test)")
    return a


def main(argv=None):
    a = parse(argv)
    dev = a.dev
    if dev.type == "cuda":
        if dev.index is not None:
            torch.cuda.set_device(dev)
        dev = torch.device("cuda", torch.cuda.current_device())
    overrides = dict(seq_length=a.seq)
    if a.num_layers is not None:
        overrides["num_layers"] = a.num_layers
    if a.recompute_activations:
        overrides["recompute_activations"] = True
    try:
        cfg = preset(a.model, **overrides)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    import triton
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    # the environment settings the FORGE kernels read at import: a run's numbers belong to them
    env = {k: os.environ.get(k, "") for k in ("FORGE_WS", "FORGE_WS_SPLIT", "FORGE_FAST_DIV")}
    knobs = " ".join(f"{k}={v or '(default)'}" for k, v in env.items())
    head = (f"card: {card} | torch {torch.__version__} | triton {triton.__version__} | "
            f"FORGE backend {backend_for(dev)} | {norm_implementation()} | "
            f"{knobs}\n"
            f"model {a.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, ffn "
            f"{cfg.ffn_hidden_size}, vocab {cfg.vocab_size}, tied "
            f"{not cfg.untie_embeddings_and_output_weights}; batch {a.batch} x seq {a.seq}; "
            f"bf16 weights; AdamW lr {a.lr:g} wd {a.weight_decay:g}; {a.warmup} warmup + "
            f"{a.steps} timed steps")
    print(head, flush=True)
    args = {k: v for k, v in vars(a).items() if k not in ("dev", "mode_list")}
    out = dict(card=card, torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, forge_backend=backend_for(dev),
               norm=norm_implementation(), env=env, args=args, model_config=asdict(cfg), results={})
    for mode in a.mode_list:
        free_all(dev)
        rec = out["results"][mode] = {}
        try:
            run_mode(mode, cfg, a, dev, rec)
        except torch.cuda.OutOfMemoryError:
            rec["status"] = f"OOM ({rec.get('phase')})"
            rec["peak_gib"] = peak(dev) / GiB
        free_all(dev)  # the exception (and the frame holding the model) is gone by now
        r = rec
        print(f"[{mode}] {r['status']}: median {fmt(r.get('median_ms'), '.1f')} ms, peak "
              f"{fmt(r.get('peak_gib'), '.2f')} GiB", flush=True)
        with open(a.out, "w") as f:  # after every mode: a later crash keeps these
            json.dump(out, f, indent=1)
    print()
    print(table(out["results"]))
    print(f"wrote {a.out}")
    if a.plot:
        plot(out["results"], a.plot, head)


if __name__ == "__main__":
    main()

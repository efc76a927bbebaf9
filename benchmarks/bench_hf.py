"""FORGE on a Hugging Face model: training steps of transformers' LlamaForCausalLM /
Qwen3ForCausalLM / GPT2LMHeadModel, forge_engine.optim.AdamW against
torch.optim.AdamW(fused=True).

    python3 benchmarks/bench_hf.py --model llama3.1-8b --seq 512 --out hf.json
    python3 benchmarks/bench_hf.py --model gpt2-xl --seq 1024 --out hf.json

The model is built from a config (the preset's shape, forge_engine.hf.config_to_hf, or GPT-2's
size, whose linears are Conv1D modules; random weights, bf16, sdpa attention; nothing
downloaded). Modes, each on a fresh model from the same
seed and the same token stream, the previous mode freed first:
  torch-fused        the plain loop a user has: loss = model(ids, labels=ids).loss;
                     loss.backward(); opt.step(); opt.zero_grad(), with torch.optim.AdamW(
                     model.parameters(), fused=True) (bf16 moments: torch keeps the weight dtype)
  forge-bf16 / -int8 the same loop with forge_engine.optim.AdamW(model, state_dtype=...): every
                     weight matrix, the embedding included, updated in backward
  *-graph            each step one replay of a CUDA graph captured by forge_engine.graphs.
                     CudaGraphStep around forge_engine.engine.Engine(model, ...); the torch row
                     is Engine(forge=False) with AdamW(fused=True, capturable=True)
  *-compile          the plain loop with every decoder layer compiled (layer.compile(), after
                     the optimizer is made: transformers' regional compilation, one compiled
                     graph that all layers share); Inductor, default mode
  *-compile-graph    both: the layers compiled so, and each step one replay of a CUDA graph
                     captured around them (the graph's warmup steps compile). The model gets
                     a 4-D causal attention_mask: without one transformers skips the mask in
                     eager steps and builds it while a stream captures, and the compiled
                     layers would recompile inside the capture (graphs.CudaGraphStep refuses)
  forge-*-triton     the plain loop of forge-bf16 / -int8 with FORGE_WS_SPLIT=0 for the mode:
                     on Hopper the Triton kernel takes the updates at <= 1024 tokens (by
                     default the split Gluon kernel takes them)
  *-clip             the plain loop with torch.nn.utils.clip_grad_norm_(model.parameters(),
                     1.0) before opt.step(): the step of transformers.Trainer with its
                     defaults (max_grad_norm=1.0; with 0 it still asks for the norm). FORGE's
                     updates="auto" sees the clipping in the first step and updates in step()
                     from the stashed segments, after one norm-only pass per weight
  *-trainer          transformers.Trainer's own loop, optimizers=(opt, None), with its
                     defaults: clip_grad_norm_ at 1.0, its linear learning-rate schedule
                     (the rate changes every step), its NaN check of each step's loss (one
                     synchronize after backward), model.zero_grad(); no logging until the
                     last step. Timed as Trainer runs it, with nothing added: the time between
                     one step's end and the next's (TrainerCallback.on_step_end), so a step's
                     updates may still run on the device while the host starts the next
Each other step is bracketed by torch.cuda.synchronize(); the median of --steps timed steps
after --warmup untimed ones, and the peak of torch.cuda.max_memory_allocated() over the whole
mode. --unsynced K (not the *-trainer modes): then K more steps back to back, one synchronize
before and one after them, ms per step: the loop that reads its loss only every few steps,
whose host enqueues the next forward while the device still runs the last backward and
update (a synchronized step adds the host's forward to the device's work; this one overlaps
them).
--rounds R runs the list of modes R times over, one after the other (each time on a fresh
model): an eager step is bound by the host's Python, whose speed drifts over minutes on a
shared machine, and R rounds give every mode the same share of that drift. A mode's median is
then over all its rounds' timed steps, and each round's median is kept (round_ms) beside the
ratio of each round's median to its torch mode's in the same round.
Ratios are against torch run the same way (eager against torch-fused, graphed against
torch-fused-graph, compiled against torch-fused-compile, both against
torch-fused-compile-graph). --timeline (eager and compiled modes) runs 3 more steps under
torch.profiler and splits each into its forward, backward and step() (the device's tail
with it): per phase the host time and the device's busy and idle time in its window, which
shows how much of an eager step the device waits for the host. The JSON (--out) is
rewritten after every mode. --device cpu: a smoke test (the tiny preset, or gpt2-tiny for a
GPT-2 size; FORGE_BACKEND=torch, times by perf_counter, RSS as "peak").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_host import forge_timers  # noqa: E402
from bench_step import GiB, fmt, free_all, peak, state_bytes, sync  # noqa: E402

MODES = {
    "torch-fused": dict(forge=False),
    "forge-bf16": dict(forge=True, state_dtype="bf16"),
    "forge-int8": dict(forge=True, state_dtype="int8"),
    "torch-fused-graph": dict(forge=False, graph=True),
    "forge-bf16-graph": dict(forge=True, state_dtype="bf16", graph=True),
    "forge-int8-graph": dict(forge=True, state_dtype="int8", graph=True),
    "torch-fused-compile": dict(forge=False, compile=True),
    "forge-bf16-compile": dict(forge=True, state_dtype="bf16", compile=True),
    "forge-int8-compile": dict(forge=True, state_dtype="int8", compile=True),
    "torch-fused-compile-graph": dict(forge=False, compile=True, graph=True),
    "forge-bf16-compile-graph": dict(forge=True, state_dtype="bf16", compile=True, graph=True),
    "forge-int8-compile-graph": dict(forge=True, state_dtype="int8", compile=True, graph=True),
    # eager with the Triton kernel at <= 1024 tokens (FORGE_WS_SPLIT=0 for the run)
    "forge-bf16-triton": dict(forge=True, state_dtype="bf16", switches=dict(ws_split="0")),
    "forge-int8-triton": dict(forge=True, state_dtype="int8", switches=dict(ws_split="0")),
    # eager with clip_grad_norm_(model.parameters(), 1.0) before step(): Trainer's defaults
    "torch-fused-clip": dict(forge=False, clip=True),
    "forge-bf16-clip": dict(forge=True, state_dtype="bf16", clip=True),
    "forge-int8-clip": dict(forge=True, state_dtype="int8", clip=True),
    # transformers.Trainer's loop with its defaults (clipping at 1.0, a linear schedule)
    "torch-fused-trainer": dict(forge=False, trainer=True),
    "forge-bf16-trainer": dict(forge=True, state_dtype="bf16", trainer=True),
    "forge-int8-trainer": dict(forge=True, state_dtype="int8", trainer=True),
}


def baseline(mode: str) -> str:
    """The torch mode a mode's ratios are taken against: the one run the same way."""
    kw = MODES[mode]
    return "torch-fused" + ("-compile" if kw.get("compile") else "") + \
        ("-graph" if kw.get("graph") else "") + ("-clip" if kw.get("clip") else "") + \
        ("-trainer" if kw.get("trainer") else "")


# transformers' GPT-2 sizes (layers, width, heads): its linears are Conv1D modules, W [in, out]
GPT2 = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
        "gpt2-xl": (48, 1600, 25), "gpt2-tiny": (2, 64, 4)}


def hf_model(name: str, dev, seed: int):
    import transformers
    from forge_engine.hf import config_to_hf
    from forge_engine.model import preset
    if name in GPT2:  # (its dropout as configured: 0.1)
        layers, width, heads = GPT2[name]
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads)
    else:
        hf = config_to_hf(preset(name), dtype=torch.bfloat16)  # the preset's context length
        kind = hf.pop("model_type")
        hf.pop("architectures")
        cfg = transformers.AutoConfig.for_model(kind, **hf)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False  # training: no KV cache (a cache's state recompiles every layer)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    return model.train(), cfg.vocab_size


def make_step(mode: str, model, a):
    """(step(ids) -> loss tensor, optimizer, loss_of(ids) -> the forward's loss)"""
    kw = dict(MODES[mode])
    graph, forge, compiled = kw.pop("graph", False), kw.pop("forge"), kw.pop("compile", False)
    clip = kw.pop("clip", False)
    kw.pop("switches", None)  # (run_mode sets them)
    lr, wd = a.lr, a.weight_decay

    mask = None
    if graph and compiled:  # one causal mask in eager steps and in the capture alike
        mask = torch.ones(a.seq, a.seq, dtype=torch.bool, device=a.dev).tril().expand(
            a.batch, 1, a.seq, a.seq)

    def loss_of(ids):  # ids [b, s]; transformers shifts the labels itself
        return model(input_ids=ids, labels=ids, attention_mask=mask).loss

    if graph:
        from forge_engine.engine import Engine
        from forge_engine.graphs import CudaGraphStep
        extra = kw if forge else dict(fused=True, capturable=True)
        engine = Engine(model, "adamw", forge=forge, lr=lr, weight_decay=wd, seed=a.seed,
                        **extra)
        regions = []

        def counted(ids):  # the compiled regions of the warmup steps' and the capture's loss
            loss = loss_of(ids)
            regions.append(compiled_nodes(loss))
            return loss

        if compiled:
            compile_layers(model)
        graphed = CudaGraphStep(engine, counted if compiled else loss_of, warmup=a.warmup - 1)

        def replay(ids):
            return graphed(ids).loss
        replay.regions = regions
        return replay, engine.optimizer, loss_of
    opt = make_optimizer(mode, model, a)
    if clip:
        opt = Clipped(opt, model, 1.0)
    if compiled:
        compile_layers(model)

    def step(ids):
        loss = loss_of(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, opt, loss_of


def make_optimizer(mode: str, model, a):
    """The eager optimizer of mode: FORGE's AdamW with the mode's state format, or torch's
    fused AdamW."""
    kw = MODES[mode]
    if kw["forge"]:
        import forge_engine
        return forge_engine.optim.AdamW(model, lr=a.lr, weight_decay=a.weight_decay,
                                        state_dtype=kw["state_dtype"])
    return torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                             fused=a.dev.type == "cuda")


class Clipped:
    """opt whose step() first clips the model's gradients to max_norm as Trainer does
    (torch.nn.utils.clip_grad_norm_ over model.parameters()); everything else is opt's, so
    the host and timeline passes count the clipping in step()."""

    def __init__(self, opt, model, max_norm: float):
        self.opt, self.params, self.max_norm = opt, list(model.parameters()), max_norm
        self.norms = []  # each step's norm before clipping, on the device (no sync)

    def step(self):
        self.norms.append(torch.nn.utils.clip_grad_norm_(self.params, self.max_norm))
        self.opt.step()

    def __getattr__(self, name):
        return getattr(self.opt, name)


def compile_layers(model) -> None:
    """Every decoder layer compiled at its first call (a warmup step), FORGE's modules in
    place: the optimizer is made first."""
    torch._dynamo.reset()  # each mode compiles afresh, within its own recompile limit
    for layer in decoder_layers(model):
        layer.compile()


def decoder_layers(model):
    """The model's decoder layers: model.model.layers (Llama, Qwen3), transformer.h (GPT-2)."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


@contextlib.contextmanager
def switched(values: dict):
    """The kernels' switches `values` (options.apply) while the block runs, then the
    environment's again."""
    from forge_engine.kernels import options
    saved = {options.ENV[k]: os.environ.get(options.ENV[k]) for k in values}
    options.apply(values)
    try:
        yield
    finally:
        for env, v in saved.items():
            if v is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = v
        options.apply({})  # (an imported fused_update.py reads its routing again)


def run_mode(mode, a, rec, last: bool = True):
    """One round of mode (under its kernel switches): see _run_mode."""
    with switched(MODES[mode].get("switches", {})):
        _run_mode(mode, a, rec, last)


def _run_mode(mode, a, rec, last: bool = True):
    """One round of mode: build, warm up, time; fills rec in place (so an OOM keeps what was
    measured), adding to what earlier rounds put there. last: the host and cProfile passes
    (--host, --profile) run in this round."""
    if MODES[mode].get("trainer"):
        return _run_trainer(mode, a, rec)
    dev, forge = a.dev, MODES[mode]["forge"]
    rec["phase"] = "build"
    model, V = hf_model(a.model, dev, a.seed)
    step, opt, loss_of = make_step(mode, model, a)
    summary = getattr(opt, "forge_summary", lambda: type(opt).__module__ + "." +
                      type(opt).__name__)()
    rec["summary"] = summary
    rec["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / GiB
    print(f"[{mode}] {summary}", flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed + 1)
    rec["losses"] = losses = []
    times = rec.setdefault("step_ms", [])
    first = len(times)
    for i in range(a.warmup + a.steps):
        rec["phase"] = "warmup" if i < a.warmup else "timed"
        ids = torch.randint(0, V, (a.batch, a.seq), device=dev, generator=gen)
        sync(dev)
        t0 = time.perf_counter()
        loss = step(ids)
        sync(dev)
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
    rec.setdefault("round_ms", []).append(statistics.median(times[first:]))
    if a.unsynced:
        rec["phase"] = "unsynced"
        batches = [torch.randint(0, V, (a.batch, a.seq), device=dev, generator=gen)
                   for _ in range(a.unsynced)]
        sync(dev)
        t0 = time.perf_counter()
        queued = [step(ids) for ids in batches]
        sync(dev)
        rec.setdefault("unsynced_round_ms", []).append(
            (time.perf_counter() - t0) * 1e3 / a.unsynced)
        rec["unsynced_ms"] = statistics.median(rec["unsynced_round_ms"])
        losses.extend(float(x) for x in queued)
    if a.host and last and not MODES[mode].get("graph"):
        rec["phase"] = "host profile"
        rec["host"] = host_profile(loss_of, opt, lambda: torch.randint(
            0, V, (a.batch, a.seq), device=dev, generator=gen), dev)
    if a.timeline and last and not MODES[mode].get("graph"):
        rec["phase"] = "timeline"
        rec["timeline"] = timeline(loss_of, opt, lambda: torch.randint(
            0, V, (a.batch, a.seq), device=dev, generator=gen), dev)
    if a.profile and last and not MODES[mode].get("graph"):
        rec["phase"] = "cProfile"
        profiles = phase_profiles(loss_of, opt, lambda: torch.randint(
            0, V, (a.batch, a.seq), device=dev, generator=gen), dev, a.profile)
        for phase, rows in profiles.items():
            rec[f"{phase}_profile"] = rows
            print(f"[{mode}] {phase} under cProfile, by own time:\n" + profile_table(rows),
                  flush=True)
    if MODES[mode].get("compile"):  # every layer compiled, none left eager by Dynamo
        # graphed: as the capture recorded it (one more eager forward beside the graph's
        # private pool would not fit where the graph barely does)
        rec["compiled_layers"] = step.regions[-1] if MODES[mode].get("graph") else \
            compiled_nodes(loss_of(torch.randint(0, V, (a.batch, a.seq), device=dev,
                                                 generator=gen)))
    if isinstance(opt, Clipped):
        rec["grad_norms"] = [float(n) for n in opt.norms]
    summarize(rec, a, opt, forge, times)
    ok = all(math.isfinite(x) for x in losses)
    rec["status"] = "ok" if ok else "failed: non-finite loss"
    layers = len(decoder_layers(model))
    if ok and rec.get("compiled_layers", layers) != layers:
        rec["status"] = f"failed: {rec['compiled_layers']} of {layers} layers ran compiled"


def _run_trainer(mode, a, rec):
    """One round of a *-trainer mode: transformers.Trainer trains a fresh model for --warmup +
    --steps steps on the same token stream as the other modes, with its defaults; the timed
    steps are the intervals between the ends of consecutive steps after the warmup ones."""
    import tempfile

    import transformers
    dev, forge = a.dev, MODES[mode]["forge"]
    rec["phase"] = "build"
    model, V = hf_model(a.model, dev, a.seed)
    opt = make_optimizer(mode, model, a)
    rec["summary"] = summary = getattr(opt, "forge_summary", lambda: "torch.optim.AdamW")()
    print(f"[{mode}] {summary}", flush=True)
    n = a.warmup + a.steps
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed + 1)
    ids = [torch.randint(0, V, (a.batch, a.seq), device=dev, generator=gen).cpu()
           for _ in range(n)]  # (the other modes' batches: drawn on the device, in order)
    rows = [{"input_ids": r, "labels": r} for b in ids for r in b]
    ends, losses = [], []

    class StepEnds(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    class Recorded(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            out = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append((out[0] if isinstance(out, tuple) else out).detach())
            return out

    with tempfile.TemporaryDirectory() as tmp:
        targs = transformers.TrainingArguments(
            output_dir=tmp, max_steps=n, per_device_train_batch_size=a.batch,
            logging_steps=n, report_to=[], save_strategy="no", seed=a.seed,
            dataloader_num_workers=0, disable_tqdm=True, use_cpu=dev.type == "cpu")
        trainer = Recorded(model=model, args=targs, train_dataset=rows,
                           optimizers=(opt, None), callbacks=[StepEnds()])
        # the rows in the other modes' order (Trainer's own sampler shuffles them)
        trainer._get_train_sampler = lambda *args: torch.utils.data.SequentialSampler(rows)
        rec["phase"] = "training"
        trainer.train()
    sync(dev)
    times = rec.setdefault("step_ms", [])
    times.extend((t1 - t0) * 1e3 for t0, t1 in zip(ends[a.warmup - 1:], ends[a.warmup:]))
    rec.setdefault("round_ms", []).append(statistics.median(times[-a.steps:]))
    rec["losses"] = [float(x) for x in losses]
    summarize(rec, a, opt, forge, times)
    ok = len(losses) == n and all(math.isfinite(x) for x in rec["losses"])
    rec["status"] = "ok" if ok else f"failed: {len(losses)} losses of {n} steps, or not finite"


def summarize(rec, a, opt, forge: bool, times: list):
    """What every mode's record holds once its steps ran: where FORGE updated the fused
    weights (in backward, or in step() where something clipped), peak and state memory,
    and the timed steps' median, range and tokens per second."""
    if forge:
        rec["updates"] = opt._mode
    rec["phase"] = "done"
    rec["peak_gib"] = max(peak(a.dev) / GiB, rec.get("peak_gib", 0.0))
    rec["states_gib"] = state_bytes(opt, a.dev) / GiB
    rec["median_ms"] = statistics.median(times)
    rec["min_ms"], rec["max_ms"] = min(times), max(times)
    rec["tokens_per_s"] = a.batch * a.seq / (rec["median_ms"] / 1e3)


def compiled_nodes(loss) -> int:
    """How many compiled regions loss's autograd graph holds (CompiledFunctionBackward)."""
    return sum(type(n).__name__ == "CompiledFunctionBackward" for n in _nodes(loss.grad_fn))


def _nodes(root):
    """Every node of the autograd graph under root, once."""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
        yield node


def host_profile(loss_of, opt, ids_of, dev, steps: int = 3) -> dict:
    """Eager steps' host time, no profiler. Over `steps` steps, the medians of the forward,
    loss.backward() and opt.step(), each timed from a synchronized device to its return (ms;
    host work, unless a launch waited for a free queue slot); then one more step with every
    autograd node hooked: per node kind, its count and the median host time from the node's
    pre-hook to its hook (us, the node's whole backward), and in that backward FORGE's
    hook on a linear's node and the update's launch within it (bench_host.forge_timers)."""
    parts: dict = {"forward_ms": [], "backward_ms": [], "step_ms": []}
    times: dict = {}
    for i in range(steps + 1):
        ids = ids_of()
        sync(dev)
        t0 = time.perf_counter_ns()
        loss = loss_of(ids)
        t1 = time.perf_counter_ns()
        if i == steps:
            _hook_nodes(loss.grad_fn, times)
        sync(dev)
        with forge_timers() if i == steps else contextlib.nullcontext(()) as timers:
            t2 = time.perf_counter_ns()
            loss.backward()
            t3 = time.perf_counter_ns()
        for name, timer in timers:
            if timer.calls:
                times[name] = timer.calls
        sync(dev)
        t4 = time.perf_counter_ns()
        opt.step()
        t5 = time.perf_counter_ns()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        if i < steps:
            for k, v in zip(parts, (t1 - t0, t3 - t2, t5 - t4)):
                parts[k].append(v / 1e6)
    nodes = {k: dict(count=len(v), median_us=statistics.median(v) / 1e3)
             for k, v in times.items()}
    forge = {k: nodes.pop(k) for k in ("FORGE hook", "FORGE launch") if k in nodes}
    top = sorted(nodes.items(), key=lambda kv: -kv[1]["count"] * kv[1]["median_us"])[:12]
    return dict({k: statistics.median(v) for k, v in parts.items()}, nodes=dict(top, **forge))


PHASES = ("forward", "backward", "step")


def timeline(loss_of, opt, ids_of, dev, steps: int = 3) -> dict:
    """Where an eager step leaves the device idle: `steps` more steps under torch.profiler,
    each from a synchronized device, its forward, loss.backward() and opt.step() (with
    zero_grad) marked as host ranges, then a synchronize. Per phase (ms, medians over the
    steps): the host range's length, and the device's busy time (the union of its kernels,
    copies and fills) within the window from the phase's start to the next one's (the last:
    to the end of the synchronize, which holds the device's tail) and the idle rest of it.
    The profiler records every operator, so host ranges run longer than unprofiled ones: the
    split, not the total, is what this measures. On the CPU the device columns are None.
    kernels[phase]: the 10 kernels (and copies, fills) of most device time starting in the
    phase's window, ms and launches per step (empty on the CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(steps):
            ids = ids_of()
            sync(dev)
            with record_function(f"bench:{i}:forward"):
                loss = loss_of(ids)
            with record_function(f"bench:{i}:backward"):
                loss.backward()
            with record_function(f"bench:{i}:step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            with record_function(f"bench:{i}:sync"):
                sync(dev)
            del loss
    ranges, named = {}, []
    for e in prof.profiler.kineto_results.events():
        start, end = e.start_ns(), e.start_ns() + e.duration_ns()
        if e.device_type() == DeviceType.CUDA:
            if device_work(e):
                named.append((start, end, e.name()))
        elif e.name().startswith("bench:"):
            ranges[e.name()] = (start, end)
    device = sorted((s, e) for s, e, _ in named)
    if dev.type == "cuda" and not device:  # (else every window would read as idle)
        raise SystemExit("bench_hf.py: error: --timeline: the profiler recorded no device "
                         "activity")
    per: dict = {}
    spans = []
    kernels = {p: {} for p in PHASES}
    for i in range(steps):
        marks = [ranges[f"bench:{i}:{p}"] for p in (*PHASES, "sync")]
        for k, p in enumerate(PHASES):
            lo, hi = marks[k][0], marks[k + 1][0] if k + 1 < len(PHASES) else marks[-1][1]
            busy = _covered(device, lo, hi) if dev.type == "cuda" else None
            for s, e, name in named:  # attributed to the window it starts in
                if lo <= s < hi:
                    ms, n = kernels[p].get(name, (0.0, 0))
                    kernels[p][name] = (ms + (e - s) / 1e6 / steps, n + 1)
            row = per.setdefault(p, {"host_ms": [], "busy_ms": [], "idle_ms": []})
            row["host_ms"].append((marks[k][1] - marks[k][0]) / 1e6)
            row["busy_ms"].append(None if busy is None else busy / 1e6)
            row["idle_ms"].append(None if busy is None else (hi - lo - busy) / 1e6)
        spans.append((marks[-1][1] - marks[0][0]) / 1e6)
    out = {p: {k: (statistics.median(v) if None not in v else None) for k, v in row.items()}
           for p, row in per.items()}
    top = {p: [dict(name=name[:120], ms_per_step=ms, per_step=n / steps)
               for name, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:10]]
           for p, kinds in kernels.items()}
    return dict(out, span_ms=statistics.median(spans), kernels=top)


def device_work(event) -> bool:
    """Whether a device event (a kineto event) is work (a kernel, copy or fill): not a
    record_function range's span on the device (activity "gpu_user_annotation"), which covers
    the gaps between the range's kernels. torch builds without the event's activity_type (the
    device's 2.11) tell the range by is_user_annotation."""
    if hasattr(event, "activity_type"):
        return "annotation" not in str(event.activity_type())
    return not event.is_user_annotation()


def _covered(intervals, lo: int, hi: int) -> int:
    """Length of the union of sorted (start, end) intervals within [lo, hi]."""
    total, reach = 0, lo
    for s, e in intervals:
        if e <= reach:
            continue
        if s >= hi:
            break
        s = max(s, reach)
        e = min(e, hi)
        if e > s:
            total += e - s
            reach = e
    return total


def timeline_table(results) -> str:
    rows = ["| mode | step span ms | " + " | ".join(
        f"{p}: host / device busy / idle ms" for p in PHASES) + " |", "|---|---|---|---|---|"]
    for mode, r in results.items():
        t = r.get("timeline")
        if not t:
            continue
        cells = [" / ".join(fmt(t[p][k], ".1f") for k in ("host_ms", "busy_ms", "idle_ms"))
                 for p in PHASES]
        rows.append(f"| {mode} | {fmt(t['span_ms'], '.1f')} | " + " | ".join(cells)
                    + " |")
    return "\n".join(rows)


def kernel_table(results) -> str:
    rows = ["| mode | phase | kernel | ms per step | launches per step |", "|---|---|---|---|---|"]
    for mode, r in results.items():
        for p, top in (r.get("timeline") or {}).get("kernels", {}).items():
            rows += [f"| {mode} | {p} | {k['name'][:70]} | {k['ms_per_step']:.2f} | "
                     f"{k['per_step']:g} |" for k in top]
    return "\n".join(rows)


def phase_profiles(loss_of, opt, ids_of, dev, top: int, steps: int = 3) -> dict:
    """`steps` more eager steps, each phase (the forward, loss.backward(), opt.step() with
    zero_grad) under a cProfile of its own, each from a synchronized device: per phase
    (PHASES), the `top` functions by own time, each as (name, calls, own and cumulative us
    per step). cProfile's own cost per Python call inflates both; what it gives is where the
    host time goes, not how much."""
    import cProfile
    import pstats
    profs = {p: cProfile.Profile() for p in PHASES}
    for _ in range(steps):
        ids = ids_of()
        sync(dev)
        profs["forward"].enable()
        loss = loss_of(ids)
        profs["forward"].disable()
        sync(dev)
        profs["backward"].enable()
        loss.backward()
        profs["backward"].disable()
        sync(dev)
        profs["step"].enable()
        opt.step()
        opt.zero_grad(set_to_none=True)
        profs["step"].disable()
        sync(dev)
    out = {}
    for phase, prof in profs.items():
        rows = []
        for (path, line, fn), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
            name = f"{fn} ({os.path.basename(path)}:{line})" if path != "~" else fn
            rows.append(dict(function=name, calls=calls // steps, own_us=own / steps * 1e6,
                             cum_us=cum / steps * 1e6))
        out[phase] = sorted(rows, key=lambda r: -r["own_us"])[:top]
    return out


def profile_table(rows) -> str:
    out = ["| function | calls per step | own us per step | cumulative us per step |",
           "|---|---|---|---|"]
    out += [f"| {r['function']} | {r['calls']} | {r['own_us']:.0f} | {r['cum_us']:.0f} |"
            for r in rows]
    return "\n".join(out)


def _hook_nodes(root, times: dict) -> None:
    """Hook every node of the graph under root once: times[node kind] receives the host time
    (ns) from each run's pre-hook to its hook."""
    for node in _nodes(root):
        start = []
        node.register_prehook(lambda g, start=start: start.append(time.perf_counter_ns()))
        node.register_hook(lambda gi, go, start=start, name=type(node).__name__:
                           times.setdefault(name, []).append(time.perf_counter_ns() -
                                                             start.pop()))


def host_table(results) -> str:
    rows = ["| mode | forward host ms | backward host ms | step() host ms | linear backward: "
            "node, count, median us (FORGE: its hook and launch within) |", "|---|---|---|---|---|"]
    for mode, r in results.items():
        h = r.get("host")
        if not h:
            continue
        lin = [(k, v) for k, v in h["nodes"].items()
               if k in ("ForgeLinearFunctionBackward", "MmBackward0", "AddmmBackward0",
                        "CompiledFunctionBackward", "FORGE hook", "FORGE launch")]
        cells = "; ".join(f"{k} x{v['count']}: {v['median_us']:.1f}" for k, v in lin)
        rows.append(f"| {mode} | {fmt(h.get('forward_ms'), '.1f')} | "
                    f"{fmt(h.get('backward_ms'), '.1f')} | {fmt(h.get('step_ms'), '.1f')} | "
                    f"{cells} |")
    return "\n".join(rows)


def table(results) -> str:
    rows = ["| mode | status | median ms | min | max | tokens/s | peak GiB | states GiB | "
            "time / torch | peak / torch | loss first -> last | time / torch by round |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        base = results.get(baseline(mode), {})
        ok, both = r.get("status") == "ok", base.get("status") == "ok"
        rt = r["median_ms"] / base["median_ms"] if ok and both else None
        rp = r["peak_gib"] / base["peak_gib"] if ok and both else None
        loss = f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}" if r.get("losses") else "-"
        rows.append(f"| {mode} | {r.get('status')} | {fmt(r.get('median_ms'), '.1f')} | "
                    f"{fmt(r.get('min_ms'), '.1f')} | {fmt(r.get('max_ms'), '.1f')} | "
                    f"{fmt(r.get('tokens_per_s'), '.0f')} | {fmt(r.get('peak_gib'), '.2f')} | "
                    f"{fmt(r.get('states_gib'), '.2f')} | {fmt(rt, '.3f')} | {fmt(rp, '.3f')} | "
                    f"{loss} | {', '.join(f'{x:.3f}' for x in round_ratios(r, base))} |")
    return "\n".join(rows)


def round_ratios(r: dict, base: dict, key: str = "round_ms") -> list:
    """Each round's median step time (key: its unsynced steps' time) over its torch mode's in
    the same round."""
    if r.get("status") != "ok" or base.get("status") != "ok":
        return []
    return [x / y for x, y in zip(r.get(key, []), base.get(key, []))]


def unsynced_table(results) -> str:
    rows = ["| mode | unsynced ms per step | time / torch | by round | synchronized / unsynced |",
            "|---|---|---|---|---|"]
    for mode, r in results.items():
        if "unsynced_ms" not in r:
            continue
        base = results.get(baseline(mode), {})
        by = round_ratios(r, base, "unsynced_round_ms")
        rt = r["unsynced_ms"] / base["unsynced_ms"] if by else None
        rows.append(f"| {mode} | {r['unsynced_ms']:.1f} | {fmt(rt, '.3f')} | "
                    f"{', '.join(f'{x:.3f}' for x in by)} | "
                    f"{r['median_ms'] / r['unsynced_ms']:.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.1-8b", help="a preset (llama3.1-8b, qwen3-8b, "
                   "...) or a GPT-2 size (gpt2, gpt2-medium, gpt2-large, gpt2-xl)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (>= 2: the graphed "
                   "modes capture in the last)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times over, "
                   "interleaved (medians over all rounds; each round's ratio kept)")
    p.add_argument("--unsynced", type=int, default=0, metavar="K", help="each round, K more "
                   "steps back to back, synchronized only before and after them (ms per step)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda")
    p.add_argument("--host", action="store_true", help="time 4 more eager steps' host "
                   "work: forward, backward, step() and per autograd node (hooks)")
    p.add_argument("--timeline", action="store_true", help="eager and compiled modes: 3 more "
                   "steps under torch.profiler; per phase (forward, backward, step() with the "
                   "device's tail) its host time and the device's busy and idle time")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="eager and compiled modes: 3 more steps, each phase (forward, "
                        "backward, step()) under cProfile: the N functions of most own time "
                        "per phase (JSON: forward_profile, backward_profile, step_profile)")
    p.add_argument("--out", default="bench_hf.json")
    a = p.parse_args(argv)
    a.dev = torch.device(a.device)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or a.warmup < 2 or a.rounds < 1 or a.unsynced < 0:
        print(f"bench_hf.py: error: unknown modes {bad}; valid: {', '.join(MODES)}" if bad else
              "bench_hf.py: error: --warmup must be >= 2" if a.warmup < 2 else
              "bench_hf.py: error: --rounds must be >= 1" if a.rounds < 1 else
              "bench_hf.py: error: --unsynced must be >= 0", file=sys.stderr)
        return 2
    from forge_engine.model import PRESETS
    if a.model not in GPT2 and a.model not in PRESETS:
        print(f"bench_hf.py: error: --model {a.model!r}: not a preset ({', '.join(PRESETS)}) "
              f"nor a GPT-2 size ({', '.join(GPT2)})", file=sys.stderr)
        return 2
    if a.model in GPT2 and a.seq > 1024:
        print(f"bench_hf.py: error: --seq {a.seq}: GPT-2 has 1024 positions", file=sys.stderr)
        return 2
    if a.dev.type == "cpu":
        a.model, a.seq = "gpt2-tiny" if a.model in GPT2 else "tiny", min(a.seq, 32)
        os.environ.setdefault("FORGE_BACKEND", "torch")
        modes = [m for m in modes if not MODES[m].get("graph")]
    elif not torch.cuda.is_available():
        print("bench_hf.py: error: no CUDA device (--device cpu for the smoke test)",
              file=sys.stderr)
        return 2
    import transformers
    card = torch.cuda.get_device_name() if a.dev.type == "cuda" else "cpu"
    head = (f"card: {card} | torch {torch.__version__} | transformers "
            f"{transformers.__version__} | {a.model} b{a.batch} x {a.seq}, bf16 weights, sdpa; "
            f"AdamW lr {a.lr:g} wd {a.weight_decay:g}; {a.warmup} warmup + {a.steps} timed"
            + (f", {a.rounds} rounds" if a.rounds > 1 else ""))
    print(head, flush=True)
    out = dict(card=card, torch=torch.__version__, transformers=transformers.__version__,
               args={k: v for k, v in vars(a).items() if k != "dev"}, results={})
    for r in range(a.rounds):
        for mode in modes:
            free_all(a.dev)
            rec = out["results"].setdefault(mode, {})
            if str(rec.get("status", "ok")) != "ok":  # failed in an earlier round
                continue
            try:
                run_mode(mode, a, rec, last=r == a.rounds - 1)
            except torch.cuda.OutOfMemoryError:
                rec["status"] = f"OOM ({rec.get('phase')})"
            free_all(a.dev)
            print(f"[{mode}] {rec['status']}: median {fmt(rec.get('median_ms'), '.1f')} ms, "
                  f"peak {fmt(rec.get('peak_gib'), '.2f')} GiB"
                  + (f" (round {r + 1} of {a.rounds})" if a.rounds > 1 else ""), flush=True)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    print("\n" + head + "\n" + table(out["results"]))
    if a.unsynced:
        print(f"\n{a.unsynced} steps back to back, synchronized before and after: ms per step"
              "\n" + unsynced_table(out["results"]))
    if a.host:
        print("\nhost time: medians of 3 steps; nodes: one hooked step\n" +
              host_table(out["results"]))
    if a.timeline:
        print("\ntimeline: medians of 3 profiled steps; each phase's window runs to the next "
              "one's start (step: to the end of the synchronize)\n" +
              timeline_table(out["results"]))
        if a.dev.type == "cuda":
            print("\ndevice work by kernel, per phase\n" + kernel_table(out["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

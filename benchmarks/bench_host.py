"""Host time of one linear's backward: FORGE's fused update against torch's, per layer shape.

    python3 benchmarks/bench_host.py --model llama3.1-8b --tokens 512 --out host.json

For each distinct linear shape of the preset (Llama-3.1-8B: q and o 4096x4096, k/v 1024x4096,
gate/up 14336x4096, down 4096x14336), bf16 weights, one nn.Linear(bias=False) on T tokens:
  torch       y = lin(x); y.backward(dy) with torch.optim.AdamW(fused=True) on the weight:
              the autograd node MmBackward0 (both GEMMs) and the weight's AccumulateGrad
  forge-bf16 / forge-int8
              the same with forge_engine.optim.AdamW(lin, state_dtype=..., updates="backward"):
              torch's MmBackward0 computing dX alone, and the fused update's launch in
              FORGE's hook on that node (forge_engine/linear.py)
Before each backward the device is synchronized, so the launch queue is empty and the time
until backward() returns is host work only (no launch waits for a free queue slot). Reported,
medians over --reps backward calls after --warmup, in us: the linear's autograd node from its
pre-hook to its hook (the node's whole backward), and the whole backward() call (the autograd
engine's start and end too); the optimizer's step() runs between calls, untimed. For FORGE, the
node's share that is FORGE's: its hook (forge_engine/linear.py, _UpdateHook: the bookkeeping
and the launch), and within it the update's launch (kernels.PlannedUpdate: the bound Triton
launch on CUDA, the torch reference's whole update on CPU). Each lone backward is a step of
its own, so its hook also makes the step's hyperparameter row, which in a model's step one
row serves for every weight of a group.

--blocks B adds one backward of a step's linears: those of B transformer blocks (q, k, v, o,
gate, up, down each), every one on an input of its own, all in one backward() call as in a
model's step (one hyperparameter row serves all of them). Reported per mode, medians over the
linears of --reps // 10 such backwards after 2: the linear's node and, for FORGE, its hook and
launch, as above, and the whole backward() call in ms.
--device cpu: a smoke test (tiny preset, the interpreter's launches: host times of no meaning).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("torch", "forge-bf16", "forge-int8")


def shapes(cfg) -> dict:
    """name -> (out, in) of each distinct linear of a transformer block of cfg."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    q, kv = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    return {"q": (q, h), "k/v": (kv, h), "o": (h, q), "gate/up": (f, h), "down": (h, f)}


class _Timed:
    """cls.name timed while the block runs: each call's duration (ns) appended to .calls."""

    def __init__(self, cls, name: str):
        self.cls, self.name, self.calls = cls, name, []

    def __enter__(self):
        inner, calls, clock = getattr(self.cls, self.name), self.calls, time.perf_counter_ns

        def timed(*args, **kwargs):
            t = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                calls.append(clock() - t)
        self.inner = inner
        setattr(self.cls, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.cls, self.name, self.inner)


@contextlib.contextmanager
def forge_timers():
    """Within the block, FORGE's hook on a linear's node (forge_engine.linear._UpdateHook) and
    the update's launch within it (kernels.PlannedUpdate) timed: yields [("FORGE hook", timer),
    ("FORGE launch", timer)], each timer's .calls the durations (ns)."""
    from forge_engine.kernels import PlannedUpdate
    from forge_engine.linear import _UpdateHook
    with _Timed(_UpdateHook, "__call__") as hook, _Timed(PlannedUpdate, "__call__") as launch:
        yield [("FORGE hook", hook), ("FORGE launch", launch)]


def host_us(mode: str, n: int, k: int, tokens: int, a) -> dict:
    """Median host times (us) of lin(x).backward(dy) for one (n, k) linear in mode: call (the
    whole call), node (the linear's autograd node, from its pre-hook to its hook) and, for
    FORGE, hook (FORGE's hook on the node) and launch (the update's launch in it)."""
    import forge_engine
    if mode != "torch":
        with forge_timers() as ((_, hook), (_, lau)):
            out = _host_us(mode, n, k, tokens, a, forge_engine)
        # one hook and one launch per backward: the timed ones are the last reps
        if len(hook.calls) != a.warmup + a.reps or len(lau.calls) != a.warmup + a.reps:
            raise RuntimeError(f"bench_host: {mode} ran {len(hook.calls)} hooks and "
                               f"{len(lau.calls)} launches in {a.warmup + a.reps} backwards "
                               f"(one each expected: the linear did not take FORGE's hook)")
        out["hook_us"] = statistics.median(hook.calls[a.warmup:]) / 1e3
        out["launch_us"] = statistics.median(lau.calls[a.warmup:]) / 1e3
        return out
    return _host_us(mode, n, k, tokens, a, forge_engine)


def _host_us(mode, n, k, tokens, a, forge_engine) -> dict:
    dev = a.dev
    torch.manual_seed(a.seed)
    lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    if mode == "torch":
        opt = torch.optim.AdamW(lin.parameters(), lr=1e-5, fused=dev.type == "cuda")
    else:
        opt = forge_engine.optim.AdamW(lin, lr=1e-5, state_dtype=mode.split("-")[1],
                                       updates="backward")
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16) * 1e-3
    times, nodes = [], []
    for i in range(a.warmup + a.reps):
        y = lin(x)
        mark = []
        y.grad_fn.register_prehook(lambda g: mark.append(time.perf_counter_ns()))
        y.grad_fn.register_hook(lambda gi, go: mark.append(time.perf_counter_ns()))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter_ns()
        y.backward(dy)
        t1 = time.perf_counter_ns()
        opt.step()
        opt.zero_grad(set_to_none=True)
        x.grad = None
        if i >= a.warmup:
            times.append((t1 - t0) / 1e3)
            nodes.append((mark[1] - mark[0]) / 1e3)
    return dict(call_us=statistics.median(times), node_us=statistics.median(nodes))


def block_shapes(cfg) -> list:
    """(out, in) of every linear of one transformer block of cfg, in the block's order."""
    s = shapes(cfg)
    return [s["q"], s["k/v"], s["k/v"], s["o"], s["gate/up"], s["gate/up"], s["down"]]


def step_us(mode: str, cfg, tokens: int, a) -> dict:
    """Median host times in one backward of a.blocks blocks' linears (see the module doc): the
    whole call (ms), a linear's node and, for FORGE, its hook and launch (us)."""
    import forge_engine
    dev = a.dev
    torch.manual_seed(a.seed)
    lins = nn.ModuleList(nn.Linear(k, n, bias=False) for _ in range(a.blocks)
                         for n, k in block_shapes(cfg)).to(dev, torch.bfloat16)
    if mode == "torch":
        opt = torch.optim.AdamW(lins.parameters(), lr=1e-5, fused=dev.type == "cuda")
    else:
        opt = forge_engine.optim.AdamW(lins, lr=1e-5, state_dtype=mode.split("-")[1],
                                       updates="backward")
    xs = {k: torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
          for k in sorted({lin.in_features for lin in lins})}
    dys = [torch.randn(tokens, lin.out_features, device=dev, dtype=torch.bfloat16) * 1e-3
           for lin in lins]
    warmup, reps = 2, max(a.reps // 10, 1)
    calls, nodes, inner = [], [], {"hook_us": [], "launch_us": []}
    with (forge_timers() if mode != "torch" else contextlib.nullcontext([])) as timers:
        for i in range(warmup + reps):
            for _, t in timers:
                t.calls.clear()
            ys = [lin(xs[lin.in_features]) for lin in lins]
            marks = [[] for _ in ys]
            for y, m in zip(ys, marks):
                y.grad_fn.register_prehook(lambda g, m=m: m.append(time.perf_counter_ns()))
                y.grad_fn.register_hook(lambda gi, go, m=m: m.append(time.perf_counter_ns()))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter_ns()
            torch.autograd.backward(ys, dys)
            t1 = time.perf_counter_ns()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for x in xs.values():
                x.grad = None
            if i < warmup:
                continue
            calls.append((t1 - t0) / 1e6)
            nodes += [(m[1] - m[0]) / 1e3 for m in marks]
            for key, (name, t) in zip(inner, timers):
                if len(t.calls) != len(lins):
                    raise RuntimeError(f"bench_host: {mode} ran {len(t.calls)} {name} calls in "
                                       f"a backward of {len(lins)} linears (one each expected: "
                                       f"a linear did not take FORGE's hook)")
                inner[key] += [ns / 1e3 for ns in t.calls]
    out = dict(linears=len(lins), call_ms=statistics.median(calls),
               node_us=statistics.median(nodes))
    out.update({k: statistics.median(v) for k, v in inner.items() if v})
    return out


def step_table(step: dict) -> str:
    """Per mode: the backward() call (ms), a linear's node and FORGE's hook and launch (us)."""
    rows = ["| mode | backward() ms | linear node us | FORGE hook us | launch us |",
            "|---|---|---|---|---|"]
    for mode, r in step.items():
        rows.append(f"| {mode} | {r['call_ms']:.2f} | {r['node_us']:.1f} | " +
                    (f"{r['hook_us']:.1f} | {r['launch_us']:.1f} |" if "hook_us" in r
                     else "| |"))
    return "\n".join(rows)


def table(out) -> str:
    """Per shape and mode: the node's host us (the whole backward() call's in brackets); for
    FORGE also its hook's and, within the hook, the launch's."""
    forge = [m for m in MODES if m != "torch"]
    rows = ["| linear (out x in) | " + " | ".join(f"{m}: node (call) us" for m in MODES) +
            " | " + " | ".join(f"{m}: hook / launch us" for m in forge) + " | " +
            " | ".join(f"node, {m} / torch" for m in forge) + " |",
            "|---|" + "---|" * (len(MODES) + 2 * len(forge))]
    for name, r in out["results"].items():
        t = r["torch"]["node_us"]
        rows.append(f"| {name} {r['shape'][0]}x{r['shape'][1]} | " +
                    " | ".join(f"{r[m]['node_us']:.1f} ({r[m]['call_us']:.1f})"
                               for m in MODES) + " | " +
                    " | ".join(f"{r[m]['hook_us']:.1f} / {r[m]['launch_us']:.1f}"
                               for m in forge) + " | " +
                    " | ".join(f"{r[m]['node_us'] / t:.2f}" for m in forge) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda")
    p.add_argument("--blocks", type=int, default=0,
                   help="also one backward of this many blocks' linears (0: not run)")
    p.add_argument("--out", default="bench_host.json")
    a = p.parse_args(argv)
    a.dev = torch.device(a.device)
    if a.dev.type == "cpu":
        a.model, a.tokens, a.reps, a.warmup = "tiny", min(a.tokens, 16), min(a.reps, 3), 1
    elif not torch.cuda.is_available():
        print("bench_host.py: error: no CUDA device (--device cpu for the smoke test)",
              file=sys.stderr)
        return 2
    from forge_engine.model import preset
    cfg = preset(a.model)
    card = torch.cuda.get_device_name() if a.dev.type == "cuda" else "cpu"
    head = (f"card: {card} | torch {torch.__version__} | {a.model} linears, bf16, "
            f"{a.tokens} tokens; host us per backward, median of {a.reps} after {a.warmup}")
    print(head, flush=True)
    out = dict(card=card, torch=torch.__version__,
               args={k: v for k, v in vars(a).items() if k != "dev"}, results={})
    for name, (n, k) in shapes(cfg).items():
        r = out["results"][name] = dict(shape=[n, k])
        for mode in MODES:
            r[mode] = host_us(mode, n, k, a.tokens, a)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print("\n" + head + "\n" + table(out))
    if a.blocks > 0:
        step = out["step"] = {}
        for mode in MODES:
            step[mode] = step_us(mode, cfg, a.tokens, a)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
        print(f"\none backward of {a.blocks} blocks' linears ({step['torch']['linears']}), "
              f"medians over the linears of {max(a.reps // 10, 1)} backwards after 2\n" +
              step_table(step))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What is alive at the peak of one training step, by the line of code that allocated it.

Builds the model and Engine as bench_step.py does (bf16 weights, AdamW), runs two steps, then
records the CUDA caching allocator's trace over a third (torch.cuda.memory._record_memory_history,
Python stacks) and replays it: the allocation event at which the most bytes beyond the step's
start were alive, and those bytes grouped by their innermost forge_engine frame. The base (what
was allocated before the step: weights, optimizer states) is printed apart.

    python3 benchmarks/peak_trace.py --model llama3.1-8b --seq 512 [--state-dtype int8]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, ".")
from forge_engine.engine import Engine  # noqa: E402
from forge_engine.model import GPT, PRESETS, preset  # noqa: E402

MiB, GiB = 2 ** 20, 2 ** 30


def where(event) -> str:
    frames = event.get("frames") or []
    ours = [f for f in frames if "forge_engine" in f["filename"]]
    f = ours[0] if ours else (frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
    return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"


def peak_of(trace):
    """(bytes alive beyond the start at the peak, the event index, {addr: event} alive then)."""
    live, cur, best, best_i, best_live = {}, 0, 0, -1, {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if cur > best:
            best, best_i, best_live = cur, i, dict(live)
    return best, best_i, best_live


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=list(PRESETS))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--state-dtype", default=None, choices=[None, "bf16", "int8", "fp32"])
    ap.add_argument("--no-forge", action="store_true", help="torch's fused AdamW instead")
    ap.add_argument("--top", type=int, default=16)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: peak_trace.py reads the CUDA allocator; no CUDA device here")
    dev = torch.device("cuda")
    cfg = preset(a.model)
    model = GPT(cfg, params_dtype=torch.bfloat16, seed=0, init_device="cuda").to(dev)
    kw = dict(fused=True) if a.no_forge else dict(seed=0, state_dtype=a.state_dtype)
    eng = Engine(model, "adamw", forge=not a.no_forge, lr=1e-4, weight_decay=0.1, **kw)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device=dev)

    def step():
        return eng.train_step(lambda: model(ids[:, :-1], labels=ids[:, 1:]).mean())

    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][dev.index or 0]
    best, i, alive = peak_of(trace)
    print(f"card: {torch.cuda.get_device_name(dev)} | torch {torch.__version__} | model "
          f"{a.model} {a.batch} x {a.seq} | {'torch fused AdamW' if a.no_forge else 'FORGE'} "
          f"states {a.state_dtype or 'bf16'}")
    print(f"allocated before the step {base / GiB:.2f} GiB; peak (max_memory_allocated) "
          f"{torch.cuda.max_memory_allocated() / GiB:.2f} GiB; from the trace "
          f"{(base + best) / GiB:.2f} GiB at event {i} of {len(trace)} ({where(trace[i])})")
    groups, counts = collections.Counter(), collections.Counter()
    for e in alive.values():
        groups[where(e)] += e["size"]
        counts[where(e)] += 1
    print(f"alive at the peak beyond the step's start: {best / MiB:.0f} MiB in {len(alive)} "
          f"blocks, by allocating line:")
    for k, v in groups.most_common(a.top):
        print(f"  {v / MiB:9.1f} MiB  x{counts[k]:4d}  {k}")


if __name__ == "__main__":
    main()

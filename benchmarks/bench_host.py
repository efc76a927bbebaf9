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
engine's start and end too); the optimizer's step() runs between calls, untimed. --device cpu: a smoke test (tiny preset, the interpreter's
launches: host times of no meaning).
"""
from __future__ import annotations

import argparse
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


def host_us(mode: str, n: int, k: int, tokens: int, a) -> tuple:
    """Median host times (us) of lin(x).backward(dy) for one (n, k) linear in mode: the whole
    call, and the linear's autograd node alone (from its pre-hook to its hook)."""
    import forge_engine
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
    return statistics.median(times), statistics.median(nodes)


def table(out) -> str:
    """Per shape and mode: the node's host us (the whole backward() call's in brackets)."""
    rows = ["| linear (out x in) | " + " | ".join(f"{m}: node (call) us" for m in MODES) +
            " | node, forge-bf16 / torch | node, forge-int8 / torch |",
            "|---|" + "---|" * (len(MODES) + 2)]
    for name, r in out["results"].items():
        t = r["torch"]["node_us"]
        rows.append(f"| {name} {r['shape'][0]}x{r['shape'][1]} | " +
                    " | ".join(f"{r[m]['node_us']:.1f} ({r[m]['call_us']:.1f})"
                               for m in MODES) +
                    f" | {r['forge-bf16']['node_us'] / t:.2f} | "
                    f"{r['forge-int8']['node_us'] / t:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.1-8b")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda")
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
            call, node = host_us(mode, n, k, a.tokens, a)
            r[mode] = dict(call_us=call, node_us=node)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print("\n" + head + "\n" + table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

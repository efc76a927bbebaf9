"""Can a backward's fused updates hide its dX GEMMs? One Llama-3.1-8B decoder layer's seven
linears (q, k, v, o, gate, up, down), LAYERS copies of them, replayed from a CUDA graph in
four ways: the dX GEMMs alone (dY @ W, cuBLAS), the fused updates alone, both on one stream
(the backward as it runs: each GEMM, then its weight's update), and each update on a side
stream that waits for the GEMM before it (the GEMMs run on while the updates do). Each update
way is run with the default route of the captured update (FORGE_WS=auto) and with the split
Gluon kernel limited to fewer programs, which leaves multiprocessors free for the GEMMs.
Also the update's effective bandwidth (the bytes of W and both moments read and written, over
its time alone) and a floor for it: the same tensors each read and written once by torch's
in-place elementwise kernels (mul_(1)), no token products, no arithmetic that matters. Each
time is the median of Triton's do_bench_cudagraph, per layer. Needs a Hopper GPU.

    python3 benchmarks/bench_overlap.py --tokens 512,2048 --out overlap.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import moments, problem, written  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update, split_route  # noqa: E402
from graphed_small import graph_bench  # noqa: E402

# (N, K) of one Llama-3.1-8B layer's weights: gate, up, down, q, k, v, o
LAYER = [(14336, 4096), (14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096),
         (1024, 4096), (4096, 4096)]
# bytes a parameter's update reads and writes: W (bf16) and two moments (bf16: 2 bytes each;
# int8: 1 byte each, the row scales left out), each read once and written once
BYTES = {"bf16": 2 * (2 + 2 + 2), "int8": 2 * (2 + 1 + 1)}


def config(tokens: int, programs):
    """The update's config: None (the default route, as a captured update takes it) or the
    split Gluon kernel of that route with at most `programs` programs."""
    if programs is None:
        return None
    return {"WS": True, **split_route(tokens), "PROGRAMS": programs}


def replay_ms(body, layers: int) -> float:
    """Median ms per layer of body (layers copies of the layer's linears) replayed from a
    CUDA graph (graphed_small.graph_bench: Triton's do_bench_cudagraph)."""
    return graph_bench(body) / layers


def measure(tokens: int, fmt: str, layers: int, programs: list) -> list:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lin = []
    for _ in range(layers):
        for n, k in LAYER:
            x, dy, w, m0, v0, spec, hp_list = problem(tokens, n, k, dev)
            lin.append((x, dy, w, moments(m0, v0, fmt)))
            del m0, v0
    hp = torch.tensor(hp_list, device=dev)
    sumsq = torch.zeros(1, device=dev)
    side = torch.cuda.Stream()
    params = layers * sum(n * k for n, k in LAYER)

    def body(way, cfg):
        main = torch.cuda.current_stream()
        for x, dy, w, st in lin:
            if way == "floor":  # the update's bytes alone: each tensor read and written once
                for t in written(w, st):
                    t.mul_(1)
                continue
            if way != "updates":
                dy @ w  # the dX GEMM, which reads W before its update
            if way == "gemms":
                continue
            if way == "side":
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    fused_wgrad_update(x, dy, w, st, spec, hp, sumsq, 1, True, config=cfg)
            else:
                fused_wgrad_update(x, dy, w, st, spec, hp, sumsq, 1, True, config=cfg)
        if way == "side":
            main.wait_stream(side)

    gemms = replay_ms(lambda: body("gemms", None), layers)
    floor = replay_ms(lambda: body("floor", None), layers)
    rows = []
    for p in programs:
        cfg = config(tokens, p)
        t = {way: replay_ms(lambda: body(way, cfg), layers)
             for way in ("updates", "serial", "side")}
        rows.append(dict(tokens=tokens, states=fmt, programs=p or "auto", gemms_ms=gemms,
                         updates_ms=t["updates"], serial_ms=t["serial"], side_ms=t["side"],
                         saved_ms=t["serial"] - t["side"],
                         update_tbps=params / layers * BYTES[fmt] / (t["updates"] * 1e-3)
                         / 1e12, floor_ms=floor,
                         floor_tbps=params / layers * BYTES[fmt] / (floor * 1e-3) / 1e12))
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v)
                         for v in rows[-1].values()), flush=True)
    del lin
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512", help="comma-separated token counts")
    p.add_argument("--states", default="bf16,int8", help="bf16, int8 or both")
    p.add_argument("--programs", default="auto,100,66",
                   help="auto (the default route) and program limits of the split kernel")
    p.add_argument("--layers", type=int, default=4, help="copies of the layer's linears")
    p.add_argument("--out", default=None, help="JSON of the rows")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overlap.py: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    programs = [None if v == "auto" else int(v) for v in a.programs.split(",")]
    card = torch.cuda.get_device_name()
    print(f"card: {card} | {torch.cuda.get_device_properties(0).multi_processor_count} SMs | "
          f"torch {torch.__version__}; ms per layer ({a.layers} layers' linears per graph)")
    print("tokens | states | programs | GEMMs alone | updates alone | one stream | side stream"
          " | saved | update TB/s | bytes floor | floor TB/s")
    rows = [r for t in map(int, a.tokens.split(",")) for fmt in a.states.split(",")
            for r in measure(t, fmt, a.layers, programs)]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(card=card, torch=torch.__version__, layers=a.layers, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

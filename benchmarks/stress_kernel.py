"""Repeatability under stress: the fused update on the same inputs, many times, compared bit for
bit with its first result. Every route is deterministic for fixed inputs and seed (the random
draws hash the seed and the element's index; the clipping pre-pass sums its tiles in one order),
so any difference is a defect: a race inside a kernel, a read of memory not yet written. Run
several copies on one GPU at once to change the kernels' timing (the way several training runs
on one card do).

    python3 benchmarks/stress_kernel.py --shapes 4096x1024,1024x2048,6144x1024,1024x3072 \\
        --tokens 4096 --reps 200 --routes auto,triton,norm

Routes: auto (fused_wgrad_update's own choice, what training takes: above 1024 tokens on a
Hopper GPU the split kernel at SPLIT_LARGE), triton (config WS=False: the Triton kernel),
norm (the Triton kernel's norm-only clipping pre-pass: its sumsq). One line per cell: the
number of repetitions whose weights, states (int8: codes and scales) or sumsq differ from the
first, the non-finite ones, and the first difference found. sumsq of the update routes is an
atomic sum, compared to the rounding of a reordered sum (tiles at 64 x 128: tiles x 2^-24).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import moments, problem, shape_of, sumsq_close, written  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402

ROUTES = {"auto": None, "triton": {"WS": False}, "norm": {"WS": False}}


def first_difference(ref, got) -> str:
    for i, (a, b) in enumerate(zip(ref, got)):
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            where = tuple(bad[0].tolist())
            return (f"tensor {i} ({'w' if i == 0 else 'state'}) differs in {bad.shape[0]} of "
                    f"{a.numel()} elements, first at {where}: {a[where].item()!r} -> "
                    f"{b[where].item()!r}")
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x1024,1024x2048,6144x1024,1024x3072",
                    help="bench_kernel.SHAPES names or NxK (default: qwen3-0.6b's linears)")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--states", default="bf16,int8")
    ap.add_argument("--routes", default="auto,triton,norm")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="stop a cell's repetitions after this long (0: all --reps)")
    a = ap.parse_args()
    shapes = [(s, shape_of(s)) for s in a.shapes.split(",")]
    routes = a.routes.split(",")
    bad = [r for r in routes if r not in ROUTES]
    if bad:
        raise SystemExit(f"error: unknown route(s) {bad}; valid: {sorted(ROUTES)}")
    if not torch.cuda.is_available():
        raise SystemExit("error: stress_kernel.py needs a GPU")
    dev = torch.device("cuda")
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    failures = 0
    for fmt in a.states.split(","):
        for T in map(int, a.tokens.split(",")):
            for name, (N, K) in shapes:
                torch.manual_seed(T + N + K)
                x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
                hp = torch.tensor(hp_list, device=dev)
                for route in routes:
                    norm = route == "norm"
                    ref, ref_s, diff, nonfinite, note, reps = None, None, 0, 0, "", 0
                    t0 = time.monotonic()
                    for rep in range(a.reps):
                        st = moments(m0, v0, fmt)
                        ww, s = w.clone(), torch.zeros(1, device=dev)
                        fused_wgrad_update(x, dy, ww, st, spec, hp, s, 1, True,
                                           config=ROUTES[route], norm_only=norm)
                        torch.cuda.synchronize()
                        got = written(ww, st)
                        reps += 1
                        finite = all(bool(torch.isfinite(t.float()).all()) for t in got + [s])
                        if not finite:
                            nonfinite += 1
                        if ref is None:
                            ref, ref_s = got, s.item()
                        else:
                            sv = s.item()
                            close = sv == ref_s if norm else sumsq_close(sv, ref_s, N, K)
                            d = first_difference(ref, got)
                            if not d and not close:
                                d = f"sumsq {ref_s!r} -> {sv!r}"
                            if d:
                                diff += 1
                                note = note or f"rep {rep}: {d}"
                        if a.seconds and time.monotonic() - t0 > a.seconds:
                            break
                    failures += diff + nonfinite
                    print(f"{fmt} T={T} {name:>10} {route:>6}: {reps} reps, {diff} differ, "
                          f"{nonfinite} non-finite ({time.monotonic() - t0:.1f} s) {note}",
                          flush=True)
                x = dy = w = m0 = v0 = ref = None
                torch.cuda.empty_cache()
    print("all repetitions equal" if failures == 0 else f"FAILURES: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

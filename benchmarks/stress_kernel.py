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
atomic sum, compared to the rounding of a reordered sum (bench_kernel.sumsq_tol: tiles at
64 x 128, 2 (tiles - 1) 2^-24 relative).

    python3 benchmarks/stress_kernel.py --states bf16 --routes large --hammer 120 --gemm [--poison]

--hammer SECONDS: every cell (state format x tokens x shape x route) launched round-robin and
back to back for that long, each launch on fresh copies of its inputs, its results compared on
the GPU with the cell's first (checked beforehand to be bitwise the Triton kernel's); a
launch that differs is described (how many tiles, whether they hold the input W unchanged,
the kernel's skip of a non-finite tile, or finite wrong values). --gemm adds the layer's dX
GEMM after each launch, as in training; --poison fills every SM's shared memory with NaN
before each launch, so that a read of a shared buffer before its data has landed shows as NaN
rather than as the previous launch's finite data. Routes large, staged and ws1: the split
design at SPLIT_LARGE, at SPLIT_DEFAULT, the WS kernel without the split.
"""
# no `from __future__ import annotations`: _poison's constexpr annotations are read at trace time
import argparse
import sys
import time

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import moments, problem, shape_of, sumsq_close, sumsq_tol, written  # noqa: E402
from forge_engine.kernels import clone_states  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402

ROUTES = {"auto": None, "triton": {"WS": False}, "norm": {"WS": False},
          "large": {"WS": True, "SPLIT": True, "LARGE": True},
          "staged": {"WS": True, "SPLIT": True}, "ws1": {"WS": True}}


def problems(a, shapes, dev):
    """Every (format, tokens, shape) cell's inputs, seeded by its shape: (fmt, T, name, N, K,
    x, dy, w, m0, v0, spec, hp)."""
    for fmt in a.states.split(","):
        for T in map(int, a.tokens.split(",")):
            for name, (N, K) in shapes:
                torch.manual_seed(T + N + K)
                x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
                yield fmt, T, name, N, K, x, dy, w, m0, v0, spec, torch.tensor(hp_list,
                                                                                device=dev)


def route_config(route: str):
    """The config fused_wgrad_update takes for a route: large is the split design at
    fused_ws.SPLIT_LARGE (what auto takes above 1024 tokens on Hopper, named here so that
    FORGE_WS in the environment cannot change it), staged the split design at SPLIT_DEFAULT,
    ws1 the WS kernel without the split."""
    cfg = ROUTES[route]
    if cfg is not None and cfg.get("LARGE"):
        from forge_engine.kernels.fused_ws import SPLIT_LARGE
        cfg = {"WS": True, "SPLIT": True, **SPLIT_LARGE}
    return cfg


def first_difference(ref, got) -> str:
    for i, (a, b) in enumerate(zip(ref, got)):
        if not torch.equal(a, b):
            bad = (a != b).nonzero()
            where = tuple(bad[0].tolist())
            return (f"tensor {i} ({'w' if i == 0 else 'state'}) differs in {bad.shape[0]} of "
                    f"{a.numel()} elements, first at {where}: {a[where].item()!r} -> "
                    f"{b[where].item()!r}")
    return ""


def copy_states(dst: list, src: list) -> None:
    for q, q0 in zip(dst, src):
        if q is not None:
            q.data.copy_(q0.data)
            if q.scale is not None:
                q.scale.copy_(q0.scale)


def describe_bad(ref: list, got: list, w_in: torch.Tensor, tile=(128, 128)) -> str:
    """One line on a launch whose results differ from the reference: for W, how many elements
    differ, in how many tiles (tile = rows x columns of W), how many of those tiles hold the
    input W unchanged (a tile the kernel skipped as non-finite), and whether the differing
    values are finite; then the states' differing element counts."""
    w_ref, w_got = ref[0], got[0]
    bad = w_ref != w_got
    parts = []
    if bool(bad.any()):
        rows, cols = bad.nonzero().unbind(1)
        tiles = torch.unique(rows // tile[0] * (-(-w_in.shape[1] // tile[1])) + cols // tile[1])
        kept = 0
        nt = -(-w_in.shape[1] // tile[1])
        for t in tiles.tolist():
            r0, c0 = t // nt * tile[0], t % nt * tile[1]
            sl = (slice(r0, r0 + tile[0]), slice(c0, c0 + tile[1]))
            kept += bool(torch.equal(w_got[sl], w_in[sl]))
        vals = w_got[bad].float()
        parts.append(f"W: {int(bad.sum())} elements differ in {tiles.numel()} tile(s) of "
                     f"{tile[0]}x{tile[1]}, {kept} of them the input W unchanged, "
                     f"{int((~torch.isfinite(vals)).sum())} non-finite values")
    for i, (a, b) in enumerate(zip(ref[1:], got[1:]), 1):
        n = int((a != b).sum())
        if n:
            parts.append(f"state tensor {i}: {n} elements differ")
    return "; ".join(parts) or "W and states equal (sumsq only)"


@gluon.jit
def _poison(out_ptr, ROWS: gl.constexpr, num_warps: gl.constexpr):
    # ROWS x 4 KiB (224 KiB of the 227 a block may take): one block per SM at a time
    lay: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    buf = gl.allocate_shared_memory(gl.int32, [ROWS, 1024],
                                    gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ones = gl.full([1024], -1, gl.int32, lay)
    acc = gl.zeros([1024], gl.int32, lay)
    for i in range(ROWS):
        buf.index(i).store(ones)
    for i in range(ROWS):
        acc += buf.index(i).load(lay)  # read back, and used below: the stores stay
    gl.atomic_add(out_ptr, gl.sum(acc, axis=0), sem="relaxed")


_POISON_OUT: dict = {}


def poison_shared_memory(dev) -> None:
    """Fill the shared memory of every SM with 0xFF bytes (NaN as bf16 and as fp32): a kernel
    that reads a shared buffer before its data has landed then reads NaN, not the finite
    leftovers of the previous launch of the same kernel."""
    if dev not in _POISON_OUT:
        _POISON_OUT[dev] = (torch.zeros(1, dtype=torch.int32, device=dev),
                            2 * torch.cuda.get_device_properties(dev).multi_processor_count)
    out, grid = _POISON_OUT[dev]
    _poison[(grid,)](out, ROWS=56, num_warps=8)


def hammer(cells, seconds: float, poison: bool, gemm: bool, check_every: int) -> int:
    """Launch every cell's update round-robin, back to back, for `seconds`, each on fresh
    copies of its inputs, and compare its results with the cell's first on the GPU (a sync
    every `check_every` rounds, the last rounds' results kept in turn so that a bad one can be
    described). Optionally fill the shared memory with NaN before each launch (poison) and run
    the layer's dX GEMM between launches (gemm), as training does. Returns the failures."""
    dev = cells[0]["w"].device  # (a GPU; the CPU in the tests, under TRITON_INTERPRET)
    for c in cells:
        x, w, st0 = c["x"], c["w"], c["st"]
        c["outs"] = [(w.clone(), clone_states(st0), torch.zeros(1, device=dev))
                     for _ in range(check_every)]
        c["flags"] = torch.zeros(check_every, 3, dtype=torch.int32, device=dev)
        c["dx"] = torch.empty(x.shape, dtype=x.dtype, device=dev)
        c.update(launches=0, differ=0, nonfinite=0, sumsq_off=0, notes=[])
    t0 = time.monotonic()
    last_print = t0
    while True:  # at least one round
        for slot in range(check_every):
            for c in cells:
                ww, st, s = c["outs"][slot]
                ww.copy_(c["w"])
                copy_states(st, c["st"])
                s.zero_()
                if poison:
                    poison_shared_memory(dev)
                fused_wgrad_update(c["x"], c["dy"], ww, st, c["spec"], c["hp"], s, 1, True,
                                   config=c["config"])
                if gemm:
                    torch.mm(c["dy"], c["w"], out=c["dx"])
                got = written(ww, st)
                diff = torch.stack([(a != b).any() for a, b in zip(c["ref"], got)]).any()
                c["flags"][slot, 0] = diff.int()
                c["flags"][slot, 1] = (~torch.isfinite(s)).int().sum()
                c["flags"][slot, 2] = ((s - c["ref_s"]).abs() > c["tol"]).int().sum()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        for c in cells:
            flags = c["flags"].cpu()
            c["launches"] += check_every
            for slot in range(check_every):
                d, nf, off = (int(v) for v in flags[slot])
                if not (d or nf or off):
                    continue
                c["differ"] += d and not nf
                c["nonfinite"] += bool(nf)
                c["sumsq_off"] += bool(off) and not d and not nf
                if len(c["notes"]) < 5:
                    ww, st, s = c["outs"][slot]
                    note = (f"launch {c['launches'] - check_every + slot}: sumsq "
                            f"{s.item()!r} (reference {c['ref_s'].item()!r}); "
                            + describe_bad(c["ref"], written(ww, st), c["w"]))
                    c["notes"].append(note)
                    print(f"  {c['name']}: {note}", flush=True)
        now = time.monotonic()
        if now - last_print > 30:
            last_print = now
            print(f"  {now - t0:.0f} s: " + ", ".join(
                f"{c['name']} {c['launches']} ({c['differ']}/{c['nonfinite']}/{c['sumsq_off']})"
                for c in cells), flush=True)
        if now - t0 >= seconds:
            break
    failures = 0
    for c in cells:
        failures += c["differ"] + c["nonfinite"] + c["sumsq_off"]
        print(f"{c['name']}: {c['launches']} launches in {time.monotonic() - t0:.0f} s, "
              f"{c['differ']} differ with a finite sumsq, {c['nonfinite']} non-finite sumsq, "
              f"{c['sumsq_off']} with only sumsq off", flush=True)
    return failures


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
    ap.add_argument("--hammer", type=float, default=0.0, metavar="SECONDS",
                    help="instead of --reps: launch all cells round-robin, back to back, for "
                         "this long, comparing on the GPU (hammer())")
    ap.add_argument("--poison", action="store_true",
                    help="--hammer: fill every SM's shared memory with NaN before each launch")
    ap.add_argument("--gemm", action="store_true",
                    help="--hammer: the layer's dX GEMM after each launch, as in training")
    ap.add_argument("--check-every", type=int, default=4, metavar="ROUNDS",
                    help="--hammer: rounds between two syncs (their results kept)")
    a = ap.parse_args()
    shapes = [(s, shape_of(s)) for s in a.shapes.split(",")]
    routes = a.routes.split(",")
    bad = [r for r in routes if r not in ROUTES]
    if bad:
        raise SystemExit(f"error: unknown route(s) {bad}; valid: {sorted(ROUTES)}")
    if a.hammer < 0 or a.check_every < 1:
        raise SystemExit(f"error: --hammer must be >= 0 and --check-every >= 1, got "
                         f"{a.hammer} and {a.check_every}")
    if (a.poison or a.gemm) and not a.hammer:
        raise SystemExit("error: --poison and --gemm go with --hammer")
    if a.hammer and "norm" in routes:
        raise SystemExit("error: --hammer takes update routes, not norm")
    if not torch.cuda.is_available():
        raise SystemExit("error: stress_kernel.py needs a GPU")
    dev = torch.device("cuda")
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    if a.hammer:
        cells = []
        for fmt, T, name, N, K, x, dy, w, m0, v0, spec, hp in problems(a, shapes, dev):
            st = moments(m0, v0, fmt)
            outs = {}
            for route in ["triton"] + routes:
                ww, q = w.clone(), clone_states(st)
                s = torch.zeros(1, device=dev)
                fused_wgrad_update(x, dy, ww, q, spec, hp, s, 1, True,
                                   config=route_config(route))
                torch.cuda.synchronize()
                outs[route] = (written(ww, q), s)
            for route in routes:
                ref, s = outs[route]
                # the split and WS designs are bitwise the Triton kernel's results: the
                # reference is checked against it before the hammering
                d = first_difference(outs["triton"][0], ref)
                if d or not torch.isfinite(s).all():
                    raise SystemExit(f"error: {fmt} T={T} {name} {route}: the first launch is "
                                     f"not the Triton kernel's result: "
                                     f"{d or 'non-finite sumsq'}")
                cells.append(dict(name=f"{fmt} T={T} {name} {route}", x=x, dy=dy, w=w, st=st,
                                  spec=spec, hp=hp, config=route_config(route), ref=ref,
                                  ref_s=s, tol=sumsq_tol(s.item(), N, K)))
        print(f"hammering {len(cells)} cells for {a.hammer:.0f} s (poison {a.poison}, gemm "
              f"{a.gemm})", flush=True)
        failures = hammer(cells, a.hammer, a.poison, a.gemm, a.check_every)
        print("all launches equal" if failures == 0 else f"FAILURES: {failures}")
        sys.exit(1 if failures else 0)
    failures = 0
    for fmt, T, name, N, K, x, dy, w, m0, v0, spec, hp in problems(a, shapes, dev):
        for route in routes:
            norm = route == "norm"
            ref, ref_s, diff, nonfinite, note, reps = None, None, 0, 0, "", 0
            t0 = time.monotonic()
            for rep in range(a.reps):
                st = moments(m0, v0, fmt)
                ww, s = w.clone(), torch.zeros(1, device=dev)
                fused_wgrad_update(x, dy, ww, st, spec, hp, s, 1, True,
                                   config=route_config(route), norm_only=norm)
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

"""A/B of the warp-specialized kernel (fused_ws.py) at a git revision against the working
tree, in one process on one card: per cell (moments, T tokens, shape) both versions step the
same problem once and their weights and states (int8: codes and scales) are compared bit for
bit (sumsq, whose tiles' norms are added atomically in any order, to the rounding of a
reordered sum), then each is timed replayed from a CUDA graph (do_bench_cudagraph, median) in
two interleaved rounds (A B, then B A) against the graphed unfused baseline (cuBLAS dW +
torch's fused AdamW, capturable).

    python3 benchmarks/ab_ws.py --base HEAD --tokens 2048,4096 \\
        --shapes qkv,proj,fc1,fc2,head,q-fc1,q-fc2,q-head --states bf16,int8 --out ab.csv

--base may also name a file, a copy of fused_ws.py (a variant, or a revision's copy written
with `git show REV:forge_engine/kernels/fused_ws.py > FILE` where the GPU's checkout has no
git history). Version A's fused_ws.py is loaded as a module of its own (its imports are the
tree's: the A/B is of that one file). --config: fused_ws's SPLIT_LARGE (default) or
SPLIT_DEFAULT, taken from each version itself. Needs a Hopper GPU.

--out CSV also writes the cells as rows (shape, T, N, K, states, unfused_ms, A_ms, B_ms,
bitwise; the columns' names from --names), rewritten after every cell so that a run cut off
keeps what it measured; `benchmarks/sweep_ws.py --plot PNG --plot-from CSV [--variants
NAME]` draws them. --csv-from LOG[,LOG] --out CSV builds the same rows, without a GPU, from
what this script printed (each time the median of its rounds, as the run took it):

    python3 benchmarks/ab_ws.py --names head,final --out ab.csv \
        --csv-from benchmarks/results/kernel/ab_final2048.txt  # no GPU
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton.testing as tt

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import moments, problem, shape_of, sumsq_close, write_csv, written  # noqa: E402
from graphed_small import graphed_unfused_ms  # noqa: E402

FILE = "forge_engine/kernels/fused_ws.py"


def load_revision(rev: str, path: str = FILE):
    """The module `path` as it stands at git revision `rev` (or the file `rev`, where one of
    that name exists: a checkout without its git history, a variant), loaded under a name of
    its own."""
    if Path(rev).is_file():
        text = Path(rev).read_text()
    else:
        src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
        if src.returncode:
            raise SystemExit(f"error: --base {rev}: neither a file nor a revision git can show "
                             f"({src.stderr.strip()})")
        text = src.stdout
    tmp = Path(tempfile.mkdtemp()) / "fused_ws_base.py"
    tmp.write_text(text)
    spec = importlib.util.spec_from_file_location("fused_ws_base", tmp)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cell_line(fmt: str, T: int, shape: str, unfused: float, times: dict, bitwise: str) -> str:
    """One cell as main() prints it: the unfused time, each version's median time (and over
    unfused), B / A, the bitwise verdict and every round's time (what --csv-from reads)."""
    med = {v: statistics.median(t) for v, t in times.items()}
    return (f"{fmt} T={T} {shape:>6} unfused {unfused:.4f} | "
            + " ".join(f"{v} {med[v]:.4f} ({med[v] / unfused:.3f})" for v in med)
            + f" | B/A {med['B'] / med['A']:.3f} | bitwise {bitwise} | rounds {times}")


LINE = re.compile(r"(?P<states>\w+) T=(?P<T>\d+)\s+(?P<shape>\S+) unfused (?P<unfused>[\d.]+) \|"
                  r".*\| bitwise (?P<bitwise>\w+) \| rounds (?P<rounds>\{.*\})\s*$")


def row(shape: str, T: int, states: str, unfused: float, times: dict, bitwise: str,
        names: tuple) -> dict:
    """One cell's CSV row: each version's time the median of its rounds, under its name."""
    N, K = shape_of(shape)
    r = dict(shape=shape, T=T, N=N, K=K, states=states, unfused_ms=unfused)
    for name, v in zip(names, ("A", "B")):
        r[f"{name}_ms"] = statistics.median(times[v])
    r["bitwise"] = bitwise
    return r


def rows_from_logs(paths: str, names: tuple) -> list:
    """--csv-from: the rows of every cell line (cell_line) in the comma-separated logs this
    script printed (other lines, e.g. the card's, are skipped; unfused_ms as printed, to 4
    decimals); an error if a log has none."""
    rows = []
    for path in paths.split(","):
        found = 0
        with open(path) as f:
            for line in f:
                m = LINE.match(line.strip())
                if m:
                    rows.append(row(m["shape"], int(m["T"]), m["states"], float(m["unfused"]),
                                    ast.literal_eval(m["rounds"]), m["bitwise"], names))
                    found += 1
        if not found:
            raise SystemExit(f"error: --csv-from {path}: no cell line of ab_ws.py in it")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None,
                    help="version A: a git revision, or a copy of fused_ws.py (a file path); "
                         "needed unless --csv-from")
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--shapes", default="qkv,proj,fc1,fc2,head,q-fc1,q-fc2,q-head",
                    help="comma-separated bench_kernel.SHAPES names or NxK weights")
    ap.add_argument("--states", default="bf16,int8", help="moment formats, comma-separated")
    ap.add_argument("--config", default="SPLIT_LARGE", choices=("SPLIT_LARGE", "SPLIT_DEFAULT"))
    ap.add_argument("--out", default=None, metavar="CSV", help="also write the cells as CSV rows")
    ap.add_argument("--names", default="A,B", metavar="NAME_A,NAME_B",
                    help="the two versions' names in the CSV's columns (NAME_ms)")
    ap.add_argument("--csv-from", default=None, metavar="LOG[,LOG]",
                    help="no GPU: only write --out from the cells this script printed")
    a = ap.parse_args()
    names = tuple(a.names.split(","))
    if len(names) != 2 or len(set(names)) != 2 or not all(re.fullmatch(r"[\w-]+", n)
                                                           for n in names):
        raise SystemExit(f"error: --names wants two different names (letters, digits, _ or -), "
                         f"got {a.names!r}")
    if a.csv_from:
        if not a.out:
            raise SystemExit("error: --csv-from needs --out CSV")
        write_csv(a.out, rows_from_logs(a.csv_from, names))
        return
    if not a.base:
        raise SystemExit("error: --base REV (or FILE) is needed, unless --csv-from")
    shapes = [(s, shape_of(s)) for s in a.shapes.split(",")]  # bad names fail before the GPU
    base = load_revision(a.base)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: ab_ws.py needs a Hopper GPU")
    from forge_engine.kernels import fused_ws as tree
    versions = {"A": base, "B": tree}
    dev = torch.device("cuda")
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__} | A = {a.base}, "
          f"B = the tree | {a.config}")
    rows = []
    for fmt in a.states.split(","):
        for T in map(int, a.tokens.split(",")):
            for name, (N, K) in shapes:
                x, dy, w, m0, v0, spec, hp_list = problem(T, N, K, dev)
                hp = torch.tensor(hp_list, device=dev)
                outs = {}
                for v, mod in versions.items():
                    cfg = dict(SPLIT=True, **getattr(mod, a.config))
                    st = moments(m0, v0, fmt)
                    ww, s = w.clone(), torch.zeros(1, device=dev)
                    mod.fused_wgrad_update_ws(x, dy, ww, st, spec, hp, s, 1, True, config=cfg)
                    torch.cuda.synchronize()
                    outs[v] = (written(ww, st), s)
                same = all(torch.equal(p, q) for p, q in zip(outs["A"][0], outs["B"][0]))
                same = same and sumsq_close(outs["A"][1].item(), outs["B"][1].item(), N, K)
                outs = None
                unfused = graphed_unfused_ms(x, dy, w)
                st = moments(m0, v0, fmt)
                ww, s = w.clone(), torch.zeros(1, device=dev)
                times = {v: [] for v in versions}
                for order in (("A", "B"), ("B", "A")):
                    for v in order:
                        mod = versions[v]
                        cfg = dict(SPLIT=True, **getattr(mod, a.config))

                        def call():
                            mod.fused_wgrad_update_ws(x, dy, ww, st, spec, hp, s, 1, True,
                                                      config=cfg)
                        call()
                        times[v].append(tt.do_bench_cudagraph(call, rep=120,
                                                              return_mode="median"))
                bitwise = "equal" if same else "DIFFERENT"
                print(cell_line(fmt, T, name, unfused, times, bitwise), flush=True)
                if a.out:  # after every cell: a run cut off keeps its rows
                    rows.append(row(name, T, fmt, unfused, times, bitwise, names))
                    write_csv(a.out, rows, quiet=True)
                x = dy = w = m0 = v0 = st = ww = None
                torch.cuda.empty_cache()
    if a.out:
        print(f"wrote {a.out} ({len(rows)} cells)")


if __name__ == "__main__":
    main()

"""A/B of the warp-specialized kernel (fused_ws.py) at a git revision against the working
tree, in one process on one card: per cell (moments, T tokens, shape) both versions step the
same problem once and their weights and states (int8: codes and scales) are compared bit for
bit (sumsq, whose tiles' norms are added atomically in any order, to the rounding of a
reordered sum), then each is timed replayed from a CUDA graph (do_bench_cudagraph, median) in
two interleaved rounds (A B, then B A) against the graphed unfused baseline (cuBLAS dW +
torch's fused AdamW, capturable).

    python3 benchmarks/ab_ws.py --base 43e5105 --tokens 2048,4096 \\
        --shapes qkv,proj,fc1,fc2,head,q-fc1,q-fc2,q-head --states bf16,int8
        # docs/benchmarks.md, "Fifteenth session" (docs/runs/var15_prefetch_h200.txt)

--base may also name a file, a copy of fused_ws.py (a variant, or a revision's copy written
with `git show REV:forge_engine/kernels/fused_ws.py > FILE` where the GPU's checkout has no
git history). Version A's fused_ws.py is loaded as a module of its own (its imports are the
tree's: the A/B is of that one file). --config: fused_ws's SPLIT_LARGE (default) or
SPLIT_DEFAULT, taken from each version itself. Needs a Hopper GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton.testing as tt

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import moments, problem, shape_of, sumsq_close, written  # noqa: E402
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True,
                    help="version A: a git revision, or a copy of fused_ws.py (a file path)")
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--shapes", default="qkv,proj,fc1,fc2,head,q-fc1,q-fc2,q-head",
                    help="comma-separated bench_kernel.SHAPES names or NxK weights")
    ap.add_argument("--states", default="bf16,int8", help="moment formats, comma-separated")
    ap.add_argument("--config", default="SPLIT_LARGE", choices=("SPLIT_LARGE", "SPLIT_DEFAULT"))
    a = ap.parse_args()
    shapes = [(s, shape_of(s)) for s in a.shapes.split(",")]  # bad names fail before the GPU
    base = load_revision(a.base)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: ab_ws.py needs a Hopper GPU")
    from forge_engine.kernels import fused_ws as tree
    versions = {"A": base, "B": tree}
    dev = torch.device("cuda")
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__} | A = {a.base}, "
          f"B = the tree | {a.config}")
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
                med = {v: statistics.median(t) for v, t in times.items()}
                print(f"{fmt} T={T} {name:>6} unfused {unfused:.4f} | "
                      + " ".join(f"{v} {med[v]:.4f} ({med[v] / unfused:.3f})" for v in med)
                      + f" | B/A {med['B'] / med['A']:.3f} | bitwise "
                      + ("equal" if same else "DIFFERENT") + f" | rounds {times}", flush=True)
                x = dy = w = m0 = v0 = st = ww = None
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

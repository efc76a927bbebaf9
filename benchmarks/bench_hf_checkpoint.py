"""pretrain.py --hf-checkpoint on a model of a preset's shape: FORGE against --no-forge.

    python benchmarks/bench_hf_checkpoint.py --preset llama3.1-8b --out results_dir

writes a Hugging Face directory of the preset's shape with random weights (bf16 on a GPU,
forge_engine.hf.save_pretrained), then runs `pretrain.py --hf-checkpoint DIR --mock-data` twice
as a user does, once with FORGE and once with --no-forge (torch.optim.AdamW, fused on CUDA),
each in its own process, and parses pretrain's log lines: the median of the logged
"elapsed time per iteration" intervals after the first (which holds compilation and warm-up),
the peak memory of the last line, and the losses. Writes hf_checkpoint.csv and prints a table.
`--tiny` runs the same on the CPU with the tiny preset (fp32), to check the script.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LINE = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+) .*lm loss: ([-+.\dE]+) .*"
                  r"peak memory \(GiB\): ([\d.]+) \| tokens/s: (\d+)")


def write_checkpoint(preset: str, path: str, cuda: bool) -> float:
    import torch
    from forge_engine.hf import save_pretrained
    from forge_engine.model import GPT, preset as make
    t = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    model = GPT(make(preset), params_dtype=dtype, seed=1, init_device="cuda" if cuda else "cpu")
    save_pretrained(model, path)
    del model
    return time.perf_counter() - t


def run(hf_dir: str, args, forge: bool, log_path: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "pretrain.py"), "--hf-checkpoint", hf_dir,
           "--mock-data", "--seq-length", str(args.seq_length), "--micro-batch-size", "1",
           "--train-iters", str(args.iters), "--log-interval", str(args.log_interval),
           "--eval-iters", "0", "--lr", "1e-5", "--lr-warmup-iters", "0"]
    cmd += ["--bf16"] if not args.tiny else []
    cmd += ["--enable-cuda-graph"] if args.cuda_graph else []
    cmd += [] if forge else ["--no-forge"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.tiny:
        env["FORGE_BACKEND"] = "torch"
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    with open(log_path, "w") as f:
        f.write(" ".join(cmd) + "\n" + p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"bench_hf_checkpoint.py: error: {' '.join(cmd)} exited "
                         f"{p.returncode}; see {log_path}")
    rows = [LINE.search(s) for s in p.stdout.splitlines()]
    rows = [m for m in rows if m]
    if len(rows) < 2:
        raise SystemExit(f"bench_hf_checkpoint.py: error: fewer than two log lines in {log_path}")
    ms = [float(m.group(1)) for m in rows[1:]]
    return dict(mode="forge" if forge else "no-forge", step_ms=statistics.median(ms),
                step_ms_min=min(ms), step_ms_max=max(ms), peak_gib=float(rows[-1].group(3)),
                tokens_per_s=statistics.median(int(m.group(4)) for m in rows[1:]),
                first_loss=float(rows[0].group(2)), last_loss=float(rows[-1].group(2)),
                wall_s=round(wall, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3.1-8b")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--workdir", default="/tmp/bench_hf_checkpoint",
                   help="where the Hugging Face directory is written (16 GB for 8B in bf16)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--cuda-graph", action="store_true",
                   help="both runs with --enable-cuda-graph (each step one replayed graph)")
    p.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU")
    a = p.parse_args(argv)
    import torch
    cuda = torch.cuda.is_available() and not a.tiny
    if a.tiny:
        a.preset, a.seq_length = "tiny", 32
    elif not cuda:
        print("bench_hf_checkpoint.py: error: needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    hf_dir = os.path.join(a.workdir, a.preset)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        save_s = write_checkpoint(a.preset, hf_dir, cuda)
        print(f"wrote {hf_dir} in {save_s:.1f} s", flush=True)
    card = torch.cuda.get_device_name() if cuda else "cpu"
    rows, tag = [], "_graph" if a.cuda_graph else ""
    for forge in (True, False):
        log = os.path.join(a.out, f"hf_checkpoint{tag}_{'forge' if forge else 'no-forge'}.log")
        r = run(hf_dir, a, forge, log)
        rows.append(dict(card=card, preset=a.preset, seq_length=a.seq_length,
                         cuda_graph=a.cuda_graph, **r))
        print(r, flush=True)
    with open(os.path.join(a.out, f"hf_checkpoint{tag}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    f, n = rows
    print(f"| {card} | {a.preset} b1 x {a.seq_length}{tag} | FORGE {f['step_ms']:.1f} ms, "
          f"{f['peak_gib']:.1f} GiB | --no-forge {n['step_ms']:.1f} ms, {n['peak_gib']:.1f} GiB "
          f"| time {f['step_ms'] / n['step_ms']:.3f}x, memory "
          f"{f['peak_gib'] / n['peak_gib']:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

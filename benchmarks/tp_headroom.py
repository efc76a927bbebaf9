"""Per-GPU memory and micro-batch headroom of pretrain.py under tensor parallelism.

    python3 benchmarks/tp_headroom.py --nproc 4 --model llama3.1-8b --seq 2048 \
        --batches 1,4 --out headroom.json

For each mode (FORGE with bf16 moments, FORGE with int8 moments, --no-forge) and each
micro-batch size, launches `torchrun --nproc-per-node N pretrain.py --tensor-parallel N
--sequence-parallel --bf16 --mock-data ...` for a few iterations and reads Megatron's log line
(rank 0's GPU: TP ranks are symmetric): peak memory, time per iteration, tokens/s. A run that
runs out of memory is recorded as such and larger sizes of that mode are skipped. From two sizes
per mode it fits peak(B) = a + b B and reports the largest B that fits in --cap GiB.

    --exactness: a small preset trained at TP=1 twice (the run-to-run spread), at TP=N with
    FORGE and at TP=N with --no-forge; per-step losses side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

LINE = re.compile(r" iteration +(\d+)/ +\d+ .*?elapsed time per iteration \(ms\): ([\d.]+) .*?"
                  r"lm loss: ([\d.E+-]+) .*?peak memory \(GiB\): ([\d.]+) \| tokens/s: (\d+)")
MODES = {"forge-bf16": [], "forge-int8": ["--state-dtype", "int8"], "no-forge": ["--no-forge"]}


def launch(nproc, args, timeout):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "pretrain.py", *args]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0"))
    rows = [dict(it=int(m[0]), ms=float(m[1]), loss=float(m[2]), peak=float(m[3]),
                 tps=int(m[4])) for m in LINE.findall(p.stdout)]
    oom = "OutOfMemoryError" in p.stderr or "CUDA out of memory" in p.stderr
    return dict(rc=p.returncode, oom=oom, rows=rows, wall=time.time() - t0, stdout=p.stdout,
                tail=(p.stdout[-800:] + p.stderr[-1500:]) if p.returncode else "")


def headroom(a):
    out = {}
    for mode, extra in MODES.items():
        out[mode] = []
        for b in map(int, a.batches.split(",")):
            args = ["--model", a.model, "--tensor-parallel", str(a.nproc), "--sequence-parallel",
                    "--bf16", "--mock-data", "--seq-length", str(a.seq), "--micro-batch-size",
                    str(b), "--train-iters", str(a.iters), "--log-interval", "1",
                    "--eval-iters", "0", "--lr", "1e-5", *extra]
            r = launch(a.nproc, args, a.timeout)
            last = r["rows"][-1] if r["rows"] else {}
            steady = [x["ms"] for x in r["rows"][1:]]
            rec = dict(batch=b, rc=r["rc"], oom=r["oom"], peak_gib=last.get("peak"),
                       ms=min(steady) if steady else None, tokens_s=last.get("tps"),
                       wall_s=round(r["wall"], 1))
            if r["rc"] and not r["oom"]:
                rec["tail"] = r["tail"]
            out[mode].append(rec)
            print(mode, rec, flush=True)
            if r["rc"]:
                break
        ok = [x for x in out[mode] if x["rc"] == 0]
        if len(ok) >= 2:
            (b1, m1), (b2, m2) = (ok[0]["batch"], ok[0]["peak_gib"]), (ok[-1]["batch"],
                                                                       ok[-1]["peak_gib"])
            slope = (m2 - m1) / (b2 - b1)
            fixed = m1 - slope * b1
            fit = dict(fixed_gib=round(fixed, 2), per_sample_gib=round(slope, 3))
            for cap in map(float, a.cap.split(",")):
                fit[f"max_batch_at_{cap:g}GiB"] = int((cap - fixed) // slope) if slope > 0 else None
            out[mode + "-fit"] = fit
            print(mode, "fit", fit, flush=True)
    return out


def exactness(a):
    out = {}
    common = ["--model", a.small, "--bf16", "--mock-data", "--seq-length", "512",
              "--micro-batch-size", "4", "--train-iters", str(a.small_iters), "--log-interval",
              "1", "--eval-iters", "0", "--lr", "3e-4", "--lr-warmup-iters", "5"]
    runs = {"tp1-a": (1, []), "tp1-b": (1, []), f"tp{a.nproc}": (a.nproc, ["--sequence-parallel"]),
            f"tp{a.nproc}-no-forge": (a.nproc, ["--sequence-parallel", "--no-forge"])}
    for name, (n, extra) in runs.items():
        r = launch(n, [*common, "--tensor-parallel", str(n), *extra], a.timeout)
        out[name] = [x["loss"] for x in r["rows"]]
        print(name, "rc", r["rc"], "losses", out[name], r["tail"][-500:], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--cap", default="139,40")
    ap.add_argument("--small", default="qwen3-0.6b")
    ap.add_argument("--small-iters", type=int, default=30)
    ap.add_argument("--exactness", action="store_true")
    ap.add_argument("--headroom", action="store_true")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--out", default="headroom.json")
    a = ap.parse_args()
    res = {"args": vars(a)}
    if a.exactness:
        res["exactness"] = exactness(a)
    if a.headroom:
        res["headroom"] = headroom(a)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

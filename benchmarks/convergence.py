"""Convergence on a GPU (issue 5, target 4): the same preset, seed and data, trained from scratch
on the default corpus (tools/prepare_default_data.py) in four ways:

    fp32-master   --no-forge, fp32 weights and AdamW states (the reference: no bf16 rounding of
                  weights at all)
    forge-bf16    FORGE, bf16 weights with stochastic rounding, bf16 moments
    forge-int8    FORGE, bf16 weights with stochastic rounding, int8 moments
    bf16-plain    --no-forge with bf16 weights: torch's AdamW rounds every update to nearest
                  (no stochastic rounding): updates below half an ulp of the weight are lost

    python3 benchmarks/convergence.py --gpus 2 --out docs/runs/convergence_h200.json

forge-bf16-graph is forge-bf16 with every step after the third a replayed CUDA graph
(--enable-cuda-graph); not in the default list. Runs go --gpus at a time, one per GPU (of those
CUDA_VISIBLE_DEVICES lists, when it is set). A mode written MODE#N (fp32-master#2) is MODE run again
with the same seed and data: the run-to-run spread, against which any difference between modes
has to be read (docs/benchmarks.md, "How much one run says"). Each is `python pretrain.py ...` with
--log-interval 10; the JSON holds every logged loss and the validation losses. "final" is the
mean of the last three logged training losses (iterations 280-300 for 300 iterations), which
smooths batch-to-batch noise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

LINE = re.compile(r" iteration +(\d+)/ +\d+ .*?lm loss: ([\d.E+-]+) ")
VALID = re.compile(r" validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+)")
MODES = {"fp32-master": ["--no-forge"], "forge-bf16": ["--bf16"],
         "forge-int8": ["--bf16", "--state-dtype", "int8"], "bf16-plain": ["--bf16", "--no-forge"],
         "forge-bf16-graph": ["--bf16", "--enable-cuda-graph"]}


def summary(runs: dict) -> dict:
    """Per mode (repeats MODE#N pooled): the number of finished runs, the mean and sample
    standard deviation of their final losses, and the difference of means to fp32-master with
    its standard error sqrt(sd_a^2 / n_a + sd_b^2 / n_b) when both modes have two runs or more.
    One run per mode cannot tell a difference from the run-to-run spread; this says how
    large that spread is."""
    finals: dict = {}
    for name, rec in runs.items():
        if rec.get("final") is not None:
            finals.setdefault(name.split("#")[0], []).append(rec["final"])
    out = {}
    for mode, xs in finals.items():
        n = len(xs)
        mean = sum(xs) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else None
        out[mode] = dict(n=n, mean=mean, sd=sd, finals=xs)
    ref = out.get("fp32-master")
    for mode, row in out.items():
        if ref is not None and mode != "fp32-master":
            row["minus_fp32_master"] = row["mean"] - ref["mean"]
            both = row["sd"] is not None and ref["sd"] is not None
            row["se"] = math.sqrt(row["sd"] ** 2 / row["n"] + ref["sd"] ** 2 / ref["n"]) \
                if both else None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--modes", default="fp32-master,forge-bf16,forge-int8,bf16-plain")
    ap.add_argument("--out", default="convergence.json")
    a = ap.parse_args()
    modes = a.modes.split(",")
    bad = [m for m in modes if m.split("#")[0] not in MODES]
    if bad:
        raise SystemExit(f"error: unknown mode(s) {', '.join(bad)}; valid: {', '.join(MODES)}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(a.gpus)]
    if len(gpus) < a.gpus:
        raise SystemExit(f"error: --gpus {a.gpus} but CUDA_VISIBLE_DEVICES={visible} lists "
                         f"{len(gpus)}")
    subprocess.run([sys.executable, "tools/prepare_default_data.py", "--data-dir", "data"],
                   check=True)
    common = ["--model", a.model, "--data-path", "data/stdlib_text_document",
              "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
              "data/stdlib_tokenizer.model", "--split", "98,2,0", "--seq-length", str(a.seq),
              "--micro-batch-size", str(a.micro_batch), "--train-iters", str(a.iters),
              "--lr", a.lr, "--min-lr", str(float(a.lr) / 10), "--lr-warmup-iters",
              str(a.iters // 10), "--lr-decay-style", "cosine", "--weight-decay", "0.1",
              "--adam-beta2", "0.95", "--log-interval", "10", "--eval-interval",
              str(a.iters // 3), "--eval-iters", "10", "--seed", "1234"]
    res = {"args": vars(a), "runs": {}}
    for i in range(0, len(modes), a.gpus):
        procs = {}
        for j, mode in enumerate(modes[i:i + a.gpus]):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[j], PYTHONUNBUFFERED="1")
            procs[mode] = subprocess.Popen([sys.executable, "pretrain.py", *common,
                                            *MODES[mode.split("#")[0]]],
                                           env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        for mode, p in procs.items():
            out, err = p.communicate()
            losses = [(int(m[0]), float(m[1])) for m in LINE.findall(out)]
            valid = [(int(m[0]), float(m[1])) for m in VALID.findall(out)]
            last = [v for _, v in losses[-3:]]
            rec = dict(rc=p.returncode, losses=losses, valid=valid,
                       final=sum(last) / len(last) if last else None,
                       forge_line=next((ln for ln in out.splitlines()
                                        if ln.startswith("FORGE:")), ""),
                       tail=err[-1500:] if p.returncode else "")
            res["runs"][mode] = rec
            print(f"{mode:>12} rc {rec['rc']} final {rec['final']} valid {valid}", flush=True)
            if rec["tail"]:
                print(rec["tail"], flush=True)
            with open(a.out, "w") as f:  # after every run: a later failure keeps these
                json.dump(res, f, indent=1)
    res["summary"] = summary(res["runs"])
    for mode, row in res["summary"].items():
        sd = f"sd {row['sd']:.4f}" if row["sd"] is not None else "sd -"
        diff = ""
        if "minus_fp32_master" in row:
            se = row["se"]
            diff = (f"; - fp32-master {row['minus_fp32_master']:+.4f}"
                    + (f" +- {se:.4f} (standard error)" if se is not None else
                       " (no standard error: a mode with one run)"))
        print(f"{mode:>16} n {row['n']} mean final {row['mean']:.4f} {sd}{diff}")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

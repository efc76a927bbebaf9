"""Convergence on a GPU: the same preset, seed and data, trained from scratch
on the default corpus (tools/prepare_default_data.py) in these ways:

    fp32-master   --no-forge, fp32 weights and AdamW states (the reference: no bf16 rounding of
                  weights at all)
    forge-bf16    FORGE, bf16 weights with stochastic rounding, bf16 moments
    forge-int8    FORGE, bf16 weights with stochastic rounding, int8 moments
    bf16-plain    --no-forge with bf16 weights: torch's AdamW rounds every update to nearest
                  (no stochastic rounding): updates below half an ulp of the weight are lost
    bf16-master   --no-forge --bf16 --main-params-dtype fp32: Megatron's mixed precision, bf16
                  weights and compute (as FORGE's) with fp32 master copies and fp32 states,
                  the copy rounded to nearest into the weight each step (not in the default
                  list; the reference that isolates what FORGE changes: only the optimizer)

    python3 benchmarks/convergence.py --gpus 2 --out runs.json
    python3 benchmarks/convergence.py --gpus 2 --per-gpu 4 --repeat 8 --budget-s 540 --out a.json
    python3 benchmarks/convergence.py --merge a.json,b.json --out pooled.json    # no GPU
    python3 benchmarks/convergence.py --merge a.json,b.json --untag --ref bf16-master \\
        --at 150,200,300 --out pooled.json    # against another mode; losses on the way

A mode written MODE@TAG is MODE with the environment of --variant TAG:KEY=VALUE (repeat the flag
for more keys), a mode of its own in the summary: the A/B of a kernel route in training,
e.g. --modes forge-bf16,forge-bf16@ws0 --variant ws0:FORGE_WS=0.

forge-bf16-graph is forge-bf16 with every step after the third a replayed CUDA graph
(--enable-cuda-graph); not in the default list. A mode written MODE#N (fp32-master#2) is MODE
run again with the same seed and data; --repeat N runs every mode N times, interleaved (a, b,
a#2, b#2, ...). Same-seed repeats differ (some GPU kernels are not bitwise reproducible, and
this run's loss curve is chaotic: docs/performance.md, "Convergence"), so a mode's
final loss is a distribution, and the summary compares means with their standard errors
and medians with a bootstrap interval (a run that leaves the loss plateau late moves the mean,
hardly the median).

Runs go --per-gpu at a time on each of --gpus GPUs (of those CUDA_VISIBLE_DEVICES lists, when
it is set); each is `python pretrain.py ...` with --log-interval 10, its output in a log file
beside --out. With --budget-s no run starts that would not end within that many seconds of the
start, judged by the longest finished run of its mode, and the runs still going at that time
(those started before any run of their mode had finished) are stopped; they, like the runs an
interrupt (Ctrl-C) stops, keep their logged losses without a final ("cut_off" says why). Set
--budget-s below a caller's own time limit. The JSON, rewritten after every run, holds every
logged loss, the validation losses and the summary. "final" is the mean of the last three
logged training losses (iterations 280-300 for 300 iterations; each is Megatron's mean over
its 10 iterations).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

LINE = re.compile(r" iteration +(\d+)/ +\d+ .*?lm loss: ([\d.E+-]+) ")
ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")
VALID = re.compile(r" validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+)")
MODE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*(?:@[a-z0-9]+(?:-[a-z0-9]+)*)?")
MODES = {"fp32-master": ["--no-forge"], "forge-bf16": ["--bf16"],
         "forge-int8": ["--bf16", "--state-dtype", "int8"], "bf16-plain": ["--bf16", "--no-forge"],
         "forge-bf16-graph": ["--bf16", "--enable-cuda-graph"],
         "bf16-master": ["--bf16", "--no-forge", "--main-params-dtype", "fp32"]}


def mode_of(name: str) -> str:
    """The mode a run's name stands for: "forge-bf16#3" and the older files' "fp32-master (a)"
    are runs of forge-bf16 and fp32-master; "forge-bf16@staged#2" of forge-bf16@staged (a
    variant: forge-bf16 with --variant staged's environment)."""
    return MODE.match(name).group()


def median_diff_ci(a: list, b: list, resamples: int = 4000, seed: int = 0) -> tuple:
    """A 95% percentile-bootstrap interval of median(a) - median(b): each sample resampled
    with replacement, `resamples` times, from a fixed seed (the same data give the same
    interval). Unlike the difference of means, one run that left the loss plateau late does
    not move it much."""
    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(a, k=len(a)))
                   - statistics.median(rng.choices(b, k=len(b))) for _ in range(resamples))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def summary(runs: dict, ref_mode: str = "fp32-master") -> dict:
    """Per mode (repeats MODE#N pooled): the number of finished runs, the mean and sample
    standard deviation of their final losses, and the difference of means to ref_mode (the
    target's fp32 master weights unless named) with its standard error sqrt(sd_a^2 / n_a +
    sd_b^2 / n_b) and of medians with median_diff_ci's interval, when both modes have two runs
    or more.
    One run per mode cannot tell a difference from the run-to-run spread; this says how
    large that spread is."""
    finals: dict = {}
    for name, rec in runs.items():
        if rec.get("final") is not None:
            finals.setdefault(rec.get("mode") or mode_of(name), []).append(rec["final"])
    out = {}
    for mode, xs in finals.items():
        n = len(xs)
        mean = sum(xs) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else None
        out[mode] = dict(n=n, mean=mean, sd=sd, median=statistics.median(xs), finals=xs)
    ref = out.get(ref_mode)
    for mode, row in out.items():
        if ref is not None and mode != ref_mode:
            row["ref"] = ref_mode
            row["minus_ref"] = row["mean"] - ref["mean"]
            both = row["sd"] is not None and ref["sd"] is not None
            row["se"] = math.sqrt(row["sd"] ** 2 / row["n"] + ref["sd"] ** 2 / ref["n"]) \
                if both else None
            row["median_minus_ref"] = row["median"] - ref["median"]
            row["median_ci95"] = median_diff_ci(row["finals"], ref["finals"]) \
                if both else None
    return out


def losses_at(runs: dict, iters: list) -> dict:
    """Per mode, over its finished runs that kept their curves: the median logged training
    loss at each of `iters` (each a mean over its 10 iterations) and how many runs logged it;
    where the modes part on the way to the final loss (the plateau's exit)."""
    got: dict = {}
    for name, rec in runs.items():
        if rec.get("final") is None:
            continue
        logged = {int(i): v for i, v in rec.get("losses") or []}
        row = got.setdefault(rec.get("mode") or mode_of(name), {it: [] for it in iters})
        for it in iters:
            if it in logged:
                row[it].append(logged[it])
    return {mode: {it: (statistics.median(xs), len(xs)) if xs else (None, 0)
                   for it, xs in row.items()} for mode, row in got.items()}


def summary_lines(summ: dict, ref_mode: str = "fp32-master") -> list:
    lines = [] if ref_mode in summ or not summ else \
        [f"note: no finished run of {ref_mode} (--ref): no differences below"]
    for mode, row in summ.items():
        sd = f"sd {row['sd']:.4f}" if row["sd"] is not None else "sd -"
        diff = ""
        if "minus_ref" in row:
            se = row["se"]
            diff = (f"; - {row['ref']} {row['minus_ref']:+.4f}"
                    + (f" +- {se:.4f} (standard error)" if se is not None else
                       " (no standard error: a mode with one run)"))
            ci = row.get("median_ci95")
            if ci is not None:
                diff += (f"; median - {row['ref']}'s {row['median_minus_ref']:+.4f}, "
                         f"95% {ci[0]:+.4f} to {ci[1]:+.4f} (bootstrap)")
        lines.append(f"{mode:>16} n {row['n']} mean final {row['mean']:.4f} {sd} median "
                     f"{row['median']:.4f} range {min(row['finals']):.4f}-"
                     f"{max(row['finals']):.4f}{diff}")
    return lines


def base_and_tag(mode: str) -> tuple:
    """A mode (no #N) -> (the MODES key it runs, its --variant tag or None)."""
    base, _, tag = mode.partition("@")
    return base, tag or None


def parse_variants(specs: list) -> dict:
    """--variant TAG:KEY=VALUE flags -> {TAG: {KEY: VALUE, ...}}."""
    out: dict = {}
    for spec in specs:
        tag, _, kv = spec.partition(":")
        key, eq, value = kv.partition("=")
        if not (MODE.fullmatch(tag) and "@" not in tag and key and eq):
            raise SystemExit(f"error: --variant takes TAG:KEY=VALUE (TAG lower-case letters, "
                             f"digits and dashes), got {spec!r}")
        out.setdefault(tag, {})[key] = value
    return out


def run_names(modes: list, repeat: int) -> list:
    """Every mode `repeat` times, interleaved, so that a run cut short by the budget leaves the
    modes with about equal counts: a, b, a#2, b#2, ... A name the caller already wrote with
    #N keeps it; a name twice is refused (two runs would share one log file)."""
    names = [m if r == 1 else f"{m}#{r}" for r in range(1, repeat + 1) for m in modes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SystemExit(f"error: run name(s) {', '.join(dup)} twice; with --repeat write each "
                         "mode once")
    return names


def merge(paths: list, untag: bool = False) -> dict:
    """The runs of several JSON files of this script, keyed FILESTEM/NAME, each with its mode;
    finished runs only count in the summary. untag: MODE@TAG counts as MODE (variants that
    change only a kernel's route, the same arithmetic, pooled)."""
    runs = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for name, rec in data["runs"].items():
            mode = rec.get("mode") or mode_of(name)
            runs[f"{Path(path).stem}/{name}"] = dict(rec, mode=mode.split("@")[0] if untag
                                                     else mode)
    return runs


def parse_run(name: str, rc: int, out: str, err: str, wall_s: float, gpu: str) -> dict:
    losses = [(int(m[0]), float(m[1])) for m in LINE.findall(out)]
    valid = [(int(m[0]), float(m[1])) for m in VALID.findall(out)]
    iter_ms = [float(x) for x in ITER_MS.findall(out)]
    last = [v for _, v in losses[-3:]]
    return dict(mode=mode_of(name), rc=rc, losses=losses, valid=valid,
                final=sum(last) / len(last) if last and rc == 0 else None,
                wall_s=round(wall_s, 1), gpu=gpu,
                ms_per_iter=round(statistics.median(iter_ms[1:] or iter_ms), 1) if iter_ms else None,
                forge_line=next((ln for ln in out.splitlines() if ln.startswith("FORGE:")), ""),
                # pretrain.py says why it stopped in its log (a non-finite norm) or on stderr
                tail=("\n".join(ln for ln in out.splitlines() if ln.startswith("error:"))
                      + "\n" + err[-1500:]).strip() if rc else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--per-gpu", type=int, default=1,
                    help="runs at a time on one GPU (a 0.6B model leaves an H200 room)")
    ap.add_argument("--repeat", type=int, default=1, help="run every mode this many times")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no run that would not end this many seconds after the start, "
                         "and stop the runs still going then (their logged losses are kept; "
                         "0: no limit)")
    ap.add_argument("--modes", default="fp32-master,forge-bf16,forge-int8,bf16-plain")
    ap.add_argument("--merge", default="",
                    help="comma-separated JSON files of earlier calls: pool their runs into "
                         "--out and print the summary (nothing is run)")
    ap.add_argument("--at", default="", metavar="ITERS",
                    help="with --merge: also the median logged loss of each mode at these "
                         "iterations (comma-separated, multiples of the log interval, 10)")
    ap.add_argument("--ref", default="fp32-master", metavar="MODE",
                    help="the mode the summary's differences are taken against")
    ap.add_argument("--untag", action="store_true",
                    help="with --merge: pool MODE@TAG with MODE (route variants, same math)")
    ap.add_argument("--variant", action="append", default=[], metavar="TAG:KEY=VALUE",
                    help="environment of the modes written MODE@TAG (repeat for more keys), "
                         "e.g. --variant ws0:FORGE_WS=0 --modes forge-bf16,forge-bf16@ws0")
    ap.add_argument("--out", default="convergence.json")
    a = ap.parse_args()
    try:
        at = [int(x) for x in a.at.split(",")] if a.at else []
    except ValueError:
        raise SystemExit(f"error: --at takes comma-separated iterations, got {a.at!r}")
    if at and not a.merge:
        raise SystemExit("error: --at goes with --merge")
    if a.merge:
        runs = merge(a.merge.split(","), a.untag)
        res = {"merged": a.merge.split(","), "runs": runs, "summary": summary(runs, a.ref)}
        print("\n".join(summary_lines(res["summary"], a.ref)))
        if at:
            res["losses_at"] = losses_at(runs, at)
            for mode, row in res["losses_at"].items():
                print(f"{mode:>16} median logged loss " + ", ".join(
                    f"at {it}: {m:.4f} (n {n})" if n else f"at {it}: - (n 0)"
                    for it, (m, n) in row.items()))
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")
        return
    modes = a.modes.split(",")
    bad = [m for m in modes if base_and_tag(m.split("#")[0])[0] not in MODES]
    if bad:
        raise SystemExit(f"error: unknown mode(s) {', '.join(bad)}; valid: {', '.join(MODES)}")
    variants = parse_variants(a.variant)
    tags = {base_and_tag(m.split("#")[0])[1] for m in modes} - {None}
    if tags - set(variants):
        raise SystemExit(f"error: mode(s) with @{', @'.join(sorted(tags - set(variants)))} "
                         f"but no --variant TAG:KEY=VALUE for it")
    for flag in ("gpus", "per_gpu", "repeat"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be at least 1")
    names = run_names(modes, a.repeat)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(a.gpus)]
    if len(gpus) < a.gpus:
        raise SystemExit(f"error: --gpus {a.gpus} but CUDA_VISIBLE_DEVICES={visible} lists "
                         f"{len(gpus)}")
    gpus = gpus[:a.gpus]
    logs = Path(a.out).with_suffix("")
    logs = logs.parent / (logs.name + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
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
    # every run's host threads share the machine's cores
    threads = str(max(1, (os.cpu_count() or 1) // (a.gpus * a.per_gpu)))
    res = {"args": vars(a), "runs": {}, "skipped": []}
    queue, running, took = list(names), {}, {}  # running: name -> (process, GPU, start, stem)

    def write():
        res["summary"] = summary(res["runs"], a.ref)
        with open(a.out, "w") as f:  # after every run: a later failure keeps these
            json.dump(res, f, indent=1)

    def finish(name, cut=""):
        p, gpu, start, stem = running.pop(name)
        wall = time.monotonic() - start
        rec = parse_run(name, p.returncode, (logs / f"{stem}.out").read_text(),
                        (logs / f"{stem}.err").read_text(), wall, gpu)
        if cut:
            rec.update(cut_off=cut, tail="")
        res["runs"][name] = rec
        if rec["rc"] == 0:
            took.setdefault(rec["mode"], []).append(wall)
        print(f"{name:>16} rc {rec['rc']} final {rec['final']} valid {rec['valid']} "
              f"({wall:.0f} s on GPU {gpu}, {rec['ms_per_iter']} ms/iteration; "
              f"{time.monotonic() - t0:.0f} s since start){'; ' + cut if cut else ''}",
              flush=True)
        if rec["tail"]:
            print(rec["tail"], flush=True)
        write()

    def stop_all(why):
        """Runs cut short keep what they logged (no final): a caller's time limit or Ctrl-C
        loses nothing already measured."""
        for p, *_ in running.values():
            p.terminate()
        for name, (p, *_) in list(running.items()):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            finish(name, why)

    try:
        while queue or running:
            busy = [g for _, g, _, _ in running.values()]
            free = [g for g in gpus for _ in range(a.per_gpu - busy.count(g))]
            while queue and free:
                name = queue.pop(0)
                mode = mode_of(name)
                now = time.monotonic() - t0
                if a.budget_s and (now >= a.budget_s or took.get(mode)
                                   and now + max(took[mode]) > a.budget_s):
                    res["skipped"].append(name)
                    why = (f" + its mode's {max(took[mode]):.0f} s would pass"
                           if took.get(mode) else " is past")
                    print(f"{name:>16} not started: {now:.0f} s{why} --budget-s "
                          f"{a.budget_s:.0f}", flush=True)
                    continue
                gpu = free.pop(0)
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, PYTHONUNBUFFERED="1",
                           OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
                base, tag = base_and_tag(mode)
                env.update(variants.get(tag, {}))
                stem = name.replace("#", "_")  # (a plain file name: '#' travels badly)
                out, err = open(logs / f"{stem}.out", "w"), open(logs / f"{stem}.err", "w")
                p = subprocess.Popen([sys.executable, "pretrain.py", *common,
                                      *MODES[base]], env=env, stdout=out, stderr=err)
                out.close(), err.close()
                running[name] = (p, gpu, time.monotonic(), stem)
            time.sleep(1.0)
            for name, (p, *_) in list(running.items()):
                if p.poll() is not None:
                    finish(name)
            if a.budget_s and running and time.monotonic() - t0 > a.budget_s:
                stop_all(f"stopped at --budget-s {a.budget_s:.0f}")
    except KeyboardInterrupt:
        stop_all("stopped by an interrupt")
        raise SystemExit(f"interrupted: the finished runs, and the logged losses of those "
                         f"stopped, are in {a.out}")
    write()
    print("\n".join(summary_lines(res["summary"], a.ref)))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""The measurements behind tests/closeness.py's K: the tests that train one loop with FORGE and
with torch.optim, run over many seeds, each reporting the K its weights needed.

    python3 benchmarks/closeness_sweep.py --seeds 0:2000 --budget 300 accelerate trainer ...
    python3 benchmarks/closeness_sweep.py --list
    python3 benchmarks/closeness_sweep.py --seeds 0:100 "defect:beta1 0.89"

Each case calls one test function of tests/ with its data generators seeded (os.urandom, which
the tests seed their generators from, returns the seed; torch's global generator is seeded
too), and replaces assert_fp32_close by a recorder. Per run and over the tensors, three
numbers, each the smallest K with which the rule of tests/closeness.py would pass:
  both      FORGE against the larger error of torch's two fp32 runs (the rule as tested)
  alone     FORGE against torch's run in the given order alone
  reversed  torch's reversed-rows run against torch's run alone: what fp32 rounding gives a
            second run of torch's own, on the same footing as `alone`
Cases defect:... run tests/test_closeness.py's loop with one of its defects: there `both` is
what the defective torch run needs in FORGE's place (closeness-loop: FORGE's run of that
loop). Per case, one line: seeds run, the largest of each, the smallest `both`, and how many
runs needed more than 2, 3.5 and 8. --csv writes every run's numbers. CPU only
(the torch backend: the tests' own default on a machine without a GPU).
"""
import argparse
import contextlib
import csv
import io
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
import torch  # noqa: E402
from closeness import FLOOR, RTOL  # noqa: E402
from test_closeness import DEFECTS  # noqa: E402
from test_optim_parity import CONFIGS as PARITY_CONFIGS  # noqa: E402

CASES = {  # name -> (test module, function name, arguments)
    "compile": ("test_compile", "test_compiled_model_trains_like_torch_optim", ("auto", 0.5)),
    "compile-llama": ("test_compile",
                      "test_compiled_llama_has_no_graph_break_and_trains_like_torch_optim", ()),
    "scaler": ("test_drop_in", "test_grad_scaler_trains_like_torch_and_skips_a_nonfinite_step",
               ("AdamW", "auto", None)),
    "clip": ("test_drop_in", "test_clip_grad_norm_on_model_parameters_clips_the_fused_weights",
             (None,)),
    "accum-sgd": ("test_drop_in", "test_accumulation_with_clipping_like_torch", ()),
    "zero-grad": ("test_drop_in",
                  "test_zero_grad_between_backward_passes_drops_the_first_as_torch_does",
                  ("model",)),
    "encoder": ("test_drop_in",
                "test_transformer_encoder_fuses_every_matrix_and_trains_like_torch", (True,)),
    "trainer": ("test_drop_in", "test_hf_trainer_with_its_defaults_trains_like_torch_adamw",
                (2, False, "tmp")),
    "accelerate": ("test_drop_in",
                   "test_accelerate_loop_with_clipping_and_accumulation_like_torch", ()),
    "segments-clip": ("test_segments", "test_accumulation_and_clipping_match_torch",
                      ("AdamW", dict(lr=1e-2, weight_decay=0.1), 0.05, None, "cpu")),
    "segments-twice": ("test_segments",
                       "test_module_applied_twice_is_exact_with_deferred_updates",
                       (None, "cpu")),
}
CASES.update({f"parity:{n}-{i}": ("test_optim_parity", "test_matches_torch_optim",
                                  (n, kw, None, "cpu"))  # its ids, for CONFIGS' entries
              for i, (n, kw) in enumerate(PARITY_CONFIGS)})

CASES.update({f"defect:{d}": ("test_closeness", "runs", (d,)) for d in DEFECTS})
CASES["closeness-loop"] = ("test_closeness", "runs", (None,))  # FORGE's run in that loop

RUNS = []  # per assert_fp32_close call: (both, alone, reversed)


def _needed(a, c, err):
    """The smallest K with |a - c| <= K * err + FLOOR + RTOL |c| everywhere (0 if none
    needed)."""
    slack = float(((a - c).abs() - FLOOR - RTOL * c.abs()).max())
    return max(0.0, slack / max(err, 1e-30))


def record(ours, ref, ref64, also=()):
    both = alone = rev = 0.0
    for a, c, b, *more in zip(ours.parameters(), ref64.parameters(), ref.parameters(),
                              *(m.parameters() for m in also)):
        a, c, b = a.detach().double(), c.detach().double(), b.detach().double()
        e_ref = float((b - c).abs().max())
        errs = [e_ref] + [float((m.detach().double() - c).abs().max()) for m in more]
        both = max(both, _needed(a, c, max(errs)))
        alone = max(alone, _needed(a, c, e_ref))
        if more:  # the reversed-rows run comes first in every test's `also`
            rev = max(rev, _needed(more[0].detach().double(), c, e_ref))
    RUNS.append((both, alone, rev))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--seeds", default="0:2000", help="first:end")
    ap.add_argument("--budget", type=float, default=600, help="seconds per case at most")
    ap.add_argument("--csv", help="every run's numbers")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list or not args.cases:
        print("\n".join(CASES))
        return 0
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        raise SystemExit(f"error: unknown case(s) {', '.join(unknown)}; --list names them")
    try:
        first, end = map(int, args.seeds.split(":"))
    except ValueError:
        raise SystemExit(f"error: --seeds {args.seeds!r}: want first:end, e.g. 0:2000") from None
    if not 0 <= first < end <= 1 << 16:
        raise SystemExit("error: --seeds first:end with 0 <= first < end <= 65536")
    import transformers
    backend, verbosity = os.environ.get("FORGE_BACKEND"), transformers.logging.get_verbosity()
    urandom, patched = os.urandom, []
    os.environ["FORGE_BACKEND"] = "torch"
    transformers.logging.set_verbosity_error()
    try:  # torch's global generator, seeded per run, is restored too
        with torch.random.fork_rng(devices=[]):
            rows = sweep(args.cases, first, end, args.budget, patched)
    finally:  # a caller in this process (the bench-tools test) gets all of it back
        os.urandom = urandom
        for mod, fn in patched:
            mod.assert_fp32_close = fn
        transformers.logging.set_verbosity(verbosity)
        if backend is None:
            os.environ.pop("FORGE_BACKEND", None)
        else:
            os.environ["FORGE_BACKEND"] = backend
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["case", "seed", "both", "alone", "reversed"])
            w.writerows(rows)
    return 0


def sweep(cases, first, end, budget, patched) -> list:
    import importlib
    rows = []
    for name in cases:
        mod_name, fn_name, fn_args = CASES[name]
        mod = importlib.import_module(mod_name)
        if mod.assert_fp32_close is not record:
            patched.append((mod, mod.assert_fp32_close))
            mod.assert_fp32_close = record
        fn = getattr(mod, fn_name)
        per_seed, t0 = [], time.time()
        for seed in range(first, end):
            if time.time() - t0 > budget:
                break
            os.urandom = lambda n, s=seed: s.to_bytes(n, "little")
            torch.manual_seed(seed)
            if name.startswith("compile"):
                torch._dynamo.reset()
            n0 = len(RUNS)
            tmp = tempfile.TemporaryDirectory()
            call = [pathlib.Path(tmp.name) if a == "tmp" else a for a in fn_args]
            with tmp, contextlib.redirect_stdout(io.StringIO()):  # Trainer prints its logs
                if fn_name == "runs":  # torch's run with a defect in FORGE's place, or FORGE's
                    defect = call[0]
                    r = fn(mod.DEFECTS[defect] if defect else lambda kw, clip: (kw, clip))
                    record(r["defect" if defect else "forge"], r["ref"], r["ref64"],
                           also=[r["ref_r"]])
                else:
                    fn(*call)
            got = [max(r[i] for r in RUNS[n0:]) for i in range(3)]
            per_seed.append(got)
            rows.append([name, seed, *(f"{v:.4g}" for v in got)])
        n = len(per_seed)
        big = [max(r[i] for r in per_seed) for i in range(3)]
        over = {k: sum(r[0] > k for r in per_seed) for k in (2, 3.5, 8)}
        print(f"{name}: seeds {first}..{first + n - 1} ({n} runs, {time.time() - t0:.0f} s); "
              f"largest K needed: both {big[0]:.2f}, alone {big[1]:.2f}, reversed {big[2]:.2f}; "
              f"smallest both {min(r[0] for r in per_seed):.2f}; "
              f"runs needing K > 2: {over[2]}, > 3.5: {over[3.5]}, > 8: {over[8]}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())

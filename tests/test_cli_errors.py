"""pretrain.py's bad inputs and resume idioms (issue 36's classes) and its RNG restore.

Most checks call pretrain.main() in this process (a fraction of a second each); one subprocess
per class holds the contract as a user meets it: the exit code, one line on stderr naming the
cause, no traceback, and no checkpoint lost or changed."""
import hashlib
import logging
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from forge_engine import checkpoint as ckpt
from test_pretrain import ROOT, TINY, env, losses

SHORT = [*TINY, "--train-iters", "2"]




def one_line(err: str, rc: int, got: int, *needles):
    assert got == rc, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def digest(root) -> dict:
    """Every file under root and its content hash: a checkpoint directory, unchanged or not."""
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def subprocess_pretrain(args, wrapper: str = ""):
    """pretrain.py as a user starts it; `wrapper`: Python run first in the same process (a
    patched writer, a kill), then pretrain.py as __main__."""
    code = (wrapper + "\nimport runpy, sys\nsys.argv[0] = 'pretrain.py'\n"
            "runpy.run_path('pretrain.py', run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------ 1. work lost late

def test_unwritable_save_and_tensorboard_dirs_are_found_at_start(run, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for flag, path, why in (("--save", afile, "exists and is not a directory"),
                            ("--save", afile / "sub", "Not a directory"),
                            ("--tensorboard-dir", afile / "tb", "Not a directory"),
                            ("--tensorboard-dir", "/proc/no_such_dir", "cannot write there")):
        rc, out, err = run(*SHORT, flag, path)
        one_line(err, 2, rc, f"{flag} {path}", why)
        assert " iteration " not in out  # refused before training
    ok = tmp_path / "new" / "ck"
    rc, _, err = run(*SHORT, "--save", ok, "--save-interval", "0")  # 0: only at the end
    assert rc == 0, err
    assert sorted(os.listdir(ok)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


FULL_DISK = """
import errno, os, torch
real, calls = torch.save, []
def save(obj, f, *a, **k):
    calls.append(1)
    if len(calls) == 2:
        f.write(b"PK half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
    return real(obj, f, *a, **k)
torch.save = save
"""

KILLED = """
import os, signal, torch
real = torch.save
def save(obj, f, *a, **k):
    f.write(b"PK half a file"); f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = save
"""


def test_full_disk_then_kill_during_save_then_resume(tmp_path):
    """`--save ck --load ck`, launched three times: the first starts from scratch and hits a
    full disk at its second save (one line, exit 1, iteration 2 intact); the second resumes
    from 2 and is killed (-9) inside its save of 4; the third resumes from 2 again and ends
    with the losses the first two logged."""
    ck = tmp_path / "ck"
    args = [*TINY, "--train-iters", "4", "--save-interval", "2", "--save", ck, "--load", ck]
    a = subprocess_pretrain(args, FULL_DISK)
    assert "no checkpoint in" in a.stdout and "starting from scratch" in a.stdout
    line = one_line(a.stderr, 1, a.returncode, f"cannot save the checkpoint of iteration 4 to "
                    f"{ck}: No space left on device ({ck}/iter_0000004/mp_rank_00/.tmp-",
                    "the checkpoint of iteration 2 there is intact")
    assert line
    assert ckpt.latest_iteration(str(ck)) == 2
    assert not [n for _, _, fs in os.walk(ck) for n in fs if n.startswith(".tmp-")]
    before = digest(ck / "iter_0000002")

    b = subprocess_pretrain(args, KILLED)
    assert b.returncode == -9, b.stderr[-2000:]
    assert "loaded checkpoint from" in b.stdout and "at iteration 2: model, optimizer" in b.stdout
    assert ckpt.latest_iteration(str(ck)) == 2 and digest(ck / "iter_0000002") == before

    c = subprocess_pretrain(args)
    assert c.returncode == 0, c.stderr[-2000:]
    assert "at iteration 2: model, optimizer, data position (8 samples), RNG" in c.stdout
    la, lc = losses(a.stdout), losses(c.stdout)
    assert sorted(lc) == [3, 4] and all(la[i] == lc[i] for i in (3, 4))
    assert ckpt.latest_iteration(str(ck)) == 4
    assert not [n for _, _, fs in os.walk(ck) for n in fs if n.startswith(".tmp-")]


# ---------------------------------------------------- 2 and 3. resume idioms, misfits

@pytest.fixture(scope="module")
def saved(tmp_path_factory, pretrain_module):
    """A checkpoint directory of the tiny model at iterations 2 and 4 (adamw, fp32)."""
    root = tmp_path_factory.mktemp("saved") / "ck"
    saved_env = dict(os.environ)
    os.environ["FORGE_BACKEND"] = "torch"
    try:
        rc = pretrain_module.main([*TINY, "--train-iters", "4", "--save-interval", "2",
                                   "--save", str(root)])
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    assert rc == 0
    return root


def test_resume_idioms_say_what_was_loaded(run, saved, tmp_path):
    ref = digest(saved)
    rc, out, err = run(*TINY, "--train-iters", "3", "--load", saved, "--ckpt-step", 2)
    assert rc == 0 and "loaded checkpoint from" in out, err
    assert "at iteration 2: model, optimizer, data position (8 samples), RNG" in out
    assert sorted(losses(out)) == [3]
    rc, out, err = run(*TINY, "--train-iters", "5", "--load", saved, "--no-load-optim",
                       "--no-load-rng", "--optimizer", "sgd")  # another optimizer: fresh
    assert rc == 0, err
    assert ("at iteration 4: model, a fresh optimizer (--no-load-optim), data position "
            "(16 samples), RNG not restored (--no-load-rng)") in out
    rc, out, err = run(*TINY, "--train-iters", "2", "--load", saved, "--finetune", "--bf16",
                       "--optimizer", "lion", "--save", tmp_path / "ft")
    assert rc == 0, err
    assert "loaded the model weights of iteration 4" in out and "(--finetune)" in out
    assert sorted(losses(out)) == [1, 2] and ckpt.latest_iteration(str(tmp_path / "ft")) == 2
    rc, out, err = run(*TINY, "--train-iters", "4", "--load", saved, "--save", saved)
    assert rc == 0 and "nothing to train: the run is at iteration 4" in out, err
    assert digest(saved) == ref  # nothing trained: the loaded checkpoint is not re-saved
    # a first launch that is not `--save ck --load ck`: a typo must not train from scratch
    rc, _, err = run(*SHORT, "--load", tmp_path / "typo")
    one_line(err, 2, rc, f"--load {tmp_path / 'typo'}: no such directory")
    (tmp_path / "empty").mkdir()
    rc, _, err = run(*SHORT, "--load", tmp_path / "empty")
    one_line(err, 2, rc, "no checkpoint tracker", "--ckpt-step")
    for flag in ("--finetune", "--no-load-optim", "--no-load-rng"):
        rc, _, err = run(*SHORT, flag)
        one_line(err, 2, rc, f"{flag} needs --load DIR")


def test_checkpoints_that_do_not_fit_are_one_line_naming_the_file(run, saved, tmp_path):
    ref = digest(saved)
    f4 = ckpt.checkpoint_path(str(saved), 4, 0)
    cases = [
        (["--hidden-size", "32"], f"--load {f4}: tensor embedding.weight has shape [512, 64] "
                                  f"in the checkpoint, [512, 32] in this model; the checkpoint "
                                  f"was saved with --hidden-size default (this run: 32)"),
        (["--num-layers", "3"], "holds no tensor layers.2."),
        (["--optimizer", "sgd"], "trained with --optimizer 'adamw', this run asks for 'sgd'"),
        (["--bf16"], "trained with --bf16 False, this run asks for True"),
        (["--ckpt-step", "3"], f"--ckpt-step 3 was asked for, but {saved}/iter_0000003 does "
                               f"not exist (iterations in {saved}: 2, 4)"),
    ]
    for extra, needle in cases:
        rc, out, err = run(*SHORT, "--load", saved, *extra)
        one_line(err, 2, rc, needle)
        assert " iteration " not in out
    assert digest(saved) == ref

    bad = tmp_path / "bad"  # copies, damaged one way at a time
    import shutil
    for damage, needle in (
            ("tracker", "names iteration 9, but"),
            ("tracker-garbage", "holds '"),
            ("truncate", "it is truncated or corrupt"),
            ("garbage", "it is truncated or corrupt"),
            ("tp2", "saved with tensor-parallel size 2, this run uses 1"),
            ("no-tracker", "no latest_checkpointed_iteration.txt, but iteration(s) 2, 4 hold")):
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(saved, bad)
        f = ckpt.checkpoint_path(str(bad), 4, 0)
        tracker = bad / "latest_checkpointed_iteration.txt"
        if damage == "tracker":
            tracker.write_text("9")
        elif damage == "tracker-garbage":
            tracker.write_bytes(b"\xff\xfe\x00")
        elif damage == "truncate":
            data = open(f, "rb").read()
            open(f, "wb").write(data[:len(data) // 3])
        elif damage == "garbage":
            open(f, "wb").write(os.urandom(4096))
        elif damage == "tp2":
            for r in (1, 0):
                ckpt.save_checkpoint(str(bad), 4, {"model": {}}, tp_rank=r, tp_size=2)
        else:
            tracker.unlink()
        rc, _, err = run(*SHORT, "--load", bad, "--save", bad)
        line = one_line(err, 2, rc, needle)
        if damage in ("truncate", "garbage"):
            assert f in line


def test_bad_checkpoint_is_one_line_in_a_subprocess(saved, tmp_path):
    """The contract as a user meets it: a truncated model_optim_rng.pt."""
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    f = ckpt.checkpoint_path(str(bad), 4, 0)
    data = open(f, "rb").read()
    open(f, "wb").write(data[:1000])
    ref = digest(bad)
    p = subprocess_pretrain([*SHORT, "--load", bad, "--save", bad])
    one_line(p.stderr, 2, p.returncode, f"cannot read checkpoint file {f} (")
    assert digest(bad) == ref and " iteration " not in p.stdout


# ------------------------------------------------------------- 4. data that does not fit

def test_data_of_another_tokenizer_is_refused_in_a_subprocess(tmp_path):
    from forge_engine.data import preprocess
    from forge_engine.tokenizer import NullTokenizer
    src = tmp_path / "d.jsonl"
    src.write_text("".join('{"text": "%s"}\n' % " ".join(str((50 * d + t) % 1000)
                                                           for t in range(200))
                           for d in range(20)))  # ids up to 999
    (prefix,) = preprocess(str(src), ["text"], str(tmp_path / "d"), NullTokenizer(1000))
    p = subprocess_pretrain(["--data-path", prefix, "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "512", "--seq-length", "32", "--train-iters", "2"])
    one_line(p.stderr, 2, p.returncode, f"--data-path {prefix}: {prefix}.bin holds token id",
             "outside the tokenizer's vocabulary [0, 512)")
    assert " iteration " not in p.stdout


# ------------------------------------------------------- 5 and 6. combinations, precision

def test_megatron_combinations_run(run, tmp_path):
    from forge_engine.data import preprocess
    from forge_engine.tokenizer import NullTokenizer
    src = tmp_path / "d.jsonl"
    src.write_text("".join('{"text": "%s"}\n' % " ".join(str((d + t) % 500) for t in range(100))
                           for d in range(10)))
    (prefix,) = preprocess(str(src), ["text"], str(tmp_path / "d"), NullTokenizer(512))
    data = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
            "--log-interval", "1"]
    rc, out, err = run(*data, "--split", "100,0,0", "--eval-iters", "0")
    assert rc == 0 and sorted(losses(out)) == [1, 2], err
    rc, out, err = run(*data, "--split", "100,0,0", "--eval-interval", "1")  # as Megatron
    assert rc == 0 and "no validation: the valid split of --split 100,0,0 is empty" in out, err
    rc, out, err = run(*SHORT, "--eval-interval", "0", "--exit-interval", "0")
    assert rc == 0 and "validation loss" not in out, err


def test_fp16_is_refused_with_the_reason(run):
    rc, _, err = run(*SHORT, "--fp16")
    one_line(err, 2, rc, "--fp16 is not supported", "use --bf16")
    p = subprocess_pretrain([*SHORT, "--fp16"])
    one_line(p.stderr, 2, p.returncode, "--fp16 is not supported")


# ------------------------------------------------------------------ resume restores the RNG

def rng_of(path):
    return torch.load(path, weights_only=False)["rng"]


def assert_rng_equal(a, b, names):
    for name in names:
        x, y = a[name], b[name]
        same = torch.equal(x, y) if torch.is_tensor(x) else (
            all(torch.equal(s, t) for s, t in zip(x, y)) if name == "cuda" else
            str(x) == str(y))
        assert same, f"the {name} generator was not restored"


def test_resume_restores_every_rng(run, saved, tmp_path, monkeypatch):
    """A run resumed from iteration 2 of `saved` must hold, at iteration 4, the RNG states of
    the run that went straight to 4, every generator alike, although just before the load
    each generator is advanced (as a fresh process's would differ); with --no-load-rng they
    differ, so the comparison sees a generator that is not restored."""
    names = ["random", "numpy", "torch"] + (["cuda"] if torch.cuda.is_available() else [])
    real = ckpt.load_checkpoint

    def load_after_draws(*a, **k):
        random.random(), np.random.rand(), torch.rand(1)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(987)
        return real(*a, **k)
    monkeypatch.setattr(ckpt, "load_checkpoint", load_after_draws)
    want = rng_of(ckpt.checkpoint_path(str(saved), 4, 0))
    for flags, restored in (([], True), (["--no-load-rng"], False)):
        out_dir = tmp_path / ("r" if restored else "n")
        rc, out, err = run(*TINY, "--train-iters", "4", "--load", saved, "--ckpt-step", "2",
                           "--save", out_dir, *flags)
        assert rc == 0, err
        got = rng_of(ckpt.checkpoint_path(str(out_dir), 4, 0))
        if restored:
            assert_rng_equal(got, want, names)
        else:
            for name in names:
                with pytest.raises(AssertionError):
                    assert_rng_equal(got, want, [name])


def test_main_leaves_no_handler_on_the_library_logger(run):
    """main() shows forge_engine's log on the sys.stdout of its run and detaches that handler
    when it returns: a later log line (a caller's own training) never writes to that stream,
    which may be closed by then."""
    before = list(logging.getLogger("forge_engine").handlers)
    rc, _, err = run(*TINY, "--train-iters", "1")
    assert rc == 0, err
    assert logging.getLogger("forge_engine").handlers == before

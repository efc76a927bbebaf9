"""pretrain.py end to end on the CPU: log lines, TP=2 with torchrun, resume, errors, TensorBoard,
a two-node launch on localhost. Every run is a real subprocess, as a user would start it."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from forge_engine.parallel.state import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(
    r" iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| elapsed time per iteration "
    r"\(ms\): ([\d.]+) \| learning rate: ([\d.E+-]+) \| global batch size: +(\d+) \| lm loss: "
    r"([\d.E+-]+) \| grad norm: ([\d.]+) \| peak memory \(GiB\): ([\d.]+) \| tokens/s: (\d+) \|")
VALID = re.compile(r" validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+) \| "
                   r"lm loss PPL: ([\d.E+-]+) \|")
TINY = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--micro-batch-size", "4",
        "--lr", "3e-3", "--log-interval", "1", "--eval-interval", "1000"]


def env():
    e = dict(os.environ, FORGE_BACKEND="torch", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    e.pop("TRITON_INTERPRET", None)
    return e


def pretrain(args, nproc=1, timeout=300):
    if nproc == 1:
        cmd = [sys.executable, "pretrain.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "pretrain.py", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=timeout)
    return p


def losses(out):
    return {int(m.group(1)): m.group(7) for m in LINE.finditer(out)}


def test_tp1_log_lines_and_forge_line():
    p = pretrain([*TINY, "--train-iters", "24", "--lr-warmup-iters", "2", "--eval-interval",
                  "12", "--eval-iters", "2", "--lr", "1e-2", "--micro-batch-size", "8"])
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert re.search(r"^FORGE: fused 9 of 9 weight matrices \(\d+ of \d+ parameters\); "
                     r"standard path: none$", out, re.M), out[:2000]
    rows = [m.groups() for m in LINE.finditer(out)]
    assert [int(r[0]) for r in rows] == list(range(1, 25))
    assert all(int(r[1]) == 24 and int(r[5]) == 8 for r in rows)
    assert [int(r[2]) for r in rows] == [8 * i for i in range(1, 25)]
    lrs = [float(r[4]) for r in rows]  # Megatron: warmup from 0, then cosine to --min-lr 0
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(5e-3) and lrs[2] == pytest.approx(1e-2)
    assert lrs[-1] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 21 / 22)), rel=1e-5)
    ls = [float(r[6]) for r in rows]
    assert ls[0] == pytest.approx(math.log(512), abs=0.1)  # uniform at init
    # the mock data is a 4-successor Markov chain: learnable (measured: about -0.4 by step 24)
    assert sum(ls[-3:]) / 3 < ls[0] - 0.2, ls
    vals = [(int(m.group(1)), float(m.group(2))) for m in VALID.finditer(out)]
    assert [v[0] for v in vals] == [12, 24]


def test_tp2_sequence_parallel_with_torchrun():
    p = pretrain([*TINY, "--train-iters", "4", "--tensor-parallel", "2", "--sequence-parallel"],
                 nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(LINE.findall(p.stdout)) == 4  # one rank prints
    assert "TP 2 + SP" in p.stdout


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """8 iterations straight vs 4, stop (--exit-interval), --load, 4 more: identical losses and
    identical final weights (bitwise on the CPU): bf16 weights, int8 states, SR included."""
    common = [*TINY, "--train-iters", "8", "--bf16", "--state-dtype", "int8",
              "--lr-warmup-iters", "2"]
    a = pretrain([*common, "--save", str(tmp_path / "a")])
    assert a.returncode == 0, a.stderr[-3000:]
    b1 = pretrain([*common, "--save", str(tmp_path / "b"), "--exit-interval", "4"])
    assert b1.returncode == 0, b1.stderr[-3000:]
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    b2 = pretrain([*common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert b2.returncode == 0, b2.stderr[-3000:]
    la, lb = losses(a.stdout), {**losses(b1.stdout), **losses(b2.stdout)}
    assert sorted(lb) == list(range(1, 9)) and la == lb
    fa = tmp_path / "a" / "iter_0000008" / "mp_rank_00" / "model_optim_rng.pt"
    fb = tmp_path / "b" / "iter_0000008" / "mp_rank_00" / "model_optim_rng.pt"
    sa, sb = torch.load(fa, weights_only=False), torch.load(fb, weights_only=False)
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    assert torch.equal(sa["optimizer"]["state"][1]["exp_avg"],
                       sb["optimizer"]["state"][1]["exp_avg"])


def test_fp32_master_weights_resume_bit_for_bit(tmp_path):
    """--no-forge --bf16 --main-params-dtype fp32 (the mixed-precision reference of
    benchmarks/convergence.py): 6 iterations straight vs 3, stop, --load, 3 more: identical
    losses, bf16 weights and fp32 master copies. Loading it without the flag is refused."""
    common = [*TINY, "--train-iters", "6", "--bf16", "--no-forge", "--main-params-dtype",
              "fp32", "--lr-warmup-iters", "2"]
    a = pretrain([*common, "--save", str(tmp_path / "a")])
    assert a.returncode == 0, a.stderr[-3000:]
    assert "stepping fp32 master copies of the bf16 weights" in a.stdout
    b1 = pretrain([*common, "--save", str(tmp_path / "b"), "--exit-interval", "3"])
    b2 = pretrain([*common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")])
    assert b1.returncode == 0 and b2.returncode == 0, (b1.stderr[-3000:], b2.stderr[-3000:])
    la, lb = losses(a.stdout), {**losses(b1.stdout), **losses(b2.stdout)}
    assert sorted(lb) == list(range(1, 7)) and la == lb
    sa, sb = (torch.load(tmp_path / d / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt",
                         weights_only=False) for d in ("a", "b"))
    for k, v in sa["model"].items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, sb["model"][k]), k
    ma, mb = sa["optimizer"]["master_params"], sb["optimizer"]["master_params"]
    assert ma and all(m.dtype == torch.float32 for m in ma)
    for m in ma:  # each bf16 weight saved is its fp32 copy rounded to nearest
        assert any(torch.equal(m.bfloat16(), v) for v in sa["model"].values()
                   if v.shape == m.shape)
    assert all(torch.equal(x, y) for x, y in zip(ma, mb))
    c = pretrain([*TINY, "--train-iters", "8", "--bf16", "--no-forge", "--load",
                  str(tmp_path / "a")])
    assert c.returncode == 2 and "trained with --main-params-dtype 'fp32', this run asks for " \
        "None" in c.stderr, c.stderr[-2000:]


def test_tensorboard_events_have_megatron_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    p = pretrain([*TINY, "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                  "--tensorboard-dir", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "lm loss validation",
                "iteration-time", "tokens-per-second", "mem-max-allocated-gigabytes"):
        assert tag in tags, tags
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3, 4]


@pytest.mark.parametrize("args,message", [
    (["--mock-data", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ([], "give exactly one of --data-path PREFIX and --mock-data"),
    (["--mock-data", "--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no such"),
    (["--mock-data", "--optimizer", "adam"], "invalid choice: 'adam'"),
    (["--mock-data", "--tensor-parallel", "3"], "tensor-parallel size"),
    (["--mock-data", "--global-batch-size", "10", "--micro-batch-size", "4"],
     "is not a multiple of --micro-batch-size 4"),
    (["--mock-data", "--clip-grad", "-1"], "--clip-grad must be >= 0"),
    (["--mock-data", "--no-forge", "--state-dtype", "int8"], "is a FORGE option"),
    (["--data-path", "/nonexistent/corpus", "--tokenizer-type", "NullTokenizer",
      "--vocab-size", "512"], "/nonexistent/corpus"),
    (["--mock-data", "--enable-cuda-graph", "--cuda-graph-warmup-steps", "0"],
     "--cuda-graph-warmup-steps must be >= 1"),
    (["--mock-data", "--enable-cuda-graph", "--no-forge", "--optimizer", "sgd"],
     "--enable-cuda-graph with --no-forge supports --optimizer adamw"),
    (["--mock-data", "--enable-cuda-graph", "--global-batch-size", "2"],
     "--enable-cuda-graph needs one micro-batch per step"),
    (["--mock-data", "--bf16", "--main-params-dtype", "fp32"], "FORGE keeps none"),
    (["--mock-data", "--no-forge", "--main-params-dtype", "fp32"], "add --bf16"),
    (["--mock-data", "--no-forge", "--bf16", "--main-params-dtype", "fp16"],
     "invalid choice: 'fp16'"),
])
def test_bad_input_is_one_clear_line(args, message, run):
    """pretrain.main in this process (the subprocess below holds the contract as a user
    meets it): exit code 2, the message on stderr, no traceback, nothing trained."""
    rc, out, err = run(*args, "--train-iters", "2")
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert message in err, err[-2000:]
    assert "Traceback" not in err and "iteration" not in out


def test_bad_flag_in_a_subprocess_is_one_line():
    p = pretrain(["--mock-data", "--optimizer", "adam", "--train-iters", "2"])
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid choice: 'adam'" in lines[0], p.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_cuda_graph_on_cpu_is_one_clear_line():
    p = pretrain(["--mock-data", "--enable-cuda-graph", "--train-iters", "2"])
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "error: --enable-cuda-graph: CUDA graphs need the model on a CUDA device, it is " \
           "on cpu" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mock_data: true\ntrain_iters: 2\nlearning_rate: 0.1\n")
    p = pretrain(["--config", str(cfg)])
    assert p.returncode == 2 and "unknown key 'learning_rate'" in p.stderr, p.stderr[-2000:]
    cfg.write_text("mock_data: true\ntrain_iters: two\n")
    p = pretrain(["--config", str(cfg)])
    assert p.returncode == 2 and "train_iters must be int" in p.stderr, p.stderr[-2000:]


def test_flags_override_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mock_data: true\ntrain_iters: 50\nseq_length: 32\nmicro_batch_size: 2\n"
                   "log_interval: 1\n")
    p = pretrain(["--config", str(cfg), "--train-iters", "2"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(losses(p.stdout)) == [1, 2]


def test_nonfinite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    p = pretrain([*TINY, "--train-iters", "20", "--lr", "1e12", "--optimizer", "sgd",
                  "--save", str(tmp_path), "--save-interval", "1"])
    assert p.returncode == 1, (p.stdout[-2000:], p.stderr[-2000:])
    m = re.search(r"error: non-finite (lm loss|gradient norm) at iteration (\d+)", p.stdout)
    assert m, p.stdout[-2000:]
    bad = int(m.group(2))
    last = int((tmp_path / "latest_checkpointed_iteration.txt").read_text())
    assert last == bad - 1
    from forge_engine.checkpoint import load_checkpoint
    it, state = load_checkpoint(str(tmp_path), tp_rank=0, tp_size=1)
    assert it == last and all(torch.isfinite(v).all() for v in state["model"].values())


def two_nodes(args):
    """`torchrun --nnodes 2` with one process per "node", both on this machine, running
    pretrain.py with args; asserts both succeeded and returns each node's stdout."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "pretrain.py", *args]
        e = env()
        if torch.cuda.device_count() >= 2:  # one GPU per "node", as on real hosts
            e["CUDA_VISIBLE_DEVICES"] = str(node)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return [o[0] for o in outs]


def test_two_node_launch_on_localhost():
    """torchrun --nnodes 2 with one process per "node", both on this machine (gloo): the
    multi-node rendezvous path of docker/README.md."""
    outs = two_nodes([*TINY, "--train-iters", "3", "--tensor-parallel", "2"])
    assert len(LINE.findall(outs[0])) == 3 and LINE.findall(outs[1]) == []


def test_accumulation_and_clipping_with_forge_match_no_forge():
    """--global-batch-size 8 over micro-batches of 4 with --clip-grad 0.5 (active: the norm
    starts near 1.3): FORGE defers its updates over the token segments and must give the
    losses and norms of torch.optim on materialized, accumulated, clipped gradients."""
    args = [*TINY, "--train-iters", "6", "--global-batch-size", "8", "--clip-grad", "0.5"]
    a, b = pretrain(args), pretrain([*args, "--no-forge"])
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    ra, rb = [m.groups() for m in LINE.finditer(a.stdout)], [m.groups() for m in
                                                             LINE.finditer(b.stdout)]
    assert len(ra) == len(rb) == 6 and all(int(r[5]) == 8 for r in ra)
    assert float(ra[0][7]) > 0.5  # clipping was active
    for x, y in zip(ra, rb):
        assert float(x[6]) == pytest.approx(float(y[6]), rel=1e-5)  # lm loss
        assert float(x[7]) == pytest.approx(float(y[7]), rel=1e-3)  # grad norm, 3 decimals


def test_save_interval_without_save_dir_trains_on():
    """--save-interval with no --save (e.g. a config's save: emptied by a flag) saves nothing
    and must not stop the run at the first interval."""
    p = pretrain([*TINY, "--train-iters", "3", "--save-interval", "2", "--save", ""])
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(LINE.findall(p.stdout)) == 3 and "saved checkpoint" not in p.stdout

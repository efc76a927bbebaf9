"""pretrain.py with data parallelism (FORGE-DP) on the CPU: world = TP x DP under torchrun,
checkpoints of the sharded optimizer state, a two-node launch. Real subprocesses, as a user
starts them. Loss tolerance rel 1e-5 as tests/test_pretrain.py (the runs differ by the order of
token-axis sums only); grad norms are printed with 3 decimals."""
import pytest
import torch

from test_pretrain import LINE, TINY, losses, pretrain, two_nodes


def rows(out):
    return [m.groups() for m in LINE.finditer(out)]


def same_run(a, b, n):
    ra, rb = rows(a), rows(b)
    assert len(ra) == len(rb) == n, (a[-2000:], b[-2000:])
    for x, y in zip(ra, rb):
        assert x[2] == y[2] and x[5] == y[5]  # consumed samples, global batch size
        assert float(x[6]) == pytest.approx(float(y[6]), rel=1e-5)  # lm loss
        assert float(x[7]) == pytest.approx(float(y[7]), abs=2e-3)  # grad norm (3 decimals)


def test_dp2_equals_one_process_accumulating_and_ordinary_dp():
    """DP=2 with micro-batch 4 sees the global batch of 8 that one process sees over two
    micro-batches (Megatron's sampler); FORGE-DP, ordinary DP (--no-forge) and single-process
    accumulation give the same losses and gradient norms."""
    args = [*TINY, "--train-iters", "5", "--global-batch-size", "8"]
    dp = pretrain(args, nproc=2)
    ddp = pretrain([*args, "--no-forge"], nproc=2)
    one = pretrain(args)
    for p in (dp, ddp, one):
        assert p.returncode == 0, p.stderr[-3000:]
    assert "TP 1 x DP 2" in dp.stdout and "data-parallel x2" in dp.stdout
    assert "data-parallel bytes received per replica in iteration 1: tokens" in dp.stdout
    assert "gradient all-reduce" in ddp.stdout
    same_run(dp.stdout, ddp.stdout, 5)
    same_run(dp.stdout, one.stdout, 5)


def test_tp2_dp2_matches_no_forge_and_resumes_on_the_same_layout(tmp_path):
    """4 ranks, TP=2 with SP x DP=2: FORGE-DP vs --no-forge; then 4 iterations straight vs 2,
    stop, --load, 2 more: identical losses and bitwise-identical checkpoints (weights and every
    replica's optimizer shard); loading into another DP size is one clear line."""
    common = [*TINY, "--train-iters", "4", "--tensor-parallel", "2", "--sequence-parallel",
              "--lr-warmup-iters", "1"]
    a = pretrain([*common, "--save", str(tmp_path / "a")], nproc=4)
    assert a.returncode == 0, a.stderr[-3000:]
    assert "TP 2 + SP x DP 2" in a.stdout
    nof = pretrain([*common, "--no-forge"], nproc=4)
    assert nof.returncode == 0, nof.stderr[-3000:]
    same_run(a.stdout, nof.stdout, 4)

    b1 = pretrain([*common, "--save", str(tmp_path / "b"), "--exit-interval", "2"], nproc=4)
    assert b1.returncode == 0, b1.stderr[-3000:]
    b2 = pretrain([*common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b")],
                  nproc=4)
    assert b2.returncode == 0, b2.stderr[-3000:]
    la, lb = losses(a.stdout), {**losses(b1.stdout), **losses(b2.stdout)}
    assert sorted(lb) == [1, 2, 3, 4] and la == lb
    for tp in (0, 1):
        for name in ("model_optim_rng.pt", "optim_dp_rank_001.pt"):
            sa, sb = (torch.load(tmp_path / r / "iter_0000004" / f"mp_rank_{tp:02d}" / name,
                                 weights_only=False) for r in ("a", "b"))
            for k, v in sa.get("model", {}).items():
                assert torch.equal(v, sb["model"][k]), (name, k)
            for i, st in sa["optimizer"]["state"].items():
                for k, v in st.items():
                    if torch.is_tensor(v):
                        assert torch.equal(v, sb["optimizer"]["state"][i][k]), (name, i, k)

    c = pretrain([*common, "--load", str(tmp_path / "a")], nproc=2)
    assert c.returncode != 0  # torchrun reports the ranks' exit 2 as its failure
    errs = [ln for ln in c.stderr.splitlines() if ln.startswith("error: ")]
    # each rank says it in one line; torchrun may stop the second rank once the first exits
    assert 1 <= len(errs) <= 2 and all("saved with data-parallel size 2, this run uses 1" in e
                                       for e in errs), c.stderr[-3000:]
    ours = c.stderr.split("ChildFailedError")[0].split("elastic/multiprocessing")[0]
    assert "Traceback" not in ours, c.stderr[-3000:]  # only torchrun's own report has one


def test_two_nodes_data_parallel_on_localhost():
    """torchrun --nnodes 2, one process per "node" on this machine: DP=2 across the nodes."""
    outs = two_nodes([*TINY, "--train-iters", "3"])
    assert len(LINE.findall(outs[0])) == 3 and LINE.findall(outs[1]) == []
    assert "x DP 2" in outs[0]
    ref = pretrain([*TINY, "--train-iters", "3", "--global-batch-size", "8"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    same_run(outs[0], ref.stdout, 3)

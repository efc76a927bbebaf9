"""forge_engine.checkpoint: Megatron-LM layout, bitwise round trips, crash safety, errors, RNG,
and an exact resume of FORGE training (int8 optimizer states) from a checkpoint.

Crash safety is tested two ways: an exception inside the save (the temporary file is removed on
the way out) and a real SIGKILL of a forked process at three points of the save (nothing runs
on the way out; the next save removes what was left). Every comparison is exact: a checkpoint
must restore the same bits, so no tolerance applies.
"""
import multiprocessing
import os
import random
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import forge_engine
from forge_engine import checkpoint as ckpt
from forge_engine.checkpoint import (load_checkpoint, latest_iteration, rng_state,
                                     save_checkpoint, set_rng_state)
from dist import run_ranks

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (NaN payloads and -0.0 included) as integers."""
    return t.contiguous().view(INT_OF_SIZE[t.element_size()])


def assert_same(a, b):
    """Recursive exact equality; tensors by dtype, shape and bits."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def sample_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(5, 7, generator=g)
    f32[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    return {
        "model": {"w_bf16": torch.randn(6, 9, generator=g).bfloat16(), "w_fp32": f32},
        "optimizer": {"exp_avg": torch.randint(-128, 128, (6, 9), dtype=torch.int8,
                                               generator=g),
                      "exp_avg_sq": torch.randint(0, 256, (6, 9), dtype=torch.uint8,
                                                  generator=g),
                      "exp_avg_scale": torch.rand(6, 1, generator=g)},
        "scheduler": {"last_epoch": 17, "lrs": [3e-4, 1e-5]},
        "data": {"consumed_samples": 12345, "shard": ("train", 3)},
        "args": SimpleNamespace(lr=3e-4, name="gpt-tiny", layers=[1, 2], extra=None),
    }


def tracker_text(root):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return f.read()


def temps_under(root):
    return [os.path.join(d, n) for d, dirs, files in os.walk(root)
            for n in dirs + files if n.startswith(".tmp-")]


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------ layout, round trip

def test_round_trip_is_bitwise_and_adds_metadata(tmp_path):
    state = sample_state()
    save_checkpoint(str(tmp_path), 7, state, tp_rank=0, tp_size=1)
    assert "iteration" not in state  # the caller's dict is not modified
    it, loaded = load_checkpoint(str(tmp_path), tp_rank=0, tp_size=1)
    assert it == 7
    assert {k: loaded.pop(k) for k in ckpt.METADATA_KEYS + ckpt.DP_KEYS} == dict(
        iteration=7, tp_size=1, tp_rank=0, checkpoint_version=ckpt.CHECKPOINT_VERSION,
        dp_size=1, dp_rank=0)
    assert_same(loaded, state)


def test_data_parallel_files_completeness_and_size_mismatch(tmp_path):
    """TP 2 x DP 2: data-parallel rank d > 0 writes optim_dp_rank_00d.pt beside rank 0's
    model_optim_rng.pt; an iteration missing one of the four files is incomplete (pruned, never
    kept); another DP size is one clear error."""
    root = str(tmp_path)
    for it in (10, 20):
        for tp in (0, 1):
            for dp in (1, 0):  # replica 0 (which writes the tracker) last
                if (it, tp, dp) == (10, 1, 1):
                    continue  # iteration 10: one replica's shard never written
                save_checkpoint(root, it, {"who": (tp, dp)}, tp_rank=tp, tp_size=2,
                                dp_rank=dp, dp_size=2)
    assert os.path.basename(ckpt.checkpoint_path(root, 20, 1, 1)) == "optim_dp_rank_001.pt"
    assert ckpt._is_complete(root, 20, 2, 2) and not ckpt._is_complete(root, 10, 2, 2)
    it, st = load_checkpoint(root, tp_rank=1, tp_size=2, dp_rank=1, dp_size=2)
    assert it == 20 and st["who"] == (1, 1) and (st["dp_rank"], st["dp_size"]) == (1, 2)
    with pytest.raises(ValueError, match="saved with data-parallel size 2, this run uses 1"):
        load_checkpoint(root, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="saved with data-parallel size 2, this run uses 4"):
        load_checkpoint(root, tp_rank=0, tp_size=2, dp_rank=3, dp_size=4)
    # the same size, one replica's file missing: an incomplete save, not a size mismatch
    with pytest.raises(FileNotFoundError, match="did not complete"):
        load_checkpoint(root, iteration=10, tp_rank=1, tp_size=2, dp_rank=1, dp_size=2)
    save_checkpoint(root, 30, {}, tp_rank=0, tp_size=1, keep_last=1)  # prunes 10 and 20
    assert ckpt._iterations(root) == [30]


def test_layout_paths_and_tracker_content(tmp_path):
    root = str(tmp_path)
    assert latest_iteration(root) is None
    assert latest_iteration(os.path.join(root, "nowhere")) is None
    path = save_checkpoint(root, 100, {"x": 1}, tp_rank=0, tp_size=1)
    assert path == os.path.join(root, "iter_0000100", "mp_rank_00", "model_optim_rng.pt")
    assert tracker_text(root) == "100"
    assert latest_iteration(root) == 100
    assert sorted(os.listdir(root)) == ["iter_0000100", "latest_checkpointed_iteration.txt"]
    assert os.listdir(os.path.dirname(path)) == ["model_optim_rng.pt"]
    path = save_checkpoint(root, 12345678, {"x": 2}, tp_rank=11, tp_size=12)
    assert path == os.path.join(root, "iter_12345678", "mp_rank_11", "model_optim_rng.pt")
    assert tracker_text(root) == "100"  # only rank 0 writes the tracker


def test_old_checkpoints_are_kept_and_any_can_be_loaded(tmp_path):
    root = str(tmp_path)
    for it in (10, 20, 30):
        save_checkpoint(root, it, {"it": it}, tp_rank=0, tp_size=1)
    assert tracker_text(root) == "30"
    for it in (10, 20, 30):
        assert load_checkpoint(root, tp_rank=0, tp_size=1, iteration=it)[1]["it"] == it


def test_keep_last_deletes_older_complete_iterations_after_the_tracker(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, 40, {}, tp_rank=0, tp_size=1)  # from a run that went further
    for it in (10, 20, 30):
        save_checkpoint(root, it, {}, tp_rank=0, tp_size=1, keep_last=2)
    assert sorted(os.listdir(root)) == ["iter_0000020", "iter_0000030", "iter_0000040",
                                        "latest_checkpointed_iteration.txt"]
    assert tracker_text(root) == "30"
    for r in (1, 0):  # 35 complete at tp_size 2; 33 half written (rank 0 killed)
        save_checkpoint(root, 35, {}, tp_rank=r, tp_size=2, barrier=lambda: None)
    save_checkpoint(root, 33, {}, tp_rank=1, tp_size=2)
    save_checkpoint(root, 37, {}, tp_rank=1, tp_size=2)
    save_checkpoint(root, 37, {}, tp_rank=0, tp_size=2, keep_last=2)
    assert sorted(os.listdir(root)) == ["iter_0000035", "iter_0000037", "iter_0000040",
                                        "latest_checkpointed_iteration.txt"]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(root, 50, {}, tp_rank=0, tp_size=1, keep_last=0)


# ------------------------------------------------------------------------------ crash safety

@pytest.mark.parametrize("fail_in", ["torch.save", "os.replace"])
def test_exception_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    root = str(tmp_path)
    save_checkpoint(root, 100, sample_state(0), tp_rank=0, tp_size=1)

    def partial_save(obj, f):
        f.write(b"PK\x03\x04 half a zip archive")
        raise OSError("No space left on device")

    def failing_replace(src, dst):
        raise OSError("Input/output error")

    if fail_in == "torch.save":
        monkeypatch.setattr(torch, "save", partial_save)
    else:
        monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        save_checkpoint(root, 200, sample_state(1), tp_rank=0, tp_size=1)
    monkeypatch.undo()

    assert tracker_text(root) == "100"
    assert not os.path.exists(ckpt.checkpoint_path(root, 200, 0))
    assert temps_under(root) == []  # removed on the way out of the exception
    it, state = load_checkpoint(root, tp_rank=0, tp_size=1)
    assert it == 100 and torch.equal(state["model"]["w_bf16"], sample_state(0)["model"]["w_bf16"])
    save_checkpoint(root, 200, sample_state(1), tp_rank=0, tp_size=1)
    assert load_checkpoint(root, tp_rank=0, tp_size=1)[0] == 200


def _killed_save(root, kill_at):
    """Child process: save iteration 200 and SIGKILL itself at `kill_at`."""
    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    barrier = None
    if kill_at == "writing the rank file":
        def partial_save(obj, f):
            f.write(b"PK\x03\x04 half a zip archive")
            f.flush()
            die()
        torch.save = partial_save
    elif kill_at == "before the tracker":
        barrier = die
    else:  # the tracker's temporary file is written and synced, not yet renamed
        real_replace = os.replace

        def replace(src, dst):
            if dst.endswith("latest_checkpointed_iteration.txt"):
                die()
            real_replace(src, dst)
        os.replace = replace
    save_checkpoint(root, 200, sample_state(1), tp_rank=0, tp_size=1, barrier=barrier)
    os._exit(3)  # not reached


@pytest.mark.parametrize("kill_at", ["writing the rank file", "before the tracker",
                                     "renaming the tracker"])
def test_killed_save_leaves_previous_checkpoint_and_next_save_cleans_up(tmp_path, kill_at):
    root = str(tmp_path)
    save_checkpoint(root, 100, sample_state(0), tp_rank=0, tp_size=1)
    child = multiprocessing.get_context("fork").Process(target=_killed_save,
                                                        args=(root, kill_at))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == -signal.SIGKILL

    assert tracker_text(root) == "100" and latest_iteration(root) == 100
    it, state = load_checkpoint(root, tp_rank=0, tp_size=1)
    assert it == 100
    assert_same(state["model"], sample_state(0)["model"])
    left = temps_under(root)
    if kill_at == "before the tracker":  # the rank file is complete, just not pointed to
        assert left == []
        assert_same(load_checkpoint(root, tp_rank=0, tp_size=1, iteration=200)[1]["model"],
                    sample_state(1)["model"])
    else:
        assert len(left) == 1 and os.path.basename(left[0]).startswith(f".tmp-{child.pid}-")

    save_checkpoint(root, 200, sample_state(1), tp_rank=0, tp_size=1)
    assert temps_under(root) == []
    it, state = load_checkpoint(root, tp_rank=0, tp_size=1)
    assert it == 200
    assert_same(state["model"], sample_state(1)["model"])


def test_tracker_is_written_after_the_barrier_that_follows_every_rank_file(tmp_path):
    root = str(tmp_path)
    save_checkpoint(root, 100, {}, tp_rank=0, tp_size=1)
    seen = []

    def barrier():
        seen.append((os.path.isfile(ckpt.checkpoint_path(root, 200, 0)), tracker_text(root)))

    save_checkpoint(root, 200, {}, tp_rank=0, tp_size=1, barrier=barrier)
    assert seen == [(True, "100"), (True, "200")]


# ------------------------------------------------------------------------------------ errors

def test_missing_paths_give_one_line_errors(tmp_path):
    root = str(tmp_path)
    missing = os.path.join(root, "no_such_dir")
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(missing, tp_rank=0, tp_size=1)
    assert one_line(e) == (f"checkpoint directory {missing} does not exist; pass the directory "
                           f"a previous run saved to, or start without loading")

    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(root, tp_rank=0, tp_size=1)
    assert one_line(e).startswith(
        f"no checkpoint tracker {os.path.join(root, 'latest_checkpointed_iteration.txt')}: ")

    save_checkpoint(root, 100, {}, tp_rank=0, tp_size=2)  # rank 1 never saved
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(root, tp_rank=0, tp_size=1, iteration=300)
    assert one_line(e) == (f"iteration=300 was asked for, but {os.path.join(root, 'iter_0000300')}"
                           f" does not exist (iterations in {root}: 100); pass one of them as "
                           f"iteration=")
    with pytest.raises(FileNotFoundError) as e:
        load_checkpoint(root, tp_rank=1, tp_size=2)
    assert one_line(e).startswith(f"checkpoint file {ckpt.checkpoint_path(root, 100, 1)} does "
                                  f"not exist (iteration 100, tensor-parallel rank 1 of 2)")

    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    with pytest.raises(ValueError) as e:
        load_checkpoint(root, tp_rank=0, tp_size=2)
    assert "latest_checkpointed_iteration.txt holds 'release'" in one_line(e)


@pytest.mark.parametrize("tp_size, tp_rank", [(1, 0), (4, 0), (4, 3)])
def test_tensor_parallel_size_mismatch_is_a_one_line_error(tmp_path, tp_size, tp_rank):
    root = str(tmp_path)
    for r in range(2):
        save_checkpoint(root, 100, {"r": r}, tp_rank=r, tp_size=2)
    with pytest.raises(ValueError) as e:
        load_checkpoint(root, tp_rank=tp_rank, tp_size=tp_size)
    assert one_line(e).startswith(f"checkpoint was saved with tensor-parallel size 2, this run "
                                  f"uses {tp_size}; resharding is not supported (")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file_names_the_file(tmp_path, damage):
    root = str(tmp_path)
    path = save_checkpoint(root, 100, sample_state(), tp_rank=0, tp_size=1)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2] if damage == "truncate" else b"\x00garbage" * 100)
    with pytest.raises(RuntimeError) as e:
        load_checkpoint(root, tp_rank=0, tp_size=1)
    msg = one_line(e)
    assert msg.startswith(f"cannot read checkpoint file {path} (")
    assert msg.endswith("it is truncated or corrupt, load another iteration")


def test_invalid_save_arguments(tmp_path):
    with pytest.raises(ValueError, match="tp_rank=2, tp_size=2"):
        save_checkpoint(str(tmp_path), 1, {}, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="iteration must be an int >= 0"):
        save_checkpoint(str(tmp_path), -1, {}, tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=r"state\['iteration'\] is 5 but this save has "
                                         r"iteration=6"):
        save_checkpoint(str(tmp_path), 6, {"iteration": 5}, tp_rank=0, tp_size=1)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- two TP ranks

def test_two_ranks_in_one_process_each_load_their_own_file(tmp_path):
    root = str(tmp_path)
    states = [sample_state(seed=r) for r in range(2)]
    for r in (1, 0):
        save_checkpoint(root, 50, states[r], tp_rank=r, tp_size=2, barrier=lambda: None)
    assert sorted(os.listdir(os.path.join(root, "iter_0000050"))) == ["mp_rank_00",
                                                                      "mp_rank_01"]
    for r in range(2):
        it, st = load_checkpoint(root, tp_rank=r, tp_size=2)
        assert it == 50 and st["tp_rank"] == r
        assert_same(st["optimizer"], states[r]["optimizer"])


def _save_and_load_on_ranks(rank, world, root):
    if rank == 1:
        time.sleep(0.3)  # rank 0 must wait at the barrier for this file before the tracker
    state = {"shard": torch.full((3,), float(rank)), "rng": rng_state()}
    save_checkpoint(root, 8, state, tp_rank=rank, tp_size=world, barrier=dist.barrier)
    assert all(os.path.isfile(ckpt.checkpoint_path(root, 8, r)) for r in range(world))
    assert tracker_text(root) == "8"  # every rank returns after the tracker is written
    it, st = load_checkpoint(root, tp_rank=rank, tp_size=world)
    return it, st["tp_rank"], st["shard"]


def test_two_ranks_with_gloo(tmp_path):
    out = run_ranks(_save_and_load_on_ranks, 2, str(tmp_path))
    for rank, (it, tp_rank, shard) in enumerate(out):
        assert (it, tp_rank) == (8, rank)
        assert torch.equal(shard, torch.full((3,), float(rank)))


# ----------------------------------------------------------------------------------------- RNG

def draws():
    return torch.rand(4), random.random(), np.random.rand(3)


def test_rng_state_restores_every_generator_through_a_checkpoint(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    draws()
    save_checkpoint(str(tmp_path), 1, {"rng": rng_state()}, tp_rank=0, tp_size=1)
    first = draws()
    draws()
    set_rng_state(load_checkpoint(str(tmp_path), tp_rank=0, tp_size=1)[1]["rng"])
    again = draws()
    assert torch.equal(first[0], again[0])
    assert first[1] == again[1]
    assert np.array_equal(first[2], again[2])


# --------------------------------------------------------------- resume FORGE training exactly

def _train(model, opt, steps):
    """`steps` steps on batches drawn from torch's global RNG (restored by the checkpoint)."""
    losses = []
    for _ in range(steps):
        x, y = torch.randn(6, 10), torch.randn(6, 3)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mlp():
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def test_resume_from_checkpoint_continues_forge_int8_training_exactly(tmp_path):
    root = str(tmp_path)
    torch.manual_seed(0)
    model = _mlp()
    opt = forge_engine.optim.AdamW(model, lr=1e-2, state_dtype="int8")
    _train(model, opt, 2)
    save_checkpoint(root, 2, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                              "rng": rng_state()}, tp_rank=0, tp_size=1)
    straight = _train(model, opt, 2)

    torch.manual_seed(123)  # another init and RNG position: the checkpoint must restore both
    model2 = _mlp()
    opt2 = forge_engine.optim.AdamW(model2, lr=1e-2, state_dtype="int8", seed=77)
    it, state = load_checkpoint(root, tp_rank=0, tp_size=1)
    assert it == 2
    assert state["optimizer"]["state"][0]["exp_avg"].dtype == torch.int8  # fused moments
    assert state["optimizer"]["state"][0]["exp_avg_scale"].dtype == torch.float32
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    resumed = _train(model2, opt2, 2)

    assert resumed == straight
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------- start-time probe, agreed saves, CUDA RNG

def test_check_writable_dir(tmp_path):
    ckpt.check_writable_dir(str(tmp_path / "a" / "b"), "--save")  # created, probe removed
    assert os.listdir(tmp_path / "a" / "b") == []
    (tmp_path / "f").write_text("x")
    for path, why in ((tmp_path / "f", "exists and is not a directory"),
                      (tmp_path / "f" / "sub", "cannot write there (Not a directory")):
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.check_writable_dir(str(path), "--save")
        assert one_line(e).startswith(f"--save {path}: {why}")


def test_agreed_save_writes_no_tracker_when_a_rank_failed(tmp_path, monkeypatch):
    """agree= replaces the barrier: rank 1's failed write is told to rank 0, which then writes
    no tracker and raises, instead of waiting for a rank that will never arrive."""
    root = str(tmp_path)
    save_checkpoint(root, 1, {"x": 1}, tp_rank=0, tp_size=1)
    votes = []
    with pytest.raises(ckpt.CheckpointError, match="another rank could not write its file of "
                                                   "iteration 2"):
        save_checkpoint(root, 2, {"x": 2}, tp_rank=0, tp_size=2,
                        agree=lambda ok: votes.append(ok) or False)  # rank 1 voted no
    assert votes == [True] and latest_iteration(root) == 1

    def full(obj, f):
        raise OSError(28, "No space left on device", f.name)
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="No space left"):  # this rank's own cause, after voting
        save_checkpoint(root, 2, {}, tp_rank=1, tp_size=2, agree=lambda ok: votes.append(ok) or ok)
    assert votes == [True, False] and latest_iteration(root) == 1 and temps_under(root) == []


def test_rng_state_restores_each_generator_alone(monkeypatch):
    """Each generator, CUDA's included (faked on a machine without one), restored on its own:
    a set_rng_state that skips any one of them fails its case."""
    cuda = [torch.ByteTensor([1, 2, 3])]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in cuda])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda states: cuda.__setitem__(slice(None), [t.clone() for t in states]))
    advance = {"random": random.random, "numpy": np.random.rand, "torch": lambda: torch.rand(1),
               "cuda": lambda: cuda.__setitem__(0, cuda[0] + 1)}
    def same(a, b):
        if torch.is_tensor(a):
            return torch.equal(a, b)
        if isinstance(a, list):
            return all(torch.equal(x, y) for x, y in zip(a, b))
        return repr(a) == repr(b)  # random's tuple, numpy's (name, array, ...) tuple
    np.set_printoptions(threshold=10 ** 6)
    for name, draw in advance.items():
        saved = rng_state()
        assert set(saved) == set(advance)
        draw()
        assert not same(rng_state()[name], saved[name])
        set_rng_state(saved)
        assert same(rng_state()[name], saved[name]), name
    np.set_printoptions(threshold=1000)

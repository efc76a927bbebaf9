"""Checkpoints in Megatron-LM's directory layout, written so that a kill at any moment leaves the
previous checkpoint loadable.

Layout (one file per tensor-parallel rank, the tracker names the newest complete iteration):

    <save>/latest_checkpointed_iteration.txt            "100" (the iteration number as text)
    <save>/iter_0000100/mp_rank_00/model_optim_rng.pt   torch.save of the state dict of rank 0
    <save>/iter_0000100/mp_rank_01/model_optim_rng.pt   ... of rank 1 (tp_size = 2)
    <save>/iter_0000100/mp_rank_00/optim_dp_rank_001.pt  with data parallelism (dp_size > 1):
                                                        what data-parallel rank 1 of TP rank 0
                                                        saves (its optimizer shard); rank 0 of
                                                        each data-parallel group writes
                                                        model_optim_rng.pt

The state is whatever the caller puts in one dict (model and optimizer state_dicts, including the
FORGE optimizer's int8 / bf16 moments and fp32 scales, scheduler and iteration info, rng_state(),
data position, args); save_checkpoint adds the metadata keys of METADATA_KEYS and DP_KEYS.

Order of a save, and what a kill at each point leaves behind:
  1. every rank writes its file to a temporary name in its mp_rank_XX directory, fsyncs it,
     renames it into place (os.replace is atomic) and fsyncs the directories.
     Killed here: a ".tmp-<pid>-..." file nobody reads; the tracker still names the old iteration.
  2. barrier(): all ranks have written.
  3. rank 0 writes the tracker the same way (temporary name, fsync, rename, fsync), LAST.
     Killed before the rename: the old tracker, so loading resumes from the old iteration.
  4. rank 0 deletes iterations beyond keep_last (renamed to a temporary name first, so a half
     deleted directory is never taken for a checkpoint), then barrier() again.
Temporary files left by a killed save are removed by the next save of the same rank. With
agree= (multi-process runs) a rank that fails to write its file tells the others at step 2, so
no rank writes the tracker and every rank raises instead of waiting for the failed one.

Loading is torch.load(weights_only=False): checkpoints hold pickled Python objects (args, RNG
states), so load only checkpoints you trust. Resharding to another tensor-parallel size is not
supported.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import socket
import warnings
from typing import Callable

import torch

CHECKPOINT_VERSION = 1
TRACKER_NAME = "latest_checkpointed_iteration.txt"
FILE_NAME = "model_optim_rng.pt"
METADATA_KEYS = ("iteration", "tp_size", "tp_rank", "checkpoint_version")
DP_KEYS = ("dp_size", "dp_rank")  # written since data parallelism; absent: 1 and 0
DP_FILE = "optim_dp_rank_{:03d}.pt"
_TMP_PREFIX = ".tmp-"  # cannot match iter_*, mp_rank_* or the tracker
_ITER_RE = re.compile(r"iter_(\d{7,})")
_RANK_RE = re.compile(r"mp_rank_(\d{2,})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message is one line for the user."""


def describe_os_error(e: BaseException) -> str:
    """One line for an exception of a file operation: the cause and the file it concerns
    ("No space left on device (ck/iter_0000004/mp_rank_00/.tmp-1-model_optim_rng.pt)")."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, OSError):
        return e.strerror + (f" ({e.filename})" if e.filename else "") if e.strerror else first
    return f"{type(e).__name__}: {first}"


# ------------------------------------------------------------------------------------- paths

def iteration_dir(root: str, iteration: int) -> str:
    """<root>/iter_0000100 for iteration 100 (7 digits, as Megatron-LM)."""
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_path(root: str, iteration: int, tp_rank: int, dp_rank: int = 0) -> str:
    """<root>/iter_0000100/mp_rank_01/model_optim_rng.pt: the file of one tensor-parallel rank
    (of data-parallel rank 0; another data-parallel rank's file is optim_dp_rank_XXX.pt)."""
    name = FILE_NAME if dp_rank == 0 else DP_FILE.format(dp_rank)
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp_rank:02d}", name)


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_NAME)


def _tmp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f"{_TMP_PREFIX}{os.getpid()}-{tail}")


def _iterations(root: str) -> list[int]:
    """Iterations that have an iter_ directory under root (complete or not), ascending."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _ITER_RE.fullmatch(n))
                  and os.path.isdir(os.path.join(root, n)))


def iterations_with_files(root: str) -> list[int]:
    """Iterations under root whose iter_ directory holds at least one complete rank file (a
    save that wrote something, the tracker aside), ascending."""
    out = []
    for it in _iterations(root):
        d = iteration_dir(root, it)
        if any(_RANK_RE.fullmatch(n) and os.path.isfile(os.path.join(d, n, FILE_NAME))
               for n in os.listdir(d)):
            out.append(it)
    return out


def check_writable_dir(path: str, flag: str) -> None:
    """Create `path` if it is missing, then create, fsync and remove a probe file in it, so that
    a directory nothing can be written to is found when the run starts, not at its first save.
    Raises CheckpointError, one line naming the flag, the path and the cause."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path}: exists and is not a directory")
    probe = os.path.join(path, f"{_TMP_PREFIX}probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"{flag} {path}: cannot write there ({describe_os_error(e)})") \
            from None


def _is_complete(root: str, iteration: int, tp_size: int, dp_size: int = 1) -> bool:
    return all(os.path.isfile(checkpoint_path(root, iteration, r, d)) for r in range(tp_size)
               for d in range(dp_size))


# ------------------------------------------------------------------------ durable file writes

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, write: Callable) -> None:
    """write(f) into a temporary file next to path, fsync it, rename it to path, fsync the
    directory. On an exception the temporary file is removed; after a kill it stays behind
    under its temporary name (removed by the next save: _clean_stale_temps)."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(path))


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _clean_stale_temps(root: str, tp_rank: int, dp_rank: int = 0) -> None:
    """Remove what killed saves of this rank left: temporary files of this rank's file name in
    every iter_*/mp_rank_XX/ of this rank (other data-parallel ranks' temporaries there may be
    in the middle of their write) and, on rank 0, temporary trackers and half-deleted
    iteration directories in root."""
    rank_dir = f"mp_rank_{tp_rank:02d}"
    own = "-" + os.path.basename(checkpoint_path(root, 0, tp_rank, dp_rank))
    for it in _iterations(root):
        d = os.path.join(iteration_dir(root, it), rank_dir)
        if os.path.isdir(d):
            for name in os.listdir(d):
                if name.startswith(_TMP_PREFIX) and name.endswith(own):
                    _remove(os.path.join(d, name))
    if tp_rank == 0 and dp_rank == 0:
        for name in os.listdir(root):
            if name.startswith(_TMP_PREFIX):
                _remove(os.path.join(root, name))


def _prune(root: str, iteration: int, keep_last: int, tp_size: int, dp_size: int = 1) -> None:
    """Keep `iteration` and the newest keep_last - 1 complete checkpoints before it; delete
    every other iter_ directory before it. Directories after it (left by an earlier run that
    went further) are not touched."""
    older = [it for it in _iterations(root) if it < iteration]
    keep = [it for it in older if _is_complete(root, it, tp_size, dp_size)][::-1][:keep_last - 1]
    for it in older:
        if it in keep:
            continue
        src = iteration_dir(root, it)
        doomed = _tmp_name(src)  # never mistaken for a checkpoint while it is being deleted
        try:
            os.replace(src, doomed)
            _fsync_dir(root)
            shutil.rmtree(doomed)
        except OSError as e:
            warnings.warn(f"forge_engine: could not delete old checkpoint {src} (keep_last="
                          f"{keep_last}): {e}", stacklevel=3)


# --------------------------------------------------------------------------------- save / load

def save_checkpoint(save_dir: str, iteration: int, state: dict, *, tp_rank: int, tp_size: int,
                    barrier: Callable[[], object] | None = None,
                    keep_last: int | None = None, dp_rank: int = 0, dp_size: int = 1,
                    agree: Callable[[bool], bool] | None = None) -> str:
    """Write this rank's `state` as <save_dir>/iter_<iteration:07d>/mp_rank_<tp_rank:02d>/
    model_optim_rng.pt, then (rank 0, after barrier()) point the tracker at `iteration`.

    Every rank of the tensor-parallel group calls this with the same save_dir, iteration and
    tp_size; in multi-process runs pass barrier=torch.distributed.barrier (or a barrier over
    the group that shares save_dir). barrier is called twice: after this rank's file is written
    and after the tracker is written, so on return the checkpoint is complete on every rank.
    `state` is not modified; the file holds a shallow copy plus METADATA_KEYS. keep_last
    (None: keep every checkpoint) deletes older iterations only after the new tracker is
    written. Saving an iteration that already exists replaces it rank by rank (each file
    atomically, not the set of files). With data parallelism every rank of the world calls
    this (barrier over the world); data-parallel rank d > 0 writes optim_dp_rank_<d>.pt (the
    caller's state: its optimizer shard). Returns the path of the file written.

    agree (instead of barrier, multi-process runs): agree(ok) is called at both points where
    barrier() would be, with whether this rank's part succeeded, and must return whether every
    rank's did (an all-reduce of ok, a barrier too). When any rank failed, no tracker is
    written, the tracker keeps naming the previous checkpoint, and every rank raises: the rank
    that failed its own exception, the others a CheckpointError."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
    if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int)
            and 0 <= tp_rank < tp_size):
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r}, "
                         f"tp_size={tp_size!r}")
    _check_dp(dp_rank, dp_size)
    if keep_last is not None and not (isinstance(keep_last, int) and keep_last >= 1):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, got {keep_last!r}")
    meta = dict(iteration=iteration, tp_size=tp_size, tp_rank=tp_rank,
                checkpoint_version=CHECKPOINT_VERSION, dp_size=dp_size, dp_rank=dp_rank)
    for k, v in meta.items():
        if k in state and state[k] != v:
            raise ValueError(f"state[{k!r}] is {state[k]!r} but this save has {k}={v!r}; "
                             f"the keys {METADATA_KEYS + DP_KEYS} are written by save_checkpoint")
    payload = {**state, **meta}

    path = checkpoint_path(save_dir, iteration, tp_rank, dp_rank)

    def write_rank_file():
        rank_dir = os.path.dirname(path)
        os.makedirs(rank_dir, exist_ok=True)
        _clean_stale_temps(save_dir, tp_rank, dp_rank)
        _atomic_write(path, lambda f: torch.save(payload, f))
        _fsync_dir(os.path.dirname(rank_dir))  # the new mp_rank_XX and iter_ entries are durable
        _fsync_dir(save_dir)

    def write_tracker():
        if tp_rank == 0 and dp_rank == 0:
            _atomic_write(tracker_path(save_dir), lambda f: f.write(str(iteration).encode()))
            if keep_last is not None:
                _prune(save_dir, iteration, keep_last, tp_size, dp_size)

    # each step ends in a barrier: after the rank files every rank's is in place, after the
    # tracker it names the new checkpoint on every rank
    for step, what in ((write_rank_file, "its file"), (write_tracker, "the tracker")):
        if agree is None:
            step()
            if barrier is not None:
                barrier()
            continue
        error = None
        try:
            step()
        except Exception as e:  # told to the other ranks first, so that none waits for this one
            error = e
        if not agree(error is None):
            if error is not None:
                raise error
            raise CheckpointError(f"another rank could not write {what} of iteration "
                                  f"{iteration} to {save_dir} (its own error names the cause)")
    return path


def latest_iteration(load_dir: str, step_flag: str = "iteration=") -> int | None:
    """The iteration the tracker names, or None when there is no tracker (nothing saved yet)."""
    path = tracker_path(load_dir)
    try:
        with open(path, "rb") as f:
            text = f.read(64).decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint tracker {path} "
                              f"({describe_os_error(e)})") from None
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"checkpoint tracker {path} holds {text[:40]!r}, not an iteration "
                         f"number; fix or delete it, or pass {step_flag} to load an iteration")
    return int(text)


def load_checkpoint(load_dir: str, *, tp_rank: int, tp_size: int,
                    iteration: int | None = None, dp_rank: int = 0,
                    dp_size: int | None = 1, step_flag: str = "iteration=") -> tuple[int, dict]:
    """Load this rank's file of the iteration the tracker names (or of `iteration`) onto the
    CPU and check it belongs to this run. Returns (iteration, state); state includes the
    METADATA_KEYS. Errors are one line: FileNotFoundError for a missing directory, tracker or
    rank file; ValueError for another tensor- or data-parallel size (dp_size=None: any, for
    data-parallel rank 0's file read without its optimizer shard) or a file of another rank
    or iteration; CheckpointError (a RuntimeError) for a file torch.load cannot read.
    step_flag names the way to ask for an iteration in the messages (pretrain.py: --ckpt-step)."""
    if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(tp_rank, int)
            and 0 <= tp_rank < tp_size):
        raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank!r}, "
                         f"tp_size={tp_size!r}")
    any_dp = dp_size is None
    if any_dp:
        dp_size = 1
    _check_dp(dp_rank, dp_size)
    if any_dp and dp_rank:
        raise ValueError("dp_size=None reads data-parallel rank 0's file only")
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"checkpoint directory {load_dir} does not exist; pass the "
                                f"directory a previous run saved to, or start without loading")
    if iteration is None:
        iteration = latest_iteration(load_dir, step_flag)
        if iteration is None:
            raise FileNotFoundError(
                f"no checkpoint tracker {tracker_path(load_dir)}: no save into {load_dir} "
                f"has completed; start without loading, or pass {step_flag} to load an "
                f"iter_ directory")
        origin = f"the tracker {tracker_path(load_dir)} names iteration {iteration}, but"
    else:
        origin = (f"iteration={iteration}" if step_flag == "iteration=" else
                  f"{step_flag} {iteration}") + " was asked for, but"
    it_dir = iteration_dir(load_dir, iteration)
    if not os.path.isdir(it_dir):
        have = _iterations(load_dir)
        have_s = ", ".join(map(str, have[-10:])) if have else "none"
        raise FileNotFoundError(f"{origin} {it_dir} does not exist (iterations in {load_dir}: "
                                f"{have_s}); pass one of them as {step_flag}")

    path = checkpoint_path(load_dir, iteration, tp_rank, dp_rank)
    if not os.path.isfile(path):
        saved = _saved_tp_size(it_dir)  # a file of another size's rank is missing?
        if saved is not None and saved != tp_size:
            _tp_mismatch(saved, tp_size, it_dir)
        first = checkpoint_path(load_dir, iteration, tp_rank)  # replica 0's file
        if dp_rank > 0 and os.path.isfile(first):  # saved by another data-parallel size?
            saved_dp = _saved_dp_size(first)
            if saved_dp is not None and saved_dp != dp_size:
                _dp_mismatch(saved_dp, dp_size, it_dir)
        raise FileNotFoundError(f"checkpoint file {path} does not exist (iteration {iteration}, "
                                f"tensor-parallel rank {tp_rank} of {tp_size}); the save of "
                                f"this iteration did not complete, load another iteration")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        why = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}: {why}); "
                              f"it is truncated or corrupt, load another iteration") from None
    if not isinstance(state, dict) or any(k not in state for k in METADATA_KEYS):
        raise ValueError(f"{path} is not a forge_engine checkpoint (it lacks the keys "
                         f"{METADATA_KEYS})")
    if state["checkpoint_version"] > CHECKPOINT_VERSION:
        raise ValueError(f"{path} has checkpoint_version {state['checkpoint_version']}, this "
                         f"forge_engine reads up to {CHECKPOINT_VERSION}; update forge_engine")
    if state["tp_size"] != tp_size:
        _tp_mismatch(state["tp_size"], tp_size, path)
    if not any_dp and state.get("dp_size", 1) != dp_size:
        _dp_mismatch(state.get("dp_size", 1), dp_size, path)
    if (state["tp_rank"], state["iteration"], state.get("dp_rank", 0)) != \
            (tp_rank, iteration, dp_rank):
        raise ValueError(f"{path} holds tensor-parallel rank {state['tp_rank']} of iteration "
                         f"{state['iteration']}, expected rank {tp_rank} of iteration "
                         f"{iteration}; the checkpoint files were moved or renamed")
    return iteration, state


def _saved_tp_size(it_dir: str) -> int | None:
    """tp_size recorded in any rank file of it_dir (memory-mapped: the tensors are not read),
    or None when no rank file there is readable."""
    for name in sorted(os.listdir(it_dir)):
        path = os.path.join(it_dir, name, FILE_NAME)
        if _RANK_RE.fullmatch(name) and os.path.isfile(path):
            try:
                state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
                return int(state["tp_size"])
            except Exception:
                continue
    return None


def _tp_mismatch(saved: int, ours: int, where: str):
    raise ValueError(f"checkpoint was saved with tensor-parallel size {saved}, this run uses "
                     f"{ours}; resharding is not supported ({where})")


def _check_dp(dp_rank, dp_size):
    if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int)
            and 0 <= dp_rank < dp_size):
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank!r}, "
                         f"dp_size={dp_size!r}")


def _saved_dp_size(path: str) -> int | None:
    """dp_size recorded in a rank file, or None when the file is not readable (the full load
    of that file then names the problem)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        return int(state.get("dp_size", 1))
    except Exception:
        return None


def _dp_mismatch(saved: int, ours: int, where: str):
    raise ValueError(f"checkpoint was saved with data-parallel size {saved}, this run uses "
                     f"{ours}; the optimizer state is sharded by data-parallel rank and "
                     f"resharding is not supported ({where})")


# ----------------------------------------------------------------------------------------- RNG

def rng_state() -> dict:
    """The state of every random number generator a training step draws from: python's
    `random`, numpy's global generator (if numpy is installed), torch's CPU generator and, when
    CUDA is available, the generator of every CUDA device. Per process: in tensor-parallel runs
    each rank saves its own."""
    d = {"random": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        d["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        d["cuda"] = torch.cuda.get_rng_state_all()
    return d


def set_rng_state(d: dict) -> None:
    """Restore what rng_state() captured. A generator this process lacks (numpy not installed,
    no CUDA) is skipped; a different number of CUDA devices is an error."""
    if "random" in d:
        random.setstate(d["random"])
    if "torch" in d:
        torch.set_rng_state(d["torch"])
    if "numpy" in d:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.set_state(d["numpy"])
    if "cuda" in d and torch.cuda.is_available():
        if len(d["cuda"]) != torch.cuda.device_count():
            raise ValueError(f"the RNG state holds {len(d['cuda'])} CUDA generators, this "
                             f"process sees {torch.cuda.device_count()} devices; restore on "
                             f"the same device layout")
        torch.cuda.set_rng_state_all(d["cuda"])

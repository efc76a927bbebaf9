"""The persistent hyperparameters of a step replayed as a CUDA graph (forge_engine/graphs.py).

StaticHparams owns one fp32 row per parameter in device memory (lr, bias corrections, the
step's rounding seed, the clip factor) and the host bookkeeping that rewrites the rows before
each replay; StaticStepMixin gives ForgeOptimizer the calls that switch to those rows and
drive them: capture_static_step, recording_static_step, advance_static_step,
replayed_static_step.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from forge_engine.kernels.rules import HP_LEN, hparams, set_seed_bits

if TYPE_CHECKING:
    from forge_engine.optim.base import ForgeOptimizer


class StaticHparams:
    """ForgeOptimizer.capture_static_step's persistent hyperparameters: one fp32 row per
    parameter in device memory (16 floats, so every row starts 64-byte aligned and all share
    one kernel specialization), refilled from pinned host memory before each step."""

    ROW = 16

    def __init__(self, opt: "ForgeOptimizer"):
        self.opt = opt
        dev = next(iter(opt._index)).device
        n = len(opt._index)
        self.dev = torch.zeros((n, self.ROW), dtype=torch.float32, device=dev)
        self.host = torch.zeros((n, self.ROW), dtype=torch.float32,
                                pin_memory=dev.type == "cuda")
        # the parameters a step updates: those earlier (eager) steps gave optimizer state
        self.params = [p for p in opt._index if opt.state.get(p)]
        self.known = set(self.params)
        # rows a device clip factor scales (scale_gradients); the standard path scales .grad
        self.fused_rows = torch.tensor([opt._index[p] for p in self.params if p in opt._fused],
                                       dtype=torch.int64, device=dev)
        self.rows = torch.tensor([opt._index[p] for p in self.params], dtype=torch.int64)
        # advance(): [(members, the step / scalar tensors they share)], and each row's class
        self.classes = None
        self.class_of = None
        self.used: set = set()
        self.ready = False  # advance() wrote the rows of the step now running
        self.recording = False  # the step is being captured (recorded, not run)
        self.copied = None  # CUDA event after the last host-to-device copy of the rows

    def use(self, p, grad_scale: float) -> dict:
        """p's optimizer state for an update in the current step (its hp row is static)."""
        if grad_scale != 1.0:
            raise RuntimeError("forge_engine: a host clip factor (scale_gradients(float), "
                               "clip_grad_norm_) after capture_static_step(): pass the factor "
                               "as a device tensor (forge_engine.graphs.device_step does)")
        name = self.opt._param_names
        if p not in self.known:
            raise RuntimeError(f"forge_engine: parameter '{name[p]}' has no optimizer state "
                               f"yet; a captured step updates only parameters that the eager "
                               f"steps before capture updated")
        if p in self.used:
            raise RuntimeError(f"forge_engine: parameter '{name[p]}' was updated twice in one "
                               f"captured step (a weight used twice needs deferred updates)")
        self.check_ready(name[p])
        self.used.add(p)
        return self.opt.state[p]

    def check_ready(self, name: str):
        if not (self.ready or self.recording):
            raise RuntimeError(f"forge_engine: parameter '{name}' updated after "
                               f"capture_static_step() without advance_static_step() for this "
                               f"step: its hyperparameter row still holds the last step's "
                               f"values (run such steps through forge_engine.graphs."
                               f"CudaGraphStep)")

    def close_step(self):
        missing = [p for p in self.params if p not in self.used]
        self.used = set()
        self.ready = False
        if missing:
            raise RuntimeError(f"forge_engine: {len(missing)} parameter(s) with optimizer state "
                               f"were not updated in this step, e.g. "
                               f"'{self.opt._param_names[missing[0]]}'; a captured step "
                               f"replays one fixed set of updates")

    def advance(self):
        """The host bookkeeping of one step, and its hp rows copied to the device. It runs
        before each replay while the device waits, so its cost is per class, not per
        parameter: parameters of one group at one step with the same host scalars form a class
        (Llama: one), which gets one hp computation and one new set of step (and scalar)
        tensors that all its members share. The classes hold from step to step while every
        member still holds its class's tensors; anything else (a state replaced by hand)
        regroups them."""
        opt = self.opt
        if self.copied is not None:  # the previous copy has read the pinned rows
            self.copied.synchronize()
        if not self._classes_hold():
            self._classify()
        rows, offsets, classes = [], [], []
        for members, _ in self.classes:
            step, scalars = opt._next_step(opt.state[members[0]])
            hp = hparams(opt.kind, opt._group_of(members[0]), step, scalars)  # updates scalars
            finished = opt._finished(step, scalars)
            for p in members:
                opt.state[p].update(finished)  # as _finish, one set for the class
            rows.append(hp + [0.0] * (self.ROW - HP_LEN))
            offsets.append(opt._seed_offset(step))
            classes.append((members, finished))
        self.classes = classes
        if rows:
            new = set_seed_bits(torch.tensor(rows, dtype=torch.float32),
                                torch.tensor(offsets, dtype=torch.int32))
            self.host.index_copy_(0, self.rows, new.index_select(0, self.class_of))
        self.dev.copy_(self.host, non_blocking=True)
        self.ready = True
        if self.dev.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def _classes_hold(self) -> bool:
        if self.classes is None:
            return False
        state = self.opt.state
        for members, shared in self.classes:
            for p in members:
                st = state[p]
                if any(st.get(k) is not v for k, v in shared.items()):
                    return False
        return True

    def _classify(self):
        """Group self.params by (group, next step, host scalars) from their states."""
        opt = self.opt
        by_key = {}
        for p in self.params:
            step, scalars = opt._next_step(opt.state[p])
            key = (id(opt._group_of(p)), step, tuple(scalars.items()))
            by_key.setdefault(key, []).append(p)
        self.classes = [(members, {}) for members in by_key.values()]
        where = {p: i for i, (members, _) in enumerate(self.classes) for p in members}
        self.class_of = torch.tensor([where[p] for p in self.params], dtype=torch.int64)


class StaticStepMixin:
    """ForgeOptimizer's CUDA graph calls; self._static is the StaticHparams once captured."""

    def _init_static(self):
        self._static = None  # capture_static_step(): persistent hp rows (a CUDA graph's step)

    def capture_static_step(self) -> None:
        """Switch to persistent hyperparameters, the contract of a replayed CUDA graph
        (forge_engine/graphs.py). From now on every update reads its hp vector (lr, bias
        corrections, the step's rounding seed) from its row of one device buffer, and a step's
        host bookkeeping (step counts, NAdam's mu_product, the step counter) is done by
        advance_static_step(), which writes the rows for the next step: a replayed graph runs
        no Python. Every parameter updated in such a step must already have optimizer state,
        be updated once per step, and be updated in every step (the same set of launches)."""
        if self._static is not None:
            raise RuntimeError("forge_engine: capture_static_step() was already called")
        if self._shards:
            raise RuntimeError("forge_engine: CUDA graph steps do not support data "
                               "parallelism (FORGE-DP's collectives run in Python)")
        if self._defer or self._segments or self._buffers:
            raise RuntimeError("forge_engine: capture_static_step() between a backward and "
                               "its step(); call it after optimizer.step()")
        if self._mode is None:  # a replayed step is one plain backward per step
            self._mode = "backward"
        self._static = StaticHparams(self)

    @contextlib.contextmanager
    def recording_static_step(self):
        """Around the CUDA graph capture of one step (forge_engine.graphs): its updates are
        recorded, not run, so they read their rows without advance_static_step()."""
        if self._static is None:
            raise RuntimeError("forge_engine: recording_static_step() needs "
                               "capture_static_step()")
        self._static.recording = True
        try:
            yield
        finally:
            self._static.recording = False

    def advance_static_step(self) -> None:
        """Host half of one step under capture_static_step: advance every captured parameter's
        step count and host scalars, and copy the new hp rows to the device (one copy, ordered
        on the current stream before what is launched next). Call before each replay."""
        if self._static is None:
            raise RuntimeError("forge_engine: advance_static_step() needs capture_static_step()")
        self._static.advance()
        self._global_step += 1

    def replayed_static_step(self) -> None:
        """A replay has run the step advance_static_step() prepared: its rows are used up, and
        an update before the next advance_static_step() is refused (an eager step mixed in
        would read them again and count no step)."""
        if self._static is None:
            raise RuntimeError("forge_engine: replayed_static_step() needs "
                               "capture_static_step()")
        self._static.ready = False

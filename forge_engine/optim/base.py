"""ForgeOptimizer: a torch.optim.Optimizer whose fused weights are updated inside backward.

Construction takes the model, swaps every eligible nn.Linear for a ForgeLinear in place (same
module and Parameter objects, same state_dict keys) and binds each such weight to this optimizer
through a Slot (optim/slots.py). During loss.backward() each fused weight is stepped by the
fused kernel the moment its input gradient has been computed (forge_engine/linear.py).
opt.step() then steps the remaining ("standard path") parameters from their materialized .grad
with the same kernel (the gradient handed to it as a materialized segment), and closes the step.

Hyperparameters are read from param_groups at backward time, so torch LR schedulers work
unchanged: schedule.step() after opt.step() sets the lr the next backward uses.

This module owns the optimizer state, the hyperparameter rows, the kernel launches and the
step. ForgeOptimizer composes the owners of the rest: the weight selection (selection.py) and,
one mixin each, deferred segments and clipping (deferral.py), the fused weights' .grad
(grad_policy.py), FORGE-DP (dp_exchange.py) and the CUDA graph rows (static_hparams.py).
"""
from __future__ import annotations

import logging
import warnings
from collections import defaultdict

import torch
from torch import nn

from forge_engine.kernels import FORMATS, PlannedUpdate, StateTensor, fused_wgrad_update, norm_hp
from forge_engine.linear import bind, transposed
from forge_engine.optim import debug_nonfinite
from forge_engine.kernels.rules import GRAD_SCALE, HP_LEN, hparams, rule_spec, set_seed_bits
from forge_engine.optim.clipping import scale_grad_, scale_grads_, sumsq_all
from forge_engine.optim.deferral import DeferralMixin
from forge_engine.optim.dp_exchange import DataParallelMixin
from forge_engine.optim.grad_policy import GradPolicyMixin
from forge_engine.optim.selection import select_weights
from forge_engine.optim.slots import Slot
from forge_engine.optim.static_hparams import StaticStepMixin

# the clipping helpers live in clipping.py and are importable from here as well
__all__ = ["ForgeOptimizer", "INT8_CODE", "SCALAR_KEYS", "scale_grad_", "scale_grads_",
           "sumsq_all"]

SCALAR_KEYS = ("mu_product",)  # per-parameter host scalars kept in the state (NAdam)
# version of the int8 state codes in state dicts: 2 = signed square-root codes for signed states
# (kernels/quant.py); 1 (or absent) = the former linear codes, which would decode wrongly
INT8_CODE = 2
logger = logging.getLogger("forge_engine")


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.view(1, 1) if t.dim() == 0 else t.view(-1, t.shape[-1])


class _Lookups:
    """What the updates of one parameter p look up once and reuse from step to step (an update
    runs for every fused linear of every step, and each lookup keyed by a tensor costs the
    host a Python hash): its state dict, param group, index, seed, norm slot and update plan.
    ForgeOptimizer._lookups_of makes it anew (_new_lookups) when the state dict is no longer
    the optimizer's (load_state_dict, a cleared state) or p's memory moved (.data replaced,
    another device)."""

    __slots__ = ("p", "st", "ptr", "group", "index", "seed", "device", "sumsq", "plan",
                 "step_t", "step")

    def __init__(self, p, st: dict, group: dict, index: int, seed: int):
        # (holding p keeps id(p), the record's key, p's own while the record lives)
        self.p, self.st, self.ptr, self.group = p, st, p.data_ptr(), group
        self.index, self.seed, self.device = index, seed, p.device
        self.sumsq = None  # p's norm slot, at its first update that adds to it (_sumsq_of)
        self.plan = None  # made at p's first kernel update (ForgeOptimizer._plan)
        # the step tensor p's last eager update left in its state, and its value: read
        # without a tensor access while the state still holds that tensor, unchanged
        self.step_t, self.step = None, 0


class ForgeOptimizer(DeferralMixin, GradPolicyMixin, DataParallelMixin, StaticStepMixin,
                     torch.optim.Optimizer):
    """Base class; subclasses fix the rule (kind, variant) and torch.optim-style defaults.

    fuse=False keeps every weight on the standard path (materialized .grad, same rule): the
    forge=False baseline for rules torch.optim does not have (Lion).

    dp_group (a data-parallel process group, or None): FORGE-DP (parallel/data_parallel.py).
    Each replica updates its row shard of every fused weight from the token segments of all
    replicas and keeps optimizer state for that shard only; the updated rows are all-gathered
    behind the next forward. Standard-path gradients are averaged over the replicas.

    updates: where the fused weights are updated.
      "backward"  inside each linear's backward, the moment its input gradient exists: the
                  least memory. The loop must be plain (one backward per step, nothing that
                  clips, unscales or reads the fused gradients before step()); anything else
                  is an error when it happens (after that step's updates).
      "step"      in step(), from the token segments stashed in backward: exact for gradient
                  accumulation, torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler (a
                  skipped step updates nothing) and Hugging Face's Trainer. Cost: every fused
                  layer's X and dY stay alive until step() (deferred_bytes()).
      "auto"      (default) the first step runs as "step" and watches the loop: with one
                  backward and nothing touching a fused gradient, the later steps run as
                  "backward"; otherwise all of them as "step". With dp_group (FORGE-DP):
                  "backward" (clip with this optimizer's clip_grad_norm_).
    standard: names (or Parameters) of weights to keep on the standard path."""

    UPDATES = ("auto", "step", "backward")

    def __init__(self, model: nn.Module, defaults: dict, kind: int, variant: int = 0, *,
                 state_dtype: str | None = None, stochastic_rounding: bool = True,
                 seed: int | None = None, fuse: bool = True, dp_group=None,
                 updates: str = "auto", standard=()):
        if not isinstance(model, nn.Module):
            # (transformers.Trainer(optimizer_cls_and_kwargs=...) passes parameter groups)
            raise TypeError(f"{type(self).__name__}: the first argument is the model (an "
                            f"nn.Module whose nn.Linear layers FORGE will update), got "
                            f"{type(model).__name__}; with transformers.Trainer, make the "
                            f"optimizer from the model and pass Trainer(..., optimizers="
                            f"(optimizer, None))")
        if state_dtype is not None and state_dtype not in FORMATS:
            raise ValueError(f"state_dtype must be one of {FORMATS} (or None for the weight's "
                             f"default), got {state_dtype!r}")
        if updates not in self.UPDATES:
            raise ValueError(f"updates must be one of {self.UPDATES}, got {updates!r}")
        self.updates = updates
        self._mode = None if updates == "auto" else updates  # auto: decided by step 1
        self.kind, self.variant = kind, variant
        self.spec = rule_spec(kind, variant)
        # the state entries an update reads: each slot's tensor and its int8 scales
        self._state_keys = tuple(k for sl in self.spec.slots if sl is not None
                                 for k in (sl[0], sl[0] + "_scale"))
        self.state_dtype = state_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(torch.initial_seed() if seed is None else seed) & 0x7FFFFFFF
        self._global_step = 0
        self._sumsq: dict = {}
        # (group, step, host scalars, grad scale, device) -> this step's hp row and new state
        # entries (see _begin); and, under keys that begin with their name, the step's other
        # device rows: a clip factor converted, an hp row scaled by it, the norm pass's hp
        self._hp_cache: dict = {}
        self._lookups: dict = {}  # id(p) -> p's _Lookups (see _kernel_step)
        # fused-norm writes so far, and pending_sumsq's last (key, total): one all-reduce when
        # the total is asked for twice with nothing written in between
        self._sumsq_writes = 0
        self._pending = None
        self.grad_norm: torch.Tensor | None = None
        self._init_deferral()
        self._init_static()
        self._slots: dict = {}  # fused weight -> its Slot
        self._init_grad_policy()
        # FORGE_DEBUG_NONFINITE=1: each update's inputs kept until the step ends
        self._recorder = debug_nonfinite.UpdateRecorder() if debug_nonfinite.enabled() else None

        chosen = select_weights(model, standard, fuse, type(self).__name__)
        self.standard_reasons = chosen.standard_reasons
        super().__init__(chosen.params, defaults)
        self._index = {p: i for i, p in enumerate(chosen.params)}
        self._bind(chosen.fused)
        self._param_names = {p: n for n, p in chosen.first}
        self._weights = [(n, p) for n, p in chosen.first if p.dim() >= 2]
        self._init_data_parallel(model, dp_group)

    def _bind(self, fused: list):
        """Bind each fused weight to a Slot of this optimizer in every module that uses it."""
        self._fused = {}
        self.fused_names = []
        for wname, w, mods in fused:
            slot = Slot(self, w, wname.rsplit(".", 1)[0] or "<root>", consumers=len(mods),
                        transposed=transposed(mods[0][1]))
            self._slots[w] = slot
            for _, m, key in mods:
                bind(m, key, slot)  # in place: same module, Parameters, state keys
            self._fused[w] = wname
            self.fused_names.append(wname)
            w.register_hook(self._foreign_grad_hook(wname))

    # ----------------------------------------------------------------------- state handling

    def _format(self, p: torch.Tensor) -> str:
        if self.state_dtype is not None:
            return self.state_dtype
        return "bf16" if p.dtype == torch.bfloat16 else "fp32"

    def _group_of(self, p):
        """p's param group, cached: called for every fused weight in every backward. Group
        dicts are only ever updated in place (load_state_dict too), so the cache stays true."""
        cache = self.__dict__.setdefault("_group_cache", {})
        g = cache.get(p)
        if g is None:
            g = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
            if g is None:
                raise KeyError("parameter not managed by this optimizer")
            cache[p] = g
        return g

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            fmt = self._format(p)
            sh = self._shards.get(p)
            shape = (sh.rows, sh.k) if sh is not None else tuple(_as_2d(p).shape)
            for slot in self.spec.slots:
                if slot is None:
                    continue
                name, nonneg = slot
                init = group.get("initial_accumulator_value", 0.0) if name == "sum" else 0.0
                t = StateTensor.full(shape, init, fmt, nonneg, p.device)
                st[name] = t.data
                if t.scale is not None:
                    st[name + "_scale"] = t.scale
        return st

    def _states(self, st: dict) -> list:
        return [StateTensor(st[s[0]], st.get(s[0] + "_scale"), s[1]) if s is not None else None
                for s in self.spec.slots]

    def _lookups_of(self, p) -> _Lookups:
        """p's _Lookups, made anew where its state or memory may have changed."""
        r = self._lookups.get(id(p))
        if r is None or not r.st or self.state.get(p) is not r.st or r.ptr != p.data_ptr():
            r = self._new_lookups(p)
        return r

    def _new_lookups(self, p) -> _Lookups:
        """p's _Lookups made anew: its state (initialized at p's first update), group, index
        and seed, where p has none, or where the state or p's memory may have changed
        since."""
        group = self._group_of(p)
        st = self._init_state(p, group)
        i = self._index[p]
        r = self._lookups[id(p)] = _Lookups(p, st, group, i, self._seed_for(i))
        return r

    def _begin(self, r: _Lookups, grad_scale: float):
        """What an eager update of r's parameter reads and leaves: (the hp row on its device,
        the state entries after it, the step it makes). The weights of one group at one step
        with the same host scalars share them (one hp computation, one host-to-device copy,
        one set of new step tensors, as a captured step's class does), until step() ends the
        step: hyperparameters are read at a weight's update, and a group changed in the
        middle of a backward pass applies from the next step on."""
        st = r.st
        t = st["step"]
        if t is r.step_t and not t._version:
            step = r.step + 1
        else:
            step = int(t.item()) + 1
        scalars = self._host_scalars(st)
        key = (id(r.group), step, *scalars.items(), grad_scale, r.device)
        shared = self._hp_cache.get(key)
        if shared is None:
            hp = hparams(self.kind, r.group, step, scalars, grad_scale)  # updates scalars
            # never written after creation: launches may still read it
            hp_t = self._hp_row(hp, step).to(r.device, non_blocking=True)
            shared = self._hp_cache[key] = (hp_t, self._finished(step, scalars), step)
        return shared

    @staticmethod
    def _next_step(st) -> tuple:
        """The 1-based step an update of this state makes, and its host scalars (a dict)."""
        return int(st["step"].item()) + 1, ForgeOptimizer._host_scalars(st)

    @staticmethod
    def _host_scalars(st) -> dict:
        """The host scalars (SCALAR_KEYS) this state holds, as floats."""
        if st.keys().isdisjoint(SCALAR_KEYS):  # every rule but NAdam: an update's common case
            return {}
        return {k: float(st[k]) for k in SCALAR_KEYS if k in st}

    @staticmethod
    def _finished(step, scalars) -> dict:
        """The state entries an update leaves: its step count and host scalars, as tensors."""
        # new tensors (a captured step's class of weights shares one set); scalar_tensor is
        # a third of torch.tensor's host time for a number
        return {"step": torch.scalar_tensor(float(step)),
                **{k: torch.scalar_tensor(v, dtype=torch.float64) for k, v in scalars.items()}}

    def _seed_for(self, index: int, dp_rank: int = 0) -> int:
        """The per-weight part of the rounding seed: the kernel adds the step's part
        (_seed_offset, in hp[HP_SEED]) modulo 2**31."""
        return (self.seed * 1000003 + index * 104729 + dp_rank * 15485863) & 0x7FFFFFFF

    @staticmethod
    def _seed_offset(step: int) -> int:
        return (step * 7919) & 0x7FFFFFFF

    def _hp_row(self, hp: list, step: int) -> torch.Tensor:
        """hp values and the step's seed offset as one fp32 [HP_LEN] host tensor."""
        return set_seed_bits(torch.tensor(hp, dtype=torch.float32), self._seed_offset(step))

    def _sumsq_of(self, p) -> torch.Tensor:
        """p's [1] slot (a view, which p's _Lookups keeps) of its device's fp32 vector of the
        fused weights' squared gradient norms in this step (the kernel's tile sums of the
        gradient its update applied: clipped, unscaled), indexed like the parameters. One slot
        per weight names a non-finite gradient; one vector makes zeroing and summing one
        launch. With data parallelism every fused weight is a row shard, and its slot holds
        the norm of the shard's mean gradient over the replicas."""
        key = str(p.device)
        if key not in self._sumsq:  # (vectors are only ever zeroed in place)
            self._sumsq[key] = torch.zeros(len(self._index), dtype=torch.float32,
                                           device=p.device)
        i = self._index[p]
        return self._sumsq[key][i:i + 1]

    def pending_sumsq(self, device) -> torch.Tensor:
        """Sum of squares of the gradients fused so far in this step (0-d tensor on device):
        the in-kernel tile sums (with data parallelism: over every replica's shard, which costs
        one scalar all-reduce); step() folds them into grad_norm and resets them."""
        key = (self._sumsq_writes, str(device))
        if self._pending is not None and self._pending[0] == key:  # nothing written since:
            return self._pending[1]  # the Engine's norm and step() share one all-reduce
        total = sum((v.sum().to(device) for v in self._sumsq.values()),
                    torch.zeros((), dtype=torch.float32, device=device))
        total = self._dp_total(total, mean=False) if self._shards else total
        self._pending = (key, total)
        return total

    def _standard_params(self) -> list:
        """The parameters whose .grad is a real tensor: all but the fused weights."""
        return [p for g in self.param_groups for p in g["params"] if p not in self._fused]

    # ------------------------------------------------------------------------ the updates

    def _kernel_step(self, p, w, x=None, dy=None, onehot=None, grad=None,
                     grad_scale: float = 1.0, sumsq=None, dp_rank: int = 0, factor=None):
        """One optimizer step of w (p, its 2-D view, or this replica's rows of it) by the fused
        kernel, from any mix of segments: dense (x, dy), one-hot, a materialized fp32 grad.
        Adds ||gradient||^2 to sumsq (default: p's slot of the fused weights' norm vector).
        factor: a scaling of the gradient done through its FusedGrad (a float, or a 0-d
        device tensor: GradScaler's 1 / scale, a clip coefficient), applied on top of
        grad_scale. The kernel adds the norm of the gradient it applies, scaled by both."""
        if factor is not None and not torch.is_tensor(factor):
            grad_scale, factor = grad_scale * factor, float(factor)
        static = self._static
        r = self._lookups_of(p)
        st = r.st
        if static is not None:  # hp from p's persistent row, written by advance_static_step
            static.use(p, grad_scale)
            hp_t = static.dev[r.index, :HP_LEN]
        else:
            hp_t, finished, step = self._begin(r, grad_scale)
        if w.numel():  # a replica may own no rows of a small weight
            if sumsq is None:
                self._sumsq_writes += 1  # pending_sumsq's cached total is stale now
                sumsq = r.sumsq
                if sumsq is None:
                    sumsq = r.sumsq = self._sumsq_of(p)
            seed = r.seed if dp_rank == 0 else self._seed_for(r.index, dp_rank)
            if factor is not None and torch.is_tensor(factor):  # on the device: no wait
                if static is not None:
                    raise RuntimeError("forge_engine: a FusedGrad scaling in a captured step")
                hp_t = self._scaled_hp(hp_t, factor)
            if self._recorder is not None and static is None:  # (the row the kernel takes)
                self._recorder.record(p, x, dy, w, self._states(st), hp_t, seed,
                                      self.stochastic_rounding, onehot, grad)
            if onehot is None:  # the same launch as every step's: through p's plan
                self._plan(r, w, seed)(x, dy, hp_t, sumsq, grad)
            else:
                fused_wgrad_update(x, dy, w.detach(), self._states(st), self.spec, hp_t, sumsq,
                                   seed, self.stochastic_rounding, onehot=onehot, grad=grad)
        if static is None:
            st.update(finished)
            r.step_t, r.step = finished["step"], step

    def _scaled_hp(self, hp_t, factor) -> torch.Tensor:
        """hp_t with its gradient scale multiplied by factor (a device tensor), made once per
        pair in a step: clip_grad_norm_ multiplies every gradient by one coefficient, and the
        weights of a group share one hp row, so a step's deferred updates share a few."""
        key = ("scaled hp", id(hp_t), id(factor))  # (both ours: neither changes in place)
        hit = self._hp_cache.get(key)
        if hit is None:  # (the pair is kept: the ids stay theirs until step() ends)
            scaled = hp_t.clone()
            scaled[GRAD_SCALE:GRAD_SCALE + 1].mul_(factor.reshape(1))
            hit = self._hp_cache[key] = (hp_t, factor, scaled)
        return hit[2]

    def _plan(self, r: _Lookups, w, seed: int) -> PlannedUpdate:
        """The update plan (kernels.PlannedUpdate) of w (r's parameter, or a replica's rows of
        it): made at its first update, and again when w, the state tensors, the seed or the
        rounding are no longer the bound ones (a loaded state dict, replaced .data, another
        replica's rows)."""
        st = r.st
        refs = (*map(st.get, self._state_keys), self.stochastic_rounding)
        plan = r.plan
        if plan is None or not plan.binds(w, refs, seed):
            plan = r.plan = PlannedUpdate(w.detach(), self._states(st), self.spec, seed,
                                          self.stochastic_rounding, refs)
        return plan

    @staticmethod
    def _operands(p, x, dy, onehot):
        if x is None:
            return None, None
        return (x if x.dtype == p.dtype else x.to(p.dtype),
                dy if dy.dtype == p.dtype else dy.to(p.dtype))

    @staticmethod
    def _onehot(p, onehot):
        return (onehot[0], onehot[1].to(p.dtype)) if onehot is not None else None

    def _fused_update(self, p: torch.Tensor, x2, dy2, onehot=None, early=None,
                      grad=None, factor=None):
        """Step fused weight p [N, K] with gradient dy2^T x2 (x2 [T, K], dy2 [T, N]) plus
        onehot(ids)^T e for a one-hot segment (ids [T1], e [T1, K]). With data parallelism:
        this replica's row shard, from every replica's segments (early: _dp_start's). grad: a
        materialized fp32 gradient [N, K] (an accumulation buffer) instead of segments."""
        if torch.is_grad_enabled():  # (backward runs without grad mode: no context to enter)
            with torch.no_grad():
                return self._fused_update(p, x2, dy2, onehot, early, grad, factor)
        if self._shards and p in self._shards:
            self._dp_apply(p, self._dp_ready(p, x2, dy2, onehot, early))
            return
        if x2 is not None and (x2.dtype != p.dtype or dy2.dtype != p.dtype):
            x2, dy2 = x2.to(p.dtype), dy2.to(p.dtype)
        # p itself as the weight (no grad mode here): the plan keeps a detached view of it
        self._kernel_step(p, p, x2, dy2, None if onehot is None else self._onehot(p, onehot),
                          grad, self._grad_scale, factor=factor)

    def _norm_only(self, p, w, x, dy, onehot) -> torch.Tensor:
        """||dy^T x + onehot(ids)^T e||^2 ([1] fp32) over the rows of w (p or its shard), by the
        kernel's norm-only pass: reads the segments, writes nothing."""
        acc = torch.zeros(1, dtype=torch.float32, device=p.device)
        fused_wgrad_update(x, dy, w, self._states(self._init_state(p, self._group_of(p))),
                           self.spec, norm_hp(p.device), acc, 0, False, norm_only=True,
                           onehot=onehot)
        return acc

    @torch.no_grad()
    def step(self, closure=None):
        """Step the standard-path parameters from their .grad and close the step.

        The fused weights were already updated during backward. After this call,
        `self.grad_norm` holds the global L2 norm of the gradients this step applied (fused
        tiles' in-kernel sums plus the standard path), as a 0-d tensor: after GradScaler's
        unscale_ and after clipping (torch.nn.utils.clip_grad_norm_, scale_gradients), as
        .grad held them at step(); after this optimizer's own clip_grad_norm_, the norm
        before clipping that it returned. A step replayed from a CUDA graph does not keep
        it: the Engine's StepStats.grad_norm is that step's norm."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._defer or self._segments or self._buffers or self._ready:
            self.flush()
        self.reduce_dp_grads()
        dev = next(iter(self._index)).device
        std = torch.zeros(1, dtype=torch.float32, device=dev)
        stepped = self._step_standard(dev, std)
        if self._fused:  # the fused tiles' in-kernel sums of this step
            fused = self.pending_sumsq(dev)
            total = fused + std[0]
        else:
            total = std[0] if stepped else None
        self.grad_norm = torch.sqrt(total) if total is not None else None
        self._close_step()
        return loss

    def _step_standard(self, dev, std: torch.Tensor) -> bool:
        """Step every standard-path parameter that has a .grad, adding its squared norm to
        std ([1] fp32 on dev); whether any was stepped."""
        stepped = False
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._fused:
                    if p.grad is not None and p.grad is not self._slots[p].grad:
                        raise RuntimeError(
                            f"forge_engine: FORGE weight '{self._fused[p]}' has a .grad; fused "
                            f"weights are updated in backward and must not receive gradients")
                    continue
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("forge_engine optimizers do not support sparse gradients")
                if p.device != dev:
                    raise RuntimeError(f"forge_engine: parameters on {dev} and {p.device}; "
                                       f"one optimizer steps the parameters of one device")
                stepped = True
                # the same kernel, .grad as a materialized segment: one launch (a bf16 .grad
                # is widened in the kernel), no host sync; clipping scaled .grad itself
                grad = _as_2d(p.grad)
                if grad.dtype not in (torch.float32, p.dtype):
                    grad = grad.float()
                self._kernel_step(p, _as_2d(p.detach()), grad=grad, sumsq=std)
        return stepped

    def _close_step(self):
        """The end of step(): the reported norm, the per-step caches and counters reset, the
        fused weights' .grad hidden, the updates='auto' decision made."""
        if self._clipped_norm is not None:  # report the norm before clipping, as torch does
            self.grad_norm, self._clipped_norm = self._clipped_norm, None
        for s in self._sumsq.values():
            s.zero_()
        self._sumsq_writes += 1
        self._hp_cache.clear()  # the next step's hyperparameters differ (step count, lr)
        if self._recorder is not None:
            self._recorder.clear()
        self._dp_grads_reduced = False
        self._hide_grads()  # the update used them: fused weights have no .grad after step()
        if self._mode is None:  # auto: the first step saw a plain loop
            self._mode = "backward"
            logger.info("forge_engine: the first step ran a plain loop (one backward, nothing "
                        "touched the fused gradients before step()); the fused weights are "
                        "updated inside backward from now on")
        if self._static is not None:
            self._static.close_step()  # the host's part of the step is advance_static_step's
        else:
            self._global_step += 1

    def nonfinite_weights(self, sums: dict | None = None) -> list[str]:
        """Names of the fused weights whose gradient in this step (so far) was not finite on
        this process (call before step(), which resets the sums); sums: copies of the squared
        norm vectors taken before step() (a replayed graph's), by device."""
        sums = self._sumsq if sums is None else sums
        bad = {key: (~torch.isfinite(v)).tolist() for key, v in sums.items()}
        hit = [p for p in self._fused
               if str(p.device) in bad and bad[str(p.device)][self._index[p]]]
        if self._recorder is not None:  # FORGE_DEBUG_NONFINITE: what a second run gives
            for p in hit:
                for line in self._recorder.explain(p, self._fused[p], self.spec,
                                                   self._global_step + 1):
                    logger.warning(line)
        return [self._fused[p] for p in hit]

    # ------------------------------------------------------------------ checkpoint support

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["forge"] = dict(seed=self.seed, global_step=self._global_step, kind=self.kind,
                           variant=self.variant, state_dtype=self.state_dtype,
                           stochastic_rounding=self.stochastic_rounding,
                           dp_size=self.dp_size, dp_rank=self._dp_rank(), int8_code=INT8_CODE)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore exactly (no dtype casting: bf16 / int8 states and fp32 scales stay as saved).
        A state dict of another optimizer kind, variant or parameter layout is rejected."""
        forge = self._check_loadable(state_dict)
        groups = state_dict["param_groups"]
        id_map = {}
        for saved, mine in zip(groups, self.param_groups):
            id_map.update(zip(saved["params"], mine["params"]))
        new_state = defaultdict(dict)
        for k, v in state_dict["state"].items():
            p = id_map[k]
            entry = {}
            for name, val in v.items():
                if torch.is_tensor(val) and name != "step" and name not in SCALAR_KEYS:
                    if val.shape[-1:] != _as_2d(p).shape[-1:] and not name.endswith("_scale"):
                        raise ValueError(f"state '{name}' has shape {tuple(val.shape)}, which "
                                         f"does not fit parameter of shape {tuple(p.shape)}")
                    val = val.to(p.device, copy=True)  # never alias the given dict
                entry[name] = val
            new_state[p] = entry
        self.state = new_state
        for saved, mine in zip(groups, self.param_groups):
            for key, val in saved.items():
                if key != "params":
                    mine[key] = val
        self.seed = forge["seed"]
        self._lookups.clear()  # (each holds a seed and the former state)
        self._global_step = forge["global_step"]
        if self.state_dtype is not None and forge["state_dtype"] != self.state_dtype:
            # restored as saved, against the format asked for: say so once
            warnings.warn(f"forge_engine: the loaded optimizer state keeps the moments as "
                          f"saved, state_dtype={forge['state_dtype']!r}; this optimizer was "
                          f"made with state_dtype={self.state_dtype!r}. To change the format, "
                          f"start the optimizer state afresh", stacklevel=2)
        self.state_dtype = forge["state_dtype"]
        self.stochastic_rounding = forge["stochastic_rounding"]

    def _check_loadable(self, state_dict: dict) -> dict:
        """state_dict's 'forge' entry, once it is known to fit this optimizer (else
        ValueError): kind and variant, int8 code, data-parallel shard, parameter groups."""
        forge = state_dict.get("forge")
        if forge is None:
            raise ValueError("not a forge_engine optimizer state dict (no 'forge' entry; a "
                             "torch.optim state dict keeps its moments in another layout): "
                             "resume a FORGE run from its own optimizer.state_dict(), or start "
                             "FORGE afresh from the model's weights")
        if (forge["kind"], forge["variant"]) != (self.kind, self.variant):
            raise ValueError(f"state dict is for optimizer kind/variant "
                             f"{forge['kind']}/{forge['variant']}, this optimizer is "
                             f"{self.kind}/{self.variant}")
        has_int8 = any(name.endswith("_scale") for v in state_dict["state"].values()
                       for name in v)
        if has_int8 and forge.get("int8_code", 1) != INT8_CODE:
            raise ValueError("state dict holds int8 optimizer states in the former linear code "
                             "(before signed square-root codes, 2026-11-29); they would decode "
                             "wrongly: resume from a checkpoint written since, or restart the "
                             "optimizer state")
        saved_dp = (forge.get("dp_size", 1), forge.get("dp_rank", 0))
        if saved_dp != (self.dp_size, self._dp_rank()):
            raise ValueError(f"state dict holds the optimizer shard of data-parallel rank "
                             f"{saved_dp[1]} of {saved_dp[0]}; this optimizer is rank "
                             f"{self._dp_rank()} of {self.dp_size} (resharding is not "
                             f"supported)")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("state dict parameter groups do not match this optimizer's")
        return forge

    def forge_summary(self) -> str:
        """One line: which weights the fused kernel updates, which stay standard (and why);
        a weight of more than 2 dimensions (stacked experts) counts as one."""
        mats = self._weights
        std = [f"{n} ({self.standard_reasons[n]})" if n in self.standard_reasons else n
               for n, p in mats if p not in self._fused]
        fp = sum(p.numel() for p in self._fused)
        allp = sum(p.numel() for _, p in mats)
        dp = (f"; data-parallel x{self.dp_size}: each replica updates 1/{self.dp_size} of the "
              f"rows from all replicas' tokens, no gradient all-reduce") if self._shards else ""
        return (f"FORGE: fused {len(self._fused)} of {len(mats)} weight matrices ({fp} of {allp} "
                f"parameters); standard path: {', '.join(std) if std else 'none'}{dp}")

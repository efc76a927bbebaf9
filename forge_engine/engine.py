"""The step scheduler (docs/design.md, "Module map"): one training step of a (tensor-parallel)
model with FORGE or, for comparison, with ordinary materialized gradients.

Per step, in order:
  1. lr for this iteration is written into the optimizer's param_groups: every FORGE layer reads
     its hyperparameters there when its backward runs (ForgeOptimizer._fused_update), so the
     schedule drives the fused updates without recompiling anything.
  2. loss.backward(): every fused weight is updated as soon as its consumer's dX is computed
     (dX before update: ForgeLinearFunction). A weight with two consumers (tied embedding and LM
     head) is not fused: the optimizer leaves it on the standard path and says so (summary).
  3. Replicated parameters whose gradient is a partial sum over the TP group (norm weights under
     sequence parallelism, QK-norms always: GPT.tp_grad_sum_parameters) are all-reduced, as
     Megatron does before its optimizer step. With data parallelism (dp_group), materialized
     gradients are then averaged over the replicas (ordinary DP); the fused weights need no
     gradient all-reduce: FORGE-DP gathered the replicas' token segments in backward and each
     replica updated its row shard (parallel/data_parallel.py).
  4. Global gradient norm: sum of squares of TP-sharded gradients (the fused tiles' in-kernel sums
     and the sharded standard-path grads) all-reduced over TP, plus the replicated grads counted
     once (they are equal on every rank after step 3). With clip_grad > 0 this comes first, from
     the deferred segments (a norm-only kernel pass), and every update is scaled by
     clip_grad / (norm + 1e-6) when that is below 1 (torch.nn.utils.clip_grad_norm_'s rule).
  5. optimizer.step() (standard-path params, and the deferred fused updates) and zero_grad().
forge=False uses torch.optim on the same model (Lion, which torch lacks, uses our rule on
materialized gradients: ForgeOptimizer(fuse=False)): the baseline for every comparison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import forge_engine.optim as fopt
from forge_engine.optim.clipping import scale_grads_, sumsq_all
from forge_engine.optim.master_weights import MasterWeights
from forge_engine.parallel.data_parallel import average_gradients
from forge_engine.parallel.mappings import world

OPTIMIZERS = {"adamw": "AdamW", "nadam": "NAdam", "radam": "RAdam", "lion": "Lion",
              "rmsprop": "RMSprop", "adagrad": "Adagrad", "sgd": "SGD"}


def build_optimizer(model: torch.nn.Module, name: str, forge: bool = True, dp_group=None,
                    **kwargs):
    """forge_engine.optim.<Name>(model, ...) or, with forge=False, torch.optim.<Name>.
    dp_group: FORGE-DP for the forge optimizers (torch.optim's gradients are averaged by the
    Engine). main_params_dtype="fp32" (forge=False, bf16 weights): torch.optim steps fp32
    master copies of the weights (MasterWeights, Megatron's mixed precision)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    cls = OPTIMIZERS[name]
    main_params_dtype = kwargs.pop("main_params_dtype", None)
    if main_params_dtype not in (None, "fp32"):
        raise ValueError(f"main_params_dtype={main_params_dtype!r}: None (step the weights "
                         f"themselves) or 'fp32' (fp32 master copies of bf16 weights)")
    if forge:
        if main_params_dtype is not None:
            raise ValueError("main_params_dtype is the forge=False baseline's fp32 master copy; "
                             "FORGE keeps none (bf16 weights with stochastic rounding)")
        # the Engine runs its own loop: accumulation and clipping defer explicitly
        kwargs.setdefault("updates", "backward")
        return getattr(fopt, cls)(model, dp_group=dp_group, **kwargs)
    if not hasattr(torch.optim, cls):  # Lion: our rule on materialized gradients
        if main_params_dtype is not None:
            raise ValueError(f"main_params_dtype wraps torch.optim; {cls} is not in it")
        return getattr(fopt, cls)(model, fuse=False, dp_group=dp_group, **kwargs)
    kwargs.pop("seed", None)  # rounding streams: nothing to seed in torch.optim
    kwargs.pop("stochastic_rounding", None)
    state_dtype = kwargs.pop("state_dtype", None)
    if state_dtype not in (None, "fp32"):
        raise ValueError(f"state_dtype={state_dtype!r} applies to FORGE; the forge=False "
                         f"baseline keeps torch.optim's states")

    def make(params):
        if cls == "AdamW" and params and params[0].is_cuda:
            return fused_adamw(params, **kwargs)
        return getattr(torch.optim, cls)(params, **kwargs)

    if main_params_dtype == "fp32":
        return MasterWeights(model.parameters(), make)
    return make(list(model.parameters()))


def _apex_fused_adam():
    """apex.optimizers.FusedAdam where NVIDIA apex is importable (NVIDIA's PyTorch images),
    else None. Never `pip install apex` (an unrelated project)."""
    try:
        from apex.optimizers import FusedAdam
    except Exception:  # ImportError, or an apex built without its CUDA extensions
        return None
    return FusedAdam


def fused_adamw(params, **kwargs) -> torch.optim.Optimizer:
    """The forge=False AdamW on CUDA: apex's FusedAdam (adam_w_mode) where apex is importable,
    else torch.optim.AdamW(fused=True): one multi-tensor kernel for all parameters either way.
    (With FORGE on, the parameters FORGE does not fuse, norms and biases, are stepped by the
    FORGE kernel itself from their .grad: ForgeOptimizer._standard_update.)"""
    kwargs.pop("fused", None)
    apex_cls = _apex_fused_adam()
    if apex_cls is not None:
        return apex_cls(params, adam_w_mode=True, **kwargs)
    return torch.optim.AdamW(params, fused=True, **kwargs)


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    nonfinite: list = field(default_factory=list)
    """names of the weights whose gradient was not finite in this step (any rank), when the
    norm is not finite; their non-finite tiles were not written"""


class Engine:
    """Runs training steps of `model` (a GPT or any module returning a scalar loss via loss_fn).

    model: may define tp_sharded_parameters() and tp_grad_sum_parameters() (GPT does); without
    them every parameter counts as local (TP size 1). dp_group: the data-parallel replicas
    (each runs train_step on its own micro-batches of the same shape).
    """

    def __init__(self, model: torch.nn.Module, optimizer: str = "adamw", *, forge: bool = True,
                 tp_group=None, dp_group=None, lr_schedule: Callable[[int], float] | None = None,
                 clip_grad: float = 0.0, **optimizer_kwargs):
        self.model, self.forge, self.tp_group, self.dp_group = model, forge, tp_group, dp_group
        self.clip_grad = float(clip_grad)
        if world(dp_group) > 1:  # replicas start equal (as DDP's construction makes them)
            src = dist.get_global_rank(dp_group, 0)
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t, src, group=dp_group)
        self.optimizer = build_optimizer(model, optimizer, forge, dp_group, **optimizer_kwargs)
        self.lr_schedule = lr_schedule
        self.iteration = 0
        self._allreduce_bytes = 0
        sharded = getattr(model, "tp_sharded_parameters", lambda: [])()
        self._sharded = {id(p) for p in sharded}
        self._grad_sum = list(getattr(model, "tp_grad_sum_parameters", lambda: [])())
        if world(tp_group) == 1:
            self._sharded = {id(p) for p in model.parameters()}

    @property
    def summary(self) -> str:
        """The start-up line: what the fused kernel updates (or that FORGE is off)."""
        if isinstance(self.optimizer, fopt.ForgeOptimizer):
            line = self.optimizer.forge_summary()
            return line if self.forge else "FORGE: off (--no-forge); " + line.split("; ", 1)[1]
        master = isinstance(self.optimizer, MasterWeights)
        kind = type(self.optimizer.inner if master else self.optimizer)
        where = f"{kind.__module__.split('.')[0]}.{kind.__name__}"
        fused = " (fused)" if getattr(self.optimizer, "defaults", {}).get("fused") else ""
        return (f"FORGE: off (--no-forge); every weight on {where}{fused} with materialized "
                f"gradients" + (", stepping fp32 master copies of the bf16 weights" if master
                                else ""))

    def synchronize(self):
        """Data parallelism: finish the in-flight all-gathers of updated weight rows, so every
        replica's weights are complete (before saving, or leaving)."""
        if isinstance(self.optimizer, fopt.ForgeOptimizer):
            self.optimizer.synchronize()

    def comm_bytes(self) -> dict:
        """Bytes this replica has received for data parallelism, by kind (FORGE-DP: tokens,
        reduce-scatter, weight all-gather, gradient all-reduce of the standard path; forge
        off: gradient all-reduce)."""
        if isinstance(self.optimizer, fopt.ForgeOptimizer):
            return self.optimizer.comm_bytes()
        return {"gradient all-reduce": self._allreduce_bytes}

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train_step(self, loss_fn) -> StepStats:
        """loss_fn() runs the forward and returns the scalar loss (identical on all TP ranks).
        A list of loss functions is one step of gradient accumulation over micro-batches (each
        loss scaled by 1 / len). With FORGE, accumulation and clipping defer the fused updates to
        the end of the step over the stashed token segments (ForgeOptimizer.defer_updates)."""
        fns = list(loss_fn) if isinstance(loss_fn, (list, tuple)) else [loss_fn]
        fused = isinstance(self.optimizer, fopt.ForgeOptimizer)
        if fused and (len(fns) > 1 or self.clip_grad > 0):
            self.optimizer.defer_updates()  # exact accumulation / clipping over segments
        if self.lr_schedule is not None:
            lr = float(self.lr_schedule(self.iteration))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        total = 0.0
        for fn in fns:
            loss = fn()
            (loss / len(fns)).backward()
            total += loss.detach().double() / len(fns)
        if world(self.dp_group) > 1:  # the reported loss: the mean over the replicas
            dist.all_reduce(total, group=self.dp_group)
            total = total / world(self.dp_group)
        total = float(total)
        self._reduce_partial_grads()
        if fused:
            self.optimizer.reduce_dp_grads()
        else:
            self._allreduce_bytes += average_gradients(self.model.parameters(), self.dp_group)
        if self.clip_grad > 0:  # the norm before any update, then one scale for every weight
            norm = self._global_grad_norm(deferred=True)
            factor = self.clip_grad / (norm + 1e-6)
            if fused:
                self.optimizer.scale_gradients(factor)
                self.optimizer.flush()
            elif factor < 1.0:
                scale_grads_(self.model.parameters(), factor)
        else:
            if fused:
                self.optimizer.flush()  # no-op unless accumulating
            norm = self._global_grad_norm()
        bad = [] if math.isfinite(norm) else self._nonfinite_names()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return StepStats(total, norm, self.lr(), bad)

    def _nonfinite_names(self, sums: dict | None = None) -> list:
        """Which weights had a non-finite gradient, agreed over every rank (each sees only its
        shards); called when the global norm is not finite, so every rank calls it. sums: the
        fused weights' squared norms saved before step() (a replayed CUDA graph's)."""
        names, flags = [], []
        fused = self.optimizer._fused if isinstance(self.optimizer, fopt.ForgeOptimizer) else {}
        if fused:
            bad = set(self.optimizer.nonfinite_weights(sums))
            names += list(fused.values())
            flags += [n in bad for n in fused.values()]
        for n, p in self.model.named_parameters():
            if p.grad is not None and p not in fused:
                names.append(n)
                flags.append(not bool(torch.isfinite(p.grad).all()))
        vec = torch.tensor(flags, dtype=torch.float32,
                           device=next(self.model.parameters()).device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        return [n for n, f in zip(names, vec.tolist()) if f > 0]

    def _reduce_partial_grads(self):
        if world(self.tp_group) == 1:
            return
        for p in self._grad_sum:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.tp_group)

    def _global_grad_norm(self, deferred: bool = False) -> float:
        """deferred: the fused gradients are still segments (norm-only kernel pass)."""
        return math.sqrt(float(self._grad_norm_sq(deferred)))

    def _grad_norm_sq(self, deferred: bool = False) -> torch.Tensor:
        """The squared global gradient norm as a device tensor (no host synchronization: a
        CUDA graph captures it); see _global_grad_norm."""
        dev = next(self.model.parameters()).device
        shard = torch.zeros((), dtype=torch.float32, device=dev)
        repl = torch.zeros((), dtype=torch.float32, device=dev)
        if isinstance(self.optimizer, fopt.ForgeOptimizer):
            shard = shard + (self.optimizer.deferred_sumsq(dev) if deferred
                             else self.optimizer.pending_sumsq(dev))
        fused = self.optimizer._fused if isinstance(self.optimizer, fopt.ForgeOptimizer) else {}
        grads = [p for p in self.model.parameters() if p.grad is not None and p not in fused]
        shard = shard + sumsq_all([p.grad for p in grads if id(p) in self._sharded], dev)
        repl = repl + sumsq_all([p.grad for p in grads if id(p) not in self._sharded], dev)
        if world(self.tp_group) > 1:
            dist.all_reduce(shard, group=self.tp_group)
        return shard + repl

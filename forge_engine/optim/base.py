"""ForgeOptimizer: a torch.optim.Optimizer whose fused weights are updated inside backward.

Construction takes the model, swaps every eligible nn.Linear for a ForgeLinear in place (same
module and Parameter objects, same state_dict keys) and binds each such weight to this optimizer
through a _Slot. During loss.backward() each fused weight is stepped by the fused kernel the
moment its input gradient has been computed (forge_engine/linear.py). opt.step() then steps the
remaining ("standard path") parameters from their materialized .grad with the same kernel (the
gradient handed to it as a materialized segment), and closes the step.

Hyperparameters are read from param_groups at backward time, so torch LR schedulers work
unchanged: schedule.step() after opt.step() sets the lr the next backward uses.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections import Counter, defaultdict

import torch
from torch import nn

from forge_engine.kernels import FORMATS, StateTensor, fused_wgrad_update
from forge_engine.linear import bind, bound, fusable_weights
from forge_engine.optim import debug_nonfinite
from forge_engine.kernels.rules import GRAD_SCALE, HP_LEN, hparams, rule_spec, set_seed_bits
from forge_engine.optim.clipping import scale_grad_, scale_grads_, sumsq_all
from forge_engine.optim.fused_grad import FusedGrad
from forge_engine.parallel.data_parallel import RowShard, average_gradients
from forge_engine.parallel.mappings import world

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


class _Slot:
    """Binds one fused weight to its optimizer; called from ForgeLinearFunction.backward."""

    def __init__(self, opt: "ForgeOptimizer", param: nn.Parameter, name: str,
                 consumers: int = 1):
        self.opt, self.param, self.name = opt, param, name
        self.last_step = -1
        # a weight with several consumers (tied embedding and LM head) always stashes its
        # segments and is updated once, after every consumer's backward, at step()
        self.consumers = consumers
        self.deferred = consumers > 1
        self.grad = None  # its FusedGrad (made at the first backward), shown as param.grad
        self.factor = None  # scaling of the pending gradient (clipping, unscaling): None = 1
        self.count = 0  # segments stashed since the last update (or discard)

    def _stashing(self) -> bool:
        return self.deferred or self.opt._defer or self.opt._mode != "backward"

    def wait_weight(self):
        """Data parallelism: finish the all-gather of this weight's updated rows (before a
        forward reads it)."""
        if self.opt._inflight:
            self.opt._wait_rows(self.param)

    def start_exchange(self, dy2: torch.Tensor):
        """Data parallelism, token path: start the dY exchange now, so it runs behind the dX
        GEMM; None when nothing is to start (no data parallelism, or a stashed segment)."""
        if self._stashing() or self.param not in self.opt._shards:
            return None
        return self.opt._dp_start(self.param, dy2)

    def begin_backward(self):
        if self.opt._static is not None:  # a step after capture: its rows must be written
            self.opt._static.check_ready(self.opt._param_names[self.param])
        if self._stashing():  # segments are stashed, W is unchanged: any number of backwards
            return
        if self.last_step == self.opt._global_step:
            raise RuntimeError(
                f"forge_engine: a second backward reached FORGE linear '{self.name}' before "
                f"optimizer.step(); its weight was already updated in this step. This happens "
                f"with gradient accumulation or when one module is applied twice in a forward: "
                f"create the optimizer with updates='step' (or call "
                f"optimizer.defer_updates() before the backward passes of such a step)")
        self.last_step = self.opt._global_step

    def update(self, x2: torch.Tensor, dy2: torch.Tensor, early=None):
        """A dense token segment: x2 [T, K], dy2 [T, N] (a linear's input and output grad);
        early: what start_exchange returned."""
        if self._stashing():  # a segment of this step's dW = [dY_1; dY_2]^T [X_1; X_2]
            self.opt._expose(self, applied=False)
            self.count += 1
            self.opt._stash(self.param, ("dense", x2.detach(), dy2.detach()))
        else:
            self.opt._expose(self, applied=True)
            self.opt._fused_update(self.param, x2, dy2, early=early)

    def update_onehot(self, ids: torch.Tensor, e: torch.Tensor):
        """A one-hot segment: ids [T] (row of the weight, -1 for none), e [T, K] (an embedding
        lookup's output gradient): dW[n] += sum_t [ids[t] == n] e[t]."""
        if self._stashing():
            self.opt._expose(self, applied=False)
            self.count += 1
            self.opt._stash(self.param, ("onehot", ids.detach(), e.detach()))
        else:
            self.opt._expose(self, applied=True)
            self.opt._fused_update(self.param, None, None, (ids, e))


class _StaticHparams:
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


class ForgeOptimizer(torch.optim.Optimizer):
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
            raise TypeError(f"{type(self).__name__}: the first argument is the model (an "
                            f"nn.Module whose nn.Linear layers FORGE will update), got "
                            f"{type(model).__name__}")
        if state_dtype is not None and state_dtype not in FORMATS:
            raise ValueError(f"state_dtype must be one of {FORMATS} (or None for the weight's "
                             f"default), got {state_dtype!r}")
        if updates not in self.UPDATES:
            raise ValueError(f"updates must be one of {self.UPDATES}, got {updates!r}")
        self.updates = updates
        self._mode = None if updates == "auto" else updates  # auto: decided by step 1
        self.kind, self.variant = kind, variant
        self.spec = rule_spec(kind, variant)
        self.state_dtype = state_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(torch.initial_seed() if seed is None else seed) & 0x7FFFFFFF
        self._global_step = 0
        self._sumsq: dict = {}
        self._sumsq_views: dict = {}  # p -> its [1] slot of self._sumsq (see _sumsq_of)
        # (device, hp values) -> the fp32 tensor on the device: the weights of one group share
        # their hyperparameters within a step, so one host-to-device copy serves them all
        self._hp_cache: dict = {}
        # fused-norm writes so far, and pending_sumsq's last (key, total): one all-reduce when
        # the total is asked for twice with nothing written in between
        self._sumsq_writes = 0
        self._pending = None
        self.grad_norm: torch.Tensor | None = None
        self._defer = False  # defer_updates(): stash token segments until step()
        self._segments: dict = {}  # weight -> [("dense", x, dy) | ("onehot", ids, e), ...]
        self._buffers: dict = {}  # weight -> fp32 dW, where segments would cost more memory
        self.accumulation = {}  # weight name -> "segments" | "fp32 buffer" (last choice made)
        self._grad_scale = 1.0  # set by clip_grad_norm_ for the deferred updates
        self._clipped_norm = None
        self._static = None  # capture_static_step(): persistent hp rows (a CUDA graph's step)
        self._slots: dict = {}  # fused weight -> its _Slot
        self._shown: list = []  # slots whose FusedGrad is some weight's .grad now
        self._norm_cache: dict = {}  # weight -> (its slot's count, raw ||dW||^2 [1])
        # FORGE_DEBUG_NONFINITE=1: each update's inputs kept until the step ends
        self._recorder = debug_nonfinite.UpdateRecorder() if debug_nonfinite.enabled() else None

        named = list(model.named_parameters(remove_duplicate=False))
        uses = Counter(id(p) for _, p in named)
        aliases = defaultdict(list)
        for n, p in named:
            aliases[id(p)].append(n)
        params, seen = [], set()
        for _, p in named:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if not params:
            raise ValueError(f"{type(self).__name__}: the model has no parameter that "
                             f"requires grad")

        asked = {id(x) if torch.is_tensor(x) else x for x in standard}
        consumers = defaultdict(list)  # id(weight) -> [(module name, module, key)]
        refused = {}  # id(weight) -> why its module cannot be fused
        inside = set()  # submodules whose weights their parent module's forward uses
        for mname, m in model.named_modules():
            if id(m) in inside:
                continue
            what = fusable_weights(m)
            if what is None:
                continue
            if bound(m):
                raise ValueError(f"module '{mname}' is already updated by another FORGE "
                                 f"optimizer; create one optimizer per model")
            if isinstance(m, nn.MultiheadAttention):
                inside.add(id(m.out_proj))
                if isinstance(what, str):
                    for w in (m.in_proj_weight, m.q_proj_weight, m.out_proj.weight):
                        if w is not None:
                            refused[id(w)] = what
                    continue
            if isinstance(what, str):
                refused[id(m.weight)] = what
                continue
            for key, w in what:
                if w.requires_grad:
                    consumers[id(w)].append((mname, m, key))
        fused = []  # (weight name, weight, its consumers)
        self.standard_reasons = {}
        for n, w in named:
            if w.dim() != 2 or not w.requires_grad or aliases[id(w)][0] != n \
                    or id(w) in consumers:
                continue
            self.standard_reasons[n] = refused.get(id(w)) or \
                "not the weight of an nn.Linear, nn.Embedding or nn.MultiheadAttention"
        for mods in consumers.values():
            key = mods[0][2]
            w = mods[0][1].get_parameter(key)
            wname = aliases[id(w)][0]
            if refused.get(id(w)):
                self.standard_reasons[wname] = refused[id(w)]
            elif uses[id(w)] > len(mods):  # also a parameter of a module FORGE cannot fuse
                self.standard_reasons[wname] = "shared by " + ", ".join(aliases[id(w)])
            elif w.dtype not in (torch.float32, torch.bfloat16):
                self.standard_reasons[wname] = f"dtype {w.dtype} (fp32 or bf16 fuse)"
            elif id(w) in asked or any(a in asked for a in aliases[id(w)]):
                self.standard_reasons[wname] = "asked for (standard=...)"
            elif not fuse:
                self.standard_reasons[wname] = "fuse=False"
            else:
                fused.append((wname, w, mods))
        for wname, why in self.standard_reasons.items():
            if why.startswith("shared"):
                warnings.warn(f"forge_engine: weight '{wname}' is {why}; it stays on the "
                              f"standard optimizer path (materialized gradient): one of its "
                              f"users is not a module FORGE updates (nn.Linear, nn.Embedding, "
                              f"nn.MultiheadAttention or a forge_engine parallel layer)",
                              stacklevel=3)

        super().__init__(params, defaults)
        self._index = {p: i for i, p in enumerate(params)}
        self._fused = {}
        self.fused_names = []
        for wname, w, mods in fused:
            slot = _Slot(self, w, wname.rsplit(".", 1)[0] or "<root>", consumers=len(mods))
            self._slots[w] = slot
            for _, m, key in mods:
                bind(m, key, slot)  # in place: same module, Parameters, state keys
            self._fused[w] = wname
            self.fused_names.append(wname)
            w.register_hook(self._foreign_grad_hook(wname))
        first = [(n, p) for n, p in named if p.requires_grad and aliases[id(p)][0] == n]
        self._param_names = {p: n for n, p in first}
        self._named2d = [(n, p) for n, p in first if p.dim() == 2]

        # data parallelism (FORGE-DP): row shards, their in-flight row all-gathers, the
        # deferred weights' prepared operands
        self.dp_group, self.dp_size = dp_group, world(dp_group)
        self._shards = {w: RowShard.of(w, dp_group) for w in self._fused} \
            if self.dp_size > 1 else {}
        if self._shards and self._mode is None:  # a row shard's .grad cannot answer torch's
            self._mode = "backward"  # clipping: FORGE-DP clips with clip_grad_norm_ (ours)
        self._inflight: dict = {}
        self._ready: dict = {}
        self._dp_grads_reduced = False
        self.dp_allreduce_bytes = 0
        if self._shards:  # model.state_dict() sees complete weights, and an in-flight row
            # gather never lands on weights model.load_state_dict() has just written
            model.register_state_dict_pre_hook(lambda *args, **kwargs: self.synchronize())
            model.register_load_state_dict_pre_hook(lambda *args, **kwargs: self.synchronize())

    # ----------------------------------------------------------------------- state handling

    @staticmethod
    def _foreign_grad_hook(wname: str):
        def hook(grad):
            if grad is None:  # what ForgeLinearFunction returns for the weight
                return None
            raise RuntimeError(
                f"forge_engine: FORGE weight '{wname}' received a gradient from outside its "
                f"FORGE linear (the tensor is used by another operation too). Its update is "
                f"fused into the linear's backward, so that gradient would be lost; keep the "
                f"weight to one nn.Linear, or leave this model to a torch.optim optimizer")
        return hook

    def _format(self, p: torch.Tensor) -> str:
        if self.state_dtype is not None:
            return self.state_dtype
        return "bf16" if p.dtype == torch.bfloat16 else "fp32"

    def _group_of(self, p):
        """p's param group, cached: called for every fused weight in every backward. Group
        dicts are only ever updated in place (load_state_dict too), so the cache stays true."""
        cache = self.__dict__.setdefault("_group_cache", {})
        if p not in cache:
            g = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
            if g is None:
                raise KeyError("parameter not managed by this optimizer")
            cache[p] = g
        return cache[p]

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

    def _begin(self, p, group, grad_scale: float = 1.0):
        """State, 1-based step, hp list and host scalars for the update of p."""
        st = self._init_state(p, group)
        step, scalars = self._next_step(st)
        hp = hparams(self.kind, group, step, scalars, grad_scale)
        return st, step, hp, scalars

    @staticmethod
    def _next_step(st) -> tuple:
        """The 1-based step an update of this state makes, and its host scalars (a dict)."""
        return int(st["step"].item()) + 1, {k: float(st[k]) for k in SCALAR_KEYS if k in st}

    @staticmethod
    def _finished(step, scalars) -> dict:
        """The state entries an update leaves: its step count and host scalars, as tensors."""
        return {"step": torch.tensor(float(step)),
                **{k: torch.tensor(v, dtype=torch.float64) for k, v in scalars.items()}}

    @staticmethod
    def _finish(st, step, scalars):
        st.update(ForgeOptimizer._finished(step, scalars))

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
        """p's [1] slot of its device's fp32 vector of the fused weights' squared gradient
        norms in this step (the kernel's tile sums), indexed like the parameters. One slot per
        weight names a non-finite gradient; one vector makes zeroing and summing one launch.
        With data parallelism every fused weight is a row shard, and its slot holds the norm
        of the replicas' gradient SUM (D^2 times the mean's; pending_sumsq rescales)."""
        view = self._sumsq_views.get(p)
        if view is None or view.device != p.device:  # vectors are only zeroed in place
            key = str(p.device)
            if key not in self._sumsq:
                self._sumsq[key] = torch.zeros(len(self._index), dtype=torch.float32,
                                               device=p.device)
            i = self._index[p]
            view = self._sumsq_views[p] = self._sumsq[key][i:i + 1]
        return view

    def _dp_total(self, local: torch.Tensor) -> torch.Tensor:
        """Shards' squared norms of the replicas' gradient sum -> squared norm of the mean
        gradient over all shards (an all-reduce over the data-parallel group)."""
        local = local / float(self.dp_size) ** 2
        torch.distributed.all_reduce(local, group=self.dp_group)
        return local

    def pending_sumsq(self, device) -> torch.Tensor:
        """Sum of squares of the gradients fused so far in this step (0-d tensor on device):
        the in-kernel tile sums (with data parallelism: over every replica's shard, which costs
        one scalar all-reduce); step() folds them into grad_norm and resets them."""
        key = (self._sumsq_writes, str(device))
        if self._pending is not None and self._pending[0] == key:  # nothing written since:
            return self._pending[1]  # the Engine's norm and step() share one all-reduce
        total = sum((v.sum().to(device) for v in self._sumsq.values()),
                    torch.zeros((), dtype=torch.float32, device=device))
        total = self._dp_total(total) if self._shards else total
        self._pending = (key, total)
        return total

    # ------------------------------------------------------------- data parallelism
    def synchronize(self):
        """Finish every in-flight all-gather of updated rows (data parallelism): afterwards
        every replica's weights are complete and equal. Forward passes wait for their own
        weight; call this before reading weights any other way (model.state_dict() does)."""
        for pending in self._inflight.values():
            pending.wait()
        self._inflight.clear()

    def _wait_rows(self, p):
        pending = self._inflight.pop(p, None)
        if pending is not None:
            pending.wait()

    def reduce_dp_grads(self):
        """Average the standard-path gradients over the data-parallel replicas (ordinary DP,
        once per step; step() does it if the caller has not)."""
        if self.dp_size > 1 and not self._dp_grads_reduced:
            self.dp_allreduce_bytes += average_gradients(self._standard_params(), self.dp_group)
        self._dp_grads_reduced = True

    def comm_bytes(self) -> dict:
        """Bytes this replica received for data parallelism so far, by kind: token gathering,
        gradient reduce-scatter, weight-row all-gather (fused weights), gradient all-reduce
        (standard path)."""
        out = {"tokens": 0, "reduce-scatter": 0, "weight all-gather": 0}
        for sh in self._shards.values():
            for k, v in sh.bytes.items():
                out[k] += v
        out["gradient all-reduce"] = self.dp_allreduce_bytes
        return out

    def _dp_choice(self, p, t: int, t1: int, e_x: int, e_dy: int, e_oh: int) -> str:
        sh = self._shards[p]
        mode, tok, rs = sh.choose(t, t1, e_x, e_dy, e_oh)
        if mode != sh.mode:
            logger.info("forge_engine: data-parallel %s: %s (%.2f MiB per replica by token "
                        "gathering, %.2f MiB by reduce-scatter of dW)", self._fused[p],
                        "gathers tokens" if mode == "tokens" else "reduce-scatters its gradient",
                        tok / 2 ** 20, rs / 2 ** 20)
            sh.mode = mode
        return mode

    def _dp_start(self, p, dy2: torch.Tensor):
        """A fused backward's early half: the choice, and the dY exchange if tokens."""
        e = p.element_size()
        if self._dp_choice(p, dy2.shape[0], 0, e, e, e) != "tokens":
            return ("reduce-scatter", None)
        return ("tokens", self._shards[p].exchange_columns(dy2.to(p.dtype), async_op=True))

    def _dp_ready(self, p, x, dy, onehot, early=None):
        """This replica's operands for its shard of p: ("tokens", x_all, dy_cols, onehot) by
        gathering every replica's segments, or ("grad", g) with g the reduce-scattered fp32
        gradient sum of the shard rows."""
        sh = self._shards[p]
        e = p.element_size()
        if early is None:
            t = x.shape[0] if x is not None else 0
            t1 = onehot[0].shape[0] if onehot is not None else 0
            early = ("tokens", None) if self._dp_choice(p, t, t1, e, e, e) == "tokens" \
                else ("reduce-scatter", None)
        if early[0] != "tokens":
            g = self._segment_grad(p, ("dense", x, dy)) if x is not None else None
            if onehot is not None:
                oh = self._segment_grad(p, ("onehot", *onehot))
                g = oh if g is None else g.add_(oh)
            return ("grad", sh.reduce_scatter(g))
        x_all = dy_cols = oh = None
        if x is not None:
            dy_pend = early[1] or sh.exchange_columns(dy.to(p.dtype), async_op=True)
            x_all = sh.gather(x.to(p.dtype)).wait()  # needed at once (not overlapped)
            dy_cols = dy_pend.wait()
        if onehot is not None:
            ids_p = sh.gather(onehot[0], async_op=True)
            e_all = sh.gather(onehot[1].to(p.dtype), async_op=True).wait()
            oh = (sh.local_ids(ids_p.wait()), e_all)
        return ("tokens", x_all, dy_cols, oh)

    def _dp_apply(self, p, ready):
        """Step this replica's shard of p from _dp_ready's operands, then start the
        all-gather of the updated rows."""
        sh = self._shards[p]
        self._wait_rows(p)
        # both forms go through the kernel: a materialized shard gradient is one more segment
        x, dy, onehot = ready[1:] if ready[0] == "tokens" else (None, None, None)
        grad = ready[1] if ready[0] == "grad" else None
        self._kernel_step(p, p.detach()[sh.r0:sh.r1], x, dy, onehot, grad,
                          self._grad_scale / sh.size,  # the mean over replicas, as DDP
                          dp_rank=sh.rank)
        self._inflight[p] = sh.gather_rows(p.detach())

    def _prepared(self, p):
        """A deferred sharded weight's operands, prepared once (the clipping pre-pass and the
        update share them): its segments gathered, or its fp32 buffer reduce-scattered."""
        if p not in self._ready:
            if p in self._buffers:
                sh = self._shards[p]
                if sh.mode != "buffer":
                    logger.info("forge_engine: data-parallel %s: reduce-scatters its fp32 "
                                "accumulation buffer (%.2f MiB per replica)", self._fused[p],
                                (sh.size - 1) * sh.per * sh.k * 4 / 2 ** 20)
                    sh.mode = "buffer"
                self._ready[p] = ("grad", sh.reduce_scatter(self._buffers.pop(p)))
            else:
                x, dy, onehot = self._joined(p)
                del self._segments[p]
                self._ready[p] = self._dp_ready(p, x, dy, onehot)
        return self._ready[p]

    def _deferred_order(self) -> list:
        """Deferred weights in one order on every replica (their collectives must match)."""
        return list(dict.fromkeys([*self._ready, *self._segments, *self._buffers]))

    # ------------------------------------------------------------- deferred segments
    def defer_updates(self):
        """Until the next step(), fused layers stash their token segments (X, dY) instead of
        updating (DESIGN.md: dW = [dY_1; dY_2; ...]^T [X_1; X_2; ...]). Then several backward
        passes (gradient accumulation over micro-batches) or several uses of one module in a
        forward are exact, and clip_grad_norm_ can see the whole gradient before any update.
        Cost: every fused layer's X and dY stay alive until step() (activation-sized)."""
        self._defer = True
        return self

    @staticmethod
    def _segment_grad(p, seg) -> torch.Tensor:
        """The fp32 dW [N, K] of one segment, materialized (fp32-buffer accumulation and the
        data-parallel reduce-scatter only)."""
        kind, a, b = seg
        if kind == "dense":
            if b.is_cuda and b.dtype == a.dtype == torch.bfloat16:
                try:  # bf16 operands on the tensor cores, fp32 accumulation and output
                    return torch.mm(b.t(), a, out_dtype=torch.float32)
                except (TypeError, RuntimeError):  # a torch without mm(out_dtype=)
                    pass
            return b.float().t() @ a.float()
        g = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        hit = (a >= 0)[:, None]  # rows of id -1 add nothing, not even a NaN; no boolean
        # indexing, which would wait for the device (and cannot be captured in a CUDA graph)
        return g.index_add_(0, a.clamp(min=0), torch.where(hit, b.float(), 0.0))

    def _stash(self, p, seg):
        """Keep a token segment of p's gradient, or add it to p's fp32 buffer once the segments
        of this step would take more memory than that buffer (N K x 4 bytes): chosen per weight,
        automatically, and logged."""
        if p in self._buffers:
            self._buffers[p] += self._segment_grad(p, seg)
            return
        segs = self._segments.setdefault(p, [])
        segs.append(seg)
        held = sum(t.numel() * t.element_size() for s_ in segs for t in s_[1:])
        if held > p.numel() * 4:
            buf = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for s_ in segs:
                buf += self._segment_grad(p, s_)
            self._buffers[p] = buf
            del self._segments[p]
            name = self._fused[p]
            if self.accumulation.get(name) != "fp32 buffer":
                logger.info("forge_engine: %s accumulates in an fp32 gradient buffer (%.1f MiB) "
                            "instead of token segments (%.1f MiB so far)", name,
                            buf.numel() * 4 / 2 ** 20, held / 2 ** 20)
            self.accumulation[name] = "fp32 buffer"
        else:
            self.accumulation[self._fused[p]] = "segments"

    def deferred_bytes(self) -> int:
        """Memory held until step() by deferred updates: token segments and fp32 buffers."""
        return sum(b.numel() * 4 for b in self._buffers.values()) + self._segment_bytes()

    def _segment_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for segs in self._segments.values()
                   for seg in segs for t in seg[1:])

    def _joined(self, p):
        """p's segments -> (x, dy) of the dense ones (or None, None) and (ids, e) of the
        one-hot ones (or None), each concatenated along the token axis. The joined tensors
        replace the list, so the clipping pre-pass and the update concatenate only once."""
        segs = self._segments[p]

        def cat(kind, i):
            parts = [seg[i] for seg in segs if seg[0] == kind]
            return (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
        x, dy = cat("dense", 1), cat("dense", 2)
        onehot = (cat("onehot", 1), cat("onehot", 2)) if any(s[0] == "onehot" for s in segs) \
            else None
        self._segments[p] = ([("dense", x, dy)] if x is not None else []) + \
            ([("onehot", *onehot)] if onehot is not None else [])
        return x, dy, onehot

    def _norm_only(self, p, w, x, dy, onehot) -> torch.Tensor:
        """||dy^T x + onehot(ids)^T e||^2 ([1] fp32) over the rows of w (p or its shard), by the
        kernel's norm-only pass: reads the segments, writes nothing."""
        acc = torch.zeros(1, dtype=torch.float32, device=p.device)
        hp = torch.zeros(HP_LEN, dtype=torch.float32, device=p.device)
        fused_wgrad_update(x, dy, w, self._states(self._init_state(p, self._group_of(p))),
                           self.spec, hp, acc, 0, False, norm_only=True, onehot=onehot)
        return acc

    @torch.no_grad()
    def deferred_sumsq(self, device) -> torch.Tensor:
        """||dW||^2 summed over the deferred weights, by the kernel's norm-only pass (reads the
        segments, writes nothing): the exact-clipping pre-pass, about one dW GEMM per weight.
        With data parallelism each replica sums its shards and one all-reduce adds them up."""
        total = torch.zeros(1, dtype=torch.float32, device=device)
        dp = torch.zeros(1, dtype=torch.float32, device=device)
        for p in self._deferred_order():
            sh = self._shards.get(p)
            if sh is not None:
                ready = self._prepared(p)
                if ready[0] == "grad":
                    dp += ready[1].pow(2).sum().to(device)
                elif sh.rows:
                    dp += self._norm_only(p, p.detach()[sh.r0:sh.r1], *ready[1:]).to(device)
            else:
                total += self._scaled_sumsq(p).to(device)
        if self._shards:
            total += self._dp_total(dp)
        return total[0]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Exact global-norm clipping with FORGE, as torch.nn.utils.clip_grad_norm_ on the
        materialized gradients: needs defer_updates() before the backward passes. Returns the
        total norm before clipping, over this process's parameters only: under tensor
        parallelism use Engine(clip_grad=...), whose norm is reduced over the group."""
        if self._fused and self._mode == "backward" and not self._defer:
            raise RuntimeError("forge_engine: clip_grad_norm_ with updates='backward' needs "
                               "optimizer.defer_updates() before backward: otherwise the fused "
                               "weights are already updated")
        dev = next(iter(self._index)).device
        self.reduce_dp_grads()
        total = self.deferred_sumsq(dev)
        grads = [p.grad for p in self._standard_params() if p.grad is not None]
        norm = torch.sqrt(total + sumsq_all(grads, dev))
        self.scale_gradients(float(max_norm / (float(norm) + 1e-6)))
        self._clipped_norm = norm
        return norm

    @torch.no_grad()
    def scale_gradients(self, factor):
        """Clip by `factor` (applied only if < 1): the deferred fused updates and the standard
        path's .grad alike. factor may be a 0-d fp32 device tensor after capture_static_step
        (a captured step computes it on the device): min(1, factor) is then written into the
        fused weights' hp rows (GRAD_SCALE) and multiplies the standard path's .grad, with no
        host synchronization."""
        if torch.is_tensor(factor):
            if self._static is None:
                raise RuntimeError("forge_engine: scale_gradients(tensor) needs "
                                   "capture_static_step(); pass a float otherwise")
            factor = factor.to(torch.float32).clamp(max=1.0)
            self._static.dev[self._static.fused_rows, GRAD_SCALE] = factor
        elif factor < 1.0:
            self._grad_scale = factor
        else:
            return
        scale_grads_(self._standard_params(), factor)

    def flush(self):
        """Apply the deferred updates now (one fused kernel per weight over its segments)."""
        self._defer = False
        for p in self._deferred_order():
            slot = self._slots[p]
            if slot.grad is not None and p.grad is not slot.grad:
                # its .grad was cleared after backward (zero_grad, `.grad = None`): like
                # torch.optim for a parameter without a gradient, no update
                self._discard(p)
                continue
            factor, slot.factor, slot.count = slot.factor, None, 0
            self._norm_cache.pop(p, None)
            if p in self._shards:
                self._dp_apply(p, self._prepared(p))
                del self._ready[p]
            elif p in self._buffers:  # the kernel steps p from its buffer, as from segments
                self._fused_update(p, None, None, grad=self._buffers.pop(p), factor=factor)
            else:
                x, dy, onehot = self._joined(p)
                del self._segments[p]
                self._fused_update(p, x, dy, onehot, factor=factor)
        self._grad_scale = 1.0

    # ------------------------------------------------------- the fused weights' .grad
    def _expose(self, slot, applied: bool):
        """Show slot's FusedGrad as its weight's .grad (backward of one of its consumers).
        applied: the update runs now (updates='backward'), so the gradient is gone after it.
        A .grad cleared since the weight's last segments means those segments are gone too
        (zero_grad between backward passes), as a cleared gradient in torch."""
        p, g = slot.param, slot.grad
        if g is None:
            g = slot.grad = FusedGrad(slot)
        if p.grad is not g:
            if p.grad is not None:
                raise RuntimeError(f"forge_engine: FORGE weight '{self._fused[p]}' has a .grad "
                                   f"that other code set; its gradient is fused into the "
                                   f"update and cannot be added to that tensor")
            if slot.count:
                self._discard(p)
            p.grad = g
            self._shown.append(slot)
        elif not applied and self._mode is None and slot.count >= slot.consumers:
            self._decide_step("a second backward before step() (gradient accumulation, or a "
                              "module applied twice)")
        g.applied = applied

    def _hide_grads(self):
        for slot in self._shown:
            if slot.param.grad is slot.grad:
                slot.param.grad = None
        self._shown = []

    def _discard(self, p):
        """Drop p's pending gradient (its segments, buffer, prepared shard operands)."""
        for held in (self._segments, self._buffers, self._ready, self._norm_cache):
            held.pop(p, None)
        slot = self._slots[p]
        slot.count, slot.factor = 0, None

    def zero_grad(self, set_to_none: bool = True):
        """As torch.optim's: every gradient is cleared, the fused weights' pending segments
        included (the step GradScaler skipped, say); a fused weight's .grad becomes None."""
        self._hide_grads()
        for p in self._deferred_order():
            self._discard(p)
        super().zero_grad(set_to_none)

    def _decide_step(self, why: str):
        self._mode = "step"
        logger.info("forge_engine: %s; the fused weights are updated in step() from stashed "
                    "token segments (updates='step')", why)

    def _raw_sumsq(self, p) -> torch.Tensor:
        """||dW||^2 [1] fp32 of p's pending gradient before any FusedGrad scaling: the
        kernel's norm-only pass over its segments, kept until another segment arrives."""
        slot = self._slots[p]
        hit = self._norm_cache.get(p)
        if hit is not None and hit[0] == slot.count:
            return hit[1]
        if p in self._buffers:
            s = self._buffers[p].pow(2).sum().reshape(1)
        elif p in self._segments:
            x, dy, onehot = self._joined(p)
            s = self._norm_only(p, p.detach(), *self._operands(p, x, dy, onehot),
                                self._onehot(p, onehot))
        else:
            s = torch.zeros(1, dtype=torch.float32, device=p.device)
        self._norm_cache[p] = (slot.count, s)
        return s

    def _scaled_sumsq(self, p) -> torch.Tensor:
        f = self._slots[p].factor
        s = self._raw_sumsq(p)
        return s if f is None else s * (f * f)

    def _grad_check(self, slot, what: str):
        """A FusedGrad operation is about to be answered: refused where the gradient is gone
        (updated in backward) or spread over data-parallel shards; in auto mode it decides
        updates='step'."""
        name = self._fused[slot.param]
        if slot.grad.applied:
            how = ("the first step ran a plain loop, so updates='auto' chose 'backward'"
                   if self.updates == "auto" else "updates='backward'")
            raise RuntimeError(
                f"forge_engine: {what} of FORGE weight '{name}' after its update: the fused "
                f"weights are updated inside backward ({how}), so their gradients can no "
                f"longer be clipped, unscaled or read. Create the optimizer with "
                f"updates='step' for a loop that does this between backward() and step()")
        if self._shards:
            raise RuntimeError(f"forge_engine: {what} of FORGE weight '{name}' under FORGE "
                               f"data parallelism (each replica holds a row shard): use "
                               f"optimizer.clip_grad_norm_(max_norm)")
        if self._mode is None:
            self._decide_step(f"{what} of a fused gradient between backward() and step()")

    def _grad_norm(self, slot, dtype=None) -> torch.Tensor:
        """The L2 norm of slot's pending gradient (0-d, in the weight's dtype as torch's
        norm of its .grad would be, or dtype)."""
        self._grad_check(slot, "the norm")
        n = self._scaled_sumsq(slot.param).sqrt().reshape(())
        return n.to(dtype or slot.param.dtype)

    def _grad_scale_by(self, slot, f, divide: bool = False):
        """Multiply (divide) slot's pending gradient by f: a number or a one-element tensor."""
        self._grad_check(slot, "scaling")
        if torch.is_tensor(f):
            f = f.detach().reshape(()).to(device=slot.param.device, dtype=torch.float32)
            f = f.reciprocal() if divide else f
        else:
            f = 1.0 / float(f) if divide else float(f)
        slot.factor = f if slot.factor is None else slot.factor * f

    def _grad_unscale(self, slot, found_inf: torch.Tensor, inv_scale: torch.Tensor):
        """torch.amp.GradScaler's unscale and inf check: multiply by inv_scale; found_inf
        becomes 1 where the gradient is not finite (its squared norm is not)."""
        self._grad_check(slot, "GradScaler's unscale")
        self._grad_scale_by(slot, inv_scale)
        bad = ~torch.isfinite(self._raw_sumsq(slot.param)).reshape(found_inf.shape)
        found_inf.masked_fill_(bad.to(found_inf.device), 1.0)

    def _standard_params(self) -> list:
        """The parameters whose .grad is a real tensor: all but the fused weights."""
        return [p for g in self.param_groups for p in g["params"] if p not in self._fused]

    def _grad_zero(self, slot):
        if not slot.grad.applied:
            self._discard(slot.param)

    def _grad_refuse(self, slot, op: str, clamp: bool = False):
        name = self._fused[slot.param]
        if clamp:
            raise RuntimeError(
                f"forge_engine: {op} (element-wise clipping, clip_grad_value_) on the .grad of "
                f"FORGE weight '{name}': its gradient exists only tile by tile inside the "
                f"fused kernel. Clip by norm (torch.nn.utils.clip_grad_norm_), or keep the "
                f"weight on the standard path: {type(self).__name__}(model, ..., "
                f"standard=['{name}'])")
        raise RuntimeError(
            f"forge_engine: {op} on the .grad of FORGE weight '{name}': its gradient is fused "
            f"into the update and never materialized. Its .grad answers what clipping and "
            f"loss scaling do (the L2 norm, scaling by a number, GradScaler's unscale, "
            f"zeroing); to use the gradient otherwise keep the weight on the standard path: "
            f"{type(self).__name__}(model, ..., standard=['{name}'])")

    # ------------------------------------------------------------------------ the updates

    def _kernel_step(self, p, w, x=None, dy=None, onehot=None, grad=None,
                     grad_scale: float = 1.0, sumsq=None, dp_rank: int = 0, factor=None):
        """One optimizer step of w (p, its 2-D view, or this replica's rows of it) by the fused
        kernel, from any mix of segments: dense (x, dy), one-hot, a materialized fp32 grad.
        Adds ||gradient||^2 to sumsq (default: p's slot of the fused weights' norm vector).
        factor: a scaling of the gradient done through its FusedGrad (a float, or a 0-d
        device tensor: GradScaler's 1 / scale, a clip coefficient), applied on top of
        grad_scale; the norm added to p's slot is then that of the scaled gradient."""
        if factor is not None and not torch.is_tensor(factor):
            grad_scale, factor = grad_scale * factor, float(factor)
        static = self._static
        if static is not None:  # hp from p's persistent row, written by advance_static_step
            st = static.use(p, grad_scale)
            hp_t = static.dev[self._index[p], :HP_LEN]
        else:
            st, step, hp, scalars = self._begin(p, self._group_of(p), grad_scale)
            key = (p.device, tuple(hp), step)
            hp_t = self._hp_cache.get(key)
            if hp_t is None and w.numel():  # never written after creation: launches may
                hp_t = self._hp_row(hp, step).to(p.device, non_blocking=True)  # still read it
                self._hp_cache[key] = hp_t
        if w.numel():  # a replica may own no rows of a small weight
            if sumsq is None:
                self._sumsq_writes += 1  # pending_sumsq's cached total is stale now
            states, seed = self._states(st), self._seed_for(self._index[p], dp_rank)
            if self._recorder is not None and static is None:
                self._recorder.record(p, x, dy, w, states, hp_t, seed, self.stochastic_rounding,
                                      onehot, grad)
            if torch.is_tensor(factor):  # on the device: no wait for its value
                if static is not None:
                    raise RuntimeError("forge_engine: a FusedGrad scaling in a captured step")
                hp_t = hp_t.clone()
                hp_t[GRAD_SCALE:GRAD_SCALE + 1].mul_(factor.reshape(1))
            fused_wgrad_update(x, dy, w, states, self.spec, hp_t,
                               self._sumsq_of(p) if sumsq is None else sumsq, seed,
                               self.stochastic_rounding, onehot=onehot, grad=grad)
            if factor is not None and sumsq is None:  # the kernel summed the raw gradient
                self._sumsq_of(p).mul_(factor * factor)
        if static is None:
            self._finish(st, step, scalars)

    @staticmethod
    def _operands(p, x, dy, onehot):
        if x is None:
            return None, None
        return (x if x.dtype == p.dtype else x.to(p.dtype),
                dy if dy.dtype == p.dtype else dy.to(p.dtype))

    @staticmethod
    def _onehot(p, onehot):
        return (onehot[0], onehot[1].to(p.dtype)) if onehot is not None else None

    @torch.no_grad()
    def _fused_update(self, p: torch.Tensor, x2, dy2, onehot=None, early=None,
                      grad=None, factor=None):
        """Step fused weight p [N, K] with gradient dy2^T x2 (x2 [T, K], dy2 [T, N]) plus
        onehot(ids)^T e for a one-hot segment (ids [T1], e [T1, K]). With data parallelism:
        this replica's row shard, from every replica's segments (early: _dp_start's). grad: a
        materialized fp32 gradient [N, K] (an accumulation buffer) instead of segments."""
        if p in self._shards:
            self._dp_apply(p, self._dp_ready(p, x2, dy2, onehot, early))
            return
        self._kernel_step(p, p.detach(), *self._operands(p, x2, dy2, onehot),
                          self._onehot(p, onehot), grad, self._grad_scale, factor=factor)

    @torch.no_grad()
    def step(self, closure=None):
        """Step the standard-path parameters from their .grad and close the step.

        The fused weights were already updated during backward. After this call,
        `self.grad_norm` holds the global L2 norm of this step's gradients (fused tiles'
        in-kernel sums plus the standard path) as a 0-d tensor."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._defer or self._segments or self._buffers or self._ready:
            self.flush()
        self.reduce_dp_grads()
        total = None
        dev = next(iter(self._index)).device
        std = torch.zeros(1, dtype=torch.float32, device=dev)
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
                total = std
                # the same kernel, .grad as a materialized segment: one launch (a bf16 .grad
                # is widened in the kernel), no host sync; clipping scaled .grad itself
                grad = _as_2d(p.grad)
                if grad.dtype not in (torch.float32, p.dtype):
                    grad = grad.float()
                self._kernel_step(p, _as_2d(p.detach()), grad=grad, sumsq=std)
        if self._fused:  # the fused tiles' in-kernel sums of this step
            fused = self.pending_sumsq(dev)
            total = fused + std[0]
        elif total is not None:
            total = total[0]
        self.grad_norm = torch.sqrt(total) if total is not None else None
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
        return loss

    # ------------------------------------------------------------- CUDA graph replay
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
        self._static = _StaticHparams(self)

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

    def _dp_rank(self) -> int:
        return next(iter(self._shards.values())).rank if self._shards else 0

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore exactly (no dtype casting: bf16 / int8 states and fp32 scales stay as saved).
        A state dict of another optimizer kind, variant or parameter layout is rejected."""
        forge = state_dict.get("forge")
        if forge is None:
            raise ValueError("not a forge_engine optimizer state dict (no 'forge' entry)")
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
        self._global_step = forge["global_step"]
        self.state_dtype = forge["state_dtype"]
        self.stochastic_rounding = forge["stochastic_rounding"]

    def forge_summary(self) -> str:
        """One line: which 2-D weights the fused kernel updates, which stay standard (and why)."""
        mats = [(n, p) for n, p in self._named2d]
        std = [f"{n} ({self.standard_reasons[n]})" if n in self.standard_reasons else n
               for n, p in mats if p not in self._fused]
        fp = sum(p.numel() for p in self._fused)
        allp = sum(p.numel() for _, p in mats)
        dp = (f"; data-parallel x{self.dp_size}: each replica updates 1/{self.dp_size} of the "
              f"rows from all replicas' tokens, no gradient all-reduce") if self._shards else ""
        return (f"FORGE: fused {len(self._fused)} of {len(mats)} weight matrices ({fp} of {allp} "
                f"parameters); standard path: {', '.join(std) if std else 'none'}{dp}")

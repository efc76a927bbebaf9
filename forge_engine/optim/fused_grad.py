"""FusedGrad: what a fused weight shows as its `.grad`.

A fused weight's gradient never exists as a tensor: it is the token segments its linear saw
(dW = dY^T X, docs/design.md's identity), or, once the update ran in backward, nothing at all. Code
written for torch.optim still reads and changes `.grad` between backward() and step():
torch.nn.utils.clip_grad_norm_ takes its norm and multiplies it, torch.amp.GradScaler unscales
it and checks it for inf, zero_grad() clears it. A FusedGrad stands in the weight's `.grad`
(same shape, dtype and device, no storage) and answers exactly those operations from the
segments: its L2 norm by the kernel's norm-only pass, a scaling as a factor the fused update
applies, the inf check from that norm, zeroing as dropping the segments. Every other operation
on it is an error naming the weight, never a silent wrong answer.

The policy (whether an operation is allowed now, and what it does) is the optimizer's
(ForgeOptimizer._grad_op and the methods it calls); this file only routes aten calls to it.
"""
from __future__ import annotations

import weakref

import torch

aten = torch.ops.aten

# operations that need the gradient's values and cannot be answered from its norm
_CLAMPS = {"clamp_", "clamp_min_", "clamp_max_", "_foreach_clamp_min_", "_foreach_clamp_max_",
           "clip_"}


class FusedGrad(torch.Tensor):
    """The `.grad` of one fused weight [N, K] (a wrapper tensor without storage). slot: the
    weight's optimizer binding (slots.Slot)."""

    @staticmethod
    def __new__(cls, slot):
        p = slot.param
        t = torch.Tensor._make_wrapper_subclass(cls, p.shape, dtype=p.dtype, device=p.device,
                                                requires_grad=False)
        # a weak reference: the slot holds this tensor, and a reference cycle through a
        # tensor subclass is left to the garbage collector, which can crash on it
        t._slot = weakref.ref(slot)
        t.applied = False  # the update already ran (updates='backward'): nothing to answer
        return t

    @property
    def slot(self):
        slot = self._slot()
        if slot is None:
            raise RuntimeError("forge_engine: the .grad of a weight whose FORGE optimizer no "
                               "longer exists; set it to None")
        return slot

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        slot = self._slot()
        return f"FusedGrad(weight '{slot.name if slot else '?'}', shape {tuple(self.shape)})"

    def __deepcopy__(self, memo):  # a copy of a model carries no optimizer binding
        return None

    def __reduce_ex__(self, proto):
        raise RuntimeError(f"forge_engine: the .grad of FORGE weight '{self.slot.name}' has "
                           f"no values to save; call optimizer.zero_grad() first")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.startswith("_foreach_") or name == "_amp_foreach_non_finite_check_and_unscale_":
            return _foreach(func, name, args, kwargs)
        g = args[0]
        if not isinstance(g, FusedGrad):  # a FusedGrad as a later operand
            g = next(a for a in args if isinstance(a, FusedGrad))
            return g.slot.opt._grad_refuse(g.slot, name)
        opt, slot = g.slot.opt, g.slot
        if name in ("detach", "detach_", "alias"):
            return g
        if name == "zero_":
            opt._grad_zero(slot)
            return g
        if name in ("linalg_vector_norm", "norm"):
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
            dim = args[2] if len(args) > 2 else kwargs.get("dim")
            dtype = kwargs.get("dtype")
            if ord_ not in (2, 2.0, None) or dim not in (None, [], ()):
                return opt._grad_refuse(slot, f"{name}(ord={ord_}, dim={dim})")
            return opt._grad_norm(slot, dtype)
        if name in ("mul_", "div_"):
            other = args[1]
            if torch.is_tensor(other) and other.numel() != 1:
                return opt._grad_refuse(slot, f"{name} by a tensor of shape "
                                              f"{tuple(other.shape)}")
            opt._grad_scale_by(slot, other, divide=name == "div_")
            return g
        if name in _CLAMPS:
            return opt._grad_refuse(slot, name, clamp=True)
        return opt._grad_refuse(slot, name)


def _foreach(func, name, args, kwargs):
    """A foreach operation over a list that holds FusedGrads (and maybe ordinary tensors):
    the ordinary ones take the real operation, each FusedGrad its own answer, in list order."""
    tensors = list(args[0])
    fused = [i for i, t in enumerate(tensors) if isinstance(t, FusedGrad)]
    real = [i for i, t in enumerate(tensors) if not isinstance(t, FusedGrad)]
    opt = tensors[fused[0]].slot.opt

    def pick(seq, idx):
        return [seq[i] for i in idx]

    if name == "_amp_foreach_non_finite_check_and_unscale_":
        found_inf, inv_scale = args[1], args[2]
        if real:
            func(pick(tensors, real), found_inf, inv_scale)
        opt._grad_unscale([tensors[i].slot for i in fused], found_inf, inv_scale)
        return None
    if name == "_foreach_norm":
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = kwargs.get("dtype")
        out = [None] * len(tensors)
        if real:
            for i, n in zip(real, func(pick(tensors, real), *args[1:], **kwargs)):
                out[i] = n
        for i in fused:
            slot = tensors[i].slot
            out[i] = opt._grad_norm(slot, dtype) if ord_ in (2, 2.0) else \
                opt._grad_refuse(slot, f"_foreach_norm(ord={ord_})")
        return out
    if name in ("_foreach_mul_", "_foreach_div_"):
        other = args[1]
        per = isinstance(other, (list, tuple))  # one factor per tensor
        if real:
            func(pick(tensors, real), pick(other, real) if per else other)
        for i in fused:
            f = other[i] if per else other
            if torch.is_tensor(f) and f.numel() != 1:
                opt._grad_refuse(tensors[i].slot, f"{name} by a tensor of shape "
                                                  f"{tuple(f.shape)}")
            opt._grad_scale_by(tensors[i].slot, f, divide=name == "_foreach_div_")
        return None
    if name == "_foreach_zero_":
        if real:
            func(pick(tensors, real))
        for i in fused:
            opt._grad_zero(tensors[i].slot)
        return None
    slot = tensors[fused[0]].slot
    return opt._grad_refuse(slot, name, clamp=name in _CLAMPS)

"""The drop-in policy for the fused weights' .grad (their FusedGrad, optim/fused_grad.py).

GradPolicyMixin owns, for ForgeOptimizer, what a fused weight's .grad answers: it is shown
during backward and hidden after step(); its norm, scaling, GradScaler's unscale and zeroing
act on the pending gradient (the stashed segments) without materializing it; the first such
operation in updates='auto' decides updates='step'; everything else is refused with a message
that names the weight and the way out. A gradient reaching a fused weight from outside its
FORGE module is refused too.
"""
from __future__ import annotations

import logging

import torch

from forge_engine.kernels import norm_parts
from forge_engine.optim.fused_grad import FusedGrad

logger = logging.getLogger("forge_engine")


class GradPolicyMixin:
    """ForgeOptimizer's answers for the .grad of its fused weights (called by FusedGrad)."""

    def _init_grad_policy(self):
        self._shown: list = []  # slots whose FusedGrad is some weight's .grad now
        # weight -> (its slot's count, the _Norms batch of its raw ||dW||^2, its index there)
        self._norm_cache: dict = {}
        # weight -> (its slot's count, tiles, parts) of a norm-only pass run in backward
        self._early: dict = {}

    @staticmethod
    def _foreign_grad_hook(wname: str):
        def hook(grad):
            if grad is None:  # what ForgeLinearFunction returns for the weight
                return None
            raise RuntimeError(
                f"forge_engine: FORGE weight '{wname}' received a gradient from outside its "
                f"FORGE linear (the tensor is used by another operation too). Its update is "
                f"fused into the linear's backward, so that gradient would be lost; keep it "
                f"on the standard path (standard=['{wname}']), or leave this model to a "
                f"torch.optim optimizer")
        return hook

    def _expose(self, slot, applied: bool):
        """Show slot's FusedGrad as its weight's .grad (backward of one of its consumers).
        applied: the update runs now (updates='backward'), so the gradient is gone after it.
        A .grad cleared since the weight's last segments means those segments are gone too
        (zero_grad between backward passes), as a cleared gradient in torch."""
        p, g = slot.param, slot.grad
        if g is None:
            g = slot.grad = FusedGrad(slot)
        elif g.dtype != p.dtype:  # (model.to(dtype) after the optimizer: its state is older)
            raise RuntimeError(f"forge_engine: FORGE weight '{self._fused[p]}' is {p.dtype} "
                               f"now and was {g.dtype} when its optimizer state began; convert "
                               f"the model before making the optimizer (model.to(dtype), then "
                               f"{type(self).__name__}(model, ...))")
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
        for held in (self._segments, self._buffers, self._ready, self._norm_cache, self._early):
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
        """||dW||^2 [1] fp32 of p's pending gradient before any FusedGrad scaling (a view of
        its batch's vector, see _measure), kept until another segment arrives."""
        batch, i = self._measured(p)
        return batch.raw[i:i + 1]

    def _scaled_sumsq(self, p) -> torch.Tensor:
        f = self._slots[p].factor
        s = self._raw_sumsq(p)
        return s if f is None else s * (f * f)

    def _measured(self, p) -> tuple:
        """(the _Norms batch that holds p's raw squared norm, p's index in it)."""
        if not self._norm_known(p):
            self._measure(p)
        _, batch, i = self._norm_cache[p]
        return batch, i

    def _measure(self, p):
        """The raw squared norm of p's pending gradient, and with it that of every other
        fused weight on p's device whose norm is not known: clip_grad_norm_ and GradScaler's
        unscale ask for every weight's, one at a time. The batch costs each weight with a
        dense segment alone one norm-only launch through its update plan, which writes its
        tiles' parts into a buffer shared by the weights of its tile count, and then one
        sum per tile count and one concatenation; each other weight (an embedding's one-hot
        segment, an fp32 buffer, nothing pending) a few launches as before."""
        dev = p.device
        todo = [q for q in self._deferred_order()
                if q is not p and q.device == dev and q not in self._shards
                and self._shown_grad(q) and not self._norm_known(q)]
        todo.append(p)
        planned: dict = {}  # tiles -> [(q, plan, x, dy)]
        early: dict = {}  # tiles -> [(q, parts of the pass run in backward)]
        sums: list = []  # [(q, [1] fp32 squared norm)]
        for q in todo:
            slot = self._slots[q]
            slot.norm_at = slot.count  # the next step measures q in backward at this count
            ran = self._early.pop(q, None)
            if ran is not None and ran[0] == slot.count:
                early.setdefault(ran[1], []).append((q, ran[2]))
                continue
            if q in self._buffers:
                sums.append((q, self._buffers[q].pow(2).sum().reshape(1)))
                continue
            if q not in self._segments:
                sums.append((q, torch.zeros(1, dtype=torch.float32, device=dev)))
                continue
            x, dy, onehot = self._joined(q)
            x, dy = self._operands(q, x, dy, onehot)
            if onehot is not None:  # an embedding's one-hot segment
                sums.append((q, self._norm_only(q, q.detach(), x, dy, self._onehot(q, onehot))))
                continue
            plan = self._plan_of(q)
            planned.setdefault(plan.norm_tiles(x, dy), []).append((q, plan, x, dy))
        order, parts = [], []
        for tiles in {**planned, **early}:  # one buffer and one sum per tile count
            ran, late = early.get(tiles, []), planned.get(tiles, [])
            buf = torch.empty(len(ran) + len(late), norm_parts(tiles), dtype=torch.float32,
                              device=dev)
            if ran:
                torch.stack([t for _, t in ran], out=buf[:len(ran)])
            for row, (q, plan, x, dy) in zip(buf[len(ran):], late):  # (16-byte rows)
                plan.norm(x, dy, row)
            parts.append(buf[:, :tiles].sum(1))
            order.extend(q for q, *_ in ran + late)
        if sums:
            parts.append(torch.cat([s for _, s in sums]))
            order.extend(q for q, _ in sums)
        batch = _Norms(torch.cat(parts) if len(parts) > 1 else parts[0])
        for i, q in enumerate(order):
            self._norm_cache[q] = (self._slots[q].count, batch, i)

    def _measure_early(self, p):
        """p's norm-only pass now, in backward, where the last step asked for its norm at
        the count of segments it has now (Slot.norm_at): the device runs it between the
        backward's kernels, which leave it idle while the host works through autograd, and
        _measure sums its parts with the others'. A dense segment alone (as _measure plans),
        outside a captured step; if another segment follows, the pass was in vain and
        _measure runs it again."""
        if p not in self._segments or p in self._shards or self._static is not None:
            return
        x, dy, onehot = self._joined(p)
        if onehot is None:
            x, dy = self._operands(p, x, dy, None)
            self._early[p] = (self._slots[p].count, *self._plan_of(p).norm(x, dy))

    def _plan_of(self, p):
        """p's update plan, whose norm-only pass takes p's dense segments alone."""
        r = self._lookups_of(p)
        return self._plan(r, p, r.seed)

    def _shown_grad(self, q) -> bool:
        """Whether q's .grad is still its FusedGrad (code may have cleared it since
        backward: then step() drops its segments)."""
        g = self._slots[q].grad
        return g is None or q.grad is g

    def _norm_known(self, q) -> bool:
        hit = self._norm_cache.get(q)
        return hit is not None and hit[0] == self._slots[q].count

    def _grad_check(self, slot, what: str):
        """A FusedGrad operation is about to be answered: refused where the gradient is gone
        (updated in backward) or spread over data-parallel shards; in auto mode it decides
        updates='step'."""
        if slot.grad.applied:
            how = ("the first step ran a plain loop, so updates='auto' chose 'backward'"
                   if self.updates == "auto" else "updates='backward'")
            raise RuntimeError(
                f"forge_engine: {what} of FORGE weight '{self._fused[slot.param]}' after its "
                f"update: the fused weights are updated inside backward ({how}), so their "
                f"gradients can no longer be clipped, unscaled or read. Create the optimizer "
                f"with updates='step' for a loop that does this between backward() and step()")
        if self._shards:
            raise RuntimeError(f"forge_engine: {what} of FORGE weight "
                               f"'{self._fused[slot.param]}' under FORGE data parallelism (each "
                               f"replica holds a row shard): use "
                               f"optimizer.clip_grad_norm_(max_norm)")
        if self._mode is None:
            self._decide_step(f"{what} of a fused gradient between backward() and step()")

    def _grad_norm(self, slot, dtype=None) -> torch.Tensor:
        """The L2 norm of slot's pending gradient (0-d, in the weight's dtype as torch's
        norm of its .grad would be, or dtype)."""
        self._grad_check(slot, "the norm")
        batch, i = self._measured(slot.param)  # (one sqrt and cast for the batch's weights)
        return batch.norm(i, dtype or slot.param.dtype, slot.factor)

    def _grad_scale_by(self, slot, f, divide: bool = False):
        """Multiply (divide) slot's pending gradient by f: a number or a one-element tensor."""
        self._grad_check(slot, "scaling")
        if torch.is_tensor(f):
            # a copy (torch's .grad takes f's value now; f may change in place before the
            # update), one per value of f: clip_grad_norm_ multiplies every .grad by one tensor
            key = ("factor", id(f), f._version, divide, slot.param.device)
            hit = self._hp_cache.get(key)
            if hit is None:  # (f is kept with it: its id stays its own until step() ends)
                g = f.detach().reshape(()).to(device=slot.param.device, dtype=torch.float32,
                                              copy=True)
                hit = self._hp_cache[key] = (f, g.reciprocal_() if divide else g)
            f = hit[1]
        else:
            f = 1.0 / float(f) if divide else float(f)
        slot.factor = f if slot.factor is None else slot.factor * f

    def _grad_unscale(self, slots: list, found_inf: torch.Tensor, inv_scale: torch.Tensor):
        """torch.amp.GradScaler's unscale and inf check of slots' pending gradients: each is
        multiplied by inv_scale; found_inf becomes 1 where one is not finite (its squared norm
        is not). One check where slots are exactly the weights of one norm batch (GradScaler
        unscales every fused weight of a device and dtype at once), else one per weight."""
        for slot in slots:
            self._grad_check(slot, "GradScaler's unscale")
            self._grad_scale_by(slot, inv_scale)
        hits = [self._measured(slot.param) for slot in slots]
        batch = hits[0][0]
        whole = len(hits) == batch.raw.numel() and all(b is batch for b, _ in hits)
        for s in [batch.raw] if whole else [b.raw[i] for b, i in hits]:
            bad = ~torch.isfinite(s).all()
            found_inf.masked_fill_(bad.reshape(found_inf.shape).to(found_inf.device), 1.0)

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
            f"{type(self).__name__}(model, ..., standard=['{name}']). (A second optimizer "
            f"over the same model's parameters reads .grad so: one optimizer per model.)")


class _Norms:
    """The raw squared norms of a batch of pending fused gradients (GradPolicyMixin._measure):
    raw, fp32 [n], never handed out, and their roots for each dtype and scaling asked for,
    made at the first ask. Each root is handed out once, as an element of its vector; an
    answer to the same question again is a tensor of its own: the caller may have changed the
    first in place."""

    __slots__ = ("raw", "roots", "given")

    def __init__(self, raw: torch.Tensor):
        self.raw, self.roots, self.given = raw, {}, set()

    def norm(self, i: int, dtype, factor=None) -> torch.Tensor:
        """The norm of the batch's i-th gradient times factor (None, a number, or a 0-d fp32
        tensor: GradScaler's 1 / scale, shared by every weight), 0-d in dtype."""
        key = (dtype, id(factor) if torch.is_tensor(factor) else factor)
        if (i, key) in self.given:
            return _root(self.raw[i], factor).to(dtype)
        self.given.add((i, key))
        hit = self.roots.get(key)
        if hit is None:  # (the factor is kept with it: its id stays its own)
            hit = self.roots[key] = (_root(self.raw, factor).to(dtype), factor)
        return hit[0][i]


def _root(sumsq: torch.Tensor, factor) -> torch.Tensor:
    """The norm of a gradient scaled by factor, from its raw squared norm."""
    return (sumsq if factor is None else sumsq * (factor * factor)).sqrt()

"""Deferred updates: token segments stashed until step(), and the clipping they make exact.

DeferralMixin owns, for ForgeOptimizer, what a fused weight keeps between its backward passes
and its update (docs/design.md: dW = [dY_1; dY_2; ...]^T [X_1; X_2; ...]): the stashed (X, dY) and
one-hot segments, the fp32 buffer a weight switches to where segments would take more memory,
the norm-only pre-pass of exact clipping, the clip factor, and flush(), which runs the
deferred updates.
"""
from __future__ import annotations

import logging

import torch

from forge_engine.kernels.rules import GRAD_SCALE
from forge_engine.optim.clipping import scale_grads_, sumsq_all

logger = logging.getLogger("forge_engine")


class DeferralMixin:
    """ForgeOptimizer's deferred updates: self._segments and self._buffers hold the pending
    gradient of each deferred weight until flush()."""

    def _init_deferral(self):
        self._defer = False  # defer_updates(): stash token segments until step()
        self._segments: dict = {}  # weight -> [("dense", x, dy) | ("onehot", ids, e), ...]
        self._buffers: dict = {}  # weight -> fp32 dW, where segments would cost more memory
        self.accumulation = {}  # weight name -> "segments" | "fp32 buffer" (last choice made)
        self._grad_scale = 1.0  # set by clip_grad_norm_ for the deferred updates
        self._clipped_norm = None

    def defer_updates(self):
        """Until the next step(), fused layers stash their token segments (X, dY) instead of
        updating (docs/design.md: dW = [dY_1; dY_2; ...]^T [X_1; X_2; ...]). Then several backward
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
        slot = self._slots[p]
        if slot.factor is not None:  # .grad was scaled since its last segment; seg is not
            self._fold(p, "its .grad was scaled before this segment")
        if p in self._buffers:
            self._buffers[p] += self._segment_grad(p, seg)
            return
        segs = self._segments.setdefault(p, [])
        segs.append(seg)
        held = sum(t.numel() * t.element_size() for s_ in segs for t in s_[1:])
        if held > p.numel() * 4:
            self._fold(p, f"token segments would take more ({held / 2 ** 20:.1f} MiB so far)")
        else:
            self.accumulation[self._fused[p]] = "segments"

    def _fold(self, p, why: str):
        """p's pending gradient into an fp32 buffer, its FusedGrad scaling applied: the
        segments are dropped, later ones are added to the buffer."""
        slot = self._slots[p]
        buf = self._buffers.get(p)
        if buf is None:
            buf = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for seg in self._segments.pop(p, ()):
                buf += self._segment_grad(p, seg)
            self._buffers[p] = buf
        if slot.factor is not None:
            buf.mul_(slot.factor)
            slot.factor = None
        name = self._fused[p]
        if self.accumulation.get(name) != "fp32 buffer":
            logger.info("forge_engine: %s accumulates in an fp32 gradient buffer (%.1f MiB): %s",
                        name, buf.numel() * 4 / 2 ** 20, why)
        self.accumulation[name] = "fp32 buffer"

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
        host synchronization. A factor that is not a number (the clip factor of a non-finite
        norm) scales nothing, as a float one: the weights whose gradient was finite step
        unscaled, and their norm slots stay finite, so only the others are named."""
        if torch.is_tensor(factor):
            if self._static is None:
                raise RuntimeError("forge_engine: scale_gradients(tensor) needs "
                                   "capture_static_step(); pass a float otherwise")
            factor = factor.to(torch.float32).clamp(max=1.0).nan_to_num(nan=1.0)
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
            if not self._shown_grad(p):
                # its .grad was cleared after backward (zero_grad, `.grad = None`): like
                # torch.optim for a parameter without a gradient, no update
                self._discard(p)
                continue
            factor, slot.factor, slot.count = slot.factor, None, 0
            if self._norm_cache.pop(p, None) is None:  # not asked for in this step
                slot.norm_at = None
            self._early.pop(p, None)
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

    def _deferred_order(self) -> list:
        """Deferred weights in one order on every replica (their collectives must match)."""
        return list(dict.fromkeys([*self._ready, *self._segments, *self._buffers]))

"""FORGE linear: an nn.Linear whose backward updates its own weight (DESIGN.md, "Backward of one
FORGE linear").

    forward   y [*, N] = x [*, K] @ W^T [K, N] + b          (as nn.Linear)
    backward  1. dx [*, K] = dy [*, N] @ W [N, K]          (W read BEFORE the update)
              2. start the TP collective of dx (async; column-parallel layers only)
              3. fused kernel: W <- step(W, dy^T x)         (dW never materialized)
              4. wait for the collective; return dx (db = sum of dy: standard path)
The weight's gradient returned to autograd is None, so `.grad` of a fused weight stays None.

A module becomes a ForgeLinear when a forge_engine optimizer swaps its class in place: the same
module object, the same Parameter objects, the same state_dict keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ForgeLinearFunction(torch.autograd.Function):
    """(x [*, K], weight [N, K], bias [N] | None, slot, comm) -> y [*, N]; see module docstring.

    slot None (a column-parallel weight not on FORGE, e.g. forge off): the same collectives,
    and the weight gets its ordinary materialized gradient instead of an update.

    comm (a parallel.mappings.ColumnInput, or None) moves the input across the TP group: then
    x is this rank's input (SP: a sequence shard), the forward gathers it, and the backward
    re-gathers it behind the dX GEMM and reduces dX behind the fused update (both async)."""

    @staticmethod
    def forward(ctx, x, weight, bias, slot, comm):
        ctx.save_for_backward(x, weight)  # with SP: the local shard only
        ctx.slot, ctx.comm = slot, comm
        x_full = comm.gather(x).wait() if comm is not None else x
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        slot, comm = ctx.slot, ctx.comm
        if slot is not None:
            slot.begin_backward()  # misuse checks first, before anything is computed
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        gathering = comm.gather(x, async_op=True) if comm is not None else None
        dy2 = dy.reshape(-1, n)
        # data parallelism: the dY exchange between replicas runs behind the dX GEMM too
        early = slot.start_exchange(dy2) if slot is not None else None
        dx = pending_dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight.to(dy.dtype)  # step 1: W before its update
            if comm is not None:
                pending_dx = comm.reduce_grad(dx)  # step 2: in flight during the update
        db = dy2.sum(0) if ctx.needs_input_grad[2] else None
        x_full = gathering.wait() if gathering is not None else x
        dw = None
        if slot is not None:
            slot.update(x_full.reshape(-1, k), dy2, early)  # step 3: the fused update
        elif ctx.needs_input_grad[1]:  # unfused (forge off): the ordinary materialized dW
            dw = (dy2.t() @ x_full.reshape(-1, k).to(dy2.dtype)).to(weight.dtype)
        if pending_dx is not None:
            dx = pending_dx.wait()  # step 4
        return dx, dw, db, None, None


class ForgeCapable:
    """Mixin of every module whose weight FORGE can update in backward (ForgeLinear and the
    tensor-parallel linears). An optimizer binds the weight by setting `_forge_slot`; unbound
    (no FORGE optimizer, forge=False, or a weight on the standard path), `_linear` is F.linear
    and the weight gets an ordinary .grad."""

    _forge_slot = None

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias, comm=None) -> torch.Tensor:
        """y = x W^T + b; comm: the ColumnInput of a column-parallel layer (x is then local)."""
        if self._forge_slot is not None:  # data parallelism: the updated rows have arrived
            self._forge_slot.wait_weight()
        grad = torch.is_grad_enabled()
        slot = self._forge_slot if grad and weight.requires_grad else None
        if slot is None and (comm is None or not grad):  # plain, or a no-grad forward
            return F.linear(x if comm is None else comm.gather(x).wait(), weight, bias)
        # a column-parallel layer takes the Function even unfused: the same saved shard and
        # overlapped collectives with FORGE on or off
        return ForgeLinearFunction.apply(x, weight, bias, slot, comm)


class ForgeLinear(nn.Linear, ForgeCapable):
    """nn.Linear trained by FORGE; an optimizer swaps an nn.Linear's class to this in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)

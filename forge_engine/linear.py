"""FORGE linear: an nn.Linear whose backward updates its own weight (DESIGN.md, "Backward of one
FORGE linear").

    forward   y [*, N] = x [*, K] @ W^T [K, N] + b          (as nn.Linear)
    backward  1. dx [*, K] = dy [*, N] @ W [N, K]          (W read BEFORE the update)
              2. db = sum of dy over tokens                 (bias stays on the standard path)
              3. fused kernel: W <- step(W, dy^T x)         (dW never materialized)
The weight's gradient returned to autograd is None, so `.grad` of a fused weight stays None.

A module becomes a ForgeLinear when a forge_engine optimizer swaps its class in place: the same
module object, the same Parameter objects, the same state_dict keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ForgeLinearFunction(torch.autograd.Function):
    """(x [*, K], weight [N, K], bias [N] | None, slot) -> y [*, N]; see module docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, slot):
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        slot = ctx.slot
        slot.begin_backward()  # misuse checks first, before anything is computed or unpacked
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        dy2 = dy.reshape(-1, n)
        dx = (dy @ weight.to(dy.dtype)) if ctx.needs_input_grad[0] else None  # step 1
        db = dy2.sum(0) if ctx.needs_input_grad[2] else None  # step 2
        slot.update(x.reshape(-1, k), dy2)  # step 3
        return dx, None, db, None


class ForgeCapable:
    """Mixin of every module whose weight FORGE can update in backward (ForgeLinear and the
    tensor-parallel linears). An optimizer binds the weight by setting `_forge_slot`; unbound
    (no FORGE optimizer, forge=False, or a weight on the standard path), `_linear` is F.linear
    and the weight gets an ordinary .grad."""

    _forge_slot = None

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        slot = self._forge_slot
        if slot is None or not (torch.is_grad_enabled() and weight.requires_grad):
            return F.linear(x, weight, bias)
        return ForgeLinearFunction.apply(x, weight, bias, slot)


class ForgeLinear(nn.Linear, ForgeCapable):
    """nn.Linear trained by FORGE; an optimizer swaps an nn.Linear's class to this in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)

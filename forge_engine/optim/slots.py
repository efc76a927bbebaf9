"""Slot: the binding of one fused weight to its optimizer, which the weight's FORGE modules call
from their backward (forge_engine/linear.py). It owns the per-weight bookkeeping of a step:
whether the weight's segments are stashed or its update runs now, the misuse check of a second
backward, the start of its data-parallel exchange, and its FusedGrad (the weight's .grad).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from forge_engine import custom_ops

if TYPE_CHECKING:
    from forge_engine.optim.base import ForgeOptimizer


class Slot:
    """Binds one fused weight to its optimizer; called from ForgeLinearFunction.backward."""

    def __init__(self, opt: "ForgeOptimizer", param: nn.Parameter, name: str,
                 consumers: int = 1, transposed: bool = False):
        self.opt, self.param, self.name = opt, param, name
        # W kept as [in, out] (transformers' Conv1D): its gradient X^T dY is the kernel's
        # dy^T x with the operands' roles swapped, so a caller hands (x, dy) as for any
        # linear and the slot swaps them once, here, for everything after (stash, norm, DP)
        self.transposed = transposed
        self.last_step = -1
        # a weight with several consumers (tied embedding and LM head) always stashes its
        # segments and is updated once, after every consumer's backward, at step()
        self.consumers = consumers
        self.deferred = consumers > 1
        self.grad = None  # its FusedGrad (made at the first backward), shown as param.grad
        self.factor = None  # scaling of the pending gradient (clipping, unscaling): None = 1
        self.count = 0  # segments stashed since the last update (or discard)
        # the count at which the last step asked for this weight's norm (clipping, GradScaler):
        # its norm-only pass runs in backward once that many segments are stashed
        self.norm_at = None
        self.key = custom_ops.register(self)  # how a compiled graph names this slot

    def keeps_segments(self) -> bool:
        """Whether a segment handed to update() is kept past the call (stashed until step(),
        or recorded by FORGE_DEBUG_NONFINITE)."""
        return self._stashing() or self.opt._recorder is not None

    def _stashing(self) -> bool:
        return self.deferred or self.opt._defer or self.opt._mode != "backward"

    def wait_weight(self):
        """Data parallelism: finish the all-gather of this weight's updated rows (before a
        forward reads it)."""
        if self.opt._inflight:
            self.opt._wait_rows(self.param)

    def start_exchange(self, x: torch.Tensor, dy2: torch.Tensor):
        """Data parallelism, token path: start the exchange of the operand along W's rows (dY
        [T, N]; X [*, K] for a transposed weight) now, so it runs behind the dX GEMM; None
        when nothing is to start (no data parallelism, or a stashed segment)."""
        if self._stashing() or self.param not in self.opt._shards:
            return None
        return self.opt._dp_start(self.param,
                                  x.reshape(-1, x.shape[-1]) if self.transposed else dy2)

    def begin_backward(self) -> bool:
        """The misuse checks of a backward reaching this weight, first, before anything is
        computed; whether its segments are stashed (else its update runs now)."""
        if self.opt._static is not None:  # a step after capture: its rows must be written
            self.opt._static.check_ready(self.opt._param_names[self.param])
        if self._stashing():  # segments are stashed, W is unchanged: any number of backwards
            return True
        if self.last_step == self.opt._global_step:
            raise RuntimeError(
                f"forge_engine: a second backward reached FORGE linear '{self.name}' before "
                f"optimizer.step(); its weight was already updated in this step. This happens "
                f"with gradient accumulation or when one module is applied twice in a forward: "
                f"create the optimizer with updates='step' (or call "
                f"optimizer.defer_updates() before the backward passes of such a step)")
        self.last_step = self.opt._global_step
        return False

    def backward_update(self, x2: torch.Tensor, dy2: torch.Tensor):
        """begin_backward() and update(x2, dy2) at once, for a caller with nothing to do in
        between (a hook on a linear's node, run once dX exists): whether the segment is
        stashed is asked once."""
        self._dense(x2, dy2, self.begin_backward())

    def update(self, x2: torch.Tensor, dy2: torch.Tensor, early=None):
        """A dense token segment: x2 [T, K], dy2 [T, N] (a linear's input and output grad);
        early: what start_exchange returned."""
        self._dense(x2, dy2, self._stashing(), early)

    def _dense(self, x2, dy2, stashing: bool, early=None):
        """The dense segment stashed for step(), or the update made from it now."""
        if self.transposed:
            x2, dy2 = dy2, x2
        if stashing:  # a segment of this step's dW = [dY_1; dY_2]^T [X_1; X_2]
            self.opt._expose(self, applied=False)
            self.count += 1
            self.opt._stash(self.param, ("dense", x2.detach(), dy2.detach()))
            if self.count == self.norm_at:
                self.opt._measure_early(self.param)
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

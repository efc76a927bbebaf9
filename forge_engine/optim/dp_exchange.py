"""FORGE-DP exchange (parallel/data_parallel.py has the row shards and their collectives).

DataParallelMixin owns, for ForgeOptimizer, each fused weight's row shard, the choice per
weight between exchanging token segments and reduce-scattering the gradient, the update of
this replica's rows from every replica's operands, the all-gather of the updated rows behind
the next forward, the averaging of the standard-path gradients and the byte counts.
"""
from __future__ import annotations

import logging

import torch

from forge_engine.parallel.data_parallel import RowShard, average_gradients
from forge_engine.parallel.mappings import world

logger = logging.getLogger("forge_engine")


class DataParallelMixin:
    """ForgeOptimizer's data-parallel half: self._shards maps each fused weight to its
    RowShard (empty without data parallelism)."""

    def _init_data_parallel(self, model, dp_group):
        """FORGE-DP's state: row shards, their in-flight row all-gathers, the deferred
        weights' prepared operands (built once the fused weights are known)."""
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

    def _dp_total(self, local: torch.Tensor, mean: bool = True) -> torch.Tensor:
        """This replica's shards' squared gradient norm (a tensor of the caller's own, which
        mean=False reduces in place) -> the squared norm over all shards (an all-reduce over
        the data-parallel group). mean: local is the norm of the replicas' gradient SUM (a
        norm-only pass), rescaled here to the mean's; else it is the mean's already (an
        update's, whose grad_scale holds 1 / replicas)."""
        if mean:
            local = local / float(self.dp_size) ** 2
        torch.distributed.all_reduce(local, group=self.dp_group)
        return local

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

    def _dp_rank(self) -> int:
        return next(iter(self._shards.values())).rank if self._shards else 0

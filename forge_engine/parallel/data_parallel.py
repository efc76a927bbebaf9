"""FORGE data parallelism (FORGE-DP): replicas never all-reduce a weight gradient.

docs/design.md's identity dW = sum over replicas r of dY_r^T X_r says that gathering the token
segments of every replica is as good as reducing their gradients. With D replicas (the
data-parallel group) and a fused weight W [N, K], replica r owns the row shard
W[r0:r1] (rows split in D parts of ceil(N / D), the last ones shorter or empty) and keeps the
optimizer state of that shard only (ZeRO-1's division of optimizer memory, and no gradient at all):

    tokens          X: all-gather             -> every replica's X       [D T, K]
                    dY: all-to-all of columns -> every replica's dY[:, r0:r1]   [D T, N / D]
                    fused kernel on (X, dY[:, shard]) updates W[r0:r1] with its state
    reduce-scatter  dW = dY^T X materialized in fp32 on each replica, reduce-scattered by row
                    shard, the shard stepped from it (the usual ZeRO path)
    then, either way, the updated rows are all-gathered into every replica's W, asynchronously:
    the next forward of the layer waits for them (ForgeCapable._linear).

Bytes each replica receives per step (ring collectives, e = element size):
    tokens          (D - 1) (T K e_x + T N/D e_dy)   (+ (D - 1) T1 (8 + K e) for one-hot segments)
    reduce-scatter  (D - 1) N/D K 4
and the row all-gather (D - 1) N/D K e_w on both paths. The cheaper of the two is chosen per
weight and per step (RowShard.choose), logged when it changes, and counted in `bytes`.

The loss of each replica is its own mean, so the data-parallel gradient is the mean over
replicas: the fused update multiplies the gathered sum by 1 / D (hp GRAD_SCALE), as DDP's
average does. Every replica must present the same number of tokens in a step (a fixed micro-batch
shape, as Megatron requires).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from forge_engine.parallel.mappings import _all_gather_async, _all_gather_single, _Pending, \
    _reduce_scatter_single, local_rows, rank_in, world


@dataclass
class RowShard:
    """Replica `rank` of `size` owns rows [r0, r1) of a weight [n, k]."""

    group: object
    size: int
    rank: int
    n: int
    k: int
    per: int  # rows of every shard but the last ones: ceil(n / size)
    r0: int
    r1: int
    bytes: dict = field(default_factory=lambda: {"tokens": 0, "reduce-scatter": 0,
                                                 "weight all-gather": 0})
    mode: str | None = None  # the last choice made (tokens / reduce-scatter)

    @classmethod
    def of(cls, weight: torch.Tensor, group) -> "RowShard":
        size, rank = world(group), rank_in(group)
        n, k = weight.shape
        per = -(-n // size)
        r0 = min(rank * per, n)
        return cls(group, size, rank, n, k, per, r0, min(r0 + per, n))

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    def choose(self, t: int, t1: int, e_x: int, e_dy: int, e_oh: int) -> tuple[str, int, int]:
        """(mode, bytes by token gathering, bytes by reduce-scatter) for t dense tokens and t1
        one-hot tokens; ties go to tokens (no gradient materialized)."""
        d = self.size - 1
        tok = d * (t * self.k * e_x + t * self.per * e_dy + t1 * (8 + self.k * e_oh))
        rs = d * self.per * self.k * 4
        return ("tokens" if tok <= rs else "reduce-scatter"), tok, rs

    # ------------------------------------------------------------------ the collectives
    def gather(self, t: torch.Tensor, async_op: bool = False) -> _Pending:
        """All-gather along dim 0: every replica's t, replica order."""
        self.bytes["tokens"] += (self.size - 1) * t.numel() * t.element_size()
        return _all_gather_async(t, self.group, 0, async_op)

    def exchange_columns(self, dy: torch.Tensor, async_op: bool = False) -> _Pending:
        """dy [T, n] of this replica -> [D T, rows]: every replica's dy[:, r0:r1] (all-to-all;
        each replica receives only the columns of its own shard)."""
        t = dy.shape[0]
        padded = dy.new_zeros((t, self.size * self.per)) if self.n % self.size else None
        if padded is not None:
            padded[:, :self.n] = dy
        src = (padded if padded is not None else dy).reshape(t, self.size, self.per)
        send = src.transpose(0, 1).contiguous()  # [D, T, per]: block j goes to replica j
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=async_op)
        self.bytes["tokens"] += (self.size - 1) * t * self.per * dy.element_size()
        # `send` stays referenced until the exchange is waited for
        return _Pending(work, lambda: (send, recv.view(self.size * t, self.per)[:, :self.rows])[1])

    def reduce_scatter(self, g: torch.Tensor) -> torch.Tensor:
        """g [n, k] fp32 (this replica's partial dW) -> the sum over replicas of rows r0:r1."""
        if self.n % self.size:
            full = g.new_zeros((self.size * self.per, self.k))
            full[:self.n] = g
            g = full
        out = g.new_empty((self.per, self.k))
        _reduce_scatter_single(out, g.contiguous(), group=self.group)
        self.bytes["reduce-scatter"] += (self.size - 1) * out.numel() * 4
        return out[:self.rows]

    def gather_rows(self, w: torch.Tensor) -> _Pending:
        """Start the all-gather of every replica's updated rows into w [n, k] (in place);
        .wait() completes it."""
        self.bytes["weight all-gather"] += (self.size - 1) * self.per * self.k * w.element_size()
        shard = w.new_zeros((self.per, self.k))
        shard[:self.rows] = w[self.r0:self.r1]
        if self.n % self.size == 0 and w.is_contiguous():  # straight into the weight
            work = _all_gather_single(w, shard, group=self.group, async_op=True)
            return _Pending(work, lambda: (shard, w)[1])
        buf = w.new_empty((self.size * self.per, self.k))
        work = _all_gather_single(buf, shard, group=self.group, async_op=True)
        return _Pending(work, lambda: (shard, w.copy_(buf[:self.n]))[1])

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight -> rows of this shard; -1 for rows of other shards (and -1s)."""
        return local_rows(ids, self.r0, self.rows)


def average_gradients(params, group) -> int:
    """Ordinary data parallelism for materialized gradients: .grad <- mean over replicas, one
    all-reduce per dtype (flattened), as DDP's buckets do. Returns the bytes each replica
    receives (a ring all-reduce: 2 (D - 1) / D of the gradient bytes)."""
    size = world(group)
    if size == 1:
        return 0
    moved = 0
    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        moved += 2 * (size - 1) * flat.numel() * flat.element_size() // size
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return moved

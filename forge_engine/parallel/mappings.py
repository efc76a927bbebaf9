"""Tensor/sequence-parallel communication as conjugate autograd pairs (Megatron-core's
mappings.py). Each name says what happens forward; backward is the conjugate. Every
op is the identity when the group has one rank (or is None). Groups are passed explicitly.

Activations are [s, b, h]; "sequence" is dim 0, "hidden"/"vocab" the last dim. R = group size.

    copy_to_tp             fwd identity                bwd all-reduce            (Column input, no SP)
    reduce_from_tp         fwd all-reduce              bwd identity              (Row output, no SP)
    scatter_to_sp          fwd split dim 0 [s/R]       bwd all-gather dim 0      (embedding -> SP)
    gather_from_sp         fwd all-gather dim 0 [s]    bwd reduce-scatter dim 0  (Column input, SP)
    reduce_scatter_to_sp   fwd reduce-scatter [s/R]    bwd all-gather dim 0      (Row output, SP)
    gather_from_tp         fwd all-gather last dim     bwd split last dim        (gather_output)
    scatter_to_tp_last     fwd split last dim          bwd all-gather last dim   (Row, full input)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class _Pending:
    """A collective, possibly asynchronous: .wait() finishes it and returns its result."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


def local_rows(ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of a row-sharded table -> 0 .. count - 1; every other id,
    and -1, -> -1 (the vocab-parallel embedding's lookup, a FORGE-DP shard's one-hot ids)."""
    local = ids - start
    return local.masked_fill((ids < 0) | (local < 0) | (local >= count), -1)


def _chunks(x, group, dim):
    r = world(group)
    if x.shape[dim] % r:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not divide among {r} "
                         f"tensor-parallel ranks")
    return x.chunk(r, dim=dim)


def _all_reduce_async(x, group, async_op=False) -> _Pending:
    if world(group) == 1:
        return _Pending(None, lambda: x)
    x = x.contiguous()
    return _Pending(dist.all_reduce(x, group=group, async_op=async_op), lambda: x)


# torch 2.13 renamed the single-tensor collectives; the GPU image's torch 2.11 has the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or \
    dist.reduce_scatter_tensor


def _all_gather_async(x, group, dim, async_op=False) -> _Pending:
    if world(group) == 1:
        return _Pending(None, lambda: x)
    x = x.contiguous()
    if dim == 0:  # straight into one output tensor: no concatenation copy
        out = x.new_empty((world(group) * x.shape[0],) + tuple(x.shape[1:]))
        return _Pending(_all_gather_single(out, x, group=group, async_op=async_op), lambda: out)
    parts = [torch.empty_like(x) for _ in range(world(group))]
    work = dist.all_gather(parts, x, group=group, async_op=async_op)
    return _Pending(work, lambda: torch.cat(parts, dim=dim))


def _reduce_scatter_async(x, group, dim, async_op=False) -> _Pending:
    if world(group) == 1:
        return _Pending(None, lambda: x)
    parts = [p.contiguous() for p in _chunks(x, group, dim)]
    out = torch.empty_like(parts[0])
    return _Pending(dist.reduce_scatter(out, parts, group=group, async_op=async_op),
                    lambda: out)


def _all_reduce(x, group):
    return _all_reduce_async(x, group).wait()


def _all_gather(x, group, dim):
    return _all_gather_async(x, group, dim).wait()


def _reduce_scatter(x, group, dim):
    return _reduce_scatter_async(x, group, dim).wait()


def _split(x, group, dim):
    if world(group) == 1:
        return x
    return _chunks(x, group, dim)[rank_in(group)].contiguous()


def _pair(name: str, forward, backward):
    """An autograd Function doing forward(x, group) and, in backward, backward(grad, group)."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, g):
        return backward(g, ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _last(x):
    return x.dim() - 1


_CopyToTP = _pair("CopyToTP", lambda x, g: x, lambda d, g: _all_reduce(d.clone(), g))
_ReduceFromTP = _pair("ReduceFromTP", lambda x, g: _all_reduce(x.clone(), g), lambda d, g: d)
_ScatterToSP = _pair("ScatterToSP", lambda x, g: _split(x, g, 0),
                     lambda d, g: _all_gather(d, g, 0))
_GatherFromSP = _pair("GatherFromSP", lambda x, g: _all_gather(x, g, 0),
                      lambda d, g: _reduce_scatter(d, g, 0))
_ReduceScatterToSP = _pair("ReduceScatterToSP", lambda x, g: _reduce_scatter(x, g, 0),
                           lambda d, g: _all_gather(d, g, 0))
_GatherFromTP = _pair("GatherFromTP", lambda x, g: _all_gather(x, g, _last(x)),
                      lambda d, g: _split(d, g, _last(d)))
_ScatterToTPLast = _pair("ScatterToTPLast", lambda x, g: _split(x, g, _last(x)),
                         lambda d, g: _all_gather(d, g, _last(d)))


def _identity_on_one_rank(fn):
    """The public op: fn's autograd pair, or the identity when the group has one rank."""
    return lambda x, group: fn.apply(x, group) if world(group) > 1 else x


copy_to_tp = _identity_on_one_rank(_CopyToTP)
reduce_from_tp = _identity_on_one_rank(_ReduceFromTP)
scatter_to_sp = _identity_on_one_rank(_ScatterToSP)
gather_from_sp = _identity_on_one_rank(_GatherFromSP)
reduce_scatter_to_sp = _identity_on_one_rank(_ReduceScatterToSP)
gather_from_tp = _identity_on_one_rank(_GatherFromTP)
scatter_to_tp_last = _identity_on_one_rank(_ScatterToTPLast)


class ColumnInput:
    """How the input of a column-parallel linear crosses the TP group, for the fused backward
    (ForgeLinearFunction), which needs the collectives split open to overlap them:
        forward   x_local [s/R, b, h] -all-gather-> x [s, b, h]   (SP; without SP x is local)
        backward  re-gather x (async, behind the dX GEMM: only x_local is saved, as Megatron),
                  dX partial -reduce-scatter (SP) / all-reduce-> dX_local, async, behind the
                  fused weight update.
    The unfused path (forge off) uses it too, so both keep the same activations and overlap."""

    def __init__(self, group, sequence_parallel: bool):
        self.group, self.sp = group, sequence_parallel and world(group) > 1

    def gather(self, x, async_op: bool = False) -> _Pending:
        return _all_gather_async(x, self.group, 0, async_op) if self.sp else _Pending(None,
                                                                                      lambda: x)

    def reduce_grad(self, dx) -> _Pending:
        if self.sp:
            return _reduce_scatter_async(dx, self.group, 0, async_op=True)
        return _all_reduce_async(dx, self.group, async_op=True)

"""Tensor-parallel layers with megatron-core's constructor and forward contract, FORGE inside.

R = tensor-parallel size, r = this rank. Activations [s, b, h]; with sequence parallelism the
activations between layers are sequence shards [s/R, b, h].

    ColumnParallelLinear  W_r [out/R, in]    x [s, b, in] (SP: [s/R, b, in]) -> y_r [s, b, out/R]
    RowParallelLinear     W_r [out, in/R]    x_r [s, b, in/R] -> y [s, b, out] (SP: [s/R, b, out])
    VocabParallelEmbedding E_r [V/R, h]      ids [s, b] -> [s, b, h] (SP: [s/R, b, h])

The weight update is fused through ForgeCapable._linear: the linear's backward sees the FULL token
axis of its shard (Column: the gathered sequence; Row: the gathered dY), so the local weight
gradient is complete at backward time and the fused update is exact (docs/design.md). A column
layer's dX collective is started before the fused update and waited for after it
(mappings.ColumnInput); with SP only the local input shard is saved and re-gathered in backward.

Initialization is TP-invariant: every rank draws the FULL weight from the global torch RNG on the
CPU (all ranks seed alike and build layers in the same order), applies init_method, and keeps its
slice. `partition_chunks` > 1 says the output dim is that many stacked blocks (SwiGLU [gate; up]),
each sharded separately, so TP=1 and TP=R compute the same function from the same seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from forge_engine.linear import ForgeCapable
from forge_engine.parallel import mappings as M


@dataclass
class ParallelConfig:
    """The slice of megatron-core's ModelParallelConfig the layers read."""

    sequence_parallel: bool = False
    """Activations between layers are sequence shards; norms see s/R tokens."""
    params_dtype: torch.dtype = torch.float32
    """dtype of weights and biases (fp32 or bf16)."""
    init_device: str = "cpu"
    """where the full weights are drawn: "cpu" (the same numbers on every machine) or "cuda"
    (fast for 8B+ models; the same on every rank of one run, not across GPU models)."""


def _check_divisible(n: int, r: int, what: str):
    if n % r:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({r})")


def shard_of(full: torch.Tensor, dim: int, group, chunks: int = 1) -> torch.Tensor:
    """This rank's slice of a full tensor along `dim` (`chunks` stacked blocks, each split)."""
    r, i = M.world(group), M.rank_in(group)
    return torch.cat([b.chunk(r, dim=dim)[i] for b in full.chunk(chunks, dim=dim)], dim=dim)


def _shard_init(full_shape, dim, group, init_method, config, chunks=1):
    """Draw the full weight (on config.init_device), initialize it, keep this rank's slice."""
    full = torch.empty(full_shape, dtype=torch.float32, device=config.init_device)
    init_method(full)
    return shard_of(full, dim, group, chunks).to(config.params_dtype).contiguous()


def default_init(std: float = 0.02):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


class ColumnParallelLinear(nn.Module, ForgeCapable):
    """Y = X A^T + b with A split by rows (output features) across the TP group."""

    def __init__(self, input_size: int, output_size: int, *, config: ParallelConfig,
                 init_method=None, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, tp_group=None, partition_chunks: int = 1,
                 weight: torch.Tensor | None = None):
        super().__init__()
        r = M.world(tp_group)
        _check_divisible(output_size, r * partition_chunks, "output_size")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.config = tp_group, config
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.partition_chunks = partition_chunks
        self._input = M.ColumnInput(tp_group, config.sequence_parallel)
        if gather_output and config.sequence_parallel:
            raise ValueError("gather_output is not compatible with sequence_parallel")
        init = init_method or default_init()
        if weight is None:
            self.weight = nn.Parameter(_shard_init((output_size, input_size), 0, tp_group, init,
                                                   config, partition_chunks))
        else:  # a shared weight (tied LM head): the caller's Parameter
            self.weight = weight
        self.bias = nn.Parameter(torch.zeros(output_size // r, dtype=config.params_dtype,
                                              device=config.init_device)) \
            if bias else None

    def forward(self, x):  # x [s, b, in] or SP [s/R, b, in]
        g = self.tp_group
        b = None if self.skip_bias_add else self.bias
        y = self._linear(x, self.weight, b, self._input)  # [s, b, out/R]
        if self.gather_output:
            y = M.gather_from_tp(y, g)
        return y, (self.bias if self.skip_bias_add else None)

    def sharded_parameters(self):
        return [p for p in (self.weight, self.bias) if p is not None]


class RowParallelLinear(nn.Module, ForgeCapable):
    """Y = X A^T + b with A split by columns (input features) across the TP group."""

    def __init__(self, input_size: int, output_size: int, *, config: ParallelConfig,
                 init_method=None, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, tp_group=None):
        super().__init__()
        r = M.world(tp_group)
        _check_divisible(input_size, r, "input_size")
        if not input_is_parallel and config.sequence_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.config = tp_group, config
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.weight = nn.Parameter(_shard_init((output_size, input_size), 1, tp_group,
                                               init_method or default_init(), config))
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype,
                                              device=config.init_device)) if bias else None

    def forward(self, x):  # x [s, b, in/R] (or [s, b, in] when not input_is_parallel)
        g = self.tp_group
        if not self.input_is_parallel:
            x = M.scatter_to_tp_last(x, g)
        y = self._linear(x, self.weight, None)  # partial sums [s, b, out]
        y = M.reduce_scatter_to_sp(y, g) if self.config.sequence_parallel \
            else M.reduce_from_tp(y, g)
        if self.skip_bias_add:
            return y, self.bias
        return (y + self.bias if self.bias is not None else y), None

    def sharded_parameters(self):
        return [self.weight]


def _lookup(ids, weight, sharded: bool = True):
    """Rows of weight for ids [*] (row of this shard, or -1: zeros) -> [*, h]. sharded=False:
    one tensor-parallel rank, no id is -1 (a plain lookup)."""
    if not sharded:
        return F.embedding(ids, weight)
    return F.embedding(ids.clamp(min=0), weight).masked_fill((ids < 0)[..., None], 0.0)


class _EmbeddingFunction(torch.autograd.Function):
    """(ids [*] rows of this shard or -1, weight [V/R, h], slot) -> e [*, h]. Backward hands the
    one-hot segment (ids, dE) to the fused kernel, which builds onehot(ids)^T dE tile by tile:
    no [tokens x vocab] tensor and no materialized embedding gradient."""

    @staticmethod
    def forward(ctx, ids, weight, slot, sharded):
        ctx.save_for_backward(ids)
        ctx.slot = slot
        return _lookup(ids, weight, sharded)

    @staticmethod
    def backward(ctx, de):
        slot = ctx.slot
        slot.begin_backward()
        (ids,) = ctx.saved_tensors
        slot.update_onehot(ids.reshape(-1), de.reshape(-1, de.shape[-1]))
        return None, None, None, None


class VocabParallelEmbedding(nn.Module, ForgeCapable):
    """Embedding with the vocabulary split across the TP group: rank r owns rows
    [r V/R, (r+1) V/R); other ids give zeros locally and the all-reduce (SP: reduce-scatter
    along the sequence) completes the lookup. Bound to a FORGE optimizer, its weight is updated
    from one-hot segments (_EmbeddingFunction); tied to the LM head, the two consumers' segments
    are joined into one update (ForgeOptimizer: a weight with several consumers defers)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config: ParallelConfig,
                 init_method=None, tp_group=None):
        super().__init__()
        r = M.world(tp_group)
        _check_divisible(num_embeddings, r, "vocabulary size (pad it)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.config = tp_group, config
        self.per_rank = num_embeddings // r
        self.start = M.rank_in(tp_group) * self.per_rank
        self.weight = nn.Parameter(_shard_init((num_embeddings, embedding_dim), 0, tp_group,
                                               init_method or default_init(), config))

    def forward(self, ids):  # ids [s, b] -> [s, b, h] (SP: [s/R, b, h])
        g = self.tp_group
        local = ids
        sharded = M.world(g) > 1
        if sharded:  # rows of this shard; -1 for another rank's
            local = M.local_rows(ids, self.start, self.per_rank)
        slot = self._forge_slot
        if slot is not None:  # data parallelism: the updated rows have arrived
            slot.wait_weight()
        if slot is not None and torch.is_grad_enabled() and self.weight.requires_grad:
            e = _EmbeddingFunction.apply(local, self.weight, slot, sharded)
        else:
            e = _lookup(local, self.weight, sharded)
        if self.config.sequence_parallel:
            return M.reduce_scatter_to_sp(e, g)
        return M.reduce_from_tp(e, g)

    def sharded_parameters(self):
        return [self.weight]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss[t] = logsumexp(logits[t, :]) - logits[t, target[t]] with the vocab dim sharded;
    only [s, b] statistics cross ranks, never the full logits.

    Memory: one fp32 [s, b, V/R] tensor, worked on in place, is kept from forward to backward
    (the softmax), and backward writes the logits' gradient straight into their dtype, with
    the target entries fixed afterwards. At 512 tokens and a 128256 vocab that tensor is
    263 MB; the out-of-place version had up to four alive at once, each way."""

    @staticmethod
    def forward(ctx, logits, target, group):  # logits [s, b, V/R] (any float), target [s, b]
        # fp32 (fp64 for fp64 logits), always a copy: worked on in place below
        x = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
        vmax = x.max(dim=-1)[0]
        if M.world(group) > 1:
            torch.distributed.all_reduce(vmax, op=torch.distributed.ReduceOp.MAX, group=group)
        x.sub_(vmax[..., None])
        per = x.shape[-1]
        start = M.rank_in(group) * per
        local = target - start
        outside = (local < 0) | (local >= per)
        local = local.masked_fill(outside, 0)
        picked = x.gather(-1, local[..., None])[..., 0].masked_fill(outside, 0.0)
        sumexp = x.exp_().sum(dim=-1)
        if M.world(group) > 1:
            torch.distributed.all_reduce(picked, group=group)
            torch.distributed.all_reduce(sumexp, group=group)
        loss = sumexp.log() - picked
        softmax = x.div_(sumexp[..., None])
        ctx.save_for_backward(softmax, local, outside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):  # g [s, b]
        # d loss / d logits = (softmax - onehot(target)) * g, each element rounded once to the
        # logits' dtype: softmax * g everywhere, then (softmax - 1) * g at the targets this
        # rank holds. The saved softmax is left as it is (a retained graph can run again).
        softmax, local, outside = ctx.saved_tensors
        g = g[..., None].to(softmax.dtype)
        grad = torch.empty(softmax.shape, dtype=ctx.in_dtype, device=softmax.device)
        torch.mul(softmax, g, out=grad)
        at = softmax.gather(-1, local[..., None])
        fix = torch.where(outside[..., None], at, at - 1.0) * g
        grad.scatter_(-1, local[..., None], fix.to(ctx.in_dtype))
        return grad, None, None


def vocab_parallel_cross_entropy(logits, target, tp_group=None):
    """Per-token loss [s, b] from vocab-sharded logits [s, b, V/R]."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)

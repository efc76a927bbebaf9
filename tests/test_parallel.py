"""Tensor/sequence parallelism on CPU with gloo: collectives exact, layers exact under FORGE.

Level 1: each conjugate pair forward and backward on integer-valued,
rank-dependent inputs, compared exactly. Level 2: a small vocab-parallel network built from
the parallel layers, trained 3 steps with FORGE at TP=R (with and without sequence parallelism)
against the same network at TP=1 from the same seed: every rank's shards equal the matching
slices of the TP=1 weights to fp32 rounding (criterion in _toy_parity).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import forge_engine
from forge_engine.parallel import (ColumnParallelLinear, ParallelConfig, RowParallelLinear,
                                   VocabParallelEmbedding, copy_to_tp, gather_from_sp,
                                   gather_from_tp, reduce_from_tp, reduce_scatter_to_sp,
                                   scatter_to_sp, scatter_to_tp_last,
                                   vocab_parallel_cross_entropy)
from forge_engine.parallel.layers import shard_of
from forge_engine.parallel.state import init_parallel
from dist import run_ranks


def _collectives(rank, world):
    g = init_parallel(world).tp_group
    R, S = world, world * (world + 1) / 2
    rows = torch.arange(1, 2 * R + 1, dtype=torch.float32)[:, None].expand(2 * R, 3)

    def check(fn, x, upstream, want_y, want_grad):
        x = x.clone().requires_grad_(True)
        y = fn(x, g)
        assert torch.equal(y, want_y), (fn.__name__, "forward", y, want_y)
        y.backward(upstream)
        assert torch.equal(x.grad, want_grad), (fn.__name__, "backward", x.grad, want_grad)

    own = torch.full((2 * R, 3), rank + 1.0)
    check(copy_to_tp, own, own, own, torch.full_like(own, S))
    check(reduce_from_tp, own, own, torch.full_like(own, S), own)
    block = slice(2 * rank, 2 * rank + 2)
    blocks = torch.arange(1, R + 1, dtype=torch.float32).repeat_interleave(2)[:, None]
    check(scatter_to_sp, rows, torch.full((2, 3), rank + 1.0), rows[block],
          torch.zeros(2 * R, 3) + blocks)
    check(gather_from_sp, torch.full((2, 3), rank + 1.0), (rank + 1) * rows,
          torch.zeros(2 * R, 3) + blocks, S * rows[block])
    check(reduce_scatter_to_sp, (rank + 1) * rows, torch.full((2, 3), rank + 1.0),
          S * rows[block], torch.zeros(2 * R, 3) + blocks)
    cols = torch.arange(1, 3 * R + 1, dtype=torch.float32)[None, :].expand(2, 3 * R)
    cblocks = torch.arange(1, R + 1, dtype=torch.float32).repeat_interleave(3)[None, :]
    check(gather_from_tp, torch.full((2, 3), rank + 1.0), cols,
          torch.zeros(2, 3 * R) + cblocks, cols[:, 3 * rank:3 * rank + 3])
    check(scatter_to_tp_last, cols, torch.full((2, 3), rank + 1.0),
          cols[:, 3 * rank:3 * rank + 3], torch.zeros(2, 3 * R) + cblocks)
    # a group of one (None) is the identity both ways
    x = own.clone().requires_grad_(True)
    for fn in (copy_to_tp, reduce_from_tp, scatter_to_sp, gather_from_sp,
               reduce_scatter_to_sp, gather_from_tp, scatter_to_tp_last):
        assert fn(x, None) is x
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_are_exact(world):
    assert all(run_ranks(_collectives, world))


class Toy(nn.Module):
    """embedding -> SwiGLU (column, 2 chunks) -> row -> LM head (column) -> vocab-parallel CE."""

    V, H, F = 64, 16, 24

    def __init__(self, tp_group, sp):
        super().__init__()
        torch.manual_seed(7)
        c = ParallelConfig(sequence_parallel=sp)
        self.tp_group = tp_group
        self.emb = VocabParallelEmbedding(self.V, self.H, config=c, tp_group=tp_group,
                                          init_method=lambda w: nn.init.normal_(w, std=1.0))
        self.fc1 = ColumnParallelLinear(self.H, 2 * self.F, config=c, tp_group=tp_group,
                                        partition_chunks=2, bias=False)
        self.fc2 = RowParallelLinear(self.F, self.H, config=c, tp_group=tp_group, bias=True)
        self.head = ColumnParallelLinear(self.H, self.V, config=c, tp_group=tp_group,
                                         bias=False, init_method=lambda w: nn.init.normal_(
                                             w, std=0.3))

    def forward(self, ids):  # ids [s, b]
        h = self.emb(ids)
        gate, up = self.fc1(h)[0].chunk(2, dim=-1)
        h = h + self.fc2(F.silu(gate) * up)[0]
        logits = self.head(h)[0]
        return vocab_parallel_cross_entropy(logits, ids.roll(-1, 0), self.tp_group).mean()


def _toy_parity(rank, world, sp):
    """TP=R with FORGE vs TP=1 in float64 (torch.optim): the error must be at most twice that
    of torch.optim in fp32 at TP=1 (the same criterion as test_kernel.py: summation order is
    the only difference), plus two fp32 half-ulps of the largest weight."""
    g = init_parallel(world).tp_group
    par, r32, r64 = Toy(g, sp), Toy(None, False), Toy(None, False).double()
    opts = [forge_engine.optim.AdamW(par, lr=1e-2, weight_decay=0.1)]
    opts += [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (r32, r64)]
    assert opts[0].fused_names == ["emb.weight", "fc1.weight", "fc2.weight", "head.weight"]
    torch.manual_seed(123)
    for _ in range(3):
        ids = torch.randint(0, Toy.V, (8, 3))
        losses = []
        for m, o in zip((par, r32, r64), opts):
            loss = m(ids)
            loss.backward()
            if sp and m is par:  # the row bias is replicated; its grad is per sequence shard
                torch.distributed.all_reduce(m.fc2.bias.grad, group=g)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[2], rel=1e-5), losses
    for (name, p), q32, q64 in zip(par.named_parameters(), r32.parameters(), r64.parameters()):
        dim, chunks = {"emb.weight": (0, 1), "fc1.weight": (0, 2), "fc2.weight": (1, 1),
                       "head.weight": (0, 1)}.get(name, (None, 1))
        cut = (lambda t: t.detach()) if dim is None else \
            (lambda t: shard_of(t.detach(), dim, g, chunks))
        ref = cut(q64)
        base = float((cut(q32).double() - ref).abs().max())
        err = float((p.detach().double() - ref).abs().max())
        bound = 2 * base + 4 * 2.0 ** -24 * float(ref.abs().max())
        assert err <= bound, f"rank {rank} {name}: error {err:.3e} > {bound:.3e}"
    return True


@pytest.mark.parametrize("world,sp", [(2, False), (2, True), (4, True)])
def test_parallel_layers_match_single_rank_under_forge(world, sp, monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    assert all(run_ranks(_toy_parity, world, sp))


def test_bad_tp_shapes_fail_before_any_work():
    c = ParallelConfig()

    class FakeGroup:  # only the size is read before the check
        pass

    import forge_engine.parallel.mappings as M
    orig = M.world
    M.world = lambda g: 3 if isinstance(g, FakeGroup) else orig(g)
    try:
        with pytest.raises(ValueError, match=r"output_size \(16\) is not divisible by the "
                                             r"tensor-parallel size \(3\)"):
            ColumnParallelLinear(8, 16, config=c, tp_group=FakeGroup())
        with pytest.raises(ValueError, match=r"input_size \(16\)"):
            RowParallelLinear(16, 8, config=c, tp_group=FakeGroup())
        with pytest.raises(ValueError, match="vocabulary size"):
            VocabParallelEmbedding(100, 8, config=c, tp_group=FakeGroup())
    finally:
        M.world = orig


def _saved_input_is_the_local_shard(rank, world):
    g = init_parallel(world).tp_group
    col = ColumnParallelLinear(8, 12, config=ParallelConfig(sequence_parallel=True),
                               tp_group=g, bias=False)
    forge_engine.optim.SGD(col, lr=0.1)
    x = torch.randn(3, 2, 8, requires_grad=True)  # this rank's sequence shard [s/R, b, h]
    y, _ = col(x)
    assert y.shape == (3 * world, 2, 12 // world)
    saved_x, saved_w = y.grad_fn.saved_tensors
    assert saved_x.shape == (3, 2, 8), saved_x.shape  # not the gathered [s, b, h]
    y.sum().backward()
    assert x.grad.shape == x.shape and type(col.weight.grad).__name__ == "FusedGrad"
    return True


def test_sequence_parallel_column_saves_only_its_shard(monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    assert all(run_ranks(_saved_input_is_the_local_shard, 2))


def test_a_world_of_one_gives_back_the_variables_it_set(monkeypatch):
    """init_parallel in a plain process (no RANK) sets RANK, WORLD_SIZE, LOCAL_RANK and a free
    MASTER_PORT; destroy_parallel restores what was there, so a second world in the process
    (pretrain.main called twice) or a subprocess it starts never meets the first one's port."""
    import os
    from forge_engine.parallel.state import destroy_parallel
    for k in ("RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "7")  # without RANK: not a launcher's world, replaced
    before = dict(os.environ)
    for _ in range(2):
        init_parallel(1, backend="gloo")
        assert os.environ["WORLD_SIZE"] == "1" and os.environ["RANK"] == "0"
        destroy_parallel()
        assert {k: os.environ.get(k) for k in before} == before
        assert "MASTER_PORT" not in os.environ and "RANK" not in os.environ

"""Our tensor-parallel linears against megatron-core's own, option by option.

forge_engine.parallel.ColumnParallelLinear / RowParallelLinear promise megatron-core's
constructor and forward contract. Here megatron-core 0.16's tensor_parallel layers are built on
the same gloo ranks (CPU) with the same weight shards and biases, for every combination of the
options its users pass: bias, gather_output, skip_bias_add (column); bias, input_is_parallel,
skip_bias_add (row); each with and without sequence parallelism where megatron-core allows it.
Ours run FORGE (SGD, lr 1, through the torch backend), so our weight is updated inside
backward; megatron-core's gets an ordinary .grad. Compared, per rank:

    output (and the returned bias when skip_bias_add)   equal to megatron-core's, and to the
                                                       unsharded x W^T + b sliced as the
                                                       option says
    input gradient                                     equal (shape: the rank's shard or the
                                                       full input, as megatron-core's)
    weight                                             ours after backward = W - megatron's
                                                       .grad (SGD at lr 1: the fused update
                                                       saw the same weight gradient)
    bias gradient                                      equal (row + SP: the rank's partial
                                                       sum, which megatron-core leaves to be
                                                       all-reduced later, as we do)

Every input, weight, bias and upstream gradient holds small integers, so every product and sum
is exact in fp32 whatever the order of summation: the comparisons are exact (torch.equal).

megatron-core on the CPU: its layers' constructors allocate on torch.cuda.current_device()
unless ModelParallelConfig(use_cpu_initialization=True), which is set (with
perform_initialization=False: the weights are copied in from ours); sequence parallelism's
all-gather buffer (GlobalMemoryBuffer) and the reduce-scatter's output in its linear's backward
still call torch.cuda.current_device() with no flag to avoid it, so each rank replaces that one
function by one returning the CPU device (_megatron_on_cpu; forge_engine never calls it on the
CPU). Its collectives (all_gather_into_tensor, reduce_scatter_tensor, all_reduce) run on gloo.
The process groups are megatron-core's parallel_state ones, built by init_parallel, passed to
both layers explicitly.
"""
import itertools
import warnings

import pytest
import torch

import forge_engine
from forge_engine.optim.fused_grad import FusedGrad
from forge_engine.parallel import ColumnParallelLinear, ParallelConfig, RowParallelLinear
from forge_engine.parallel.state import init_parallel
from dist import run_ranks

S, B, IN, OUT = 4, 3, 6, 10  # [s, b, h]; s and both widths divide among 2 ranks


def _megatron_on_cpu():
    """Import megatron-core's layers and make its device helper answer the CPU (see the module
    docstring): torch.cuda.current_device is what its SP buffers allocate on."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import layers as mlayers
    torch.cuda.current_device = lambda: torch.device("cpu")
    return ModelParallelConfig, mlayers


def _ints(gen, *shape, lo=-3, hi=4):
    return torch.randint(lo, hi, shape, generator=gen).float()


def _cut(t, dim, rank, world):
    return t.chunk(world, dim=dim)[rank].contiguous()


def _column_cases():
    for bias, gather, skip, sp in itertools.product((True, False), repeat=4):
        if not (gather and sp):  # gather_output with SP: refused by both
            yield dict(bias=bias, gather_output=gather, skip_bias_add=skip), sp


def _row_cases():
    for bias, parallel_in, skip, sp in itertools.product((True, False), repeat=4):
        if parallel_in or not sp:  # SP needs input_is_parallel in both
            yield dict(bias=bias, input_is_parallel=parallel_in, skip_bias_add=skip), sp


def _run_layer(layer, x, dy, rank, world):
    """forward, then the caller's bias add where skip_bias_add returned it, then backward of
    sum((y + b) * dy). Returns (y, returned bias, x.grad). A gathered column output with its
    bias returned holds [s, b, out] against a bias shard [out/R]: the bias then meets its own
    columns of dy."""
    x = x.clone().requires_grad_(True)
    y, b = layer(x)
    loss = (y * dy).sum()
    if b is not None:
        db = dy.sum((0, 1))
        if db.shape != b.shape:
            db = _cut(db, 0, rank, world)
        loss = loss + (b * db).sum()
    loss.backward()
    return y.detach(), b, x.grad


def _parity(rank, world):
    ModelParallelConfig, mlayers = _megatron_on_cpu()
    g = init_parallel(world).tp_group
    checked = []
    for kind, cases in (("column", _column_cases()), ("row", _row_cases())):
        for opts, sp in cases:
            gen = torch.Generator().manual_seed(len(checked))  # the same numbers on each rank
            w_full = _ints(gen, OUT, IN, lo=-2, hi=3)
            b_full = _ints(gen, OUT)
            x_full = _ints(gen, S, B, IN)
            dy_full = _ints(gen, S, B, OUT)
            mcfg = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp,
                                       use_cpu_initialization=True, perform_initialization=False,
                                       params_dtype=torch.float32,
                                       gradient_accumulation_fusion=False)
            cfg = ParallelConfig(sequence_parallel=sp)
            if kind == "column":
                ours = ColumnParallelLinear(IN, OUT, config=cfg, tp_group=g, **opts)
                theirs = mlayers.ColumnParallelLinear(IN, OUT, config=mcfg, tp_group=g,
                                                      init_method=lambda w: None, **opts)
                w_shard, b_shard = _cut(w_full, 0, rank, world), _cut(b_full, 0, rank, world)
                x = _cut(x_full, 0, rank, world) if sp else x_full
                y_full = x_full @ w_full.t()
                if opts["bias"] and not opts["skip_bias_add"]:
                    y_full = y_full + b_full
                y_want = y_full if opts["gather_output"] else _cut(y_full, -1, rank, world)
                dy = dy_full if opts["gather_output"] else _cut(dy_full, -1, rank, world)
            else:
                ours = RowParallelLinear(IN, OUT, config=cfg, tp_group=g, **opts)
                theirs = mlayers.RowParallelLinear(IN, OUT, config=mcfg, tp_group=g,
                                                   init_method=lambda w: None, **opts)
                w_shard, b_shard = _cut(w_full, 1, rank, world), b_full
                x = _cut(x_full, -1, rank, world) if opts["input_is_parallel"] else x_full
                y_full = x_full @ w_full.t()
                if opts["bias"] and not opts["skip_bias_add"]:
                    y_full = y_full + b_full
                y_want = _cut(y_full, 0, rank, world) if sp else y_full
                dy = _cut(dy_full, 0, rank, world) if sp else dy_full
            assert ours.weight.shape == theirs.weight.shape == w_shard.shape
            with torch.no_grad():
                for layer in (ours, theirs):
                    layer.weight.copy_(w_shard)
                    if opts["bias"]:
                        assert layer.bias.shape == b_shard.shape
                        layer.bias.copy_(b_shard)
                    else:
                        assert layer.bias is None
            opt = forge_engine.optim.SGD(ours, lr=1.0, updates="backward")
            y_o, b_o, dx_o = _run_layer(ours, x, dy, rank, world)
            y_t, b_t, dx_t = _run_layer(theirs, x, dy, rank, world)
            label = f"rank {rank} {kind} {opts} sp={sp}"
            assert torch.equal(y_o, y_t), f"{label}: output differs from megatron-core's"
            assert torch.equal(y_o, y_want), f"{label}: output is not the unsharded x W^T + b"
            assert (b_o is None) == (b_t is None), f"{label}: returned bias"
            if b_o is not None:
                assert b_o is ours.bias and torch.equal(b_o.detach(), b_t.detach())
            assert dx_o.shape == dx_t.shape == x.shape and torch.equal(dx_o, dx_t), \
                f"{label}: input gradient differs"
            # fused: updated in backward; its .grad a FusedGrad, never materialized
            assert isinstance(ours.weight.grad, FusedGrad) and ours.weight.grad.applied
            assert torch.equal(ours.weight.detach(), w_shard - theirs.weight.grad), \
                f"{label}: the fused update did not see megatron-core's weight gradient"
            if opts["bias"]:
                assert torch.equal(ours.bias.grad, theirs.bias.grad), f"{label}: bias gradient"
            opt.zero_grad()
            checked.append(label)
    return checked


@pytest.mark.slow
def test_parallel_linears_match_megatron_core(monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    checked = run_ranks(_parity, 2)
    # column: 16 combinations less the 4 of gather_output with SP; row: 16 less the 4 of SP
    # with a full input
    assert len(checked[0]) == len(checked[1]) == 24


@pytest.mark.parametrize("kind", ["column", "row"])
def test_refused_combinations_match_megatron_core(kind):
    """gather_output with SP (column) and a full input with SP (row), the combinations the
    parity test leaves out: refused at construction with a one-line reason (megatron-core's
    row layer asserts the second in its forward)."""
    cfg = ParallelConfig(sequence_parallel=True)
    if kind == "column":
        with pytest.raises(ValueError, match="gather_output is not compatible"):
            ColumnParallelLinear(IN, OUT, config=cfg, gather_output=True)
    else:
        with pytest.raises(ValueError, match="sequence_parallel needs input_is_parallel"):
            RowParallelLinear(IN, OUT, config=cfg, input_is_parallel=False)

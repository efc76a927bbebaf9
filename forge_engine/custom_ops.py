"""The FORGE linear and embedding as torch.compile traces them, so that a compiled model keeps
one graph across its FORGE modules (docs/design.md, "torch.compile").

Eager, a FORGE module runs its hooked linear or autograd.Function (linear.py), whose backward
calls into the optimizer from Python; Dynamo cannot trace that and would break the graph at
every layer. Under torch.compile a linear is CompiledLinear instead, an autograd.Function whose
forward (y = x w^T + b) and backward (dX = dY W, db) are ordinary operators that the compiler
traces and compiles, and whose one opaque call is the fused update:

    forge_engine::linear_update(x, dy, after, slot)   the update of slot's weight from (x, dy);
                                                       after = dX, so that W is read first
    forge_engine::embedding(ids, rows, w, slot) -> w[ids]
        backward: forge_engine::embedding_backward(rows, de, slot)   (the one-hot segment)
    forge_engine::linear(x, w, b, slot) -> y           CompiledLinear under FORGE-DP, whose
                                                       forward waits for the weight's rows

The forward ops are torch.library custom ops (they carry the autograd formula); the update
ops are plain operators of a library fragment with CPU and CUDA kernels and fakes, which a
compiled backward calls with less host work. The update ops are opaque to the compiler and
registered as ordered effects: they are never dropped as dead code (a first layer's dX may be
unused, its update is not) and keep their order.
`slot` is the weight's optim.slots.Slot named by a 0-dim int64 CPU tensor (Slot.key): a tensor
is a graph input, where an int would be a constant of the graph, so one compiled graph serves
every layer of a model (transformers' regional compilation compiles each decoder layer with
the same code; with int handles each layer recompiled until torch's recompile limit left the
rest eager). Reading the CPU tensor's value never waits for a device. A segment the
optimizer keeps past the op (updates="step", or the non-finite recorder) is copied first: the
compiled graph reuses the memory of its temporaries once the op has returned.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_SLOTS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)


def register(slot) -> Tensor:
    """A new key for slot (its handle as a 0-dim int64 CPU tensor; kept while the slot lives)."""
    handle = next(_HANDLES)
    _SLOTS[handle] = slot
    return torch.tensor(handle, dtype=torch.int64)


def _slot(key: Tensor):
    slot = _SLOTS.get(int(key))
    if slot is None:
        raise RuntimeError("forge_engine: a compiled FORGE module ran after its optimizer was "
                           "deleted; compile the model again (torch._dynamo.reset())")
    return slot


def _held(slot, *tensors):
    """The segment's tensors as the slot may keep them: copies where it keeps them past the op."""
    return tuple(t.clone() for t in tensors) if slot.keeps_segments() else tensors


# ---------------------------------------------------------------------------- linear

@torch.library.custom_op("forge_engine::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], slot: Tensor) -> Tensor:
    """CompiledLinear with FORGE-DP: the forward first waits for the weight's updated rows."""
    _slot(slot).wait_weight()
    return F.linear(x, weight, bias)


@linear.register_fake
def _linear_fake(x, weight, bias, slot):
    return F.linear(x, weight, bias)


# the backward ops' fragment (module docstring: a custom op's Python wrappers, its autograd
# layer and Dynamo's disable, would run at every call of a compiled backward)
_LIB = torch.library.Library("forge_engine", "FRAGMENT")


def _backward_op(schema: str, kernel, fake):
    """Define schema's operator with kernel for CPU and CUDA tensors and fake for tracing (the
    ops take no gradient); returns its overload."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    torch.library.register_fake(f"forge_engine::{name}", fake, lib=_LIB)
    return getattr(torch.ops.forge_engine, name).default


def linear_update(x: Tensor, dy: Tensor, after: Tensor, slot: Tensor) -> None:
    """The fused update of slot's weight from x [T, K] and dy [T, N]; after: the layer's dX
    (or dy where there is none), read by nothing here: as an input it orders this op after
    the GEMM that reads W."""
    s = _slot(slot)
    s.begin_backward()  # misuse checks first, before the weight changes
    early = s.start_exchange(x, dy)
    s.update(*_held(s, x, dy), early)


def _linear_update_fake(x, dy, after, slot):
    return None


_linear_update_op = _backward_op(
    "linear_update(Tensor x, Tensor dy, Tensor after, Tensor slot) -> ()",
    linear_update, _linear_update_fake)


def _linear_setup(ctx, inputs, output):
    x, weight, bias, slot = inputs
    ctx.save_for_backward(x, weight, slot)
    ctx.has_bias = bias is not None


def _linear_grad(ctx, dy):
    x, weight, slot = ctx.saved_tensors
    n, k = weight.shape
    dx = dy @ weight.to(dy.dtype) if ctx.needs_input_grad[0] else None  # W before its update
    dy2 = dy.reshape(-1, n)
    _linear_update_op(x.reshape(-1, k), dy2, dy2 if dx is None else dx, slot)
    db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, None, db, None


linear.register_autograd(_linear_grad, setup_context=_linear_setup)


class CompiledLinear(torch.autograd.Function):
    """(x [*, K], weight [N, K], bias [N] | None, slot) -> y [*, N], as torch.compile traces
    it: the forward and the dX GEMM are the compiler's own operators, and the one opaque call
    of the backward is the fused update, forge_engine::linear_update, which takes dX as an
    input so that it runs after W has been read (W before its update)."""

    @staticmethod
    def forward(x, weight, bias, slot):
        return F.linear(x, weight, bias)

    setup_context = staticmethod(_linear_setup)
    backward = staticmethod(_linear_grad)


# ---------------------------------------------------------------------------- embedding

@torch.library.custom_op("forge_engine::embedding", mutates_args=())
def embedding(ids: Tensor, rows: Tensor, weight: Tensor, slot: Tensor) -> Tensor:
    _slot(slot).wait_weight()
    return F.embedding(ids, weight)


@embedding.register_fake
def _embedding_fake(ids, rows, weight, slot):
    return F.embedding(ids, weight)


def embedding_backward(rows: Tensor, de: Tensor, slot: Tensor) -> None:
    s = _slot(slot)
    s.begin_backward()
    s.update_onehot(*_held(s, rows.reshape(-1), de.reshape(-1, de.shape[-1])))


def _embedding_backward_fake(rows, de, slot):
    return None


_embedding_backward_op = _backward_op(
    "embedding_backward(Tensor rows, Tensor de, Tensor slot) -> ()",
    embedding_backward, _embedding_backward_fake)


def _embedding_setup(ctx, inputs, output):
    ids, rows, weight, slot = inputs
    ctx.save_for_backward(rows, slot)


def _embedding_grad(ctx, de):
    rows, slot = ctx.saved_tensors
    _embedding_backward_op(rows, de, slot)
    return None, None, None, None


embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)


def _ordered(op) -> None:
    """Mark op as an ordered side effect (kept, and kept in order, by the compiler), through
    the registry this torch has; one with none keeps it from dead-code elimination only."""
    register_effect = getattr(torch.library, "_register_effectful_op", None)
    if register_effect is not None:
        from torch._library.effects import EffectType
        register_effect(op, EffectType.ORDERED)
        return
    try:
        from torch._higher_order_ops import effects
        effects._register_effectful_op(op, effects._EffectType.ORDERED)
    except (ImportError, AttributeError):
        torch.fx.node.has_side_effect(op)


for _op in (_linear_update_op, _embedding_backward_op):
    _ordered(_op)

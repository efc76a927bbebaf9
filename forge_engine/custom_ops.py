"""The FORGE linear and embedding as registered custom ops: what torch.compile traces, so that a
compiled model keeps one graph across its FORGE modules (docs/design.md, "torch.compile").

Eager, a FORGE module runs its autograd.Function (linear.py). Dynamo cannot trace a Function
whose backward calls into the optimizer, and would break the graph at every layer; under
torch.compile the module calls these ops instead, which do the same arithmetic:

    forge_engine::linear(x, w, b, slot) -> y                 y = x w^T + b
        backward: forge_engine::linear_backward(dy, x, w, slot, needs_dx) -> dx
                  (dX = dY W with W read before its update, then the fused update), db = sum dY
    forge_engine::embedding(ids, rows, w, slot) -> w[ids]
        backward: forge_engine::embedding_backward(rows, de, slot)   (the one-hot segment)

The forward ops are torch.library custom ops (they carry the autograd formula); the backward
ops are plain operators of a library fragment with CPU and CUDA kernels and fakes, which a
compiled backward calls with less host work. The backward ops are opaque to the compiler and
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
    _slot(slot).wait_weight()  # data parallelism: the updated rows have arrived
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


def linear_backward(dy: Tensor, x: Tensor, weight: Tensor, slot: Tensor, needs_dx: bool) -> Tensor:
    s = _slot(slot)
    s.begin_backward()  # misuse checks first, before anything is computed
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    early = s.start_exchange(dy2)
    dx = dy @ weight.to(dy.dtype) if needs_dx else dy.new_empty(0)  # W before its update
    x2, dy2 = _held(s, x.reshape(-1, k), dy2)
    s.update(x2, dy2, early)
    return dx


def _linear_backward_fake(dy, x, weight, slot, needs_dx):
    return dy @ weight.to(dy.dtype) if needs_dx else dy.new_empty(0)


_linear_backward_op = _backward_op(
    "linear_backward(Tensor dy, Tensor x, Tensor weight, Tensor slot, bool needs_dx) -> Tensor",
    linear_backward, _linear_backward_fake)


def _linear_setup(ctx, inputs, output):
    x, weight, bias, slot = inputs
    ctx.save_for_backward(x, weight, slot)
    ctx.has_bias = bias is not None


def _linear_grad(ctx, dy):
    x, weight, slot = ctx.saved_tensors
    dx = _linear_backward_op(dy, x, weight, slot, ctx.needs_input_grad[0])
    db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] \
        else None
    return (dx if ctx.needs_input_grad[0] else None), None, db, None


linear.register_autograd(_linear_grad, setup_context=_linear_setup)


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


for _op in (_linear_backward_op, _embedding_backward_op):
    _ordered(_op)

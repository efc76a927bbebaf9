"""FORGE linear: an nn.Linear whose backward updates its own weight (docs/design.md, "The backward
of one fused linear").

    forward   y [*, N] = x [*, K] @ W^T [K, N] + b          (as nn.Linear)
    backward  1. dx [*, K] = dy [*, N] @ W [N, K]          (W read BEFORE the update)
              2. start the TP collective of dx (async; column-parallel layers only)
              3. fused kernel: W <- step(W, dy^T x)         (dW never materialized)
              4. wait for the collective; return dx (db = sum of dy: standard path)
The weight's gradient returned to autograd is None, so `.grad` of a fused weight stays None.
ForgeLinearFunction does these steps; without tensor parallelism, FORGE-DP or activation
checkpointing, _hooked_linear does steps 1 and 3 with less host work: torch's own node computes
dx from the detached weight, and a hook on it runs the update after.

A module becomes a ForgeLinear when a forge_engine optimizer swaps its class in place: the same
module object, the same Parameter objects, the same state_dict keys. transformers' Conv1D
(y = x W + b, W [in, out]) becomes a ForgeConv1D the same way, a linear of the view W^T.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from forge_engine import custom_ops


class ForgeLinearFunction(torch.autograd.Function):
    """(x [*, K], weight [N, K], bias [N] | None, slot, comm) -> y [*, N]; see module docstring.

    slot None (a column-parallel weight not on FORGE, e.g. forge off): the same collectives,
    and the weight gets its ordinary materialized gradient instead of an update.

    comm (a parallel.mappings.ColumnInput, or None) moves the input across the TP group: then
    x is this rank's input (SP: a sequence shard), the forward gathers it, and the backward
    re-gathers it behind the dX GEMM and reduces dX behind the fused update (both async)."""

    @staticmethod
    def forward(ctx, x, weight, bias, slot, comm):
        ctx.save_for_backward(x, weight)  # with SP: the local shard only
        ctx.slot, ctx.comm = slot, comm
        x_full = comm.gather(x).wait() if comm is not None else x
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        slot, comm = ctx.slot, ctx.comm
        if slot is not None:
            slot.begin_backward()  # misuse checks first, before anything is computed
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        gathering = comm.gather(x, async_op=True) if comm is not None else None
        dy2 = dy.reshape(-1, n)
        # data parallelism: the dY exchange between replicas runs behind the dX GEMM too
        early = slot.start_exchange(x, dy2) if slot is not None else None
        dx = pending_dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight.to(dy.dtype)  # step 1: W before its update
            if comm is not None:
                pending_dx = comm.reduce_grad(dx)  # step 2: in flight during the update
        db = dy2.sum(0) if ctx.needs_input_grad[2] else None
        x_full = gathering.wait() if gathering is not None else x
        dw = None
        if slot is not None:
            slot.update(x_full.reshape(-1, k), dy2, early)  # step 3: the fused update
        elif ctx.needs_input_grad[1]:  # unfused (forge off): the ordinary materialized dW
            dw = (dy2.t() @ x_full.reshape(-1, k).to(dy2.dtype)).to(weight.dtype)
        if pending_dx is not None:
            dx = pending_dx.wait()  # step 4
        return dx, dw, db, None, None


def _hooked_linear(x, weight, bias, slot) -> torch.Tensor:
    """The fused linear without a Python autograd node: torch's linear of the detached weight,
    whose C++ backward node computes dX (and db) only, and a hook on that node, which runs once
    dX has been computed (W read before its update, as in ForgeLinearFunction) and hands
    (X, dY) to the slot. It costs the host less per linear than the Function's forward and
    backward (docs/performance.md, "transformers' own models"). _linear takes it without
    tensor parallelism or FORGE-DP (whose collectives the Function overlaps with the dX
    GEMM), for an input that requires grad (else there is no node to hook), and outside
    saved-tensor hooks (activation checkpointing drops and recomputes what a Function
    saves; the hook would keep X alive)."""
    n, k = weight.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # (torch's linear folds [*, K] alike)
    y2 = F.linear(x2, weight.detach(), bias)
    y2.grad_fn.register_hook(_UpdateHook(slot, x2))
    return y2 if x2 is x else y2.view(*x.shape[:-1], n)


class _UpdateHook:
    """The hook of _hooked_linear's node: called with (grad_inputs, grad_outputs), the
    latter (dY [T, N],), it runs the slot's update with dW = dY^T X.

    Autograd frees a node's saved tensors once the node has run, but the node itself (and
    its hooks) lives as long as the graph does, so the hook drops X once it is used: else
    every linear's input would stay alive through the rest of backward and after it, where
    torch's saved inputs do not. A graph retained for another backward keeps X."""

    __slots__ = ("slot", "x")

    def __init__(self, slot, x):
        self.slot, self.x = slot, x

    def __call__(self, grad_inputs, grad_outputs):
        x = self.x  # (a second backward of a freed graph fails in the node, before this)
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            self.x = None
        self.slot.backward_update(x, grad_outputs[0])


def _new_module(cls):
    """An empty module of cls, for pickling and copies (its state is set afterwards)."""
    return cls.__new__(cls)


class ForgeCapable:
    """Mixin of every module whose weight FORGE can update in backward (ForgeLinear and the
    tensor-parallel linears). An optimizer binds the weight by setting `_forge_slot`; unbound
    (no FORGE optimizer, forge=False, or a weight on the standard path), `_linear` is F.linear
    and the weight gets an ordinary .grad.

    A copy of the module (copy.deepcopy, pickling: torch.save(model)) is not bound: no
    optimizer updates it, and a copy of a swapped torch module is of its torch class again."""

    _forge_slot = None
    _forge_from = None  # the torch class an optimizer swapped this module from

    def __reduce_ex__(self, protocol):
        fn, args, state, *rest = super().__reduce_ex__(protocol)
        if self._forge_from is not None:
            fn, args = _new_module, (self._forge_from,)
        if isinstance(state, dict):
            state = {k: v for k, v in state.items()
                     if k not in ("_forge_slot", "_forge_slots", "_forge_from")}
        return (fn, args, state, *rest)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias, comm=None,
                slot="own") -> torch.Tensor:
        """y = x W^T + b; comm: the ColumnInput of a column-parallel layer (x is then local);
        slot: the weight's binding, if not this module's own (a module with two weights)."""
        slot = self._forge_slot if slot == "own" else slot
        grad = torch.is_grad_enabled()
        if slot is not None and comm is None and grad and weight.requires_grad \
                and torch.compiler.is_compiling():  # the same linear, as ops Dynamo traces
            if slot.opt._shards:
                return torch.ops.forge_engine.linear(x, weight, bias, slot.key)
            return custom_ops.CompiledLinear.apply(x, weight, bias, slot.key)
        if slot is not None:  # data parallelism: the updated rows have arrived
            slot.wait_weight()
        slot = slot if grad and weight.requires_grad else None
        if slot is None and (comm is None or not grad):  # plain, or a no-grad forward
            return F.linear(x if comm is None else comm.gather(x).wait(), weight, bias)
        if comm is None and x.requires_grad and not slot.opt._shards \
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            return _hooked_linear(x, weight, bias, slot)
        # a column-parallel layer takes the Function even unfused: the same saved shard and
        # overlapped collectives with FORGE on or off
        return ForgeLinearFunction.apply(x, weight, bias, slot, comm)


class ForgeLinear(nn.Linear, ForgeCapable):
    """nn.Linear trained by FORGE; an optimizer swaps an nn.Linear's class to this in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)


class ForgeEmbedding(nn.Embedding, ForgeCapable):
    """nn.Embedding trained by FORGE: backward hands the one-hot segment (ids, dE) to the
    fused kernel, which builds onehot(ids)^T dE tile by tile (no [V, h] gradient). Ids equal
    to padding_idx add nothing, as in torch."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [*] -> [*, h]
        slot = self._forge_slot
        if slot is None or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(ids)
        rows = ids if self.padding_idx is None else ids.masked_fill(ids == self.padding_idx, -1)
        if torch.compiler.is_compiling():
            return torch.ops.forge_engine.embedding(ids, rows, self.weight, slot.key)
        slot.wait_weight()
        return OneHotFunction.apply(ids, rows, self.weight, slot)


class OneHotFunction(torch.autograd.Function):
    """(ids [*], rows [*] (ids, -1 where no gradient goes), weight [V, h], slot) -> weight[ids]
    [*, h]; backward: the one-hot segment (rows, dE) to the slot."""

    @staticmethod
    def forward(ctx, ids, rows, weight, slot):
        ctx.save_for_backward(rows)
        ctx.slot = slot
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, de):
        ctx.slot.begin_backward()
        (rows,) = ctx.saved_tensors
        ctx.slot.update_onehot(rows.reshape(-1), de.reshape(-1, de.shape[-1]))
        return None, None, None, None


class _CrossInProjFunction(torch.autograd.Function):
    """nn.MultiheadAttention's packed input projection when query, key and value differ:
    (q_in [Lq, B, E], k_in [S, B, E], v_in [S, B, E], W [3E, E], b [3E] | None, slot) ->
    (q, k, v), each its third of W. The weight's gradient is one dense token segment
    dW = DY^T X with X = [q_in; k_in; v_in] and DY block-diagonal ([dq 0 0; 0 dk 0; 0 0 dv]):
    the three thirds' gradients, exactly, in one update."""

    @staticmethod
    def forward(ctx, q_in, k_in, v_in, weight, bias, slot):
        ctx.save_for_backward(q_in, k_in, v_in, weight)
        ctx.slot, ctx.has_bias = slot, bias is not None
        w = weight.chunk(3)
        b = bias.chunk(3) if bias is not None else (None,) * 3
        return tuple(F.linear(x, wi, bi) for x, wi, bi in zip((q_in, k_in, v_in), w, b))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.slot.begin_backward()
        q_in, k_in, v_in, weight = ctx.saved_tensors
        e = weight.shape[1]
        grads = [torch.zeros_like(t) if g is None else g for g, t in
                 zip((dq, dk, dv), (q_in, k_in, v_in))]
        w = weight.chunk(3)
        dx = [g @ wi.to(g.dtype) for g, wi in zip(grads, w)]
        x2 = torch.cat([t.reshape(-1, e) for t in (q_in, k_in, v_in)])
        dy2 = x2.new_zeros((x2.shape[0], 3 * e), dtype=grads[0].dtype)
        t0 = 0
        for i, g in enumerate(grads):
            g2 = g.reshape(-1, e)
            dy2[t0:t0 + g2.shape[0], i * e:(i + 1) * e] = g2
            t0 += g2.shape[0]
        db = torch.cat([g.reshape(-1, e).sum(0) for g in grads]) if ctx.has_bias else None
        ctx.slot.update(x2, dy2)
        return dx[0], dx[1], dx[2], None, db, None


class ForgeMultiheadAttention(nn.MultiheadAttention, ForgeCapable):
    """nn.MultiheadAttention trained by FORGE: in_proj_weight and out_proj.weight are updated
    by the fused kernel. With gradients enabled the forward is computed here (the packed
    projection, scaled dot-product attention, the output projection) with torch's semantics:
    attn_mask (bool or additive, [L, S] or [B * heads, L, S]; is_causal without a mask: the
    causal one), key_padding_mask, dropout, need_weights with averaged or per-head weights;
    without gradients it is torch's own."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        slots = self.__dict__.get("_forge_slots")
        if not slots or not torch.is_grad_enabled():
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights,
                                   is_causal=is_causal)
        batched = query.dim() == 3
        same = query is key and key is value  # self-attention (before the layout changes)
        if self.batch_first and batched:  # [B, L, E] -> [L, B, E]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if not batched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        L, B, E = query.shape
        S, H = key.shape[0], self.num_heads
        D = E // H
        slot_in = slots["in_proj_weight"]
        if same:  # self-attention: one dense segment
            q, k, v = self._linear(query, self.in_proj_weight, self.in_proj_bias,
                                   slot=slot_in).chunk(3, dim=-1)
        elif torch.compiler.is_compiling():  # the same segment through the traced linear:
            # the stacked inputs' full projection, of which each input keeps its own third;
            # the other blocks' gradient is zero, so dW = DY^T X is the block-diagonal one
            rows = [t.reshape(-1, E) for t in (query, key, value)]
            y = self._linear(torch.cat(rows), self.in_proj_weight, self.in_proj_bias,
                             slot=slot_in)
            q, k, v = (part[:, i * E:(i + 1) * E].reshape(t.shape)
                       for i, (part, t) in enumerate(zip(y.split([r.shape[0] for r in rows]),
                                                         (query, key, value))))
        else:
            slot_in.wait_weight()
            q, k, v = _CrossInProjFunction.apply(query, key, value, self.in_proj_weight,
                                                 self.in_proj_bias, slot_in)
        q = q.reshape(L, B * H, D).transpose(0, 1).reshape(B, H, L, D)
        k = k.reshape(S, B * H, D).transpose(0, 1).reshape(B, H, S, D)
        v = v.reshape(S, B * H, D).transpose(0, 1).reshape(B, H, S, D)
        if attn_mask is None and is_causal:  # torch's hint, given without the mask itself
            attn_mask = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
        mask = self._additive_mask(attn_mask, key_padding_mask, B, L, S, q.dtype)
        p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q * D ** -0.5) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(dim=-1)
            o = F.dropout(weights, p) @ v if p > 0 else weights @ v
        else:
            weights = None
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        o = o.permute(2, 0, 1, 3).reshape(L * B, E)  # [L, B, E] as rows
        out = self._linear(o, self.out_proj.weight, self.out_proj.bias,
                           slot=slots["out_proj.weight"]).view(L, B, E)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
        if weights is not None:
            weights = weights.mean(dim=1) if average_attn_weights else weights
            if not batched:
                weights = weights.squeeze(0)
        return out, weights

    def _additive_mask(self, attn_mask, key_padding_mask, B, L, S, dtype):
        """attn_mask and key_padding_mask as one additive float mask broadcastable to
        [B, H, L, S] (True in a bool mask: not attended), or None."""
        mask = None
        if attn_mask is not None:
            m = attn_mask
            if m.dtype == torch.bool:
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
            m = m.to(dtype)
            mask = m.view(B, self.num_heads, L, S) if m.dim() == 3 else m
        if key_padding_mask is not None:
            k = key_padding_mask
            if k.dtype == torch.bool:
                k = torch.zeros(k.shape, dtype=dtype, device=k.device).masked_fill(k, float("-inf"))
            k = k.to(dtype).view(B, 1, 1, S)
            mask = k if mask is None else mask + k
        return mask


# the torch modules whose weights FORGE can update, and the class each becomes
FORGE_CLASSES = {nn.Linear: ForgeLinear, nn.Embedding: ForgeEmbedding,
                 nn.MultiheadAttention: ForgeMultiheadAttention}


def _conv1d():
    """transformers' Conv1D class (GPT-2's linears: y = x W + b, W [in, out]), or None where
    transformers is not imported (then no model holds one)."""
    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None)


def _conv1d_forward(self, x: torch.Tensor) -> torch.Tensor:
    # the linear of W^T (a view): torch's GEMM reads W [in, out] as it is stored
    return self._linear(x, self.weight.t(), self.bias)


def _scaled_embedding(cls) -> bool:
    """Whether cls is one of transformers' *ScaledWordEmbedding classes (Gemma, BART, ...): an
    nn.Embedding whose forward scales super().forward(ids) (Gemma3TextScaledWordEmbedding:
    by sqrt(hidden)). Put before ForgeEmbedding in a class's MRO, that super() call is
    FORGE's lookup, and autograd scales the gradient it hands the update. A forward that did
    not go through it would give the weight a foreign gradient, which the optimizer refuses
    at the first backward (GradPolicyMixin._foreign_grad_hook)."""
    return cls.__bases__ == (nn.Embedding,) and cls.__name__.endswith("ScaledWordEmbedding") \
        and cls.__module__.startswith("transformers.")


_MADE: dict = {}  # a transformers class -> its FORGE class, made when a model first needs it


def _forge_class(cls):
    """The FORGE class a module of class cls becomes (None: FORGE does not bind it). Besides
    FORGE_CLASSES: transformers' Conv1D becomes ForgeConv1D, a linear of the view W^T (its
    weight's slot is transposed: the kernel updates W [in, out] from dW = X^T dY, and every
    path of a linear, the hooked node, the Function and the compiled op, serves it), and a
    *ScaledWordEmbedding becomes itself with ForgeEmbedding after it in the MRO."""
    forge = FORGE_CLASSES.get(cls) or _MADE.get(cls)
    if forge is None and cls is _conv1d():
        forge = _MADE[cls] = type("ForgeConv1D", (cls, ForgeCapable), {
            "forward": _conv1d_forward, "__module__": __name__,
            "__doc__": "transformers' Conv1D trained by FORGE (y = x W + b, W [in, out])."})
    elif forge is None and _scaled_embedding(cls):
        forge = _MADE[cls] = type("Forge" + cls.__name__, (cls, ForgeEmbedding), {
            "__module__": __name__,
            "__doc__": f"transformers' {cls.__name__} trained by FORGE: its forward, whose "
                       f"super().forward(ids) is ForgeEmbedding's."})
    return forge


def transposed(module: nn.Module) -> bool:
    """Whether the module keeps its weight as W [in, out] (transformers' Conv1D), the
    transpose of nn.Linear's [out, in]."""
    conv1d = _conv1d()
    return conv1d is not None and isinstance(module, conv1d)


def fusable_weights(module: nn.Module):
    """What FORGE can do with a module's weights: a list of (key, weight) it updates through
    the fused kernel ("weight", or a multi-head attention's "in_proj_weight" and
    "out_proj.weight"), a string saying why it cannot, or None (not a module FORGE knows)."""
    t = type(module)
    if t is nn.Linear or (isinstance(module, ForgeCapable)
                          and not isinstance(module, ForgeMultiheadAttention)):
        return [("weight", module.weight)]
    if t is nn.Embedding or t is ForgeEmbedding or _scaled_embedding(t):
        for bad, why in ((module.sparse, "sparse=True"),
                         (module.max_norm is not None, "max_norm (renormalizes rows in forward)"),
                         (module.scale_grad_by_freq, "scale_grad_by_freq=True")):
            if bad:
                return f"nn.Embedding with {why}"
        return [("weight", module.weight)]
    if t is nn.MultiheadAttention or t is ForgeMultiheadAttention:
        if not module._qkv_same_embed_dim:
            return "nn.MultiheadAttention with kdim/vdim unlike embed_dim"
        if module.bias_k is not None or module.add_zero_attn:
            return "nn.MultiheadAttention with add_bias_kv or add_zero_attn"
        return [("in_proj_weight", module.in_proj_weight),
                ("out_proj.weight", module.out_proj.weight)]
    if isinstance(module, (nn.Linear, nn.Embedding, nn.MultiheadAttention)):
        return f"{t.__name__} is a subclass of a torch module whose forward FORGE replaces"
    conv1d = _conv1d()
    if conv1d is not None and t is conv1d:
        return [("weight", module.weight)]
    if conv1d is not None and isinstance(module, conv1d):
        return f"{t.__name__} is a subclass of transformers' Conv1D, whose forward FORGE replaces"
    return None


def bind(module: nn.Module, key: str, slot) -> None:
    """Bind one of the module's fusable weights (fusable_weights' key) to an optimizer's slot:
    a torch module's class becomes its FORGE class in place (same module and Parameters,
    same state_dict keys)."""
    forge_cls = _forge_class(type(module))
    if forge_cls is not None:
        module._forge_from = type(module)
        module.__class__ = forge_cls
    if isinstance(module, ForgeMultiheadAttention):
        module.__dict__.setdefault("_forge_slots", {})[key] = slot
    else:
        module._forge_slot = slot


def bound(module: nn.Module) -> bool:
    """Whether an optimizer already updates one of the module's weights."""
    return module.__dict__.get("_forge_slot") is not None or \
        bool(module.__dict__.get("_forge_slots"))

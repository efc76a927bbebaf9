"""Which of a model's weights the fused kernel updates, and why each other 2-D weight stays on
the standard path (a materialized .grad): select_weights, run once by ForgeOptimizer.__init__.

A weight fuses when every module that uses it is one FORGE can bind (nn.Linear, nn.Embedding,
nn.MultiheadAttention, transformers' Conv1D, forge_engine's parallel layers), in one
orientation (a Conv1D keeps W as [in, out]), it is fp32 or bf16 and the caller did not ask for
it (standard=..., fuse=False). A weight shared with a module FORGE cannot bind is warned
about: its gradient from that module would otherwise be lost. So are weights of another dtype
(a float16 model) and weights of modules FORGE does not bind (a custom module's own matmul):
what stays on the standard path saves no memory, and nothing else would say so.
"""
from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from forge_engine.linear import bound, fusable_weights, transposed


@dataclass
class Selection:
    params: list  # the parameters that require grad, each once, in the model's order
    fused: list  # (weight name, weight, its consumers [(module name, module, key)])
    standard_reasons: dict  # 2-D weight name -> why it stays on the standard path
    first: list  # (name, parameter) of each parameter that requires grad, by its first name


def _consumers(model: nn.Module) -> tuple[dict, dict]:
    """id(weight) -> the FORGE-capable modules that use it [(module name, module, key)], and
    id(weight) -> why its module cannot be fused."""
    consumers = defaultdict(list)  # id(weight) -> [(module name, module, key)]
    refused = {}  # id(weight) -> why its module cannot be fused
    inside = set()  # submodules whose weights their parent module's forward uses
    for mname, m in model.named_modules():
        if id(m) in inside:
            continue
        what = fusable_weights(m)
        if what is None:
            continue
        if bound(m):
            raise ValueError(f"module '{mname}' is already updated by another FORGE "
                             f"optimizer; create one optimizer per model")
        if isinstance(m, nn.MultiheadAttention):
            inside.add(id(m.out_proj))
            if isinstance(what, str):
                for w in (m.in_proj_weight, m.q_proj_weight, m.out_proj.weight):
                    if w is not None:
                        refused[id(w)] = what
                continue
        if isinstance(what, str):
            refused[id(m.weight)] = what
            continue
        for key, w in what:
            if w.requires_grad:
                consumers[id(w)].append((mname, m, key))
    return consumers, refused


def select_weights(model: nn.Module, standard=(), fuse: bool = True,
                   owner: str = "ForgeOptimizer") -> Selection:
    """The optimizer's parameters and the weights it fuses; owner names the optimizer class
    in the errors. The warnings point at the code that built the optimizer."""
    named = list(model.named_parameters(remove_duplicate=False))
    uses = Counter(id(p) for _, p in named)
    aliases = defaultdict(list)
    for n, p in named:
        aliases[id(p)].append(n)
    params, seen = [], set()
    for _, p in named:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError(f"{owner}: the model has no parameter that requires grad")

    asked = {id(x) if torch.is_tensor(x) else x for x in standard}

    def asked_for(w) -> bool:  # (by the Parameter or by any of its names)
        return id(w) in asked or any(a in asked for a in aliases[id(w)])
    consumers, refused = _consumers(model)
    fused = []  # (weight name, weight, its consumers)
    standard_reasons = {}
    # the names among those warned about on their own, and those the caller kept there
    shared, by_dtype, kept = [], [], set()
    for n, w in named:
        if w.dim() < 2 or not w.requires_grad or aliases[id(w)][0] != n \
                or id(w) in consumers:
            continue
        if w.dim() > 2:  # (transformers' MoE layers keep their experts so: most of the model)
            standard_reasons[n] = f"{w.dim()}-D; FORGE fuses matrices, not stacked experts " \
                f"or convolutions"
        else:
            standard_reasons[n] = refused.get(id(w)) or \
                "not the weight of an nn.Linear, nn.Embedding, nn.MultiheadAttention or Conv1D"
        if not fuse or asked_for(w):
            kept.add(n)  # (where the caller keeps it anyway: nothing to warn about)
    for mods in consumers.values():
        key = mods[0][2]
        w = mods[0][1].get_parameter(key)
        wname = aliases[id(w)][0]
        if refused.get(id(w)):
            standard_reasons[wname] = refused[id(w)]
        elif len({transposed(m) for _, m, _ in mods}) > 1:  # one slot has one orientation
            standard_reasons[wname] = "used both as W [in, out] (Conv1D) and as W [out, in]"
        elif uses[id(w)] > len(mods):  # also a parameter of a module FORGE cannot fuse
            standard_reasons[wname] = "shared by " + ", ".join(aliases[id(w)])
            shared.append(wname)
        elif w.dtype not in (torch.float32, torch.bfloat16):
            standard_reasons[wname] = f"dtype {w.dtype} (fp32 or bf16 fuse)"
            by_dtype.append(wname)
        elif asked_for(w):
            standard_reasons[wname] = "asked for (standard=...)"
            kept.add(wname)
        elif not fuse:
            standard_reasons[wname] = "fuse=False"
            kept.add(wname)
        else:
            fused.append((wname, w, mods))
    for wname in shared:  # stacklevel: past ForgeOptimizer.__init__ and the optimizer
        # class's own __init__ to the caller
        why = standard_reasons[wname]
        warnings.warn(f"forge_engine: weight '{wname}' is {why}; it stays on the "
                      f"standard optimizer path (materialized gradient): one of its "
                      f"users is not a module FORGE updates (nn.Linear, nn.Embedding, "
                      f"nn.MultiheadAttention, transformers' Conv1D or a forge_engine "
                      f"parallel layer)",
                      stacklevel=4)
    if by_dtype:  # (a float16 checkpoint, say: the optimizer would quietly be torch's)
        dtypes = sorted({str(model.get_parameter(n).dtype) for n in by_dtype})
        what = "weight matrix that FORGE would fuse is" if len(by_dtype) == 1 else \
            "weight matrices that FORGE would fuse are"
        names = ", ".join(by_dtype[:3]) + (", ..." if len(by_dtype) > 3 else "")
        warnings.warn(f"forge_engine: {len(by_dtype)} {what} {' / '.join(dtypes)} ({names}); "
                      f"FORGE fuses fp32 or bf16 weights, so they stay on the standard "
                      f"optimizer path (materialized gradients, no memory saving). Convert "
                      f"the model first, e.g. model.to(torch.bfloat16)", stacklevel=4)
    said = kept.union(shared, by_dtype)
    left = {n: why for n, why in standard_reasons.items() if n not in said}
    if left:  # (a custom module that multiplies by its own weight, say)
        names = ", ".join(f"{n} ({why})" for n, why in list(left.items())[:2]) + \
            (", ..." if len(left) > 2 else "")
        size = {n: w.numel() for n, w in named}  # (a few matrices may be most of the model)
        share = sum(size[n] for n in left) / sum(size[n] for n in [*standard_reasons,
                                                                      *(f[0] for f in fused)])
        warnings.warn(f"forge_engine: {len(left)} of the model's "
                      f"{len(standard_reasons) + len(fused)} weight matrices "
                      f"{'stays' if len(left) == 1 else 'stay'} on the standard optimizer "
                      f"path (materialized gradients, no memory saving for {share:.0%} of "
                      f"the weight matrices' parameters): {names}; "
                      f"optimizer.forge_summary() names each and why", stacklevel=4)
    first = [(n, p) for n, p in named if p.requires_grad and aliases[id(p)][0] == n]
    return Selection(params, fused, standard_reasons, first)

"""fp32 master weights for the --no-forge baseline: Megatron-LM's mixed precision.

The model's weights stay bf16 (the forward and backward compute in bf16, exactly as with FORGE
and with plain bf16 AdamW); the optimizer keeps an fp32 copy of every weight and fp32 states,
steps the copy with each step's gradient (the bf16 .grad, widened), and writes the copy back to
the bf16 weight rounded to nearest. An update too small to move a bf16 weight is kept in the
copy and adds up over the steps; plain bf16 AdamW loses it, FORGE keeps it in expectation by
stochastic rounding. This is the reference FORGE's bf16 weights replace: with it, FORGE and
the baseline differ only in the optimizer (pretrain.py --no-forge --bf16 --main-params-dtype
fp32; benchmarks/convergence.py's bf16-master).
"""
from __future__ import annotations

from typing import Callable

import torch


class MasterWeights:
    """torch.optim's interface (param_groups, state, step, zero_grad, state_dict) over an inner
    optimizer that steps fp32 copies of `params`.

    make_inner(masters) builds the inner optimizer on the fp32 copies (e.g. torch's fused
    AdamW); its param_groups are this object's, so an LR schedule that writes
    param_groups[i]["lr"] drives it. state_dict() holds the inner state and the copies: a
    resumed run continues from the same fp32 weights, not from the rounded bf16 ones."""

    def __init__(self, params, make_inner: Callable[[list], torch.optim.Optimizer]):
        self.params = list(params)
        if not self.params:
            raise ValueError("MasterWeights: no parameters")
        wide = sorted({str(p.dtype) for p in self.params if p.dtype != torch.bfloat16})
        if wide:
            raise ValueError(f"fp32 master weights are for bf16 weights; these are "
                             f"{', '.join(wide)}")
        self.masters = [p.detach().float().clone() for p in self.params]
        self.inner = make_inner(self.masters)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def defaults(self):
        return self.inner.defaults

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            if m.grad is not None:
                p.copy_(m)  # round to nearest
                m.grad = None

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(),
                "master_params": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        if set(state) != {"inner", "master_params"}:
            raise ValueError(f"not a fp32-master-weights optimizer state (keys "
                             f"{sorted(state)}): was the checkpoint trained with "
                             f"--main-params-dtype fp32?")
        saved = state["master_params"]
        if [tuple(t.shape) for t in saved] != [tuple(m.shape) for m in self.masters]:
            raise ValueError("the checkpoint's fp32 master weights do not match this model's "
                             "parameters (count or shapes)")
        for m, t in zip(self.masters, saved):
            m.copy_(t)
        self.inner.load_state_dict(state["inner"])

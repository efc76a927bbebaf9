"""FORGE_DEBUG_NONFINITE=1: when a step's gradient norm is not finite, find out why.

Every fused update of the step keeps its inputs (the token segment, a copy of W and of its
states before the update, the hp row, the seed) until the step ends. When the norm is not
finite, each fused weight whose in-kernel norm was not finite is examined: are its inputs
finite, what is the norm of dY^T X in float64, and what does the kernel give when run again on
the same inputs (twice by the route training took, once by the Triton kernel)? A norm that
comes back finite on the same inputs points at a transient fault of the launch in training
(a race, stale memory), one that comes back non-finite at the data or a deterministic bug.
With FORGE_DEBUG_DIR set, the inputs are also saved there (torch.save, one file per weight)
for a replay elsewhere.

Cost: the step's token segments stay alive until its end (as with clipping) and W and the
states are copied before each update (device-to-device, no host synchronization). A
debugging aid, not for production runs. Not in a replayed CUDA graph (--enable-cuda-graph):
its updates run no Python, so there is nothing recorded to run again.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from forge_engine.kernels import clone_states, fused_wgrad_update, options
from forge_engine.kernels.rules import GRAD_SCALE


def enabled() -> bool:
    """FORGE_DEBUG_NONFINITE=1 (options.Options.debug_nonfinite), read now."""
    return options.read("debug_nonfinite")


@dataclass
class _Inputs:
    x: torch.Tensor | None
    dy: torch.Tensor | None
    w: torch.Tensor
    states: list
    hp: torch.Tensor
    seed: int
    stochastic: bool
    onehot: tuple | None
    grad: torch.Tensor | None


def _bad(t: torch.Tensor | None) -> int:
    """How many elements of t are not finite (0 for None or integer tensors)."""
    if t is None or not t.is_floating_point():
        return 0
    return int((~torch.isfinite(t)).sum())


class UpdateRecorder:
    """The inputs of this step's fused updates, by weight (see the module docstring)."""

    def __init__(self):
        self._saved: dict = {}

    def record(self, p, x, dy, w, states, hp, seed, stochastic, onehot, grad) -> None:
        self._saved.setdefault(p, []).append(_Inputs(
            x, dy, w.detach().clone(), clone_states(states), hp, seed, stochastic, onehot, grad))

    def clear(self) -> None:
        self._saved.clear()

    @torch.no_grad()
    def explain(self, p, name: str, spec, step: int) -> list[str]:
        """Lines saying what the recorded updates of p give when run again."""
        runs = self._saved.get(p)
        if not runs:
            return [f"forge debug: {name}: no update of it was recorded in this step"]
        lines = []
        for i, r in enumerate(runs):
            tag = f"forge debug: {name} (update {i + 1} of {len(runs)} in step {step})"
            st_bad = [_bad(s.fp32()) if s is not None else 0 for s in r.states]
            lines.append(f"{tag}: non-finite inputs: x {_bad(r.x)}, dy {_bad(r.dy)}, W "
                         f"{_bad(r.w)}, states {st_bad}, onehot "
                         f"{_bad(r.onehot[1]) if r.onehot else 0}, grad {_bad(r.grad)}")
            if r.x is not None and r.x.numel():
                xd = r.x.double()
                norm = sum(float((r.dy[:, n:n + 4096].double().t() @ xd).pow(2).sum())
                           for n in range(0, r.dy.shape[1], 4096))  # (an LM head's rows)
                lines.append(f"{tag}: float64 ||dY^T X||^2 = {norm:.6g}, max |x| "
                             f"{float(r.x.abs().max()):.4g}, max |dy| "
                             f"{float(r.dy.abs().max()):.4g}")
            # the kernel adds the norm of the gradient it applies: dY^T X times hp[GRAD_SCALE]
            # (clipping, unscaling, 1 / replicas), divided out here to compare with the line above
            gs = float(r.hp[GRAD_SCALE])
            for label, cfg in (("again, same route", None), ("again, same route", None),
                               ("again, Triton kernel", {"WS": False})):
                w = r.w.clone()
                states = clone_states(r.states)
                acc = torch.zeros(1, dtype=torch.float32, device=w.device)
                try:
                    fused_wgrad_update(r.x, r.dy, w, states, spec, r.hp, acc, r.seed,
                                       r.stochastic, config=cfg, onehot=r.onehot, grad=r.grad)
                    raw = float(acc) / (gs * gs) if gs else float("nan")
                    lines.append(f"{tag}: {label}: norm^2 {raw:.6g}, applied {float(acc):.6g} "
                                 f"at gradient scale {gs:.6g}, non-finite W after it {_bad(w)}")
                except Exception as e:  # a route that cannot take it: say so, go on
                    lines.append(f"{tag}: {label}: {type(e).__name__}: {e}")
            where = options.read("debug_dir")
            if where:
                os.makedirs(where, exist_ok=True)
                path = os.path.join(where, f"nonfinite_step{step}_{name}_{i}.pt")
                torch.save(dict(x=r.x, dy=r.dy, w=r.w, hp=r.hp, seed=r.seed,
                                stochastic=r.stochastic, onehot=r.onehot, grad=r.grad,
                                states=[None if s is None else (s.data, s.scale, s.nonneg)
                                        for s in r.states]), path)
                lines.append(f"{tag}: inputs saved to {path}")
        return lines

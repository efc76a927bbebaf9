"""Fused weight-gradient + optimizer kernels and their backend switch.

`fused_wgrad_update` dispatches to the Triton kernel (fused_update.py) on CUDA tensors and to the
tiled torch reference (reference.py) on CPU. FORGE_BACKEND=triton|torch (options.Options.backend)
forces one; on CPU the Triton kernel then needs TRITON_INTERPRET=1 set before triton is first
imported.
"""
from __future__ import annotations

import functools
import os

from forge_engine.kernels import options
from forge_engine.kernels.quant import FORMATS, QBLOCK, StateTensor, clone_states
from forge_engine.kernels.reference import fused_wgrad_update_torch


def backend_for(device) -> str:
    """The backend used for tensors on `device`: FORGE_BACKEND if set, else by device type."""
    forced = options.read("backend")
    if forced:
        if forced == "triton" and getattr(device, "type", device) != "cuda" \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("FORGE_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                               "in the environment before triton is imported")
        return forced
    return "triton" if getattr(device, "type", device) == "cuda" else "torch"


@functools.lru_cache(maxsize=None)
def _triton_impl():
    """The Triton kernel's host function, imported on first use (importing triton on a CPU
    machine needs TRITON_INTERPRET decided first) and then kept."""
    from forge_engine.kernels.fused_update import fused_wgrad_update
    return fused_wgrad_update


def fused_wgrad_update(x, dy, w, states, spec, hp, sumsq, seed, stochastic, config=None,
                       norm_only=False, onehot=None, grad=None):
    """w [N, K] <- optimizer step with gradient dy^T x (x [T, K], dy [T, N]); see fused_update.
    norm_only: only add ||dy^T x||^2 to sumsq (the exact-clipping pre-pass); onehot: an
    embedding's segment (ids [T1], e [T1, K]) adding onehot(ids)^T e to the gradient; grad: an
    fp32 [N, K] gradient added as it is (materialized: reduce-scattered, or a buffer)."""
    impl = _triton_impl() if backend_for(w.device) == "triton" else fused_wgrad_update_torch
    impl(x, dy, w, states, spec, hp, sumsq, seed, stochastic, config, norm_only, onehot, grad)


__all__ = ["fused_wgrad_update", "backend_for", "StateTensor", "clone_states", "FORMATS",
           "QBLOCK"]

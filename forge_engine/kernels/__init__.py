"""Fused weight-gradient + optimizer kernels and their backend switch.

`fused_wgrad_update` dispatches to the Triton kernel (fused_update.py) on CUDA tensors and to the
tiled torch reference (reference.py) on CPU. FORGE_BACKEND=triton|torch (options.Options.backend)
forces one; on CPU the Triton kernel then needs TRITON_INTERPRET=1 set before triton is first
imported.
"""
from __future__ import annotations

import functools
import operator
import os

import torch

from forge_engine.kernels import options
from forge_engine.kernels.quant import FORMATS, QBLOCK, StateTensor, clone_states
from forge_engine.kernels.reference import fused_wgrad_update_torch
from forge_engine.kernels.rules import HP_LEN


def backend_for(device) -> str:
    """The backend used for tensors on `device`: FORGE_BACKEND if set, else by device type."""
    forced = _forced()
    if forced:
        if forced == "triton" and getattr(device, "type", device) != "cuda" \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("FORGE_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                               "in the environment before triton is imported")
        return forced
    return _native(device)


def _native(device) -> str:
    """The backend of tensors on device when FORGE_BACKEND forces none."""
    native = _NATIVE.get(device)
    if native is None:
        native = _NATIVE[device] = \
            "triton" if getattr(device, "type", device) == "cuda" else "torch"
    return native


# device (a torch.device or its type's name) -> its backend when none is forced: asked at every
# update, and reading torch.device.type builds a new string each time
_NATIVE: dict = {}


_FORCED = [object(), ""]  # FORGE_BACKEND's last raw value and its checked reading
# os.environ's own mapping where CPython has one: read directly, without os.environ.get's key
# and value conversions (asked at every update); os.environ's writes (monkeypatch.setenv,
# options.apply) change it too
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(options.ENV["backend"]) if _ENV_DATA is not None else None


def _forced() -> str:
    """FORGE_BACKEND as the environment sets it now (options.read, again only when the raw
    value changed: asked at every update)."""
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None \
        else os.environ.get(options.ENV["backend"])
    if raw != _FORCED[0]:
        _FORCED[1] = options.read("backend")
        _FORCED[0] = raw
    return _FORCED[1]


@functools.lru_cache(maxsize=None)
def _triton_impl():
    """The Triton kernel's host function, imported on first use (importing triton on a CPU
    machine needs TRITON_INTERPRET decided first) and then kept."""
    from forge_engine.kernels.fused_update import fused_wgrad_update
    return fused_wgrad_update


def fused_wgrad_update(x, dy, w, states, spec, hp, sumsq, seed, stochastic, config=None,
                       norm_only=False, onehot=None, grad=None):
    """w [N, K] <- optimizer step with gradient dy^T x (x [T, K], dy [T, N]), adding the
    squared norm of hp[GRAD_SCALE] * dy^T x to sumsq; see fused_update.
    norm_only: only add ||dy^T x||^2 to sumsq (the exact-clipping pre-pass); onehot: an
    embedding's segment (ids [T1], e [T1, K]) adding onehot(ids)^T e to the gradient; grad: an
    fp32 [N, K] gradient added as it is (materialized: reduce-scattered, or a buffer)."""
    impl = _triton_impl() if backend_for(w.device) == "triton" else fused_wgrad_update_torch
    impl(x, dy, w, states, spec, hp, sumsq, seed, stochastic, config, norm_only, onehot, grad)


class PlannedUpdate:
    """One weight's fused update with its unchanging operands bound (w, states, the rule, the
    seed, the rounding): plan(x, dy, hp, sumsq, grad) is fused_wgrad_update(x, dy, w, states,
    spec, hp, sumsq, seed, stochastic, grad=grad). The backend is asked at each call; on the
    Triton backend a fused_update.UpdatePlan launches it, paying the operand checks once per
    kind of call. refs: the caller's objects behind the states (binds() compares them)."""

    def __init__(self, w, states: list, spec, seed: int, stochastic: bool, refs: tuple = ()):
        self.w, self.states, self.spec = w, states, spec
        self.seed, self.stochastic, self.refs = seed, bool(stochastic), refs
        self._where = (w.data_ptr(), w.shape, w.stride(), w.dtype, w.device)
        self._device = w.device
        self._native = _native(w.device)
        self._triton = None

    def binds(self, w, refs: tuple, seed: int) -> bool:
        """Whether this plan updates w (the same memory, shape and layout) with the states
        behind refs (the same objects, by identity) and seed."""
        return (w.data_ptr(), w.shape, w.stride(), w.dtype, w.device) == self._where \
            and seed == self.seed and len(refs) == len(self.refs) \
            and all(map(operator.is_, refs, self.refs))

    def __call__(self, x, dy, hp, sumsq, grad=None) -> None:
        if (_forced() or self._native) != "triton":  # backend_for(w.device), without its call
            fused_wgrad_update_torch(x, dy, self.w, self.states, self.spec, hp, sumsq,
                                     self.seed, self.stochastic, None, False, None, grad)
            return
        self._triton_plan()(x, dy, hp, sumsq, grad)

    def norm_tiles(self, x, dy) -> int:
        """How many parts norm(x, dy, parts) writes (1 on the torch backend)."""
        if (_forced() or self._native) != "triton":
            return 1
        return self._triton_plan().norm_tiles(x, dy)

    def norm(self, x, dy, parts=None) -> tuple:
        """The norm-only pass over the dense segment dy^T x, in parts (None: made here, 16
        bytes): its first norm_tiles(x, dy) elements are overwritten with squared norms whose
        sum is ||dy^T x||^2 (the Triton kernel's one per tile; the torch reference's whole
        norm in parts[0]). Writes nothing else. Returns (tiles, parts)."""
        if (_forced() or self._native) != "triton":
            if parts is None:
                parts = torch.empty(norm_parts(1), dtype=torch.float32, device=self._device)
            elif parts.dtype != torch.float32 or parts.numel() < 1:
                raise ValueError(f"norm parts: need an fp32 tensor of at least one element, "
                                 f"got {parts.dtype} {tuple(parts.shape)}")
            fused_wgrad_update_torch(x, dy, self.w, self.states, self.spec,
                                     norm_hp(self._device), parts[:1].zero_(), 0, False, None,
                                     True)
            return 1, parts
        return self._triton_plan().norm(x, dy, parts)

    def _triton_plan(self):
        if self._triton is None:
            backend_for(self._device)  # (its check of a forced Triton backend on CPU)
            from forge_engine.kernels.fused_update import UpdatePlan
            self._triton = UpdatePlan(self.w, self.states, self.spec, self.seed,
                                      self.stochastic)
        return self._triton


@functools.lru_cache(maxsize=None)
def norm_hp(device: torch.device) -> torch.Tensor:
    """The hp row every norm-only pass on device is given: zeros, never written (the pass
    reads none of it; the launch needs a valid row), one for all callers."""
    return torch.zeros(HP_LEN, dtype=torch.float32, device=device)


def norm_parts(tiles: int) -> int:
    """The length of a norm-only pass's parts for tiles: rounded up to 16 bytes, so that
    rows of such parts stay aligned in a shared buffer."""
    return -(-tiles // 4) * 4


__all__ = ["fused_wgrad_update", "backend_for", "StateTensor", "clone_states", "FORMATS",
           "QBLOCK", "PlannedUpdate", "norm_hp", "norm_parts"]

"""The FORGE_* environment switches of the kernels, read in one place into one typed object.

Each field of Options is one switch: its variable (ENV), its type, its default (the value
when the variable is unset) and when the code reads it. A switch compiled into the kernels
(fast_sqrt, fast_div) is read when forge_engine.kernels is first imported; the routing
switches (ws, ws_split, ws_large) when fused_update.py is first imported (at the first
Triton launch), so that a launch does not ask os.environ; the others at each use, so that a
test's monkeypatch.setenv takes effect. read(name) gives one field as the environment sets it
now, checked as Options checks it; Options.from_env() all of them.

apply(values) sets switches for this process above the environment (pretrain.py's flags and
--config): it writes their variables, so each later read sees them, and has an imported
fused_update.py read its routing switches again, so they reach every reader alike.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, fields

BACKENDS = ("triton", "torch")
WS_CHOICES = ("0", "1", "auto")
COMPILED = ("fast_sqrt", "fast_div")  # built into the kernels at import: environment only


def _switch(default, env: str, doc: str):
    return field(default=default, metadata=dict(env=env, doc=doc))


@dataclass(frozen=True)
class Options:
    """The kernels' switches (see the module docstring for when each is read)."""

    backend: str = _switch(
        "", "FORGE_BACKEND",
        "The backend of fused_wgrad_update: 'triton' (the Triton kernel; on CPU tensors it "
        "needs TRITON_INTERPRET=1 before triton is imported) or 'torch' (the tiled torch "
        "reference); '' chooses by device: Triton on CUDA tensors, torch on CPU. Read at each "
        "call.")
    ws: str = _switch(
        "auto", "FORGE_WS",
        "Which updates take the warp-specialized Gluon kernel (fused_ws.py): 'auto' those its "
        "split design can take with more than fused_update.WS_AUTO_TOKENS tokens, on CUDA and "
        "with no explicit config, at fused_ws.SPLIT_LARGE (fewer tokens: ws_split); '1' every "
        "update it can take (its default design where no config names one); '0' none. Read "
        "when fused_update.py is imported.")
    ws_split: str = _switch(
        "auto", "FORGE_WS_SPLIT",
        "Under ws='auto', whether the updates the Gluon kernel can take with at most "
        "WS_AUTO_TOKENS tokens go to its split design at fused_ws.SPLIT_DEFAULT: 'auto' (the "
        "default) and '1' all of them, eager and captured into a CUDA graph (less device time "
        "than the Triton kernel for no more host time a launch); '0' none (the Triton "
        "kernel). Read when fused_update.py is imported.")
    ws_large: dict | None = _switch(
        None, "FORGE_WS_LARGE",
        "For experiments: a JSON object of the split design's config that replaces "
        "fused_ws.SPLIT_LARGE under ws='auto' above WS_AUTO_TOKENS ('{}': SPLIT_DEFAULT); its "
        "keys are checked at the first such launch. Read when fused_update.py is imported.")
    fast_sqrt: bool = _switch(
        True, "FORGE_FAST_SQRT",
        "'1': the kernels' square roots are sqrt.approx.ftz.f32 (at most 1 ulp from IEEE; "
        "quant.sqrt); '0': the IEEE sqrt.rn. Compiled into the kernels: read when "
        "forge_engine.kernels is imported.")
    fast_div: bool = _switch(
        True, "FORGE_FAST_DIV",
        "'1': the rules' divisions are div.approx.f32 (within 2 ulp; quant.div); '0': "
        "Triton's div.full.f32. The interpreter always divides with '/'. Compiled into the "
        "kernels: read when forge_engine.kernels is imported.")
    debug_nonfinite: bool = _switch(
        False, "FORGE_DEBUG_NONFINITE",
        "'1': every fused update keeps its inputs until the step ends, and a step whose "
        "gradient norm is not finite is examined weight by weight (optim/debug_nonfinite.py); "
        "any other value: off. Read when a ForgeOptimizer is built.")
    debug_dir: str = _switch(
        "", "FORGE_DEBUG_DIR",
        "With debug_nonfinite: a directory where the examined updates' inputs are saved "
        "(torch.save, one file per weight); '' saves nothing. Read when a step is examined.")

    def __post_init__(self):
        if self.backend not in ("", *BACKENDS):
            raise ValueError(f"FORGE_BACKEND must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("ws", "ws_split"):
            value = getattr(self, name)
            if value not in WS_CHOICES:
                raise ValueError(f"{ENV[name]} must be 0, 1 or auto, got {value!r}")
        if self.ws_large is not None and not isinstance(self.ws_large, dict):
            raise ValueError(f"FORGE_WS_LARGE must be a JSON object, got {self.ws_large!r}")
        for name in ("fast_sqrt", "fast_div", "debug_nonfinite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.debug_dir, str):
            raise ValueError(f"debug_dir must be a str, got {self.debug_dir!r}")

    @classmethod
    def from_env(cls, environ=None) -> "Options":
        """Every switch as the environment (default os.environ) sets it now."""
        return cls(**{f.name: read(f.name, environ) for f in fields(cls)})

    def to_env(self) -> dict:
        """The environment variables that set these options, as strings (the defaults too;
        FORGE_WS_LARGE only when ws_large is set): Options.from_env(o.to_env()) == o."""
        return {f.metadata["env"]: _as_env(getattr(self, f.name)) for f in fields(self)
                if getattr(self, f.name) is not None}


def _as_env(value) -> str:
    """A field's value as its variable holds it."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, dict):
        return json.dumps(value)
    return value


ENV = {f.name: f.metadata["env"] for f in fields(Options)}


def _flag(env: str, raw: str | None) -> bool:
    value = "1" if raw is None else raw.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{env} must be 0 or 1, got {value!r}")
    return value == "1"


def read(name: str, environ=None):
    """Field `name` of Options as its variable in `environ` (default os.environ) sets it now,
    checked as Options checks it: one variable read, for the reads at each call."""
    env = ENV[name]
    raw = (os.environ if environ is None else environ).get(env)
    if name == "backend":
        value = (raw or "").strip().lower()
        if value not in ("", *BACKENDS):
            raise ValueError(f"FORGE_BACKEND must be one of {BACKENDS}, got {value!r}")
        return value
    if name in ("ws", "ws_split"):
        value = "auto" if raw is None else raw.strip()
        if value not in WS_CHOICES:
            raise ValueError(f"{env} must be 0, 1 or auto, got {value!r}")
        return value
    if name == "ws_large":
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"FORGE_WS_LARGE must be a JSON object, got {raw!r}: {e}") \
                from None
        if not isinstance(value, dict):
            raise ValueError(f"FORGE_WS_LARGE must be a JSON object, got {value!r}")
        return value
    if name in ("fast_sqrt", "fast_div"):
        return _flag(env, raw)
    if name == "debug_nonfinite":
        return raw == "1"
    return raw or ""  # debug_dir


def apply(values: dict) -> Options:
    """Set switches for this process above the environment: values maps fields to values as
    Options holds them (None: not set, the environment decides). Every switch is checked
    first, the given ones with the environment's others (a ValueError names the variable,
    and nothing is set). Then the given ones are written to os.environ, so that each later
    read sees them, and an imported fused_update.py reads its routing switches again: every
    reader holds the returned Options. The compiled switches (COMPILED) are refused: the
    kernels were built with them when forge_engine.kernels was imported."""
    for name in values:
        if name not in ENV:
            raise ValueError(f"no kernel switch {name!r}; the switches are {', '.join(ENV)}")
        if name in COMPILED:
            raise ValueError(f"{ENV[name]} is compiled into the kernels when "
                             f"forge_engine.kernels is imported: set it in the environment")
    given = {ENV[name]: _as_env(v) for name, v in values.items() if v is not None}
    now = Options.from_env({**os.environ, **given})
    os.environ.update(given)
    routing = sys.modules.get("forge_engine.kernels.fused_update")
    if routing is not None:  # it read them at its import: now they are the ones returned
        routing.read_routing()
    return now

"""The FORGE_* switches (forge_engine/kernels/options.py): one typed object, each variable
parsed and checked in one place, the use-time ones read anew at each use."""
import dataclasses

import pytest

from forge_engine.kernels import backend_for
from forge_engine.kernels.options import ENV, Options, read


def test_unset_variables_give_the_defaults():
    assert Options.from_env({}) == Options()
    assert Options() == Options(backend="", ws="auto", ws_split="auto", ws_large=None,
                                fast_sqrt=True, fast_div=True, debug_nonfinite=False,
                                debug_dir="")


def test_every_field_has_a_variable_and_a_doc():
    for f in dataclasses.fields(Options):
        assert ENV[f.name].startswith("FORGE_") and len(f.metadata["doc"]) > 40, f.name


def test_to_env_round_trips():
    o = Options(backend="torch", ws="0", ws_split="1", ws_large={"BLOCK_T": 64},
                fast_sqrt=False, fast_div=True, debug_nonfinite=True, debug_dir="/tmp/x")
    assert Options.from_env(o.to_env()) == o
    assert Options.from_env(Options().to_env()) == Options()


def test_values_are_parsed_as_the_kernels_read_them():
    env = {"FORGE_BACKEND": " Torch ", "FORGE_WS": "1 ", "FORGE_FAST_SQRT": " 0",
           "FORGE_WS_LARGE": "{}", "FORGE_DEBUG_NONFINITE": "yes"}
    o = Options.from_env(env)
    assert (o.backend, o.ws, o.fast_sqrt, o.ws_large, o.debug_nonfinite) == \
        ("torch", "1", False, {}, False)  # (only "1" turns the debugging on)


@pytest.mark.parametrize("env,match", [
    ({"FORGE_BACKEND": "cuda"}, "FORGE_BACKEND must be one of"),
    ({"FORGE_WS": "2"}, "FORGE_WS must be 0, 1 or auto, got '2'"),
    ({"FORGE_WS_SPLIT": ""}, "FORGE_WS_SPLIT must be 0, 1 or auto, got ''"),
    ({"FORGE_WS_LARGE": "[1]"}, r"FORGE_WS_LARGE must be a JSON object, got \[1\]"),
    ({"FORGE_WS_LARGE": "{x"}, "FORGE_WS_LARGE must be a JSON object, got '{x': Expecting"),
    ({"FORGE_FAST_SQRT": "true"}, "FORGE_FAST_SQRT must be 0 or 1, got 'true'"),
    ({"FORGE_FAST_DIV": "2"}, "FORGE_FAST_DIV must be 0 or 1, got '2'")])
def test_a_bad_value_names_its_variable(env, match):
    with pytest.raises(ValueError, match=match):
        Options.from_env(env)


def test_fields_are_checked_when_built_directly():
    with pytest.raises(ValueError, match="FORGE_WS must be 0, 1 or auto"):
        Options(ws="on")
    with pytest.raises(ValueError, match="fast_div must be a bool"):
        Options(fast_div="1")


def test_use_time_switches_follow_the_environment(monkeypatch):
    """backend and the debugging switches are read at each use: a test's setenv applies."""
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    assert read("backend") == "torch" and backend_for("cpu") == "torch"
    monkeypatch.delenv("FORGE_BACKEND")
    assert read("backend") == "" and backend_for("cpu") == "torch"
    monkeypatch.setenv("FORGE_DEBUG_NONFINITE", "1")
    monkeypatch.setenv("FORGE_DEBUG_DIR", "/tmp/d")
    assert read("debug_nonfinite") is True and read("debug_dir") == "/tmp/d"

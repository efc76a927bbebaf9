"""The FORGE_* switches (forge_engine/kernels/options.py): one typed object, each variable
parsed and checked in one place, the use-time ones read anew at each use; pretrain.py's flags
for them (forge_engine/config.py)."""
import dataclasses
import os

import pytest
import torch

from forge_engine.config import KERNEL_SWITCHES, apply_kernel_switches, parse_config
from forge_engine.kernels import backend_for
from forge_engine.kernels.options import COMPILED, ENV, Options, apply, read
from test_pretrain import pretrain


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


# ---- pretrain.py's flags for the switches (forge_engine/config.py): flag > --config >
# environment > default, every reader alike; a bad value is one line before any work

@pytest.fixture
def switches(monkeypatch):
    """No FORGE_* variable set, and whatever the test sets undone afterwards: the variables
    (apply writes os.environ) and fused_update's routing switches (apply has it read them)."""
    from forge_engine.kernels import fused_update as fu
    for name in ("_WS_FLAG", "_WS_SPLIT", "_WS_LARGE"):
        monkeypatch.setattr(fu, name, getattr(fu, name))
    saved = dict(os.environ)
    for var in ENV.values():
        os.environ.pop(var, None)
    yield fu
    os.environ.clear()
    os.environ.update(saved)


def _apply(*flags, yaml_text=None, tmp_path=None):
    args = ["--mock-data", *flags]
    if yaml_text is not None:
        path = tmp_path / "run.yaml"
        path.write_text(yaml_text)
        args += ["--config", str(path)]
    apply_kernel_switches(parse_config(args))


def test_every_switch_but_the_compiled_ones_has_a_flag():
    assert sorted(KERNEL_SWITCHES.values()) == sorted(set(ENV) - set(COMPILED))
    with pytest.raises(ValueError, match="FORGE_FAST_SQRT is compiled into the kernels"):
        apply({"fast_sqrt": False})


def test_a_flag_reaches_the_kernels_choice(switches, tmp_path):
    """--kernel-backend over FORGE_BACKEND at the next launch; the routing switches in the
    already imported fused_update.py; the debugging switches at the optimizer's build."""
    from forge_engine.optim import AdamW, debug_nonfinite
    os.environ["FORGE_BACKEND"] = "torch"
    _apply("--kernel-backend", "triton", "--kernel-ws", "0", "--kernel-ws-split", "1",
           "--kernel-ws-large", '{"BLOCK_T": 64}', "--debug-nonfinite",
           "--debug-nonfinite-dir", str(tmp_path))
    assert backend_for("cpu") == backend_for("cuda") == "triton"
    assert (switches._WS_FLAG, switches._WS_SPLIT, switches._WS_LARGE) == \
        ("0", "1", {"BLOCK_T": 64})
    assert debug_nonfinite.enabled() and read("debug_dir") == str(tmp_path)
    assert AdamW(torch.nn.Linear(4, 4))._recorder is not None
    _apply("--kernel-backend", "torch")
    assert backend_for("cuda") == "torch"


def test_split_route_follows_the_token_count_and_ws_large(switches):
    """The split kernel's config the auto route gives: SPLIT_DEFAULT (no key but SPLIT) up to
    WS_AUTO_TOKENS tokens, SPLIT_LARGE above, or --kernel-ws-large's config once applied."""
    from forge_engine.kernels.fused_ws import SPLIT_LARGE
    at = switches.WS_AUTO_TOKENS
    assert switches.split_route(at) == {"SPLIT": True}
    assert switches.split_route(at + 1) == {"SPLIT": True, **SPLIT_LARGE}
    _apply("--kernel-ws-large", '{"BLOCK_T": 32}')
    assert switches.split_route(at + 1) == {"SPLIT": True, "BLOCK_T": 32}
    assert switches.split_route(1) == {"SPLIT": True}


def test_flag_over_config_over_environment_over_default(switches, tmp_path):
    def ws(env=None, yaml_text=None, flags=()):
        os.environ.pop("FORGE_WS", None)
        os.environ.update(env or {})
        _apply(*flags, yaml_text=yaml_text, tmp_path=tmp_path)
        assert switches._WS_FLAG == read("ws")
        return read("ws")
    assert ws() == "auto"
    assert ws({"FORGE_WS": "1"}) == "1"
    assert ws({"FORGE_WS": "1"}, "kernel_ws: 0\n") == "0"  # YAML's unquoted 0 too
    assert ws({"FORGE_WS": "1"}, "kernel_ws: 0\n", ["--kernel-ws", "auto"]) == "auto"
    os.environ["FORGE_DEBUG_NONFINITE"] = "1"
    _apply(yaml_text="debug_nonfinite: false\n", tmp_path=tmp_path)  # the config turns it off
    assert read("debug_nonfinite") is False
    _apply(yaml_text="kernel_ws_large: {BLOCK_T: 32}\n", tmp_path=tmp_path)
    assert switches._WS_LARGE == {"BLOCK_T": 32}


@pytest.fixture(scope="module")
def pretrain_main(pretrain_module):
    return pretrain_module.main


@pytest.mark.parametrize("args,env,needle", [
    (["--kernel-ws", "2"], {}, "argument --kernel-ws: invalid choice: '2'"),
    (["--kernel-backend", "cuda"], {}, "argument --kernel-backend: invalid choice: 'cuda'"),
    (["--kernel-ws-large", "[1]"], {}, "--kernel-ws-large must be a JSON object, got '[1]'"),
    (["--kernel-ws-large", "{x"], {}, "--kernel-ws-large must be a JSON object, got '{x' ("),
    ([], {"FORGE_WS_SPLIT": "on"}, "FORGE_WS_SPLIT must be 0, 1 or auto, got 'on'"),
    ([], {"FORGE_BACKEND": "cuda"}, "FORGE_BACKEND must be one of"),
    (["--kernel-ws-split", "0"], {"FORGE_WS_SPLIT": "on"}, None),  # the flag decides
])
def test_a_bad_value_is_one_line_before_any_work(switches, pretrain_main, capsys, args, env,
                                                 needle):
    os.environ.update(env)
    rc = pretrain_main(["--mock-data", "--train-iters", "1", "--seq-length", "16", *args])
    err = capsys.readouterr().err
    if needle is None:
        assert rc == 0, err
        return
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0], lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal on a machine without CUDA")
def test_the_triton_backend_without_cuda_needs_the_interpreter(switches, tmp_path):
    """As a user meets it: a real process, FORGE_BACKEND=torch and no TRITON_INTERPRET in its
    environment; the flag decides, and the run stops with one line before any work."""
    p = pretrain(["--mock-data", "--train-iters", "1", "--kernel-backend", "triton"])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0] == ("error: --kernel-backend triton without CUDA needs the Triton "
                        "interpreter: TRITON_INTERPRET=1 in the environment")

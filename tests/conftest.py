"""Test set-up: on a machine without CUDA the Triton kernel runs under the interpreter, which
must be switched on before triton is first imported."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the benchmarks' modules import one another by name; tests of their helpers import them so
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Run a test on both backends: the tiled torch reference and the Triton kernel
    (compiled on CUDA, interpreted on CPU)."""
    monkeypatch.setenv("FORGE_BACKEND", request.param)
    return request.param


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def compile_tool():
    """Runs `python3 ARGS...` in the repository root without TRITON_INTERPRET (the tests'
    Triton interprets; the offline sm_90 builds of forge_engine/kernels/ptx_check.py and
    ptxas_report.py must not): returns the finished subprocess, stdout and stderr as text."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True,
                              text=True, timeout=900)
    return run



@pytest.fixture(autouse=True)
def _no_leaked_world(request):
    """Each test leaves the process as it found it: no torch.distributed group alive and none of
    the rendezvous variables (RANK, MASTER_PORT, ...) that init_parallel sets for a world of one.
    A leaked MASTER_PORT sends every later `python pretrain.py` subprocess to the same port."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in keys}
    yield
    import torch.distributed as dist
    alive = dist.is_available() and dist.is_initialized()
    leaked = {k: os.environ.get(k) for k in keys if os.environ.get(k) != before[k]}
    if alive:
        from forge_engine.parallel.state import destroy_parallel
        destroy_parallel()
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert not alive and not leaked, (
        f"{request.node.nodeid} left a process group alive ({alive}) or set {leaked}")


@pytest.fixture(scope="module")
def pretrain_module():
    """pretrain.py imported as a module, for checks that call its main() in this process."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("pretrain_under_test",
                                                  os.path.join(ROOT, "pretrain.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def run(pretrain_module, capsys, monkeypatch):
    """run(*args) -> (exit code, stdout, stderr) of pretrain.main in this process."""
    monkeypatch.setenv("FORGE_BACKEND", "torch")

    def go(*args):
        saved = dict(os.environ)  # main applies the kernel switches (FORGE_*) to it
        try:
            rc = pretrain_module.main([str(a) for a in args])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out, err = capsys.readouterr()
        return rc, out, err
    return go

"""Test set-up: on a machine without CUDA the Triton kernel runs under the interpreter, which
must be switched on before triton is first imported."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


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


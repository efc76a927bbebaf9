"""python3 benchmarks/ws_ptxas.py ARGS: the command line of forge_engine/kernels/ptx_check.py."""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # build the kernels for the GPU, not the interpreter
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from forge_engine.kernels.ptx_check import main  # noqa: E402

if __name__ == "__main__":
    main()

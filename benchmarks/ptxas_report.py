"""python3 benchmarks/ptxas_report.py ARGS: forge_engine/kernels/ptxas_report.py's command line."""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # build the kernels for the GPU, not the interpreter
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from forge_engine.kernels.ptxas_report import main  # noqa: E402

if __name__ == "__main__":
    main()

"""Host time of the model's norm and SwiGLU, forward + backward, per call: torch autograd (the
path before kernels/fused_layers.py), the torch path recomputed in backward (model._Recomputed,
what CPU and fp64 tensors take), and the Triton kernels with cached launches. Tiny tensors
(8 rows), so the GPU never waits and the host clock measures the host. An eager 8B step makes
65 norm and 32 SwiGLU calls each way.

    python3 benchmarks/host_layers.py
"""
import sys
import time

import torch

sys.path.insert(0, ".")
import forge_engine.model as M  # noqa: E402
from forge_engine.kernels import fused_layers as FL  # noqa: E402


def main():
    if not torch.cuda.is_available():
        raise SystemExit("error: host_layers.py times CUDA launches; no CUDA device here")
    dev = torch.device("cuda")
    x = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(8, 2 * 14336, device=dev, dtype=torch.bfloat16, requires_grad=True)
    cases = {
        "norm, torch autograd (before)": lambda: M._rms_norm(x, w, 1e-5),
        "norm, torch recomputed": lambda: M.recomputed(lambda a, b: M._rms_norm(a, b, 1e-5),
                                                       x, w),
        "norm, Triton fused": lambda: FL.rms_norm(x, w, 1e-5),
        "swiglu, torch autograd (before)": lambda: M.swiglu(y),
        "swiglu, torch recomputed": lambda: M.recomputed(M.swiglu, y),
        "swiglu, Triton fused": lambda: FL.swiglu(y),
    }
    print(f"card: {torch.cuda.get_device_name(dev)} | torch {torch.__version__}")
    for name, fn in cases.items():
        for _ in range(20):
            fn().sum().backward()
        torch.cuda.synchronize()
        res = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                out = fn()
                out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            res.append((time.perf_counter() - t) / 200 * 1e6)
        res.sort()
        print(f"{name:34s} {res[2]:7.1f} us per forward + backward (median of 5 x 200; "
              f"min {res[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()

"""Host time per fused update: what a FORGE linear's backward costs the CPU, GPU idle.

A step of an 8B model calls the fused kernel about 195 times; when the host needs more time per
call than the GPU, the step waits on Python (bench_step.py --profile shows it as wall time far
above the sum of kernel time). On tiny shapes, so that the GPU finishes each kernel long before
the next launch, this times per call (host clock, no synchronization inside the loop):
  launch    the Triton kernel launched directly with fixed arguments (Triton's own launch cost),
            and its parts: pointer token tiles instead of descriptors, building two
            descriptors, the argument binder, the compiled kernel's launcher alone
  kernel    forge_engine.kernels.fused_wgrad_update (checks, descriptors, launch)
  plain linear fwd+bwd       forward + backward of a frozen nn.Linear (dX only): the floor
  forge linear fwd+bwd+step  one fused Linear's forward + backward (dX and the fused update)
                             plus optimizer.step() and zero_grad() (a one-layer "step")
  torch linear fwd+bwd, dW   forward + backward of a trained nn.Linear (dX, dW into .grad)
  forge linear fwd+bwd, fused  the same with FORGE (dX, the fused update), no step()
and then prints cProfile's top functions by own time over the last loop.
    python3 benchmarks/host_overhead.py [--calls 2000]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
from forge_engine.kernels import StateTensor, fused_wgrad_update  # noqa: E402
from forge_engine.optim import AdamW  # noqa: E402
from forge_engine.kernels import rules as R  # noqa: E402


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: host_overhead.py needs a CUDA GPU")
    dev = torch.device("cuda")
    T, N, K = 64, 128, 128
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    spec = R.rule_spec(R.ADAMW, 0)
    hp = torch.tensor(R.hparams(R.ADAMW, dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                              weight_decay=0.1), 1, {}), device=dev)
    states = [StateTensor.full((N, K), 0.0, "bf16", False, dev),
              StateTensor.full((N, K), 0.0, "bf16", True, dev), None]
    sumsq = torch.zeros(1, device=dev)
    rows = {}
    rows["kernel"] = per_call_us(
        lambda: fused_wgrad_update(x, dy, w, states, spec, hp, sumsq, 1, True), a.calls)

    from forge_engine.kernels import fused_update as fu
    from triton.tools.tensor_descriptor import TensorDescriptor
    cfg = fu.default_config(torch.bfloat16, T, N, K)
    cfg.setdefault("EPI_SPLIT", 1)
    cfg["DESC"] = True
    xd = TensorDescriptor.from_tensor(x, [cfg["BLOCK_T"], cfg["BLOCK_K"]])
    dyd = TensorDescriptor.from_tensor(dy, [cfg["BLOCK_T"], cfg["BLOCK_N"]])
    data = [s.data for s in states[:2]] + [w]
    grid = (triton_cdiv(N, cfg["BLOCK_N"]) * triton_cdiv(K, cfg["BLOCK_K"]),)

    def launch():
        fu._fused_wgrad_update_kernel[grid](
            xd, dyd, w, w, w, w, *data, w, w, w, hp, sumsq, T, 0, N, K, 2, K, 1, N, 1, 0, 0, 0,
            0, K, 1, 1, KIND=spec.kind, VARIANT=spec.variant, HAS0=True, HAS1=True, HAS2=False,
            NN0=False, NN1=True, NN2=False, STATE_FMT=1, W_SR=True, S_SR=True,
            DOT_PRECISION="tf32", UPCAST=False, QB=64, NORM_ONLY=False, HAS_ONEHOT=False,
            HAS_G=False, W_BF16=True, PERSISTENT=False, **cfg)
    rows["launch"] = per_call_us(launch, a.calls)
    # where Triton's launch time goes: the same launch with pointer token tiles; building the
    # two tensor descriptors; the argument binder alone; the compiled kernel's launcher called
    # directly (what a per-weight launch cache could call)
    pcfg = dict(cfg, DESC=False)
    pos = [x, dy, w, w, w, w, *data, w, w, w, hp, sumsq, T, 0, N, K, 2, K, 1, N, 1, 0, 0, 0,
           0, K, 1, 1]
    const = dict(KIND=spec.kind, VARIANT=spec.variant, HAS0=True, HAS1=True, HAS2=False,
                 NN0=False, NN1=True, NN2=False, STATE_FMT=1, W_SR=True, S_SR=True,
                 DOT_PRECISION="tf32", UPCAST=False, QB=64, NORM_ONLY=False, HAS_ONEHOT=False,
                 HAS_G=False, W_BF16=True, PERSISTENT=False)
    rows["launch, pointers"] = per_call_us(
        lambda: fu._fused_wgrad_update_kernel[grid](*pos, **const, **pcfg), a.calls)
    rows["two descriptors"] = per_call_us(
        lambda: (TensorDescriptor.from_tensor(x, [cfg["BLOCK_T"], cfg["BLOCK_K"]]),
                 TensorDescriptor.from_tensor(dy, [cfg["BLOCK_T"], cfg["BLOCK_N"]])), a.calls)
    binder = fu._fused_wgrad_update_kernel.device_caches[torch.cuda.current_device()][4]
    rows["binder, pointers"] = per_call_us(lambda: binder(*pos, **const, **pcfg), a.calls)
    for name, args, c in (("desc", [xd, dyd] + pos[2:], cfg), ("pointers", pos, pcfg)):
        ck = fu._fused_wgrad_update_kernel[grid](*args, **const, **c)
        kw = dict(zip(fu._fused_wgrad_update_kernel.arg_names, args))
        kw.update(const)
        kw.update({k: v for k, v in c.items() if k in fu._fused_wgrad_update_kernel.arg_names})
        ordered = [kw[n] for n in fu._fused_wgrad_update_kernel.arg_names]
        stream = torch.cuda.current_stream().cuda_stream
        run, fn, meta = ck.run, ck.function, ck.packed_metadata
        rows[f"compiled launcher, {name}"] = per_call_us(
            lambda: run(grid[0], 1, 1, stream, fn, meta, None, None, None, *ordered), a.calls)

    def layer_step(model, opt):
        def run():
            out = model(xin)
            out.backward(gout)
        return run
    xin = torch.randn(T, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gout = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    plain = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    plain.weight.requires_grad_(False)
    rows["plain linear fwd+bwd"] = per_call_us(layer_step(plain, None), a.calls)
    model = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=dev,
                                                dtype=torch.bfloat16))
    opt = AdamW(model, lr=1e-4, state_dtype="bf16")

    def forge_step():
        model(xin).backward(gout)
        opt.step()
        opt.zero_grad()
    rows["forge linear fwd+bwd+step"] = per_call_us(forge_step, a.calls)
    # the backward alone, as in a real step (many layers, one step()): torch's dW into .grad
    # against FORGE's fused update; FORGE's weight bound to an optimizer whose hyperparameters
    # do not change with the step count (betas 0: no bias correction), so the per-step
    # hyperparameter upload is cached as in a real step, and the step counter advanced by hand
    tlin = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)

    def torch_bwd():
        tlin(xin).backward(gout)
        tlin.weight.grad = None
    rows["torch linear fwd+bwd, dW"] = per_call_us(torch_bwd, a.calls)
    model2 = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=dev,
                                                 dtype=torch.bfloat16))
    opt2 = AdamW(model2, lr=1e-4, betas=(0.0, 0.0), state_dtype="bf16")

    def forge_bwd():
        model2(xin).backward(gout)
        opt2._global_step += 1  # another backward without step() (benchmark only)
    rows["forge linear fwd+bwd, fused"] = per_call_us(forge_bwd, a.calls)
    print(f"card {torch.cuda.get_device_name()} | torch {torch.__version__} | host time per "
          f"call, {a.calls} calls, T N K = {T} {N} {K}")
    for k, v in rows.items():
        print(f"  {k:30s} {v:8.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        forge_bwd()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def triton_cdiv(a, b):
    return -(-a // b)


if __name__ == "__main__":
    main()

"""Registers and spills of the fused kernel compiled for a GPU architecture, without a GPU.

    python3 -m forge_engine.kernels.ptxas_report            # sm_90 (H200), AdamW, bf16 weights
    python3 -m forge_engine.kernels.ptxas_report --arch 80  # A100

(python3 benchmarks/ptxas_report.py ARGS runs the same command; run it without
TRITON_INTERPRET: the kernel is built, not interpreted.)

Builds the kernel with triton.compile for GPUTarget("cuda", arch, 32) at the tile
configurations default_config() uses, for bf16 and int8 states, with and without the epilogue
(NORM_ONLY), the token tiles by descriptors and by pointers, and the persistent variant, and
runs Triton's bundled ptxas -v on the PTX. The arguments are specialized as a launch on an
LLM shape specializes them (unit strides constant, the rest multiples of 16): without that,
the epilogue's pointers lose their contiguity and the report shows spills (about 2 KB per
thread) that the real kernel does not have. Spills are a lead for the kernel's speed, not a
measurement of it: time it on the card (benchmarks/bench_kernel.py).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from forge_engine.kernels import fused_update
from forge_engine.kernels import rules as R
from forge_engine.kernels.launch import INTERPRET
from forge_engine.kernels.ptx_check import bundled

KERNEL = fused_update._fused_wgrad_update_kernel

CONFIGS = {"T<=1024": dict(BLOCK_T=64, BLOCK_N=64, BLOCK_K=128, GROUP_N=8, num_warps=4,
                           num_stages=3, EPI_SPLIT=2),
           "T<=1024 int8": dict(BLOCK_T=64, BLOCK_N=64, BLOCK_K=128, GROUP_N=8, num_warps=4,
                                num_stages=3, EPI_SPLIT=2, maxnreg=168),
           "T>1024": dict(BLOCK_T=64, BLOCK_N=128, BLOCK_K=128, GROUP_N=8, num_warps=8,
                          num_stages=4, EPI_SPLIT=2)}
STATE = {"bf16": (1, "*bf16", "*bf16"), "int8": (2, "*i8", "*u8")}


def ptxas(arch: int, state: str, cfg: dict, norm_only: bool, desc: bool,
          persistent: bool = False, unit: tuple = ()) -> str:
    """ptxas -v's registers and spills of the kernel built at cfg; `unit`: integer arguments
    built as the constant 1, as a launch specializes an argument equal to 1 (N = 1 for a
    norm weight, K = 1 for a one-input linear)."""
    spec = R.rule_spec(R.ADAMW, 0)
    fmt, s0, s1 = STATE[state]
    bt, bn, bk = cfg["BLOCK_T"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sig = {"x_ptr": f"tensordesc<bf16[{bt}, {bk}]>" if desc else "*bf16",
           "dy_ptr": f"tensordesc<bf16[{bt}, {bn}]>" if desc else "*bf16",
           "ids_ptr": "*bf16", "e_ptr": "*bf16", "g_ptr": "*fp32", "w_ptr": "*bf16",
           "s0_ptr": s0, "s1_ptr": s1, "s2_ptr": "*bf16", "q0_ptr": "*fp32", "q1_ptr": "*fp32",
           "q2_ptr": "*bf16", "hp_ptr": "*fp32", "sumsq_ptr": "*fp32"}
    for name in KERNEL.arg_names:
        sig.setdefault(name, "i32")
    # specialize as a real launch on an LLM shape does: unit strides become the constant 1,
    # every other integer and pointer is known to be a multiple of 16 (K = 4096, N = 14336, ...)
    ones = dict(stride_xk=1, stride_dn=1, stride_wk=1)
    const = dict(**ones, KIND=spec.kind, VARIANT=spec.variant, HAS0=True, HAS1=True, HAS2=False,
                 NN0=False, NN1=True, NN2=False, STATE_FMT=fmt, W_SR=True, S_SR=fmt == 1,
                 DOT_PRECISION="tf32", UPCAST=False, QB=64, NORM_ONLY=norm_only,
                 HAS_ONEHOT=False, HAS_G=False, DESC=desc, W_BF16=True,
                 PERSISTENT=persistent,
                 **{k: v for k, v in cfg.items()
                    if k not in ("num_warps", "num_stages", "maxnreg")})
    const.update({name: 1 for name in unit})
    for k in const:
        sig[k] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(KERNEL.arg_names)
             if sig[n] != "constexpr" and n != "seed" and not sig[n].startswith("tensordesc")}
    src = ASTSource(fn=KERNEL, signature=sig, attrs=attrs,
                    constexprs={(KERNEL.arg_names.index(k),): v for k, v in const.items()})
    cc = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                     maxnreg=cfg.get("maxnreg")))
    ptx = cc.asm["ptx"]
    target = re.search(r"\.target (sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([bundled("ptxas"), f"-arch={target}", "-v", path, "-o",
                              os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"{regs.group(1) if regs else '?':>4} regs, spill stores {spill.group(1):>5} B, "
            f"loads {spill.group(2):>5} B" if spill else text.strip()[-300:])


def main(argv=None):
    if INTERPRET:
        sys.exit("ptxas_report builds the kernel: run it without TRITON_INTERPRET")
    ap = argparse.ArgumentParser(prog="python3 -m forge_engine.kernels.ptxas_report")
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_{a.arch}, AdamW, bf16 weights with SR")
    for cname, cfg in CONFIGS.items():
        for desc, persistent in ((True, False), (False, False), (True, True)):
            loads = "persistent" if persistent else "descriptors" if desc else "pointers"
            for state in STATE:
                for norm_only in (True, False):
                    part = "token loop only" if norm_only else "token loop + epilogue"
                    print(f"{cname:>8} {loads:>11} {state:>5} {part:>22}: "
                          f"{ptxas(a.arch, state, cfg, norm_only, desc, persistent)}",
                          flush=True)


if __name__ == "__main__":
    main()

"""Tile-configuration sweep of the fused kernel: which (BLOCK_T, BLOCK_N,
BLOCK_K, warps, stages, tensor descriptors for the token tiles, epilogue in 1 / 2 / 4 column
parts, register cap, persistent programs) keeps the epilogue in registers and the token loop
fed.

For each shape and config: check the result against the float64 reference (one step, bf16
weights with stochastic rounding, bf16 moments; tolerance as tests/test_kernel.py), then time it
(median of do_bench) next to cuBLAS dW + torch fused AdamW measured in the same process, and the
same config's token loop alone (the norm-only pass: the GEMM part of the kernel).
    python3 benchmarks/sweep_kernel.py --out sweep.csv [--configs 2,3,8,9]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import bench, moments, problem, unfused_ms, write_csv  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402
from forge_engine.kernels.reference import materialized_step  # noqa: E402
from test_kernel import check_values  # noqa: E402

CONFIGS = [  # BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages, DESC, EPI_SPLIT, maxnreg,
    # PERSISTENT (DESC: the token tiles through tensor descriptors; EPI_SPLIT: the epilogue in
    # column parts; maxnreg: a register cap per thread, None = the compiler's choice, 255 here;
    # PERSISTENT: one program per SM, tile and token loops flattened)
    # pointer loads, the whole epilogue at once
    (64, 64, 128, 4, 3, False, 1, None, False), (64, 128, 128, 8, 3, False, 1, None, False),
    # the defaults: 255 registers and (T > 1024) 131 KB of shared memory hold one program
    # per SM (ncu), so no other program's token loop runs while one is in its epilogue
    (64, 64, 128, 4, 3, True, 2, None, False), (64, 128, 128, 8, 4, True, 2, None, False),
    (64, 128, 128, 8, 3, True, 2, None, False), (128, 128, 128, 8, 3, True, 2, None, False),
    # capped registers and fewer stages: two to four programs per SM, spilling more
    (64, 64, 128, 4, 3, True, 2, 128, False), (64, 128, 128, 8, 3, True, 2, 128, False),
    # persistent programs: the next tile's loads may be issued under this tile's epilogue
    (64, 64, 128, 4, 3, True, 2, None, True), (64, 128, 128, 8, 4, True, 2, None, True),
    (64, 128, 128, 8, 3, True, 2, None, True), (64, 128, 256, 8, 3, True, 4, None, True),
    # smaller tiles with fewer registers (ptxas_report: 164 in bf16, 219 in int8, no spills):
    # three programs of 4 warps per SM in bf16, still two in int8
    (64, 32, 128, 4, 3, True, 2, None, False), (64, 32, 128, 4, 4, True, 2, None, False),
    (64, 64, 64, 4, 3, True, 1, None, False),
    # 64 x 128 tiles capped at 168 registers (three programs per
    # SM), and 32-token steps on 32-row tiles (less shared memory per program)
    (64, 64, 128, 4, 3, True, 2, 168, False), (32, 32, 128, 4, 3, True, 2, None, False),
]
CONFIG_KEYS = ("BT", "BN", "BK", "warps", "stages", "desc", "split", "maxnreg", "persistent")
SHAPES = [(512, 28672, 4096), (2048, 6144, 4096), (4096, 4096, 14336)]
REP_MS = 150  # do_bench's timing window per measurement


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.csv")
    ap.add_argument("--configs", default=None,
                    help="comma-separated indices into CONFIGS to run (default: all)")
    a = ap.parse_args()
    configs = CONFIGS if a.configs is None else [CONFIGS[int(i)] for i in a.configs.split(",")]
    dev = torch.device("cuda")
    rows = []
    print(f"card {torch.cuda.get_device_name()} | torch {torch.__version__}")
    for T, N, K in SHAPES:
        x, dy, w0, m0, v0, spec, hp_list = problem(T, N, K, dev)
        hp = torch.tensor(hp_list, device=dev)
        t_unf = unfused_ms(x, dy, w0, REP_MS)
        t_gemm = bench(lambda: dy.t() @ x, REP_MS)
        flops = 2.0 * T * N * K
        for fmt in ("bf16", "int8"):
            for cfg in configs:
                bt, bn, bk, nw, ns, desc, split, maxnreg, persistent = cfg
                conf = dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=8, num_warps=nw,
                            num_stages=ns, DESC=desc, EPI_SPLIT=split, PERSISTENT=persistent)
                if maxnreg is not None:
                    conf["maxnreg"] = maxnreg
                st = moments(m0, v0, fmt)
                w = w0.clone()
                s_in = [t.fp32() if t is not None else None for t in st]
                ok = "ok"
                try:
                    fused_wgrad_update(x, dy, w, st, spec, hp, torch.zeros(1, device=dev), 1,
                                       True, conf)
                    rows_chk = slice(0, 512)  # check a slab of rows against float64
                    wr, _, _ = materialized_step(x, dy[:, rows_chk], w0.float()[rows_chk],
                                                 [s[rows_chk] if s is not None else None
                                                  for s in s_in], spec, hp_list)
                    w32, _, _ = materialized_step(x, dy[:, rows_chk], w0.float()[rows_chk],
                                                  [s[rows_chk] if s is not None else None
                                                   for s in s_in], spec, hp_list,
                                                  torch.float32)
                    check_values("w", w[rows_chk], wr, float((w32.double() - wr).abs().max()),
                                 True)
                    st = moments(m0, v0, fmt)
                    t = bench(lambda: fused_wgrad_update(x, dy, w, st, spec, hp,
                                                         torch.zeros(1, device=dev), 1, True,
                                                         conf), REP_MS)
                    # the token loop alone (norm-only pass: no epilogue loads or stores)
                    t_loop = bench(lambda: fused_wgrad_update(x, dy, w, st, spec, hp,
                                                              torch.zeros(1, device=dev), 1,
                                                              True, conf, norm_only=True),
                               REP_MS)
                except Exception as e:  # a config that does not compile or fit: record, go on
                    ok, t = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}", float("nan")
                    t_loop = float("nan")
                r = dict(T=T, N=N, K=K, fmt=fmt, BT=bt, BN=bn, BK=bk, warps=nw, stages=ns,
                         desc=desc, split=split, maxnreg=maxnreg, persistent=persistent, ms=t,
                         loop_ms=t_loop, gemm_ms=t_gemm,
                         unfused_ms=t_unf, ratio=t / t_unf, loop_tflops=flops / t_loop / 1e9,
                         check=ok)
                rows.append(r)
                print(f"T {T:5d} N {N:6d} K {K:6d} {fmt} cfg {cfg}: {t:8.3f} ms | loop "
                      f"{t_loop:7.3f} ({flops / t_loop / 1e9:4.0f} TF/s) | gemm {t_gemm:7.3f} | "
                      f"unfused {t_unf:7.3f} | ratio {t / t_unf:5.2f} | {ok}", flush=True)
                torch.cuda.empty_cache()
    write_csv(a.out, rows)
    print("\nbest per shape and moment format (ms; ratio to cuBLAS dW + fused AdamW):")
    for T, N, K in SHAPES:
        for fmt in ("bf16", "int8"):
            ok = [r for r in rows if (r["T"], r["N"], r["K"], r["fmt"]) == (T, N, K, fmt)
                  and r["check"] == "ok"]
            if ok:
                b = min(ok, key=lambda r: r["ms"])
                print(f"T {T:5d} N {N:6d} K {K:6d} {fmt}: {b['ms']:.3f} ms ratio "
                      f"{b['ratio']:.2f} loop {b['loop_ms']:.3f} gemm {b['gemm_ms']:.3f} cfg "
                      f"{tuple(b[k] for k in CONFIG_KEYS)}")


if __name__ == "__main__":
    main()

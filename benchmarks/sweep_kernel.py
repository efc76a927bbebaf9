"""Tile-configuration sweep of the fused kernel (issue 5 groundwork): which (BLOCK_T, BLOCK_N,
BLOCK_K, warps, stages) keeps the epilogue in registers and the token loop fed.

For each shape and config: check the result against the float64 reference (one step, bf16
weights with stochastic rounding, bf16 moments; tolerance as tests/test_kernel.py), then time it
(median of do_bench) next to cuBLAS dW + torch fused AdamW measured in the same process.
    python3 benchmarks/sweep_kernel.py --out sweep.csv
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel import write_csv  # noqa: E402
from forge_engine.kernels import StateTensor  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402
from forge_engine.kernels.reference import materialized_step  # noqa: E402
from forge_engine.optim import rules as R  # noqa: E402
from test_kernel import check_values  # noqa: E402

CONFIGS = [  # BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages
    (64, 128, 128, 8, 3), (64, 128, 64, 8, 3), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3),
    (128, 128, 64, 8, 3), (32, 128, 128, 8, 4), (64, 64, 64, 4, 4), (128, 64, 128, 8, 3),
    (64, 256, 64, 8, 3),
    # 32 fp32 values per thread per tile instead of 64: the epilogue's register floor
    # (docs/benchmarks.md, "Registers and spills without a GPU")
    (64, 64, 128, 8, 3), (32, 64, 128, 8, 4),
]
SHAPES = [(512, 28672, 4096), (2048, 28672, 4096), (4096, 4096, 14336)]
GROUP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep.csv")
    a = ap.parse_args()
    dev = torch.device("cuda")
    spec = R.rule_spec(R.ADAMW, 0)
    hp_list = R.hparams(R.ADAMW, GROUP, 10, {})
    hp = torch.tensor(hp_list, device=dev)
    rows = []
    print(f"card {torch.cuda.get_device_name()} | torch {torch.__version__}")
    for T, N, K in SHAPES:
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16) * 1e-2
        w0 = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
        p = torch.nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True)
        p.grad = dy.t() @ x
        opt.step()

        def unfused():
            p.grad = dy.t() @ x
            opt.step()
        t_unf = bench(unfused)
        del opt, p
        m0 = torch.randn(N, K, device=dev) * 1e-3
        v0 = torch.rand(N, K, device=dev) * 1e-6
        for fmt in ("bf16", "int8"):
            for cfg in CONFIGS:
                bt, bn, bk, nw, ns = cfg
                conf = dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=8, num_warps=nw,
                            num_stages=ns)
                st = [StateTensor.from_fp32(m0, fmt, False), StateTensor.from_fp32(v0, fmt, True),
                      None]
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
                    st = [StateTensor.from_fp32(m0, fmt, False),
                          StateTensor.from_fp32(v0, fmt, True), None]
                    t = bench(lambda: fused_wgrad_update(x, dy, w, st, spec, hp,
                                                         torch.zeros(1, device=dev), 1, True,
                                                         conf))
                except Exception as e:  # a config that does not compile or fit: record, go on
                    ok, t = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}", float("nan")
                r = dict(T=T, N=N, K=K, fmt=fmt, BT=bt, BN=bn, BK=bk, warps=nw, stages=ns,
                         ms=t, unfused_ms=t_unf, ratio=t / t_unf, check=ok)
                rows.append(r)
                print(f"T {T:5d} N {N:6d} K {K:6d} {fmt} cfg {cfg}: {t:8.3f} ms | unfused "
                      f"{t_unf:7.3f} | ratio {t / t_unf:5.2f} | {ok}", flush=True)
                torch.cuda.empty_cache()
    write_csv(a.out, rows)


if __name__ == "__main__":
    main()

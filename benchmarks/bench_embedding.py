"""An embedding's update: FORGE's one-hot segment (the Triton kernel) against torch's embedding
backward (a dense [V, H] gradient) + fused AdamW, at the vocabularies of Llama-3.1-8B and
Qwen3-8B.

    python3 benchmarks/bench_embedding.py --out benchmarks/results/embedding/bench_embedding_flat_h200.csv

Per (vocabulary, token count, token distribution, moments' format), in one process on one card,
the median of triton.testing.do_bench:
  unfused  torch.ops.aten.embedding_backward (the [V, H] bf16 gradient autograd would make)
           + torch.optim.AdamW(fused=True) on bf16 weights and moments
  forge    fused_wgrad_update(None, None, w, states, ..., onehot=(ids, e)): bf16 weights with
           stochastic rounding, bf16 or int8 moments
  copy     a device copy of the bytes W and the moments occupy (read and written once): the
           floor of any update that must touch every row
Token ids: uniform over the vocabulary, or log-uniform (density 1/id, text-like: fewer
distinct rows, many repeats). Needs a GPU.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from bench_kernel import ADAMW_GROUP, ADAMW_STEP, bench, moments, write_csv  # noqa: E402
from forge_engine.kernels.fused_update import fused_wgrad_update  # noqa: E402
from forge_engine.kernels import rules as R  # noqa: E402

VOCABS = {"llama": 128256, "qwen": 151936}


def token_ids(kind: str, T: int, V: int, dev) -> torch.Tensor:
    if kind == "uniform":
        return torch.randint(0, V, (T,), device=dev)
    if kind == "loguniform":  # density 1/id over [1, V]
        return ((torch.rand(T, device=dev) * math.log(V)).exp().long() - 1).clamp_(0, V - 1)
    raise ValueError(f"token distribution must be uniform or loguniform, got {kind!r}")


def unfused_ms(ids, e, w, V) -> float:
    """torch's embedding backward (dense gradient) + fused AdamW on bf16 weights/moments."""
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([p], lr=ADAMW_GROUP["lr"], betas=ADAMW_GROUP["betas"],
                            eps=ADAMW_GROUP["eps"], weight_decay=ADAMW_GROUP["weight_decay"],
                            fused=True)

    def step():
        p.grad = torch.ops.aten.embedding_backward(e, ids, V, -1, False, False)
        opt.step()
    step()  # create the moments
    return bench(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_embedding.csv")
    ap.add_argument("--vocabs", default="llama,qwen")
    ap.add_argument("--tokens", default="512,2048,4096")
    ap.add_argument("--ids", default="uniform,loguniform")
    ap.add_argument("--hidden", type=int, default=4096)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_embedding.py needs a CUDA GPU")
    for v in a.vocabs.split(","):
        if v not in VOCABS:
            raise SystemExit(f"error: --vocabs takes {sorted(VOCABS)}, got {v!r}")
    dev = torch.device("cuda")
    K = a.hidden
    spec = R.rule_spec(R.ADAMW, 0)
    hp = torch.tensor(R.hparams(R.ADAMW, ADAMW_GROUP, ADAMW_STEP, {}), device=dev)
    sumsq = torch.zeros(1, device=dev)
    print(f"card: {torch.cuda.get_device_name()} | torch {torch.__version__} | hidden {K}")
    print(f"{'vocab':>6} {'T':>5} {'ids':>10} {'rows':>5} | {'copy':>7} {'unfused':>8} | "
          f"{'bf16':>7} {'ratio':>6} | {'int8':>7} {'ratio':>6}")
    rows = []
    for name in a.vocabs.split(","):
        V = VOCABS[name]
        w = (torch.randn(V, K, device=dev) * 0.02).to(torch.bfloat16)
        m0 = torch.randn(V, K, device=dev) * 1e-3
        v0 = torch.rand(V, K, device=dev) * 1e-6
        src = torch.empty(V * K * 6, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy = bench(lambda: dst.copy_(src))
        src = dst = None
        for T in map(int, a.tokens.split(",")):
            for kind in a.ids.split(","):
                ids = token_ids(kind, T, V, dev)
                e = (torch.randn(T, K, device=dev) * 1e-3).to(torch.bfloat16)
                row = dict(vocab=name, V=V, K=K, T=T, ids=kind,
                           distinct=int(torch.unique(ids).numel()), copy_ms=copy,
                           unfused_ms=unfused_ms(ids, e, w, V))
                for fmt in ("bf16", "int8"):
                    states = moments(m0, v0, fmt)
                    ww = w.clone()
                    row[f"forge_{fmt}_ms"] = bench(lambda: fused_wgrad_update(
                        None, None, ww, states, spec, hp, sumsq, 1, True, onehot=(ids, e)))
                    row[f"ratio_{fmt}"] = row[f"forge_{fmt}_ms"] / row["unfused_ms"]
                    states = ww = None
                rows.append(row)
                print(f"{name:>6} {T:>5} {kind:>10} {row['distinct']:>5} | {copy:7.3f} "
                      f"{row['unfused_ms']:8.3f} | {row['forge_bf16_ms']:7.3f} "
                      f"{row['ratio_bf16']:6.2f} | {row['forge_int8_ms']:7.3f} "
                      f"{row['ratio_int8']:6.2f}", flush=True)
        w = m0 = v0 = None
        torch.cuda.empty_cache()
    write_csv(a.out, rows)


if __name__ == "__main__":
    main()

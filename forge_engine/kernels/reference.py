"""Pure-torch references of the fused kernel (the one place tests and benchmarks use).

* fused_wgrad_update_torch: the tiled torch backend. Same math and same storage formats as the
  Triton kernel, over blocks of whole rows of W, so the full dW is never materialized either
  (one [rows, K] block at a time). Serves CPU training, where the Triton interpreter is too slow.
* materialized_step: "materialize dW, then step" in a chosen precision (float64 for tests):
  the definition the kernel must agree with.
"""
from __future__ import annotations

import torch

from forge_engine.kernels.quant import StateTensor, sr_bf16
from forge_engine.kernels.rules import GRAD_SCALE, HP_LEN, RuleSpec, ref_update, seed_bits

ROW_BLOCK_ELEMS = 1 << 22  # rows per block so that one gradient block is at most 16 MiB fp32


def fused_wgrad_update_torch(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor, states: list,
                             spec: RuleSpec, hp: torch.Tensor, sumsq: torch.Tensor, seed: int,
                             stochastic: bool, config: dict | None = None,
                             norm_only: bool = False, onehot=None, grad=None) -> None:
    """Same contract as kernels.fused_update.fused_wgrad_update (x [T, K], dy [T, N], w [N, K],
    onehot (ids [T1], e [T1, K]) or None, grad [N, K] in fp32 or w's dtype, or None)."""
    N, K = w.shape
    if x is None:
        x, dy = w.new_empty((0, K)), w.new_empty((0, N))
    T = x.shape[0]
    if dy.shape != (T, N) or x.shape != (T, K) or w.dim() != 2:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, dy {tuple(dy.shape)}, "
                         f"w {tuple(w.shape)}; need x [T, K], dy [T, N], w [N, K]")
    if grad is not None and (grad.shape != (N, K) or grad.dtype not in (torch.float32, w.dtype)):
        raise ValueError(f"grad must be [{N}, {K}] in fp32 or w's {w.dtype}, got {grad.dtype} "
                         f"{tuple(grad.shape)}")
    if hp.numel() != HP_LEN:
        raise ValueError(f"hp must hold {HP_LEN} values, got {tuple(hp.shape)}")
    hp_host = hp.cpu()  # one copy for the values and the seed bits
    hpl = [float(v) for v in hp_host.float()]  # fp32-rounded, as the kernel sees them
    gen = torch.Generator(device=w.device)
    gen.manual_seed((seed + seed_bits(hp_host)) & 0x7FFFFFFF)  # the step's offset, as the kernel
    rows = max(1, ROW_BLOCK_ELEMS // max(K, 1))
    xf = x.float()
    total = torch.zeros((), dtype=torch.float32, device=w.device)
    for r0 in range(0, N, rows):
        sl = slice(r0, min(N, r0 + rows))
        g = dy[:, sl].float().t() @ xf  # [rows, K], the only gradient memory: one block
        if onehot is not None:  # + onehot(ids)^T e for the rows of this block
            ids, e = onehot
            hit = (ids >= sl.start) & (ids < sl.stop)
            g.index_add_(0, ids[hit] - sl.start, e[hit].float())
        if grad is not None:
            g += grad[sl]
        sq = (g * g).sum()
        total += sq
        if norm_only or not torch.isfinite(sq):
            continue  # a block with a non-finite gradient is not written (kernel: per tile)
        step_rows(w, g, states, sl, spec, hpl, stochastic, gen)
    # the norm of the gradient the rule applies, hp[GRAD_SCALE] * g (norm_only: of g itself)
    sumsq += total if norm_only else total * (hpl[GRAD_SCALE] * hpl[GRAD_SCALE])


def step_rows(w: torch.Tensor, g: torch.Tensor, states: list, rows: slice, spec: RuleSpec,
              hpl: list, stochastic: bool, gen: torch.Generator | None) -> None:
    """One optimizer step on rows `rows` of the 2-D weight w, given their fp32 gradient g.

    Shared by the torch backend (g is one block of dy^T x) and by the optimizer's standard path
    (g is a materialized .grad), so both store weights and states the same way."""
    s = [st.fp32(rows) if st is not None else None for st in states]
    wn, s = ref_update(spec, hpl, w[rows].float(), g, s)
    if w.dtype == torch.bfloat16 and stochastic:
        w[rows] = sr_bf16(wn, gen)
    else:
        w[rows] = wn.to(w.dtype)
    for st, v in zip(states, s):
        if st is not None:
            st.write(rows, v, stochastic, gen)


def materialized_step(x: torch.Tensor | None, dy: torch.Tensor | None, w: torch.Tensor,
                      states: list, spec: RuleSpec, hp, dtype=torch.float64, onehot=None,
                      grad=None):
    """Reference: dW = dy^T x (+ onehot(ids)^T e) materialized in `dtype`, then one step of the
    rule in `dtype`. states: list of 3 fp32-valued tensors or None.
    Returns (w_new, states_new, grad) in `dtype`."""
    g = torch.zeros(w.shape, dtype=dtype, device=w.device)
    if x is not None:
        g = g + dy.to(dtype).t() @ x.to(dtype)
    if onehot is not None:
        ids, e = onehot
        hit = ids >= 0
        g.index_add_(0, ids[hit], e[hit].to(dtype))
    if grad is not None:
        g = g + grad.to(dtype)
    s = [st.to(dtype) if st is not None else None for st in states]
    hpl = [float(v) for v in torch.as_tensor(hp, dtype=torch.float32)]
    wn, s = ref_update(spec, hpl, w.to(dtype), g, s)
    return wn, s, g


__all__ = ["fused_wgrad_update_torch", "materialized_step", "StateTensor"]

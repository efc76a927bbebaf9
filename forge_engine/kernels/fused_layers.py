"""Fused RMSNorm and SwiGLU for the model (Triton), forward and backward.

Each keeps for backward only what backward needs, and replaces a chain of element-wise torch
ops (nine for a torch RMSNorm's forward, more for its backward) by one kernel each way:

    rms_norm(x [*, n], w [n], eps) = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)
        kept: x, w and rstd (one fp32 per row); backward with y = x * rstd, g = dy * w:
        dx = rstd * (g - y * mean(g * y)),  dw = sum over rows of dy * y
    swiglu(y [*, 2f]) = silu(gate) * up,  [gate, up] = y split in halves
        kept: y; backward with s = sigmoid(gate):
        d_gate = dout * up * s * (1 + gate * (1 - s)),  d_up = dout * gate * s

Everything is computed in fp32 and rounded once to the input's dtype. dw is summed per program
into an fp32 [programs, n] buffer and then over programs in one fixed order: the same result
on every run. Inputs are bf16, fp16 or fp32 on CUDA (or on the CPU under TRITON_INTERPRET=1,
as the tests run them); model.py falls back to torch for anything else.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge_engine.kernels.fused_update import _programs as _multiprocessors
from forge_engine.kernels.fused_update import launch_cached
from forge_engine.kernels.quant import to_bf16_rn

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_NORM_WIDTH = 32768  # one row is one block of registers


@triton.jit
def _rounded(x, PTR):
    """fp32 x rounded to nearest in PTR's element type (bf16 in integer arithmetic: Triton's
    interpreter truncates a plain cast)."""
    if PTR.dtype.element_ty == tl.bfloat16:
        return to_bf16_rn(x)
    else:
        return x.to(PTR.dtype.element_ty)


@triton.jit
def _rms_norm_fwd(X, W, Y, RSTD, rows, n, eps, sx, sy,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    cmask = cols < n
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        m = cmask & (row < rows)
        x = tl.load(X + row.to(tl.int64) * sx + cols, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
        tl.store(Y + row.to(tl.int64) * sy + cols, _rounded(x * rstd * w, Y),
                 mask=m)
        tl.store(RSTD + row, rstd, mask=row < rows)


@triton.jit
def _rms_norm_bwd(X, W, DY, RSTD, DX, DWP, rows, n, sx, sdy, sdx,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    cmask = cols < n
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        m = cmask & (row < rows)
        r64 = row.to(tl.int64)
        x = tl.load(X + r64 * sx + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * sdy + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < rows, other=0.0)
        y = x * rstd
        g = dy * w
        c = tl.sum(g * y, axis=0) / n
        tl.store(DX + r64 * sdx + cols, _rounded(rstd * (g - y * c), DX), mask=m)
        dw += dy * y  # rows past the end load zeros and add nothing
    tl.store(DWP + tl.program_id(0).to(tl.int64) * n + cols, dw, mask=cmask)


def _rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as [rows, n] with unit column stride (a copy only where no such view exists)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _programs(rows: int, device) -> tuple[int, int]:
    """(programs, rows per program): about four programs per multiprocessor, so that the dw
    partials stay few, and never more programs than rows."""
    per = max(1, -(-rows // (4 * _multiprocessors(device))))
    return -(-rows // per), per


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _check(name: str, *tensors):
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: tensors must be one of {DTYPES}, got {t.dtype}")


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        n = x.shape[-1] if x.dim() else 0
        _check("rms_norm", x, w)
        if not 1 <= n <= MAX_NORM_WIDTH:
            raise ValueError(f"rms_norm: the normalized (last) dim must be 1 to "
                             f"{MAX_NORM_WIDTH}, got x of shape {tuple(x.shape)}")
        if w.shape != (n,):
            raise ValueError(f"rms_norm: weight must be [{n}] (x's last dim), got "
                             f"{tuple(w.shape)}")
        w = w if w.is_contiguous() else w.contiguous()  # the kernels read it with unit stride
        x2 = _rows_view(x, n)
        rows = x2.shape[0]
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            programs, per = _programs(rows, x.device)
            block = 1 << (n - 1).bit_length()  # the next power of two
            launch_cached(_rms_norm_fwd, (programs,),
                          [x2, w, y, rstd, rows, n, float(eps), x2.stride(0), y.stride(0)],
                          x.device, dict(BLOCK=block, ROWS=per, num_warps=_warps(block)))
        ctx.save_for_backward(x2, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dx = torch.empty((rows, n), dtype=x2.dtype, device=x2.device)
        need_dw = ctx.needs_input_grad[1]
        if not rows:  # nothing to normalize: dw is a sum over no rows
            return dx.view(dy.shape), torch.zeros_like(w) if need_dw else None, None
        dy2 = _rows_view(dy, n)
        programs, per = _programs(rows, x2.device)
        # dw partials: every program writes its row
        dwp = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        block = 1 << (n - 1).bit_length()  # the next power of two
        launch_cached(_rms_norm_bwd, (programs,),
                      [x2, w, dy2, rstd, dx, dwp, rows, n, x2.stride(0), dy2.stride(0),
                       dx.stride(0)],
                      x2.device, dict(BLOCK=block, ROWS=per, num_warps=_warps(block)))
        dw = dwp.sum(0).to(w.dtype) if need_dw else None
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * w in fp32, rounded once to x's dtype (see module)."""
    return _RMSNorm.apply(x, w, eps)


@triton.jit
def _swiglu_fwd(Y, OUT, rows, f, sy, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < f
    gate = tl.load(Y + row * sy + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(Y + row * sy + f + cols, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    tl.store(OUT + row * so + cols, _rounded(gate * s * up, OUT), mask=m)


@triton.jit
def _swiglu_bwd(Y, DOUT, DY, rows, f, sy, sd, sdy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < f
    gate = tl.load(Y + row * sy + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(Y + row * sy + f + cols, mask=m, other=0.0).to(tl.float32)
    d = tl.load(DOUT + row * sd + cols, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    dgate = d * up * s * (1.0 + gate * (1.0 - s))
    tl.store(DY + row * sdy + cols, _rounded(dgate, DY), mask=m)
    tl.store(DY + row * sdy + f + cols, _rounded(d * gate * s, DY), mask=m)


SWIGLU_BLOCK = 1024


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        _check("swiglu", y)
        two_f = y.shape[-1]
        if two_f % 2:
            raise ValueError(f"swiglu: the last dim holds [gate, up] and must be even, got "
                             f"{two_f}")
        f = two_f // 2
        y2 = _rows_view(y, two_f)
        rows = y2.shape[0]
        out = torch.empty((rows, f), dtype=y.dtype, device=y.device)
        if rows and f:
            launch_cached(_swiglu_fwd, (rows, -(-f // SWIGLU_BLOCK)),
                          [y2, out, rows, f, y2.stride(0), out.stride(0)], y.device,
                          dict(BLOCK=SWIGLU_BLOCK))
        ctx.save_for_backward(y2)
        ctx.shape = y.shape
        return out.view(*y.shape[:-1], f)

    @staticmethod
    def backward(ctx, dout):
        (y2,) = ctx.saved_tensors
        rows, two_f = y2.shape
        f = two_f // 2
        d2 = _rows_view(dout, f)
        dy = torch.empty_like(y2)
        if rows and f:
            launch_cached(_swiglu_bwd, (rows, -(-f // SWIGLU_BLOCK)),
                          [y2, d2, dy, rows, f, y2.stride(0), d2.stride(0), dy.stride(0)],
                          y2.device, dict(BLOCK=SWIGLU_BLOCK))
        return dy.view(ctx.shape)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for y = [gate, up] along the last dim, in fp32, rounded once."""
    return _SwiGLU.apply(y)


__all__ = ["rms_norm", "swiglu", "DTYPES"]

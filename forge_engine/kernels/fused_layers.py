"""Fused RMSNorm, SwiGLU and rotary embedding for the model (Triton), forward and backward.

Each keeps for backward only what backward needs, and replaces a chain of element-wise torch
ops (nine for a torch RMSNorm's forward, more for its backward) by one kernel each way:

    rms_norm(x [*, n], w [n], eps) = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)
        kept: x, w and rstd (one fp32 per row); backward with y = x * rstd, g = dy * w:
        dx = rstd * (g - y * mean(g * y)),  dw = sum over rows of dy * y
    swiglu(y [*, 2f]) = silu(gate) * up,  [gate, up] = y split in halves
        kept: y; backward with s = sigmoid(gate):
        d_gate = dout * up * s * (1 + gate * (1 - s)),  d_up = dout * gate * s
    rope(x [s, b, heads, d], cos, sin [s, d/2]): x rotated by position, rotate-half layout
        (pairs j and j + d/2): y_j = x_j c - x_(j+d/2) s,  y_(j+d/2) = x_(j+d/2) c + x_j s
        kept: nothing but the tables; backward is the rotation by minus the angle (sin -> -sin).
        One kernel each way for a whole [s, b, heads, d] tensor, where torch's rotate-half
        takes seven (a widening copy, neg, cat, two products, a sum, a narrowing copy)

Everything is computed in fp32 and rounded once to the input's dtype. dw is summed per program
into an fp32 [programs, n] buffer and then over programs in one fixed order: the same result
on every run. Inputs are bf16, fp16 or fp32 on CUDA (or on the CPU under TRITON_INTERPRET=1,
as the tests run them); model.py falls back to torch for anything else.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge_engine.kernels.launch import launch_cached, persistent_programs
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
    per = max(1, -(-rows // (4 * persistent_programs(device))))
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


@triton.jit
def _rope(X, COS, SIN, Y, B, heads, half, sxs, sxb, sxh, sys, syb, syh,
          BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One position and batch row per program: all its heads, both halves of each."""
    pid = tl.program_id(0)
    si = (pid // B).to(tl.int64)
    bi = (pid % B).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_D)
    jm = j < half
    m = (h < heads)[:, None] & jm[None, :]
    c = tl.load(COS + si * half + j, mask=jm, other=0.0)[None, :]
    s = tl.load(SIN + si * half + j, mask=jm, other=0.0)[None, :]
    if BACKWARD:  # the transpose of a rotation: the rotation by minus the angle
        s = -s
    src = X + si * sxs + bi * sxb + h[:, None].to(tl.int64) * sxh + j[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
    dst = Y + si * sys + bi * syb + h[:, None].to(tl.int64) * syh + j[None, :]
    tl.store(dst, _rounded(x1 * c - x2 * s, Y), mask=m)
    tl.store(dst + half, _rounded(x2 * c + x1 * s, Y), mask=m)


def _rope_apply(x, cos, sin, backward: bool):
    s, b, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((s, b, heads, d), dtype=x.dtype, device=x.device)
    if y.numel():
        launch_cached(_rope, (s * b,),
                      [x, cos, sin, y, b, heads, d // 2, *x.stride()[:3], *y.stride()[:3]],
                      x.device, dict(BACKWARD=backward,
                                     BLOCK_H=triton.next_power_of_2(heads),
                                     BLOCK_D=triton.next_power_of_2(d // 2)))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        _check("rope", x)
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(f"rope: x must be [s, b, heads, d] with d even, got "
                             f"{tuple(x.shape)}")
        s, d = x.shape[0], x.shape[-1]
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (s, d // 2) or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"rope: {name} must be a contiguous fp32 [{s}, {d // 2}] "
                                 f"(positions x d/2), got {t.dtype} {tuple(t.shape)}")
        ctx.save_for_backward(cos, sin)
        return _rope_apply(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_apply(dy, cos, sin, True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d] (any strides but a unit last one) rotated by position in the
    rotate-half layout, in fp32 and rounded once to x's dtype: the rotation model.apply_rope
    computes, to one rounding (compiled, the products and sums contract into fused
    multiply-adds). cos, sin: fp32 [s, d/2], the angles of positions 0..s-1
    (model.rope_tables)."""
    return _Rope.apply(x, cos, sin)


__all__ = ["rms_norm", "swiglu", "rope", "DTYPES"]

"""Optimizer-state formats and stochastic rounding (docs/design.md, "Precision").

State formats (one per optimizer, every state tensor of a weight [N, K] in the same format):
  fp32  plain fp32 [N, K].
  bf16  bf16 [N, K]; written with stochastic rounding when the optimizer rounds stochastically.
  int8  codes [N, K] + fp32 scales [N, ceil(K / 64)]: one scale per block of QBLOCK = 64
        consecutive elements along K (the paper's small blocks; bitsandbytes uses 2048).
        Both kinds store the square root of the magnitude (a companding code: the dynamic range
        in bits is halved, so small entries next to a large one in the same block keep
        resolution):
        * signed states (momentum, exp_avg, grad_avg): u = sign(x) sqrt(|x|) as int8 codes in
          [-127, 127], u = code * scale, scale = absmax(u) / 127; x = u |u|. Linear codes
          would store an entry below absmax / 254 of its block as 0: in an LLM, blocks along
          the input dimension mix outlier features with ordinary ones, and those weights would
          stop moving (qwen3-0.6b ends behind fp32 states: benchmarks/convergence.py).
        * nonnegative states (exp_avg_sq, square_avg, sum, max_exp_avg_sq): u = sqrt(x) as
          uint8 codes in [0, 255], scale = absmax(u) / 255, and a nonzero value is never stored
          as code 0 (the code is raised to 1): a denominator sqrt(v) + eps can therefore not
          collapse to eps while the true v is nonzero, which is what makes round-to-nearest
          linear absmax of v explode.
        Codes are rounded to nearest (see docs/precision.md for the measured alternatives).

Stochastic rounding of fp32 -> bf16: add 16 uniformly random bits below the bf16 mantissa, then
truncate. The result is one of the two bf16 neighbours of x, the upper one with probability equal
to the fraction of the gap x lies above the lower one, so E[SR(x)] = x (unbiased; tested).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from forge_engine.kernels import options
from forge_engine.kernels.launch import INTERPRET

QBLOCK = 64
FORMATS = ("fp32", "bf16", "int8")
FMT_ID = {"fp32": 0, "bf16": 1, "int8": 2}


# --------------------------------------------------------------------------------- torch side

def sr_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stochastically round an fp32 tensor to bf16."""
    x = x.float().contiguous()
    r = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32,
                      device=x.device)
    bits = (x.view(torch.int32) + r) & -65536  # -65536 == 0xFFFF0000 as int32
    y = bits.view(torch.float32)
    # NaN/inf and values that would carry into inf keep round-to-nearest semantics
    y = torch.where(torch.isfinite(x) & torch.isfinite(y), y, x)
    return y.to(torch.bfloat16)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, nblk, QBLOCK], zero padded along K."""
    n, k = x.shape
    nblk = -(-k // QBLOCK)
    pad = nblk * QBLOCK - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(n, nblk, QBLOCK)


def quantize(x: torch.Tensor, nonneg: bool):
    """fp32 [N, K] -> (codes [N, K] int8/uint8, scales [N, ceil(K/64)] fp32)."""
    n, k = x.shape
    b = _blocks(x.float())
    if nonneg:
        b = torch.sqrt(torch.clamp(b, min=0.0))
    else:  # signed square root: the companding code of signed states
        b = torch.sign(b) * torch.sqrt(b.abs())
    qmax = 255.0 if nonneg else 127.0
    # as the kernel (quant.store_state): one reciprocal per block, then products, so that the
    # compiled kernel's variants and the backends round alike
    scale = b.abs().amax(dim=2) * (1.0 / qmax)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    c = b * (1.0 / safe)[:, :, None]
    # rounded to nearest, ties to even (torch.round; the kernels' round_codes: an fp32 add)
    if nonneg:
        c = torch.where(b > 0, torch.clamp(c, min=1.0), c)
        codes = torch.clamp(torch.round(c), 0, 255).to(torch.uint8)
    else:
        codes = torch.clamp(torch.round(c), -127, 127).to(torch.int8)
    return codes.view(n, -1)[:, :k].contiguous(), scale.contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, nonneg: bool) -> torch.Tensor:
    n, k = codes.shape
    b = _blocks(codes.float()) * scale[:, :, None]
    b = b * b if nonneg else b * b.abs()
    return b.view(n, -1)[:, :k]


class StateTensor:
    """One optimizer state of a fused weight, in its storage format.

    data: [N, K] fp32 / bf16 / int8 / uint8; scale: [N, ceil(K/64)] fp32 for int8, else None.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, nonneg: bool):
        self.data, self.scale, self.nonneg = data, scale, nonneg

    @classmethod
    def full(cls, shape, value: float, fmt: str, nonneg: bool, device) -> "StateTensor":
        """Every element `value`, built in the storage format directly (no fp32 tensor of the
        full shape: for an LM head that temporary alone is 2 GiB)."""
        n, k = shape
        if fmt == "int8":  # every row quantizes alike: one row, repeated
            codes, scale = quantize(torch.full((1, k), float(value), device=device), nonneg)
            return cls(codes.expand(n, k).contiguous(), scale.expand(n, -1).contiguous(), nonneg)
        if fmt not in FORMATS:
            raise ValueError(f"state format must be one of {FORMATS}, got {fmt!r}")
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        return cls(torch.full((n, k), float(value), dtype=dtype, device=device), None, nonneg)

    @classmethod
    def from_fp32(cls, x: torch.Tensor, fmt: str, nonneg: bool) -> "StateTensor":
        if fmt == "fp32":
            return cls(x.float().contiguous(), None, nonneg)
        if fmt == "bf16":
            return cls(x.to(torch.bfloat16).contiguous(), None, nonneg)
        if fmt == "int8":
            return cls(*quantize(x, nonneg), nonneg)
        raise ValueError(f"state format must be one of {FORMATS}, got {fmt!r}")

    def clone(self) -> "StateTensor":
        """A copy with its own storage (codes and scales for int8)."""
        return StateTensor(self.data.clone(), None if self.scale is None else self.scale.clone(),
                           self.nonneg)

    @property
    def fmt(self) -> str:
        if self.scale is not None:
            return "int8"
        return "bf16" if self.data.dtype == torch.bfloat16 else "fp32"

    def fp32(self, rows: slice = slice(None)) -> torch.Tensor:
        """The values of rows `rows` as fp32 (dequantized for int8)."""
        if self.scale is not None:
            return dequantize(self.data[rows], self.scale[rows], self.nonneg)
        return self.data[rows].float()

    def write(self, rows: slice, x: torch.Tensor, stochastic: bool,
              generator: torch.Generator | None = None):
        """Store fp32 values x into rows `rows` (whole rows: int8 blocks run along K)."""
        if self.scale is not None:
            self.data[rows], self.scale[rows] = quantize(x, self.nonneg)
        elif self.data.dtype == torch.bfloat16 and stochastic:
            self.data[rows] = sr_bf16(x, generator)
        else:
            self.data[rows] = x.to(self.data.dtype)


def clone_states(states: list) -> list:
    """A weight's state slots copied (StateTensor.clone), absent slots (None) kept."""
    return [None if s is None else s.clone() for s in states]


# -------------------------------------------------------------------------------- triton side

# The kernels' square roots (the rules' in kernels/rules.py, the int8 codes' here):
# sqrt.approx.ftz.f32, at most 1 ulp from the IEEE result on sm_52 and newer (the CUDA C++
# Programming Guide's table of single-precision functions; tests/test_gpu.py checks it on the
# card; subnormal inputs give 0), as the division is approximate too (div). The IEEE sqrt.rn has
# a special-case branch (a call per element in the SASS) that splits the epilogue into basic
# blocks: 4 to 13% of the kernel's time on the H200 (benchmarks/bench_kernel.py run with
# FORGE_FAST_SQRT=0 and =1). FORGE_FAST_SQRT=0 (options.Options.fast_sqrt, read at import)
# restores sqrt.rn.
_FAST_SQRT = tl.constexpr(options.read("fast_sqrt"))


@triton.jit
def sqrt(x):
    if _FAST_SQRT:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


# The rules' divisions by a denominator sqrt(v) + eps: div.approx.f32 (a reciprocal, then a
# product) instead of Triton's `/`, div.full.f32, which adds a range test and a rescaling per
# element for denominators above 2^126. Both are within 2 ulp of the quotient for denominators
# in [2^-126, 2^126] (PTX ISA, div); sqrt(v) + eps is never above 2^64 for finite fp32 v, and
# a zero denominator gives inf or NaN with both. The interpreter keeps `/` (no extern calls
# there); FORGE_FAST_DIV=0 (options.Options.fast_div, read at import) restores div.full.f32.
_FAST_DIV = tl.constexpr(options.read("fast_div") and not INTERPRET)


@triton.jit
def div(x, y):
    if _FAST_DIV:
        return libdevice.fast_dividef(x, y)
    else:
        return x / y


BF16_MAX = tl.constexpr(3.3895313892515355e38)  # the largest finite bf16 (0x7F7F0000 as fp32)


@triton.jit
def _bits_to_bf16(x, bits):
    """bf16 of the fp32 value with bit pattern `bits` (x's bits plus at most 0xFFFF, low 16
    bits then cleared, so the final cast is exact under any rounding mode). For |x| <= BF16_MAX
    the sum stays at most 0x7F7FFFFF: finite. Anything else (NaN, whose bits can wrap to -0.0;
    inf; a finite x beyond the bf16 range) keeps x's own cast, which the one compare sends
    there: NaN fails it."""
    y = bits.to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) <= BF16_MAX, y, x).to(tl.bfloat16)


@triton.jit
def hash_u32(x):
    """A 32-bit integer hash (Wellons' "lowbias32": xor-shift-multiply, full avalanche), used
    as the random stream of stochastic rounding: a few integer ops per element instead of a
    Philox round sequence, and only one tile of random bits alive at a time."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def random_u32(seed, draws, stream: tl.constexpr):
    """Uniform uint32 bits for the draw indices `draws` (draw_index) of rounding stream
    `stream` under `seed`: stream 0 rounds the weight, streams 1, 2, 3 states 0, 1, 2."""
    key = hash_u32(hash_u32(seed.to(tl.uint32)) + stream)
    return hash_u32(draws.to(tl.uint32) ^ key)


@triton.jit
def draw_index(n, k, K):
    """The draw index of elements (n, k) of an [N, K] weight, rows n [R] by columns k [C]
    (integer tensors): one draw per pair of adjacent columns of a row, n ceil(K / 2) + k // 2,
    in uint32 arithmetic (past 2^32 pairs it wraps; the bits stay deterministic)."""
    # (K + 1) // 2 stays a scalar as it comes (uint32 times int32 is uint32): Triton makes an
    # int argument equal to 1 a constexpr, which has no .to()
    return n.to(tl.uint32)[:, None] * ((K + 1) // 2) + (k.to(tl.uint32) >> 1)[None, :]


@triton.jit
def random_pairs(seed, draws, stream: tl.constexpr):
    """The 16 random bits (as uint32) of each element of an [R, C] tile for one stochastic
    rounding (stream: random_u32), given its draw indices (draw_index) and a tile whose first
    column is even and whose width C is even, so that it holds whole column pairs: one hash
    per pair (lowbias32's full avalanche reaches both halves of its output), the low half to
    the even column, the high half to the odd one: half a hash per rounding, where one hash
    per element would be two per pair."""
    R: tl.constexpr = draws.shape[0]
    C: tl.constexpr = draws.shape[1]
    even, _ = tl.split(tl.reshape(draws, (R, C // 2, 2)))
    r = random_u32(seed, even, stream)
    return tl.reshape(tl.join(r & 0xFFFF, r >> 16), (R, C))


@triton.jit
def sr_to_bf16(x, r):
    """fp32 tile x, uint32 random tile r -> bf16 tile rounded stochastically (the low 16 bits
    of r are the random bits)."""
    bits = x.to(tl.uint32, bitcast=True)
    return _bits_to_bf16(x, (bits + (r & 0xFFFF)) & 0xFFFF0000)


@triton.jit
def to_bf16_rn(x):
    """fp32 -> bf16, round to nearest even, in integer arithmetic. Not x.to(tl.bfloat16):
    Triton 3.6's interpreter truncates there, and its "rtne" mode loses the mantissa carry."""
    bits = x.to(tl.uint32, bitcast=True)
    return _bits_to_bf16(x, (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000)


@triton.jit
def code_values(codes, NONNEG: tl.constexpr):
    """int8 / uint8 codes (either viewed as int8) -> their values as fp32, exactly. A uint8
    code widened to int32 converts by I2FP; a signed one would compile to I2F of an 8 or
    16-bit source, which shares the 16-per-clock pipe with the square roots: instead its byte,
    offset by 128 (top bit flipped), goes into the low bits of 2^23's fp32 pattern, and
    2^23 + 128 is subtracted (an integer op and an add)."""
    b = codes.to(tl.uint8, bitcast=True).to(tl.int32)
    if NONNEG:
        return b.to(tl.float32)
    else:
        return ((b ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def load_state(s_ptr, q_ptr, offs, mask, rmask, offs_n, blk0, nblk,
               FMT: tl.constexpr, NONNEG: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, QB: tl.constexpr):
    """Load a [BLOCK_N, BLOCK_K] state tile as fp32 (dequantizing int8 blocks).
    offs: int64 element offsets [BLOCK_N, BLOCK_K]; mask: elements in bounds; rmask: rows
    in bounds [BLOCK_N]; offs_n: row indices (int64); blk0: the scale column of the tile's first
    QB-block; nblk: scale columns."""
    if FMT == 2:
        codes = code_values(tl.load(s_ptr + offs, mask=mask, other=0), NONNEG)
        if BLOCK_K == QB:  # one block per row: no [BLOCK_N, NB, QB] relayout
            scale = tl.load(q_ptr + offs_n * nblk + blk0, mask=rmask & (blk0 < nblk),
                            other=0.0)
            u = codes * scale[:, None]
        else:
            NB: tl.constexpr = BLOCK_K // QB
            offs_b = blk0 + tl.arange(0, NB)
            qmask = rmask[:, None] & (offs_b[None, :] < nblk)
            scale = tl.load(q_ptr + offs_n[:, None] * nblk + offs_b[None, :], mask=qmask,
                            other=0.0)
            u = tl.reshape(tl.reshape(codes, (BLOCK_N, NB, QB)) * scale[:, :, None],
                           (BLOCK_N, BLOCK_K))
        return expand(u, NONNEG)
    else:
        return tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def expand(u, NONNEG: tl.constexpr):
    """Companded values u = code * scale -> the state: u^2 (nonnegative), u |u| (signed)."""
    if NONNEG:
        return u * u
    else:
        return u * tl.abs(u)


@triton.jit
def compand(x, NONNEG: tl.constexpr):
    """State values -> their square-root companded values (see the module docstring). A
    nonnegative state's is sqrt(x) itself, the same value as the rules' sqrt(v) (one square
    root for both once the compiler merges them; the rules never make v negative). The signed
    root takes x's sign bit by a bitwise or (one LOP3, not a compare and a select)."""
    if NONNEG:
        return sqrt(x)
    else:
        r = sqrt(tl.abs(x)).to(tl.int32, bitcast=True)
        return (r | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def block_codes(u, NONNEG: tl.constexpr):
    """Companded values u, one QB-block along the last axis -> (codes, the blocks' scales):
    absmax scaling per block, codes rounded to nearest (round_codes)."""
    qmax: tl.constexpr = 255.0 if NONNEG else 127.0
    scale = tl.max(tl.abs(u), axis=-1) * (1.0 / qmax)
    c = u * tl.expand_dims(1.0 / tl.where(scale > 0, scale, 1.0), -1)
    return round_codes(c, u > 0, NONNEG), scale


@triton.jit
def round_codes(c, positive, NONNEG: tl.constexpr):
    """Scaled values c -> int8 / uint8 codes, rounded to nearest, ties to even (torch.round,
    as quantize() computes them); a positive nonnegative-state value never becomes code 0.
    The rounding is an fp32 add's: c + 1.5 * 2^23 (signed c) or c + 2^23 (c >= 0) lies in
    [2^23, 2^24), where the ulp is 1, so the sum's low byte is the code (two's complement for a
    negative c): no float-to-int conversion (F2I, which shares the 16-per-clock pipe with the
    square roots) and no clamps. Needs |c| < qmax + 0.5, which block_codes' c meets: at most
    qmax (1 + a few ulp), the block's absmax times the reciprocal of absmax / qmax."""
    if NONNEG:  # a compile-time branch: one return, of the branch's code type
        c = tl.where(positive, tl.maximum(c, 1.0), c)
        codes = (c + 8388608.0).to(tl.int32, bitcast=True).to(tl.uint8)
    else:
        codes = (c + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
    return codes


@triton.jit
def store_state(s_ptr, q_ptr, x, offs, mask, rmask, offs_n, blk0, nblk, rbits,
                FMT: tl.constexpr, NONNEG: tl.constexpr, STOCHASTIC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QB: tl.constexpr):
    """Store an fp32 state tile in its format (int8: quantize per QB-block along K).
    mask / rmask already exclude a tile that must not be written (non-finite gradient);
    rbits: the random bits of stochastic rounding (bf16 states; low 16 bits used)."""
    if FMT == 2:
        u = tl.where(mask, compand(x, NONNEG), 0.0)
        if BLOCK_K == QB:  # one block per row: a row reduction, no [BLOCK_N, NB, QB] relayout
            codes, scale = block_codes(u, NONNEG)
            tl.store(s_ptr + offs, codes, mask=mask)
            # a part wholly right of K has no scale column (blk0 == nblk is the next row's)
            tl.store(q_ptr + offs_n * nblk + blk0, scale, mask=rmask & (blk0 < nblk))
        else:
            NB: tl.constexpr = BLOCK_K // QB
            codes, scale = block_codes(tl.reshape(u, (BLOCK_N, NB, QB)), NONNEG)
            tl.store(s_ptr + offs, tl.reshape(codes, (BLOCK_N, BLOCK_K)), mask=mask)
            offs_b = blk0 + tl.arange(0, NB)
            qmask = rmask[:, None] & (offs_b[None, :] < nblk)
            tl.store(q_ptr + offs_n[:, None] * nblk + offs_b[None, :], scale, mask=qmask)
    elif FMT == 1:
        if STOCHASTIC:
            tl.store(s_ptr + offs, sr_to_bf16(x, rbits), mask=mask)
        else:
            tl.store(s_ptr + offs, to_bf16_rn(x), mask=mask)
    else:
        tl.store(s_ptr + offs, x, mask=mask)

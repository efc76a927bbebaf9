"""The FORGE kernel: weight gradient accumulated in registers, optimizer applied to the tile.

For a linear Y = X W^T with W [N, K] and T tokens (docs/design.md, "The identity"):
    dW[n, k] = sum_t dY[t, n] * X[t, k]
Each program owns one [BLOCK_N x BLOCK_K] tile of W. It walks the token axis in BLOCK_T steps,
accumulating dY_tile^T X_tile in fp32 registers, then loads the W tile and its optimizer-state
tiles, applies the element-wise rule (forge_engine/kernels/rules.py) in fp32 and writes W and the
states back. The gradient tile never leaves registers. The squared norm of each gradient tile is
added to a per-step scalar, and a tile whose gradient is not finite is not written at all.

Options (the config dict): the token tiles come through tensor descriptors (DESC) where the
operands allow; the epilogue may walk the tile in column parts (EPI_SPLIT); PERSISTENT (opt-in,
untimed) runs about one program per SM over many tiles. benchmarks/bench_kernel.py times them.

Layout: _fused_wgrad_update_kernel -> fused_wgrad_update() (checks, grid) ; the
torch reference of the same math is forge_engine/kernels/reference.py.
"""
from __future__ import annotations

import operator
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from forge_engine.kernels import norm_hp, norm_parts, options
from forge_engine.kernels.launch import INTERPRET, BoundLaunch, TensorDescriptor, \
    cuda_properties, descriptor, launch_cached, persistent_programs, step_seed, tile_order
from forge_engine.kernels.quant import FMT_ID, QBLOCK, StateTensor, draw_index, load_state, \
    random_pairs, sr_to_bf16, store_state, to_bf16_rn
from forge_engine.kernels.rules import HP_LEN, RuleSpec, apply_rule, norm_factor

# The routing switches (options.Options.ws, .ws_large, .ws_split), read at import so that a
# launch does not ask os.environ (tests patch these three names), and read again when
# options.apply sets them (read_routing). FORGE_WS: which updates take the warp-specialized
# kernel (fused_ws.py); under auto (the default) those its split design can take with more than
# WS_AUTO_TOKENS tokens, on CUDA and with no explicit config, at fused_ws.SPLIT_LARGE (W and the
# states from and to global memory, the shared memory left to a deep token ring), the fastest of
# the kernels there on the H200 with bf16 and int8 states (benchmarks/bench_kernel.py).
# FORGE_WS_LARGE: a config that replaces SPLIT_LARGE (experiments). FORGE_WS_SPLIT: under auto,
# whether updates with at most WS_AUTO_TOKENS tokens go to the split design at
# fused_ws.SPLIT_DEFAULT (the epilogue on warps of its own, W and the states staged by TMA;
# bitwise the Triton kernel's results); auto and 1: all it can take, eager and captured into
# a CUDA graph, where it takes less device time than the Triton kernel for no more host time
# a launch (docs/performance.md, "The eager step's kernels"; benchmarks/bench_step.py,
# graphed); 0: none (the Triton kernel).
WS_AUTO_TOKENS = 1024


def read_routing():
    """Set the routing switches as the environment sets them now."""
    global _WS_FLAG, _WS_LARGE, _WS_SPLIT
    _WS_FLAG, _WS_LARGE, _WS_SPLIT = \
        options.read("ws"), options.read("ws_large"), options.read("ws_split")


read_routing()


def split_route(T: int) -> dict:
    """The warp-specialized config the auto route (FORGE_WS=auto) gives an update of T tokens
    that it sends to the split design: SPLIT_LARGE (or FORGE_WS_LARGE's config) above
    WS_AUTO_TOKENS tokens, else SPLIT_DEFAULT (the split design's own defaults)."""
    if T > WS_AUTO_TOKENS:
        from forge_engine.kernels.fused_ws import SPLIT_LARGE  # (Gluon: only where taken)
        return {"SPLIT": True, **(SPLIT_LARGE if _WS_LARGE is None else _WS_LARGE)}
    return {"SPLIT": True}


@triton.jit
def _halves(a, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK_N, 2 HALF] -> its column halves [BLOCK_N, HALF]: columns [0, HALF), [HALF, 2 HALF)."""
    return tl.split(tl.permute(tl.reshape(a, (BLOCK_N, 2, HALF)), (0, 2, 1)))


@triton.jit
def _update_tile(g, k0, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                 s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk, seed,
                 KIND: tl.constexpr, VARIANT: tl.constexpr,
                 HAS0: tl.constexpr, HAS1: tl.constexpr, HAS2: tl.constexpr,
                 NN0: tl.constexpr, NN1: tl.constexpr, NN2: tl.constexpr,
                 STATE_FMT: tl.constexpr, W_SR: tl.constexpr, S_SR: tl.constexpr,
                 W_BF16: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr,
                 QB: tl.constexpr):
    """Apply the rule to the gradient tile g [BLOCK_N, WIDTH] of columns [k0, k0 + WIDTH):
    load W and the state tiles, step in fp32, store; sq: the whole tile's squared gradient
    norm (inf or NaN: nothing of the tile is written). W and the states move by pointers,
    which is faster on the H200 than moving them through tensor descriptors too."""
    finite = (tl.zeros((BLOCK_N,), dtype=tl.float32) + sq) < float("inf")  # row form
    offs_k = (k0 + tl.arange(0, WIDTH)).to(tl.int64)
    kmask = offs_k < K
    rmask = nmask & finite  # row mask form [BLOCK_N]
    mask = rmask[:, None] & kmask[None, :]
    blk0 = k0 // QB  # the scale column of this tile's first int8 block
    w_offs = offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    s_offs = offs_n[:, None] * K + offs_k[None, :]
    w = tl.load(w_ptr + w_offs, mask=mask, other=0.0).to(tl.float32)
    s0 = tl.zeros((BLOCK_N, WIDTH), dtype=tl.float32)
    s1 = tl.zeros((BLOCK_N, WIDTH), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_N, WIDTH), dtype=tl.float32)
    if HAS0:
        s0 = load_state(s0_ptr, q0_ptr, s_offs, mask, rmask, offs_n, blk0, nblk,
                        STATE_FMT, NN0, BLOCK_N, WIDTH, QB)
    if HAS1:
        s1 = load_state(s1_ptr, q1_ptr, s_offs, mask, rmask, offs_n, blk0, nblk,
                        STATE_FMT, NN1, BLOCK_N, WIDTH, QB)
    if HAS2:
        s2 = load_state(s2_ptr, q2_ptr, s_offs, mask, rmask, offs_n, blk0, nblk,
                        STATE_FMT, NN2, BLOCK_N, WIDTH, QB)

    w, s0, s1, s2 = apply_rule(w, g, s0, s1, s2, hp_ptr, KIND, VARIANT)

    # random bits are drawn right before the stores that need them, one hash per column pair
    # and rounding (quant.random_pairs: k0 and WIDTH are even; a draw nothing uses is not
    # compiled)
    draws = draw_index(offs_n, offs_k, K)
    if W_SR:
        tl.store(w_ptr + w_offs, sr_to_bf16(w, random_pairs(seed, draws, 0)), mask=mask)
    elif W_BF16:
        tl.store(w_ptr + w_offs, to_bf16_rn(w), mask=mask)
    else:
        tl.store(w_ptr + w_offs, w, mask=mask)
    if HAS0:
        store_state(s0_ptr, q0_ptr, s0, s_offs, mask, rmask, offs_n, blk0, nblk,
                    random_pairs(seed, draws, 1), STATE_FMT, NN0, S_SR, BLOCK_N, WIDTH, QB)
    if HAS1:
        store_state(s1_ptr, q1_ptr, s1, s_offs, mask, rmask, offs_n, blk0, nblk,
                    random_pairs(seed, draws, 2), STATE_FMT, NN1, S_SR, BLOCK_N, WIDTH, QB)
    if HAS2:
        store_state(s2_ptr, q2_ptr, s2, s_offs, mask, rmask, offs_n, blk0, nblk,
                    random_pairs(seed, draws, 3), STATE_FMT, NN2, S_SR, BLOCK_N, WIDTH, QB)


@triton.jit
def _update_halves(a, k0, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                   s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk, seed,
                   KIND: tl.constexpr, VARIANT: tl.constexpr,
                   HAS0: tl.constexpr, HAS1: tl.constexpr, HAS2: tl.constexpr,
                   NN0: tl.constexpr, NN1: tl.constexpr, NN2: tl.constexpr,
                   STATE_FMT: tl.constexpr, W_SR: tl.constexpr, S_SR: tl.constexpr,
                   W_BF16: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr,
                   QB: tl.constexpr):
    """_update_tile on the two column halves of a [BLOCK_N, WIDTH] (columns from k0), one
    after the other."""
    HALF: tl.constexpr = WIDTH // 2
    a0, a1 = _halves(a, BLOCK_N, HALF)
    _update_tile(a0, k0, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                 s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk, seed,
                 KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT, W_SR, S_SR,
                 W_BF16, BLOCK_N, HALF, QB)
    _update_tile(a1, k0 + HALF, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                 s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk, seed,
                 KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT, W_SR, S_SR,
                 W_BF16, BLOCK_N, HALF, QB)


@triton.jit
def _finish_tile(acc, pid_n, pid_k, N, K, nblk, w_ptr, stride_wn, stride_wk,
                 s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, sumsq_ptr, seed,
                 KIND: tl.constexpr, VARIANT: tl.constexpr,
                 HAS0: tl.constexpr, HAS1: tl.constexpr, HAS2: tl.constexpr,
                 NN0: tl.constexpr, NN1: tl.constexpr, NN2: tl.constexpr,
                 STATE_FMT: tl.constexpr, W_SR: tl.constexpr, S_SR: tl.constexpr,
                 W_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 QB: tl.constexpr, NORM_ONLY: tl.constexpr, EPI_SPLIT: tl.constexpr):
    """The gradient tile acc [BLOCK_N, BLOCK_K] of tile (pid_n, pid_k) is complete: add the
    squared norm of the gradient the rule applies, hp[GRAD_SCALE] * acc, to sumsq, and apply
    the optimizer to it, whole or in EPI_SPLIT column parts one after another (a smaller live
    set of tiles). NORM_ONLY (the clipping pre-pass): only store the squared norm of acc
    itself, in the tile's own slot sumsq[pid_n * tiles along K + pid_k], which the host sums
    in order: atomic adds arrive in any order, and the clip factor, which this norm decides,
    would differ in the last bit from run to run."""
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = offs_n < N
    sq = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
    if NORM_ONLY:
        tl.store(sumsq_ptr + pid_n * tl.cdiv(K, BLOCK_K) + pid_k, sq)
    else:
        # read after the kernel: no fence
        tl.atomic_add(sumsq_ptr, sq * norm_factor(hp_ptr), sem="relaxed")
        k0 = pid_k * BLOCK_K
        if EPI_SPLIT == 1:
            _update_tile(acc, k0, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                         s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk, seed,
                         KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT, W_SR, S_SR,
                         W_BF16, BLOCK_N, BLOCK_K, QB)
        elif EPI_SPLIT == 2:
            _update_halves(acc, k0, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                           s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk,
                           seed, KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT,
                           W_SR, S_SR, W_BF16, BLOCK_N, BLOCK_K, QB)
        else:  # quarters: the halves of each half
            HALF: tl.constexpr = BLOCK_K // 2
            a0, a1 = _halves(acc, BLOCK_N, HALF)
            _update_halves(a0, k0, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                           s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk,
                           seed, KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT,
                           W_SR, S_SR, W_BF16, BLOCK_N, HALF, QB)
            _update_halves(a1, k0 + HALF, offs_n, nmask, sq, w_ptr, stride_wn, stride_wk,
                           s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, K, nblk,
                           seed, KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT,
                           W_SR, S_SR, W_BF16, BLOCK_N, HALF, QB)


@triton.jit
def _persistent(x_desc, dy_desc, w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr,
                sumsq_ptr, T, N, K, nblk, stride_wn, stride_wk, seed,
                KIND: tl.constexpr, VARIANT: tl.constexpr,
                HAS0: tl.constexpr, HAS1: tl.constexpr, HAS2: tl.constexpr,
                NN0: tl.constexpr, NN1: tl.constexpr, NN2: tl.constexpr,
                STATE_FMT: tl.constexpr, W_SR: tl.constexpr, S_SR: tl.constexpr,
                DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                QB: tl.constexpr, NORM_ONLY: tl.constexpr, EPI_SPLIT: tl.constexpr,
                W_BF16: tl.constexpr):
    """A persistent program: tiles pid, pid + P, pid + 2P, ... (P programs, about one per SM),
    with the tile loop and the token loop flattened into one loop, so that Triton's software
    pipeliner can issue the next tile's first token-tile loads before this tile's epilogue
    (the epilogue under the token loop). Dense segment only, token tiles by descriptors."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    k_steps = tl.cdiv(T, BLOCK_T)
    my_tiles = tl.cdiv(num_n * num_k - pid, nprog)
    tile = pid - nprog
    ki = -1
    pid_n = 0
    pid_k = 0
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in tl.range(0, k_steps * my_tiles, flatten=True):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            tile += nprog
            pid_n, pid_k = tile_order(tile, num_n, num_k, GROUP_N)
        dy = dy_desc.load([ki * BLOCK_T, pid_n * BLOCK_N])  # [BT, BN]
        x = x_desc.load([ki * BLOCK_T, pid_k * BLOCK_K])  # [BT, BK]
        if UPCAST:
            dy = dy.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=DOT_PRECISION)
        if ki == k_steps - 1:
            _finish_tile(acc, pid_n, pid_k, N, K, nblk, w_ptr, stride_wn, stride_wk,
                         s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, sumsq_ptr,
                         seed, KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT,
                         W_SR, S_SR, W_BF16, BLOCK_N, BLOCK_K, QB, NORM_ONLY, EPI_SPLIT)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit(do_not_specialize=["seed"])
def _fused_wgrad_update_kernel(
    x_ptr, dy_ptr, ids_ptr, e_ptr, g_ptr, w_ptr,
    s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
    hp_ptr, sumsq_ptr,
    T, T1, N, K, nblk,
    stride_xt, stride_xk, stride_dt, stride_dn, stride_et, stride_ek, stride_gn, stride_gk,
    stride_wn, stride_wk,
    seed,
    # Meta-parameters
    KIND: tl.constexpr, VARIANT: tl.constexpr,
    HAS0: tl.constexpr, HAS1: tl.constexpr, HAS2: tl.constexpr,
    NN0: tl.constexpr, NN1: tl.constexpr, NN2: tl.constexpr,
    STATE_FMT: tl.constexpr, W_SR: tl.constexpr, S_SR: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr, QB: tl.constexpr, NORM_ONLY: tl.constexpr, HAS_ONEHOT: tl.constexpr,
    HAS_G: tl.constexpr, DESC: tl.constexpr, EPI_SPLIT: tl.constexpr, W_BF16: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # x [T, K] ; dy [T, N] (DESC: tensor descriptors of them, blocks [BLOCK_T, BLOCK_K] and
    # [BLOCK_T, BLOCK_N], zero-filled out of bounds: the copy engine loads the token tiles and
    # no per-element pointers live in registers) ; one-hot segment: ids [T1] (row of W, or -1),
    # e [T1, K], meaning dW[n] += sum_t [ids[t] == n] e[t] (an embedding lookup's gradient),
    # ids_ptr then holds onehot_index(ids) [2 T1 + num_n + 1] ;
    # w [N, K] (any strides) ; states [N, K] contiguous ;
    # scales [N, nblk] contiguous (int8 only) ; hp [HP_LEN] fp32 (hp[HP_SEED]: int32 bits) ;
    # sumsq [1] fp32 (NORM_ONLY: [tiles], one slot per tile)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    seed = step_seed(seed, hp_ptr)
    if PERSISTENT:  # dense segment by descriptors only (the host checks): see _persistent
        _persistent(x_ptr, dy_ptr, w_ptr, s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr,
                    hp_ptr, sumsq_ptr, T, N, K, nblk, stride_wn, stride_wk, seed, KIND,
                    VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT, W_SR, S_SR,
                    DOT_PRECISION, UPCAST, BLOCK_T, BLOCK_N, BLOCK_K, GROUP_N, QB, NORM_ONLY,
                    EPI_SPLIT, W_BF16)
        return
    pid_n, pid_k = tile_order(pid, num_n, num_k, GROUP_N)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T).to(tl.int64)
    nmask = offs_n < N
    kmask = offs_k < K

    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        if DESC:
            dy = dy_ptr.load([t0, pid_n * BLOCK_N])  # [BT, BN]
            x = x_ptr.load([t0, pid_k * BLOCK_K])  # [BT, BK]
        else:
            t = t0 + offs_t
            tmask = t < T
            dy = tl.load(dy_ptr + t[:, None] * stride_dt + offs_n[None, :] * stride_dn,
                         mask=tmask[:, None] & nmask[None, :], other=0.0)  # [BT, BN]
            x = tl.load(x_ptr + t[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                        mask=tmask[:, None] & kmask[None, :], other=0.0)  # [BT, BK]
        if UPCAST:  # interpreter only: its bf16 dot is wrong; bf16 products are exact in fp32
            dy = dy.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=DOT_PRECISION)
    if HAS_ONEHOT:  # the one-hot segment, generated in registers (never a [T1, N] tensor)
        # ids_ptr: onehot_index's [ids sorted | their tokens | row tiles' first positions]:
        # only this tile's tokens, in token order per row; a non-finite row of e reaches its
        # own token's row only, as the reference's index_add
        lo = tl.load(ids_ptr + 2 * T1 + pid_n)
        hi = tl.load(ids_ptr + 2 * T1 + pid_n + 1)
        for t0 in range(lo, hi, BLOCK_T):
            t = t0 + offs_t
            tmask = t < hi
            ids = tl.load(ids_ptr + t, mask=tmask, other=-1)
            tok = tl.load(ids_ptr + T1 + t, mask=tmask, other=0)
            e = tl.load(e_ptr + tok[:, None] * stride_et + offs_k[None, :] * stride_ek,
                        mask=tmask[:, None] & kmask[None, :], other=0.0)  # [BT, BK]
            if UPCAST:
                e = e.to(tl.float32)
            oh = (ids[:, None] == offs_n[None, :]).to(e.dtype)  # [BT, BN]
            acc = tl.dot(tl.trans(oh), e, acc, input_precision=DOT_PRECISION)
    if HAS_G:  # a materialized gradient (a reduce-scattered shard, an accumulation buffer:
        # fp32; a standard-path .grad: fp32 or the weight's bf16, widened exactly here)
        acc += tl.load(g_ptr + offs_n[:, None] * stride_gn + offs_k[None, :] * stride_gk,
                       mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)

    # ---- epilogue: the gradient tile `acc` is complete; apply the optimizer to it
    _finish_tile(acc, pid_n, pid_k, N, K, nblk, w_ptr, stride_wn, stride_wk,
                 s0_ptr, s1_ptr, s2_ptr, q0_ptr, q1_ptr, q2_ptr, hp_ptr, sumsq_ptr, seed,
                 KIND, VARIANT, HAS0, HAS1, HAS2, NN0, NN1, NN2, STATE_FMT, W_SR, S_SR, W_BF16,
                 BLOCK_N, BLOCK_K, QB, NORM_ONLY, EPI_SPLIT)


def tma_capable(t: torch.Tensor) -> bool:
    """Whether a 2-D operand can be loaded through a tensor descriptor: unit last stride, rows
    and base 16-byte aligned, and a device whose Triton lowers descriptors to the copy engine
    (Hopper or newer; the interpreter emulates them)."""
    if TensorDescriptor is None or t.dim() != 2 or t.stride(1) != 1 or t.shape[0] == 0:
        return False
    row = t.stride(0) * t.element_size()
    if t.stride(0) < t.shape[1] or row % 16 or t.data_ptr() % 16:
        return False
    if t.is_cuda:
        return cuda_properties(t.device).major >= 9
    return INTERPRET


def default_config(dtype: torch.dtype, T: int, N: int, K: int, state_fmt: str = "bf16",
                   dense: bool = True) -> dict:
    """Tile configuration by operand precision, token count and state format, the fastest of
    benchmarks/sweep_kernel.py's sweeps on the H200. EPI_SPLIT 2: the epilogue walks
    the tile in two column halves of 64 (one int8 block per row each); the token tiles come
    through tensor descriptors wherever tma_capable() allows. Under TRITON_INTERPRET small
    tiles keep the interpreter fast.
    dense=False (no dense segment: an embedding's one-hot segment, a materialized gradient
    such as a norm weight's): the kernel is a stream of W and its states with few or no token
    products, and flat tiles of 16 rows are about twice as fast on the H200 as the dense ones
    (Llama-3.1-8B's embedding and norm weights: benchmarks/bench_embedding.py)."""
    if INTERPRET:
        return dict(BLOCK_T=32, BLOCK_N=32, BLOCK_K=64, GROUP_N=4, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_T=32, BLOCK_N=64, BLOCK_K=64, GROUP_N=8, num_warps=4, num_stages=3)
    if not dense:
        return dict(BLOCK_T=16, BLOCK_N=16, BLOCK_K=256, GROUP_N=8, num_warps=4, num_stages=1,
                    EPI_SPLIT=2)
    if T <= 1024 and state_fmt == "int8":
        # int8's epilogue is latency-bound: capped at 168 registers (a few spills per thread:
        # kernels/ptxas_report.py), three programs share an SM on the bf16 tiles, faster than
        # uncapped or on 32-row tiles (fc1 at T = 512 on the H200: benchmarks/sweep_kernel.py)
        return dict(BLOCK_T=64, BLOCK_N=64, BLOCK_K=128, GROUP_N=8, num_warps=4, num_stages=3,
                    EPI_SPLIT=2, maxnreg=168)
    if T <= 1024:  # few tokens: the epilogue dominates; smaller tiles are faster at T = 512
        return dict(BLOCK_T=64, BLOCK_N=64, BLOCK_K=128, GROUP_N=8, num_warps=4, num_stages=3,
                    EPI_SPLIT=2)
    return dict(BLOCK_T=64, BLOCK_N=128, BLOCK_K=128, GROUP_N=8, num_warps=8, num_stages=4,
                EPI_SPLIT=2)


def fused_wgrad_update(x: torch.Tensor | None, dy: torch.Tensor | None, w: torch.Tensor,
                       states: list, spec: RuleSpec, hp: torch.Tensor, sumsq: torch.Tensor,
                       seed: int, stochastic: bool, config: dict | None = None,
                       norm_only: bool = False, onehot=None, grad=None) -> None:
    """Update w [N, K] in place with the optimizer step for the gradient dy^T x.

    x: [T, K], dy: [T, N] (same dtype as w: fp32 or bf16); states: 3 slots, each a StateTensor
    [N, K] or None (spec.slots says which); hp: fp32 [HP_LEN] on w's device, whose hp[HP_SEED]
    holds the step's seed offset as int32 bits (rules.set_seed_bits; the random bits follow
    (seed + offset) mod 2**31); sumsq: fp32 [1], the squared norm of the gradient the rule
    applies, hp[GRAD_SCALE] times dy^T x, is added to it. stochastic: round bf16 writes
    stochastically.
    norm_only: only add the squared norm of dy^T x to sumsq; write nothing (clipping pre-pass;
    its tiles' parts are summed in one order: the same norm on every run).
    onehot: None or (ids [T1] int64, e [T1, K]): adds the segment onehot(ids)^T e to the
    gradient (an embedding's); x and dy may then be None (no dense segment).
    grad: None or a materialized [N, K] gradient added as it is, fp32 or w's dtype (a bf16
    .grad is widened in the kernel, exactly: no fp32 copy of it first).
    config: None (default_config) or a dict of BLOCK_T, BLOCK_N, BLOCK_K, GROUP_N, num_warps,
    num_stages, and optionally EPI_SPLIT (1, 2 or 4 column parts for the epilogue; default 1),
    DESC (token tiles through tensor descriptors; default: wherever tma_capable allows) and
    PERSISTENT (one program per multiprocessor walking many tiles, the tile and token loops
    flattened; dense segment with DESC only; default off, not yet timed on a card).
    WS: take the warp-specialized Gluon kernel (fused_ws.py; the rest of the config is then
    its own: WS_DEFAULT's keys): True requires it (an update it cannot take is an error),
    False forbids it, absent follows FORGE_WS (read at import): auto (the default) takes its
    split design at fused_ws.SPLIT_LARGE where it applies for more than WS_AUTO_TOKENS tokens
    and no config was given (fewer tokens: FORGE_WS_SPLIT), 1 wherever it applies, 0
    nowhere.
    """
    built = _build(x, dy, w, states, spec, hp, sumsq, seed, stochastic, config, norm_only,
                   onehot, grad)
    if type(built) is not _Built:  # the warp-specialized kernel's (fused_ws.WSLaunch)
        built.launch()
        return
    _launch(built.grid, built.args, built.seed, w.device, built.consts)
    if norm_only:
        sumsq += built.parts.sum()


class _Built(NamedTuple):
    """A launch of _fused_wgrad_update_kernel, checked and laid out by _build."""
    grid: tuple
    args: list
    seed: int
    consts: dict
    parts: torch.Tensor  # where the kernel adds the squared norm (norm_only: per tile)
    blocks: dict  # position in args of a tensor descriptor -> its block


def _build(x, dy, w, states, spec, hp, sumsq, seed, stochastic, config, norm_only, onehot,
           grad):
    """fused_wgrad_update's checks and routing, and the launch laid out: the Triton
    kernel's (_Built) or, where the route is the warp-specialized kernel, its
    fused_ws.WSLaunch. Nothing is launched."""
    N, K = w.shape
    if x is None:  # no dense segment: an empty one
        x, dy = w.new_empty((0, K)), w.new_empty((0, N))
    T = x.shape[0]
    if tuple(dy.shape) != (T, N) or tuple(x.shape) != (T, K) or w.dim() != 2:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, dy {tuple(dy.shape)}, "
                         f"w {tuple(w.shape)}; need x [T, K], dy [T, N], w [N, K]")
    if not (x.dtype == dy.dtype == w.dtype) or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x, dy and w must share one dtype, fp32 or bf16: got {x.dtype}, "
                         f"{dy.dtype}, {w.dtype}")
    if hp.dtype != torch.float32 or hp.numel() != HP_LEN or not hp.is_contiguous() \
            or sumsq.dtype != torch.float32:
        raise ValueError(f"hp must be a contiguous fp32 [{HP_LEN}] and sumsq fp32 [1], got hp "
                         f"{hp.dtype} {tuple(hp.shape)}, sumsq {sumsq.dtype}")
    present = spec.present
    if [st is not None for st in states] != present:
        raise ValueError(f"states do not match the rule's slots {spec.slots}")
    fmts = {st.fmt for st in states if st is not None}
    if len(fmts) > 1:
        raise ValueError(f"all states of one weight share one format, got {fmts}")
    fmt = fmts.pop() if fmts else "fp32"
    for st in states:
        if st is not None and (tuple(st.data.shape) != (N, K) or not st.data.is_contiguous()):
            raise ValueError(f"state must be contiguous [N, K] = [{N}, {K}]")
    ids, e = onehot if onehot is not None else (None, None)
    if e is not None and (e.shape != (ids.shape[0], K) or e.dtype != w.dtype
                          or ids.dtype != torch.int64 or ids.dim() != 1):
        raise ValueError(f"one-hot segment: need ids int64 [T1] and e {w.dtype} [T1, {K}], got "
                         f"ids {ids.dtype} {tuple(ids.shape)}, e {e.dtype} {tuple(e.shape)}")
    if grad is not None and (grad.shape != (N, K) or grad.dtype not in (torch.float32, w.dtype)):
        raise ValueError(f"grad must be [{N}, {K}] in fp32 or w's {w.dtype}, got {grad.dtype} "
                         f"{tuple(grad.shape)}")
    T1 = 0 if ids is None else ids.shape[0]
    ws = (config or {}).get("WS")
    ws_config = None  # the warp-specialized kernel's config chosen here (FORGE_WS=auto)
    if ws is None:  # FORGE_WS decides (an explicit config is the Triton kernel's under auto)
        auto = _WS_FLAG == "auto" and config is None and w.is_cuda
        if auto and (T > WS_AUTO_TOKENS or _WS_SPLIT != "0"):
            ws_config = split_route(T)
        ws = _WS_FLAG == "1" or ws_config is not None
    if ws:  # the warp-specialized Gluon kernel (fused_ws.py), where it applies
        from forge_engine.kernels.fused_ws import fused_wgrad_update_ws, ws_eligible
        wcfg = ws_config or {k: v for k, v in (config or {}).items() if k != "WS"}
        why = ws_eligible(x, dy, w, states, norm_only, onehot, grad,
                          split=bool(wcfg.get("SPLIT")))
        if why is None:
            return fused_wgrad_update_ws(x, dy, w, states, spec, hp, sumsq, seed, stochastic,
                                         wcfg, launch=False)
        if (config or {}).get("WS"):
            raise ValueError(f"config WS=True, but the warp-specialized kernel {why}")
    cfg = {k: v for k, v in (config or {}).items() if k != "WS"}  # ({"WS": False}: defaults)
    cfg = cfg or dict(default_config(w.dtype, T + T1, N, K, fmt, dense=T > 0))
    split = cfg.setdefault("EPI_SPLIT", 1)
    if split not in (1, 2, 4) or cfg["BLOCK_K"] % (2 * split):
        raise ValueError(f"EPI_SPLIT must be 1, 2 or 4 and divide BLOCK_K in even parts, got "
                         f"{split} for BLOCK_K {cfg['BLOCK_K']}")
    if fmt == "int8" and (cfg["BLOCK_K"] // split) % QBLOCK:
        raise ValueError(f"int8 states need BLOCK_K / EPI_SPLIT a multiple of {QBLOCK}, got "
                         f"{cfg['BLOCK_K']} / {split}")
    xs, dys = x.stride(), dy.stride()
    desc_ok = T > 0 and tma_capable(x) and tma_capable(dy)
    if cfg.get("DESC") is None:  # where the operands and the device allow it
        cfg["DESC"] = desc_ok
    elif cfg["DESC"] and not desc_ok:
        raise ValueError("DESC=True needs T > 0 and x, dy with unit last stride, 16-byte "
                         "aligned rows and base, on a device with tensor descriptors")
    persistent = cfg.setdefault("PERSISTENT", False)
    if persistent and not (cfg["DESC"] and ids is None and grad is None):
        raise ValueError("PERSISTENT=True needs the dense segment alone (no one-hot segment, "
                         "no grad) with DESC")
    blocks = {}
    if cfg["DESC"]:
        blocks = {0: [cfg["BLOCK_T"], cfg["BLOCK_K"]], 1: [cfg["BLOCK_T"], cfg["BLOCK_N"]]}
        x = descriptor(x, blocks[0])  # tma_capable(x) and (dy): desc_ok
        dy = descriptor(dy, blocks[1])
    nblk = -(-K // QBLOCK)
    data = [st.data if st is not None else w for st in states]  # w: any unused pointer
    scales = [st.scale if st is not None and st.scale is not None else w for st in states]
    bf16_w = w.dtype == torch.bfloat16
    nonneg = spec.nonneg
    interpret = INTERPRET
    # integer ceilings: triton.cdiv is a ConstexprFunction, about 2 us a call from the host
    tiles = -(-N // cfg["BLOCK_N"]) * -(-K // cfg["BLOCK_K"])
    grid = (min(tiles, persistent_programs(w.device)) if persistent else tiles,)
    # norm_only: one slot per tile, summed here in order (deterministic; see _finish_tile)
    parts = torch.empty(tiles, dtype=torch.float32, device=w.device) if norm_only else sumsq
    index = onehot_index(ids, -(-N // cfg["BLOCK_N"]), cfg["BLOCK_N"]) if ids is not None \
        else w
    args = [x, dy, index, e if e is not None else w,
            grad if grad is not None else w, w, *data, *scales, hp,
            parts, T, T1, N, K, nblk,
            *xs, *dys,
            e.stride(0) if e is not None else 0, e.stride(1) if e is not None else 0,
            grad.stride(0) if grad is not None else 0, grad.stride(1) if grad is not None else 0,
            w.stride(0), w.stride(1)]
    return _Built(grid, args, seed & 0x7FFFFFFF, dict(
        KIND=spec.kind, VARIANT=spec.variant,
        HAS0=present[0], HAS1=present[1], HAS2=present[2],
        NN0=nonneg[0], NN1=nonneg[1], NN2=nonneg[2],
        STATE_FMT=FMT_ID[fmt], W_SR=bool(stochastic and bf16_w),
        S_SR=bool(stochastic and fmt == "bf16"),
        DOT_PRECISION="ieee" if w.dtype == torch.float32 or interpret else "tf32",
        UPCAST=interpret and bf16_w,
        QB=QBLOCK, NORM_ONLY=bool(norm_only), HAS_ONEHOT=ids is not None,
        HAS_G=grad is not None, W_BF16=bf16_w, **cfg), parts, blocks)


def onehot_index(ids: torch.Tensor, num_n: int, block_n: int) -> torch.Tensor:
    """The one-hot segment's index for the kernel, one int64 tensor [2 T1 + num_n + 1]: the
    ids sorted stably (a row's tokens stay in token order; -1, no row here, first), the token
    of each sorted position, and for each tile of block_n rows its first sorted position (then
    the end). A tile reads only its own tokens: with 4096 tokens a vocabulary's tile meets
    about 2 of them, where scanning all ids per tile would cost more than the update
    (benchmarks/bench_embedding.py). Device ops only (no synchronization: capturable)."""
    order = torch.argsort(ids, stable=True)
    sids = ids[order]
    starts = torch.arange(num_n + 1, device=ids.device, dtype=torch.int64) * block_n
    return torch.cat([sids, order, torch.searchsorted(sids, starts)])


def _launch(grid, args: list, seed: int, device, consts: dict):
    """_fused_wgrad_update_kernel[grid](*args, seed, **consts), with less host time.

    Triton's launch derives the specialization of all ~45 arguments anew on every call (about
    three times the compiled kernel's own launcher), and an 8B
    model's step makes about 195 launches. Once a
    launch with the same key has gone through Triton, later ones call that compiled kernel's
    launcher directly (launch_cached). The seed is the one argument left out of the key: the
    kernel does not specialize on it."""
    return launch_cached(_fused_wgrad_update_kernel, grid, args, device, consts, free=(seed,))


# the kernel's arguments an UpdatePlan passes at each call, by position: x, dy, grad, hp, sumsq
_PASSED = (0, 1, 4, 12, 13)


def _dead():
    return None


def _signature(t):
    """What fused_wgrad_update's checks, routing and launch layout read of a tensor operand
    besides its values and address: shape, strides, dtype, device (its index, -1 on the CPU),
    16-byte alignment."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.get_device(), not t.data_ptr() & 15


# the last hp tensor an UpdatePlan was given, and its signature (weak): one hp tensor serves
# a step's weights of a group, each with a plan of its own
_LAST_HP = (_dead, None)


class UpdatePlan:
    """The fused update of one weight, its unchanging operands bound once: w, its states, the
    rule, the seed and the rounding. plan(x, dy, hp, sumsq, grad) updates w as
    fused_wgrad_update(x, dy, w, states, spec, hp, sumsq, seed, stochastic, grad=grad) does
    (the default config, no one-hot segment, not norm-only).

    An optimizer updates each weight with the same bound operands at every step and new
    segments, hyperparameters and norm slot, and fused_wgrad_update's checks, routing and
    launch layout read those only through their _signature and the routing switches; the key
    also holds whether the current stream is capturing a CUDA graph, so that a capture binds
    its launches anew, through the same checks. The first call of each such key goes
    through those checks and binds its launch (launch.BoundLaunch); a later call with the key
    runs the bound launch with its own tensors, so a step pays the checks once per weight
    (benchmarks/bench_host.py measures the host time of a linear's backward). A key the
    warp-specialized kernel takes binds that kernel's launch the same way. The bound
    operands must stay where they are (kernels.PlannedUpdate.binds checks that), and an hp or
    sumsq tensor passed again must keep its layout (it is compared by identity then: the
    optimizer's own small tensors; the segments are looked at at every call)."""

    MAX_KEYS = 16  # signatures kept (varying sequence lengths); then start over

    def __init__(self, w: torch.Tensor, states: list, spec: RuleSpec, seed: int,
                 stochastic: bool):
        self.w, self.states, self.spec = w, states, spec
        self.seed, self.stochastic = seed, bool(stochastic)
        self._cuda = w.is_cuda
        self._launches: dict = {}
        self._norms: dict = {}  # the norm-only pass's bound launches, by key (see norm)
        self._tiles: dict = {}  # key -> the tiles its norm-only pass writes a part for
        # the last sumsq tensor and its signature: the optimizer passes its own, the same
        # object again and again, whose layout nothing changes (hp: _LAST_HP)
        self._kept = [_dead, None]  # (weak: nothing of a call is kept)

    def __call__(self, x, dy, hp, sumsq, grad=None) -> None:
        global _LAST_HP
        last = _LAST_HP  # (replaced whole, never changed: one consistent pair is read)
        if last[0]() is not hp:
            last = _LAST_HP = (weakref.ref(hp), _signature(hp))
        kept = self._kept
        if kept[0]() is not sumsq:
            kept[0], kept[1] = weakref.ref(sumsq), _signature(sumsq)
        dev = torch._C._cuda_getDevice() if self._cuda else -1  # (CUDA is initialized there)
        key = (_signature(x), _signature(dy), _signature(grad), last[1], kept[1],
               _WS_FLAG, _WS_SPLIT, _WS_LARGE and tuple(sorted(_WS_LARGE.items())),
               dev >= 0 and torch._C._cuda_isCurrentStreamCapturing(), dev)
        bound = self._launches.get(key)
        if bound is None:
            self._bind(key, x, dy, hp, sumsq, grad)
        else:
            bound.run(bound.pick((x, dy, grad, hp, sumsq)), dev)

    def _bind(self, key, x, dy, hp, sumsq, grad) -> None:
        """The first call of key: fused_wgrad_update's checks and routing, the launch made
        and kept, with the order (into x, dy, grad, hp, sumsq) of the values it passes."""
        if len(self._launches) >= self.MAX_KEYS:
            self._launches.clear()
        built = _build(x, dy, self.w, self.states, self.spec, hp, sumsq, self.seed,
                       self.stochastic, None, False, None, grad)
        if type(built) is _Built:
            kernel = _fused_wgrad_update_kernel
            order = tuple(j for j, v in enumerate((x, dy, grad, hp, sumsq)) if v is not None)
            passed = tuple(_PASSED[j] for j in order)
            blocks = {i: b for i, b in built.blocks.items() if i in passed}
        else:  # the warp-specialized kernel's launch (fused_ws.WSLaunch): x, dy, hp, sumsq
            kernel, blocks = built.kernel, built.segments
            passed = (0, 1, *built.hp_at, built.sumsq_at)
            order = (0, 1, *(3 for _ in built.hp_at), 4)
        hit = launch_cached(kernel, built.grid, built.args, self.w.device, built.consts,
                            (built.seed,))
        bound = BoundLaunch(kernel, built.grid, list(built.args), (built.seed,), built.consts,
                            self.w.device, hit, passed, blocks)
        bound.pick = operator.itemgetter(*order)  # (x, dy, grad, hp, sumsq) -> its values
        self._launches[key] = bound

    # the norm-only pass: fused_wgrad_update(x, dy, w, states, spec, hp, sumsq, 0, False,
    # norm_only=True) without its sum, its parts written where the caller says

    def norm_tiles(self, x, dy) -> int:
        """How many parts norm(x, dy, parts) writes: the kernel's tiles of w for this many
        tokens (their config depends on it)."""
        return self._norm_tiles(self._norm_key(x, dy), x, dy)

    def _norm_tiles(self, key, x, dy) -> int:
        tiles = self._tiles.get(key)
        if tiles is None:
            if len(self._tiles) >= self.MAX_KEYS:
                self._tiles.clear()
            tiles = self._tiles[key] = len(self._norm_build(x, dy, None).parts)
        return tiles

    def norm(self, x, dy, parts=None) -> tuple:
        """The norm-only pass over the dense segment (x [T, K], dy [T, N]): the squared norm
        of each tile of dy^T x into parts (fp32, contiguous, 16-byte aligned, at least
        norm_tiles(x, dy) long; None: made here, rounded up to 16 bytes), one per tile in
        the kernel's order; their sum is ||dy^T x||^2. Nothing else is written. Returns
        (tiles, parts). The checks and launch layout are paid once per key, as for an
        update."""
        key = self._norm_key(x, dy)
        tiles = self._norm_tiles(key, x, dy)
        if parts is None:
            parts = torch.empty(norm_parts(tiles), dtype=torch.float32, device=self.w.device)
        elif parts.dtype != torch.float32 or not parts.is_contiguous() or parts.data_ptr() & 15 \
                or parts.numel() < tiles:
            raise ValueError(f"norm parts: need a contiguous, 16-byte aligned fp32 tensor "
                             f"of at least {tiles} elements, got {parts.dtype} "
                             f"{tuple(parts.shape)}")
        bound = self._norms.get(key)
        if bound is None:
            if len(self._norms) >= self.MAX_KEYS:
                self._norms.clear()
            built = self._norm_build(x, dy, parts)
            args = built.args
            args[_PASSED[4]] = parts  # the caller's parts, not _build's own
            hit = launch_cached(_fused_wgrad_update_kernel, built.grid, args, self.w.device,
                                built.consts, (built.seed,))
            variable = (_PASSED[0], _PASSED[1], _PASSED[4])  # x, dy, parts
            self._norms[key] = BoundLaunch(
                _fused_wgrad_update_kernel, built.grid, list(args), (built.seed,),
                built.consts, self.w.device, hit, variable,
                {i: b for i, b in built.blocks.items() if i in variable})
        else:
            bound.run((x, dy, parts), key[-1])
        return tiles, parts

    def _norm_key(self, x, dy) -> tuple:
        dev = torch._C._cuda_getDevice() if self._cuda else -1
        return (_signature(x), _signature(dy),
                dev >= 0 and torch._C._cuda_isCurrentStreamCapturing(), dev)

    def _norm_build(self, x, dy, parts) -> _Built:
        hp = norm_hp(self.w.device)
        sumsq = parts if parts is not None else hp  # (only its dtype is checked)
        built = _build(x, dy, self.w, self.states, self.spec, hp, sumsq, 0, False, None, True,
                       None, None)
        if type(built) is not _Built:  # (the warp-specialized kernel has no norm-only pass)
            raise RuntimeError("forge_engine: the norm-only pass was routed to the "
                               "warp-specialized kernel")
        return built


__all__ = ["fused_wgrad_update", "default_config", "StateTensor", "UpdatePlan"]

"""The FORGE kernel on Hopper, warp-specialized (Gluon): the epilogue's memory traffic off its
critical path.

Same contract and the same arithmetic as fused_update.py (the gradient tile dY^T X stays in
registers, the rule of kernels/rules.py is applied to it, W and the states are written back, the
squared norm is added to sumsq, a tile whose gradient is not finite keeps its values: not
written, or with EPI_PIPE written back as it was read), organized so that the epilogue does
not wait on global memory:

- one persistent program per SM, in partitions (gl.warp_specialize): a token-loader warp
  streams the dY and X tiles into a ring of STAGES shared-memory slots (TMA); an
  epilogue-loader warp brings the W and state tiles of a consumer's tile into that consumer's
  shared buffers (TMA) while it is still accumulating; the consumer (default: one of 8 warps,
  128 x 128 tiles) accumulates with wgmma. CONSUMERS=2 (two 4-warp consumers on 64 x 128
  tiles) lets them take turns, one's epilogue under the other's token loop.
- the epilogue reads W and the states from shared memory, steps in fp32, writes the results
  back into the same buffers and stores them with TMA: the stores drain while the consumer
  moves on.
- SPLIT=True (_ws_split_kernel): the epilogue on warps of its own. One warpgroup only
  accumulates and hands each tile's fp32 gradient over in shared memory; the default
  partition (EPI_WARPS warps, or EPI_GROUPS = 2 groups taking tiles in turn) only steps, with
  W and the states staged by the epilogue-loader (TMA) or, EPI_GLOBAL, loaded and stored by
  itself. The MMA partition also takes each tile's squared norm from its registers and hands
  it over with the gradient. Bitwise the Triton kernel's results. SPLIT_DEFAULT (128 x 128
  tiles, 32-token steps, one W/state set refilled half by half; EPI_PIPE: the
  epilogue-loader also stores each stepped half, so the epilogue never waits for its
  stores) is the fastest of the three kernels on the H200 at 512 and 1024 tokens, graphed,
  slower above (benchmarks/bench_kernel.py). fused_update takes it by default for updates
  of at most 1024 tokens, eager and captured into a CUDA graph: its bound launch costs no
  more host time than the Triton kernel's (docs/performance.md, "The eager step's
  kernels"); FORGE_WS_SPLIT=0 sends them to the Triton kernel. Above 1024 tokens
  fused_update takes the split design at SPLIT_LARGE (EPI_GLOBAL, a 128 KB ring of 64-token
  steps), the fastest there on the Llama-3.1-8B / Qwen3-8B shapes at 2048 and 4096 tokens
  (benchmarks/bench_kernel.py).

Scope (fused_update.fused_wgrad_update routes here only then; ws_eligible says why not):
bf16 W with bf16 states (any rule), or in the split design int8 states too (codes staged by
TMA like the bf16 states, or with EPI_GLOBAL loaded and stored by the epilogue's warps, one
row scale per 64-column half loaded ahead of the half's update; K a multiple of 16), a dense
segment (no one-hot segment, no materialized gradient), not the norm-only pass, contiguous W,
x and dy TMA-capable, K a multiple of 8, sm_90 (Gluon's wgmma). Tiles: BLOCK_N rows of W by 128 columns; the epilogue takes the
accumulator's two 64-column halves (a register split) one after the other, each a 128-byte
TMA box row of W and the states. The WS kernel (without SPLIT) is slower than the split design
at SPLIT_LARGE above 1024 tokens and than the Triton kernel at 512 on the H200
(benchmarks/bench_kernel.py); FORGE_WS=1 or config WS=True take it always.

Gluon kernels do not run under TRITON_INTERPRET; the CPU suite checks the host-side routing
and the GPU tests (tests/test_gpu.py, "ws") check the compiled kernel against the reference.
"""
# no `from __future__ import annotations`: _Shared's field types are checked at trace time
import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
    warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.language.core import _aggregate as aggregate

from forge_engine.kernels import rules as R
from forge_engine.kernels.launch import cuda_properties, persistent_programs, \
    register_descriptor, step_seed, tile_order
from forge_engine.kernels.quant import block_codes, code_values, compand, expand, \
    draw_index, random_pairs, sr_to_bf16, to_bf16_rn
from forge_engine.kernels.rules import apply_rule, load_hp, norm_factor

register_descriptor(GluonDescriptor)  # launches bound by fused_update.UpdatePlan take them

HALF = gl.constexpr(64)  # columns per epilogue part: 64 bf16 = one 128-byte TMA box row


@aggregate
class _Shared:
    """What every partition sees: descriptors, shared buffers, barriers, scalars, options."""
    x_desc: tma.tensor_descriptor
    dy_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    s0_desc: tma.tensor_descriptor
    s1_desc: tma.tensor_descriptor
    s2_desc: tma.tensor_descriptor
    dy_bufs: gl.shared_memory_descriptor
    x_bufs: gl.shared_memory_descriptor
    epi_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    epi_ready: gl.shared_memory_descriptor
    epi_empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor
    acc_bufs: gl.shared_memory_descriptor
    acc_ready: gl.shared_memory_descriptor
    acc_empty: gl.shared_memory_descriptor
    sq_bufs: gl.shared_memory_descriptor
    q_bufs: gl.shared_memory_descriptor
    w_ptr: gl.tensor
    s0_ptr: gl.tensor
    s1_ptr: gl.tensor
    s2_ptr: gl.tensor
    hp_ptr: gl.tensor
    sumsq_ptr: gl.tensor
    q0_ptr: gl.tensor
    q1_ptr: gl.tensor
    q2_ptr: gl.tensor
    nblk: gl.tensor
    seed: gl.tensor
    N: gl.tensor
    K: gl.tensor
    T: gl.tensor
    KIND: gl.constexpr
    VARIANT: gl.constexpr
    HAS0: gl.constexpr
    HAS1: gl.constexpr
    HAS2: gl.constexpr
    W_SR: gl.constexpr
    S_SR: gl.constexpr
    BLOCK_T: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    GROUP_N: gl.constexpr
    NBUF: gl.constexpr
    CONSUMERS: gl.constexpr
    CW: gl.constexpr
    EPI_BUFS: gl.constexpr
    EPI_GLOBAL: gl.constexpr
    EPI_PIPE: gl.constexpr
    INT8: gl.constexpr
    NN0: gl.constexpr
    NN1: gl.constexpr
    NN2: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs, x_bufs,
                 epi_bufs, ready, empty, epi_ready, epi_empty, turn, acc_bufs, acc_ready,
                 acc_empty, sq_bufs, q_bufs, w_ptr, s0_ptr, s1_ptr, s2_ptr, hp_ptr, sumsq_ptr,
                 q0_ptr, q1_ptr, q2_ptr, nblk, seed, N, K, T, KIND, VARIANT, HAS0, HAS1, HAS2,
                 W_SR, S_SR, BLOCK_T, BLOCK_N, STAGES, GROUP_N, NBUF, CONSUMERS, CW, EPI_BUFS,
                 EPI_GLOBAL, EPI_PIPE, INT8, NN0, NN1, NN2):
        self.x_desc = x_desc
        self.dy_desc = dy_desc
        self.w_desc = w_desc
        self.s0_desc = s0_desc
        self.s1_desc = s1_desc
        self.s2_desc = s2_desc
        self.dy_bufs = dy_bufs
        self.x_bufs = x_bufs
        self.epi_bufs = epi_bufs
        self.ready = ready
        self.empty = empty
        self.epi_ready = epi_ready
        self.epi_empty = epi_empty
        self.turn = turn
        self.acc_bufs = acc_bufs
        self.acc_ready = acc_ready
        self.acc_empty = acc_empty
        self.sq_bufs = sq_bufs
        self.q_bufs = q_bufs
        self.w_ptr = w_ptr
        self.s0_ptr = s0_ptr
        self.s1_ptr = s1_ptr
        self.s2_ptr = s2_ptr
        self.hp_ptr = hp_ptr
        self.sumsq_ptr = sumsq_ptr
        self.q0_ptr = q0_ptr
        self.q1_ptr = q1_ptr
        self.q2_ptr = q2_ptr
        self.nblk = nblk
        self.seed = seed
        self.N = N
        self.K = K
        self.T = T
        self.KIND = gl.constexpr(KIND)
        self.VARIANT = gl.constexpr(VARIANT)
        self.HAS0 = gl.constexpr(HAS0)
        self.HAS1 = gl.constexpr(HAS1)
        self.HAS2 = gl.constexpr(HAS2)
        self.W_SR = gl.constexpr(W_SR)
        self.S_SR = gl.constexpr(S_SR)
        self.BLOCK_T = gl.constexpr(BLOCK_T)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.STAGES = gl.constexpr(STAGES)
        self.GROUP_N = gl.constexpr(GROUP_N)
        self.NBUF = gl.constexpr(NBUF)
        self.CONSUMERS = gl.constexpr(CONSUMERS)
        self.CW = gl.constexpr(CW)
        self.EPI_BUFS = gl.constexpr(EPI_BUFS)
        self.EPI_GLOBAL = gl.constexpr(EPI_GLOBAL)
        self.EPI_PIPE = gl.constexpr(EPI_PIPE)
        self.INT8 = gl.constexpr(INT8)
        self.NN0 = gl.constexpr(NN0)
        self.NN1 = gl.constexpr(NN1)
        self.NN2 = gl.constexpr(NN2)


@gluon.jit
def _barriers(n: gl.constexpr):
    """n mbarriers in shared memory, each initialized for one arrival."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def _invalidate(bars, n: gl.constexpr):
    """mbarrier.inval on each of n barriers, once every partition is done with them. PTX
    makes any other access to an initialized mbarrier's memory undefined until it is
    invalidated; and because this is their last use, Triton's shared-memory allocator keeps
    them live for the whole kernel. Without it a barrier array the kernel never uses (the
    epilogue's in the EPI_GLOBAL build, `turn` with one consumer) is dead after its init,
    and the allocator may put a reduction's scratch on top of it: the tile norm's partial
    sums would be written over initialized mbarriers, which with several processes
    time-sharing the GPU gives NaN or short tile norms (benchmarks/stress_kernel.py;
    ptx_check --check-barriers reads every shipped build for it)."""
    for i in gl.static_range(n):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _my_tiles(p):
    """This program's tile count, the tile grid and the token steps per tile."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_n = gl.cdiv(p.N, p.BLOCK_N)
    num_k = gl.cdiv(p.K, 2 * HALF)
    mine = gl.cdiv(num_n * num_k - pid, nprog)
    return pid, nprog, num_n, num_k, mine, gl.cdiv(p.T, p.BLOCK_T)


@gluon.jit
def _load_tokens(p, ROLE: gl.constexpr):
    """Token-loader warp: for each of the program's tiles, its dY and X token tiles in order
    into the ring (slot = step mod STAGES), each slot waiting until a consumer released it."""
    pid, nprog, num_n, num_k, mine, steps = _my_tiles(p)
    nbytes: gl.constexpr = p.dy_desc.block_type.nbytes + p.x_desc.block_type.nbytes
    for j in range(mine):
        pid_n, pid_k = tile_order(pid + j * nprog, num_n, num_k, p.GROUP_N)
        for ks in range(steps):
            g = j * steps + ks
            s = g % p.STAGES
            mbarrier.wait(p.empty.index(s), ((g // p.STAGES) & 1) ^ 1)
            bar = p.ready.index(s)
            mbarrier.expect(bar, nbytes)
            t0 = ks * p.BLOCK_T
            tma.async_copy_global_to_shared(p.dy_desc, [t0, pid_n * p.BLOCK_N], bar,
                                            p.dy_bufs.index(s))
            tma.async_copy_global_to_shared(p.x_desc, [t0, pid_k * 2 * HALF], bar,
                                            p.x_bufs.index(s))


@gluon.jit
def _wbuf(p, c, h):
    """W's [BLOCK_N, HALF] buffer of set c, half h (bf16 states follow it in epi_bufs)."""
    return p.epi_bufs.index(c * (2 * (1 if p.INT8 else p.NBUF)) + h)


@gluon.jit
def _sbuf(p, c, h, i):
    """The buffer of the i-th present state (1, 2, 3) of set c, half h: bf16 states beside W
    in epi_bufs, int8 codes in q_bufs (unsigned codes too: their bytes, viewed as int8)."""
    if p.INT8:
        return p.q_bufs.index(c * (2 * (p.NBUF - 1)) + h + 2 * (i - 1))
    else:
        return p.epi_bufs.index(c * (2 * p.NBUF) + h + 2 * i)


@gluon.jit
def _load_half(p, bar, c, h: gl.constexpr, n0, k0):
    """W and the states of one [BLOCK_N, HALF] part at [n0, k0] into buffer set c's half h."""
    tma.async_copy_global_to_shared(p.w_desc, [n0, k0], bar, _wbuf(p, c, h))
    i = 1
    if p.HAS0:
        tma.async_copy_global_to_shared(p.s0_desc, [n0, k0], bar, _sbuf(p, c, h, i))
        i += 1
    if p.HAS1:
        tma.async_copy_global_to_shared(p.s1_desc, [n0, k0], bar, _sbuf(p, c, h, i))
        i += 1
    if p.HAS2:
        tma.async_copy_global_to_shared(p.s2_desc, [n0, k0], bar, _sbuf(p, c, h, i))


@gluon.jit
def _load_epilogue(p, ROLE: gl.constexpr):
    """Epilogue-loader warp: the W and state tiles of tile j into buffer set j % EPI_BUFS (a
    consumer's own set, or the epilogue partition's sets in turn), as soon as the tile that
    set held before has been stored from it. EPI_PIPE (one set): half by half; this warp also
    stores each half once the epilogue has stepped it, and refills it as soon as the stores
    have read it, so the next tile's first half arrives while this tile's second half steps
    and the epilogue's warps never wait for a store."""
    pid, nprog, num_n, num_k, mine, steps = _my_tiles(p)
    part: gl.constexpr = (p.w_desc.block_type.nbytes
                          + (p.NBUF - 1) * p.BLOCK_N * HALF * (1 if p.INT8 else 2))
    m0 = 0  # EPI_PIPE: the previous tile's origin (its halves are stored from here)
    l0 = 0
    for j in range(mine):
        pid_n, pid_k = tile_order(pid + j * nprog, num_n, num_k, p.GROUP_N)
        n0 = pid_n * p.BLOCK_N
        k0 = pid_k * 2 * HALF
        if p.EPI_PIPE:
            for h in gl.static_range(2):
                # the epilogue has stepped tile j - 1's half h: store it, and once the
                # stores have read the buffers, bring in tile j's half
                mbarrier.wait(p.epi_empty.index(h), (j & 1) ^ 1)
                if j > 0:
                    _store_half(p, 0, h, m0, l0 + h * HALF)
                    tma.store_wait(0)
                bar = p.epi_ready.index(h)
                mbarrier.expect(bar, part)
                _load_half(p, bar, 0, h, n0, k0 + h * HALF)
            m0 = n0
            l0 = k0
        else:
            c = j % p.EPI_BUFS
            mbarrier.wait(p.epi_empty.index(c), ((j // p.EPI_BUFS) & 1) ^ 1)
            bar = p.epi_ready.index(c)
            mbarrier.expect(bar, 2 * part)
            for h in gl.static_range(2):
                _load_half(p, bar, c, h, n0, k0 + h * HALF)
    if p.EPI_PIPE:  # the last tile's halves
        for h in gl.static_range(2):
            mbarrier.wait(p.epi_empty.index(h), (mine & 1) ^ 1)
            if mine > 0:
                _store_half(p, 0, h, m0, l0 + h * HALF)
        tma.store_wait(0)


@gluon.jit
def _round(x, r, SR: gl.constexpr):
    """fp32 -> bf16, stochastically (random bits: the low 16 of r) or to nearest even."""
    if SR:
        return sr_to_bf16(x, r)
    else:
        return to_bf16_rn(x)


@gluon.jit
def _scales(p, n0, k0, layout: gl.constexpr):
    """The int8 states' row scales of the part at [n0, k0] (one block of QBLOCK = HALF columns
    a row), loaded ahead of the part's update so that their latency hides behind the waits
    before it; zeros, compiled away, for bf16 states."""
    rows = n0 + gl.arange(0, p.BLOCK_N, layout=gl.SliceLayout(1, layout))
    q0 = gl.zeros([p.BLOCK_N], gl.float32, layout=gl.SliceLayout(1, layout))
    q1 = q0
    q2 = q0
    if p.INT8:
        blk = k0 // HALF
        m = (rows < p.N) & (blk < p.nblk)
        at = rows * p.nblk + blk  # < 2^31: N ceil(K / 64) scales of an int8 state
        if p.HAS0:
            q0 = gl.load(p.q0_ptr + at, mask=m, other=0.0)
        if p.HAS1:
            q1 = gl.load(p.q1_ptr + at, mask=m, other=0.0)
        if p.HAS2:
            q2 = gl.load(p.q2_ptr + at, mask=m, other=0.0)
    return q0, q1, q2


@gluon.jit
def _state_fp32(p, raw, scale, NN: gl.constexpr):
    """A state part as fp32 from its stored values `raw` (from a buffer or global memory):
    bf16, or int8 codes dequantized with their rows' scales (quant.load_state's arithmetic)."""
    if p.INT8:
        return expand(code_values(raw, NN) * scale[:, None], NN)
    else:
        return raw.to(gl.float32)


@gluon.jit
def _store_state(p, dst, q_ptr, x, r, NN: gl.constexpr, n0, k0, write, layout: gl.constexpr,
                 offs, st):
    """A state part back: into its buffer dst, or (EPI_GLOBAL) to global memory at dst + offs
    where st; bf16 (rounded as S_SR says, random bits r), or int8 codes with their rows'
    scales then stored to q_ptr (if `write`), quant.store_state's arithmetic: square-root
    codes rounded to nearest. Columns past K need no mask out of the block's absmax (the
    Triton kernel's): TMA loads them as zeros (X, W, the codes; the global epilogue's masked
    loads too), so the gradient, W and every state are 0 there, and each rule's new states
    are combinations of those (no constant is added to a state), 0 too; the K = 336 cases of
    tests/test_gpu.py check it."""
    if p.INT8:
        codes, scale = block_codes(compand(x, NN), NN)
        v = codes.to(gl.int8, bitcast=True)
    else:
        v = _round(x, r, p.S_SR)
    if p.EPI_GLOBAL:
        gl.store(dst + offs, v, mask=st)
    else:
        dst.store(v)
    if p.INT8:
        rows = n0 + gl.arange(0, p.BLOCK_N, layout=gl.SliceLayout(1, layout))
        blk = k0 // HALF
        gl.store(q_ptr + rows * p.nblk + blk, scale, mask=(rows < p.N) & (blk < p.nblk) & write)


@gluon.jit
def _store_half(p, c, h: gl.constexpr, n0, k0):
    """TMA stores of W and the states of buffer set c's half h to [n0, k0]."""
    tma.async_copy_shared_to_global(p.w_desc, [n0, k0], _wbuf(p, c, h))
    i = 1
    if p.HAS0:
        tma.async_copy_shared_to_global(p.s0_desc, [n0, k0], _sbuf(p, c, h, i))
        i += 1
    if p.HAS1:
        tma.async_copy_shared_to_global(p.s1_desc, [n0, k0], _sbuf(p, c, h, i))
        i += 1
    if p.HAS2:
        tma.async_copy_shared_to_global(p.s2_desc, [n0, k0], _sbuf(p, c, h, i))


@gluon.jit
def _update_part(p, g, c, h: gl.constexpr, draws, write, n0, k0, scales,
                 layout: gl.constexpr, STORE: gl.constexpr = True):
    """The rule on one [BLOCK_N, HALF] gradient part g: W and the states from consumer c's
    shared buffers (int8 states: with their row scales, _scales), results back into them,
    then (if `write`) TMA stores to [n0, k0]. STORE False (EPI_PIPE: the epilogue-loader
    stores): the buffers are written only if `write`, a tile not written goes back as it
    came."""
    if STORE:
        _step_part(p, g, c, h, draws, write, n0, k0, scales, layout)
        fence_async_shared()
        if write:
            _store_half(p, c, h, n0, k0)
    else:
        if write:
            _step_part(p, g, c, h, draws, write, n0, k0, scales, layout)
        fence_async_shared()  # before the loader's stores read the buffers (async proxy)


@gluon.jit
def _step_part(p, g, c, h: gl.constexpr, draws, write, n0, k0, scales, layout: gl.constexpr):
    """_update_part's arithmetic: results into the buffers (int8: row scales to global
    memory if `write`)."""
    wb = _wbuf(p, c, h)
    w = wb.load(layout).to(gl.float32)
    s0 = g
    s1 = g
    s2 = g
    i = 1
    if p.HAS0:
        s0 = _state_fp32(p, _sbuf(p, c, h, i).load(layout), scales[0], p.NN0)
        i += 1
    if p.HAS1:
        s1 = _state_fp32(p, _sbuf(p, c, h, i).load(layout), scales[1], p.NN1)
        i += 1
    if p.HAS2:
        s2 = _state_fp32(p, _sbuf(p, c, h, i).load(layout), scales[2], p.NN2)
    w, s0, s1, s2 = apply_rule(w, g, s0, s1, s2, p.hp_ptr, p.KIND, p.VARIANT)
    # the random bits of each rounding as the Triton kernel draws them (quant.random_pairs)
    wb.store(_round(w, _random_pairs(p, draws, 0, layout), p.W_SR))
    i = 1
    if p.HAS0:
        _store_state(p, _sbuf(p, c, h, i), p.q0_ptr, s0, _random_pairs(p, draws, 1, layout),
                     p.NN0, n0, k0, write, layout, 0, write)
        i += 1
    if p.HAS1:
        _store_state(p, _sbuf(p, c, h, i), p.q1_ptr, s1, _random_pairs(p, draws, 2, layout),
                     p.NN1, n0, k0, write, layout, 0, write)
        i += 1
    if p.HAS2:
        _store_state(p, _sbuf(p, c, h, i), p.q2_ptr, s2, _random_pairs(p, draws, 3, layout),
                     p.NN2, n0, k0, write, layout, 0, write)


@gluon.jit
def _load_global(p, offs, mask):
    """EPI_GLOBAL: W and the present states of one part, as stored (bf16, or int8 codes), from
    global memory in the epilogue's layout. The epilogue issues the first half's before it
    waits for the tile's gradient (faster with int8 moments at 2048 tokens, bf16 alike) and
    the second half's after the first half's update (issued before it too, they spill and are
    slower with bf16 moments; benchmarks/sweep_ws.py). Masked-off columns and rows load as 0
    (code 0), as TMA loads them;
    absent states as W (unused)."""
    w = gl.load(p.w_ptr + offs, mask=mask, other=0.0)
    s0 = w
    s1 = w
    s2 = w
    if p.HAS0:
        s0 = gl.load(p.s0_ptr + offs, mask=mask, other=0)
    if p.HAS1:
        s1 = gl.load(p.s1_ptr + offs, mask=mask, other=0)
    if p.HAS2:
        s2 = gl.load(p.s2_ptr + offs, mask=mask, other=0)
    return w, s0, s1, s2


@gluon.jit
def _update_global(p, g, raw, offs, draws, mask, write, n0, k0, scales, hp,
                   HP_ONCE: gl.constexpr):
    """The rule on one gradient part g at [n0, k0] against W and the states `raw` loaded by
    _load_global, the results stored to global memory in g's layout by the epilogue's own
    warps (EPI_GLOBAL: no shared-memory staging, which leaves it all to the token ring, and
    no TMA traffic beside the token loads; int8 states with their row scales, _scales). hp:
    the rule's hyperparameters, a pointer or (HP_ONCE) load_hp's tuple."""
    w = raw[0].to(gl.float32)
    s0 = g
    s1 = g
    s2 = g
    if p.HAS0:
        s0 = _state_fp32(p, raw[1], scales[0], p.NN0)
    if p.HAS1:
        s1 = _state_fp32(p, raw[2], scales[1], p.NN1)
    if p.HAS2:
        s2 = _state_fp32(p, raw[3], scales[2], p.NN2)
    w, s0, s1, s2 = apply_rule(w, g, s0, s1, s2, hp, p.KIND, p.VARIANT, HP_ONCE)
    st = mask & write
    lay: gl.constexpr = g.type.layout
    gl.store(p.w_ptr + offs, _round(w, _random_pairs(p, draws, 0, lay), p.W_SR), mask=st)
    if p.HAS0:
        _store_state(p, p.s0_ptr, p.q0_ptr, s0, _random_pairs(p, draws, 1, lay), p.NN0,
                     n0, k0, write, lay, offs, st)
    if p.HAS1:
        _store_state(p, p.s1_ptr, p.q1_ptr, s1, _random_pairs(p, draws, 2, lay), p.NN1,
                     n0, k0, write, lay, offs, st)
    if p.HAS2:
        _store_state(p, p.s2_ptr, p.q2_ptr, s2, _random_pairs(p, draws, 3, lay), p.NN2,
                     n0, k0, write, lay, offs, st)


@gluon.jit
def _random_pairs(p, draws, stream: gl.constexpr, layout: gl.constexpr):
    """quant.random_pairs of the part's draws, in the part's `layout` (its register split and
    join move no data: a thread holds both columns of a pair)."""
    return gl.convert_layout(random_pairs(p.seed, draws, stream), layout)


@gluon.jit
def _halves(a, BN: gl.constexpr):
    """[BN, 2 HALF] -> its column halves [BN, HALF] (a register split of the wgmma layout)."""
    return a.reshape([BN, 2, HALF]).permute((0, 2, 1)).split()


@gluon.jit
def _token_loop(p, j, steps, acc_layout: gl.constexpr):
    """Tile j's [BLOCK_N, 128] gradient: wgmma over its `steps` token steps, the ring's
    j * steps-th to (j + 1) * steps - 1-th fills of this program, one group in flight; each
    slot is released once the group after it has been issued, the last one at the end."""
    acc = gl.zeros([p.BLOCK_N, 2 * HALF], gl.float32, layout=acc_layout)
    first = j * steps
    for ks in range(steps):
        g = first + ks
        s = g % p.STAGES
        mbarrier.wait(p.ready.index(s), (g // p.STAGES) & 1)
        a = p.dy_bufs.index(s).permute((1, 0))  # dY^T [BN, BT] over the [BT, BN] tile
        acc = warpgroup_mma(a, p.x_bufs.index(s), acc, is_async=True)
        # the previous step's group is done: its slot can be refilled
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(p.empty.index((g + p.STAGES - 1) % p.STAGES), pred=ks > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(p.empty.index((first + steps - 1) % p.STAGES))
    return acc


@gluon.jit
def _consume(p, ROLE: gl.constexpr):
    """Consumer ROLE (0 or 1; CW warps): tiles ROLE, ROLE + CONSUMERS, ... of the program.
    Accumulate the [BLOCK_N, 128] gradient tile with wgmma over the token ring (one step in
    flight), then apply the rule to its two column halves (_update_part) and release the
    epilogue buffers once the stores have read them."""
    BN: gl.constexpr = p.BLOCK_N
    CW: gl.constexpr = p.CW
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                         warps_per_cta=[CW, 1],
                                                         instr_shape=[16, 128, 16])
    pid, nprog, num_n, num_k, mine, steps = _my_tiles(p)
    gs2 = norm_factor(p.hp_ptr)  # (loaded once: nothing writes hp)
    for j in range(ROLE, mine if ROLE < p.CONSUMERS else 0, p.CONSUMERS):
        pid_n, pid_k = tile_order(pid + j * nprog, num_n, num_k, p.GROUP_N)
        # take turns: tile j's token steps start after tile j - 1's were consumed, so the
        # ring's slots are taken in order and no wait is more than one phase ahead of its
        # barrier (a parity wait cannot tell phase u from u + 2)
        if p.CONSUMERS == 2:
            mbarrier.wait(p.turn.index(ROLE), ((j // 2) - 1 + ROLE) & 1, pred=j > 0)
        acc = _token_loop(p, j, steps, acc_layout)
        if p.CONSUMERS == 2:
            mbarrier.arrive(p.turn.index(1 - ROLE))  # the other consumer's tile j + 1 may start

        sq = gl.sum(gl.sum(acc * acc, axis=1), axis=0)
        # the norm of the gradient the rule applies (hp[GRAD_SCALE] * acc); read after the
        # kernel: no fence
        gl.atomic_add(p.sumsq_ptr, sq * gs2, sem="relaxed")
        write = sq < float("inf")  # inf or NaN: nothing of the tile is written
        g0, g1 = _halves(acc, BN)
        part: gl.constexpr = g0.type.layout
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, part))
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, part))
        n0 = pid_n * BN
        k0 = pid_k * 2 * HALF
        draws = draw_index(n0 + rows, k0 + cols, p.K)
        mbarrier.wait(p.epi_ready.index(ROLE), (j // p.CONSUMERS) & 1)
        none = _scales(p, n0, k0, part)  # (bf16 states only: zeros, unused)
        _update_part(p, g0, ROLE, 0, draws, write, n0, k0, none, part)
        _update_part(p, g1, ROLE, 1, draws + HALF // 2, write, n0, k0 + HALF, none, part)
        tma.store_wait(0)  # the stores have read the buffers: the loader may refill them
        mbarrier.arrive(p.epi_empty.index(ROLE))


@gluon.jit
def _accumulate(p, ROLE: gl.constexpr):
    """Split design, MMA partition (4 warps, one warpgroup): each tile's [BLOCK_N, 128]
    gradient with wgmma over the token ring (one group in flight), its squared norm (added to
    sumsq), then the two column halves and the norm into the accumulator buffers for the
    epilogue partition, and on to the next tile."""
    BN: gl.constexpr = p.BLOCK_N
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 128, 16])
    pid, nprog, num_n, num_k, mine, steps = _my_tiles(p)
    gs2 = norm_factor(p.hp_ptr)  # (loaded once: nothing writes hp)
    for j in range(mine):
        acc = _token_loop(p, j, steps, acc_layout)
        # the tile's squared norm here, where the gradient is in registers (in the epilogue
        # it would take a third read of the gradient buffers and a reduction across its warps)
        sq = gl.sum(gl.sum(acc * acc, axis=1), axis=0)
        # sumsq gets the norm of the gradient the rule applies (hp[GRAD_SCALE] * acc); the
        # epilogue's non-finite check takes sq itself. relaxed: sumsq is read after the
        # kernel, and the default (acq_rel) fence stalls the tensor cores between tiles
        # (slower at 512 tokens: benchmarks/bench_kernel.py)
        gl.atomic_add(p.sumsq_ptr, sq * gs2, sem="relaxed")
        g0, g1 = _halves(acc, BN)
        # tile j goes to epilogue group j % CONSUMERS, once that group has taken its previous
        # tile's halves into its registers
        a = j % p.CONSUMERS
        mbarrier.wait(p.acc_empty.index(a), ((j // p.CONSUMERS) & 1) ^ 1)
        p.acc_bufs.index(2 * a).store(g0)
        p.acc_bufs.index(2 * a + 1).store(g1)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        p.sq_bufs.index(a).store(gl.full([1], sq, gl.float32, one))
        mbarrier.arrive(p.acc_ready.index(a))  # after a barrier of this partition's warps


@gluon.jit
def _epilogue(p, ROLE: gl.constexpr, HP_ONCE: gl.constexpr = False):
    """Split design, epilogue group ROLE (CW warps; CONSUMERS groups take the tiles in turn):
    for each of its tiles, the tile's squared norm and the gradient's halves from its
    accumulator buffers (released at once, or with RELOAD once the second half is read, so
    that the group's next tile can be written while this one steps), then the rule on each
    half against W and the states, staged by the epilogue-loader in buffer set j % EPI_BUFS
    and stored by TMA (EPI_PIPE: one set, each half handed back to the epilogue-loader once
    stepped, which stores and refills it), or (EPI_GLOBAL) loaded and stored by the group
    itself; HP_ONCE (EPI_GLOBAL): the rule's hyperparameters loaded once, before the first tile,
    not again for each part (fused_wgrad_update_ws says where)."""
    BN: gl.constexpr = p.BLOCK_N
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[8, 4],
                                            warps_per_cta=[p.CW, 1], order=[1, 0])
    # two groups, or 128-row tiles: hold one gradient half at a time, the buffer released
    # once the second half has been read, after the first half's update
    RELOAD: gl.constexpr = p.CONSUMERS == 2 or BN == 128
    pid, nprog, num_n, num_k, mine, steps = _my_tiles(p)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    hp = p.hp_ptr
    if HP_ONCE:
        hp = load_hp(p.hp_ptr)
    for j in range(ROLE, mine, p.CONSUMERS):
        pid_n, pid_k = tile_order(pid + j * nprog, num_n, num_k, p.GROUP_N)
        n0 = pid_n * BN
        k0 = pid_k * 2 * HALF
        scales0 = _scales(p, n0, k0, layout)  # int8: issued before any wait of the tile
        scales1 = _scales(p, n0, k0 + HALF, layout)
        if p.EPI_GLOBAL:  # the first half's W and states before the gradient's wait
            offs = (n0 + rows.to(gl.int64))[:, None] * p.K + (k0 + cols.to(gl.int64))[None, :]
            inside0 = ((n0 + rows)[:, None] < p.N) & ((k0 + cols)[None, :] < p.K)
            inside1 = ((n0 + rows)[:, None] < p.N) & ((k0 + HALF + cols)[None, :] < p.K)
            raw0 = _load_global(p, offs, inside0)
        mbarrier.wait(p.acc_ready.index(ROLE), (j // p.CONSUMERS) & 1)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [p.CW], [0])
        sq = gl.max(p.sq_bufs.index(ROLE).load(one), axis=0)  # the MMA partition's norm
        g0 = p.acc_bufs.index(2 * ROLE).load(layout)
        g1 = g0
        if not RELOAD:  # release the buffers at once, the next tile is due
            g1 = p.acc_bufs.index(2 * ROLE + 1).load(layout)
            mbarrier.arrive(p.acc_empty.index(ROLE))
        write = sq < float("inf")  # inf or NaN: nothing of the tile is written
        if p.EPI_GLOBAL:
            draws = draw_index(n0 + rows, k0 + cols, p.K)
            _update_global(p, g0, raw0, offs, draws, inside0, write, n0, k0, scales0, hp,
                           HP_ONCE)
            if RELOAD:
                g1 = p.acc_bufs.index(2 * ROLE + 1).load(layout)
                mbarrier.arrive(p.acc_empty.index(ROLE))
            raw1 = _load_global(p, offs + HALF, inside1)
            _update_global(p, g1, raw1, offs + HALF, draws + HALF // 2, inside1, write, n0,
                           k0 + HALF, scales1, hp, HP_ONCE)
        else:
            draws = draw_index(n0 + rows, k0 + cols, p.K)
            c = j % p.EPI_BUFS
            if p.EPI_PIPE:  # each half back to the loader once stepped: it stores it
                mbarrier.wait(p.epi_ready.index(0), j & 1)
                _update_part(p, g0, 0, 0, draws, write, n0, k0, scales0, layout, False)
                mbarrier.arrive(p.epi_empty.index(0))
            else:
                mbarrier.wait(p.epi_ready.index(c), (j // p.EPI_BUFS) & 1)
                _update_part(p, g0, c, 0, draws, write, n0, k0, scales0, layout)
            if RELOAD:
                g1 = p.acc_bufs.index(2 * ROLE + 1).load(layout)
                mbarrier.arrive(p.acc_empty.index(ROLE))
            if p.EPI_PIPE:
                mbarrier.wait(p.epi_ready.index(1), j & 1)
                _update_part(p, g1, 0, 1, draws + HALF // 2, write, n0, k0 + HALF, scales1,
                             layout, False)
                mbarrier.arrive(p.epi_empty.index(1))
            else:
                _update_part(p, g1, c, 1, draws + HALF // 2, write, n0, k0 + HALF, scales1,
                             layout)
                tma.store_wait(0)  # the stores have read the buffers: the loader may refill
                mbarrier.arrive(p.epi_empty.index(c))


@gluon.constexpr_function
def gradient_layout(rows):
    """The shared layout of a [rows, HALF] fp32 gradient half handed from the MMA partition
    to the epilogue: row r's words at r HALF + (c XOR f(r)), f(r) = 12 (r bit 0) XOR 16 (r bit
    1), so that neither side meets a bank conflict. A warp's 8-byte stores from the wgmma
    registers (8 rows by 8 columns; a half-warp at a time: 4 rows, which f spreads over the
    four 32-byte quarters of the banks) and its 16-byte loads into the epilogue's layout (8
    rows by 32 columns; a quarter-warp at a time: 2 rows, which f's 4-word XOR puts on the
    other half of the banks) take the fewest wavefronts their bytes need. The default
    128-byte swizzle takes twice that for the stores (ncu), on the MMA partition's path
    between two tiles."""
    bases = [[0, 1 << i] for i in range(6)] + [[1, 12], [2, 16]]  # offset bit -> (row, col)
    bases += [[1 << i, 0] for i in range(2, rows.bit_length() - 1)]
    return gl.SharedLinearLayout(bases)


# K specialized (its divisibility by 16): EPI_GLOBAL's row offsets n K + k then stay 16-byte
# aligned and its loads and stores vectorized
@gluon.jit(do_not_specialize=["N", "T", "seed", "nblk"])
def _ws_split_kernel(x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, w_ptr, s0_ptr,
                     s1_ptr, s2_ptr, hp_ptr, sumsq_ptr, q0_ptr, q1_ptr, q2_ptr, nblk, N, K, T,
                     seed,
                     KIND: gl.constexpr, VARIANT: gl.constexpr, HAS0: gl.constexpr,
                     HAS1: gl.constexpr, HAS2: gl.constexpr, W_SR: gl.constexpr,
                     S_SR: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_N: gl.constexpr, NBUF: gl.constexpr,
                     EPI_BUFS: gl.constexpr, EPI_GROUPS: gl.constexpr, EPI_REGS: gl.constexpr,
                     MMA_REGS: gl.constexpr, EPI_GLOBAL: gl.constexpr,
                     EPI_PIPE: gl.constexpr, INT8: gl.constexpr, NN0: gl.constexpr,
                     NN1: gl.constexpr, NN2: gl.constexpr, HP_ONCE: gl.constexpr,
                     num_warps: gl.constexpr):
    # the split design: the default partition (num_warps warps) runs only the epilogue, a
    # worker warpgroup only the wgmma token loop, handing each tile's fp32 gradient over in
    # shared memory; the loader warps as in _ws_kernel
    gl.static_assert(not HP_ONCE or (EPI_GLOBAL and EPI_GROUPS == 1),
                     "HP_ONCE is built and checked for EPI_GLOBAL with one epilogue group only")
    dy_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, BLOCK_N], dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, 2 * HALF], x_desc.layout)
    WB: gl.constexpr = 1 if INT8 else NBUF  # W, and bf16 states beside it
    if EPI_GLOBAL:  # one small unused buffer (the ring takes the shared memory)
        epi_bufs = gl.allocate_shared_memory(gl.bfloat16, [1, 8, HALF], w_desc.layout)
    else:
        epi_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * EPI_BUFS * WB, BLOCK_N, HALF],
                                             w_desc.layout)
    q_bufs = epi_bufs  # int8 states' codes: their own buffers (EPI_GLOBAL: none)
    if INT8 and not EPI_GLOBAL:
        q_bufs = gl.allocate_shared_memory(gl.int8, [2 * EPI_BUFS * (NBUF - 1), BLOCK_N, HALF],
                                           s0_desc.layout)
    acc_bufs = gl.allocate_shared_memory(gl.float32, [2 * EPI_GROUPS, BLOCK_N, HALF],
                                         gradient_layout(BLOCK_N))
    sq_bufs = gl.allocate_shared_memory(gl.float32, [EPI_GROUPS, 1],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = _barriers(STAGES)
    empty = _barriers(STAGES)
    epi_ready = _barriers(2)
    epi_empty = _barriers(2)
    acc_ready = _barriers(2)
    acc_empty = _barriers(2)
    p = _Shared(x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs, x_bufs, epi_bufs,
                ready, empty, epi_ready, epi_empty, acc_ready, acc_bufs, acc_ready, acc_empty,
                sq_bufs, q_bufs, w_ptr, s0_ptr, s1_ptr, s2_ptr, hp_ptr, sumsq_ptr, q0_ptr,
                q1_ptr, q2_ptr, nblk, step_seed(seed, hp_ptr), N, K, T, KIND, VARIANT, HAS0,
                HAS1, HAS2, W_SR, S_SR, BLOCK_T, BLOCK_N, STAGES, GROUP_N, NBUF, EPI_GROUPS,
                num_warps, EPI_BUFS, EPI_GLOBAL, EPI_PIPE, INT8, NN0, NN1, NN2)
    if EPI_GROUPS == 2 and EPI_GLOBAL:  # no epilogue-loader: the groups load for themselves
        gl.warp_specialize([(_epilogue, (p, 0, HP_ONCE)), (_epilogue, (p, 1, HP_ONCE)),
                            (_accumulate, (p, 0)), (_load_tokens, (p, 0))],
                           [num_warps, 4, 1], [EPI_REGS, MMA_REGS, 24])
    elif EPI_GROUPS == 2:  # two epilogue groups taking the tiles in turn, each its own buffers
        gl.warp_specialize([(_epilogue, (p, 0)), (_epilogue, (p, 1)), (_accumulate, (p, 0)),
                            (_load_tokens, (p, 0)), (_load_epilogue, (p, 0))],
                           [num_warps, 4, 1, 1], [EPI_REGS, MMA_REGS, 24, 24])
    elif EPI_GLOBAL:
        gl.warp_specialize([(_epilogue, (p, 0, HP_ONCE)), (_accumulate, (p, 0)),
                            (_load_tokens, (p, 0))], [4, 1], [MMA_REGS, 24])
    else:
        gl.warp_specialize([(_epilogue, (p, 0)), (_accumulate, (p, 0)), (_load_tokens, (p, 0)),
                            (_load_epilogue, (p, 0))], [4, 1, 1], [MMA_REGS, 24, 24])
    _invalidate(ready, STAGES)  # (every barrier, used or not: _invalidate says why)
    _invalidate(empty, STAGES)
    _invalidate(epi_ready, 2)
    _invalidate(epi_empty, 2)
    _invalidate(acc_ready, 2)
    _invalidate(acc_empty, 2)


@gluon.jit(do_not_specialize=["N", "K", "T", "seed"])
def _ws_kernel(x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, hp_ptr, sumsq_ptr,
               N, K, T, seed,
               KIND: gl.constexpr, VARIANT: gl.constexpr, HAS0: gl.constexpr,
               HAS1: gl.constexpr, HAS2: gl.constexpr, W_SR: gl.constexpr, S_SR: gl.constexpr,
               BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               GROUP_N: gl.constexpr, NBUF: gl.constexpr, CONSUMERS: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    # x [T, K] by [BLOCK_T, HALF] boxes, dy [T, N] by [BLOCK_T, BLOCK_N], W and the states
    # [N, K] by [BLOCK_N, HALF]; NBUF = 1 + the number of states
    dy_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, BLOCK_N], dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, 2 * HALF], x_desc.layout)
    epi_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * CONSUMERS * NBUF, BLOCK_N, HALF],
                                         w_desc.layout)
    ready = _barriers(STAGES)
    empty = _barriers(STAGES)
    epi_ready = _barriers(2)
    epi_empty = _barriers(2)
    turn = _barriers(2)
    p = _Shared(x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs, x_bufs, epi_bufs,
                ready, empty, epi_ready, epi_empty, turn, epi_bufs, turn, turn, turn, epi_bufs,
                hp_ptr, hp_ptr, hp_ptr, hp_ptr, hp_ptr, sumsq_ptr, hp_ptr, hp_ptr, hp_ptr, N,
                step_seed(seed, hp_ptr), N, K, T, KIND, VARIANT, HAS0, HAS1, HAS2, W_SR, S_SR,
                BLOCK_T, BLOCK_N, STAGES, GROUP_N, NBUF, CONSUMERS, num_warps, CONSUMERS, False,
                False, False, False, False, False)
    if CONSUMERS == 2:
        gl.warp_specialize([(_consume, (p, 0)), (_consume, (p, 1)), (_load_tokens, (p, 0)),
                            (_load_epilogue, (p, 0))], [num_warps, 1, 1],
                           [CONSUMER_REGS, 24, 24])
    else:
        gl.warp_specialize([(_consume, (p, 0)), (_load_tokens, (p, 0)),
                            (_load_epilogue, (p, 0))], [1, 1], [24, 24])
    _invalidate(ready, STAGES)  # (every barrier, used or not: _invalidate says why)
    _invalidate(empty, STAGES)
    _invalidate(epi_ready, 2)
    _invalidate(epi_empty, 2)
    _invalidate(turn, 2)


# ------------------------------------------------------------------------------- host side

SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 (227 KiB)
# BLOCK_N rows by 128 columns per tile; CONSUMERS 1: one consumer of CONSUMER_WARPS warps
# accumulates and then runs the epilogue, while the loader warps fetch the next tile's tokens
# and this tile's W and states; CONSUMERS 2 (with BLOCK_N 64, 4 warps): two consumers take
# turns, one's epilogue under the other's token loop (slower on the H200: benchmarks/sweep_ws.py).
# SPLIT: the split design (_ws_split_kernel): EPI_WARPS warps (EPI_GROUPS groups of them) run
# only the epilogue, one warpgroup (MMA_REGS registers) only the token loop, the gradient
# handed over in shared memory; EPI_BUFS sets of W and state buffers (2: the next tile's
# arrive while this one steps; at least EPI_GROUPS); EPI_REGS: the second group's registers;
# EPI_GLOBAL: W and the states from and to global memory, not staged; EPI_PIPE (one set, one
# group): the set's halves stored by the epilogue-loader once stepped and refilled one by one,
# the next tile's first half while this tile's second steps (SPLIT_DEFAULT's EPI_PIPE applies
# where the config leaves one set and one group; named in a config, it must). SPLIT_DEFAULT's
# values replace WS_DEFAULT's unless the config names them.
# PROGRAMS: at most this many programs (None: one per SM, even_programs with int8 states),
# for tests and experiments. HP_ONCE (EPI_GLOBAL): the epilogue loads the rule's
# hyperparameters once, not for each part (None: hp_once decides).
WS_DEFAULT = dict(BLOCK_T=64, BLOCK_N=128, STAGES=4, GROUP_N=8, CONSUMER_REGS=232, maxnreg=168,
                  PROGRAMS=None, CONSUMERS=1, CONSUMER_WARPS=8, SPLIT=False, EPI_WARPS=8,
                  MMA_REGS=128, EPI_BUFS=2, EPI_GROUPS=1, EPI_REGS=168, EPI_GLOBAL=False,
                  EPI_PIPE=False, HP_ONCE=None)
# the fastest of the split configurations on the H200 at up to 1024 tokens
# (benchmarks/sweep_ws.py): 128 x 128 tiles, one W/state set refilled half by half, 32-token
# steps in a ring of four
SPLIT_DEFAULT = dict(BLOCK_N=128, BLOCK_T=32, STAGES=4, EPI_BUFS=1, EPI_PIPE=True, MMA_REGS=160,
                     maxnreg=None)
# the split design's configuration above 1024 tokens (fused_update's FORGE_WS=auto), where the
# token loop is long and must keep pace with cuBLAS: the epilogue loads and stores W and the
# states itself (EPI_GLOBAL), so the only TMA traffic is the token loads and the shared memory
# not holding the gradient goes to a ring of four 64-token steps. On the H200 the TMA-staged
# epilogue's loads and stores slow such a token loop by half (even all hitting L2) and a 4-slot
# ring of 32-token steps starves the wgmma; this configuration is faster than the WS kernel at
# 2048 and 4096 tokens, graphed (benchmarks/bench_kernel.py, benchmarks/sweep_ws.py). The
# barriers it never uses are kept off the norm's reduction scratch by _invalidate
SPLIT_LARGE = dict(EPI_GLOBAL=True, EPI_PIPE=False, BLOCK_T=64, STAGES=4)


# HP_ONCE: the rules (kind, variant) whose SPLIT_LARGE builds (EPI_GLOBAL, one epilogue
# group) compute the same float dataflow with the hyperparameters loaded once
# (ptx_check --check-hp-once, a CPU test), and the most tokens it is taken for. apply_rule's
# loads come again for each part, since the stores between may alias hp; loaded once, AdamW is
# faster at 2048 tokens with bf16 and int8 states but slower at 4096 with bf16, bitwise equal
# (benchmarks/ab_ws.py).
HP_ONCE_RULES = ((R.ADAMW, 0), (R.ADAMW, R.AMSGRAD))
HP_ONCE_MAX_T = 2048


def hp_once(checked: bool, tokens: int, kind: int, variant: int) -> bool:
    """Whether a split launch loads the rule's hyperparameters once (HP_ONCE): a design the
    check builds (`checked`: EPI_GLOBAL with one epilogue group), at most HP_ONCE_MAX_T
    tokens, a rule of HP_ONCE_RULES."""
    return bool(checked) and tokens <= HP_ONCE_MAX_T and (kind, variant) in HP_ONCE_RULES


def even_programs(tiles: int, sms: int) -> int:
    """Programs of a persistent launch over `tiles` tiles on `sms` multiprocessors: where fewer
    programs than one per SM take the tiles in the same ceil(tiles / sms) rounds with the same
    number of tiles each (no partial last round), that many; else one per SM (or per tile).
    On the H200 (132 SMs) proj's 1024 tiles go to 128 programs, 8 each; qkv, fc2 and q-fc2 go
    to 128 too, the other LLM shapes stay on 132 (fc1's 7168 tiles do not split evenly in 55
    rounds). With int8 states the four moved shapes are faster at 512 to 4096 tokens, with
    bf16 states slower at 512, so the launcher uses it for int8 states only
    (benchmarks/bench_kernel.py)."""
    if tiles < 1 or sms < 1:
        raise ValueError(f"even_programs needs at least one tile and one SM, got {tiles}, {sms}")
    rounds = -(-tiles // sms)
    fewest = -(-tiles // rounds)
    return fewest if fewest * rounds == tiles else min(tiles, sms)


def ws_eligible(x, dy, w, states, norm_only=False, onehot=None, grad=None,
                split: bool = False) -> str | None:
    """None if the warp-specialized kernel (split: its split design) can take this update,
    else why not (one line)."""
    if not w.is_cuda or cuda_properties(w.device).major != 9:
        return "needs an sm_90 GPU (Hopper)"
    if norm_only or onehot is not None or grad is not None or x is None or x.shape[0] == 0:
        return ("needs a dense segment alone (no norm-only pass, one-hot segment or "
                "materialized gradient)")
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        return "needs contiguous bf16 weights"
    fmts = {st.fmt for st in states if st is not None}
    if fmts - ({"bf16", "int8"} if split else {"bf16"}):
        return ("needs bf16 states (or int8 in the split design)" if split else
                "needs bf16 states")
    K = w.shape[1]
    if K % 8:
        return "needs K a multiple of 8 (16-byte rows for TMA)"
    if "int8" in fmts and K % 16:
        return "needs K a multiple of 16 with int8 states (16-byte code rows for TMA)"
    for t in (x, dy):
        if t.stride(-1) != 1 or (t.stride(0) * 2) % 16 or t.data_ptr() % 16:
            return "needs x and dy with unit last stride and 16-byte aligned rows and base"
    if w.data_ptr() % 16 or any(st is not None and st.data.data_ptr() % 16 for st in states):
        return "needs W and the states at 16-byte aligned addresses"
    return None


def _layout(block, dtype=gl.bfloat16):
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


class WSLaunch(NamedTuple):
    """A launch of one of the warp-specialized kernels, laid out by fused_wgrad_update_ws:
    kernel[grid](*args, seed, **consts). segments: the positions in args of x's and dy's
    descriptors, each -> a function making that descriptor of a tensor (the geometry is this
    launch's); hp_at: the positions that take hp (its own, and the scales of states that
    have none: never read); sumsq_at: the position of the norm slot."""
    kernel: object
    grid: tuple
    args: list
    seed: int
    consts: dict
    segments: dict
    hp_at: tuple
    sumsq_at: int

    def launch(self) -> None:
        self.kernel[self.grid](*self.args, self.seed, **self.consts)


def gluon_descriptor(t: torch.Tensor, block: list, layout):
    """GluonDescriptor.from_tensor(t, block, layout) without its checks, for a segment of a
    launch whose key (fused_update._signature: shape, strides, dtype, alignment) a checked
    descriptor was made for."""
    d = object.__new__(GluonDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = \
        t, t.shape, t.stride(), block, layout, "zero"
    return d


def fused_wgrad_update_ws(x, dy, w, states, spec, hp, sumsq, seed: int, stochastic: bool,
                          config: dict | None = None, launch: bool = True) -> WSLaunch:
    """fused_update.fused_wgrad_update for an update ws_eligible() accepts (the caller checks
    the shapes, dtypes and hp as that function does). Returns the launch (launch=False: laid
    out only, for the caller to run or bind)."""
    unknown = set(config or {}) - set(WS_DEFAULT)
    if unknown:
        raise ValueError(f"the warp-specialized kernel's config takes {sorted(WS_DEFAULT)}, "
                         f"got {sorted(unknown)}")
    split = bool((config or {}).get("SPLIT", WS_DEFAULT["SPLIT"]))
    cfg = dict(WS_DEFAULT)  # then the split design's own defaults, then the caller's values
    cfg.update(SPLIT_DEFAULT if split else {})
    cfg.update(config or {})
    bt, bn = cfg["BLOCK_T"], cfg["BLOCK_N"]
    if split and (cfg["EPI_BUFS"] not in (1, 2) or cfg["EPI_WARPS"] not in (4, 8)
                  or bn not in (64, 128) or cfg["EPI_GROUPS"] not in (1, 2)
                  or cfg["EPI_BUFS"] < cfg["EPI_GROUPS"]
                  or cfg["EPI_GROUPS"] * cfg["EPI_WARPS"] > 8):
        # (16 epilogue warps leave 80 registers a thread at launch: ptxas refuses a 128-column
        # wgmma instruction; with 64-column ones they compile, spill and are slower)
        raise ValueError(f"SPLIT needs EPI_GROUPS 1 or 2, EPI_BUFS 1 or 2 and at least "
                         f"EPI_GROUPS, EPI_WARPS 4 or 8, BLOCK_N 64 or 128, at most 8 epilogue "
                         f"warps in all, got {cfg['EPI_GROUPS']}, {cfg['EPI_BUFS']}, "
                         f"{cfg['EPI_WARPS']}, {bn}")
    single = cfg["EPI_BUFS"] == 1 and cfg["EPI_GROUPS"] == 1 and not cfg["EPI_GLOBAL"]
    if "EPI_PIPE" not in (config or {}):  # SPLIT_DEFAULT's half-by-half refill where it applies
        cfg["EPI_PIPE"] = cfg["EPI_PIPE"] and single
    if split and cfg["EPI_PIPE"] and not single:
        raise ValueError(f"EPI_PIPE needs EPI_BUFS 1, EPI_GROUPS 1 and EPI_GLOBAL off, got "
                         f"{cfg['EPI_BUFS']}, {cfg['EPI_GROUPS']}, {cfg['EPI_GLOBAL']}")
    if not split and cfg["CONSUMERS"] not in (1, 2):
        raise ValueError(f"CONSUMERS must be 1 or 2, got {cfg['CONSUMERS']}")
    checked = split and bool(cfg["EPI_GLOBAL"]) and cfg["EPI_GROUPS"] == 1
    once = cfg["HP_ONCE"]
    if once is None:
        once = hp_once(checked, x.shape[0], spec.kind, spec.variant)
    elif once and (not checked or (spec.kind, spec.variant) not in HP_ONCE_RULES):
        raise ValueError(f"HP_ONCE needs the split design with EPI_GLOBAL and one epilogue "
                         f"group, and AdamW (with or without amsgrad: HP_ONCE_RULES); got "
                         f"split={split}, EPI_GLOBAL={cfg['EPI_GLOBAL']}, EPI_GROUPS="
                         f"{cfg['EPI_GROUPS']}, rule kind {spec.kind} variant {spec.variant}")
    int8 = any(st is not None and st.fmt == "int8" for st in states)
    if int8 and (not split or cfg["EPI_GROUPS"] != 1):
        raise ValueError("int8 states need the split design (SPLIT=True) with one epilogue "
                         "group")
    N, K = w.shape
    present = spec.present
    nbuf = 1 + sum(present)
    # shared memory: the token ring, the W and state halves, the gradient's halves, barriers
    sets = cfg["EPI_BUFS"] if split else cfg["CONSUMERS"]
    ring = bt * (bn + 2 * 64) * 2
    epi = 2 * sets * bn * 64 * (2 + (nbuf - 1) * (1 if int8 else 2))
    if split and cfg["EPI_GLOBAL"]:
        epi = 8 * 64 * 2  # one small unused buffer
    epi += 2 * cfg["EPI_GROUPS"] * bn * 64 * 4 if split else 0
    if "STAGES" not in (config or {}):  # the default ring, shortened where three states need it
        cfg["STAGES"] = max(2, min(cfg["STAGES"], (SMEM_LIMIT - epi - 1024) // ring))
    if cfg["STAGES"] * ring + epi + 1024 > SMEM_LIMIT:
        raise ValueError(f"the warp-specialized kernel's buffers need "
                         f"{cfg['STAGES'] * ring + epi + 1024} bytes of shared memory "
                         f"(STAGES={cfg['STAGES']}, {nbuf - 1} states), more than {SMEM_LIMIT}")
    # by slot, as the kernel takes them (HAS0..2: RMSprop centered without momentum uses
    # slots 0 and 2); unsigned int8 codes travel as their bytes viewed as int8 (one buffer
    # type for both)
    data = [None if st is None else st.data.view(torch.int8) if int8 else st.data
            for st in states]
    sdt = gl.int8 if int8 else gl.bfloat16
    wdesc = GluonDescriptor.from_tensor(w, [bn, 64], _layout([bn, 64]))
    # an unused slot: W's descriptor and pointer (never read: its HAS is off)
    descs = [wdesc] + [wdesc if t is None else
                       GluonDescriptor.from_tensor(t, [bn, 64], _layout([bn, 64], sdt))
                       for t in data]
    tiles = -(-N // bn) * -(-K // 128)
    # int8 states: even_programs (qkv, proj, fc2, q-fc2 on 128 programs: faster); bf16 states:
    # one program per SM (128 is slower at 512 tokens; see even_programs)
    sms = persistent_programs(w.device)
    grid = (min(tiles, cfg["PROGRAMS"]) if cfg["PROGRAMS"] else
            even_programs(tiles, sms) if int8 else min(tiles, sms),)
    x_geom, dy_geom = ([bt, 128], _layout([bt, 128])), ([bt, bn], _layout([bt, bn]))
    segments = {0: functools.partial(_segment_descriptor, geometry=x_geom),
                1: functools.partial(_segment_descriptor, geometry=dy_geom)}
    args = (GluonDescriptor.from_tensor(x, *x_geom), GluonDescriptor.from_tensor(dy, *dy_geom),
            *descs, hp, sumsq, N, K, x.shape[0])
    common = dict(KIND=spec.kind, VARIANT=spec.variant, HAS0=present[0], HAS1=present[1],
                  HAS2=present[2], W_SR=bool(stochastic), S_SR=bool(stochastic), BLOCK_T=bt,
                  BLOCK_N=bn, STAGES=cfg["STAGES"], GROUP_N=cfg["GROUP_N"], NBUF=nbuf)
    if split:
        # epilogue warps + one MMA warpgroup + two loader warps, padded to whole warpgroups;
        # at launch every thread gets the same share of the 64 K registers, then the
        # partitions trade them (setmaxnreg)
        warps = -(-(cfg["EPI_GROUPS"] * cfg["EPI_WARPS"] + 6 - cfg["EPI_GLOBAL"]) // 4) * 4
        ptrs = [w] + [w if t is None else t for t in data]
        scales = [st.scale if st is not None and st.scale is not None else hp for st in states]
        nonneg = spec.nonneg
        laid = WSLaunch(
            _ws_split_kernel, grid,
            [*args[:6], *ptrs, *args[6:8], *scales, -(-K // 64), *args[8:]],
            seed & 0x7FFFFFFF,
            dict(common, INT8=int8, NN0=nonneg[0], NN1=nonneg[1], NN2=nonneg[2],
                 EPI_BUFS=cfg["EPI_BUFS"], EPI_GLOBAL=bool(cfg["EPI_GLOBAL"]),
                 EPI_PIPE=bool(cfg["EPI_PIPE"]), EPI_GROUPS=cfg["EPI_GROUPS"],
                 EPI_REGS=cfg["EPI_REGS"], MMA_REGS=cfg["MMA_REGS"], HP_ONCE=bool(once),
                 num_warps=cfg["EPI_WARPS"],
                 maxnreg=cfg["maxnreg"] or 65536 // (32 * warps) // 8 * 8),
            segments,
            (10, *(12 + i for i, st in enumerate(states) if st is None or st.scale is None)),
            11)
    else:
        laid = WSLaunch(_ws_kernel, grid, list(args), seed & 0x7FFFFFFF,
                        dict(common, CONSUMERS=cfg["CONSUMERS"],
                             CONSUMER_REGS=cfg["CONSUMER_REGS"],
                             num_warps=cfg["CONSUMER_WARPS"], maxnreg=cfg["maxnreg"]),
                        segments, (6,), 7)
    if launch:
        laid.launch()
    return laid


def _segment_descriptor(t: torch.Tensor, geometry):
    return gluon_descriptor(t, *geometry)


__all__ = ["fused_wgrad_update_ws", "WSLaunch", "gluon_descriptor", "ws_eligible", "even_programs", "hp_once", "WS_DEFAULT",
           "SPLIT_DEFAULT", "SPLIT_LARGE", "HP_ONCE_RULES", "HP_ONCE_MAX_T"]

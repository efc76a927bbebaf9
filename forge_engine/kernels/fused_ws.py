"""The FORGE kernel on Hopper, warp-specialized (Gluon): the epilogue's memory traffic off its
critical path.

Same contract and the same arithmetic as fused_update.py (the gradient tile dY^T X stays in
registers, the rule of optim/rules.py is applied to it, W and the states are written back, the
squared norm is added to sumsq, a tile whose gradient is not finite is not written), organized
so that the epilogue does not wait on global memory:

- one persistent program per SM, in partitions (gl.warp_specialize): a token-loader warp
  streams the dY and X tiles into a ring of STAGES shared-memory slots (TMA); an
  epilogue-loader warp brings the W and state tiles of a consumer's tile into that consumer's
  shared buffers (TMA) while it is still accumulating; the consumer (default: one of 8 warps,
  128 x 128 tiles) accumulates with wgmma. CONSUMERS=2 (two 4-warp consumers on 64 x 128
  tiles) lets them take turns, one's epilogue under the other's token loop.
- the epilogue reads W and the states from shared memory, steps in fp32, writes the results
  back into the same buffers and stores them with TMA: the stores drain while the consumer
  moves on.

Scope (fused_update.fused_wgrad_update routes here only then; ws_eligible says why not):
bf16 W with bf16 states (any rule), a dense segment (no one-hot segment, no materialized
gradient), not the norm-only pass, contiguous W, x and dy TMA-capable, K a multiple of 8,
sm_90 (Gluon's wgmma). Tiles: BLOCK_N rows of W by 128 columns; the epilogue takes the
accumulator's two 64-column halves (a register split) one after the other, each a 128-byte
TMA box row of W and the states. On the H200, after the sixth session's cheaper epilogue, it
was 2 to 6% faster than fused_update.py's kernel on all 16 Llama-3.1-8B / Qwen3-8B shapes at
2048 and 4096 tokens and slower on 6 of 8 at 512 (one run; docs/benchmarks.md, "Sixth kernel
session"): FORGE_WS=auto (the default) takes it above 1024 tokens; FORGE_WS=1 or config
WS=True always.

Gluon kernels do not run under TRITON_INTERPRET; the CPU suite checks the host-side routing
and the GPU tests (tests/test_gpu.py, "ws") check the compiled kernel against the reference.
"""
# no `from __future__ import annotations`: _Shared's field types are checked at trace time
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, \
    warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.language.core import _aggregate as aggregate

from forge_engine.kernels.fused_update import _cuda_properties, _programs, _step_seed, \
    _tile_order
from forge_engine.kernels.quant import random_halves, sr_to_bf16, to_bf16_rn
from forge_engine.optim.rules import apply_rule

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
    hp_ptr: gl.tensor
    sumsq_ptr: gl.tensor
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

    @gluon.constexpr_function
    def __init__(self, x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs, x_bufs,
                 epi_bufs, ready, empty, epi_ready, epi_empty, turn, hp_ptr, sumsq_ptr, seed, N, K,
                 T, KIND, VARIANT, HAS0, HAS1, HAS2, W_SR, S_SR, BLOCK_T, BLOCK_N, STAGES, GROUP_N,
                 NBUF, CONSUMERS, CW):
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
        self.hp_ptr = hp_ptr
        self.sumsq_ptr = sumsq_ptr
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
        pid_n, pid_k = _tile_order(pid + j * nprog, num_n, num_k, p.GROUP_N)
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
def _load_epilogue(p, ROLE: gl.constexpr):
    """Epilogue-loader warp: the W and state tiles of tile j into consumer (j % 2)'s buffers,
    as soon as that consumer has stored its previous tile from them."""
    pid, nprog, num_n, num_k, mine, steps = _my_tiles(p)
    nbytes: gl.constexpr = p.NBUF * 2 * p.w_desc.block_type.nbytes
    for j in range(mine):
        c = j % p.CONSUMERS
        mbarrier.wait(p.epi_empty.index(c), ((j // p.CONSUMERS) & 1) ^ 1)
        bar = p.epi_ready.index(c)
        mbarrier.expect(bar, nbytes)
        pid_n, pid_k = _tile_order(pid + j * nprog, num_n, num_k, p.GROUP_N)
        n0 = pid_n * p.BLOCK_N
        for h in gl.static_range(2):
            k0 = pid_k * 2 * HALF + h * HALF
            base = c * (2 * p.NBUF) + h
            tma.async_copy_global_to_shared(p.w_desc, [n0, k0], bar, p.epi_bufs.index(base))
            i = 1
            if p.HAS0:
                tma.async_copy_global_to_shared(p.s0_desc, [n0, k0], bar,
                                                p.epi_bufs.index(base + 2 * i))
                i += 1
            if p.HAS1:
                tma.async_copy_global_to_shared(p.s1_desc, [n0, k0], bar,
                                                p.epi_bufs.index(base + 2 * i))
                i += 1
            if p.HAS2:
                tma.async_copy_global_to_shared(p.s2_desc, [n0, k0], bar,
                                                p.epi_bufs.index(base + 2 * i))


@gluon.jit
def _round(x, r, SR: gl.constexpr):
    """fp32 -> bf16, stochastically (random bits: the low 16 of r) or to nearest even."""
    if SR:
        return sr_to_bf16(x, r)
    else:
        return to_bf16_rn(x)


@gluon.jit
def _update_part(p, g, c, h: gl.constexpr, offs, write, n0, k0, layout: gl.constexpr):
    """The rule on one [BLOCK_N, HALF] gradient part g: W and the states from consumer c's
    shared buffers, results back into them, then (if `write`) TMA stores to [n0, k0]."""
    base = c * (2 * p.NBUF) + h
    wb = p.epi_bufs.index(base)
    w = wb.load(layout).to(gl.float32)
    s0 = g
    s1 = g
    s2 = g
    i = 1
    if p.HAS0:
        s0 = p.epi_bufs.index(base + 2 * i).load(layout).to(gl.float32)
        i += 1
    if p.HAS1:
        s1 = p.epi_bufs.index(base + 2 * i).load(layout).to(gl.float32)
        i += 1
    if p.HAS2:
        s2 = p.epi_bufs.index(base + 2 * i).load(layout).to(gl.float32)
    w, s0, s1, s2 = apply_rule(w, g, s0, s1, s2, p.hp_ptr, p.KIND, p.VARIANT)
    r_lo, r_hi = random_halves(p.seed, offs, 0)  # W, state 0 (as the Triton kernel)
    wb.store(_round(w, r_lo, p.W_SR))
    i = 1
    if p.HAS0:
        p.epi_bufs.index(base + 2 * i).store(_round(s0, r_hi, p.S_SR))
        i += 1
    r_lo, r_hi = random_halves(p.seed, offs, 1)  # states 1 and 2
    if p.HAS1:
        p.epi_bufs.index(base + 2 * i).store(_round(s1, r_lo, p.S_SR))
        i += 1
    if p.HAS2:
        p.epi_bufs.index(base + 2 * i).store(_round(s2, r_hi, p.S_SR))
    fence_async_shared()
    if write:
        tma.async_copy_shared_to_global(p.w_desc, [n0, k0], wb)
        i = 1
        if p.HAS0:
            tma.async_copy_shared_to_global(p.s0_desc, [n0, k0], p.epi_bufs.index(base + 2 * i))
            i += 1
        if p.HAS1:
            tma.async_copy_shared_to_global(p.s1_desc, [n0, k0], p.epi_bufs.index(base + 2 * i))
            i += 1
        if p.HAS2:
            tma.async_copy_shared_to_global(p.s2_desc, [n0, k0], p.epi_bufs.index(base + 2 * i))


@gluon.jit
def _halves(a, BN: gl.constexpr):
    """[BN, 2 HALF] -> its column halves [BN, HALF] (a register split of the wgmma layout)."""
    return a.reshape([BN, 2, HALF]).permute((0, 2, 1)).split()


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
    for j in range(ROLE, mine if ROLE < p.CONSUMERS else 0, p.CONSUMERS):
        pid_n, pid_k = _tile_order(pid + j * nprog, num_n, num_k, p.GROUP_N)
        # take turns: tile j's token steps start after tile j - 1's were consumed, so the
        # ring's slots are taken in order and no wait is more than one phase ahead of its
        # barrier (a parity wait cannot tell phase u from u + 2)
        if p.CONSUMERS == 2:
            mbarrier.wait(p.turn.index(ROLE), ((j // 2) - 1 + ROLE) & 1, pred=j > 0)
        acc = gl.zeros([BN, 2 * HALF], gl.float32, layout=acc_layout)
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
        if p.CONSUMERS == 2:
            mbarrier.arrive(p.turn.index(1 - ROLE))  # the other consumer's tile j + 1 may start

        sq = gl.sum(gl.sum(acc * acc, axis=1), axis=0)
        gl.atomic_add(p.sumsq_ptr, sq)
        write = sq < float("inf")  # inf or NaN: nothing of the tile is written
        g0, g1 = _halves(acc, BN)
        part: gl.constexpr = g0.type.layout
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, part)).to(gl.int64)
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, part)).to(gl.int64)
        n0 = pid_n * BN
        k0 = pid_k * 2 * HALF
        offs = (n0 + rows)[:, None] * p.K + (k0 + cols)[None, :]  # state offsets n K + k
        mbarrier.wait(p.epi_ready.index(ROLE), (j // p.CONSUMERS) & 1)
        _update_part(p, g0, ROLE, 0, offs, write, n0, k0, part)
        _update_part(p, g1, ROLE, 1, offs + HALF, write, n0, k0 + HALF, part)
        tma.store_wait(0)  # the stores have read the buffers: the loader may refill them
        mbarrier.arrive(p.epi_empty.index(ROLE))


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
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(epi_ready.index(i), count=1)
        mbarrier.init(epi_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    p = _Shared(x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, dy_bufs, x_bufs, epi_bufs,
                ready, empty, epi_ready, epi_empty, turn, hp_ptr, sumsq_ptr,
                _step_seed(seed, hp_ptr), N, K, T, KIND, VARIANT, HAS0, HAS1, HAS2, W_SR, S_SR,
                BLOCK_T, BLOCK_N, STAGES, GROUP_N, NBUF, CONSUMERS, num_warps)
    if CONSUMERS == 2:
        gl.warp_specialize([(_consume, (p, 0)), (_consume, (p, 1)), (_load_tokens, (p, 0)),
                            (_load_epilogue, (p, 0))], [num_warps, 1, 1],
                           [CONSUMER_REGS, 24, 24])
    else:
        gl.warp_specialize([(_consume, (p, 0)), (_load_tokens, (p, 0)),
                            (_load_epilogue, (p, 0))], [1, 1], [24, 24])


# ------------------------------------------------------------------------------- host side

SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 (227 KiB)
# BLOCK_N rows by 128 columns per tile; CONSUMERS 1: one consumer of CONSUMER_WARPS warps
# accumulates and then runs the epilogue, while the loader warps fetch the next tile's tokens
# and this tile's W and states; CONSUMERS 2 (with BLOCK_N 64, 4 warps): two consumers take
# turns, one's epilogue under the other's token loop (slower on the H200: docs/benchmarks.md).
# PROGRAMS: at most this many programs (None: one per SM), for tests and experiments.
WS_DEFAULT = dict(BLOCK_T=64, BLOCK_N=128, STAGES=4, GROUP_N=8, CONSUMER_REGS=232, maxnreg=168,
                  PROGRAMS=None, CONSUMERS=1, CONSUMER_WARPS=8)


def ws_eligible(x, dy, w, states, norm_only=False, onehot=None, grad=None) -> str | None:
    """None if the warp-specialized kernel can take this update, else why not (one line)."""
    if not w.is_cuda or _cuda_properties(w.device).major != 9:
        return "needs an sm_90 GPU (Hopper)"
    if norm_only or onehot is not None or grad is not None or x is None or x.shape[0] == 0:
        return ("needs a dense segment alone (no norm-only pass, one-hot segment or "
                "materialized gradient)")
    if w.dtype != torch.bfloat16 or not w.is_contiguous():
        return "needs contiguous bf16 weights"
    if any(st is not None and (st.fmt != "bf16") for st in states):
        return "needs bf16 states"
    K = w.shape[1]
    if K % 8:
        return "needs K a multiple of 8 (16-byte rows for TMA)"
    for t in (x, dy):
        if t.stride(-1) != 1 or (t.stride(0) * 2) % 16 or t.data_ptr() % 16:
            return "needs x and dy with unit last stride and 16-byte aligned rows and base"
    if w.data_ptr() % 16 or any(st is not None and st.data.data_ptr() % 16 for st in states):
        return "needs W and the states at 16-byte aligned addresses"
    return None


def _layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def fused_wgrad_update_ws(x, dy, w, states, spec, hp, sumsq, seed: int, stochastic: bool,
                          config: dict | None = None) -> None:
    """fused_update.fused_wgrad_update for an update ws_eligible() accepts (the caller checks
    the shapes, dtypes and hp as that function does)."""
    unknown = set(config or {}) - set(WS_DEFAULT)
    if unknown:
        raise ValueError(f"the warp-specialized kernel's config takes {sorted(WS_DEFAULT)}, "
                         f"got {sorted(unknown)}")
    cfg = dict(WS_DEFAULT, **(config or {}))
    bt, bn = cfg["BLOCK_T"], cfg["BLOCK_N"]
    N, K = w.shape
    present = [s is not None for s in spec.slots]
    nbuf = 1 + sum(present)
    # shared memory: the token ring, each consumer's W and state halves, the barriers
    ring, epi = bt * (bn + 2 * 64) * 2, 2 * cfg["CONSUMERS"] * nbuf * bn * 64 * 2
    if "STAGES" not in (config or {}):  # the default ring, shortened where three states need it
        cfg["STAGES"] = max(2, min(cfg["STAGES"], (SMEM_LIMIT - epi - 1024) // ring))
    if cfg["STAGES"] * ring + epi + 1024 > SMEM_LIMIT:
        raise ValueError(f"the warp-specialized kernel's buffers need "
                         f"{cfg['STAGES'] * ring + epi + 1024} bytes of shared memory "
                         f"(STAGES={cfg['STAGES']}, {nbuf - 1} states), more than {SMEM_LIMIT}")
    data = [st.data for st in states if st is not None]
    descs = [GluonDescriptor.from_tensor(t, [bn, 64], _layout([bn, 64]))
             for t in [w] + data]
    while len(descs) < 4:
        descs.append(descs[0])  # an unused slot: any descriptor of the right type
    tiles = -(-N // bn) * -(-K // 128)
    grid = (min(tiles, cfg["PROGRAMS"] or _programs(w.device)),)
    if cfg["CONSUMERS"] not in (1, 2):
        raise ValueError(f"CONSUMERS must be 1 or 2, got {cfg['CONSUMERS']}")
    _ws_kernel[grid](
        GluonDescriptor.from_tensor(x, [bt, 128], _layout([bt, 128])),
        GluonDescriptor.from_tensor(dy, [bt, bn], _layout([bt, bn])),
        *descs, hp, sumsq, N, K, x.shape[0], seed & 0x7FFFFFFF,
        KIND=spec.kind, VARIANT=spec.variant, HAS0=present[0], HAS1=present[1],
        HAS2=present[2], W_SR=bool(stochastic), S_SR=bool(stochastic),
        BLOCK_T=bt, BLOCK_N=bn, STAGES=cfg["STAGES"], GROUP_N=cfg["GROUP_N"],
        NBUF=nbuf, CONSUMERS=cfg["CONSUMERS"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
        num_warps=cfg["CONSUMER_WARPS"],
        maxnreg=cfg["maxnreg"])


__all__ = ["fused_wgrad_update_ws", "ws_eligible", "WS_DEFAULT"]

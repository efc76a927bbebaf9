"""The warp-specialized kernels' shared memory, read from their PTX (built offline for sm_90,
no GPU): no data access may lie on an mbarrier. PTX leaves any access to an initialized
mbarrier's memory other than the mbarrier instructions undefined until mbarrier.inval; where
Triton's allocator puts a reduction's scratch on barriers the kernel never uses, tile norms come
out NaN or short with several processes on one GPU (benchmarks/stress_kernel.py;
fused_ws._invalidate keeps them apart)."""
import re

from forge_engine.kernels import ptx_check

# shaped like the PTX of a SPLIT_LARGE build without fused_ws._invalidate: the epilogue's two
# barriers (unused there) at 196608 and 196616, the tile norm's reduction scratch at 196608 +
# 4 warp
BUGGY = """
	mov.b32 	%r345, global_smem;
	add.s32 	%r337, %r345, 196840;
	@%p24 mbarrier.init.shared::cta.b64 [%r337], 1;
	add.s32 	%r338, %r345, 196608;
	@%p24 mbarrier.init.shared::cta.b64 [%r338], 1;
	add.s32 	%r339, %r345, 196616;
	@%p24 mbarrier.init.shared::cta.b64 [%r339], 1;
	add.s32 	%r156, %r114, 196608;
	@%p11 st.shared.b32 [ %r156 + 0 ], %r157;
	ld.shared.b32 	%r162, [global_smem+196608];
	st.shared.v2.b32 	[%r9+131072], {%r3494, %r3495};
	ld.shared.b8 	%r45, [%r47+196840];
"""


def test_barrier_overlaps_finds_scratch_on_a_barrier():
    """The checker on the buggy layout names both barriers under the scratch (the b8 read of
    the warp-specialize state byte, and data 64 KiB away, are not overlaps); moved off
    them, nothing."""
    check = ptx_check.barrier_overlaps
    assert ptx_check.barrier_offsets(BUGGY) == [196608, 196616, 196840]
    assert check(BUGGY) == ["data at offset 196608 on the mbarrier at 196608",
                            "data at offset 196608 on the mbarrier at 196616"]
    fixed = BUGGY.replace("196608", "196400").replace("196616", "196408") \
        .replace("%r114, 196400", "%r114, 196608").replace("global_smem+196400",
                                                          "global_smem+196608")
    assert check(fixed) == []
    # a scratch word up to 16 bytes below a barrier reaches it (one word per warp)
    assert check(BUGGY.replace("%r114, 196608", "%r114, 196828")) == [
        "data at offset 196608 on the mbarrier at 196608",
        "data at offset 196608 on the mbarrier at 196616",
        "data at offset 196828 on the mbarrier at 196840"]


def test_shipped_ws_kernels_keep_data_off_their_barriers(compile_tool):
    """Every design fused_update routes to, and the documented alternatives, built as a
    launch builds them: no shared data access on an mbarrier (SPLIT_LARGE and WS_DEFAULT
    need fused_ws._invalidate for it)."""
    out = compile_tool("-m", "forge_engine.kernels.ptx_check", "--check-barriers")
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    counts = [re.search(r": (\d+) mbarriers, no data on one$", ln) for ln in lines]
    assert len(lines) == 9 and all(counts), out.stdout
    assert all(int(m.group(1)) >= 10 for m in counts), out.stdout  # ring, epilogue, hand-over

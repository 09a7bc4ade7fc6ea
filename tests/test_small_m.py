"""Small-M (decode) dispatch and split-K: the heuristic table and the compiled reduction (CPU)."""

import re

import pytest

from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection import instances as table
from cutedsl_gemm.tools.ptx_inspect import inspect_instance


def _inst(m, recipe="row", accum="promoted", schedule=None):
    return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, accum, schedule)


def test_small_m_schedule_up_to_128_rows():
    for recipe in ("tensor", "row", "1x128_128x128", "128x128_128x128", "1x128_1x128"):
        assert _inst(1, recipe).schedule == "small_m"
        assert _inst(128, recipe).schedule == "small_m"
        assert _inst(129, recipe).schedule == "cooperative"
    assert _inst(128, accum="fast").schedule == "small_m"
    # A forced schedule serves any M (with its widest tile where M is past its ranges).
    assert _inst(4096, schedule="small_m").schedule == "small_m"
    assert _inst(4096, schedule="small_m").tile_n == 64
    assert _inst(1, schedule="cooperative").schedule == "cooperative"


@pytest.mark.parametrize("recipe", ["tensor", "row", "1x128_128x128", "128x128_128x128", "1x128_1x128"])
def test_decode_kernels_are_swapped_and_as_narrow_as_m(recipe):
    """W rows on WGMMA's M side, the activations on its N side: 16 wide to M=16, 32 to 32, 64 to 128."""
    for m, tile_n in ((1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (128, 64)):
        inst = _inst(m, recipe)
        assert inst.swap_ab and (inst.tile_m, inst.tile_n) == (128, tile_n), inst.name
        assert inst.output_tiles(m, 8192) == 64 * -(-m // tile_n)
    # 256-deep stages only where neither promotion nor block scales work per 128-deep K tile
    assert _inst(128, recipe).tile_k == 128
    if "x128" not in recipe:
        assert _inst(128, recipe, accum="fast").tile_k == 256


@pytest.mark.parametrize(
    "m,n,k,want",
    [(1, 8192, 8192, 1), (128, 8192, 8192, 1), (16, 10240, 8192, 1), (1, 57344, 8192, 1),
     (64, 8192, 28672, 2),  # 64 tiles at 224 K tiles: a whole wave (dispatch runs 128 tiles of 64x64 there)
     (1, 4096, 8192, 2), (1, 576, 7168, 12),  # swapped decode kernels: split below half a wave of tiles
     (1024, 1536, 7168, 2),  # cooperative 128x192 tiles: 64 tiles on 132 SMs
     (1024, 576, 7168, 5),
     (6144, 7168, 2048, 1)],  # plenty of tiles: no split
)
def test_split_heuristic_table(m, n, k, want):
    assert dispatch.choose_splits(_inst(m), m, n, k, slots=132) == want


def test_split_counts_never_leave_a_split_empty():
    for k_tiles in range(1, 80):
        for s in range(1, 20):
            eff = dispatch.normalize_splits(s, k_tiles)
            per = -(-k_tiles // eff)
            assert 1 <= eff <= min(s, k_tiles) and (eff - 1) * per < k_tiles <= eff * per


def test_more_tiles_than_sms_means_no_split():
    inst = _inst(64)
    assert dispatch.choose_splits(inst, 64, 133 * 128, 8192, slots=132) == 1


def test_split_k_instances():
    rows = table.select(arch="sm_90a", op="gemm")
    assert all(r.sm90_config().split_k == (r.tile_n <= 192) for r in rows)
    assert all(r.can_split_k for r in rows if r.accum == "promoted" or r.schedule == "small_m")
    fast_wide = dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 4096, "fast", n=8192, sms=132)
    assert fast_wide.tile_n == 256 and dispatch.choose_splits(fast_wide, 4096, 512, 8192, slots=132) == 1
    # Fast accumulation has the promoted rows' tiles too, and they split like them.
    fast_narrow = dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 1024, "fast", n=576, sms=132)
    assert (fast_narrow.tile_m, fast_narrow.tile_n, fast_narrow.can_split_k) == (64, 96, True)


@pytest.mark.compile
def test_split_k_reduction_in_the_ptx():
    rep = inspect_instance(_inst(16, schedule="small_m"))
    # one acq_rel counter increment per tile, partials written and read back at L2 16 bytes at a time, a
    # device-scope fence
    assert re.search(r"atom\.global(\.gpu)?\.acq_rel(\.gpu)?\.add\.u32", rep.ptx)
    assert re.search(r"st\.global\.cg\.v4\.(f32|b32)", rep.ptx)
    assert re.search(r"ld\.global\.cg\.v4\.(f32|b32)", rep.ptx)
    assert not re.search(r"ld\.global\.cg\.(f32|b32)", rep.ptx)  # no scalar read-back left
    assert re.search(r"fence\.acq_rel\.gpu", rep.ptx)
    # swapped: the 16 activation rows are WGMMA's N
    assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3")
    assert not rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32")
    assert rep.frame_bytes == 0
    # decode kernels use programmatic dependent launch; the producer prefetches its first weight tiles into L2,
    # then waits before its first load into shared memory
    assert "griddepcontrol.wait" in rep.ptx and "griddepcontrol.launch_dependents" in rep.ptx
    wait = rep.ptx.index("griddepcontrol.wait")
    prefetch = re.search(r"cp\.async\.bulk\.prefetch\.tensor\.2d\.L2\.global", rep.ptx)
    assert prefetch and prefetch.start() < wait
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", rep.ptx).start() > wait
    assert _inst(16, schedule="small_m").sm90_config().pdl and not _inst(4096).sm90_config().pdl


@pytest.mark.parametrize("recipe", ["row", "tensor", "1x128_128x128"])
def test_decode_rows_by_wave_cost(recipe):
    """With K unknown (costs per K block): 64-row decode tiles where 128-row ones fill under a wave of SMs,
    128-row ones where the 64-row ones need another wave; from M = 33 the unswapped tiles compete. The swapped
    kernels tile N by tile_m."""
    def pick(m, n):
        return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, "promoted",
                                    n=n, sms=132)
    assert (pick(16, 8192).tile_m, pick(16, 8192).tile_n) == (64, 16)  # 128 tiles, one wave (64 at 128 rows)
    assert (pick(16, 10240).tile_m, pick(16, 10240).tile_n) == (128, 16)  # 80 tiles in one wave vs 160 in two
    assert (pick(64, 8192).tile_m, pick(64, 8192).tile_n, pick(64, 8192).swap_ab) == (64, 64, True)
    assert (pick(64, 57344).tile_m, pick(64, 57344).tile_n, pick(64, 57344).swap_ab) == (64, 64, True)
    assert (pick(128, 8192).tile_m, pick(128, 8192).tile_n, pick(128, 8192).swap_ab) == (64, 128, False)
    wide, narrow = pick(16, 10240), pick(16, 8192)
    # each streams its share of N x 128 bytes of W per K block: 80 tiles at the full rate in one wave, 160 in two
    assert wide.output_tiles(16, 10240) == 80 and narrow.output_tiles(16, 10240) == 160
    assert dispatch.wave_cost(wide, 16, 10240, 132) < dispatch.wave_cost(narrow, 16, 10240, 132)
    assert dispatch.stream_cost(narrow, 16, 10240, 132) < dispatch.stream_cost(wide, 16, 10240, 132)


def test_last_wave_split_variant():
    """A little over whole waves with a long K: the call takes the row's last-wave split sibling, which
    splits only the cluster tiles past the last full wave (split_tiles sizes its workspace)."""
    def row(m, n):
        return dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, m, "promoted", n=n, sms=132)
    # The table's first row (128x192 c2x1), as if dispatch had picked it for M=6144, N=512 (it now takes
    # 128x128 there): 48 x 3 tiles = 72 cluster tiles, 6 past the first wave of 66.
    inst = dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 6144, "promoted")
    assert (inst.tile_m, inst.tile_n, inst.cluster_m, inst.split_tail) == (128, 192, 2, False)
    assert dispatch.choose_splits(inst, 6144, 512, 7168, 132) == 1
    assert dispatch.last_wave_splits(inst, 6144, 512, 7168, 132) == dispatch.MAX_LAST_WAVE_SPLITS == 4
    variant = dispatch.last_wave_variant(inst)
    assert variant.split_tail and variant.name == inst.name.replace("_t128x192", "_lastwave_t128x192")
    assert launch.split_tiles(variant, 6144, 512, 4, 66) == 6 * 2
    assert launch.split_tiles(inst, 1024, 512, 5, 66) == inst.output_tiles(1024, 512)  # ordinary split: every tile
    assert dispatch.last_wave_splits(inst, 1024, 4608, 7168, 132) == 2  # 30 past the wave: 66 // 30
    assert dispatch.last_wave_splits(row(1024, 4608), 1024, 4608, 7168, 132) == 1  # 128x144 has no such variant
    # whole waves, a last wave too full to split, a short K, under one wave, decode: not split this way
    assert dispatch.last_wave_splits(row(8192, 8192), 8192, 8192, 8192, 132) == 1  # 1376 = 20 x 66 + 56
    # more than 4 waves deep (the variant's whole tiles cost more than the split saves); 3.4 waves still split
    assert dispatch.last_wave_splits(inst, 8192, 7168, 7168, 132) == 1  # 1216 = 18 x 66 + 28
    assert dispatch.last_wave_splits(inst, 4096, 7168, 7168, 132) == 1  # 608 = 9 x 66 + 14
    assert dispatch.last_wave_splits(inst, 768, 14336, 7168, 132) == 2  # 225 = 3 x 66 + 27
    assert dispatch.last_wave_splits(inst, 1056, 2304, 7168, 132) == 1  # exactly 4 waves (264): no tail
    assert dispatch.last_wave_splits(inst, 1024, 7168, 2048, 132) == 1
    assert dispatch.last_wave_splits(inst, 6144, 512, 4096, 132) == 1
    assert dispatch.last_wave_splits(row(1024, 512), 1024, 512, 7168, 132) == 1
    assert dispatch.last_wave_splits(row(16, 65536), 16, 65536, 7168, 132) == 1
    # what a call without split_k runs (scaled_mm and the benchmarks that replay it): the variant where it splits,
    # else the row itself with choose_splits' count
    assert dispatch.plan_splits(inst, 6144, 512, 7168, 132) == (variant, 4)
    assert dispatch.plan_splits(inst, 1024, 512, 7168, 132) == (inst, 5) \
        == (inst, dispatch.choose_splits(inst, 1024, 512, 7168, 132))
    assert dispatch.plan_splits(inst, 8192, 7168, 7168, 132) == (inst, 1)
    # never chosen by M range
    picks = [dispatch.select_gemm("sm_90a", r, "e4m3", "e4m3", "bf16", None, m, "promoted", n=n, sms=132)
             for r in ("tensor", "row", "1x128_128x128") for m in (1, 200, 6144) for n in (512, 8192)]
    assert not any(i.split_tail for i in picks)

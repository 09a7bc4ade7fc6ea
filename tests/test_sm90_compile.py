"""Compile-only tier (no GPU): the Hopper kernels hold the instructions we meant."""

import functools
import re
from dataclasses import replace

import pytest

from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmPlan
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection import instances as table
from cutedsl_gemm.tools.ptx_inspect import find_ptxas, ptxas_performance_notes
from cutedsl_gemm.tools.ptx_inspect import inspect_instance as _inspect_uncached

# Several tests read the same dispatched instances (e.g. the DeepSeek 128x128 tile): compile each once.
inspect_instance = functools.lru_cache(maxsize=None)(_inspect_uncached)

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def reports():
    want = [
        ("row", "e4m3", "e4m3", "bf16", None, "promoted"),
        ("tensor", "e5m2", "e4m3", "fp32", "fp32", "promoted"),
        ("row", "e4m3", "e5m2", "fp16", "fp16", "fast"),
        ("1x128_128x128", "e4m3", "e4m3", "bf16", "bf16", "promoted"),
        ("1x128_1x128", "e5m2", "e4m3", "fp32", None, "promoted"),
    ]
    return {w: inspect_instance(dispatch.select_gemm("sm_90a", w[0], w[1], w[2], w[3], w[4], 4096, w[5])) for w in want}


def test_wgmma_with_the_operand_types(reports):
    for (recipe, a, b, out, bias, accum), rep in reports.items():
        inst = dispatch.select_gemm("sm_90a", recipe, a, b, out, bias, 4096, accum)
        n = Sm90GemmPlan.wgmma_n(inst.sm90_config())  # a 192-wide promoted tile issues 96-wide halves
        assert rep.has(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.{a}\.{b}"), rep.name


def test_tma_loads_multicast_and_stores(reports):
    for rep in reports.values():
        assert rep.has(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes"
                       r"\.multicast::cluster")
        assert rep.has(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.tile\.bulk_group")  # TMA store epilogue


def test_register_reallocation_and_no_spills(reports):
    for rep in reports.values():
        assert rep.has(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40\b")
        assert rep.has(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232\b")
        # The default (promoted) path must not spill. The 128x256 fast path with a bias is known to keep a
        # 16 B stack frame (64 per-column scale and bias loads live at once); bound it so it cannot grow.
        limit = 0 if "promoted" in rep.name else 16
        assert rep.frame_bytes <= limit, f"{rep.name} spills ({rep.frame_bytes} B stack frame)"
        assert 0 < rep.registers <= 168


def test_block_scales_ride_the_mainloop_pipeline(reports):
    for (recipe, _a, _b, _out, _bias, _accum), rep in reports.items():
        block = "x128" in recipe
        # 4-byte cp.async of the K tile's scales into its stage, and one noinc arrive per producer lane
        assert rep.has(r"cp\.async\.ca\.shared\.global(\.\w+)*\s+\[[^]]+\],\s*\[[^]]+\],\s*4") == block, rep.name
        assert rep.has(r"cp\.async\.mbarrier\.arrive\.noinc\.shared(::cta)?\.b64") == block, rep.name


def test_straddling_w_block_scales_one_promotion_path():
    """A 192-wide tile starts 0 or 64 columns into its first 128-wide W scale block: the DeepSeek recipe's
    promotion picks each column group's scale with selects, in one copy of its FMAs per K tile of the loop
    (64 x 192 fragment: 96 per thread; the split-N loop promotes two K tiles per trip, an odd one after it
    and the last in either of two drains: 5 copies), not one copy per offset behind a branch (3-4% slower on an
    H100)."""
    inst = dispatch.select_gemm("sm_90a", "1x128_128x128", "e4m3", "e4m3", "bf16", None, 8192, "promoted",
                                n=8192, sms=132, k=8192)
    assert (inst.tile_m, inst.tile_n) == (128, 192), inst.name
    rep = inspect_instance(inst)
    assert len(re.findall(r"\bfma\.rn\.f32\b", rep.ptx)) == 5 * 96, rep.name
    assert rep.has(r"selp\.f32"), rep.name


def test_stmatrix_only_for_16_bit_outputs(reports):
    for (_recipe, _a, _b, out, _bias, _accum), rep in reports.items():
        assert rep.has(r"stmatrix") == (out != "fp32"), rep.name


def test_wgmma_never_serialized():
    """ptxas serializes every WGMMA of a kernel when other instructions may touch in-flight accumulators
    (note C7514); it happened to the promoted tiles <= 128 wide until their fragments were fenced
    (kernels/common/register_fence.py), costing them ~1.4x per K tile. One instance per promoted main loop
    (two alternating fragments: 128x128, 64x64, swapped 128x16 and 64x16; one: 128x192; block scales), and
    the fast one."""
    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("no CUDA toolkit ptxas on this machine (PATH, CUDA_HOME, /usr/local/cuda*)")
    def pick(recipe, m, n, accum="promoted"):
        return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, accum, n=n, sms=132)
    insts = {pick("tensor", 6144, 576), pick("row", 1024, 512), pick("row", 16, 8192), pick("tensor", 8192, 8192),
             pick("1x128_128x128", 6144, 512), pick("1x128_1x128", 16, 8192), pick("row", 8192, 8192, "fast"),
             pick("row", 1024, 576), pick("tensor", 1024, 4608), pick("row", 6144, 512)}
    tiles = {(i.tile_m, i.tile_n, i.swap_ab) for i in insts}
    assert {(128, 128, False), (64, 64, False), (128, 192, False), (128, 256, False), (64, 96, False),
            (128, 144, False), (64, 192, True)} <= tiles
    for inst in insts:
        notes = ptxas_performance_notes(inspect_instance(inst).ptx, inst.arch, ptxas)
        assert not notes, f"{inst.name}: {notes}"


def test_per_tensor_scales_read_once_before_the_tile_loop():
    """The per-tensor scale product is loaded before the first tile's MMAs, not in every tile's epilogue,
    where the loads' latency sat between each tile's main loop and its multiply (2-3% on the DeepSeek-V3
    set on an H100); kernels launched with programmatic dependent launch wait for the
    previous grid before reading them (it may be writing them)."""
    for m, n, k in ((6144, 7168, 2304), (1024, 512, 7168), (16, 8192, 8192)):
        inst = dispatch.select_gemm("sm_90a", "tensor", "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
        ptx = inspect_instance(inst).ptx
        loads = [x.start() for x in re.finditer(r"ld\.global\.(?:nc\.)?[bf]32\s", ptx)]
        assert len(loads) == 2 and max(loads) < ptx.index("wgmma.mma_async"), inst.name
        if inst.sm90_config().pdl:
            waits = [x.start() for x in re.finditer(r"griddepcontrol\.wait", ptx)]
            assert any(w < min(loads) for w in waits), f"{inst.name}: scales read before griddepcontrol.wait"


def test_row_wise_scales_reach_the_epilogue_through_shared_memory():
    """Row-wise, producer warp 1 loads each unit's row and column scales into a shared-memory slot ahead of the
    epilogue (kernels/sm90/unit_scales.py): the kernel's only 32-bit global loads are that warp's, one per 32 of
    the tile's rows and columns, and the consumers read theirs from shared memory (column pairs as one vector).
    Reading them from global memory after the main loop ran row-wise 4-23% behind per-tensor on the same tiles."""
    for m, n, k in ((6144, 7168, 256), (1024, 4096, 512), (16, 8192, 8192), (6144, 2304, 7168)):
        inst = dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
        ptx = inspect_instance(inst).ptx
        loads = re.findall(r"ld\.global\.(?:nc\.)?[bf]32\s", ptx)
        assert len(loads) == inst.tile_m // 32 + -(-inst.tile_n // 32), inst.name
        assert re.search(r"ld\.shared\.v2\.[bf]32\s", ptx) or inst.tile_n <= 16, inst.name


def test_the_row_wise_scale_slot_costs_no_stage():
    """The slot lives in the kernel struct's 1 KiB alignment padding: every row-wise instance has the stages and
    epilogue buffers of the same tile per tensor."""
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm

    for inst in {i for i in table.INSTANCES if i.arch == "sm_90a" and i.op == "gemm" and i.recipe == "row"}:
        cfg = inst.sm90_config()
        twin = replace(cfg, recipe="tensor")
        stages = cfg.stages or Sm90Fp8Gemm.max_stages(cfg)
        assert stages == (twin.stages or Sm90Fp8Gemm.max_stages(twin)), inst.name
        assert Sm90Fp8Gemm.epi_buffers(cfg, stages) == Sm90Fp8Gemm.epi_buffers(twin, stages), inst.name


def test_144_wide_promoted_tiles_overlap_their_promotion():
    """128x144 promoted tiles keep two K-tile fragments (3 x 72 fp32 registers per consumer thread): the
    producer drops to 24 registers so the consumers get 240, and the main loop retires one K tile
    (wait_group 1) while the next runs (M=1024 N=4608: 50.9 us against 55.5 with one fragment)."""
    inst = dispatch.select_gemm("sm_90a", "tensor", "e4m3", "e4m3", "bf16", None, 1024, n=4608, sms=132, k=7168)
    assert (inst.tile_m, inst.tile_n, inst.accum) == (128, 144, "promoted")
    rep = inspect_instance(inst)
    assert rep.has(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24\b")
    assert rep.has(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240\b")
    assert rep.has(r"wgmma\.wait_group\.sync\.aligned\s+1;")
    assert rep.frame_bytes == 0, f"{rep.name} spills ({rep.frame_bytes} B stack frame)"


def test_dispatch_weighs_waves_by_tile_rate():
    """Tensor/row promoted tiles compete by waves x area / measured rate (docs/design.md, "The tile rates")."""
    def pick(m, n):
        return dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, m, n=n, sms=132)
    def shape(i):
        return (i.tile_m, i.tile_n, i.cluster_m, i.cluster_n)
    assert shape(pick(1024, 512)) == (64, 64, 1, 1)  # 128 tiles in one wave: 15.5 us vs 22.0 (128x192, 5 splits)
    # 8 tile rows: 128 128x96 tiles without a cluster in one wave (22.2 us against 23.2 for 128x112 in 2x2
    # clusters), as with fewer rows
    assert shape(pick(1024, 1536)) == (128, 96, 1, 1) and shape(pick(960, 1536)) == (128, 96, 1, 1)
    assert shape(pick(768, 1536)) == (128, 96, 1, 1)
    # 64x128 without a cluster up to M=1024 (M=256 N=4096 K=7168 19.6 us against 26.3 in 1x2), in 1x2 above,
    # where a 1x1 wave would out-bid 128x96 at N=576 (24.1 us against 20.4)
    assert shape(pick(256, 4096)) == (64, 128, 1, 1) and shape(pick(1536, 512)) == (64, 128, 1, 2)
    assert shape(pick(1536, 576)) == (128, 96, 1, 1)
    # two full waves, not one and a sliver; in 4x1 clusters, W tiles multicast to four CTAs: 48.9 vs 56.3 us
    assert shape(pick(6144, 576)) == (128, 128, 4, 1)
    assert shape(pick(1024, 576)) == (64, 96, 2, 2)  # 96 tiles: one wave, 15.7 us vs 21.9 (64x128)
    assert shape(pick(1024, 4608)) == (128, 144, 2, 1)  # 256 tiles in two full waves
    # 256 swapped 64x192 tiles, two CTAs per SM: one wave of 264 slots (43.6 vs 48.0 us for 128x128)
    paired = pick(6144, 512)
    assert shape(paired) == (64, 192, 2, 1) and paired.swap_ab and paired.ctas_per_sm == 2
    assert shape(pick(8192, 8192)) == (128, 192, 2, 1) and shape(pick(6144, 7168)) == (128, 192, 2, 1)
    assert pick(16, 8192).swap_ab  # decode keeps the swapped rows: their rate is 1000, waves decide
    i64, i192 = pick(1024, 512), pick(8192, 8192)
    # one wave each: 64x64 costs its area over its rate, still under a 128x192 tile
    assert dispatch.wave_cost(i64, 1024, 512, 132) == 64 * 64 * 1000 // dispatch.TILE_RATES[(64, 64)]
    assert dispatch.wave_cost(i64, 1024, 512, 132) < dispatch.wave_cost(i192, 1024, 512, 132)


def test_dispatch_counts_the_clusters_that_fit():
    """4-CTA clusters cannot span GPCs: 30 fit on the H100's 132 SMs, not 33 (dispatch.cluster_slots). The
    4x1 row wins only where its waves are no more than 2x1's (tune_tiles on an H100, us)."""
    assert [dispatch.cluster_slots(132, c) for c in (1, 2, 4)] == [132, 66, 30]
    assert dispatch.cluster_slots(1, 4) == 1
    def pick(m, n, k):
        return dispatch.select_gemm("sm_90a", "tensor", "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
    def clusters(i):
        return (i.tile_m, i.tile_n, i.cluster_m, i.cluster_n)
    assert clusters(pick(3072, 576, 7168)) == (128, 128, 4, 1)  # 27.9 vs 30.9
    assert clusters(pick(1024, 7168, 2048)) == (128, 128, 4, 1)  # 31.8 vs 32.2
    # 64 4x1 cluster tiles make three waves of 30 (13.5 us), two of 66 2x1 ones (11.1)
    assert clusters(pick(1024, 4096, 512)) == (128, 128, 2, 1)
    assert clusters(pick(4096, 576, 7168)) == (128, 144, 2, 1)  # 128 tiles in one wave: 31.5 vs 43.0
    assert clusters(pick(2048, 576, 7168)) == (128, 96, 1, 1)  # 22.0 vs 23.5 (in 2x1 clusters then)
    assert clusters(pick(6144, 4096, 4096)) == (128, 192, 2, 1)
    four = next(i for i in table.table() if (i.cluster_m, i.cluster_n, i.recipe) == (4, 1, "tensor"))
    two = replace(four, cluster_m=2)
    # same tiles, the same two waves: the 4x1 rate gain decides
    assert dispatch.wave_cost(four, 6144, 576, 132) < dispatch.wave_cost(two, 6144, 576, 132)
    # M=1024 N=4096: 64 4x1 cluster tiles on 30 slots (3 waves) against 128 2x1 ones on 66 (2)
    assert dispatch.wave_cost(four, 1024, 4096, 132) > dispatch.wave_cost(two, 1024, 4096, 132)


def test_dispatch_gives_short_k_to_two_ctas_per_sm():
    """With K known, a single-CTA tile also pays for its epilogue (dispatch.EPILOGUE_MILLI_K_BLOCKS), which a
    pair of CTAs per SM overlaps: the unswapped 64x192 pair takes K = 256 / 512 at M = 6144, N = 7168 / 4096
    (38.4 vs 44.0 us, 33.6 vs 36.0) and leaves long K to 128x192 (K = 1536: 57.3 vs 51.5)."""
    def pick(m, n, k):
        return dispatch.select_gemm("sm_90a", "tensor", "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
    for m, n, k in ((6144, 7168, 256), (6144, 4096, 512), (1024, 7168, 256)):
        inst = pick(m, n, k)
        assert (inst.tile_m, inst.tile_n, inst.ctas_per_sm, inst.swap_ab) == (64, 192, 2, False), (m, n, k, inst.name)
    for m, n, k in ((6144, 3072, 1536), (6144, 7168, 2048), (8192, 8192, 8192), (1024, 4096, 512)):
        assert pick(m, n, k).ctas_per_sm == 1, (m, n, k)
    # the block-scaled recipes have the same pair row (DeepSeek M=6144, N=7168, K=256: 41.2 vs 46.8 us)
    for recipe in ("1x128_128x128", "128x128_128x128", "1x128_1x128"):
        block = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 6144, n=7168, sms=132, k=256)
        assert (block.tile_m, block.tile_n, block.ctas_per_sm) == (64, 192, 2), block.name
        long_k = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 6144, n=7168, sms=132, k=7168)
        assert long_k.ctas_per_sm == 1, long_k.name
    # K = 0 (unknown) leaves the epilogue out: the old rule, under which the 128x192 tile wins M=6144, N=7168
    assert pick(6144, 7168, 0).tile_m == 128
    pair, wide = pick(6144, 7168, 256), pick(6144, 7168, 0)
    assert dispatch.wave_cost(pair, 6144, 7168, 132, 256) < dispatch.wave_cost(wide, 6144, 7168, 132, 256)
    assert dispatch.wave_cost(pair, 6144, 7168, 132, 7168) > dispatch.wave_cost(wide, 6144, 7168, 132, 7168)


def test_fast_accumulation_dispatch_uses_its_own_rates():
    """use_fast_accum=True has the promoted tiles plus 128x256, weighed by FAST_TILE_RATES."""
    def pick(m, n):
        return dispatch.select_gemm("sm_90a", "tensor", "e4m3", "e4m3", "bf16", None, m, "fast", n=n, sms=132)
    def shape(i):
        return (i.tile_m, i.tile_n, i.cluster_m, i.cluster_n)
    assert shape(pick(1024, 1536)) == (128, 96, 1, 1)  # 24.6 us vs 40.3 for 128x256 (2x1 clusters then)
    assert shape(pick(1024, 576)) == (64, 96, 1, 2)  # 16.1 us vs 39.7 (fast accumulation keeps 1x2 clusters)
    assert shape(pick(1024, 4608)) == (128, 144, 2, 1)  # 51.1 us vs 79.1
    assert shape(pick(8192, 8192)) == (128, 256, 2, 1) and shape(pick(4096, 4096)) == (128, 256, 2, 1)
    fast = pick(8192, 8192)
    assert fast.accum == "fast" and dispatch.tile_rate(fast) == dispatch.FAST_TILE_RATES[(128, 256)]
    assert dispatch.tile_rate(pick(1024, 4608)) == dispatch.FAST_TILE_RATES[(128, 144)] \
        != dispatch.TILE_RATES[(128, 144)]


def test_table_rejects_oversize_tiles_with_reason():
    bad = table.TileConfig("sm_90a", "gemm", "cooperative", ("row",), 128, 256, accum="promoted")
    with pytest.raises(table.InstanceTableError, match="does not fit"):
        table.validate_table(table.expand([bad]))
    too_many = table.TileConfig("sm_90a", "gemm", "cooperative", ("row",), 128, 256, stages=6, accum="fast")
    with pytest.raises(table.InstanceTableError, match="shared memory"):
        table.validate_table(table.expand([too_many]))


def test_table_rejects_bad_decode_tiles_with_reason():
    narrow = table.TileConfig("sm_90a", "gemm", "small_m", ("row",), 128, 8, swap_ab=True)
    with pytest.raises(table.InstanceTableError, match="multiple of 16"):
        table.validate_table(table.expand([narrow]))
    deep_block = table.TileConfig("sm_90a", "gemm", "small_m", ("1x128_128x128",), 128, 16, swap_ab=True, tile_k=256)
    with pytest.raises(table.InstanceTableError, match="needs tile_k=128"):
        table.validate_table(table.expand([deep_block]))


@pytest.mark.parametrize("recipe", ["1x128_128x128", "128x128_128x128", "1x128_1x128"])
def test_dispatch_picks_the_tile_width_by_wave_cost(recipe):
    """N = 512 at M = 6144: 128x192 tiles leave the second wave nearly empty, 128x128 ones do not."""
    def pick(m, n):
        return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=132)
    assert pick(6144, 512).tile_n == 128 and pick(6144, 576).tile_n == 128
    assert pick(8192, 8192).tile_n == 192 and pick(6144, 4608).tile_n == 192
    i128, i192 = pick(6144, 512), pick(8192, 8192)
    assert dispatch.wave_cost(i128, 6144, 512, 132) < dispatch.wave_cost(i192, 6144, 512, 132)
    # without N the table's first row, as before
    first = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 6144)
    assert first.tile_n == 128


def test_dispatch_reads_the_instance_table():
    inst = dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 1000)
    assert inst in table.INSTANCES and inst.accum == "promoted"
    with pytest.raises(dispatch.NoKernelError, match="no kernel instance"):
        dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "int8", None, 10)


def test_two_ctas_per_sm_compile_for_half_an_sm():
    """ctas_per_sm=2: launched at <= 128 registers per thread with .minnctapersm 2 so two CTAs fit, the
    consumer warp group raised to 216 (the pair's 64K registers), half the shared memory each."""
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm, smem_capacity

    inst = dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 6144, n=512, sms=132)
    assert inst.ctas_per_sm == 2
    rep = inspect_instance(inst)
    assert rep.has(r"\.minnctapersm\s+2") and rep.has(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+216\b")
    assert 0 < rep.registers <= 128 and rep.frame_bytes == 0
    assert 2 * (Sm90Fp8Gemm(inst.sm90_config()).smem_bytes + 1024) <= 233472 == smem_capacity(1) + 1024
    with pytest.raises(table.InstanceTableError, match="tile_m=64"):
        table.validate_table(table.expand([table.TileConfig("sm_90a", "gemm", "cooperative", ("row",), 128, 128,
                                                            ctas_per_sm=2)]))


def test_block_scaled_pairs_give_the_consumers_224_registers_and_do_not_spill():
    """Block-scaled tiles with two CTAs per SM: the producer warp group (TMA warp and scale warp) drops to 32
    registers so the consumers get 224. At 40 / 216 the DeepSeek recipe's fp32-output 64x192 pair spilled
    12 bytes (with the scale warp)."""
    inst = next(i for i in table.INSTANCES if i.recipe == "1x128_128x128" and i.ctas_per_sm == 2
                and i.out_dtype == "fp32" and i.bias_dtype == "fp32")
    rep = inspect_instance(inst)
    assert rep.has(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+32\b")
    assert rep.has(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+224\b")
    assert 0 < rep.registers <= 128 and rep.frame_bytes == 0, (rep.registers, rep.frame_bytes)


def test_epilogue_buffers_take_only_what_the_stages_leave():
    """The output slice buffers (Sm90GemmConfig.epi_stages = 0) grow into the shared memory the A/W stages
    leave, up to a whole tile, and never cost a stage: 128x128 bf16 buffers its whole tile (4 slices) at the
    same 6 stages as with 2 buffers; 128x192 gets 3 of its 6 beside its 5 stages."""
    from dataclasses import replace as _replace

    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm, Sm90GemmConfig, smem_capacity

    for inst in {i for i in table.INSTANCES if i.arch == "sm_90a" and i.op == "gemm"}:
        cfg = inst.sm90_config()
        stages = cfg.stages or Sm90Fp8Gemm.max_stages(cfg)
        two = _replace(cfg, epi_stages=2)
        assert stages == (two.stages or Sm90Fp8Gemm.max_stages(two)), inst.name
        epi = Sm90Fp8Gemm.epi_buffers(cfg, stages)
        assert 2 <= epi <= max(2, cfg.tile_n // Sm90Fp8Gemm.epi_n(cfg)), inst.name
        assert Sm90Fp8Gemm.smem_usage(cfg, stages, epi) <= smem_capacity(cfg.ctas_per_sm), inst.name
    cfg = Sm90GemmConfig(recipe="tensor", tile_m=128, tile_n=128, out_dtype="bf16")
    assert (Sm90Fp8Gemm.max_stages(cfg), Sm90Fp8Gemm.epi_buffers(cfg, 6)) == (6, 4)
    cfg = Sm90GemmConfig(recipe="tensor", tile_m=128, tile_n=192, out_dtype="bf16")
    assert (Sm90Fp8Gemm.max_stages(cfg), Sm90Fp8Gemm.epi_buffers(cfg, 5)) == (5, 3)
    with pytest.raises(ValueError, match="epi_stages is 0"):
        Sm90Fp8Gemm.check_config(_replace(cfg, epi_stages=1))


def test_multi_row_clusters_walk_a_band_of_16_cta_rows():
    """The persistent scheduler's raster group (gemm_plan.raster_group_m) spans 16 CTA rows for every
    table row with clusters of 2 or 4 rows: 4x1 clusters walking 8 cluster rows (32 CTA rows) ran narrow outputs
    4-9% slower (M=6144 N=576 K=7168 per-tensor 47.8-49.6 us vs 46.2-46.3 with 4, on an H100). One-row clusters
    keep 8; an explicit group_m overrides the rule."""
    rows = {i.sm90_config() for i in table.INSTANCES if i.arch == "sm_90a" and i.op == "gemm"}
    assert any(c.cluster_m == 4 for c in rows) and any(c.cluster_m == 2 for c in rows)
    for cfg in rows:
        if cfg.cluster_m > 1:
            assert cfg.raster_group_m * cfg.cluster_m == 16, cfg
        else:
            assert cfg.raster_group_m == 8, cfg
        assert replace(cfg, group_m=3).raster_group_m == 3


def test_block_scaled_recipes_weigh_tiles_by_their_own_rates():
    """Block scales cost the 192-wide tiles (one K-tile fragment) more than the 128-wide ones, so the
    block-scaled recipes have their own rates (dispatch.BLOCK_TILE_RATES, DeepSeek recipe on an H100, us):
    M=6144 N=7168 K=2304 128x128 196.7 vs 128x192 204.7 (a wave_cost tie the DeepSeek recipe gives to
    128x192), while 8192^3 stays on 128x192 (1013-1036 vs 1045-1066); 64x128 tiles without a cluster for
    outputs under a wave (M=1024 N=512 K=7168 17.3 vs 19.5), up to M=1024 only."""
    def pick(recipe, m, n, k):
        return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
    def shape(i):
        return (i.tile_m, i.tile_n, i.cluster_m, i.cluster_n)
    for recipe in ("1x128_128x128", "128x128_128x128", "1x128_1x128"):
        want = (128, 192, 2, 1) if recipe == "1x128_128x128" else (128, 128, 2, 1)
        assert shape(pick(recipe, 6144, 7168, 2304)) == want
        assert shape(pick(recipe, 8192, 8192, 8192)) == (128, 192, 2, 1)
        assert shape(pick(recipe, 1024, 512, 7168)) == (64, 128, 1, 1)
        assert pick(recipe, 1152, 512, 7168).tile_m == 128  # the 64-row block row ends at M=1024
    # Per-block W scales (read a K tile ahead in the 192-wide loop) lift 128x192 past the 64x192 pair at short
    # K under a wave (14.3 vs 15.3 us); per-column W scales keep the pair (40.1 vs 37.0 at M=3072).
    for m in (1024, 3072):
        for recipe in ("1x128_128x128", "128x128_128x128"):
            got = pick(recipe, m, 3072, 1536)
            assert shape(got) == (128, 192, 2, 1) and got.ctas_per_sm == 1, (recipe, m, got.name)
        assert pick("1x128_1x128", m, 3072, 1536).ctas_per_sm == 2
    block, tensor = pick("128x128_128x128", 6144, 7168, 2304), pick("tensor", 6144, 7168, 2304)
    assert dispatch.tile_rate(block) == dispatch.BLOCK_TILE_RATES[(128, 128)] != dispatch.TILE_RATES[(128, 128)]
    assert tensor.tile_n == 192  # the epilogue-scaled recipes keep 128x192 there


def test_block_w_recipes_give_wave_ties_to_128x192():
    """Where wave_cost ties 128x192 (two waves) with 128x128 (three), the 2D recipe takes 128x192 from
    K = dispatch.LONG_K (1-9% faster at K >= 7168, mixed at K = 4096, behind at K = 1536) and keeps 128x128
    below it; the DeepSeek recipe takes 128x192 at every K (with the scale warp: 0-8% faster at K = 1536-4096);
    1x128 x 1x128 (per-column W scales) keeps its own rates."""
    def pick(recipe, k):
        return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 3072, n=8192, sms=132, k=k)
    short, long_ = pick("128x128_128x128", dispatch.LONG_K - 128), pick("128x128_128x128", dispatch.LONG_K)
    assert (short.tile_n, long_.tile_n) == (128, 192) and short.cluster_m == long_.cluster_m == 2
    # a tie at the base rates: the long-K rate alone decides it
    k = dispatch.LONG_K
    assert dispatch.wave_cost(short, 3072, 8192, 132) == dispatch.wave_cost(long_, 3072, 8192, 132)
    assert dispatch.wave_cost(long_, 3072, 8192, 132, k) < dispatch.wave_cost(short, 3072, 8192, 132, k)
    assert dispatch.tile_rate(long_, k) > dispatch.tile_rate(long_, k - 1) == dispatch.tile_rate(short, k)
    for k in (1536, 2304, dispatch.LONG_K - 128, dispatch.LONG_K, 8192):
        deepseek = pick("1x128_128x128", k)
        assert (deepseek.tile_m, deepseek.tile_n, deepseek.cluster_m) == (128, 192, 2), (k, deepseek.name)
    # the dsv3 set's tie shapes
    for m, n, k in ((6144, 3072, 1536), (6144, 7168, 2048), (6144, 7168, 2304)):
        inst = dispatch.select_gemm("sm_90a", "1x128_128x128", "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
        assert inst.tile_n == 192
    assert pick("1x128_1x128", dispatch.LONG_K).tile_n == 128


def test_check_config_names_the_recipes_it_knows():
    from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmConfig, Sm90GemmPlan

    with pytest.raises(ValueError, match=r"recipe must be 'tensor', 'row' or one of "
                                         r"\['128x128_128x128', '1x128_128x128', '1x128_1x128'\]"):
        Sm90GemmPlan.check_config(Sm90GemmConfig(recipe="1x32", tile_n=128))


def _op_sequence(ptx, keys):
    """The PTX's instructions among ``keys`` (prefixes), in order, runs of one collapsed: "a b b c" -> a b c."""
    seq = []
    for line in ptx.splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        key = next((k for k in keys if op.startswith(k)), None)
        if key and (not seq or seq[-1] != key):
            seq.append(key)
    return " ".join(seq)


def _release_fences(ptx):
    """``fence.proxy.async.shared::cta`` not followed by the epilogue's named barrier (which fences the output
    slice before its TMA store): the consumers' fences before a stage release."""
    lines = [ln.strip() for ln in ptx.splitlines() if ln.strip() and not ln.strip().startswith("//")]
    return sum(1 for i, ln in enumerate(lines)
               if ln.startswith("fence.proxy.async.shared::cta")
               and not any("bar.sync" in x for x in lines[i + 1:i + 4]))


def test_a_group_scales_may_come_by_tma():
    """A's 1x128 scales ride the stage's TMA loads on the 64-row tiles when the call's layout allows
    (block_scales.a_scale_tma_view): the stage's bytes are chosen at run time (tiles alone, or tiles and the
    64 x 4-byte scale box), and the box is one more load onto the CTA's own barrier. The consumers read those
    scales with ordinary loads and the next refill writes them through the async proxy, so every stage release is
    preceded by a proxy fence (without it the DeepSeek 64x192 pairs read wrong A scales on an H100). The 128-row
    tiles, the split-N pairs and 128x128 A blocks keep the scale warp's copies: no box, no
    fences; kernels that quantize their activations store the W scales from their quantizing warps."""
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm

    own_loads = r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes"

    def row(recipe, tile_m, tile_n, ctas_per_sm=1):
        return next(i for i in table.table() if (i.arch, i.schedule, i.recipe, i.tile_m, i.tile_n, i.ctas_per_sm,
                                                      i.a_dtype, i.b_dtype, i.out_dtype, i.bias_dtype, i.split_tail)
                    == ("sm_90a", "cooperative", recipe, tile_m, tile_n, ctas_per_sm, "e4m3", "e4m3", "bf16", None,
                        False))

    for inst, by_tma in ((row("1x128_128x128", 64, 128), True), (row("1x128_1x128", 64, 128), True),
                         (row("1x128_128x128", 128, 128), False), (row("1x128_128x128", 64, 192, 2), False),
                         (row("128x128_128x128", 64, 128), False)):
        cfg = inst.sm90_config()
        assert Sm90Fp8Gemm(cfg).a_scale_tma == by_tma, inst.name
        ptx = inspect_instance(inst).ptx
        tiles = (cfg.tile_m + cfg.tile_n) * cfg.tile_k
        with_box = re.search(rf"selp\.b32\s+%r\d+,\s*{tiles + 4 * cfg.tile_m},\s*{tiles},\s*%p\d+;", ptx)
        assert bool(with_box) == by_tma, (inst.name, tiles)
        # The A tile, W's where it is not multicast (1x1 clusters) and the scale box load into the CTA alone.
        unicast = 1 + (inst.cluster_m == 1) + by_tma
        assert len(re.findall(own_loads, ptx)) == unicast, inst.name
        assert (_release_fences(ptx) > 0) == by_tma, (inst.name, _release_fences(ptx))
    # A kernel that quantizes its activations stores the W (its A) scales from its quantizing warps: no box too
    quant = next(i for i in table.table() if i.name.startswith("sm_90a_quant_gemm_small_m_1x128_1x128")
                 and i.tile_m == 64)
    assert not Sm90Fp8Gemm(quant.sm90_config()).a_scale_tma, quant.name
    assert len(re.findall(own_loads, inspect_instance(quant).ptx)) == 2, quant.name  # the W and token tiles


def test_block_scales_are_read_before_the_mmas_are_issued():
    """Block-scaled main loops never leave a promotion waiting on shared memory. Two fragments (128x128): a K
    tile's scale products are formed right after its stage's full barrier, before its MMAs, and the
    promotion after the MMA wait is FFMAs only. Split in N (128x192): a K tile's stage wait is followed by its
    issue, and its scales are read right after its half 0 is committed, while the previous K tile's half 1
    runs, the products formed in the promotion -- formed before the issue they sat between the WGMMAs."""
    keys = ("mbarrier.try_wait", "ld.shared", "mul.f32", "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group",
            "fma.rn.f32")
    for m, n, tile_n in ((4096, 4096, 128), (8192, 8192, 192)):
        inst = dispatch.select_gemm("sm_90a", "1x128_128x128", "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=8192)
        assert inst.tile_n == tile_n
        seq = _op_sequence(inspect_instance(inst).ptx, keys)
        if tile_n == 128:
            assert "mbarrier.try_wait ld.shared mul.f32 wgmma.fence" in seq, (inst.name, seq)
            assert "wgmma.wait_group fma.rn.f32" in seq and "wgmma.wait_group mul.f32" not in seq, (inst.name, seq)
        else:
            # The first K tile of an output tile, both of a loop trip and an odd last one.
            assert seq.count("mbarrier.try_wait wgmma.fence") == 4, (inst.name, seq)
            assert seq.count("wgmma.commit_group ld.shared wgmma.wait_group") == 4, (inst.name, seq)
            assert "ld.shared wgmma.fence" not in seq and "mul.f32 wgmma.fence" not in seq, (inst.name, seq)


def test_192_wide_deepseek_tiles_promote_one_n_half_while_the_other_runs():
    """The DeepSeek recipe's 192-wide tiles have registers for one full K-tile fragment beside the
    accumulator; they issue each K tile as two 96-wide halves and retire one at a time (wait_group 1), so a
    warp group's own MMAs run through its promotions; only the drain after the loop waits for everything
    (wait_group 0), once for an even and once for an odd K-tile count (0-8% faster on an H100).
    The other recipes' 192-wide tiles measured slower split and keep the serial loop: 192-wide WGMMAs, each K
    tile retired with wait_group 0."""
    def pick(recipe):
        return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 8192, n=8192,
                                    sms=132, k=8192)
    inst = pick("1x128_128x128")
    assert (inst.tile_n, inst.accum) == (192, "promoted"), inst.name
    ptx = inspect_instance(inst).ptx
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n96k32", ptx), inst.name
    assert not re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n192k32", ptx), inst.name
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count("0") == 2 and waits.count("1") == 8, (inst.name, waits)
    for recipe in ("tensor", "128x128_128x128", "1x128_1x128"):
        inst = pick(recipe)
        assert inst.tile_n == 192, inst.name
        ptx = inspect_instance(inst).ptx
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n192k32", ptx), inst.name
        assert "1" not in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx), inst.name


# The layout checks run in Python while the DSL traces, one per (thread, value): static loops on purpose, nothing
# of them is compiled, so the DSL's advice on long static loops does not apply here.
@pytest.mark.filterwarnings("ignore:This static loop has .* iterations")
def test_split_n_halves_are_the_tiles_fragment_halves():
    """The split-N loop adds half h's 96-wide fragment into elements 48h.. of the 192-wide accumulator and
    gives half h the stage's W rows 96h..: for every consumer thread, element i of the 64 x 96 WGMMA's
    fragment holds the same row, and the column 96h lower, as element 48h + i of the 64 x 192 one's."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode

    bm, bn = 128, 192
    bad, checked = [], []

    def tiled(n):
        return sm90_utils.make_trivial_tiled_mma(cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, OperandMajorMode.K,
                                                 OperandMajorMode.K, cutlass.Float32, (bm // 64, 1, 1),
                                                 tiler_mn=(64, n))

    @cute.jit
    def check():
        full, half = tiled(bn).tv_layout_C_tiled, tiled(bn // 2).tv_layout_C_tiled
        n = cute.size(half, mode=[1])
        assert cute.size(full, mode=[1]) == 2 * n
        for t in cutlass.range_constexpr(bm // 64 * 128):
            for h in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(n):
                    # (thread, value) -> column-major index into the (bm, N) tile
                    r, c = cute.idx2crd(half((t, i)), (bm, bn // 2))
                    got = (int(r), int(c) + h * (bn // 2))
                    want = tuple(int(x) for x in cute.idx2crd(full((t, h * n + i)), (bm, bn)))
                    checked.append(1)
                    if cutlass.const_expr(got != want):
                        bad.append((t, h, i, got, want))
        plain = cute.make_layout((bn, 128, 4))  # the stage's W tile (rows, K, stages), as the loop divides it
        halves = cute.flat_divide(plain, (bn // 2,))
        for h in cutlass.range_constexpr(2):
            for r in cutlass.range_constexpr(bn // 2):
                checked.append(1)
                if cutlass.const_expr(int(halves((r, h, 5, 3))) != int(plain((h * (bn // 2) + r, 5, 3)))):
                    bad.append(("W", h, r))

    cute.compile(check, options="--gpu-arch sm_90a")  # the checks run while it traces
    assert len(checked) == 256 * 96 + 192 and not bad, bad[:5]


def _mma_issue_windows(ptx):
    """The PTX between each ``wgmma.fence`` and the first ``wgmma.mma_async`` after it (one K tile's issue)."""
    windows, cur = [], None
    for line in ptx.splitlines():
        op = line.strip()
        if op.startswith("wgmma.fence"):
            cur = []
        elif cur is not None and op.startswith("wgmma.mma_async"):
            windows.append(cur)
            cur = None
        elif cur is not None:
            cur.append(op)
    return windows


def test_mma_descriptors_come_from_the_warp_groups_uniform_slice():
    """The consumers' A/W descriptors are built from the warp group's first thread, not the thread index: no
    K tile's issue converts a thread-derived 16-bit warp-group index, and inside the K loop only W's
    descriptor start address is masked per tile (A's base stays loop-invariant). Built from the thread index,
    the block-scaled loop rebuilt A's base every K tile and ptxas moved each descriptor over with R2UR."""
    for recipe, m, n, tile_n in (("tensor", 4096, 4096, 128), ("1x128_128x128", 4096, 4096, 128),
                                 ("1x128_128x128", 8192, 8192, 192)):
        inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=8192)
        assert inst.tile_n == tile_n
        windows = _mma_issue_windows(inspect_instance(inst).ptx)
        assert windows, inst.name
        assert not any("cvt.u32.u16" in op for w in windows for op in w), inst.name
        masks = [sum(1 for op in w if re.match(r"and\.b32\s.*, 16320;", op)) for w in windows]
        if tile_n == 192:
            # Split in N: the output tile's first K tile, two per loop trip and an odd last one, two halves each
            # (the first K tile's issue builds the bases).
            assert len(masks) == 8 and max(masks[2:]) <= 1, (inst.name, masks)
        else:
            # The two-fragment loop issues its first K tile before the loop.
            assert max(masks[1:] or masks) <= 1, (inst.name, masks)


def test_consumer_releases_use_the_precomputed_barrier_address():
    """Clustered kernels release a stage with one predicated arrive on an address mapped once per thread
    (kernels/common/stage_release.py): the consumers' PTX maps an empty barrier into the peer CTA's window
    once, not per release (the DSL's release re-derived the lane and the mapping every K tile)."""
    for recipe in ("tensor", "1x128_128x128"):
        inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 4096, n=4096, sms=132, k=4096)
        assert (inst.cluster_m, inst.cluster_n) == (2, 1), inst.name
        ptx = inspect_instance(inst).ptx
        releases = ptx.count("mbarrier.arrive.shared::cluster.b64")
        assert releases >= 4 and ptx.count("@p mbarrier.arrive.shared::cluster.b64") == releases, inst.name
        # The scale warp's cp.async copies address their own CTA's shared memory: nothing else is mapped.
        assert ptx.count("mapa.shared::cluster") == 1, (inst.name, ptx.count("mapa.shared::cluster"))


def test_kernels_trace_without_deprecated_dsl_names(deprecations):
    """Names the DSL deprecates (4.8: ``cutlass.utils.LayoutEnum``, ``utils.SmemAllocator``, ...) warn at every
    user's compile and go away in a later release: the Hopper GEMM (cooperative and swapped decode) traces
    without a DeprecationWarning."""
    from cutedsl_gemm.families.sm90_gemm import compile_gemm
    from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmConfig

    found = deprecations(
        lambda: compile_gemm(Sm90GemmConfig(recipe="1x128_128x128", tile_m=128, tile_n=192, cluster_m=2, stages=4)),
        lambda: compile_gemm(Sm90GemmConfig(recipe="row", tile_m=128, tile_n=16, cluster_m=1, swap_ab=True,
                                            split_k=True)),
    )
    assert not found, found

"""Dispatch's cost model (MMAs against the weight stream) and the picks it makes at decode and mid-M (CPU).
The expected picks are the fastest instances timed on an H100 (docs/design.md, "The wave-cost model")."""

import pytest

from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection import instances as table

SMS = 132
RECIPES = ["tensor", "row", "1x128_128x128", "128x128_128x128", "1x128_1x128"]
MEASURED = ["tensor", "row", "1x128_128x128"]  # the recipes the serving-batch audit timed


def pick(recipe, m, n, k, accum="promoted"):
    return dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, accum, n=n, sms=SMS, k=k)


def shape(inst):
    return inst.tile_m, inst.tile_n, inst.cluster_m, inst.swap_ab


def row(recipe, tile_m, tile_n, cluster_m, accum="promoted", **want):
    rows = table.select(arch="sm_90a", op="gemm", recipe=recipe, a_dtype="e4m3", b_dtype="e4m3", out_dtype="bf16",
                        bias_dtype=None, accum=accum, tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m,
                        split_tail=False, **want)
    assert len(rows) == 1, [r.name for r in rows]
    return rows[0]


def test_wave_cost_is_waves_of_the_longer_of_mmas_and_stream():
    for recipe in ("row", "1x128_128x128"):
        for m, n, k in ((6144, 1536, 7168), (1024, 512, 7168), (6144, 7168, 256), (128, 57344, 8192),
                        (64, 8192, 8192), (16, 10240, 8192), (128, 10240, 0)):
            for inst in table.select(arch="sm_90a", op="gemm", recipe=recipe, a_dtype="e4m3", b_dtype="e4m3",
                                     out_dtype="bf16", bias_dtype=None, accum="promoted", split_tail=False):
                slots = dispatch.cluster_slots(SMS, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm
                waves = -(-inst.cluster_tiles(m, n) // slots)
                epilogue = 0 if inst.ctas_per_sm > 1 else dispatch.EPILOGUE_MILLI_K_BLOCKS
                mma = inst.tile_m * inst.tile_n * 1000 // dispatch.tile_rate(inst, k)
                if k:
                    mma *= 1000 * -(-k // 128) + epilogue
                assert dispatch.mma_cost(inst, k) == mma, inst.name
                stream = dispatch.stream_cost(inst, m, n, SMS, k)
                want = waves * max(mma, stream + mma * dispatch.UNHIDDEN_MILLI // 1000)
                if dispatch.has_estimated_rate(inst):
                    want = want * dispatch.ESTIMATED_RATE_MARGIN // 1000
                assert dispatch.wave_cost(inst, m, n, SMS, k) == want, inst.name


def test_stream_cost_shares_the_unique_bytes_over_the_tiles():
    # M = 128, N = 57344, K = 8192: 896 tiles of 64x128 (two per W tile: one reads it from L2) in 6.8 waves
    wide = row("row", 64, 128, 1, swap_ab=False, cluster_n=1)
    assert wide.output_tiles(128, 57344) == 896
    total = (128 + 57344) * 8192
    assert dispatch.stream_cost(wide, 128, 57344, SMS, 8192) == total * dispatch.STREAM_MILLI_AREA_PER_BYTE // 896
    # under a wave each SM streams faster, up to STREAM_SHARE_CAP times its share: 64 tiles stream as fast as 128
    narrow = row("row", 128, 32, 1, swap_ab=True)
    half, full = row("row", 64, 64, 1, swap_ab=True), row("row", 64, 64, 1, swap_ab=False)
    assert narrow.output_tiles(32, 8192) == 64 and full.output_tiles(64, 8192) == 128
    per_byte = dispatch.STREAM_MILLI_AREA_PER_BYTE
    assert dispatch.stream_cost(narrow, 32, 8192, SMS, 8192) == (32 + 8192) * 8192 * per_byte // 64 // 2
    assert dispatch.stream_cost(full, 64, 8192, SMS, 8192) == (64 + 8192) * 8192 * per_byte // 128 * 128 // 132
    # swapped or not, the same tiles stream the same bytes; two CTAs per SM share its bandwidth
    assert dispatch.stream_cost(half, 64, 8192, SMS, 8192) == dispatch.stream_cost(full, 64, 8192, SMS, 8192)
    pair = row("row", 64, 192, 2, swap_ab=False, ctas_per_sm=2)
    tiles = pair.output_tiles(4096, 4096)
    assert tiles > 2 * SMS
    assert dispatch.stream_cost(pair, 4096, 4096, SMS, 4096) == 8192 * 4096 * per_byte * 2 // tiles
    # K = 0: per K block of A and W, in mma_cost's K = 0 units
    assert dispatch.stream_cost(wide, 128, 57344, SMS) == (128 + 57344) * 128 * per_byte // 896 // 1000


def test_decode_rates():
    # every decode tile of the table is rated (tile_rate raises on one that is not)
    for inst in table.select(arch="sm_90a", op="gemm"):
        if dispatch.is_decode_tile(inst):
            assert 0 < dispatch.tile_rate(inst) < 1000, inst.name
    # the decode 64x64 runs the unswapped 64x64's WGMMAs at its rate, promoted and fast
    for accum, rates in (("promoted", dispatch.TILE_RATES), ("fast", dispatch.FAST_TILE_RATES)):
        assert dispatch.tile_rate(row("row", 64, 64, 1, accum, swap_ab=True)) == rates[(64, 64)]
    assert dispatch.tile_rate(row("1x128_128x128", 64, 64, 1, swap_ab=True)) == 350
    # the swapped two-per-SM pair is rated as a pair, not as a decode tile
    pair = row("row", 64, 192, 2, swap_ab=True, ctas_per_sm=2)
    assert not dispatch.is_decode_tile(pair) and dispatch.tile_rate(pair) == dispatch.PAIRED_TILE_RATES[(64, 192)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_estimated_rates_cost_a_margin(recipe):
    for tile, m in (((64, 32, 1), 32), ((128, 128, 2), 128)):
        inst = row(recipe, *tile, swap_ab=True)
        assert dispatch.has_estimated_rate(inst) and dispatch.tile_rate(inst) == \
            dispatch.ESTIMATED_DECODE_TILE_RATES[tile[:2]]
        for n, k in ((57344, 8192), (3072, 1536)):
            slots = dispatch.cluster_slots(SMS, inst.cluster_m) * inst.ctas_per_sm
            mma, stream = dispatch.mma_cost(inst, k), dispatch.stream_cost(inst, m, n, SMS, k)
            plain = -(-inst.cluster_tiles(m, n) // slots) * max(mma, stream + mma * dispatch.UNHIDDEN_MILLI // 1000)
            assert dispatch.wave_cost(inst, m, n, SMS, k) == plain * dispatch.ESTIMATED_RATE_MARGIN // 1000
    assert not dispatch.has_estimated_rate(row(recipe, 128, 64, 1, swap_ab=True))


@pytest.mark.parametrize("recipe", MEASURED)
@pytest.mark.parametrize("n,k", [(57344, 8192), (8192, 28672), (8192, 8192)])
def test_m_128_takes_the_unswapped_64x128(recipe, n, k):
    """Timed on an H100 at M = 128 (per tensor, N = 57344, K = 8192: 128x64 swapped 217.4 us, 64x128 173.2, cuBLAS
    176.2): the same tiles and bytes, but 64x128's one m64n128 WGMMA per K step outruns 128x64's two m64n64."""
    inst = pick(recipe, 128, n, k)
    assert shape(inst) == (64, 128, 1, False) and inst.schedule == "cooperative", inst.name
    swapped = row(recipe, 128, 64, 1, swap_ab=True)
    assert swapped.output_tiles(128, n) == inst.output_tiles(128, n)
    assert dispatch.wave_cost(inst, 128, n, SMS, k) < dispatch.wave_cost(swapped, 128, n, SMS, k)


@pytest.mark.parametrize("recipe", ["tensor", "row"])
def test_m_128_picks_by_waves(recipe):
    # N = 10240: 107 tiles of 128x96 in one wave (36.9 us) against 160 of 64x128 in 1.2 (43.4)
    assert shape(pick(recipe, 128, 10240, 8192)) == (128, 96, 1, False)
    # N = 28672, K = 4096: 64x96 in 2x2 clusters, 80 streamed rows per CTA (49.4 us; 64x128 49.8, 128x64 55.4)
    inst = pick(recipe, 128, 28672, 4096)
    assert shape(inst) == (64, 96, 2, False) and inst.cluster_n == 2


def test_deepseek_m_128_n_10240_takes_the_pair_split():
    # no 128x96 for block scales: the two-per-SM pair in 2 K splits (42.7 us; 64x128 44.6, 128x64 swapped 55.2)
    inst = pick("1x128_128x128", 128, 10240, 8192)
    ctas = dispatch.cluster_slots(SMS, 2) * 2 * inst.ctas_per_sm  # resident at once: 66 clusters of 2, two per SM
    inst, splits = dispatch.plan_splits(inst, 128, 10240, 8192, ctas)
    assert (shape(inst), inst.ctas_per_sm, splits) == ((64, 192, 2, False), 2, 2)


@pytest.mark.parametrize("recipe", MEASURED)
def test_m_64_keeps_the_decode_tile_where_it_ties(recipe):
    # N = 57344, 8192: 64x64 swapped and unswapped time alike; the tie goes to the decode row (earlier, and it
    # launches behind the previous kernel)
    for n in (57344, 8192):
        assert shape(pick(recipe, 64, n, 8192)) == (64, 64, 1, True)
    # N = 10240 and 28672: 64x128 (36.2 and 46.9 us per tensor) over 128x64 swapped (37.4, 48.4), the same tiles
    for n, k in ((10240, 8192), (28672, 4096)):
        assert shape(pick(recipe, 64, n, k)) == (64, 128, 1, False)


@pytest.mark.parametrize("recipe", MEASURED)
def test_m_32_keeps_the_timed_decode_tiles(recipe):
    # large layers: 128x32 swapped, the fastest timed (57344: 167.6 us per tensor); the estimated 64x32 would stream
    # the same bytes, but its rate's margin leaves the shape to the timed tile
    for n, k in ((57344, 8192), (8192, 8192), (8192, 28672), (10240, 8192), (28672, 4096)):
        assert shape(pick(recipe, 32, n, k)) == (128, 32, 1, True), (n, k)
    # small layers: 24 tiles of 128x32 stream from a fifth of the SMs; 48 of 64x32 without a split
    inst = pick(recipe, 32, 3072, 1536)
    assert shape(inst) == (64, 32, 1, True)
    assert dispatch.plan_splits(inst, 32, 3072, 1536, SMS) == (inst, 1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_cooperative_rows_start_at_m_33(recipe):
    for m in (1, 16, 17, 32):
        for n, k in ((57344, 8192), (8192, 8192), (576, 7168), (3072, 1536)):
            inst = pick(recipe, m, n, k)
            assert dispatch.is_decode_tile(inst) and inst.schedule == "small_m", (m, n, k, inst.name)
    coop = table.select(arch="sm_90a", op="gemm", schedule="cooperative")
    assert coop and min(i.m_min for i in coop) == table.COOPERATIVE_M_MIN == 33
    # a forced cooperative schedule still serves any M
    forced = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 16, schedule="cooperative")
    assert forced.schedule == "cooperative"


@pytest.mark.parametrize("recipe", MEASURED)
def test_decode_picks_that_stay(recipe):
    assert shape(pick(recipe, 16, 8192, 8192)) == (64, 16, 1, True)  # 128 tiles in one wave, not 64
    assert shape(pick(recipe, 16, 10240, 8192)) == (128, 16, 1, True)  # 80 tiles in one wave, not 160 in two
    assert shape(pick(recipe, 16, 57344, 8192)) == (64, 16, 1, True)  # 7 waves of 896 tiles against 4 of 448
    inst = pick(recipe, 1, 576, 7168)
    assert shape(inst) == (64, 16, 1, True) and dispatch.plan_splits(inst, 1, 576, 7168, SMS)[1] == 7
    # large M: the MMAs bind, and the stream term leaves the picks to the waves
    assert not pick(recipe, 256, 57344, 8192).swap_ab
    assert shape(pick(recipe, 8192, 8192, 8192))[:3] == (128, 192, 2)


@pytest.mark.parametrize("recipe", RECIPES)
def test_new_decode_rows(recipe):
    accums = ("promoted", "fast") if recipe in ("tensor", "row") else ("promoted",)
    for accum in accums:
        wide = row(recipe, 128, 128, 2, accum, swap_ab=True)
        assert (wide.m_min, wide.m_max, wide.cluster_n, wide.tile_k) == (65, 128, 1, 128)
        assert wide.can_split_k and wide.sm90_config().pdl and wide.sm90_config().split_k
        narrow = row(recipe, 64, 32, 1, accum, swap_ab=True)
        assert (narrow.m_min, narrow.m_max, narrow.tile_k) == (17, 32, 128) and narrow.sm90_config().pdl
    # with no N to weigh, the first row of the range: the narrowest 128-row tile, as before
    first = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, 128)
    assert shape(first) == (128, 64, 1, True)


def test_wide_decode_tile_splits_below_half_a_wave():
    wide = row("tensor", 128, 128, 2, swap_ab=True)
    assert wide.output_tiles(128, 4096) == 32 and dispatch.choose_splits(wide, 128, 4096, 8192, SMS) == 2
    assert dispatch.choose_splits(wide, 128, 10240, 8192, SMS) == 1  # 80 tiles: more than half of 132
    assert dispatch.plan_splits(wide, 128, 57344, 8192, SMS) == (wide, 1)  # decode tiles have no last-wave split


def test_swapped_tiles_split_to_a_whole_wave_at_long_k():
    """From SWAPPED_FULL_WAVE_K_TILES K tiles a decode tile splits K over all slots, not half: Llama-3-8B's down
    projection (N = 4096, K = 14336) at M = 1 runs 64 tiles of 64 x 16 in 2 splits; at K = 8192 it stays whole."""
    narrow = row("row", 64, 16, 1, swap_ab=True)
    assert narrow.output_tiles(1, 4096) == 64
    assert dispatch.choose_splits(narrow, 1, 4096, 14336, SMS) == 2
    assert dispatch.choose_splits(narrow, 1, 4096, 12288 - 128, SMS) == 1  # 95 K tiles: half the slots, 66 // 64
    assert dispatch.choose_splits(narrow, 1, 4096, 8192, SMS) == 1
    assert dispatch.choose_splits(narrow, 1, 4608, 14336, SMS) == 1  # 72 tiles: a second split would not fit a wave

"""Small-M (decode) GEMMs on the GPU: split-K correctness for every recipe, bitwise determinism, CUDA
graph capture and replay."""

import pytest
import torch
from gpu_operands import block_scaled_operands, torch_scale_layout

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.runtime.device import max_active_clusters
from cutedsl_gemm.selection import dispatch

pytestmark = pytest.mark.gpu

RECIPES = ["tensor", "row", "1x128_128x128", "128x128_128x128", "1x128_1x128"]
MS = [1, 2, 3, 8, 17, 64, 100, 128]
NKS = [(8192, 8192), (1040, 7056), (576, 2048)]  # (1040, 7056): neither N nor K a multiple of the tile


def _call_args(m, n, k, recipe, fa="e4m3", fb="e4m3"):
    qa, sa, qw, sw = block_scaled_operands(m, n, k, fa, fb, recipe)
    rec = cutedsl_gemm.recipe(recipe)
    if recipe == "tensor":
        scale_a, scale_b = sa.reshape(()), sw.reshape(())
    elif recipe == "row":
        scale_a, scale_b = sa.reshape(m, 1).contiguous(), sw.reshape(1, n).contiguous()
    else:
        scale_a, scale_b = torch_scale_layout(sa, rec.a.rows), torch_scale_layout(sw, rec.b.rows).t()
    return (qa, qw.t(), scale_a, scale_b), (qa, sa, qw, sw)


def check_scaled_mm(recipe, m, n, k, seed):
    """scaled_mm through dispatch into a NaN-poisoned output, against the float64 reference."""
    torch.manual_seed(seed)
    args, plain = _call_args(m, n, k, recipe)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cutedsl_gemm.scaled_mm(*args, out=out)
    torch.cuda.synchronize()
    err = R.rel_error(out, R.reference_gemm(*plain, recipe))
    assert err <= 2e-3, f"relative error {err:.3e}"


@pytest.mark.parametrize("n,k", NKS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_small_m_matches_reference(recipe, m, n, k):
    check_scaled_mm(recipe, m, n, k, seed=m * 7 + n + k)


@pytest.mark.parametrize("split_k", [1, 3, 7, 16])
@pytest.mark.parametrize("fast", [False, True])
def test_forced_splits_and_bias(split_k, fast):
    m, n, k = 33, 1040, 7056
    args, plain = _call_args(m, n, k, "row")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cutedsl_gemm.scaled_mm(*args, bias=bias, out=out, split_k=split_k, use_fast_accum=fast)
    err = R.rel_error(out, R.reference_gemm(*plain, "row", bias=bias))
    assert err <= (4e-3 if fast else 2e-3), f"split_k={split_k}: relative error {err:.3e}"


@pytest.mark.parametrize("m", [5, 100])
@pytest.mark.parametrize("recipe", ["tensor", "1x128_128x128"])
@pytest.mark.parametrize("fa,fb,out_dtype,bias_dtype", [
    ("e5m2", "e4m3", torch.float16, torch.float16), ("e4m3", "e5m2", torch.float32, torch.float32),
    ("e5m2", "e5m2", torch.bfloat16, torch.float32), ("e4m3", "e4m3", torch.float32, None)])
def test_swapped_decode_kernels_dtypes_and_bias(recipe, m, fa, fb, out_dtype, bias_dtype):
    """The swapped kernels write D^T through a column-major TMA store and add the bias along their rows."""
    n, k = 1040, 7056
    torch.manual_seed(m + n)
    args, plain = _call_args(m, n, k, recipe, fa, fb)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda", dtype=bias_dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    cutedsl_gemm.scaled_mm(*args, bias=bias, out=out, out_dtype=out_dtype)
    err = R.rel_error(out, R.reference_gemm(*plain, recipe, bias=bias))
    assert err <= 2e-3, f"relative error {err:.3e}"


def test_forced_schedules():
    m, n, k = 256, 2048, 4096
    args, plain = _call_args(m, n, k, "1x128_128x128")
    ref = R.reference_gemm(*plain, "1x128_128x128")
    for kw in (dict(schedule="small_m"), dict(schedule="small_m", split_k=4)):
        out = cutedsl_gemm.scaled_mm(*args, **kw)
        assert R.rel_error(out, ref) <= 2e-3, kw
    out = cutedsl_gemm.scaled_mm(*args, split_k=3)  # the cooperative schedule splits too
    assert R.rel_error(out, ref) <= 2e-3
    with pytest.raises(ValueError, match="split_k must be an int"):
        cutedsl_gemm.scaled_mm(*args, split_k=0)
    with pytest.raises(ValueError, match="schedule must be"):
        cutedsl_gemm.scaled_mm(*args, schedule="pingpong")


@pytest.mark.parametrize("recipe", ["row", "1x128_128x128"])
def test_split_k_is_bitwise_deterministic(recipe):
    m, n, k = 17, 2048, 8192  # 16 output tiles: the heuristic splits K
    args, _ = _call_args(m, n, k, recipe)
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m)
    assert dispatch.choose_splits(inst, m, n, k, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    for split_k in (None, 9):
        first = cutedsl_gemm.scaled_mm(*args, split_k=split_k)
        for _ in range(10):
            again = cutedsl_gemm.scaled_mm(*args, split_k=split_k)
            assert torch.equal(first.view(torch.int16), again.view(torch.int16)), f"split_k={split_k}"


@pytest.mark.parametrize("n", [2048, 8192])  # with and without split-K
@pytest.mark.parametrize("recipe", ["row", "1x128_128x128"])
def test_cuda_graph_capture_and_replay_with_new_inputs(recipe, n):
    m, k = 16, 8192
    args, _ = _call_args(m, n, k, recipe)
    static = [t.clone() for t in args]  # preserve_format keeps the (transposed) strides
    assert all(s.stride() == t.stride() for s, t in zip(static, args))
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    cutedsl_gemm.scaled_mm(*static, out=out)  # compile, size the split-K workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cutedsl_gemm.scaled_mm(*static, out=out)
    for seed in range(3):
        torch.manual_seed(100 + seed)
        new_args, plain = _call_args(m, n, k, recipe)
        for s, t in zip(static, new_args):
            s.copy_(t)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        err = R.rel_error(out, R.reference_gemm(*plain, recipe))
        assert err <= 2e-3, f"replay {seed}: relative error {err:.3e}"


@pytest.mark.parametrize("recipe,m,n", [("tensor", 648, 14144), ("row", 648, 14144), ("1x128_128x128", 1000, 4304)])
def test_last_wave_split_matches_reference_and_is_deterministic(recipe, m, n):
    """A little more than whole waves of tiles: scaled_mm takes the instance's last-wave split variant,
    which runs the full waves whole and splits the rest in K (M=648 and 1000 leave the last tile row
    partial; N=14144 and 4304 are no multiples of the 192-wide tiles; all three run 128x192 c2x1, 3 waves and
    24 cluster tiles, or one wave and 26 (the block-scaled shape, at K >= dispatch.LONG_K), the rest split 2
    ways). Shapes dispatch gives other tiles, so not used here: 1408 x 7104 (128x128 tiles in 4x1 clusters) and
    1664 x 6080 (128x144), which have no last-wave variant; the block-scaled 1152 x 3392 (block 4x1 clusters
    above M = 1024); 3200 x 7296 (7 waves, past the split's four)."""
    k = 6144
    torch.manual_seed(5)
    args, plain = _call_args(m, n, k, recipe)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms, k=k)
    clusters = max_active_clusters(0, inst.cluster_m * inst.cluster_n)
    slots = clusters * inst.cluster_m * inst.cluster_n
    splits = dispatch.last_wave_splits(inst, m, n, k, slots)
    variant = dispatch.last_wave_variant(inst)
    assert inst.output_tiles(m, n) > slots and splits > 1 and variant.split_tail
    assert 0 < launch.split_tiles(variant, m, n, splits, clusters) < inst.output_tiles(m, n)
    ref = R.reference_gemm(*plain, recipe)
    first = None
    for _ in range(3):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        cutedsl_gemm.scaled_mm(*args, out=out)
        assert R.rel_error(out, ref) <= 2e-3
        if first is None:
            first = out
        assert torch.equal(first.view(torch.int16), out.view(torch.int16))


def _decode_row(recipe, tile, accum="promoted", out="bf16", bias=None):
    """The table's swapped decode instance of ``tile`` = (tile_m, tile_n, cluster_m) for e4m3 operands."""
    from cutedsl_gemm.selection import instances as table

    rows = table.select(arch="sm_90a", op="gemm", recipe=recipe, a_dtype="e4m3", b_dtype="e4m3", out_dtype=out,
                        bias_dtype=bias, accum=accum, swap_ab=True, ctas_per_sm=1, tile_m=tile[0],
                        tile_n=tile[1], cluster_m=tile[2])
    assert len(rows) == 1, rows
    return rows[0]


# The decode rows whose token tile is 32 wide (M = 17-32) on 64 W rows, and 128 wide (M = 65-128) in 2x1 clusters,
# run directly (dispatch gives them only some N) on ragged shapes: N and K no multiples of the tiles, and for the
# clusters an odd number of W tiles, so one cluster's second CTA has no rows.
DECODE_ROW_CASES = [((64, 32, 1), m) for m in (17, 27, 32)] + [((128, 128, 2), m) for m in (65, 100, 128)]


@pytest.mark.parametrize("n,k", [(1040, 7056), (8320, 1536)])
@pytest.mark.parametrize("tile,m", DECODE_ROW_CASES)
@pytest.mark.parametrize("recipe,accum", [("tensor", "promoted"), ("row", "promoted"), ("row", "fast"),
                                          ("1x128_128x128", "promoted"), ("128x128_128x128", "promoted"),
                                          ("1x128_1x128", "promoted")])
def test_decode_rows_on_ragged_shapes(recipe, accum, tile, m, n, k):
    from cutedsl_gemm.numerics import scale_layouts

    inst = _decode_row(recipe, tile, accum)
    assert inst.m_min <= m <= inst.m_max
    torch.manual_seed(m + n + k)
    args, plain = _call_args(m, n, k, recipe)
    qa, b, scale_a, scale_b = args
    _, sa_k, sb_k = scale_layouts.resolve(scale_a, scale_b, m, n, k)
    ref = R.reference_gemm(*plain, recipe)
    slots = launch.launch_clusters(0, inst) * inst.cluster_m * inst.cluster_n
    for want in (1, 0, 5):  # unsplit, dispatch's split, forced
        splits = dispatch.splits_for(inst, m, n, k, slots, want)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch.bind(inst, qa, b, sa_k, sb_k, out, splits=splits)()
        torch.cuda.synchronize()
        err = R.rel_error(out, ref)
        assert err <= (4e-3 if accum == "fast" else 2e-3), f"{inst.name} splits={splits}: relative error {err:.3e}"


@pytest.mark.parametrize("recipe", ["tensor", "1x128_128x128"])
def test_wide_token_tile_with_bias_and_fp16_out(recipe):
    """The 128-wide token tile stores D^T through the column-major TMA store and adds the bias along its rows."""
    from cutedsl_gemm.numerics import scale_layouts

    m, n, k = 100, 1040, 7056
    inst = _decode_row(recipe, (128, 128, 2), out="fp16", bias="fp16")
    torch.manual_seed(3)
    args, plain = _call_args(m, n, k, recipe)
    qa, b, scale_a, scale_b = args
    _, sa_k, sb_k = scale_layouts.resolve(scale_a, scale_b, m, n, k)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    launch.bind(inst, qa, b, sa_k, sb_k, out, bias=bias)()
    torch.cuda.synchronize()
    err = R.rel_error(out, R.reference_gemm(*plain, recipe, bias=bias))
    assert err <= 2e-3, f"relative error {err:.3e}"


@pytest.mark.parametrize("recipe", ["tensor", "row", "1x128_128x128"])
@pytest.mark.parametrize("m,n,tile", [(128, 57344, (64, 128, 1, False)), (100, 28672, None),
                                      (32, 3072, (64, 32, 1, True))])
def test_dispatch_takes_the_mid_m_picks(recipe, m, n, tile):
    """Through scaled_mm, ragged M: the unswapped tiles that take mid-M (dispatch.wave_cost); M = 17-32 on a small
    layer fills the SMs with 64-row decode tiles."""
    k = 1536
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms, k=k)
    if tile is not None:
        assert (inst.tile_m, inst.tile_n, inst.cluster_m, inst.swap_ab) == tile, inst.name
    check_scaled_mm(recipe, m, n, k, seed=m)

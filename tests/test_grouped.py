"""The grouped FP8 GEMM without a GPU: argument checks with clear errors, the fake implementation (shapes for
torch.compile, no host synchronisation), the instance rows, and the compiled kernel's PTX (WGMMA e4m3, TMA loads,
the group sizes read from global memory, predicated stores)."""

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cutedsl_gemm.families import sm90_grouped as G
from cutedsl_gemm.ops.grouped import grouped_scaled_mm
from cutedsl_gemm.selection import instances as M

FP8 = torch.float8_e4m3fn
SMS = 132  # an H100 / H200 SXM


def _call(layout="contiguous", recipe="row", e=4, rows=300, n=256, k=512, device="meta", **change):
    """Arguments of a valid call (metadata only on the meta device), with ``change`` replacing some."""
    b = torch.empty(e, n, k, dtype=FP8, device=device).transpose(1, 2)
    if layout == "contiguous":
        a = torch.empty(rows, k, dtype=FP8, device=device)
        sa = torch.empty(rows, 1, device=device) if recipe == "row" else torch.empty(1, device=device)
        groups = {"offs": torch.empty(e, dtype=torch.int32, device=device), "counts": None}
    else:
        a = torch.empty(e, rows, k, dtype=FP8, device=device)
        sa = torch.empty(e, rows, 1, device=device) if recipe == "row" else torch.empty(1, device=device)
        groups = {"offs": None, "counts": torch.empty(e, dtype=torch.int32, device=device)}
    sb = torch.empty(e, 1, n, device=device) if recipe == "row" else torch.empty(e, device=device)
    if recipe == "1x128_128x128":  # quantize_fp8(x, "1x128")'s M-major layout; per expert (K/128, N/128)
        kb, nb = -(-k // 128), -(-n // 128)
        sa = torch.empty(kb, a.shape[0] * (1 if a.dim() == 2 else rows), device=device).t()
        sa = sa if a.dim() == 2 else sa.view(e, rows, kb)
        sb = torch.empty(e, kb, nb, device=device)
    args = {"a": a, "b": b, "scale_a": sa, "scale_b": sb, **groups, "out_dtype": torch.bfloat16, "out": None}
    args.update(change)
    return args


def _describe(args):
    return G.describe(args["a"], args["b"], args["scale_a"], args["scale_b"], args["offs"], args["counts"],
                      args["out_dtype"], args["out"], args.get("expected_rows"))


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["row", "tensor", "1x128_128x128"])
def test_describe_reads_layout_and_recipe(layout, recipe):
    p = _describe(_call(layout, recipe))
    assert (p.layout, p.recipe, p.experts, p.rows, p.n, p.k) == (layout, recipe, 4, 300, 256, 512)
    assert p.out_shape == ((300, 256) if layout == "contiguous" else (4, 300, 256))
    inst = G.select(p, SMS)
    assert (inst.op, inst.schedule, inst.recipe) == (M.GROUPED_GEMM, layout, recipe)
    args = _call(layout, recipe)
    sa, sb = G.kernel_scales(p, args["scale_a"], args["scale_b"])
    if recipe == "1x128_128x128":  # views of the caller's scales: (rows, Kb, groups of a) and (Nb, Kb, E)
        assert tuple(sa.shape) == ((300, 4, 1) if layout == "contiguous" else (300, 4, 4))
        assert tuple(sb.shape) == (2, 4, 4) and sb.stride() == (1, 2, 8)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["row", "tensor", "1x128_128x128"])
def test_the_row_wise_tiles_load_their_scales_early(layout, recipe):
    """At any rows per group and K the row-wise recipe's tiles load their scales early (the 64-row ones as each unit
    starts, the 128-row ones staged in shared memory during the main loop); the other recipes load them (or their
    block scales) after the main loop, and the kernel refuses early row scales for the other recipes."""
    from cutedsl_gemm.kernels.sm90.grouped_gemm import Sm90GroupedGemmConfig

    e = 8
    for rows, k in ((1, 768), (16, 2048), (64, 7168), (65, 768), (300, 7168)):
        shape_rows = rows * e if layout == "contiguous" else rows
        inst = G.select(_describe(_call(layout, recipe, e=e, rows=shape_rows, k=k)), SMS)
        assert inst.tile_m == (64 if rows <= 64 else 128), (rows, k)
        assert inst.early_row_scales == (recipe == "row"), (rows, k, inst.name)
        assert G.config(inst).early_row_scales == inst.early_row_scales
    for tile_m in (64, 128):
        cfg = Sm90GroupedGemmConfig(recipe=recipe, tile_m=tile_m, early_row_scales=True)
        if recipe == "row":
            cfg.check()
        else:
            with pytest.raises(ValueError, match="early row scales are the row-wise recipe's"):
                cfg.check()


BAD = [
    ({"b": torch.empty(4, 256, 512, dtype=FP8, device="meta")}, "K contiguous"),
    ({"a": torch.empty(300, 512, dtype=torch.bfloat16, device="meta")}, "a must be float8_e4m3fn"),
    ({"offs": None}, "needs offs"),
    ({"offs": torch.empty(4, dtype=torch.int64, device="meta")}, r"offs must be a contiguous \(4,\) int32"),
    ({"offs": torch.empty(5, dtype=torch.int32, device="meta")}, r"offs must be a contiguous \(4,\) int32"),
    ({"counts": torch.empty(4, dtype=torch.int32, device="meta")}, "counts is for the masked layout"),
    ({"scale_a": torch.empty(299, 1, device="meta")}, "scales give no grouped recipe"),
    ({"scale_b": torch.empty(4, 1, 256, dtype=torch.float16, device="meta")}, "scale_b must be float32"),
    ({"out_dtype": torch.float32}, "out_dtype must be torch.bfloat16 or torch.float16"),
    ({"out": torch.empty(300, 255, dtype=torch.bfloat16, device="meta")}, r"out must be a contiguous"),
    ({"a": torch.empty(300, 520, dtype=FP8, device="meta"),
      "b": torch.empty(4, 256, 520, dtype=FP8, device="meta").transpose(1, 2)}, "multiple of 16"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_bad_arguments_are_refused_with_what_was_expected(change, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _describe(_call(**change))


def test_masked_layout_checks():
    with pytest.raises(ValueError, match="offs is for the contiguous layout"):
        _describe(_call("masked", offs=torch.empty(4, dtype=torch.int32, device="meta")))
    with pytest.raises(ValueError, match=r"expected \(4, C, 512\)"):
        _describe(_call("masked", a=torch.empty(3, 300, 512, dtype=FP8, device="meta")))
    with pytest.raises(ValueError, match="expected_rows is for the masked layout"):
        _describe(_call(expected_rows=64))
    for bad in (-1, 4 * 300 + 1, 8.0, True, "64"):
        with pytest.raises(ValueError, match=r"expected_rows must be None or an int from 0 to E \* C = 1200"):
            _describe(_call("masked", expected_rows=bad))


@pytest.mark.parametrize("recipe", ["row", "tensor", "1x128_128x128"])
def test_masked_tiles_follow_the_expected_rows(recipe):
    """A masked call sized for full groups of C rows takes the tiles of its expected rows when told them: a decode
    batch of 128 tokens of top-8 over 128 experts whose capacity is 100 has 8 rows per group, not 100."""
    e, c, n = 128, 100, 1536
    full = _describe(_call("masked", recipe, e=e, rows=c, n=n, k=512))
    told = _describe(_call("masked", recipe, e=e, rows=c, n=n, k=512, expected_rows=128 * 8))
    assert (full.rows_per_group, full.total_rows) == (100, e * c)
    assert (told.rows_per_group, told.total_rows) == (8, 1024)
    assert G.select(full, SMS).tile_m == 128 and G.select(told, SMS).tile_m == 64
    assert G.select(told, SMS).tile_n == (128 if recipe == "1x128_128x128" else 256)  # 128 groups x 12 tiles
    # at C = 1 the groups hit are known only from the hint: 8 pairs of one token
    one = _describe(_call("masked", recipe, e=e, rows=1, n=3072, k=512, expected_rows=8))
    assert one.rows_per_group == 1 and G.wide_tiles_pay(one, SMS)  # 8 x 24 tiles
    assert not G.wide_tiles_pay(_describe(_call("masked", recipe, e=e, rows=1, n=3072, k=512)), SMS)
    assert _describe(_call("masked", recipe, e=e, rows=c, n=n, k=512, expected_rows=0)).rows_per_group == 0


def test_a_cpu_call_is_refused_after_its_checks():
    args = _call(device="cpu")
    args["offs"] = torch.full((4,), 75, dtype=torch.int32).cumsum(0).int()
    args = {k: (v.fill_(1) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v) for k, v in args.items()}
    with pytest.raises(ValueError, match="runs on Hopper"):
        grouped_scaled_mm(**args)


class _NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor's values to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            raise AssertionError(f"host synchronisation: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fake_gives_the_shape_without_reading_values(layout):
    args = _call(layout)
    with _NoHostSync():
        out = torch.ops.cutedsl_gemm.grouped_scaled_mm(args["a"], args["b"], args["scale_a"], args["scale_b"],
                                                        args["offs"], counts=args["counts"],
                                                        out_dtype=torch.float16)
        p = _describe(args)
        G.kernel_scales(p, args["scale_a"], args["scale_b"])
    assert out.shape == p.out_shape and out.dtype == torch.float16


def test_traced_by_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx

    args = _call()

    def f(a, b, sa, sb, offs):
        return grouped_scaled_mm(a, b, sa, sb, offs) * 2

    graph = make_fx(f, tracing_mode="fake")(args["a"], args["b"], args["scale_a"], args["scale_b"], args["offs"])
    assert any("grouped_scaled_mm" in str(node.target) for node in graph.graph.nodes)
    # masked, with the expected rows: the op records them
    args = _call("masked")

    def g(a, b, sa, sb, counts):
        return grouped_scaled_mm(a, b, sa, sb, counts=counts, expected_rows=96)

    graph = make_fx(g, tracing_mode="fake")(args["a"], args["b"], args["scale_a"], args["scale_b"], args["counts"])
    node, = (node for node in graph.graph.nodes if "grouped_scaled_mm" in str(node.target))
    assert node.kwargs["expected_rows"] == 96


def test_rows_validate_and_cover_both_layouts():
    rows = M.select(op=M.GROUPED_GEMM)
    from cutedsl_gemm.kernels.sm90.grouped_gemm import GROUPED_LAYOUTS, GROUPED_RECIPES

    assert {(i.schedule, i.recipe) for i in rows} == {(lay, r) for lay in GROUPED_LAYOUTS for r in GROUPED_RECIPES}
    for inst in rows:
        M.validate(inst)
    with pytest.raises(M.InstanceTableError, match="tile"):
        from dataclasses import replace

        M.validate(replace(rows[0], tile_n=192))


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("rows, e, tile_m", [(300, 4, 128), (256, 4, 64), (257, 4, 128), (64, 256, 64),
                                             (1, 1, 64), (0, 4, 64)])
def test_tile_rows_follow_the_rows_per_group(layout, rows, e, tile_m):
    """64-row tiles up to 64 rows per group (contiguous: the mean T / E; masked: the capacity C), 128 above."""
    masked_rows = -(-rows // e) if layout == "masked" else rows  # the same rows per group in both layouts
    p = _describe(_call(layout, "row", e=e, rows=masked_rows, n=256, k=256))
    assert p.rows_per_group == -(-rows // e) and G.select(p, SMS).tile_m == tile_m


@pytest.mark.parametrize("recipe", ["row", "tensor", "1x128_128x128"])
@pytest.mark.parametrize("layout, e, rows, n, wide", [
    ("contiguous", 128, 8, 1536, False),    # 8 groups x 12 tiles of 128: one wave
    ("contiguous", 128, 8, 2048, False),    # 8 x 16 = 128 <= 132
    ("contiguous", 128, 8, 3072, True),     # 8 x 24 = 192: more than one wave
    ("contiguous", 128, 128, 1536, True),   # 128 groups hold rows
    ("contiguous", 256, 8, 4096, True),
    ("masked", 128, 1, 4096, False),        # C = 1: how many groups are hit is unknown
    ("masked", 128, 4, 1536, True),         # C > 1: every group
    ("masked", 8, 4, 1024, False),          # 8 x 8 = 64
])
def test_wide_decode_tiles_where_the_narrow_ones_fill_more_than_a_wave(layout, e, rows, n, wide, recipe):
    """Up to 64 rows per group, per tensor and row-wise: 64x256 tiles where the 64x128 tiles of the groups expected
    to hold rows fill more than a wave of SMs, 64x128 otherwise; the DeepSeek recipe keeps 64x128."""
    p = _describe(_call(layout, recipe, e=e, rows=rows, n=n, k=512))
    inst = G.select(p, SMS)
    assert G.wide_tiles_pay(p, SMS) == wide
    assert (inst.tile_m, inst.tile_n) == ((64, 256) if wide and recipe != "1x128_128x128" else (64, 128))
    assert inst.early_row_scales == (recipe == "row")
    assert G.select(p, 10_000).tile_n == 128  # a GPU this wide takes each of them in one wave


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["row", "tensor", "1x128_128x128"])
def test_many_rows_per_group_take_the_128x192_tile_where_measured(layout, recipe):
    """From 65 rows per group: 128x192 in both layouts for the per-tensor and row-wise recipes, 128x128 for the
    DeepSeek recipe."""
    p = _describe(_call(layout, recipe, e=8, rows=4096 if layout == "contiguous" else 512, n=2048, k=512))
    inst = G.select(p, SMS)
    serial = recipe != "1x128_128x128"
    assert (inst.tile_m, inst.tile_n) == ((128, 192) if serial else (128, 128))
    M.validate(inst)


@pytest.mark.parametrize("recipe", ["row", "tensor", "1x128_128x128"])
@pytest.mark.parametrize("layout, rows, k, clustered", [
    ("contiguous", 8 * 4096, 14336, True),   # Mixtral's down projection at 16384 tokens
    ("contiguous", 8 * 4096, 8192, True),
    ("contiguous", 8 * 4095, 14336, False),  # fewer rows a group than the clustered row's M range
    ("contiguous", 8 * 4096, 4096, False),   # short K: Mixtral's gate_up
    ("contiguous", 8 * 4096, 8176, False),
    ("masked", 4096, 14336, False),          # the masked layout has no clustered row
])
def test_clusters_where_k_is_long_and_groups_are_large(layout, rows, k, clustered, recipe):
    """The 128x192 tile in 2x1 clusters for contiguous groups of >= 4096 rows at K >= CLUSTER_MIN_K, per tensor and
    row-wise; lone CTAs everywhere else, and always for the DeepSeek recipe."""
    p = _describe(_call(layout, recipe, e=8, rows=rows, n=512, k=k))
    inst = G.select(p, SMS)
    assert G.clusters_pay(p) == (k >= G.CLUSTER_MIN_K)
    want = clustered and recipe != "1x128_128x128"
    assert inst.cluster_m == (2 if want else 1), inst.name
    if want:
        assert (inst.tile_m, inst.tile_n) == (128, 192)
    M.validate(inst)


@pytest.mark.parametrize("band", [1, 8])
@pytest.mark.parametrize("tiles_m, tiles_n", [(1, 224), (32, 224), (9, 3), (17, 5), (8, 1)])
def test_each_group_walks_its_tiles_once_in_bands(tiles_m, tiles_n, band):
    """A group's units map onto its tiles one to one (banded_coords, as the kernel walks them), and the first
    ``band * tiles_n`` units stay inside the first band's rows: a wave shares W tiles among a band's rows (band 1:
    N fastest)."""
    from cutedsl_gemm.kernels.common.tile_scheduler import banded_coords

    tiles = [tuple(int(v) for v in banded_coords(u, tiles_m, tiles_n, band)) for u in range(tiles_m * tiles_n)]
    assert sorted(tiles) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
    first = tiles[:min(band, tiles_m) * tiles_n]
    assert {m for m, _ in first} == set(range(min(band, tiles_m)))
    assert [m for m, _ in tiles[:min(band, tiles_m)]] == list(range(min(band, tiles_m)))  # M fastest


@pytest.mark.parametrize("rows", [1, 128, 129, 256, 300, 640])
@pytest.mark.parametrize("band", [1, 8])
def test_a_clusters_pair_of_tiles_covers_its_groups_rows_once(rows, band):
    """2x1 clusters: the walk's m tiles are a cluster's (walk_m rows), each CTA takes tile mt * 2 + rank of them;
    every 128-row tile of the group is some CTA's exactly once per n tile, and a tile past the group (rank 1 of the
    last pair of an odd count) is the only one loaded and not stored."""
    from cutedsl_gemm.kernels.common.tile_scheduler import banded_coords
    from cutedsl_gemm.kernels.sm90.grouped_gemm import Sm90GroupedGemmConfig, grouped_kernel

    kernel = grouped_kernel(Sm90GroupedGemmConfig(recipe="row", tile_m=128, tile_n=128, cluster_m=2))
    assert (kernel.walk_m, kernel.cluster_m) == (256, 2)
    tiles_n, tile_m = 3, 128
    walk_tiles = -(-rows // kernel.walk_m)
    stored, past = [], []
    for unit in range(walk_tiles * tiles_n):
        mt, tn = (int(v) for v in banded_coords(unit, walk_tiles, tiles_n, band))
        for rank in range(kernel.cluster_m):
            own = mt * kernel.cluster_m + rank
            (stored if own * tile_m < rows else past).append((own, tn))
    tiles_m = -(-rows // tile_m)
    assert sorted(stored) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
    assert sorted(past) == ([(tiles_m, n) for n in range(tiles_n)] if tiles_m % 2 else [])


def test_bands_only_where_an_experts_weight_overflows_l2():
    """N fastest (band 1) while one expert's W fits in L2; bands past it (Mixtral's gate_up, 112 MiB of e4m3)."""
    from cutedsl_gemm.kernels.sm90.grouped_gemm import RASTER_GROUP_M

    l2 = 50 << 20
    assert G.band_m(28672, 4096, "e4m3", l2) == RASTER_GROUP_M > 1
    assert G.band_m(4096, 7168, "e4m3", l2) == 1  # DeepSeek-V3's gate_up, 28 MiB
    assert G.band_m(4096, 7168, "e4m3", 16 << 20) == RASTER_GROUP_M  # the same weight, a smaller L2
    assert G.band_m(1024, 1024, "e4m3", 1 << 20) == 1  # exactly L2's size still fits


def _plain_128_row_tile(layout: str, recipe: str, tile_n: int = 128, cluster_m: int = 1):
    """The table's lone-CTA 128-row instance of ``layout`` and ``recipe`` as a tile_m x ``tile_n`` kernel in
    ``cluster_m`` x 1 clusters, its scales loaded after the main loop."""
    import dataclasses

    base = M.select(op=M.GROUPED_GEMM, schedule=layout, recipe=recipe, out_dtype="bf16", tile_m=128, cluster_m=1)[0]
    return dataclasses.replace(base, tile_n=tile_n, cluster_m=cluster_m, early_row_scales=False)


@pytest.mark.compile
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_ptx_holds_wgmma_tma_and_group_reads(layout):
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    inst = _plain_128_row_tile(layout, "row")
    rep = inspect_instance(inst)
    assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3")
    tma = set(re.findall(r"cp\.async\.bulk\.tensor\.(\dd)\.shared::cta\.global\.tile", rep.ptx))
    # W is (N, K, E); A (T, K) contiguous, (C, K, E) masked
    assert tma == ({"2d", "3d"} if layout == "contiguous" else {"3d"}), tma
    # the scheduler's group sizes (and the row scales) come from global memory; D is stored from registers
    # (a TMA store would clip at the tensor's edge, not the group's)
    assert len(re.findall(r"ld\.global(?:\.nc)?\.b32", rep.ptx)) >= 2
    assert rep.has(r"st\.global\.b16") and not rep.has(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared")
    assert rep.has(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232\b")
    assert rep.frame_bytes == 0, f"{rep.name} spills"


@pytest.mark.compile
@pytest.mark.parametrize("tile_n", [128, 192])
def test_clustered_tiles_multicast_w_to_the_pair_of_m_tiles(tile_n):
    """The 2x1-cluster kernel option: W's K tiles by a multicast TMA (each CTA loads its half for both), A's by a
    plain one, the CTA's rank in the cluster read, stages released to the peer through a remote barrier, no
    spills."""
    import dataclasses

    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    inst = _plain_128_row_tile("contiguous", "row", tile_n=tile_n, cluster_m=2)
    assert G.config(inst).cluster_m == 2 and "c2x1" in inst.name
    rep = inspect_instance(inst)
    loads = {(op.split(".")[4], op.split(".")[5], ".multicast::cluster" in op)
             for op in re.findall(r"cp\.async\.bulk\.tensor\.\S+", rep.ptx)}
    # A (T, K) into this CTA's stage; W (N, K, E) multicast to the cluster's
    assert loads == {("2d", "shared::cta", False), ("3d", "shared::cluster", True)}, loads
    assert rep.has(r"%cluster_ctarank") and rep.has(r"mapa\.shared::cluster")
    assert rep.has(r"barrier\.cluster\.arrive") and rep.has(r"barrier\.cluster\.wait")
    assert rep.frame_bytes == 0, f"{rep.name} spills"
    with pytest.raises(ValueError, match="2 CTAs along M with 128-row tiles"):
        dataclasses.replace(G.config(inst), recipe="1x128_128x128", tile_n=128).check()
    with pytest.raises(ValueError, match="2 CTAs along M with 128-row tiles"):
        dataclasses.replace(G.config(inst), tile_m=64, tile_n=128, early_row_scales=False).check()


@pytest.mark.filterwarnings("ignore:This static loop has .* iterations")  # trace-time checks, nothing compiled
@pytest.mark.parametrize("bm, bn, groups_n", [(64, 128, 1), (128, 128, 1), (64, 256, 2), (128, 192, 1)])
def test_fragment_pairs_are_adjacent_columns_of_one_row(bm, bn, groups_n):
    """The epilogue stores fragment elements 2j and 2j + 1 as one 32-bit word: for every consumer thread they are
    columns c and c + 1 of one row of the tile, c even; the threads' elements cover the tile once (64x256: two warp
    groups side by side along N)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode

    bad, seen = [], set()

    @cute.jit
    def check():
        tv = sm90_utils.make_trivial_tiled_mma(cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, OperandMajorMode.K,
                                               OperandMajorMode.K, cutlass.Float32, (bm // 64, groups_n, 1),
                                               tiler_mn=(64, bn // groups_n)).tv_layout_C_tiled
        values = cute.size(tv, mode=[1])
        for t in cutlass.range_constexpr(bm // 64 * groups_n * 128):
            for j in cutlass.range_constexpr(values // 2):
                r0, c0 = (int(x) for x in cute.idx2crd(tv((t, 2 * j)), (bm, bn)))
                r1, c1 = (int(x) for x in cute.idx2crd(tv((t, 2 * j + 1)), (bm, bn)))
                seen.update({(r0, c0), (r1, c1)})
                if cutlass.const_expr((r1, c1) != (r0, c0 + 1) or c0 % 2):
                    bad.append((t, j, (r0, c0), (r1, c1)))

    cute.compile(check, options="--gpu-arch sm_90a")  # the checks run while it traces
    assert len(seen) == bm * bn and not bad, bad[:4]


@pytest.mark.compile
def test_grouped_epilogue_pairs_its_stores():
    """Two bf16 columns per 32-bit store where N is even (half the store instructions), 16-bit ones otherwise."""
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    inst = _plain_128_row_tile("contiguous", "row")
    rep = inspect_instance(inst)
    # a thread's 64 elements of the 128 x 128 tile: 32 pairs
    assert len(re.findall(r"st\.global\.b32", rep.ptx)) == 128 * 128 // 256 // 2
    assert rep.has(r"st\.global\.b16")


@pytest.mark.compile
def test_block_scaled_ptx_stages_scales_in_the_mainloop():
    """The DeepSeek recipe: the scale warp's cp.async copies arrive on the stage's full barrier (noinc), and the
    promotion multiplies each K tile's fragment by its scales (fma) before adding it."""
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    inst = M.select(op=M.GROUPED_GEMM, schedule="contiguous", recipe="1x128_128x128", out_dtype="bf16",
                    tile_m=128)[0]
    rep = inspect_instance(inst)
    assert rep.has(r"cp\.async\.ca\.shared\.global\s+\[[^]]+\], \[[^]]+\], 4")
    assert rep.has(r"cp\.async\.mbarrier\.arrive\.noinc\.shared")
    assert len(re.findall(r"\bfma\.rn\.f32\b", rep.ptx)) >= 2 * 64  # both fragments' 64 elements a K tile
    assert rep.frame_bytes == 0, f"{rep.name} spills"


@pytest.mark.parametrize("tile_m, tile_n, recipe, ok", [
    (64, 256, "row", True), (64, 256, "tensor", True), (128, 256, "row", False), (64, 256, "1x128_128x128", False),
    (64, 192, "row", False), (64, 128, "row", True), (128, 192, "row", True), (128, 192, "tensor", True),
    (128, 192, "1x128_128x128", False)])
def test_the_wide_tiles_are_the_epilogue_scaled_recipes(tile_m, tile_n, recipe, ok):
    from cutedsl_gemm.kernels.sm90.grouped_gemm import Sm90GroupedGemmConfig

    cfg = Sm90GroupedGemmConfig(recipe=recipe, tile_m=tile_m, tile_n=tile_n)
    if ok:
        cfg.check()
    else:
        with pytest.raises(ValueError, match="64x256|128x192|two warp groups|serial promotion"):
            cfg.check()


@pytest.mark.compile
@pytest.mark.parametrize("early", [False, True])
def test_the_wide_tile_runs_two_warp_groups_side_by_side(early):
    """64x256: two consumer warp groups, each a 64x128 WGMMA over its half of the W tile (one 256-row TMA box), its
    half's 64 elements a thread stored as 32 paired words, no spills."""
    import dataclasses

    from cutedsl_gemm.families import sm90_grouped as G
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    inst = M.select(op=M.GROUPED_GEMM, schedule="contiguous", recipe="row", out_dtype="bf16", tile_m=64)[0]
    wide = dataclasses.replace(inst, tile_n=256, early_row_scales=early)
    rep = inspect_instance(wide)
    assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3")
    assert rep.has(r"\.reqntid 384\b") or rep.has(r"\.maxntid 384\b")
    assert len(re.findall(r"st\.global\.b32", rep.ptx)) == 64 * 128 // 128 // 2
    assert rep.frame_bytes == 0, f"{rep.name} spills"
    smem, stages = G.resources(wide)
    assert stages == 5 and smem == 1024 + 5 * (64 + 256) * 128


@pytest.mark.compile
@pytest.mark.parametrize("layout, tile_n, cluster_m", [("contiguous", 192, 1), ("masked", 128, 1),
                                                       ("contiguous", 192, 2)])
def test_128_row_tiles_read_staged_row_scales_from_shared_memory(layout, tile_n, cluster_m):
    """Row-wise 128-row tiles with early row scales: warp 1 loads each unit's tile_m row and tile_n column scales
    (one per lane a load) and stores them into the slot, the consumers read them from shared memory instead of
    global memory, one more mbarrier wait on each side, the slot's bytes in the plan, no spills."""
    import dataclasses

    from cutedsl_gemm.kernels.sm90.grouped_gemm import StagedRowScales, grouped_kernel
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    plain = _plain_128_row_tile(layout, "row", tile_n=tile_n, cluster_m=cluster_m)
    staged = dataclasses.replace(plain, early_row_scales=True)
    assert isinstance(grouped_kernel(G.config(staged)), StagedRowScales)
    assert not isinstance(grouped_kernel(G.config(plain)), StagedRowScales)
    before, after = inspect_instance(plain), inspect_instance(staged)
    loads = (128 + tile_n) // 32  # warp 1's, per unit
    consumer_loads = len(re.findall(r"ld\.global", before.ptx)) - len(re.findall(r"ld\.global", after.ptx))
    assert consumer_loads >= 2 * loads, (consumer_loads, loads)  # the epilogue's 2 row and >= 16 column loads gone
    assert len(re.findall(r"st\.shared\.(?:b32|f32)", after.ptx)) >= loads
    assert len(re.findall(r"ld\.shared\.(?:b32|f32|v\d)", after.ptx)) > 0
    waits = len(re.findall(r"mbarrier\.try_wait", after.ptx)) - len(re.findall(r"mbarrier\.try_wait", before.ptx))
    assert waits == 2
    assert after.frame_bytes == 0, f"{after.name} spills"
    smem, stages = G.resources(staged)
    assert (smem, stages) == (G.resources(plain)[0] + (128 + tile_n) * 4, G.resources(plain)[1])


@pytest.mark.compile
@pytest.mark.parametrize("recipe", ["row", "tensor"])
def test_the_128x192_tile_promotes_serially_without_spills(recipe):
    """128x192: two warp groups of 64x192 WGMMAs, each K tile retired (wait_group 0) before the next is issued,
    the row-wise scales multiplied into the accumulator before the stores, no spills."""

    from cutedsl_gemm.families import sm90_grouped as G
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    wide = _plain_128_row_tile("contiguous", recipe, tile_n=192)
    rep = inspect_instance(wide)
    assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n192k32\.f32\.e4m3\.e4m3")
    assert rep.has(r"wgmma\.wait_group\.sync\.aligned\s+0\b")
    assert not rep.has(r"wgmma\.wait_group\.sync\.aligned\s+1\b")  # no second fragment in flight
    assert len(re.findall(r"st\.global\.b32", rep.ptx)) == 64 * 192 // 128 // 2
    assert rep.frame_bytes == 0, f"{rep.name} spills"
    assert G.resources(wide) == (1024 + 5 * (128 + 192) * 128, 5)


def test_call_signature_tells_calls_apart():
    from cutedsl_gemm.ops.grouped import call_signature

    args = _call(device="cpu")
    sig = call_signature(args["a"], args["b"], args["scale_a"], args["scale_b"], args["offs"], False, torch.bfloat16)
    assert sig == call_signature(*(args[k] for k in ("a", "b", "scale_a", "scale_b", "offs")), False, torch.bfloat16)
    hash(sig)
    other_b = torch.empty(4, 256, 1024, dtype=FP8)[:, :, :512].transpose(1, 2)  # b's shape, other strides
    assert other_b.shape == args["b"].shape and other_b.stride() != args["b"].stride()
    assert call_signature(args["a"], other_b, args["scale_a"], args["scale_b"], args["offs"], False,
                          torch.bfloat16) != sig
    assert call_signature(*(args[k] for k in ("a", "b", "scale_a", "scale_b", "offs")), True, torch.bfloat16) != sig
    assert call_signature(*(args[k] for k in ("a", "b", "scale_a", "scale_b", "offs")), False, torch.float16) != sig
    assert call_signature(args["a"], args["b"], 1.0, args["scale_b"], args["offs"], False, torch.bfloat16) is None

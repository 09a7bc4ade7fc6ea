"""The grouped FP8 GEMM on a Hopper GPU: both layouts and both epilogue-scaled recipes against the float64
reference on the dequantized operands, with empty groups, one-row groups, a group one past a tile, heavy skew and
256 experts; NaN-poisoned outputs (every group row written, no other row touched); CUDA-graph replays with group
sizes that change between replays; bit-identical reruns."""

import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops.grouped import grouped_scaled_mm

pytestmark = pytest.mark.gpu

TOL = 2e-2  # e4m3 operands (dequantized in the reference), bf16 output


def _weights(e, n, k, recipe, gen):
    w = torch.randn(e, n, k, device="cuda", generator=gen)
    if recipe == "deepseek":  # per expert its 128x128 block scales, transposed like b: (E, K/128, N/128)
        q, s = zip(*(cutedsl_gemm.quantize_fp8(w[i], "128x128") for i in range(e)))
        return torch.stack(q).transpose(1, 2), torch.stack([x.t() for x in s]).contiguous()
    if recipe == "row":
        q, s = cutedsl_gemm.quantize_fp8(w.reshape(e * n, k), "row")  # (E*N, K), scales (E*N, 1)
        return q.view(e, n, k).transpose(1, 2), s.view(e, 1, n)
    amax = w.abs().amax(dim=(1, 2)).float()
    scale = amax / 448.0
    q = (w / scale[:, None, None]).to(torch.float8_e4m3fn)
    return q.transpose(1, 2), scale


def _activations(rows_shape, k, recipe, gen):
    x = torch.randn(*rows_shape, k, device="cuda", generator=gen) * 3
    flat = x.reshape(-1, k)
    if recipe == "deepseek":  # 1x128 groups, quantize_fp8's M-major layout viewed per expert
        q, s = cutedsl_gemm.quantize_fp8(flat, "1x128")
        return q.view(*rows_shape, k), s.view(*rows_shape, -1)
    if recipe == "row":
        q, s = cutedsl_gemm.quantize_fp8(flat, "row")
        return q.view(*rows_shape, k), s.view(*rows_shape, 1)
    scale = (flat.abs().amax().float() / 448.0).reshape(1)
    return (x / scale).to(torch.float8_e4m3fn), scale


def _offs(sizes):
    return torch.tensor(sizes, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)


SIZES = {
    "uniform": [256, 256, 256, 256],
    "edges": [0, 1, 129, 0, 128, 127, 300, 1],  # empty, one row, one past a tile, exactly a tile
    "skewed": [1000, 3, 0, 60, 2, 0, 0, 7],
    "e256": [int(v) for v in (torch.arange(256) % 7 * 5)],
}


@pytest.mark.parametrize("recipe", ["row", "tensor", "deepseek"])
@pytest.mark.parametrize("case", list(SIZES))
def test_contiguous_matches_reference(recipe, case):
    gen = torch.Generator(device="cuda").manual_seed(len(case) + len(recipe))
    sizes = SIZES[case]
    e, n, k = len(sizes), (256 if case != "e256" else 128), 512
    total = sum(sizes)
    b, sb = _weights(e, n, k, recipe, gen)
    a, sa = _activations((total + 5,), k, recipe, gen)  # 5 rows past the last group: never written
    offs = _offs(sizes)
    out = torch.full((total + 5, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = grouped_scaled_mm(a, b, sa, sb, offs, out=out)
    assert got is out
    ref = R.reference_grouped_mm(a, b, sa, sb, offs, recipe=recipe, out_dtype=torch.float64)
    written = ~torch.isnan(out[:, 0])
    assert torch.equal(written, ~torch.isnan(ref[:, 0])), "rows written differ from the groups' rows"
    assert not torch.isnan(out[:total]).any()
    err = R.rel_error(out[:total], ref[:total])
    assert err < TOL, f"rel error {err:.3e}"
    # every group against its own rows (a wrong expert's weights would pass the total)
    start = 0
    for size in sizes:
        if size:
            e_err = R.rel_error(out[start:start + size], ref[start:start + size])
            assert e_err < TOL, f"group at row {start} (size {size}): rel error {e_err:.3e}"
        start += size


@pytest.mark.parametrize("recipe", ["row", "tensor", "deepseek"])
@pytest.mark.parametrize("expected_rows", [None, 64, 0])  # full groups (128-row tiles); 64-row tiles at 8 a group
def test_masked_matches_reference_and_leaves_other_rows(recipe, expected_rows):
    """Any expected_rows gives the same product: only the tile it chooses differs."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    e, cap, n, k = 8, 192, 384, 1024
    counts = torch.tensor([0, 1, 129, 192, 64, 128, 3, 191], dtype=torch.int32, device="cuda")
    b, sb = _weights(e, n, k, recipe, gen)
    a, sa = _activations((e, cap), k, recipe, gen)
    out = torch.full((e, cap, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_scaled_mm(a, b, sa, sb, counts=counts, out=out, expected_rows=expected_rows)
    ref = R.reference_grouped_mm(a, b, sa, sb, counts=counts, recipe=recipe, out_dtype=torch.float64)
    for i, c in enumerate(counts.tolist()):
        assert torch.isnan(out[i, c:]).all(), f"expert {i}: rows past its count {c} were written"
        if c:
            assert not torch.isnan(out[i, :c]).any(), f"expert {i}: a counted row was not written"
            err = R.rel_error(out[i, :c], ref[i, :c])
            assert err < TOL, f"expert {i}: rel error {err:.3e}"


def test_graph_replay_with_changing_sizes_and_determinism():
    gen = torch.Generator(device="cuda").manual_seed(5)
    e, n, k, total = 16, 256, 768, 2048
    b, sb = _weights(e, n, k, "row", gen)
    a, sa = _activations((total,), k, "row", gen)
    offs = torch.zeros(e, dtype=torch.int32, device="cuda")
    out = torch.empty(total, n, dtype=torch.bfloat16, device="cuda")

    def split(seed):
        g = torch.Generator().manual_seed(seed)
        cuts = torch.sort(torch.randint(0, total + 1, (e - 1,), generator=g)).values
        return torch.cat([cuts, torch.tensor([total])]).to(torch.int32)

    offs.copy_(split(0))
    grouped_scaled_mm(a, b, sa, sb, offs, out=out)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_scaled_mm(a, b, sa, sb, offs, out=out)
    for seed in (1, 2, 3):
        offs.copy_(split(seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = grouped_scaled_mm(a, b, sa, sb, offs)
        assert torch.equal(out, eager), f"replay with sizes {seed} differs from eager"
        again = grouped_scaled_mm(a, b, sa, sb, offs)
        assert torch.equal(eager, again), "two eager runs differ"
        ref = R.reference_grouped_mm(a, b, sa, sb, offs, recipe="row", out_dtype=torch.float64)
        assert R.rel_error(out, ref) < TOL


def test_experts_match_dense_scaled_mm():
    """One expert's rows give what the dense GEMM gives on them (the same recipe, promoted accumulation)."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    e, n, k = 4, 512, 2048
    sizes = [300, 0, 513, 64]
    b, sb = _weights(e, n, k, "row", gen)
    a, sa = _activations((sum(sizes),), k, "row", gen)
    out = grouped_scaled_mm(a, b, sa, sb, _offs(sizes))
    start = 0
    for i, size in enumerate(sizes):
        if size:
            dense = cutedsl_gemm.scaled_mm(a[start:start + size], b[i], sa[start:start + size], sb[i],
                                           out_dtype=torch.bfloat16)
            err = R.rel_error(out[start:start + size], dense)
            assert err < 1e-2, f"expert {i}: {err:.3e} from the dense GEMM"
        start += size


def test_ill_formed_offsets_stay_inside_the_tensors():
    """A decreasing end offset gives an empty group and offsets past T end at T: what the clamped offsets give,
    and nothing written past the output."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    e, n, k, total = 4, 256, 256, 300
    b, sb = _weights(e, n, k, "row", gen)
    a, sa = _activations((total,), k, "row", gen)
    bad = torch.tensor([100, 50, 400, 1 << 30], dtype=torch.int32, device="cuda")
    clamped = torch.tensor([100, 100, 300, 300], dtype=torch.int32, device="cuda")
    guarded = torch.full((total + 64, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_scaled_mm(a, b, sa, sb, bad, out=guarded[:total])
    assert torch.isnan(guarded[total:]).all(), "rows past the output were written"
    want = grouped_scaled_mm(a, b, sa, sb, clamped)
    assert torch.equal(guarded[:total], want)


OPTIONS = {"the table's": {}, "64-row tiles": {"tile_m": 64, "tile_n": 128, "early_row_scales": False},
           "64-row tiles, early row scales": {"tile_m": 64, "tile_n": 128, "early_row_scales": True},
           "64x256 tiles": {"tile_m": 64, "tile_n": 256, "early_row_scales": False},
           "64x256 tiles, early row scales": {"tile_m": 64, "tile_n": 256, "early_row_scales": True},
           "128x192 tiles": {"tile_m": 128, "tile_n": 192, "early_row_scales": False, "cluster_m": 1},
           "128x128 tiles in 2x1 clusters": {"tile_m": 128, "tile_n": 128, "early_row_scales": False, "cluster_m": 2},
           "128x192 tiles in 2x1 clusters": {"tile_m": 128, "tile_n": 192, "early_row_scales": False, "cluster_m": 2},
           "128x128 tiles, staged row scales": {"tile_m": 128, "tile_n": 128, "early_row_scales": True, "cluster_m": 1},
           "128x192 tiles, staged row scales": {"tile_m": 128, "tile_n": 192, "early_row_scales": True,
                                                 "cluster_m": 1},
           "128x192 tiles in 2x1 clusters, staged row scales": {"tile_m": 128, "tile_n": 192, "early_row_scales": True,
                                                                "cluster_m": 2}}


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["row", "tensor", "deepseek"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("n", [256, 203])
@pytest.mark.parametrize("band", [1, 8])
def test_kernel_options_match_reference(layout, recipe, option, n, band):
    """The table's instance, and built with the kernel options the grouped benchmark times (64-row tiles: one
    consumer warp group; 64x256: two side by side along N; 128x192: serial promotion; 2x1 clusters: each W tile
    multicast to a pair of m tiles, the second past its group where the group has an odd count of tiles; the
    128-row tiles' row-wise scales staged in shared memory by a producer warp; row-wise,
    with the scales loaded after the main loop or as the unit starts), writes the same rows as the reference,
    walking N fastest (band 1) and in bands of m tiles (``band_m``'s two answers); N = 203 (odd) takes the
    epilogue's 16-bit stores, the even N its paired ones."""
    import dataclasses

    from cutedsl_gemm.families import sm90_grouped as G
    from cutedsl_gemm.kernels.sm90.grouped_gemm import RASTER_GROUP_M

    assert band in (1, RASTER_GROUP_M)
    if OPTIONS[option].get("early_row_scales") and recipe != "row":
        pytest.skip("early row scales are the row-wise recipe's")
    opt = OPTIONS[option]
    if (opt.get("tile_n", 128) > 128 or opt.get("cluster_m", 1) > 1) and recipe == "deepseek":
        pytest.skip("the 64x256 and 128x192 tiles and the clusters are the row-wise and per-tensor recipes'")

    gen = torch.Generator(device="cuda").manual_seed(21 + n)
    e, k = 6, 512
    sizes = [0, 1, 65, 64, 130, 7]
    b, sb = _weights(e, n, k, recipe, gen)
    if layout == "contiguous":
        a, sa = _activations((sum(sizes),), k, recipe, gen)
        groups, kw = _offs(sizes), {}
    else:
        a, sa = _activations((e, max(sizes)), k, recipe, gen)
        groups = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        kw = {"counts": groups}
    offs = groups if layout == "contiguous" else None
    problem = G.describe(a, b, sa, sb, offs, kw.get("counts"), torch.bfloat16, None)
    plan = G.plan(dataclasses.replace(G.select(problem, G.device_sms(0)), **OPTIONS[option]), 0)
    out = torch.full(problem.out_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    plan.run(a, b, out, *G.kernel_scales(problem, sa, sb), groups, band)
    torch.cuda.synchronize()
    ref = R.reference_grouped_mm(a, b, sa, sb, offs, recipe=recipe, out_dtype=torch.float64, **kw)
    written = ~torch.isnan(ref)
    assert torch.equal(~torch.isnan(out), written), "rows written differ from the groups' rows"
    err = R.rel_error(out[written], ref[written])
    assert err < TOL, f"rel error {err:.3e}"


def test_repeated_call_reuses_its_plan_and_refuses_a_wrong_out():
    from cutedsl_gemm.ops.grouped import GROUPED, call_signature
    from cutedsl_gemm.runtime.plans import PREPARED

    gen = torch.Generator(device="cuda").manual_seed(17)
    e, n, k = 4, 256, 512
    b, sb = _weights(e, n, k, "row", gen)
    a, sa = _activations((300,), k, "row", gen)
    offs = _offs([100, 0, 150, 50])
    first = grouped_scaled_mm(a, b, sa, sb, offs)
    sig = call_signature(a, b, sa, sb, offs, False, torch.bfloat16)
    assert PREPARED.get(GROUPED, sig) is not None
    again = grouped_scaled_mm(a, b, sa, sb, offs)
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        grouped_scaled_mm(a, b, sa, sb, offs, out=torch.empty(300, n, dtype=torch.float16, device="cuda"))

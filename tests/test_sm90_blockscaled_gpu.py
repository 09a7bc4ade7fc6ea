"""Hopper block-scaled FP8 GEMM on the GPU (1x128 x 128x128, 128x128 x 128x128, 1x128 x 1x128).

Operands get a random magnitude per scale block (2^-4 .. 2^2: wide, yet fp16 outputs stay finite), so a scale
applied to the wrong row, column or K block shows up as a large error, not as noise.
"""

import pytest
import torch
import torch.nn.functional as F
from gpu_operands import OUT_TOL as TOL
from gpu_operands import TORCH_DTYPES, distinct_kernels, launch_directly
from gpu_operands import block_scaled_operands as _operands
from gpu_operands import torch_scale_layout as _torch_layout

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R

pytestmark = pytest.mark.gpu

RECIPES = ["1x128_128x128", "128x128_128x128", "1x128_1x128"]

# (M, N, K, A fmt, B fmt, out dtype, bias): M from decode to prefill at DeepSeek-V3's N and K (4608, 7168, 2048),
# plus K = 7056 (a partial last K block) and N = 576 / 1040 (a partial last N block).
SHAPES = [
    (1, 512, 256, "e4m3", "e4m3", torch.bfloat16, False),
    (7, 576, 2048, "e4m3", "e4m3", torch.bfloat16, True),
    (64, 4608, 7168, "e4m3", "e4m3", torch.bfloat16, False),
    (129, 7168, 2048, "e4m3", "e5m2", torch.bfloat16, True),
    (1000, 512, 7168, "e5m2", "e4m3", torch.float16, False),
    (6144, 4608, 7168, "e4m3", "e4m3", torch.bfloat16, False),
    (6144, 576, 256, "e5m2", "e5m2", torch.float32, False),
    (1, 7168, 7056, "e4m3", "e4m3", torch.float32, True),
    (129, 576, 7056, "e4m3", "e4m3", torch.bfloat16, True),
    (1000, 7168, 7056, "e4m3", "e4m3", torch.bfloat16, False),
    (333, 1040, 464, "e4m3", "e4m3", torch.bfloat16, True),
    (64, 576, 256, "e4m3", "e4m3", torch.float16, True),
]


@pytest.mark.parametrize("layout", ["torch", "plain"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("m,n,k,fa,fb,out_dtype,use_bias", SHAPES)
def test_block_scaled_matches_reference(m, n, k, fa, fb, out_dtype, use_bias, recipe, layout):
    torch.manual_seed(m * 131 + n * 17 + k + len(recipe))
    qa, sa, qw, sw = _operands(m, n, k, fa, fb, recipe)
    rec = cutedsl_gemm.recipe(recipe)
    if layout == "torch":
        scale_a, scale_b = _torch_layout(sa, rec.a.rows), _torch_layout(sw, rec.b.rows).t()
    else:
        scale_a, scale_b = sa.contiguous(), sw.t().contiguous()
    bias = torch.randn(n, device="cuda").to(out_dtype) if use_bias else None
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    cutedsl_gemm.scaled_mm(qa, qw.t(), scale_a, scale_b, bias=bias, out_dtype=out_dtype, out=out)
    torch.cuda.synchronize()
    ref = R.reference_gemm(qa, sa, qw, sw, recipe, bias=bias)
    err = R.rel_error(out, ref)
    assert err <= TOL[out_dtype], f"relative error {err:.3e} > {TOL[out_dtype]:.0e}"


def test_deepseek_recipe_matches_torch_blockwise():
    m, n, k = 512, 1536, 7168
    qa, sa, qw, sw = _operands(m, n, k, "e4m3", "e4m3", "1x128_128x128")
    scale_a, scale_b = _torch_layout(sa, 1), _torch_layout(sw, 128).t()
    ours = cutedsl_gemm.scaled_mm(
        qa, qw.t(), scale_a, scale_b, scale_recipe_a=F.ScalingType.BlockWise1x128,
        scale_recipe_b=F.ScalingType.BlockWise128x128,
    )
    theirs = F.scaled_mm(
        qa, qw.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b, F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )
    ref = R.reference_gemm(qa, sa, qw, sw, "1x128_128x128")
    assert R.rel_error(ours, ref) <= 2e-3
    assert R.rel_error(ours, theirs.double()) <= 4e-3


@pytest.mark.parametrize("m", [1, 300, 2048])
def test_quantize_then_gemm_end_to_end(m):
    """bf16 activations -> quantize_fp8 (1x128, GEMM layout) -> scaled_mm against pre-quantized weights."""
    n, k = 2048, 7168
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qx, sx = cutedsl_gemm.quantize_fp8(x, "1x128")
    qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128", scale_layout="padded")
    out = cutedsl_gemm.scaled_mm(qx, qw.t(), sx, sw.t())
    ref = x.double() @ w.double().t()
    assert R.rel_error(out, ref) <= 6e-2  # FP8 quantization error of both operands, not GEMM error
    ref_q = R.reference_gemm(qx, sx.contiguous(), qw, sw[:, : -(-k // 128)].contiguous(), "1x128_128x128")
    assert R.rel_error(out, ref_q) <= 2e-3


@pytest.mark.parametrize("inst", distinct_kernels(RECIPES), ids=lambda i: i.name)
def test_every_block_scaled_tile_on_a_shape_nothing_divides(inst):
    """Each block-scaled row launched directly (not only where dispatch sends the test shapes): M, N, K
    that no tile or scale block divides, torch's scale layouts, K split where the instance can,
    NaN-poisoned output."""
    torch.manual_seed(7)
    _check_launched_directly(inst, 333, 1040, 720, splits=3)


def _check_launched_directly(inst, m, n, k, splits):
    """Launch ``inst`` bypassing dispatch on fresh operands with torch's scale layouts (and a random bias
    where the instance has one) and check it against the reference on the dequantized inputs, to the
    tolerance of its output dtype."""
    from cutedsl_gemm.numerics import scale_layouts

    qa, sa, qw, sw = _operands(m, n, k, "e4m3", "e4m3", inst.recipe)
    rec = cutedsl_gemm.recipe(inst.recipe)
    scale_a, scale_b = _torch_layout(sa, rec.a.rows), _torch_layout(sw, rec.b.rows).t()
    # The recipe named: with one K block (K <= 128) 1x128 x 1x128 scales have the row-wise shapes, and the
    # shapes alone resolve to the row-wise kernel's views (the same product), not this kernel's.
    _, sa_k, sb_k = scale_layouts.resolve(scale_a, scale_b, m, n, k, *inst.recipe.split("_"))
    bias = None if inst.bias_dtype is None else torch.randn(n, device="cuda").to(TORCH_DTYPES[inst.bias_dtype])
    out = launch_directly(inst, qa, qw.t(), sa_k, sb_k, (m, n, k), splits=splits, bias=bias)
    err = R.rel_error(out, R.reference_gemm(qa, sa, qw, sw, inst.recipe, bias=bias))
    tol = TOL[out.dtype]
    assert err <= tol, f"{inst.name}, {splits} splits: relative error {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("k,splits", [(128, 1), (384, 1), (720, 1), (384, 3), (720, 3)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("inst", distinct_kernels(RECIPES), ids=lambda i: i.name)
def test_every_block_scaled_tile_with_several_tiles_per_cta(inst, k, splits):
    """The block-scaled form of test_sm90_gemm_gpu's several-tiles test: a 4000 x 3008 output gives every
    persistent CTA several tiles in a row, so whatever carries from one tile's K loop to the next (pipeline
    state, scale register sets, scales staged ahead of their K tile) is exercised for every row, with 1, 3 and 6
    K tiles per tile (single, odd and even trip counts of the unrolled loops; 720 leaves a partial last K
    block), unsplit and -- where the row can split K -- in 3 K splits (work units that start mid-K, one after
    another on a CTA), torch's scale layouts, NaN-poisoned output. The nothing-divides test above gives most
    CTAs a single tile."""
    _check_launched_directly(inst, 4000, 3008, k, splits=splits if inst.can_split_k else 1)


@pytest.mark.parametrize("inst", [i for i in distinct_kernels(RECIPES) if i.ctas_per_sm == 2], ids=lambda i: i.name)
def test_block_scaled_pairs_stay_right_run_after_run(inst):
    """The two-CTAs-per-SM rows, 3 K splits of one K tile each, twelve times on fresh operands: the DeepSeek
    64x192 pair read stale A scales from the stage in about half or more of such runs (4 of 6 test runs, 6 of 12
    and at least 9 of 15 diagnostic runs) while one bulk copy staged them, a race one run can miss."""
    for rep in range(12):
        torch.manual_seed(100 + rep)
        _check_launched_directly(inst, 4000, 3008, 384, splits=3 if inst.can_split_k else 1)


def _deepseek_192_rows():
    from cutedsl_gemm.selection.instances import select

    rows = {i.name: i for i in select(arch="sm_90a", recipe="1x128_128x128", a_dtype="e4m3", b_dtype="e4m3")
            if (i.tile_m, i.tile_n, i.cluster_m, i.split_tail) == (128, 192, 2, False)}
    return list(rows.values())  # an fp32 output's "out" and "fp32" bias kinds are one row


@pytest.mark.parametrize("inst", _deepseek_192_rows(), ids=lambda i: i.name)
def test_deepseek_192_wide_rows_every_output_and_bias(inst):
    """The DeepSeek recipe's 128x192 rows run 4 A/W stages, which leaves each output dtype a different number
    of epilogue buffers (6 bf16 / fp16 slices, 3 fp32): every output dtype and bias kind, launched directly on
    a 2000 x 3008 x 1008 problem (several tiles per CTA, partial last tiles and K block), unsplit and in 3 K
    splits, NaN-poisoned output."""
    torch.manual_seed(11)
    for splits in (1, 3):
        _check_launched_directly(inst, 2000, 3008, 1008, splits)

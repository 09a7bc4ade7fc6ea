"""INT8 (W8A8) on a Hopper GPU: the s8 GEMMs against the float64 reference of the integer product (exact up to the
output dtype's rounding), NaN-poisoned outputs, split-K and both schedules bit for bit, every int8 kernel of the
table; the int8 quantizer kernels against the torch reference bit for bit (zeros, +-inf, NaN, ties)."""

import os

import pytest
import torch
from gpu_operands import distinct_kernels, launch_directly
from test_quantize_fp8 import _special_input, assert_scales_equal, random_input

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.numerics.formats import INT8

pytestmark = pytest.mark.gpu

# M from decode to prefill, N up to DeepSeek-V3's 4608 and 7168 (576: a partial last N tile); K = 464 is a multiple
# of 16 (TMA rows) but not of the 128-deep K tile.
MS = [1, 7, 64, 129, 1000, 6144]
NS = [512, 576, 4608, 7168]
KS = [256, 2048, 7168, 464]


def int8_operands(m, n, k, recipe, seed):
    """Random int8 A (M, K) and W (N, K) over the whole symmetric range, and scales spread over 2^-11 .. 2^-5 (a
    scale applied to the wrong row or column shows as a large error; fp16 outputs stay finite): (a, b = W^T,
    scale_a, scale_b)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=g, device="cuda", dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)

    def scales(shape):
        mantissa = 0.5 + torch.rand(shape, generator=g, device="cuda") / 2
        return mantissa * torch.randint(-10, -5, shape, generator=g, device="cuda").float().exp2()

    if recipe == "tensor":
        return a, w.t(), scales(()), scales(())
    return a, w.t(), scales((m, 1)), scales((1, n))


def assert_exact(out, a, b, scale_a, scale_b, bias=None):
    """Every element within half an ulp of the output dtype of the float64 reference, plus the fp32 epilogue's
    roundings (int32 -> fp32, the scale product, the fused multiply-add: a few 2^-24 of the terms' magnitude)."""
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} outputs unwritten (NaN) or not finite"
    ref = R.reference_int8_mm(a, b, scale_a, scale_b, bias)
    magnitude = R.reference_int8_mm(a.abs(), b.abs(), scale_a.abs(), scale_b.abs(), None if bias is None else
                                    bias.abs())
    fin = torch.finfo(out.dtype)
    tol = ref.abs() * fin.eps / 2 + magnitude * 2.0**-21 + fin.smallest_normal * fin.eps / 2
    err = (out.double() - ref).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {out.numel()} outputs off the reference, worst "
                           f"{float((err / tol).max()):.2f} x the tolerance at {bad.nonzero()[0].tolist()}")


# ------------------------------------------------------------------------------------------------
# GEMM
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", MS)
def test_int8_scaled_mm_is_exact(m, n, k):
    a, b, sa, sb = int8_operands(m, n, k, "row", seed=m * 7919 + n * 31 + k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # unwritten tiles stay NaN
    assert cutedsl_gemm.scaled_mm(a, b, sa, sb, out=out) is out
    torch.cuda.synchronize()
    assert_exact(out, a, b, sa, sb)


# (M, N, K, recipe, out dtype, bias dtype: None, "out" or "fp32")
VARIANTS = [
    (1, 4608, 7168, "tensor", torch.bfloat16, "out"),
    (7, 576, 2048, "row", torch.float16, "fp32"),
    (64, 7168, 256, "tensor", torch.float32, None),
    (129, 512, 464, "row", torch.float32, "fp32"),
    (1000, 4608, 2048, "tensor", torch.float16, None),
    (6144, 7168, 7168, "tensor", torch.bfloat16, "out"),
    (6144, 576, 256, "row", torch.bfloat16, "fp32"),
    (333, 1040, 464, "row", torch.bfloat16, "out"),  # nothing divides the tile
]


@pytest.mark.parametrize("m,n,k,recipe,out_dtype,bias_kind", VARIANTS)
def test_int8_recipes_outputs_and_bias(m, n, k, recipe, out_dtype, bias_kind):
    a, b, sa, sb = int8_operands(m, n, k, recipe, seed=m + n + k)
    bias = None if bias_kind is None else torch.randn(n, device="cuda").to(
        out_dtype if bias_kind == "out" else torch.float32)
    outs = []
    for fast in (False, True):  # the int32 sum is exact: use_fast_accum changes nothing
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        cutedsl_gemm.scaled_mm(a, b, sa, sb, bias, None, out_dtype, fast, out=out)
        outs.append(out)
    torch.cuda.synchronize()
    assert_exact(outs[0], a, b, sa, sb, bias)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("n,k", [(8192, 8192), (1040, 7056), (7168, 2048)])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 128])
def test_split_k_is_exact_and_deterministic(m, n, k):
    """Partials are summed in int32: any split gives the unsplit result, bit for bit, every run."""
    a, b, sa, sb = int8_operands(m, n, k, "row", seed=m * 3 + n + k)
    outs = {s: cutedsl_gemm.scaled_mm(a, b, sa, sb, split_k=s) for s in (1, 2, 5, 16)}
    again = cutedsl_gemm.scaled_mm(a, b, sa, sb, split_k=5)
    default = cutedsl_gemm.scaled_mm(a, b, sa, sb)  # dispatch's own split
    torch.cuda.synchronize()
    assert_exact(outs[1], a, b, sa, sb)
    for s, out in outs.items():
        assert torch.equal(out, outs[1]), f"split_k={s} differs from the unsplit result"
    assert torch.equal(again, outs[5]) and torch.equal(default, outs[1])


@pytest.mark.parametrize("m", [7, 64, 129, 1000])
def test_both_schedules_give_the_same_bits(m):
    """The swapped small-M kernel and the cooperative one sum the same integers and run the same epilogue."""
    n, k = 4608, 2048
    a, b, sa, sb = int8_operands(m, n, k, "row", seed=m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    small = cutedsl_gemm.scaled_mm(a, b, sa, sb, bias, schedule="small_m")
    coop = cutedsl_gemm.scaled_mm(a, b, sa, sb, bias, schedule="cooperative")
    torch.cuda.synchronize()
    assert_exact(small, a, b, sa, sb, bias)
    assert torch.equal(small, coop)


@pytest.mark.parametrize("inst", distinct_kernels(["tensor", "row"], operands="int8"), ids=lambda i: i.name)
def test_every_int8_kernel(inst):
    """Each int8 kernel of the table, launched directly (whatever dispatch would pick), K split where it can."""
    m, n, k = 333, 1040, 7056
    a, b, sa, sb = int8_operands(m, n, k, inst.recipe, seed=5)
    views = scale_layouts.kernel_views(inst.recipe, 0, sa, sb)  # the kernels' scale views ((1,) per tensor)
    out = launch_directly(inst, a, b, *views, (m, n, k), splits=3)
    assert_exact(out, a, b, sa, sb)


def test_matches_torch_int_mm_and_the_quantized_pipeline():
    m, n, k = 256, 1024, 2048
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qx, sx = cutedsl_gemm.quantize_int8(x, "row")
    qw, sw = cutedsl_gemm.quantize_int8(w, "row")
    ours = cutedsl_gemm.scaled_mm(qx, qw.t(), sx, sw.t())
    theirs = (torch._int_mm(qx, qw.t()) * sx * sw.t()).to(torch.bfloat16)
    torch.cuda.synchronize()
    assert_exact(ours, qx, qw.t(), sx, sw.t())
    assert R.rel_error(ours, theirs.double()) < 4e-3
    # W8A8 against the unquantized product: the quantization error of 8-bit symmetric scales
    assert R.rel_error(ours, x.double() @ w.double().t()) < 2e-2


def test_bad_int8_calls_on_the_gpu():
    a, b, sa, sb = int8_operands(64, 256, 512, "row", seed=0)
    fp8 = torch.randn(256, 512, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="int8 operands pair with int8"):
        cutedsl_gemm.scaled_mm(a, fp8.t(), sa, sb)
    with pytest.raises(ValueError, match="int8 operands take fp32 TensorWise"):
        cutedsl_gemm.scaled_mm(a, b, torch.ones(64, 4, device="cuda"), torch.ones(4, 2, device="cuda"))
    with pytest.raises(ValueError, match="must be K-major"):
        cutedsl_gemm.scaled_mm(a, b.contiguous(), sa, sb)


# ------------------------------------------------------------------------------------------------
# Quantizer
# ------------------------------------------------------------------------------------------------
def assert_int8_equal(q, qref):
    q, qref = q.cpu(), qref.cpu()
    assert q.dtype == qref.dtype == torch.int8 and q.shape == qref.shape
    bad = q != qref
    assert not bad.any(), f"{int(bad.sum())} int8 codes differ, first at {bad.nonzero()[0].tolist()}"


def _check_kernel(x, gran):
    q, s = cutedsl_gemm.quantize_int8(x.cuda(), gran, backend="kernel")
    torch.cuda.synchronize()
    qr, sr = cutedsl_gemm.quantize_int8(x, gran, backend="reference")
    assert_scales_equal(s, sr)
    assert_int8_equal(q, qr)


SHAPES = [(1, 16), (128, 128), (130, 272), (1000, 1040), (3, 2032), (5, 8192), (33, 17424), (3, 65552)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_int8_kernel_matches_reference(gran, shape, dtype):
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
    x = random_input(*shape, dtype, seed=seed)  # with +-inf, NaN, a subnormal and zeros
    try:
        _check_kernel(x, gran)
    except AssertionError as e:
        raise AssertionError(f"seed={seed}: {e}") from None


def _ties(dtype, rows=300, k=528):
    """Quotients on the integer rounding midpoints: amax 127 gives scale 1, x = +-(j + 0.5)."""
    g = torch.Generator().manual_seed(3)
    sign = torch.randint(0, 2, (rows, k), generator=g).float() * 2 - 1
    x = sign * (torch.randint(0, 127, (rows, k), generator=g).float() + 0.5)
    x[:, ::16] = 127.0
    return x.to(dtype)


@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("pattern", ["signed_zeros", "zeros_and_ones", "subnormal", "huge", "non_finite", "ties"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_int8_kernel_special_values(gran, pattern, dtype):
    x = _ties(dtype) if pattern == "ties" else _special_input(pattern, dtype, INT8)
    _check_kernel(x, gran)


def test_quantize_int8_kernel_contract_on_one_row():
    x = torch.tensor([[127.0, -127.0, 0.5, 1.5, -2.5, float("inf"), float("-inf"), float("nan")] * 2],
                     dtype=torch.bfloat16, device="cuda")
    q, s = cutedsl_gemm.quantize_int8(x, "row", backend="kernel")
    assert float(s) == 1.0
    assert q.cpu()[0, :8].tolist() == [127, -127, 0, 2, -2, 127, -127, 0]


def test_quantize_int8_kernel_large_rows_and_tensor():
    x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16) * 3
    x[5, 7], x[9, 300], x[11] = float("nan"), float("-inf"), 0.0
    for gran in ("row", "tensor"):
        q, s = cutedsl_gemm.quantize_int8(x, gran, backend="kernel")
        qr, sr = cutedsl_gemm.quantize_int8(x.cpu(), gran, backend="reference")
        assert_scales_equal(s, sr)
        assert_int8_equal(q, qr)

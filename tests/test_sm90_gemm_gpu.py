"""Hopper FP8 GEMM on the GPU: every output element checked against the float64 reference."""

import pytest
import torch
from gpu_operands import OUT_TOL as TOL
from gpu_operands import distinct_kernels, launch_directly

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime.jit import KERNEL_CACHE
from cutedsl_gemm.selection.dispatch import select_gemm

pytestmark = pytest.mark.gpu

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# (M, N, K, A fmt, B fmt, out dtype, recipe, bias)
CASES = [
    (1, 512, 256, "e4m3", "e4m3", torch.bfloat16, "tensor", False),
    (7, 576, 2048, "e4m3", "e4m3", torch.bfloat16, "row", True),
    (64, 4608, 7168, "e4m3", "e4m3", torch.bfloat16, "row", False),
    (129, 7168, 2048, "e4m3", "e5m2", torch.bfloat16, "tensor", True),
    (1000, 512, 7168, "e5m2", "e4m3", torch.float16, "row", False),
    (6144, 4608, 7168, "e4m3", "e4m3", torch.bfloat16, "row", False),
    (6144, 576, 256, "e5m2", "e5m2", torch.float32, "tensor", False),
    (1, 7168, 7168, "e4m3", "e4m3", torch.float32, "row", True),
    (7, 4608, 256, "e4m3", "e4m3", torch.float16, "tensor", True),
    (64, 512, 2048, "e5m2", "e4m3", torch.bfloat16, "tensor", False),
    (129, 576, 7168, "e4m3", "e4m3", torch.bfloat16, "row", True),
    (1000, 7168, 256, "e4m3", "e4m3", torch.bfloat16, "tensor", False),
    (6144, 7168, 2048, "e4m3", "e4m3", torch.bfloat16, "tensor", True),
    (1, 4608, 2048, "e4m3", "e5m2", torch.float16, "row", False),
    (7, 7168, 7168, "e5m2", "e5m2", torch.bfloat16, "row", False),
    (64, 576, 256, "e4m3", "e4m3", torch.float32, "row", True),
    (129, 512, 2048, "e4m3", "e4m3", torch.bfloat16, "row", False),
    (1000, 4608, 2048, "e4m3", "e4m3", torch.float32, "tensor", True),
    (6144, 512, 7168, "e4m3", "e4m3", torch.float16, "tensor", False),
    (1000, 576, 7168, "e4m3", "e4m3", torch.bfloat16, "tensor", False),
    (333, 1040, 464, "e4m3", "e4m3", torch.bfloat16, "row", True),  # nothing divides the tile
    (4096, 4096, 4096, "e4m3", "e4m3", torch.bfloat16, "row", False),
]


def _operands(m, n, k, fa, fb, recipe):
    a = torch.randn(m, k, device="cuda") * 3
    w = torch.randn(n, k, device="cuda")
    qa, sa, qw, sw = R.quantize_operands(a, w, recipe, fa, fb)
    if recipe == "tensor":
        scale_a, scale_b = sa.reshape(()), sw.reshape(())
    else:
        scale_a, scale_b = sa.reshape(m, 1).contiguous(), sw.reshape(1, n).contiguous()
    return qa, qw, scale_a, scale_b, (qa, sa, qw, sw)


@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast"])
@pytest.mark.parametrize("m,n,k,fa,fb,out_dtype,recipe,use_bias", CASES)
def test_scaled_mm_matches_reference(m, n, k, fa, fb, out_dtype, recipe, use_bias, fast_accum):
    torch.manual_seed(m * 31 + n * 7 + k)
    qa, qw, scale_a, scale_b, plain = _operands(m, n, k, fa, fb, recipe)
    bias = torch.randn(n, device="cuda").to(out_dtype) if use_bias else None
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")  # unwritten tiles stay NaN
    res = cutedsl_gemm.scaled_mm(
        qa, qw.t(), scale_a, scale_b, bias=bias, out_dtype=out_dtype, out=out, use_fast_accum=fast_accum
    )
    assert res is out
    torch.cuda.synchronize()
    ref = R.reference_gemm(*plain, recipe, bias=bias)
    err = R.rel_error(out, ref)
    # Fast accumulation lets the tensor cores' reduced-precision FP8 accumulator run over all of K: allow
    # its known extra error (cuBLAS with use_fast_accum=True shows the same), but still catch wrong tiles.
    tol = TOL[out_dtype] if not fast_accum else max(TOL[out_dtype], 4e-3)
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e}"


def test_matches_torch_scaled_mm_and_allocates_output():
    m, n, k = 256, 1024, 1024
    qa, qw, sa, sb, plain = _operands(m, n, k, "e4m3", "e4m3", "row")
    ours = cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out_dtype=torch.bfloat16)
    theirs = torch._scaled_mm(qa, qw.t(), sa, sb, out_dtype=torch.bfloat16)
    assert ours.shape == (m, n) and ours.dtype == torch.bfloat16
    assert R.rel_error(ours, theirs.double()) < 4e-3


def test_fresh_data_each_run_and_no_recompile_across_shapes():
    shapes = [(3, 512, 256), (200, 1024, 512), (515, 2048, 1024), (1, 512, 4096), (7, 512, 1024), (260, 1024, 768)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    used = {select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms) for m, n, _ in shapes}
    assert len(used) < len(shapes)  # several shapes share an instance
    before = KERNEL_CACHE.stats.compiles
    for (m, n, k) in shapes:
        qa, qw, sa, sb, plain = _operands(m, n, k, "e4m3", "e4m3", "row")
        out = cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb)
        assert R.rel_error(out, R.reference_gemm(*plain, "row")) <= 2e-3
    assert KERNEL_CACHE.stats.compiles - before <= len(used)  # once per instance at most, never per shape


def test_zero_sized_problems_launch_nothing():
    qa = torch.randn(0, 256, device="cuda").to(torch.float8_e4m3fn)
    qw = torch.randn(512, 256, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    assert cutedsl_gemm.scaled_mm(qa, qw.t(), one, one).shape == (0, 512)
    qa = torch.randn(4, 0, device="cuda").to(torch.float8_e4m3fn)
    qw = torch.randn(512, 0, device="cuda").to(torch.float8_e4m3fn)
    out = cutedsl_gemm.scaled_mm(qa, qw.t(), one, one)
    assert out.shape == (4, 512) and bool((out == 0).all())


def test_runs_on_current_stream():
    m, n, k = 512, 1024, 2048
    qa, qw, sa, sb, plain = _operands(m, n, k, "e4m3", "e4m3", "tensor")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out)
    s.synchronize()
    assert R.rel_error(out, R.reference_gemm(*plain, "tensor")) <= 2e-3


def test_repeated_signature_still_checks_alignment_and_computes_fresh_data():
    """The per-signature fast path must not skip what the signature does not prove (a misaligned view)."""
    m, n, k = 64, 512, 256
    for _ in range(2):  # the second call takes the fast path, on new data
        qa, qw, sa, sb, plain = _operands(m, n, k, "e4m3", "e4m3", "row")
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out)
        assert R.rel_error(out, R.reference_gemm(*plain, "row")) <= 2e-3
    big = torch.randn(m * k + 16, device="cuda").to(torch.float8_e4m3fn)
    shifted = big[1 : 1 + m * k].view(m, k)  # same shape and strides, base 1 byte off
    with pytest.raises(ValueError, match="16-byte aligned base address"):
        cutedsl_gemm.scaled_mm(shifted, qw.t(), sa, sb, out=out)
    # Same shapes and dtypes as the recorded signature, but a layout the kernel cannot take: the compiled
    # function refuses it before launching and the full validation names the problem.
    a_col_major = qa.t().contiguous().t()
    with pytest.raises(ValueError, match="must be K-major"):
        cutedsl_gemm.scaled_mm(a_col_major, qw.t(), sa, sb, out=out)
    with pytest.raises(ValueError, match=r"out must be a \(64, 512\) torch.bfloat16 tensor"):
        cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out.float())
    wide = torch.empty(m * n + 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="out must have a 16-byte aligned base address"):
        cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=wide[1 : 1 + m * n].view(m, n))
    with pytest.raises(TypeError, match="scale_a must be torch.float32"):
        cutedsl_gemm.scaled_mm(qa, qw.t(), sa.double(), sb, out=out)
    # ...and the fast path still works afterwards.
    out.fill_(float("nan"))
    cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out)
    assert R.rel_error(out, R.reference_gemm(*plain, "row")) <= 2e-3


@pytest.mark.parametrize("inst", distinct_kernels(["row"]), ids=lambda i: i.name)
def test_every_table_tile_on_a_shape_nothing_divides(inst):
    """Each row of the table launched directly (not only where dispatch sends the seed shapes): M, N, K
    that no tile divides, K split where the instance can, NaN-poisoned output."""
    _check_launched_directly(inst, 333, 1040, 720, splits=3)


def _check_launched_directly(inst, m, n, k, splits):
    """Launch ``inst`` bypassing dispatch on fresh operands of its recipe (the kernel's scale views: (1,)
    per tensor) and check it against the reference on the dequantized inputs."""
    qa, qw, sa, sb, plain = _operands(m, n, k, "e4m3", "e4m3", inst.recipe)
    _, sa_k, sb_k = scale_layouts.resolve(sa, sb, m, n, k)
    out = launch_directly(inst, qa, qw.t(), sa_k, sb_k, (m, n, k), splits=splits)
    err = R.rel_error(out, R.reference_gemm(*plain, inst.recipe))
    tol = 2e-3 if inst.accum == "promoted" else 4e-3
    assert err <= tol, f"{inst.name}: relative error {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("k", [128, 384, 720], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("inst", distinct_kernels(["row", "tensor"]), ids=lambda i: i.name)
def test_every_table_tile_with_several_tiles_per_cta(inst, k):
    """Persistent CTAs run several tiles one after another (pipeline state, accumulators and epilogue buffers
    carried from tile to tile), which the small shapes above never make most tiles do. A 4000 x 3008 output
    (N a multiple of 16, as TMA needs; partial edge tiles for most tile shapes) gives every CTA several
    tiles, with 1, 3 and 6 K tiles each (the promoted loops' odd, even and single-K-tile paths), unsplit,
    into a NaN-poisoned output."""
    _check_launched_directly(inst, 4000, 3008, k, splits=1)

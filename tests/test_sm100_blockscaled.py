"""Block-scaled GEMM family: quantizer kernels, host validation, compile-only PTX checks, Blackwell runs.

Tiers: plain tests (CPU), ``compile`` tests (build for sm_100a without a GPU and inspect PTX),
``cuda`` quantizer tests (the quantizer kernels use no sm_100-only instruction, so any CUDA GPU runs
them, compiled for its own arch) and ``blackwell`` GEMM tests (need an sm_100 device).
"""

import os
import re

import pytest
import torch

from cutedsl_gemm import microscaling as ms
from cutedsl_gemm.formats import E2M1, E2M3, E3M2, E4M3, E5M2

MX_FMTS = (E4M3, E5M2, E3M2, E2M3, E2M1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _special_input(rows, k, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (rows, k // 16), generator=g).float()).repeat_interleave(16, 1)
    x = torch.randn(rows, k, generator=g) * scale
    x[0, :16] = 0.0
    if rows > 2 and k >= 64:
        x[1, 3] = float("inf")
        x[1, 40] = -float("inf")
        x[2, 17] = float("nan")
        x[2, 50] = 1e-40  # fp32 subnormal
        x[2, 51] = -0.0
    return x.to(dtype).to(device)


# ---------------------------------------------------------------- quantizer kernels (any CUDA GPU)


@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("fmt", MX_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows,k", [(1, 32), (130, 96), (257, 512)])
def test_quantize_mx_kernel_bit_exact(fmt, dtype, rows, k):
    from cutedsl_gemm.kernels.sm100.quantize_mx import quantize_mx

    x = _special_input(rows, k, dtype, rows + k, "cuda")
    got = quantize_mx(x, fmt)
    ref = ms.quantize_mx_reference(x.cpu(), fmt)
    assert got.data.dtype == ref.data.dtype and got.scales.dtype == ref.scales.dtype
    assert torch.equal(ms._as_bytes(got.data).cpu(), ms._as_bytes(ref.data))
    assert torch.equal(got.scales.view(torch.uint8).cpu(), ref.scales.view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("given", (False, True))
@pytest.mark.parametrize("rows,k", [(1, 16), (130, 80), (257, 512)])
def test_quantize_nvfp4_kernel_bit_exact(dtype, given, rows, k):
    from cutedsl_gemm.kernels.sm100.quantize_mx import quantize_nvfp4

    x = _special_input(rows, k, dtype, rows * k, "cuda")
    gs = torch.tensor(0.37, device="cuda") if given else None
    got = quantize_nvfp4(x, gs)
    ref = ms.quantize_nvfp4_reference(x.cpu(), None if gs is None else gs.cpu())
    assert got.global_scale.item() == ref.global_scale.item()
    assert torch.equal(got.data.view(torch.uint8).cpu(), ref.data.view(torch.uint8))
    assert torch.equal(got.scales.view(torch.uint8).cpu(), ref.scales.view(torch.uint8))


# ---------------------------------------------------------------- quantizer compile checks (CPU)


@pytest.fixture(scope="module")
def sm100_env():
    old = {k: os.environ.get(k) for k in ("CUTE_DSL_ARCH",)}
    os.environ["CUTE_DSL_ARCH"] = "sm_100a"
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.compile
@pytest.mark.parametrize(
    "recipe,fmt,dtype,cg",
    [("mx", f, torch.bfloat16, False) for f in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")]
    + [("mx", "e4m3", torch.float32, False), ("nvfp4", "e2m1", torch.bfloat16, True), ("nvfp4", "e2m1", torch.float32, False)],
)
def test_quantizer_compiles_for_sm100(sm100_env, recipe, fmt, dtype, cg):
    from cutedsl_gemm.kernels.sm100.quantize_mx import compile_quantizer

    ptx = compile_quantizer(recipe, fmt, dtype, cg, keep_ptx=True).__ptx__
    assert ptx and ".target sm_100a" in ptx
    # vectorised global loads of the input block, no approximate division anywhere
    assert re.search(r"ld\.global(\.\w+)*\.v[24]\.b(32|64)", ptx)
    assert "div.approx" not in ptx and "div.full" not in ptx and ".ftz" not in ptx
    if recipe == "nvfp4":
        assert "div.rn.f32" in ptx and "rcp.rn.f32" in ptx
        assert ("atom.global.max.u32" in ptx) == cg  # device-side tensor amax only when computing g


# ---------------------------------------------------------------- host entry: conventions and validation (CPU)

from cutedsl_gemm import sm100_blockscaled as bs  # noqa: E402
from torch.nn.functional import ScalingType, SwizzleType  # noqa: E402


def _operands(m, n, k, fa, fb, seed=0, nvfp4=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    if nvfp4:
        return ms.quantize_nvfp4_reference(a), ms.quantize_nvfp4_reference(w)
    return ms.quantize_mx_reference(a, fa), ms.quantize_mx_reference(w, fb)


@pytest.mark.parametrize(
    "fa,fb,kind",
    [(E4M3, E4M3, "mxf8f6f4"), (E5M2, E4M3, "mxf8f6f4"), (E3M2, E2M3, "mxf8f6f4"), (E4M3, E2M1, "mxf8f6f4"),
     (E2M1, E2M1, "mxf4")],
    ids=lambda v: getattr(v, "name", v),
)
def test_reference_mm_mx_and_kind(fa, fb, kind):
    qa, qw = _operands(130, 72, 256, fa, fb, seed=1)
    p = bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales, qw.scales, fmt_a=fa, fmt_b=fb)
    assert p.config.kind == kind and p.config.sf_vec == 32
    out = bs.mm_quantized(qa, qw, reference=True)
    # independent: dequantize through plain scales and the element decoder
    deq = lambda q: (ms.decode_minifloat(q.codes(), q.fmt).double().view(q.shape[0], -1, 32)
                     * torch.exp2(q.plain_scales().view(torch.uint8).double() - 127).unsqueeze(-1)).view(q.shape)
    assert torch.allclose(out, deq(qa) @ deq(qw).t(), rtol=1e-12, atol=1e-12)


def test_reference_mm_nvfp4_global_scales():
    qa, qw = _operands(64, 32, 128, E2M1, E2M1, seed=2, nvfp4=True)
    p = bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales, qw.scales,
                               global_scale_a=qa.global_scale, global_scale_b=qw.global_scale)
    assert p.config.kind == "mxf4nvf4" and p.config.sf_vec == 16
    out = bs.mm_quantized(qa, qw, reference=True)
    assert torch.allclose(out, qa.dequantize() @ qw.dequantize().t(), rtol=1e-12, atol=1e-12)
    # the global scales really are applied: dropping them changes the result by their product
    no_g = bs.reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales)
    ratio = qa.global_scale.double().item() * qw.global_scale.double().item()
    assert torch.allclose(out, no_g * ratio, rtol=1e-12)


def test_scaled_mm_adapter_matches_torch_conventions():
    qa, qw = _operands(128, 64, 256, E4M3, E4M3, seed=3)
    direct = bs.mm_quantized(qa, qw, reference=True)
    via = bs.scaled_mm(qa.data, qw.data.t(), qa.scales, ScalingType.BlockWise1x32, qw.scales, ScalingType.BlockWise1x32,
                       swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=SwizzleType.SWIZZLE_32_4_4,
                       output_dtype=torch.float32, reference=True)
    assert via.dtype == torch.float32 and torch.allclose(via.double(), direct.float().double())
    # NO_SWIZZLE plain scales are converted to the blocked layout
    plain = bs.scaled_mm(qa.data, qw.data.t(), qa.plain_scales(), ScalingType.BlockWise1x32, qw.plain_scales(),
                         ScalingType.BlockWise1x32, swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE,
                         output_dtype=torch.float32, reference=True)
    assert torch.equal(plain, via)
    # NVFP4 with [BlockWise1x16, TensorWise] lists
    na, nw = _operands(64, 32, 128, E2M1, E2M1, seed=4, nvfp4=True)
    nv = bs.scaled_mm(na.data, nw.data.t(), [na.scales, na.global_scale], [ScalingType.BlockWise1x16, ScalingType.TensorWise],
                      [nw.scales, nw.global_scale], [ScalingType.BlockWise1x16, ScalingType.TensorWise],
                      output_dtype=torch.float32, reference=True)
    assert torch.allclose(nv.double(), (na.dequantize() @ nw.dequantize().t()).float().double())


def test_validation_errors():
    qa, qw = _operands(128, 64, 256, E4M3, E4M3, seed=5)
    na, nw = _operands(128, 64, 256, E2M1, E2M1, seed=5, nvfp4=True)
    # wrong vector size for the scale dtype
    with pytest.raises(ValueError, match="vector size 16 does not match"):
        bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales, qw.scales, block_size=16)
    with pytest.raises(ValueError, match="BlockWise1x32"):
        bs.scaled_mm(qa.data, qw.data.t(), qa.scales, ScalingType.BlockWise1x128, qw.scales, ScalingType.BlockWise1x128)
    # wrong scale dtype
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales.view(torch.uint8), qw.scales)
    # NVFP4 scales with FP8 operands
    with pytest.raises(ValueError, match="e2m1 x e2m1"):
        bs.prepare_blockscaled(qa.data, qw.data.t(), na.scales, nw.scales)
    # mixed recipes
    with pytest.raises(ValueError, match="different recipes"):
        bs.prepare_blockscaled(na.data, nw.data.t(), na.scales, ms.quantize_mx_reference(torch.ones(64, 256), "e2m1").scales)
    # K not a multiple of the block (FP8 K=48 passes TMA's 16-element rule but not MX's 32)
    a48 = torch.zeros(128, 48).to(torch.float8_e4m3fn)
    w48 = torch.zeros(64, 48).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of the scale block 32"):
        bs.prepare_blockscaled(a48, w48.t(), qa.scales, qw.scales)
    # scale element count for the wrong shape names the padded expectation
    with pytest.raises(ValueError, match="rows padded to 128"):
        bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales[:64], qw.scales)
    # global scales only with NVFP4
    with pytest.raises(ValueError, match="belong to NVFP4"):
        bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales, qw.scales, global_scale_a=torch.ones(1))
    with pytest.raises(TypeError, match="float32"):
        bs.prepare_blockscaled(na.data, nw.data.t(), na.scales, nw.scales, global_scale_a=torch.ones(2))
    # the GEMM itself needs an sm_100 GPU and says so
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="Blackwell"):
            bs.blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales)


def test_quantize_dispatch_cpu_is_reference():
    x = torch.randn(33, 64)
    a = bs.quantize_mx(x, "e3m2")
    b = ms.quantize_mx_reference(x, "e3m2")
    assert torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))


# ---------------------------------------------------------------- block-scaled MMA hooks: PTX (compile only)


@pytest.mark.parametrize("kind,sf_fmt", [("mxf8f6f4", 1), ("mxf4", 1), ("mxf4nvf4", 0)])
def test_block_scaled_idesc_fields(kind, sf_fmt):
    from cutedsl_gemm.kernels.sm100.blockscaled_gemm import mx_idesc

    d = mx_idesc(kind, 128, 256)
    assert (d >> 17) & 0x3F == 256 >> 3  # n_dim
    assert (d >> 27) & 0x3 == 128 >> 7  # m_dim
    assert (d >> 23) & 0x3 == sf_fmt  # scale format: UE8M0 (MX) / UE4M3 (NVFP4)
    assert (d >> 15) & 0x3 == 0  # K-major A and B


@pytest.mark.compile
@pytest.mark.parametrize("kind,block", [("mxf8f6f4", 32), ("mxf4", 32), ("mxf4nvf4", 16)])
def test_block_scaled_mma_ptx(sm100_env, kind, block):
    from cutedsl_gemm.kernels.sm100.blockscaled_gemm import compile_probe

    ptx = compile_probe(kind).__ptx__
    assert ".target sm_100a" in ptx
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::(\w+)\.block_scale\.block(\d+)", ptx)
    assert mmas and set(mmas) == {(kind, str(block))}
    assert "tcgen05.cp.cta_group::1.32x128b.warpx4" in ptx  # scale factors staged smem -> TMEM
    assert "kind::f8f6f4" not in ptx  # no dense MMA sneaks in


def test_gemm_launch_reports_missing_skeleton_hooks():
    from cutedsl_gemm.kernels.sm100 import blockscaled_gemm

    qa, qw = _operands(128, 64, 256, E4M3, E4M3, seed=6)
    p = bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales, qw.scales)
    with pytest.raises(NotImplementedError, match="f8f6f4 GEMM skeleton"):
        blockscaled_gemm.launch(p)


@pytest.mark.blackwell
@pytest.mark.parametrize("recipe,fa,fb", [("mx", E4M3, E4M3), ("mx", E3M2, E2M3), ("mx", E2M1, E2M1), ("mx", E4M3, E2M1),
                                          ("nvfp4", E2M1, E2M1)], ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("m,n,k", [(128, 128, 256), (300, 136, 512), (1024, 512, 1024)])
def test_blockscaled_gemm_vs_float64(recipe, fa, fb, m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=g).cuda()
    w = torch.randn(n, k, generator=g).cuda()
    if recipe == "nvfp4":
        qa, qw = bs.quantize_nvfp4(a), bs.quantize_nvfp4(w)
    else:
        qa, qw = bs.quantize_mx(a, fa), bs.quantize_mx(w, fb)
    out = bs.mm_quantized(qa, qw, out_dtype=torch.float32)
    ref = qa.dequantize() @ qw.dequantize().t()
    from cutedsl_gemm.reference import rel_error

    assert rel_error(out, ref) < 1e-5  # fp32 accumulation of exactly representable products

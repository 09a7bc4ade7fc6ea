"""Reference numerics (CPU): every quantizer contract and the float64 GEMMs the kernels are checked against."""

import math

import pytest
import torch
from minifloat_oracles import table_round

from cutedsl_gemm.numerics import formats as F
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.codecs import decode_operand, packed_row_bytes, quantize_operand
from cutedsl_gemm.numerics.scale_layouts import blocked_scale_shape

MX_FMTS = (F.E4M3, F.E5M2, F.E3M2, F.E2M3, F.E2M1)


@pytest.mark.parametrize("gran", [F.G.TENSOR, F.G.ROW, F.G.GROUP_1x128, F.G.BLOCK_128x128], ids=lambda g: g.label)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_roundtrip_and_scale_shapes(gran, fmt):
    torch.manual_seed(1)
    x = torch.randn(200, 300) * 5  # partial 128-blocks in both dims
    q, s = R.quantize(x, gran, fmt)
    f = F.element_format(fmt)
    assert q.dtype == f.torch_dtype and q.shape == x.shape
    assert s.shape == (F.scale_shape(gran, 200, 300) or (1, 1))
    # Every group uses its range: the largest |q| of each group is the format's max.
    back = R.dequantize(q, s, gran)
    rel = (back - x.double()).norm() / x.double().norm()
    assert rel < (0.04 if fmt == "e4m3" else 0.08)
    assert q.float().abs().max() == f.max_finite


def test_group_scales_follow_contract():
    x = torch.zeros(130, 256)
    x[0, 0] = 448 * 3.0  # block (0,0) of 1x128 groups: amax 1344 -> scale 3
    x[129, 200] = -7.0
    q, s = R.quantize(x, F.ScaleGranularity.GROUP_1x128)
    assert s.shape == (130, 2)
    assert s[0, 0] == 3.0
    assert s[129, 1] == torch.tensor(7.0) / torch.tensor(448.0)
    assert s[5, 0] == 1.0  # all-zero group -> 1, no division by zero
    assert q[0, 0].float() == 448.0


def test_nonfinite_inputs_saturate_and_propagate_nan():
    x = torch.tensor([[1.0, float("inf"), -float("inf"), float("nan"), 2.0] + [0.0] * 11])
    q, s = R.quantize(x, F.ScaleGranularity.ROW)
    assert s.item() == pytest.approx(2.0 / 448.0)  # inf/nan ignored for amax
    qf = q.float()
    assert qf[0, 1] == 448 and qf[0, 2] == -448 and torch.isnan(qf[0, 3])


def test_reference_gemm_against_explicit_dequant():
    torch.manual_seed(2)
    a, w = torch.randn(33, 256), torch.randn(40, 256)
    for rec in ["tensor", "row", "1x128_128x128", "128x128_128x128", "1x128_1x128"]:
        qa, sa, qw, sw = R.quantize_operands(a, w, rec)
        r = F.recipe(rec)
        da = qa.double() * R.expand_scales(sa.double(), r.a, 33, 256)
        dw = qw.double() * R.expand_scales(sw.double(), r.b, 40, 256)
        bias = torch.randn(40)
        ref = R.reference_gemm(qa, sa, qw, sw, rec, bias=bias)
        assert torch.allclose(ref, da @ dw.t() + bias.double())
        assert R.rel_error(ref - bias.double(), a.double() @ w.double().t()) < 0.06


def test_rel_error_flags_nan_and_wrong_values():
    ref = torch.randn(8, 8, dtype=torch.float64)
    assert R.rel_error(ref.clone(), ref) == 0
    bad = ref.clone()
    bad[3, 3] = float("nan")
    assert R.rel_error(bad, ref) == float("inf")
    assert R.rel_error(ref * 1.01, ref) == pytest.approx(0.01)


# ---------------------------------------------------------------- MX and NVFP4 reference quantizers
# Checked against a float64 transcription of the OCP / NVIDIA recipes and the table-search rounding oracle.


def ocp_mx_float64(x: torch.Tensor, fmt):
    """OCP MX 6.3 written with math.frexp per block: (codes (rows, K), scale codes (rows, K/32))."""
    rows, k = x.shape
    xd = x.double().reshape(rows, k // 32, 32)
    codes = torch.zeros(rows, k // 32, 32, dtype=torch.uint8)
    scodes = torch.zeros(rows, k // 32, dtype=torch.int64)
    elem_emax = {F.E4M3: 8, F.E5M2: 15, F.E3M2: 4, F.E2M3: 2, F.E2M1: 2}[fmt]
    for r in range(rows):
        for b in range(k // 32):
            blk = xd[r, b]
            if torch.isnan(blk).any():
                scodes[r, b] = 255
                continue
            fin = blk[torch.isfinite(blk)]
            amax = fin.abs().max().item() if fin.numel() else 0.0
            if amax == 0:
                e = 0
            else:
                e = max(math.frexp(amax)[1] - 1 - elem_emax, -127)  # floor(log2(amax)) - emax
            scodes[r, b] = e + 127
            codes[r, b] = table_round(blk / 2.0**e, fmt)
    return codes.reshape(rows, k), scodes


def _mx_inputs():
    g = torch.Generator().manual_seed(3)
    # every binade of interest: one block per scale exponent, plus outliers and zero blocks
    exps = torch.arange(-140, 128, dtype=torch.float64)
    blocks = torch.randn(len(exps), 32, generator=g, dtype=torch.float64) * torch.exp2(exps)[:, None]
    blocks = blocks.clamp(-3e38, 3e38).float()
    blocks[0] = 0.0
    x = blocks.reshape(-1, 64)
    return x


@pytest.mark.parametrize("fmt", MX_FMTS, ids=lambda f: f.name)
def test_mx_reference_matches_ocp_float64(fmt):
    x = _mx_inputs()
    x[3, 5] = float("inf")
    x[4, 40] = float("nan")
    q = R.quantize_mx_reference(x, fmt)
    codes, scodes = ocp_mx_float64(x, fmt)
    assert torch.equal(q.plain_scales().view(torch.uint8).long(), scodes)
    got = q.codes()
    nan_block = (scodes == 255).repeat_interleave(32, dim=1)
    assert torch.equal(got[~nan_block], codes[~nan_block])
    assert (got[nan_block] == 0).all()
    assert q.scales.dtype == torch.float8_e8m0fnu
    assert q.scales.shape == blocked_scale_shape(x.shape[0], x.shape[1] // 32)


@pytest.mark.parametrize("fmt", MX_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_mx_reference_random_large(fmt, dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(300, 1024, generator=g) * torch.exp2(torch.randint(-8, 8, (300, 1), generator=g))).to(dtype)
    q = R.quantize_mx_reference(x, fmt)
    deq = q.dequantize()
    # independent transcription bit for bit on a slice (the float64 loop is slow)
    codes, scodes = ocp_mx_float64(x[:8], fmt)
    assert torch.equal(q.codes()[:8], codes)
    # error bound: scale puts the block max in the top binade, so each element's error is at most half
    # an element ulp at that binade (2**(emax - man_bits - 1) * scale) plus the saturation of the top
    s = R.scale_values(q.plain_scales()).double().repeat_interleave(32, dim=1)
    half_ulp_top = 2.0 ** (fmt.emax - fmt.man_bits - 1)
    top_sat = 2.0 ** (fmt.emax + 1) - fmt.max_finite
    err = (x.double() - deq).abs()
    assert (err <= s * max(half_ulp_top, top_sat)).all()
    if q.data.dtype.is_floating_point:  # FP8 / FP4 come back in torch's dtypes
        assert q.data.dtype == (fmt.torch_dtype if fmt.bits != 6 else torch.uint8)
    assert q.data.shape == (300, packed_row_bytes(1024, fmt))


def test_mx_zero_block_scale_one():
    q = R.quantize_mx_reference(torch.zeros(2, 64), "e4m3")
    assert (q.plain_scales().view(torch.uint8) == 127).all()
    assert (q.codes() == 0).all()


def test_nvfp4_reference_recipe():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 512, generator=g) * torch.exp2(
        torch.randint(-6, 6, (200, 32), generator=g)).repeat_interleave(16, 1)
    x[7, 3] = -float("inf")
    x[9, 0:16] = 0.0
    q = R.quantize_nvfp4_reference(x)
    xf = x.double()
    amax_t = xf[torch.isfinite(xf)].abs().max()
    g64 = amax_t / 2688.0
    assert abs(q.global_scale.item() - g64.item()) <= 1e-7 * g64.item()
    assert q.scales.dtype == torch.float8_e4m3fn and q.data.dtype == torch.float4_e2m1fn_x2
    s = q.plain_scales().float().double()
    blk = xf.reshape(200, 32, 16)
    bamax = torch.where(torch.isfinite(blk), blk.abs(), torch.zeros(())).amax(-1)
    # block scale = e4m3(amax_block / 6 / g): within half an E4M3 ulp (relative 2**-4) of the exact value
    exact = bamax / 6 / q.global_scale.double()
    assert ((s - exact).abs() <= exact * 2.0**-4 + 2.0**-10).all()
    assert s[9, 0] == 0 and (q.codes()[9, :16] == 0).all()
    # elements: RNE of x * inv with inv = 1 / (s * g) in fp32 (checked by the float64 table search)
    inv = (1.0 / (s.float() * q.global_scale)).where(s > 0, torch.zeros(()))
    y = (x.reshape(200, 32, 16) * inv.unsqueeze(-1).float()).reshape(200, 512)
    assert torch.equal(q.codes(), table_round(y, F.E2M1))
    err = (q.dequantize() - xf).abs()
    step = (s * q.global_scale.double()).repeat_interleave(16, 1)  # largest E2M1 half-step is 1.0
    finite = torch.isfinite(xf)
    assert (err[finite] <= (step + xf.abs() * 2.0**-3)[finite]).all()


def test_nvfp4_given_global_scale_and_nan_block():
    x = torch.ones(1, 32)
    x[0, 20] = float("nan")
    q = R.quantize_nvfp4_reference(x, global_scale=torch.tensor(0.5))
    assert q.global_scale.item() == 0.5
    sc = q.plain_scales().view(torch.uint8)
    assert sc[0, 1].item() == R.E4M3_NAN
    assert sc[0, 0].item() == torch.tensor(1 / 6 / 0.5).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert torch.isnan(q.dequantize()[0, 16:]).all()
    with pytest.raises(TypeError, match="float32"):
        R.quantize_nvfp4_reference(x, global_scale=torch.tensor([1.0, 2.0]))


def test_block_quantizer_validation():
    with pytest.raises(ValueError, match="multiple of the scale block 32"):
        R.quantize_mx_reference(torch.zeros(4, 48), "e4m3")
    with pytest.raises(ValueError, match="multiple of the scale block 16"):
        R.quantize_nvfp4_reference(torch.zeros(4, 24))
    with pytest.raises(TypeError, match="bfloat16/float16/float32"):
        R.quantize_mx_reference(torch.zeros(4, 32, dtype=torch.float64), "e4m3")
    with pytest.raises(ValueError, match="MX element format"):
        R.quantize_mx_reference(torch.zeros(4, 32), F.UE8M0)
    with pytest.raises(ValueError, match="2-D"):
        R.quantize_mx_reference(torch.zeros(32), "e4m3")
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        R.scale_values(torch.zeros(4, dtype=torch.uint8))


# ---------------------------------------------------------------- float64 reference GEMMs of the Blackwell recipes


def test_reference_blockscaled_mm_dequantizes_both_layouts():
    g = torch.Generator().manual_seed(6)
    a, w = torch.randn(70, 128, generator=g), torch.randn(24, 128, generator=g)
    for qa, qw in ((R.quantize_mx_reference(a, "e3m2"), R.quantize_mx_reference(w, "e2m1")),
                   (R.quantize_nvfp4_reference(a), R.quantize_nvfp4_reference(w))):
        want = qa.dequantize() @ qw.dequantize().t()
        kw = dict(fmt_a=qa.fmt, fmt_b=qw.fmt, global_scale_a=qa.global_scale, global_scale_b=qw.global_scale)
        got = R.reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, **kw)
        assert torch.equal(got, want)
        plain = R.reference_blockscaled_mm(qa.data, qw.data.t(), qa.plain_scales(), qw.plain_scales(),
                                           swizzled=False, **kw)
        assert torch.equal(plain, want)
        bias = torch.randn(24, generator=g)
        assert torch.equal(R.reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, bias=bias, **kw),
                           want + bias.double())


def test_reference_blockscaled_mm_validation():
    mx = R.quantize_mx_reference(torch.randn(8, 64), "e4m3")
    nv = R.quantize_nvfp4_reference(torch.randn(8, 64))
    with pytest.raises(ValueError, match="different recipes"):
        R.reference_blockscaled_mm(nv.data, nv.data.t(), nv.scales, mx.scales)
    with pytest.raises(ValueError, match="vector size 16 does not match"):
        R.reference_blockscaled_mm(mx.data, mx.data.t(), mx.scales, mx.scales, block_size=16)
    with pytest.raises(ValueError, match="belong to NVFP4"):
        R.reference_blockscaled_mm(mx.data, mx.data.t(), mx.scales, mx.scales, global_scale_a=torch.ones(1))
    with pytest.raises(ValueError, match="e2m1 x e2m1"):
        R.reference_blockscaled_mm(mx.data, mx.data.t(), nv.scales, nv.scales)
    with pytest.raises(ValueError, match="rows padded to 128"):
        R.reference_blockscaled_mm(mx.data, mx.data.t(), mx.scales[:64], mx.scales)
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        R.reference_blockscaled_mm(mx.data, mx.data.t(), mx.scales.view(torch.uint8), mx.scales)


def test_reference_f8f6f4_decodes_every_format():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(8, 128, generator=g), torch.randn(16, 128, generator=g)
    sa, sb = torch.tensor([0.5]), torch.tensor(3.0)
    for fa, fb in ((F.E4M3, F.E2M3), (F.E3M2, F.E2M1), (F.E5M2, F.E4M3)):
        a, b = quantize_operand(x, fa), quantize_operand(w, fb).t()
        want = decode_operand(a, fa).double() @ decode_operand(b.t(), fb).double().t() * 1.5
        assert torch.equal(R.reference_f8f6f4(a, b, fmt_a=fa, fmt_b=fb, scale_a=sa, scale_b=sb), want)
    with pytest.raises(TypeError, match="does not name an f8f6f4 format"):
        R.reference_f8f6f4(quantize_operand(x, F.E2M3), b, scale_a=sa, scale_b=sb)

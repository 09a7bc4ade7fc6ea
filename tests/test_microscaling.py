"""CPU tests of the MX / NVFP4 torch reference: scale-factor layout, element codecs, packing, quantizers.

Every check compares against an implementation written independently of the one under test: the
blocked layout against an element-by-element loop over the cuBLAS offset formula, the integer element
encoder against torch's FP8 casts and a float64 nearest-even table search, the quantizers against a
float64 transcription of the OCP / NVIDIA recipes.
"""

import math

import pytest
import torch

from cutedsl_gemm.numerics import microscaling as ms
from cutedsl_gemm.numerics.formats import E2M1, E2M3, E3M2, E4M3, E5M2, UE8M0

ALL_FMTS = (E4M3, E5M2, E3M2, E2M3, E2M1)
RAGGED = [(1, 1), (5, 3), (127, 4), (128, 4), (129, 5), (300, 9), (256, 8), (33, 17)]


# ---------------------------------------------------------------- independent helpers


def loop_to_blocked(plain: torch.Tensor) -> torch.Tensor:
    """cuBLAS 'block scaling factors layout' formula, one element at a time (flat uint8)."""
    rows, cols = plain.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    out = torch.zeros(row_tiles * col_tiles * 512, dtype=torch.uint8)
    for i in range(rows):
        for j in range(cols):
            tile = (i // 128) * col_tiles + j // 4
            outer, inner = i % 128, j % 4
            out[512 * tile + (outer % 32) * 16 + (outer // 32) * 4 + inner] = plain[i, j]
    return out


def table_round(y: torch.Tensor, fmt) -> torch.Tensor:
    """Nearest representable magnitude by table search in float64, ties to the even code, saturating."""
    mags = ms.minifloat_values(fmt)[: ms._max_code(fmt) + 1].double()
    a = y.double().abs().clamp(max=fmt.max_finite)
    lo = torch.searchsorted(mags, a, right=True) - 1
    hi = (lo + 1).clamp(max=len(mags) - 1)
    dlo, dhi = a - mags[lo], mags[hi] - a
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return (pick | (torch.signbit(y).long() << (fmt.bits - 1))).to(torch.uint8)


def ocp_mx_float64(x: torch.Tensor, fmt):
    """OCP MX 6.3 written with math.frexp per block: (codes (rows, K), scale codes (rows, K/32))."""
    rows, k = x.shape
    xd = x.double().reshape(rows, k // 32, 32)
    codes = torch.zeros(rows, k // 32, 32, dtype=torch.uint8)
    scodes = torch.zeros(rows, k // 32, dtype=torch.int64)
    elem_emax = {E4M3: 8, E5M2: 15, E3M2: 4, E2M3: 2, E2M1: 2}[fmt]
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


def bf16_all() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("rows,cols", RAGGED)
def test_to_blocked_matches_cublas_formula(rows, cols):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    plain = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=g)
    blocked = ms.to_blocked(plain)
    assert blocked.shape == ms.blocked_scale_shape(rows, cols)
    assert torch.equal(blocked.flatten(), loop_to_blocked(plain))
    assert torch.equal(ms.from_blocked(blocked, rows, cols), plain)
    # the offset helper (used by the kernel's address arithmetic) agrees with the same formula
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    off = ms.blocked_offset(r, c, cols)
    assert torch.equal(blocked.flatten()[off], plain)


def test_blocked_padding_is_zero_and_keeps_dtype():
    plain = torch.full((130, 5), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    b = ms.to_blocked(plain)
    assert b.dtype == torch.float8_e8m0fnu and b.shape == (256, 8)
    nz = (b.view(torch.uint8) != 0).sum().item()
    assert nz == 130 * 5
    assert torch.equal(ms.from_blocked(b.flatten(), 130, 5).view(torch.uint8), plain.view(torch.uint8))


def test_blocked_validation():
    with pytest.raises(ValueError, match="2-D"):
        ms.to_blocked(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="one-byte"):
        ms.to_blocked(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="128"):
        ms.from_blocked(torch.zeros(100, dtype=torch.uint8), 4, 4)


# ---------------------------------------------------------------- element codecs


@pytest.mark.parametrize("fmt", (E4M3, E5M2), ids=lambda f: f.name)
def test_encoder_matches_torch_fp8_cast(fmt):
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int64, generator=g).to(torch.int32)
    x = torch.cat([bf16_all(), rnd.view(torch.float32)])
    x = x[~torch.isnan(x)]
    ref = x.clamp(-fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype).view(torch.uint8)
    assert torch.equal(ms.encode_minifloat(x, fmt), ref)


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_encoder_matches_table_search(fmt):
    vals = ms.minifloat_values(fmt)[: ms._max_code(fmt) + 1].double()
    mids = ((vals[1:] + vals[:-1]) / 2).float()  # exact ties
    g = torch.Generator().manual_seed(1)
    rnd = (torch.randn(100_000, generator=g) * fmt.max_finite / 3).float()
    tiny = torch.tensor([1e-45, -1e-45, 1e-38, 0.0, -0.0, float("inf"), float("-inf"), 1e30, -1e30])
    x = torch.cat([bf16_all(), mids, -mids, rnd, tiny])
    x = x[~torch.isnan(x)]
    assert torch.equal(ms.encode_minifloat(x, fmt), table_round(x, fmt))


def test_encoder_nan_and_signed_zero():
    x = torch.tensor([float("nan"), -0.0, -1e-30, 0.0])
    assert ms.encode_minifloat(x, E2M1).tolist() == [0, 0x8, 0x8, 0]
    assert ms.encode_minifloat(x, E2M3).tolist() == [0, 0x20, 0x20, 0]


@pytest.mark.parametrize("fmt", (E3M2, E2M3, E2M1), ids=lambda f: f.name)
def test_encoder_agrees_with_fp_packing(fmt):
    """A second, independently written sub-byte encoder (the f8f6f4 GEMM's) gives the same codes."""
    from cutedsl_gemm.numerics import fp_packing

    x = bf16_all()
    x = x[~torch.isnan(x)]
    assert torch.equal(ms.encode_minifloat(x, fmt), fp_packing.encode(x, fmt))


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_decode_roundtrip(fmt):
    codes = torch.arange(1 << fmt.bits, dtype=torch.int64).to(torch.uint8)
    vals = ms.decode_minifloat(codes, fmt)
    ok = torch.isfinite(vals)
    assert torch.equal(ms.encode_minifloat(vals[ok], fmt), codes[ok])


def test_packing_conventions():
    c = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert ms.pack_codes(c, E2M1).tolist() == [[0x21, 0x43]]  # element 0 in the low nibble (torch)
    # FP6: little-endian bit stream: 1 | 2<<6 | 3<<12 | 4<<18 = 0x103081
    assert ms.pack_codes(c, E2M3).tolist() == [[0x81, 0x30, 0x10]]
    g = torch.Generator().manual_seed(2)
    for fmt in ALL_FMTS:
        codes = torch.randint(0, 1 << fmt.bits, (7, 64), dtype=torch.int64, generator=g).to(torch.uint8)
        p = ms.pack_codes(codes, fmt)
        assert p.shape == (7, ms.packed_cols(fmt, 64))
        assert torch.equal(ms.unpack_codes(p, fmt, 64), codes)


# ---------------------------------------------------------------- MX quantizer


def _mx_inputs():
    g = torch.Generator().manual_seed(3)
    # every binade of interest: one block per scale exponent, plus outliers and zero blocks
    exps = torch.arange(-140, 128, dtype=torch.float64)
    blocks = torch.randn(len(exps), 32, generator=g, dtype=torch.float64) * torch.exp2(exps)[:, None]
    blocks = blocks.clamp(-3e38, 3e38).float()
    blocks[0] = 0.0
    x = blocks.reshape(-1, 64)
    return x


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_mx_reference_matches_ocp_float64(fmt):
    x = _mx_inputs()
    x[3, 5] = float("inf")
    x[4, 40] = float("nan")
    q = ms.quantize_mx_reference(x, fmt)
    codes, scodes = ocp_mx_float64(x, fmt)
    assert torch.equal(q.plain_scales().view(torch.uint8).long(), scodes)
    got = q.codes()
    nan_block = (scodes == 255).repeat_interleave(32, dim=1)
    assert torch.equal(got[~nan_block], codes[~nan_block])
    assert (got[nan_block] == 0).all()
    assert q.scales.dtype == torch.float8_e8m0fnu
    assert q.scales.shape == ms.blocked_scale_shape(x.shape[0], x.shape[1] // 32)


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_mx_reference_random_large(fmt, dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(300, 1024, generator=g) * torch.exp2(torch.randint(-8, 8, (300, 1), generator=g))).to(dtype)
    q = ms.quantize_mx_reference(x, fmt)
    deq = q.dequantize()
    # independent transcription bit for bit on a slice (the float64 loop is slow)
    codes, scodes = ocp_mx_float64(x[:8], fmt)
    assert torch.equal(q.codes()[:8], codes)
    # error bound: scale puts the block max in the top binade, so each element's error is at most half
    # an element ulp at that binade (2**(emax - man_bits - 1) * scale) plus the saturation of the top
    s = ms.scale_values(q.plain_scales()).double().repeat_interleave(32, dim=1)
    half_ulp_top = 2.0 ** (ms.emax(fmt) - fmt.man_bits - 1)
    top_sat = 2.0 ** (ms.emax(fmt) + 1) - fmt.max_finite
    err = (x.double() - deq).abs()
    assert (err <= s * max(half_ulp_top, top_sat)).all()
    if q.data.dtype.is_floating_point:  # FP8 / FP4 come back in torch's dtypes
        assert q.data.dtype == (fmt.torch_dtype if fmt.bits != 6 else torch.uint8)
    assert q.data.shape == (300, ms.packed_cols(fmt, 1024))


def test_mx_zero_block_scale_one():
    q = ms.quantize_mx_reference(torch.zeros(2, 64), "e4m3")
    assert (q.plain_scales().view(torch.uint8) == 127).all()
    assert (q.codes() == 0).all()


# ---------------------------------------------------------------- NVFP4 quantizer


def test_nvfp4_reference_recipe():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 512, generator=g) * torch.exp2(torch.randint(-6, 6, (200, 32), generator=g)).repeat_interleave(16, 1)
    x[7, 3] = -float("inf")
    x[9, 0:16] = 0.0
    q = ms.quantize_nvfp4_reference(x)
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
    assert torch.equal(q.codes(), table_round(y, E2M1))
    err = (q.dequantize() - xf).abs()
    step = (s * q.global_scale.double()).repeat_interleave(16, 1)  # largest E2M1 half-step is 1.0
    finite = torch.isfinite(xf)
    assert (err[finite] <= (step + xf.abs() * 2.0**-3)[finite]).all()


def test_nvfp4_given_global_scale_and_nan_block():
    x = torch.ones(1, 32)
    x[0, 20] = float("nan")
    q = ms.quantize_nvfp4_reference(x, global_scale=torch.tensor(0.5))
    assert q.global_scale.item() == 0.5
    sc = q.plain_scales().view(torch.uint8)
    assert sc[0, 1].item() == ms.E4M3_NAN
    assert sc[0, 0].item() == torch.tensor(1 / 6 / 0.5).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert torch.isnan(q.dequantize()[0, 16:]).all()
    with pytest.raises(TypeError, match="float32"):
        ms.quantize_nvfp4_reference(x, global_scale=torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------- validation


def test_quantizer_validation():
    with pytest.raises(ValueError, match="multiple of the scale block 32"):
        ms.quantize_mx_reference(torch.zeros(4, 48), "e4m3")
    with pytest.raises(ValueError, match="multiple of the scale block 16"):
        ms.quantize_nvfp4_reference(torch.zeros(4, 24))
    with pytest.raises(TypeError, match="bfloat16/float16/float32"):
        ms.quantize_mx_reference(torch.zeros(4, 32, dtype=torch.float64), "e4m3")
    with pytest.raises(ValueError, match="MX element format"):
        ms.quantize_mx_reference(torch.zeros(4, 32), UE8M0)
    with pytest.raises(ValueError, match="2-D"):
        ms.quantize_mx_reference(torch.zeros(32), "e4m3")
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        ms.scale_values(torch.zeros(4, dtype=torch.uint8))

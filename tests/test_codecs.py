"""The element codec (numerics/codecs.py): encode / decode / pack / unpack of the f8f6f4 formats.

Sub-byte formats are checked exhaustively against tables written out here by hand (binade by binade from
the OCP MX spec), not derived from the code under test; FP8 against torch's casts; every format against
a float64 nearest-even table search (tests/minifloat_oracles.py).
"""

import itertools

import pytest
import torch
from minifloat_oracles import bf16_all, table_round

from cutedsl_gemm.numerics import codecs
from cutedsl_gemm.numerics.formats import E2M1, E2M3, E3M2, E4M3, E5M2, UE8M0

ALL_FMTS = (E4M3, E5M2, E3M2, E2M3, E2M1)


def _binades(*parts):
    """parts: (first value, step, count) per binade; returns the positive values in code order."""
    out = []
    for start, step, count in parts:
        out += [start + i * step for i in range(count)]
    return out


# Positive magnitudes of codes 0 .. 2**(bits-1)-1, from the OCP MX v1.0 tables.
POSITIVE = {
    "e2m1": [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
    # bias 1, 3 mantissa bits: subnormals k/8, then [1,2) step 1/8, [2,4) step 1/4, [4,8) step 1/2
    "e2m3": _binades((0.0, 0.125, 8), (1.0, 0.125, 8), (2.0, 0.25, 8), (4.0, 0.5, 8)),
    # bias 3, 2 mantissa bits: subnormals k/16, then binades from 2**-2 up to [16, 32)
    "e3m2": _binades(
        (0.0, 0.0625, 4), (0.25, 0.0625, 4), (0.5, 0.125, 4), (1.0, 0.25, 4),
        (2.0, 0.5, 4), (4.0, 1.0, 4), (8.0, 2.0, 4), (16.0, 4.0, 4),
    ),
}
FORMATS = {"e2m1": E2M1, "e2m3": E2M3, "e3m2": E3M2}


def _independent_table(name):
    pos = POSITIVE[name]
    return torch.tensor(pos + [-v for v in pos], dtype=torch.float64)


def _brute_force_rne(x: torch.Tensor, name: str) -> torch.Tensor:
    """Nearest code by exhaustive distance, ties to the even code, after saturation."""
    pos = torch.tensor(POSITIVE[name], dtype=torch.float64)
    a = x.double().abs().clamp(max=pos[-1].item())
    d = (a[:, None] - pos[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best  # one candidate, or two adjacent ones on a tie
    idx = torch.arange(pos.numel())
    score = torch.where(cand, idx % 2, torch.full_like(cand, 2, dtype=torch.long))  # even candidate wins
    choice = torch.argmin(score, dim=1)
    nbits = FORMATS[name].bits
    sign = torch.signbit(x.double()).long() << (nbits - 1)
    return (choice | sign).to(torch.uint8)


def _midpoint_encode(x: torch.Tensor, name: str) -> torch.Tensor:
    """A second sub-byte encoder: count the midpoints below |x| (searchsorted), moving up on an exact
    midpoint whose lower neighbour is odd (round half to even), after saturation."""
    pos = torch.tensor(POSITIVE[name], dtype=torch.float64)
    xd = x.double()
    mids = (pos[1:] + pos[:-1]) / 2
    a = xd.abs().clamp(max=pos[-1].item())
    idx = torch.searchsorted(mids, a.contiguous(), right=False)
    on_mid = (idx < mids.numel()) & (mids[idx.clamp(max=mids.numel() - 1)] == a)
    idx = torch.where(on_mid & (idx % 2 == 1), idx + 1, idx)
    return (idx | (torch.signbit(xd).to(torch.int64) << (FORMATS[name].bits - 1))).to(torch.uint8)


@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_every_code_point(name):
    fmt = FORMATS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    got = codecs.decode(codes, fmt).double()
    want = _independent_table(name)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 has the sign bit
    assert torch.equal(got, want)
    assert got.abs().max().item() == fmt.max_finite


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_roundtrips_every_code_point(name):
    fmt = FORMATS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    vals = _independent_table(name).float()
    assert torch.equal(codecs.encode(vals, fmt), codes)


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_midpoints_round_to_even(name):
    fmt = FORMATS[name]
    pos = POSITIVE[name]
    for i in range(len(pos) - 1):
        lo, hi = pos[i], pos[i + 1]
        mid = (lo + hi) / 2
        x = torch.tensor([mid, -mid, mid * (1 + 2**-20), mid * (1 - 2**-20)], dtype=torch.float32)
        got = codecs.encode(x, fmt).tolist()
        even = i if i % 2 == 0 else i + 1
        sign = 1 << (fmt.bits - 1)
        assert got[0] == even, (name, lo, hi)
        assert got[1] == even | sign
        assert got[2] == i + 1
        assert got[3] == i


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_saturates(name):
    fmt = FORMATS[name]
    top = (1 << (fmt.bits - 1)) - 1
    sign = 1 << (fmt.bits - 1)
    x = torch.tensor([fmt.max_finite * 1.01, 1e30, float("inf"), -float("inf"), -1e30], dtype=torch.float32)
    assert codecs.encode(x, fmt).tolist() == [top, top, top, top | sign, top | sign]


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_matches_brute_force_on_every_bf16(name):
    fmt = FORMATS[name]
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[~torch.isnan(x)]
    got = codecs.encode(x, fmt)
    want = _brute_force_rne(x.float(), name)
    assert torch.equal(got, want)
    # fp32 input gives the same codes as the identical bf16 values
    assert torch.equal(codecs.encode(x.float(), fmt), got)


def test_encode_rejects_nan_and_integers():
    with pytest.raises(ValueError, match="no NaN"):
        codecs.encode(torch.tensor([1.0, float("nan")]), E2M1)
    with pytest.raises(TypeError, match="floating-point"):
        codecs.encode(torch.tensor([1, 2]), E2M1)
    with pytest.raises(ValueError, match="element codec handles"):
        codecs.encode(torch.tensor([1.0]), UE8M0)
    with pytest.raises(TypeError, match="round twice"):
        codecs.encode(torch.tensor([1.0], dtype=torch.float64), E2M1)
    with pytest.raises(ValueError, match="nan must be"):
        codecs.encode(torch.tensor([1.0]), E2M1, nan="keep")


def test_e2m1_packing_low_nibble_first_and_torch_fp4x2():
    codes = torch.tensor([[0x1, 0xF, 0x7, 0x8]], dtype=torch.uint8)
    packed = codecs.pack(codes, E2M1)
    assert packed.tolist() == [[0xF1, 0x87]]
    assert torch.equal(codecs.unpack(packed, E2M1), codes)
    if hasattr(torch, "float4_e2m1fn_x2"):
        as_fp4 = packed.view(torch.float4_e2m1fn_x2)
        assert torch.equal(codecs.unpack(as_fp4, E2M1), codes)
        x = torch.tensor([[0.5, -6.0, 6.0, -0.0]])
        p = codecs.quantize_operand(x, "e2m1", as_float4_x2=True)
        assert p.dtype == torch.float4_e2m1fn_x2 and p.shape == (1, 2)
        assert torch.equal(codecs.decode_operand(p, "e2m1"), x)
    with pytest.raises(ValueError, match="e2m1 only"):
        codecs.quantize_operand(torch.zeros(1, 4), "e2m3", as_float4_x2=True)


def test_fp6_bit_order_is_little_endian_stream():
    # Each value placed alone: its 6 bits must land at bit offset 6*i of the 24-bit little-endian word.
    for i, v in itertools.product(range(4), (0x01, 0x2A, 0x3F)):
        codes = torch.zeros(1, 4, dtype=torch.uint8)
        codes[0, i] = v
        b = codecs.pack(codes, E2M3)[0].tolist()
        word = b[0] | (b[1] << 8) | (b[2] << 16)
        assert word == v << (6 * i), (i, v, b)


@pytest.mark.parametrize("name", ["e2m3", "e3m2"])
def test_fp6_pack_roundtrip_all_codes(name):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 64, (8, 256), generator=g, dtype=torch.uint8)
    codes[0, :64] = torch.arange(64, dtype=torch.uint8)
    packed = codecs.pack(codes, fmt)
    assert packed.shape == (8, 192)
    assert torch.equal(codecs.unpack(packed, fmt), codes)
    assert torch.equal(codecs.decode_operand(packed, fmt), codecs.decode(codes, fmt))


def test_packing_rejects_bad_shapes_and_ranges():
    with pytest.raises(ValueError, match="even"):
        codecs.pack(torch.zeros(1, 3, dtype=torch.uint8), E2M1)
    with pytest.raises(ValueError, match="multiple of 4"):
        codecs.pack(torch.zeros(1, 6, dtype=torch.uint8), E2M3)
    with pytest.raises(ValueError, match="4 bits"):
        codecs.pack(torch.full((1, 2), 16, dtype=torch.uint8), E2M1)
    with pytest.raises(ValueError, match="6 bits"):
        codecs.pack(torch.full((1, 4), 64, dtype=torch.uint8), E3M2)
    with pytest.raises(TypeError, match="uint8 codes"):
        codecs.pack(torch.zeros(1, 4, dtype=torch.int64), E2M1)
    with pytest.raises(ValueError, match="multiple of 3"):
        codecs.unpack(torch.zeros(1, 4, dtype=torch.uint8), E2M3)
    with pytest.raises(TypeError, match="uint8"):
        codecs.unpack(torch.zeros(1, 3, dtype=torch.float32), E2M3)
    with pytest.raises(ValueError, match="out of range"):
        codecs.decode(torch.tensor([16], dtype=torch.uint8), E2M1)


def test_row_byte_helpers():
    assert codecs.packed_row_bytes(256, "e2m1") == 128
    assert codecs.packed_row_bytes(256, "e3m2") == 192
    assert codecs.packed_row_bytes(256, "e4m3") == 256
    assert codecs.logical_k(192, "e2m3") == 256
    with pytest.raises(ValueError, match="whole bytes"):
        codecs.packed_row_bytes(6, "e2m3")


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_quantize_operand_decode_operand_roundtrip(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 128, generator=g) * 3
    q = codecs.quantize_operand(x, name)
    v = codecs.decode_operand(q, name)
    # Requantizing decoded values is exact: they are representable.
    assert torch.equal(codecs.decode_operand(codecs.quantize_operand(v, name), name), v)
    assert v.shape == x.shape
    with pytest.raises(TypeError, match="must be stored as"):
        codecs.decode_operand(q.view(torch.int8), name)


# ---------------------------------------------------------------- the integer encoder, every format


@pytest.mark.parametrize("fmt", (E4M3, E5M2), ids=lambda f: f.name)
def test_encoder_matches_torch_fp8_cast(fmt):
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int64, generator=g).to(torch.int32)
    x = torch.cat([bf16_all(), rnd.view(torch.float32)])
    x = x[~torch.isnan(x)]
    ref = x.clamp(-fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype).view(torch.uint8)
    assert torch.equal(codecs.encode(x, fmt), ref)


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_encoder_matches_table_search(fmt):
    vals = codecs.code_values(fmt)[: fmt.max_code + 1].double()
    mids = ((vals[1:] + vals[:-1]) / 2).float()  # exact ties
    g = torch.Generator().manual_seed(1)
    rnd = (torch.randn(100_000, generator=g) * fmt.max_finite / 3).float()
    tiny = torch.tensor([1e-45, -1e-45, 1e-38, 0.0, -0.0, float("inf"), float("-inf"), 1e30, -1e30])
    x = torch.cat([bf16_all(), mids, -mids, rnd, tiny])
    x = x[~torch.isnan(x)]
    assert torch.equal(codecs.encode(x, fmt), table_round(x, fmt))


def test_encoder_nan_and_signed_zero():
    x = torch.tensor([float("nan"), -0.0, -1e-30, 0.0])
    assert codecs.encode(x, E2M1, nan="zero").tolist() == [0, 0x8, 0x8, 0]
    assert codecs.encode(x, E2M3, nan="zero").tolist() == [0, 0x20, 0x20, 0]
    assert codecs.encode(x, E4M3, nan="zero").tolist() == [0, 0x80, 0x80, 0]
    with pytest.raises(ValueError, match="contains NaN"):
        codecs.encode(x, E4M3)


@pytest.mark.parametrize("name", list(FORMATS))
def test_encoder_agrees_with_midpoint_search(name):
    """A second, independently written sub-byte encoder (midpoint search) gives the same codes."""
    x = bf16_all()
    x = x[~torch.isnan(x)]
    assert torch.equal(codecs.encode(x, FORMATS[name]), _midpoint_encode(x, name))


@pytest.mark.parametrize("fmt", ALL_FMTS, ids=lambda f: f.name)
def test_decode_roundtrip(fmt):
    codes = torch.arange(1 << fmt.bits, dtype=torch.int64).to(torch.uint8)
    vals = codecs.decode(codes, fmt)
    ok = torch.isfinite(vals)
    assert torch.equal(codecs.encode(vals[ok], fmt), codes[ok])
    if fmt.bits == 8:  # FP8 decodes as torch's dtype does, NaN codes included
        assert torch.equal(vals.view(torch.int32), codes.view(fmt.torch_dtype).float().view(torch.int32))


def test_packing_conventions():
    c = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert codecs.pack(c, E2M1).tolist() == [[0x21, 0x43]]  # element 0 in the low nibble (torch)
    # FP6: little-endian bit stream: 1 | 2<<6 | 3<<12 | 4<<18 = 0x103081
    assert codecs.pack(c, E2M3).tolist() == [[0x81, 0x30, 0x10]]
    g = torch.Generator().manual_seed(2)
    for fmt in ALL_FMTS:
        codes = torch.randint(0, 1 << fmt.bits, (7, 64), dtype=torch.int64, generator=g).to(torch.uint8)
        p = codecs.pack(codes, fmt)
        assert p.shape == (7, codecs.packed_row_bytes(64, fmt))
        assert torch.equal(codecs.unpack(p, fmt), codes)
        assert torch.equal(codecs.unpack(codecs.storage_view(p, fmt), fmt), codes)


def test_operand_format_from_storage():
    assert codecs.operand_format("a", torch.zeros(2, 2, dtype=torch.float8_e5m2)) is E5M2
    assert codecs.operand_format("a", torch.zeros(2, 3, dtype=torch.uint8), "e3m2") is E3M2
    with pytest.raises(TypeError, match="does not name an f8f6f4 format"):
        codecs.operand_format("a", torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="must be stored as"):
        codecs.operand_format("b", torch.zeros(2, 2, dtype=torch.float8_e4m3fn), "e2m1")

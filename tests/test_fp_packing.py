"""Sub-byte encode / decode / packing, checked exhaustively against tables written out here by hand
(binade by binade from the OCP MX spec), not derived from the code under test."""

import itertools

import pytest
import torch

from cutedsl_gemm.numerics import fp_packing as fp
from cutedsl_gemm.numerics.formats import E2M1, E2M3, E3M2, E4M3


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


@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_every_code_point(name):
    fmt = FORMATS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    got = fp.decode(codes, fmt).double()
    want = _independent_table(name)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 has the sign bit
    assert torch.equal(got, want)
    assert got.abs().max().item() == fmt.max_finite


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_roundtrips_every_code_point(name):
    fmt = FORMATS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    vals = _independent_table(name).float()
    assert torch.equal(fp.encode(vals, fmt), codes)


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_midpoints_round_to_even(name):
    fmt = FORMATS[name]
    pos = POSITIVE[name]
    for i in range(len(pos) - 1):
        lo, hi = pos[i], pos[i + 1]
        mid = (lo + hi) / 2
        x = torch.tensor([mid, -mid, mid * (1 + 2**-20), mid * (1 - 2**-20)], dtype=torch.float32)
        got = fp.encode(x, fmt).tolist()
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
    assert fp.encode(x, fmt).tolist() == [top, top, top, top | sign, top | sign]


@pytest.mark.parametrize("name", list(FORMATS))
def test_encode_matches_brute_force_on_every_bf16(name):
    fmt = FORMATS[name]
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[~torch.isnan(x)]
    got = fp.encode(x, fmt)
    want = _brute_force_rne(x.float(), name)
    assert torch.equal(got, want)
    # fp32 input gives the same codes as the identical bf16 values
    assert torch.equal(fp.encode(x.float(), fmt), got)


def test_encode_rejects_nan_and_integers():
    with pytest.raises(ValueError, match="no NaN"):
        fp.encode(torch.tensor([1.0, float("nan")]), E2M1)
    with pytest.raises(TypeError, match="floating-point"):
        fp.encode(torch.tensor([1, 2]), E2M1)
    with pytest.raises(ValueError, match="sub-byte"):
        fp.encode(torch.tensor([1.0]), E4M3)


def test_e2m1_packing_low_nibble_first_and_torch_fp4x2():
    codes = torch.tensor([[0x1, 0xF, 0x7, 0x8]], dtype=torch.uint8)
    packed = fp.pack_e2m1(codes)
    assert packed.tolist() == [[0xF1, 0x87]]
    assert torch.equal(fp.unpack_e2m1(packed), codes)
    if hasattr(torch, "float4_e2m1fn_x2"):
        as_fp4 = packed.view(torch.float4_e2m1fn_x2)
        assert torch.equal(fp.unpack_e2m1(as_fp4), codes)
        x = torch.tensor([[0.5, -6.0, 6.0, -0.0]])
        p = fp.pack(x, "e2m1", as_float4_x2=True)
        assert p.dtype == torch.float4_e2m1fn_x2 and p.shape == (1, 2)
        assert torch.equal(fp.decode_packed(p, "e2m1"), x)


def test_fp6_bit_order_is_little_endian_stream():
    # Each value placed alone: its 6 bits must land at bit offset 6*i of the 24-bit little-endian word.
    for i, v in itertools.product(range(4), (0x01, 0x2A, 0x3F)):
        codes = torch.zeros(1, 4, dtype=torch.uint8)
        codes[0, i] = v
        b = fp.pack_fp6(codes)[0].tolist()
        word = b[0] | (b[1] << 8) | (b[2] << 16)
        assert word == v << (6 * i), (i, v, b)


@pytest.mark.parametrize("name", ["e2m3", "e3m2"])
def test_fp6_pack_roundtrip_all_codes(name):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 64, (8, 256), generator=g, dtype=torch.uint8)
    codes[0, :64] = torch.arange(64, dtype=torch.uint8)
    packed = fp.pack_fp6(codes)
    assert packed.shape == (8, 192)
    assert torch.equal(fp.unpack_fp6(packed), codes)
    assert torch.equal(fp.decode_packed(packed, fmt), fp.decode(codes, fmt))


def test_packing_rejects_bad_shapes_and_ranges():
    with pytest.raises(ValueError, match="even"):
        fp.pack_e2m1(torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        fp.pack_fp6(torch.zeros(1, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4 bits"):
        fp.pack_e2m1(torch.full((1, 2), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="6 bits"):
        fp.pack_fp6(torch.full((1, 4), 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 3"):
        fp.unpack_fp6(torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        fp.unpack_fp6(torch.zeros(1, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match="out of range"):
        fp.decode(torch.tensor([16], dtype=torch.uint8), E2M1)


def test_row_byte_helpers():
    assert fp.packed_row_bytes(256, "e2m1") == 128
    assert fp.packed_row_bytes(256, "e3m2") == 192
    assert fp.packed_row_bytes(256, "e4m3") == 256
    assert fp.logical_k(192, "e2m3") == 256
    with pytest.raises(ValueError):
        fp.packed_row_bytes(6, "e2m3")


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"])
def test_quantize_operand_decode_operand_roundtrip(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 128, generator=g) * 3
    q = fp.quantize_operand(x, name)
    v = fp.decode_operand(q, name)
    # Requantizing decoded values is exact: they are representable.
    assert torch.equal(fp.decode_operand(fp.quantize_operand(v, name), name), v)
    assert v.shape == x.shape

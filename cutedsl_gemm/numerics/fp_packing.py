"""Host-side encode / decode and packing of the sub-byte OCP formats E2M1 (FP4), E2M3 and E3M2 (FP6).

Three layers, all pure torch (CPU or GPU):

* **codes**: one uint8 per element holding the format's bit pattern in the low bits
  (sign is the top bit of the format: bit 3 for E2M1, bit 5 for E2M3/E3M2).
  :func:`encode` rounds fp32 / bf16 / fp16 to the nearest representable value, ties to the code
  with an even mantissa LSB (IEEE round-to-nearest-even), saturating overflow and +-inf to
  +-max_finite. These formats have no NaN, so NaN input raises. :func:`decode` is the inverse
  (exact, to fp32).
* **packed storage** in global memory, the layout the Blackwell TMA unit reads:

  - E2M1: two codes per byte, element ``2j`` in the **low** nibble, ``2j+1`` in the high nibble.
    This is the layout of ``torch.float4_e2m1fn_x2`` (and of the DSL's ``Float4E2M1FN``).
  - E2M3 / E3M2: four codes in three bytes, a little-endian bit stream: element ``i`` occupies
    bits ``[6i, 6i + 6)`` of the row read as one little-endian integer. For one group of four::

        byte0 = v0        | (v1 & 0x03) << 6
        byte1 = v1 >> 2   | (v2 & 0x0F) << 4
        byte2 = v2 >> 4   | v3 << 2

    Why this order: the TMA sub-byte type ``.b6x16_p32`` (CUDA ``CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B``)
    takes sixteen 6-bit values packed contiguously in 12 bytes of global memory and writes them to
    16 bytes of shared memory (PTX ISA "Tensor Dimension, size and format", sub-byte types). The
    CUTLASS DSL's own fp6 test-data path (``cutlass.cute.testing``) builds that global layout with
    an LLVM ``vector<i8> -> vector<f6>`` bitcast, which on a little-endian target is exactly the
    bit stream above. The same LSB-first rule gives the E2M1 nibble order.

* **float reference values**: :func:`decode_packed` turns packed storage back into fp32, which the
  float64 reference GEMM consumes.

Nothing here needs the CuTe DSL or a GPU.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Tuple

import torch

from cutedsl_gemm.numerics.formats import E2M1, E2M3, E3M2, ElementFormat, element_format

SUBBYTE_FORMATS = (E2M1, E2M3, E3M2)


def _subbyte(fmt) -> ElementFormat:
    f = element_format(fmt)
    if f not in SUBBYTE_FORMATS:
        raise ValueError(f"expected one of the sub-byte formats e2m1, e2m3, e3m2; got {f.name}")
    return f


@lru_cache(maxsize=None)
def _positive_values(fmt: ElementFormat) -> Tuple[float, ...]:
    """Value of every non-negative code 0 .. 2**(bits-1) - 1, in code order (which is value order)."""
    vals = []
    for code in range(1 << (fmt.bits - 1)):
        e = code >> fmt.man_bits
        m = code & ((1 << fmt.man_bits) - 1)
        if e == 0:
            vals.append(m / (1 << fmt.man_bits) * 2.0 ** (1 - fmt.bias))
        else:
            vals.append((1 + m / (1 << fmt.man_bits)) * 2.0 ** (e - fmt.bias))
    assert vals[-1] == fmt.max_finite, (fmt.name, vals[-1])
    return tuple(vals)


def code_table(fmt) -> torch.Tensor:
    """float64 value of every code 0 .. 2**bits - 1 of a sub-byte format."""
    fmt = _subbyte(fmt)
    pos = torch.tensor(_positive_values(fmt), dtype=torch.float64)
    return torch.cat([pos, -pos])


def encode(x: torch.Tensor, fmt) -> torch.Tensor:
    """Round ``x`` (fp32 / bf16 / fp16) to ``fmt`` codes, one uint8 per element, RNE with saturation."""
    fmt = _subbyte(fmt)
    if not x.is_floating_point():
        raise TypeError(f"encode expects a floating-point tensor (fp32, bf16 or fp16), got {x.dtype}")
    xd = x.double()  # exact for every fp32 / bf16 / fp16 input, so midpoint tests are exact
    if torch.isnan(xd).any():
        raise ValueError(f"{fmt.name} has no NaN encoding; the input contains NaN")
    pos = torch.tensor(_positive_values(fmt), dtype=torch.float64, device=x.device)
    mids = (pos[1:] + pos[:-1]) / 2
    a = xd.abs().clamp(max=fmt.max_finite)  # saturate (inf included)
    idx = torch.searchsorted(mids, a.contiguous(), right=False)  # number of midpoints < a
    # a exactly on midpoint idx: searchsorted picked the lower neighbour; go up when that one is odd.
    on_mid = (idx < mids.numel()) & (mids[idx.clamp(max=mids.numel() - 1)] == a)
    idx = torch.where(on_mid & (idx % 2 == 1), idx + 1, idx)
    sign = torch.signbit(xd).to(torch.int64) << (fmt.bits - 1)
    return (idx | sign).to(torch.uint8)


def decode(codes: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 values of uint8 ``codes`` of ``fmt`` (one code per element)."""
    fmt = _subbyte(fmt)
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode expects uint8 codes, got {codes.dtype}")
    if (codes >> fmt.bits).any():
        raise ValueError(f"codes out of range for the {fmt.bits}-bit format {fmt.name}")
    table = code_table(fmt).to(device=codes.device, dtype=torch.float32)
    return table[codes.long()]


# ---------------------------------------------------------------------------------------------
# Packing along the last dimension
# ---------------------------------------------------------------------------------------------


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) uint8 codes -> (..., K/2) uint8, element 2j in the low nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_e2m1 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"E2M1 packs two values per byte: the last dim must be even, got {codes.shape[-1]}")
    if (codes >> 4).any():
        raise ValueError("E2M1 codes must fit in 4 bits")
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) uint8 (or float4_e2m1fn_x2) -> (..., K) uint8 codes."""
    p = as_bytes(packed)
    out = torch.stack([p & 0x0F, p >> 4], dim=-1)
    return out.reshape(*p.shape[:-1], -1)


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) uint8 6-bit codes -> (..., 3K/4) uint8 little-endian bit stream (see module doc)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp6 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 4:
        raise ValueError(f"FP6 packs four values in three bytes: the last dim must be a multiple of 4, got {codes.shape[-1]}")
    if (codes >> 6).any():
        raise ValueError("FP6 codes must fit in 6 bits")
    c = codes.reshape(*codes.shape[:-1], -1, 4)
    v0, v1, v2, v3 = c.unbind(-1)
    b0 = v0 | ((v1 & 0x03) << 6)
    b1 = (v1 >> 2) | ((v2 & 0x0F) << 4)
    b2 = (v2 >> 4) | (v3 << 2)
    out = torch.stack([b0, b1, b2], dim=-1)
    return out.reshape(*codes.shape[:-1], -1).contiguous()


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """(..., 3K/4) uint8 -> (..., K) uint8 6-bit codes."""
    p = as_bytes(packed)
    if p.shape[-1] % 3:
        raise ValueError(f"packed FP6 rows hold whole 3-byte groups: last dim must be a multiple of 3, got {p.shape[-1]}")
    g = p.reshape(*p.shape[:-1], -1, 3)
    b0, b1, b2 = g.unbind(-1)
    v0 = b0 & 0x3F
    v1 = (b0 >> 6) | ((b1 & 0x0F) << 2)
    v2 = (b1 >> 4) | ((b2 & 0x03) << 4)
    v3 = b2 >> 2
    return torch.stack([v0, v1, v2, v3], dim=-1).reshape(*p.shape[:-1], -1)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View packed storage (uint8, int8 or float4_e2m1fn_x2) as uint8 without copying."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.int8 or t.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return t.view(torch.uint8)
    raise TypeError(f"packed sub-byte storage must be uint8 (or float4_e2m1fn_x2 for e2m1), got {t.dtype}")


# ---------------------------------------------------------------------------------------------
# One-call helpers
# ---------------------------------------------------------------------------------------------


def packed_row_bytes(k: int, fmt) -> int:
    """Bytes one row of K elements takes in global memory."""
    fmt = element_format(fmt)
    bits = k * fmt.bits
    if bits % 8:
        raise ValueError(f"{k} {fmt.name} elements do not fill whole bytes")
    return bits // 8


def logical_k(row_bytes: int, fmt) -> int:
    """Elements in a packed row of ``row_bytes`` bytes."""
    fmt = element_format(fmt)
    if (row_bytes * 8) % fmt.bits:
        raise ValueError(f"{row_bytes} bytes is not a whole number of {fmt.bits}-bit {fmt.name} values")
    return row_bytes * 8 // fmt.bits


def pack(x: torch.Tensor, fmt, *, as_float4_x2: bool = False) -> torch.Tensor:
    """Quantize (RNE, saturating) and pack ``x`` (..., K) for global memory.

    E2M1 -> (..., K/2) uint8 (``torch.float4_e2m1fn_x2`` when ``as_float4_x2``);
    E2M3 / E3M2 -> (..., 3K/4) uint8.
    """
    fmt = _subbyte(fmt)
    codes = encode(x, fmt)
    if fmt is E2M1:
        p = pack_e2m1(codes)
        if as_float4_x2:
            dt = getattr(torch, "float4_e2m1fn_x2", None)
            if dt is None:
                raise TypeError("this torch build has no float4_e2m1fn_x2 dtype")
            p = p.view(dt)
        return p
    if as_float4_x2:
        raise ValueError(f"as_float4_x2 applies to e2m1 only, not {fmt.name}")
    return pack_fp6(codes)


def unpack_codes(packed: torch.Tensor, fmt) -> torch.Tensor:
    fmt = _subbyte(fmt)
    return unpack_e2m1(packed) if fmt is E2M1 else unpack_fp6(packed)


def decode_packed(packed: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 values of packed storage (the inverse of :func:`pack` up to rounding)."""
    return decode(unpack_codes(packed, fmt), fmt)


def decode_operand(t: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 values of a GEMM operand in any f8f6f4 format (FP8 torch dtypes or packed FP6/FP4)."""
    f = element_format(fmt)
    if f in SUBBYTE_FORMATS:
        return decode_packed(t, f)
    if f.torch_dtype is None:
        raise ValueError(f"no decoder for {f.name}")
    if t.dtype == torch.uint8:
        t = t.view(f.torch_dtype)
    if t.dtype != f.torch_dtype:
        raise TypeError(f"{f.name} operand must be {f.torch_dtype} (or its uint8 bytes), got {t.dtype}")
    return t.float()


def quantize_operand(x: torch.Tensor, fmt) -> torch.Tensor:
    """Storage for a GEMM operand in ``fmt``: FP8 torch dtype (saturating RNE) or packed uint8."""
    f = element_format(fmt)
    if f in SUBBYTE_FORMATS:
        return pack(x, f)
    if f.torch_dtype is None or f.bits != 8:
        raise ValueError(f"quantize_operand handles e4m3, e5m2, e3m2, e2m3, e2m1; got {f.name}")
    return x.float().clamp(-f.max_finite, f.max_finite).to(f.torch_dtype)

"""Element encode / decode and storage packing of the f8f6f4 formats (E4M3, E5M2, E3M2, E2M3, E2M1).

Pure torch, any device. Two layers:

* **codes**: one uint8 per element holding the format's bit pattern in the low ``bits`` bits (sign on top).
  :func:`encode` rounds fp32 / bf16 / fp16 to the nearest representable value, ties to the even code, in
  one step from the fp32 value; magnitudes past the largest finite value (inf included) saturate to it;
  the sign is kept, zeros and values rounding to zero included (``-0`` encodes as the sign bit alone).
  It is written with integer operations on the fp32 bit pattern, exactly as the quantizer kernels
  (``kernels/sm100/quantize_mx.py``) do it. NaN input raises, or encodes as +0 with ``nan="zero"``
  (the quantizers' rule). :func:`decode` is the exact inverse, to fp32.
* **storage** in global memory, the layout torch and the Blackwell TMA unit use (:func:`pack`, :func:`unpack`):

  - FP8: one byte per element, torch's ``float8_e4m3fn`` / ``float8_e5m2``.
  - E2M1: two codes per byte, element ``2j`` in the **low** nibble, ``2j+1`` in the high nibble: the layout
    of ``torch.float4_e2m1fn_x2`` (and of the DSL's ``Float4E2M1FN``).
  - E2M3 / E3M2: four codes in three bytes, a little-endian bit stream: element ``i`` occupies bits
    ``[6i, 6i + 6)`` of the row read as one little-endian integer. For one group of four::

        byte0 = v0        | (v1 & 0x03) << 6
        byte1 = v1 >> 2   | (v2 & 0x0F) << 4
        byte2 = v2 >> 4   | v3 << 2

    The TMA sub-byte type ``.b6x16_p32`` (CUDA ``CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B``) takes sixteen
    6-bit values packed contiguously in 12 bytes of global memory (PTX ISA "Tensor Dimension, size and
    format", sub-byte types), and the DSL's own fp6 test-data path (``cutlass.cute.testing``) builds that
    layout with an LLVM ``vector<i8> -> vector<f6>`` bitcast: on a little-endian target, the bit stream
    above. The same LSB-first rule gives the E2M1 nibble order.

:func:`quantize_operand` and :func:`decode_operand` go from floats to GEMM operand storage and back.
"""

from __future__ import annotations

import struct
from functools import cache

import torch

from cutedsl_gemm.numerics.formats import E2M1, E2M3, E3M2, F8F6F4_FORMATS, FP8_FORMATS, ElementFormat, element_format

SUBBYTE_FORMATS = (E2M1, E2M3, E3M2)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
_ENCODE_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _codec_format(fmt) -> ElementFormat:
    f = element_format(fmt)
    if f not in F8F6F4_FORMATS:
        raise ValueError(f"the element codec handles {', '.join(g.name for g in F8F6F4_FORMATS)}; got {f.name}")
    return f


def fp32_bits(value: float) -> int:
    """The IEEE fp32 bit pattern of ``value`` (rounded to fp32) as a non-negative int."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


# ---------------------------------------------------------------------------------------------------
# Element codes
# ---------------------------------------------------------------------------------------------------


def _rne_shr(v: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even right shift of non-negative int64 ``v`` by ``sh`` in [1, 62]."""
    half_m1 = (torch.ones_like(v) << (sh - 1)) - 1
    return (v + half_m1 + ((v >> sh) & 1)) >> sh


def encode(x: torch.Tensor, fmt, *, nan: str = "raise") -> torch.Tensor:
    """fp32 / bf16 / fp16 ``x`` -> ``fmt`` codes, one uint8 per element (RNE, saturating, sign kept).

    ``nan="raise"`` refuses NaN input; ``nan="zero"`` encodes it as +0, as the quantizer kernels do.
    """
    fmt = _codec_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"encode expects a floating-point tensor (fp32, bf16 or fp16), got {getattr(x, 'dtype', x)}")
    if x.dtype not in _ENCODE_INPUTS:
        raise TypeError(f"encode takes fp32, bf16 or fp16 (rounding {x.dtype} to fp32 first would round twice)")
    if nan not in ("raise", "zero"):
        raise ValueError(f"nan must be 'raise' or 'zero', got {nan!r}")
    if nan == "raise" and torch.isnan(x).any():
        why = f"{fmt.name} has no NaN encoding" if not fmt.has_nan else f"encode produces no {fmt.name} NaN codes"
        raise ValueError(f"the input contains NaN and {why}; nan='zero' encodes NaN as +0")
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = bits >> 31
    a = bits & 0x7FFFFFFF
    m, b = fmt.man_bits, fmt.bias
    exp_field = a >> 23
    # normal in the target: round the fp32 pattern at the target mantissa width; a carry walks into
    # the exponent field, which is exactly the next binade
    normal = _rne_shr(a, torch.full_like(a, 23 - m)) - ((127 - b) << m)
    # subnormal in the target: |x| = mant * 2**(e - 23), quantum 2**(1 - b - m)
    mant = (a & 0x7FFFFF) | torch.where(exp_field > 0, 0x800000, 0)
    e = torch.clamp(exp_field, min=1) - 127
    sh = torch.clamp(23 + (1 - b - m) - e, max=31)
    sub = _rne_shr(mant, sh)
    code = torch.where(e >= 1 - b, normal, sub)
    code = torch.where(a >= fp32_bits(fmt.max_finite), torch.full_like(code, fmt.max_code), code)  # inf too
    code = code | (sign << (fmt.bits - 1))
    code = torch.where(a > 0x7F800000, torch.zeros_like(code), code)  # NaN
    return code.to(torch.uint8)


@cache
def _code_values_cpu(fmt: ElementFormat) -> torch.Tensor:
    if fmt in FP8_FORMATS:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype).float()
    vals = []
    for code in range(1 << (fmt.bits - 1)):
        e = code >> fmt.man_bits
        m = code & ((1 << fmt.man_bits) - 1)
        if e == 0:
            vals.append(m / (1 << fmt.man_bits) * 2.0 ** (1 - fmt.bias))
        else:
            vals.append((1 + m / (1 << fmt.man_bits)) * 2.0 ** (e - fmt.bias))
    pos = torch.tensor(vals, dtype=torch.float32)
    return torch.cat([pos, -pos])


def code_values(fmt) -> torch.Tensor:
    """fp32 value of every code ``0 .. 2**bits - 1`` of ``fmt`` (NaN / inf codes included for FP8)."""
    return _code_values_cpu(_codec_format(fmt)).clone()


def decode(codes: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 values of uint8 ``codes`` of ``fmt`` (one code per element); exact."""
    fmt = _codec_format(fmt)
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode expects uint8 codes, got {codes.dtype}")
    if fmt.bits < 8 and (codes >> fmt.bits).any():
        raise ValueError(f"codes out of range for the {fmt.bits}-bit format {fmt.name}")
    return _code_values_cpu(fmt).to(codes.device)[codes.long()]


# ---------------------------------------------------------------------------------------------------
# Storage: packing along the last dimension
# ---------------------------------------------------------------------------------------------------


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View one-byte storage (uint8, int8, float8_*, float4_e2m1fn_x2) as uint8 without copying."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"packed storage must be a one-byte dtype (uint8, float8_*, float4_e2m1fn_x2), got {t.dtype}")
    return t.view(torch.uint8)


def pack(codes: torch.Tensor, fmt) -> torch.Tensor:
    """(..., K) uint8 codes -> (..., K * bits / 8) uint8 storage: FP8 as is, E2M1 two per byte (low nibble
    first), E2M3 / E3M2 four in three bytes (see the module doc)."""
    fmt = _codec_format(fmt)
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack expects uint8 codes, got {codes.dtype}")
    if fmt.bits == 8:
        return codes.contiguous()
    if fmt.bits == 4:
        if codes.shape[-1] % 2:
            raise ValueError(f"E2M1 packs two values per byte: the last dim must be even, got {codes.shape[-1]}")
        if (codes >> 4).any():
            raise ValueError("E2M1 codes must fit in 4 bits")
        c = codes.reshape(*codes.shape[:-1], -1, 2)
        return (c[..., 0] | (c[..., 1] << 4)).contiguous()
    if codes.shape[-1] % 4:
        raise ValueError(
            f"FP6 packs four values in three bytes: the last dim must be a multiple of 4, got {codes.shape[-1]}"
        )
    if (codes >> 6).any():
        raise ValueError("FP6 codes must fit in 6 bits")
    v0, v1, v2, v3 = codes.reshape(*codes.shape[:-1], -1, 4).unbind(-1)
    out = torch.stack([v0 | ((v1 & 0x03) << 6), (v1 >> 2) | ((v2 & 0x0F) << 4), (v2 >> 4) | (v3 << 2)], dim=-1)
    return out.reshape(*codes.shape[:-1], -1).contiguous()


def unpack(packed: torch.Tensor, fmt) -> torch.Tensor:
    """Inverse of :func:`pack`: (..., K * bits / 8) storage of any one-byte dtype -> (..., K) uint8 codes."""
    fmt = _codec_format(fmt)
    p = as_bytes(packed)
    if fmt.bits == 8:
        return p.clone()
    if fmt.bits == 4:
        return torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(*p.shape[:-1], -1)
    if p.shape[-1] % 3:
        raise ValueError(
            f"packed FP6 rows hold whole 3-byte groups: last dim must be a multiple of 3, got {p.shape[-1]}"
        )
    b0, b1, b2 = p.reshape(*p.shape[:-1], -1, 3).unbind(-1)
    v = [b0 & 0x3F, (b0 >> 6) | ((b1 & 0x0F) << 2), (b1 >> 4) | ((b2 & 0x03) << 4), b2 >> 2]
    return torch.stack(v, dim=-1).reshape(*p.shape[:-1], -1)


def storage_view(packed: torch.Tensor, fmt) -> torch.Tensor:
    """uint8 storage in the torch dtype users expect (float8_*, float4_e2m1fn_x2; FP6 stays uint8)."""
    fmt = element_format(fmt)
    if fmt.torch_dtype is not None and fmt.bits in (8, 4):
        return packed.view(fmt.torch_dtype)
    return packed


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


# ---------------------------------------------------------------------------------------------------
# GEMM operands
# ---------------------------------------------------------------------------------------------------


def storage_dtypes(fmt) -> tuple:
    """torch dtypes that hold an operand in ``fmt``: its own (FP8, FP4 pairs) and uint8 bytes."""
    fmt = _codec_format(fmt)
    return tuple(d for d in (fmt.torch_dtype, torch.uint8) if d is not None)


def operand_format(name: str, t: torch.Tensor, fmt=None) -> ElementFormat:
    """The format of operand ``name``: ``fmt``, checked against ``t``'s storage dtype, or, when None,
    the one ``t``'s dtype names (FP8 dtypes, ``float4_e2m1fn_x2``); packed FP6 in uint8 needs ``fmt``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if fmt is None:
        by_dtype = {f.torch_dtype: f for f in F8F6F4_FORMATS if f.torch_dtype is not None}
        if t.dtype not in by_dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype}, which does not name an f8f6f4 format; pass fmt_{name[0]}= one of "
                "'e4m3', 'e5m2', 'e3m2', 'e2m3', 'e2m1' (packed FP6/FP4 live in uint8)"
            )
        return by_dtype[t.dtype]
    f = element_format(fmt)
    if f not in F8F6F4_FORMATS:
        raise ValueError(f"fmt for {name} must be one of e4m3, e5m2, e3m2, e2m3, e2m1; got {f.name}")
    if t.dtype not in storage_dtypes(f):
        allowed = ", ".join(str(d) for d in storage_dtypes(f))
        raise TypeError(f"{name} in format {f.name} must be stored as {allowed}; got {t.dtype}")
    return f


def cast_saturate(y: torch.Tensor, fmt) -> torch.Tensor:
    """Round-to-nearest-even cast to an FP8 torch dtype, saturating +-inf and overflow (NaN stays NaN)."""
    fmt = element_format(fmt)
    if fmt not in FP8_FORMATS or fmt.torch_dtype is None:
        raise ValueError(f"cast_saturate handles the FP8 formats; got {fmt.name}")
    return y.float().clamp(-fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype)  # clamp keeps NaN


def quantize_operand(x: torch.Tensor, fmt, *, as_float4_x2: bool = False) -> torch.Tensor:
    """GEMM operand storage for ``x`` (..., K) in ``fmt`` (RNE, saturating): FP8 in its torch dtype, FP6
    packed (..., 3K/4) uint8, E2M1 packed (..., K/2) uint8, or ``float4_e2m1fn_x2`` with ``as_float4_x2``."""
    fmt = _codec_format(fmt)
    if as_float4_x2 and fmt is not E2M1:
        raise ValueError(f"as_float4_x2 applies to e2m1 only, not {fmt.name}")
    if fmt in FP8_FORMATS:
        return cast_saturate(x, fmt)
    p = pack(encode(x, fmt), fmt)
    if as_float4_x2:
        if _FP4X2 is None:
            raise TypeError("this torch build has no float4_e2m1fn_x2 dtype")
        p = p.view(_FP4X2)
    return p


def decode_operand(t: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 (..., K) values of GEMM operand storage in ``fmt`` (its torch dtype or uint8 bytes)."""
    fmt = _codec_format(fmt)
    if t.dtype not in storage_dtypes(fmt):
        allowed = ", ".join(str(d) for d in storage_dtypes(fmt))
        raise TypeError(f"{fmt.name} operand must be stored as {allowed}; got {t.dtype}")
    return decode(unpack(t, fmt), fmt)

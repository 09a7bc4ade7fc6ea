"""Microscaling (MX) and NVFP4 block-scaled formats: torch reference quantizers, element codecs and the
scale-factor layout Blackwell's ``tcgen05.mma ... .block_scale`` reads.

Everything here runs on any device (CPU included) and *defines* the numerics the CuTe DSL quantizer
kernels (``cutedsl_gemm.kernels.sm100.quantize_mx``) reproduce bit for bit.

Quantizer contract
==================
Operands are 2-D ``(rows, K)``; scales run along K, one per ``block`` consecutive elements
(MX: 32 with a UE8M0 scale, NVFP4: 16 with an E4M3 scale and an fp32 per-tensor scale). ``K`` must be a
multiple of the block (:func:`check_k`). A scale is a *dequantization* factor: ``x ~= q * scale``.

MX (OCP Microscaling Formats spec v1.0, section 6.3), with ``emax`` the exponent of the element
format's largest normal (E4M3 8, E5M2 15, E3M2 4, E2M3 2, E2M1 2):

* ``amax`` = largest *finite* ``|x|`` of the block, in fp32 (inputs are bf16/fp16/fp32, exact in fp32);
* ``scale = 2**(floor(log2(amax)) - emax)``, the spec's rounding: the block max lands in the element's
  top binade, and values above the element max saturate. ``floor(log2)`` is the fp32 exponent field,
  so the UE8M0 code is ``clamp(biased_exp(amax) - emax, 0, 254)`` (fp32 subnormal ``amax`` gives 0);
  an all-zero block gets scale 1.0 (code 127), a block holding a NaN gets the NaN code 255 (the spec's
  "X = NaN") and all-zero elements; +-inf elements do not take part in the scale and saturate.
  This is the spec's floor rounding, not the ``ceil`` ("RCEIL") variant some libraries offer: floor
  keeps one more binade of resolution at the cost of saturating the top of the block.
* ``q = encode(x * 2**-scale_exp)``: the multiplication by a power of two is exact in fp32.

NVFP4 (NVIDIA's recipe, as in Transformer Engine):

* per-tensor fp32 global scale ``g = amax_tensor / (6 * 448)`` (finite values; 1.0 for an all-zero
  tensor) unless the caller passes one; ``g`` is a *decode* factor and stays on the device;
* block scale ``s = e4m3_rne_satfinite((amax_block / 6) / g)`` (two IEEE fp32 divisions);
* ``inv = 1 / (float(s) * g)`` (IEEE fp32; 0 where ``s == 0``; clamped to the largest fp32),
  ``q = e2m1(x * inv)``; a block holding a NaN gets the E4M3 NaN scale (0x7F) and zero elements.

Element encoding (:func:`encode_minifloat`, every format): round to nearest, ties to even, in one step
from the fp32 value; magnitudes past the format's largest finite value (inf included) saturate to it;
the sign of the input is kept, zeros and values rounding to zero included (``-0`` encodes as the sign
bit alone). It is written with integer operations only, exactly as the kernel does it; the tests check
it against torch's own FP8 casts and against an independent float-based rounding for FP6/FP4.

Packing
=======
FP8 is one byte per element (torch ``float8_e4m3fn``/``float8_e5m2``). FP4 is two per byte, element
``2i`` in the low nibble (torch ``float4_e2m1fn_x2``, shape ``(rows, K/2)``). FP6 is a little-endian
bit stream, element ``i`` in bits ``[6i, 6i+6)``: 4 elements in 3 bytes, shape ``(rows, 3K/4)`` uint8.

Scale-factor layout (``SWIZZLE_32_4_4``)
========================================
cuBLAS, torch (``F.scaled_mm`` with ``SwizzleType.SWIZZLE_32_4_4``) and the tcgen05 MMA read scales in
atoms of 128 rows x 4 scale columns (512 bytes). Plain ``(rows, kb)`` scales are padded to
``(round_up(rows, 128), round_up(kb, 4))`` with zero bytes; atoms are stored row-atom-major
(``atom = (r // 128) * (cols_padded // 4) + c // 4``) and inside an atom entry ``(r, c)`` sits at byte
``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4`` (the 32x4x4 interleave). :func:`to_blocked` /
:func:`from_blocked` convert; blocked tensors are returned 2-D with the padded shape, their memory in
blocked order (torch only checks the element count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from cutedsl_gemm.numerics import fp_packing
from cutedsl_gemm.numerics.formats import E2M1, E4M3, E5M2, E2M3, E3M2, UE8M0, ElementFormat, element_format

MX_BLOCK = 32
NVFP4_BLOCK = 16
SF_ATOM_ROWS = 128
SF_ATOM_COLS = 4
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS

MX_ELEMENT_FORMATS = (E4M3, E5M2, E3M2, E2M3, E2M1)
NVFP4_GLOBAL_DENOM = 6.0 * 448.0  # E2M1 max * E4M3 max
UE8M0_NAN = 255
E4M3_NAN = 0x7F
_FP32_MAX_BITS = 0x7F7FFFFF


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def emax(fmt: ElementFormat) -> int:
    """Exponent of the format's largest normal value (OCP MX ``emax_elem``)."""
    return int(math.floor(math.log2(fmt.max_finite)))


# ----------------------------------------------------------------------------------------------------
# Scale-factor blocked layout
# ----------------------------------------------------------------------------------------------------


def blocked_scale_shape(rows: int, k_blocks: int) -> Tuple[int, int]:
    """Padded (rows, scale columns) of the SWIZZLE_32_4_4 layout for ``rows x k_blocks`` scales."""
    return _round_up(rows, SF_ATOM_ROWS), _round_up(k_blocks, SF_ATOM_COLS)


def blocked_offset(r, c, k_blocks: int):
    """Byte offset of plain scale ``(r, c)`` inside the blocked layout (ints or integer tensors)."""
    col_atoms = _ceil_div(k_blocks, SF_ATOM_COLS)
    atom = (r // SF_ATOM_ROWS) * col_atoms + c // SF_ATOM_COLS
    return atom * SF_ATOM_BYTES + (r % 32) * 16 + ((r % SF_ATOM_ROWS) // 32) * 4 + c % SF_ATOM_COLS


def blocked_scale_words(blocked: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """The blocked scales as the GEMM's scale TMA reads them: int32 words of shape
    ``(row atoms, col atoms * 128)``, row ``ra`` holding the 512-byte atoms of rows ``128 ra ..`` one
    after another (word ``ca * 128 + w`` is bytes ``4w .. 4w + 3`` of atom ``(ra, ca)``). A view, no copy.
    """
    pr, pc = blocked_scale_shape(rows, k_blocks)
    if blocked.element_size() != 1 or blocked.numel() != pr * pc:
        raise ValueError(f"expected {pr * pc} one-byte blocked scales for {rows} x {k_blocks}; got {blocked.numel()} x {blocked.dtype}")
    flat = _as_bytes(blocked).reshape(-1)
    if flat.storage_offset() % 4:
        raise ValueError("blocked scales must start on a 4-byte boundary to be read as words")
    return flat.view(torch.int32).view(pr // SF_ATOM_ROWS, (pc // SF_ATOM_COLS) * (SF_ATOM_BYTES // 4))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Plain ``(rows, kb)`` scales -> SWIZZLE_32_4_4 blocked tensor of shape ``blocked_scale_shape``.

    Any one-byte dtype (uint8, ``float8_e8m0fnu``, ``float8_e4m3fn``) is kept; padding is zero bytes.
    """
    if scales.dim() != 2:
        raise ValueError(f"to_blocked expects 2-D (rows, K/block) scales, got shape {tuple(scales.shape)}")
    if scales.element_size() != 1:
        raise TypeError(f"scale factors are one-byte types (UE8M0/E4M3/uint8); got {scales.dtype}")
    rows, kb = scales.shape
    pr, pc = blocked_scale_shape(rows, kb)
    b = torch.zeros(pr, pc, dtype=torch.uint8, device=scales.device)
    b[:rows, :kb] = _as_bytes(scales)
    # (row_atom, 4 sub-rows of 32, 32, col_atom, 4) -> (row_atom, col_atom, 32, 4 sub-rows, 4 cols)
    b = b.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4).contiguous().view(pr, pc)
    return b if scales.dtype == torch.uint8 else b.view(scales.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: blocked scales (any shape, padded element count) -> ``(rows, kb)``."""
    pr, pc = blocked_scale_shape(rows, k_blocks)
    if blocked.element_size() != 1:
        raise TypeError(f"scale factors are one-byte types (UE8M0/E4M3/uint8); got {blocked.dtype}")
    if blocked.numel() != pr * pc:
        raise ValueError(
            f"blocked scales for {rows}x{k_blocks} need {pr}*{pc}={pr * pc} elements "
            f"(rows padded to 128, scale columns to 4); got {blocked.numel()}"
        )
    b = _as_bytes(blocked.contiguous()).reshape(pr // 128, pc // 4, 32, 4, 4)
    b = b.permute(0, 3, 2, 1, 4).reshape(pr, pc)[:rows, :k_blocks].contiguous()
    return b if blocked.dtype == torch.uint8 else b.view(blocked.dtype)


# ----------------------------------------------------------------------------------------------------
# Element codecs (integer algorithm shared with the kernel)
# ----------------------------------------------------------------------------------------------------


def _rne_shr(v: torch.Tensor, sh: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even right shift of non-negative int64 ``v`` by ``sh`` in [1, 62]."""
    half_m1 = (torch.ones_like(v) << (sh - 1)) - 1
    return (v + half_m1 + ((v >> sh) & 1)) >> sh


def encode_minifloat(y: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 -> element code (uint8, low ``fmt.bits`` bits): RNE, saturating, sign kept. NaN -> 0."""
    fmt = element_format(fmt)
    if fmt not in MX_ELEMENT_FORMATS:
        raise ValueError(f"encode_minifloat handles {[f.name for f in MX_ELEMENT_FORMATS]}; got {fmt.name}")
    bits = y.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = bits >> 31
    a = bits & 0x7FFFFFFF
    m, b = fmt.man_bits, fmt.bias
    max_bits = int(torch.tensor(fmt.max_finite, dtype=torch.float32).view(torch.int32))
    max_code = _max_code(fmt)
    exp_field = a >> 23
    # normal in the target: round the fp32 pattern at the target mantissa width; a carry walks into
    # the exponent field, which is exactly the next binade
    normal = _rne_shr(a, torch.full_like(a, 23 - m)) - ((127 - b) << m)
    # subnormal in the target: |y| = mant * 2**(e - 23), quantum 2**(1 - b - m)
    mant = (a & 0x7FFFFF) | torch.where(exp_field > 0, 0x800000, 0)
    e = torch.clamp(exp_field, min=1) - 127
    sh = torch.clamp(23 + (1 - b - m) - e, max=31)
    sub = _rne_shr(mant, sh)
    code = torch.where(e >= 1 - b, normal, sub)
    code = torch.where(a >= max_bits, torch.full_like(code, max_code), code)  # saturate (inf included)
    code = code | (sign << (fmt.bits - 1))
    code = torch.where(a > 0x7F800000, torch.zeros_like(code), code)  # NaN
    return code.to(torch.uint8)


def _max_code(fmt: ElementFormat) -> int:
    mag_bits = fmt.bits - 1
    if fmt.has_nan and not fmt.has_inf:  # e4m3fn: all-ones is NaN
        return (1 << mag_bits) - 2
    if fmt.has_inf:  # e5m2: exponent all ones is inf/NaN
        return ((1 << fmt.exp_bits) - 2) << fmt.man_bits | ((1 << fmt.man_bits) - 1)
    return (1 << mag_bits) - 1


def minifloat_values(fmt) -> torch.Tensor:
    """fp32 value of every code ``0 .. 2**bits - 1`` (NaN/inf codes included for FP8)."""
    fmt = element_format(fmt)
    codes = torch.arange(1 << fmt.bits, dtype=torch.int64)
    return decode_minifloat(codes.to(torch.uint8), fmt)


def decode_minifloat(codes: torch.Tensor, fmt) -> torch.Tensor:
    """Element codes (uint8, low ``fmt.bits`` bits) -> fp32."""
    fmt = element_format(fmt)
    if fmt.bits == 8 and fmt.torch_dtype is not None:
        return codes.contiguous().view(fmt.torch_dtype).float()
    c = codes.to(torch.int64) & ((1 << fmt.bits) - 1)
    sign = (c >> (fmt.bits - 1)) & 1
    ex = (c >> fmt.man_bits) & ((1 << fmt.exp_bits) - 1)
    man = c & ((1 << fmt.man_bits) - 1)
    frac = man.double() / (1 << fmt.man_bits)
    mag = torch.where(
        ex > 0,
        torch.exp2((ex - fmt.bias).double()) * (1 + frac),
        2.0 ** (1 - fmt.bias) * frac,
    )
    return torch.where(sign > 0, -mag, mag).float()


# ----------------------------------------------------------------------------------------------------
# Packing: the conventions of cutedsl_gemm.numerics.fp_packing (torch / TMA layouts), shared with the f8f6f4 GEMM
# ----------------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, fmt) -> torch.Tensor:
    """(rows, K) element codes -> packed bytes: FP8 (rows, K), FP6 (rows, 3K/4), FP4 (rows, K/2)."""
    fmt = element_format(fmt)
    c = codes.to(torch.uint8)
    if fmt.bits == 8:
        return c.contiguous()
    if fmt.bits == 4:
        return fp_packing.pack_e2m1(c)
    if fmt.bits == 6:
        return fp_packing.pack_fp6(c)
    raise ValueError(f"no packing for {fmt.bits}-bit elements")


def unpack_codes(packed: torch.Tensor, fmt, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: packed bytes -> (rows, K) uint8 element codes."""
    fmt = element_format(fmt)
    p = _as_bytes(packed.contiguous())
    rows = p.shape[0]
    if fmt.bits == 8:
        return p.reshape(rows, k).clone()
    codes = fp_packing.unpack_e2m1(p) if fmt.bits == 4 else fp_packing.unpack_fp6(p)
    return codes.reshape(rows, k)


def packed_cols(fmt, k: int) -> int:
    return k * element_format(fmt).bits // 8


def storage_view(packed: torch.Tensor, fmt) -> torch.Tensor:
    """Packed bytes in the torch dtype users expect (float8_*, float4_e2m1fn_x2; FP6 stays uint8)."""
    fmt = element_format(fmt)
    if fmt.torch_dtype is not None and fmt.bits in (8, 4):
        return packed.view(fmt.torch_dtype)
    return packed


# ----------------------------------------------------------------------------------------------------
# Quantized tensors and the reference quantizers
# ----------------------------------------------------------------------------------------------------


@dataclass
class BlockScaledTensor:
    """A quantized (rows, K) operand.

    ``data``: packed elements (see module doc); ``scales``: SWIZZLE_32_4_4 blocked, shape
    ``blocked_scale_shape(rows, K // block)``, dtype ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn``
    (NVFP4); ``global_scale``: fp32 0-d device tensor (NVFP4 only, a decode factor).
    """

    data: torch.Tensor
    scales: torch.Tensor
    fmt: ElementFormat
    block: int
    shape: Tuple[int, int]
    global_scale: Optional[torch.Tensor] = None

    @property
    def recipe(self) -> str:
        return "nvfp4" if self.global_scale is not None or self.scales.dtype == E4M3.torch_dtype else "mx"

    def plain_scales(self) -> torch.Tensor:
        rows, k = self.shape
        return from_blocked(self.scales, rows, k // self.block)

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.data, self.fmt, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float64 (rows, K) values (NaN scales give NaN blocks)."""
        rows, k = self.shape
        vals = decode_minifloat(self.codes(), self.fmt).double()
        s = scale_values(self.plain_scales()).double()
        out = vals.view(rows, k // self.block, self.block) * s.unsqueeze(-1)
        out = out.view(rows, k)
        if self.global_scale is not None:
            out = out * self.global_scale.double().cpu().to(out.device)
        return out


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """One-byte scale tensor (``float8_e8m0fnu`` or ``float8_e4m3fn``) -> fp32 values."""
    if scales.dtype == UE8M0.torch_dtype:
        code = scales.view(torch.uint8).to(torch.int32)
        v = torch.exp2((code - 127).float())
        return torch.where(code == UE8M0_NAN, torch.full_like(v, float("nan")), v)
    if scales.dtype == E4M3.torch_dtype:
        return scales.float()
    raise TypeError(f"scale dtype must be float8_e8m0fnu (MX) or float8_e4m3fn (NVFP4); got {scales.dtype}")


def check_k(k: int, block: int, what: str = "K") -> None:
    if k % block:
        raise ValueError(f"{what}={k} must be a multiple of the scale block {block}")


def _check_input(x: torch.Tensor, block: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"quantizers take bfloat16/float16/float32 input; got {x.dtype}")
    check_k(x.shape[1], block)


def _blocks(x: torch.Tensor, block: int):
    rows, k = x.shape
    xf = x.float().reshape(rows, k // block, block)
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), torch.zeros((), device=x.device)).amax(-1)
    has_nan = torch.isnan(xf).any(-1)
    return xf, amax, has_nan


def mx_scale_codes(amax: torch.Tensor, fmt) -> torch.Tensor:
    """UE8M0 codes (int64) from fp32 block amax per the OCP floor rule (see module doc)."""
    fmt = element_format(fmt)
    biased = (amax.float().contiguous().view(torch.int32).to(torch.int64) >> 23) & 0xFF
    code = torch.clamp(biased - emax(fmt), 0, 254)
    return torch.where(amax > 0, code, torch.full_like(code, 127))


def quantize_mx_reference(x: torch.Tensor, fmt="e4m3") -> BlockScaledTensor:
    """OCP MX quantization of (rows, K) ``x`` with 32-element blocks (torch reference)."""
    fmt = element_format(fmt)
    if fmt not in MX_ELEMENT_FORMATS:
        raise ValueError(f"MX element format must be one of {[f.name for f in MX_ELEMENT_FORMATS]}; got {fmt.name}")
    _check_input(x, MX_BLOCK)
    rows, k = x.shape
    xf, amax, has_nan = _blocks(x, MX_BLOCK)
    code = mx_scale_codes(amax, fmt)
    # 2**(127 - code) as an fp32 bit pattern: exponent field 254 - code (code <= 252, never subnormal)
    inv = ((254 - code).to(torch.int32) << 23).view(torch.float32)
    y = xf * inv.unsqueeze(-1)
    y = torch.where(has_nan.unsqueeze(-1), torch.zeros_like(y), y)
    q = encode_minifloat(y.reshape(rows, k), fmt)
    code = torch.where(has_nan, torch.full_like(code, UE8M0_NAN), code)
    scales = to_blocked(code.to(torch.uint8)).view(UE8M0.torch_dtype)
    return BlockScaledTensor(storage_view(pack_codes(q, fmt), fmt), scales, fmt, MX_BLOCK, (rows, k))


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-d decode scale ``amax_finite(x) / (6 * 448)`` (1.0 for an all-zero tensor), on x's device."""
    xf = x.float()
    amax = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), device=x.device)).amax()
    g = amax / torch.tensor(NVFP4_GLOBAL_DENOM, dtype=torch.float32, device=x.device)
    return torch.where(g > 0, g, torch.ones_like(g))


def quantize_nvfp4_reference(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None) -> BlockScaledTensor:
    """NVFP4 quantization (E2M1 elements, E4M3 scale per 16, fp32 global decode scale), torch reference."""
    _check_input(x, NVFP4_BLOCK)
    rows, k = x.shape
    g = nvfp4_global_scale(x) if global_scale is None else _check_global_scale(global_scale, x.device)
    xf, amax, has_nan = _blocks(x, NVFP4_BLOCK)
    six = torch.tensor(6.0, dtype=torch.float32, device=x.device)
    sf = (amax / six) / g
    sf = torch.clamp(sf, max=E4M3.max_finite)  # satfinite; sf >= 0 and not NaN for finite g > 0
    s_codes = sf.to(E4M3.torch_dtype).view(torch.uint8)
    s_val = s_codes.view(E4M3.torch_dtype).float()
    denom = s_val * g
    inv = torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
    inv = torch.clamp(inv, max=torch.tensor(_FP32_MAX_BITS, dtype=torch.int32).view(torch.float32).item())
    y = xf * inv.unsqueeze(-1)
    y = torch.where(has_nan.unsqueeze(-1), torch.zeros_like(y), y)
    q = encode_minifloat(y.reshape(rows, k), E2M1)
    s_codes = torch.where(has_nan, torch.full_like(s_codes, E4M3_NAN), s_codes)
    scales = to_blocked(s_codes).view(E4M3.torch_dtype)
    return BlockScaledTensor(storage_view(pack_codes(q, E2M1), E2M1), scales, E2M1, NVFP4_BLOCK, (rows, k), g)


def _check_global_scale(g: torch.Tensor, device) -> torch.Tensor:
    if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or g.numel() != 1:
        raise TypeError("global_scale must be a one-element float32 tensor (the per-tensor decode scale)")
    return g.reshape(()).to(device)

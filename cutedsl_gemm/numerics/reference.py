"""Pure-torch reference numerics: every quantizer the kernels reproduce and the float64 GEMMs they are
checked against. Runs anywhere (CPU or GPU).

FP8 recipes (tensor, row, 1x128, 128x128 / BxB): :func:`quantize`, :func:`reference_gemm`
===========================================================================================
The contract the CuTe DSL FP8 quantizers (``kernels/sm90/quantize_fp8.py``) match bit for bit:

* a scale is the *dequantization* factor (``x ~= q * scale``), stored as fp32, one per scale group;
* ``amax`` is the largest finite ``|x|`` of the group (NaN and +-inf are ignored for the scale);
* ``scale = amax / fmt.max_finite`` (fp32, IEEE division); an all-zero (or non-finite-only) group gets 1;
* ``q = cast_rne(clamp(x / scale, -max, +max))`` in fp32: finite values and +-inf saturate to the
  largest finite value, NaN stays NaN.

INT8 (W8A8, tensor and row scales): :func:`quantize_int8_reference`, :func:`reference_int8_mm`
==============================================================================================
The same contract with ``fmt.max_finite`` = 127 (symmetric: -128 is never produced): ``scale = amax / 127``
(fp32 IEEE division; 1 for an all-zero or non-finite-only group), ``y = x / scale`` (fp32 IEEE division, the
quotient the FP8 quantizers round), ``q = RNE(clamp(y, -127, 127))`` (ties to even); +-inf gives +-127 and NaN
gives 0 (an integer has no NaN). The int8 GEMM is exact in int32, so its reference is the float64 product of
the integers times the scales.

MX and NVFP4: :func:`quantize_mx_reference`, :func:`quantize_nvfp4_reference`, :func:`reference_blockscaled_mm`
=============================================================================================================
The contract of the block-scale quantizer kernels (``kernels/sm100/quantize_mx.py``). Operands are 2-D
``(rows, K)``; scales run along K, one per ``block`` consecutive elements (MX: 32 with a UE8M0 scale,
NVFP4: 16 with an E4M3 scale and an fp32 per-tensor scale); ``K`` must be a multiple of the block.

MX (OCP Microscaling Formats spec v1.0, section 6.3), with ``emax`` the exponent of the element format's
largest normal (``ElementFormat.emax``: E4M3 8, E5M2 15, E3M2 4, E2M3 2, E2M1 2):

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

Elements are encoded by :func:`cutedsl_gemm.numerics.codecs.encode` (NaN -> +0) and packed by
:func:`~cutedsl_gemm.numerics.codecs.pack`; scales are stored in the SWIZZLE_32_4_4 blocked layout
(:mod:`cutedsl_gemm.numerics.scale_layouts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cutedsl_gemm.numerics.codecs import (
    as_bytes,
    cast_saturate,
    decode,
    decode_operand,
    encode,
    logical_k,
    operand_format,
    pack,
    storage_view,
    unpack,
)
from cutedsl_gemm.numerics.formats import (
    E2M1,
    E4M3,
    F8F6F4_FORMATS,
    FLOAT_FORMATS,
    FP32,
    INT8,
    UE8M0,
    ElementFormat,
    MX_1x32,
    NVFP4_1x16,
    ScaleGranularity,
    ScalingRecipe,
    ceil_div,
    element_format,
)
from cutedsl_gemm.numerics.formats import recipe as as_recipe
from cutedsl_gemm.numerics.scale_layouts import blocked_scale_shape, from_blocked, to_blocked

# ----------------------------------------------------------------------------------------------------
# FP8 recipes
# ----------------------------------------------------------------------------------------------------


def _extent(gran) -> tuple:
    """(rows, cols) of a ScaleGranularity, or a (rows, cols) block such as (256, 256)."""
    return gran.value if isinstance(gran, ScaleGranularity) else tuple(gran)


def _group_view(x: torch.Tensor, gran):
    """Pad x (rows, K) to whole groups and view it as (R, gr, C, gc) so groups reduce over dims 1 and 3."""
    rows, k = x.shape
    gr, gc = _extent(gran)
    gr = max(rows if gr is None else gr, 1)
    gc = max(k if gc is None else gc, 1)
    R, C = ceil_div(rows, gr), ceil_div(k, gc)
    pad = torch.zeros(R * gr, C * gc, dtype=x.dtype, device=x.device)
    pad[:rows, :k] = x
    return pad.view(R, gr, C, gc), (R, C, gr, gc)


def group_amax(x: torch.Tensor, gran) -> torch.Tensor:
    """Largest finite |x| per scale group, fp32, shape (R, C) (R = C = 1 for per-tensor)."""
    xf = x.float()
    xf = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), dtype=torch.float32, device=x.device))
    v, _ = _group_view(xf, gran)
    return v.amax(dim=(1, 3))


def scales_from_amax(amax: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    one = torch.ones((), dtype=torch.float32, device=amax.device)
    fmax = torch.tensor(fmt.max_finite, dtype=torch.float32, device=amax.device)
    return torch.where(amax > 0, amax / fmax, one)


def expand_scales(scales: torch.Tensor, gran, rows: int, k: int) -> torch.Tensor:
    """Broadcast (R, C) group scales to the (rows, K) element grid."""
    gr, gc = _extent(gran)
    gr = max(rows if gr is None else gr, 1)
    gc = max(k if gc is None else gc, 1)
    s = scales.reshape(ceil_div(rows, gr), ceil_div(k, gc))
    s = s.repeat_interleave(gr, dim=0).repeat_interleave(gc, dim=1)
    return s[:rows, :k]


def quantize(x: torch.Tensor, gran, fmt="e4m3"):
    """Quantize a 2-D tensor (rows, K) with one scale per group of ``gran`` (a ScaleGranularity or a
    (rows, cols) block such as (256, 256)).

    Returns ``(q, scales)``: q has x's shape in fmt's torch dtype, scales are fp32 with shape (R, C)
    in plain row-major group order ((1, 1) for per-tensor, (rows, 1) for per-row).
    """
    fmt = element_format(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    rows, k = x.shape
    scales = scales_from_amax(group_amax(x, gran), fmt)
    full = expand_scales(scales, gran, rows, k)
    y = x.float() / full
    q = round_to_int(y, fmt) if fmt.integer else cast_saturate(y, fmt)
    return q, scales


def silu_mul(h: torch.Tensor, weights: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The gated activation of a gate/up projection's output ``h`` (..., 2I), gate first: ``SiLU(gate) * w * up``
    with each row's weight ``w`` (``weights`` (...,), if given), every product in fp32, rounded once to ``dtype``
    (default: h's). What ``ops.gated.silu_mul_quantize_fp8`` quantizes and the MoE experts compute."""
    i = h.shape[-1] // 2
    out = torch.empty(h.shape[:-1] + (i,), dtype=dtype or h.dtype, device=h.device)
    silu = torch.nn.functional.silu(h[..., :i].float())
    if weights is not None:
        silu.mul_(weights.float().unsqueeze(-1))
    # (up is promoted exactly inside the product and rounded once as it is stored)
    return torch.mul(silu, h[..., i:], out=out)


def round_to_int(y: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 quotients -> an integer format's codes: RNE of the value clamped to +-max (+-inf saturate), NaN -> 0."""
    fmt = element_format(fmt)
    if not fmt.integer or fmt.torch_dtype is None:
        raise ValueError(f"round_to_int handles the integer formats with a torch dtype (int8); got {fmt.name}")
    q = torch.round(y.float().clamp(-fmt.max_finite, fmt.max_finite))  # torch.round: half to even; clamp keeps NaN
    return torch.nan_to_num(q, nan=0.0).to(fmt.torch_dtype)


def quantize_int8_reference(x: torch.Tensor, granularity="row"):
    """INT8 quantization of a 2-D (rows, K) tensor with one scale per row ("row") or per tensor ("tensor"):
    ``(q, scales)``, scales fp32 in plain (R, C) group order like :func:`quantize`'s."""
    gran = ScaleGranularity.named(granularity)
    if gran not in (ScaleGranularity.ROW, ScaleGranularity.TENSOR):
        raise ValueError(f"int8 quantization is per row or per tensor; got {gran.label}")
    return quantize(x, gran, INT8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, gran) -> torch.Tensor:
    """float64 dequantization of (rows, K) data with (R, C) group scales."""
    rows, k = q.shape
    return q.double() * expand_scales(scales.double(), gran, rows, k)


def quantize_operands(a: torch.Tensor, w: torch.Tensor, rec, fmt_a="e4m3", fmt_b="e4m3"):
    """Quantize A (M, K) and W (N, K) for a recipe. Returns (qa, sa, qw, sw) in plain layouts."""
    rec = as_recipe(rec)
    qa, sa = quantize(a, rec.a, fmt_a)
    qw, sw = quantize(w, rec.b, fmt_b)
    return qa, sa, qw, sw


def reference_gemm(
    qa: torch.Tensor,
    sa: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    rec,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``dequant(A) @ dequant(W).T (+ bias)`` for plain-layout scales; returns (M, N) float64."""
    rec = as_recipe(rec)
    a = dequantize(qa, sa, rec.a)
    w = dequantize(qw, sw, rec.b)
    out = a @ w.t()
    if bias is not None:
        out = out + bias.double()
    return out


def reference_int8_mm(a, b, scale_a, scale_b, bias=None) -> torch.Tensor:
    """float64 ``(a @ b) * scale_a * scale_b (+ bias)`` in ``scaled_mm``'s conventions: ``a`` (M, K) and ``b``
    (K, N) int8, scales one element each or ``scale_a`` (M, 1) and ``scale_b`` (1, N). The integer product is
    exact in float64 (its sums stay below 2**53); returns (M, N) float64."""
    for name, t in (("a", a), ("b", b)):
        if t.dtype != INT8.torch_dtype or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D torch.int8 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    sa, sb = scale_a.double(), scale_b.double()
    sa = sa.reshape(()) if sa.numel() == 1 else sa.reshape(-1, 1)
    sb = sb.reshape(()) if sb.numel() == 1 else sb.reshape(1, -1)
    out = (a.double() @ b.double()) * sa * sb
    if bias is not None:
        out = out + bias.double()
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    r = ref.double().to(o.device)
    den = torch.linalg.norm(r)
    return float(torch.linalg.norm(o - r) / (den if den > 0 else 1.0))


def reference_f8f6f4(a, b, *, fmt_a=None, fmt_b=None, scale_a, scale_b, bias=None) -> torch.Tensor:
    """float64 ``scale_a * scale_b * decode(a) @ decode(b) (+ bias)`` for per-tensor scaled operands in any
    f8f6f4 format: ``a`` (M, K) and ``b`` (K, N) (``w.t()`` of a row-major (N, K) ``w``) in the storage of
    :func:`~cutedsl_gemm.numerics.codecs.quantize_operand`; ``fmt_*`` is needed for packed FP6 (uint8)."""
    fa = operand_format("a", a, fmt_a)
    fb = operand_format("b", b, fmt_b)
    av = decode_operand(a, fa).double()  # (M, K)
    bv = decode_operand(b.t(), fb).double().t()  # decode along K, then back to (K, N)
    if av.shape[1] != bv.shape[0]:
        raise ValueError(f"K mismatch: a has K={av.shape[1]}, b has K={bv.shape[0]}")
    out = (av @ bv) * (float(scale_a.reshape(-1)[0]) * float(scale_b.reshape(-1)[0]))
    if bias is not None:
        out = out + bias.double()
    return out


# ----------------------------------------------------------------------------------------------------
# MX and NVFP4
# ----------------------------------------------------------------------------------------------------

MX_BLOCK = MX_1x32.k_block
NVFP4_BLOCK = NVFP4_1x16.k_block
MX_ELEMENT_FORMATS = F8F6F4_FORMATS
NVFP4_GLOBAL_DENOM = E2M1.max_finite * E4M3.max_finite  # 6 * 448
UE8M0_NAN = 0xFF  # the all-ones UE8M0 code
E4M3_NAN = 0x7F  # E4M3 "fn": exponent and mantissa all ones
#: the block-scaled recipes by the torch dtype of their scales
BLOCK_SCALE_RECIPES = {element_format(r.scale_format).torch_dtype: r for r in (MX_1x32, NVFP4_1x16)}


@dataclass
class BlockScaledTensor:
    """A quantized (rows, K) operand.

    ``data``: packed elements (``codecs.pack`` storage in ``codecs.storage_view``'s dtype); ``scales``:
    SWIZZLE_32_4_4 blocked, shape ``blocked_scale_shape(rows, K // block)``, dtype ``float8_e8m0fnu`` (MX)
    or ``float8_e4m3fn`` (NVFP4); ``global_scale``: fp32 0-d device tensor (NVFP4 only, a decode factor).
    """

    data: torch.Tensor
    scales: torch.Tensor
    fmt: ElementFormat
    block: int
    shape: tuple[int, int]
    global_scale: torch.Tensor | None = None

    @property
    def recipe(self) -> str:
        return "nvfp4" if self.global_scale is not None or self.scales.dtype == E4M3.torch_dtype else "mx"

    def plain_scales(self) -> torch.Tensor:
        rows, k = self.shape
        return from_blocked(self.scales, rows, k // self.block)

    def codes(self) -> torch.Tensor:
        return unpack(self.data, self.fmt)

    def dequantize(self) -> torch.Tensor:
        """float64 (rows, K) values (NaN scales give NaN blocks)."""
        rows, k = self.shape
        vals = decode(self.codes(), self.fmt).double()
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


def check_quantizer_input(x: torch.Tensor, block: int) -> None:
    """A 2-D (rows, K) bf16 / fp16 / fp32 tensor with K a multiple of ``block``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in tuple(f.torch_dtype for f in FLOAT_FORMATS):
        raise TypeError(f"quantizers take bfloat16/float16/float32 input; got {x.dtype}")
    check_k(x.shape[1], block)


def check_global_scale(g: torch.Tensor, device) -> torch.Tensor:
    """A one-element fp32 decode scale as a 0-d tensor on ``device``."""
    if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or g.numel() != 1:
        raise TypeError("global_scale must be a one-element float32 tensor (the per-tensor decode scale)")
    return g.reshape(()).to(device)


def _blocks(x: torch.Tensor, block: int):
    rows, k = x.shape
    xf = x.float().reshape(rows, k // block, block)
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), torch.zeros((), device=x.device)).amax(-1)
    has_nan = torch.isnan(xf).any(-1)
    return xf, amax, has_nan


def mx_scale_codes(amax: torch.Tensor, fmt) -> torch.Tensor:
    """UE8M0 codes (int64) from fp32 block amax per the OCP floor rule (see the module doc)."""
    fmt = element_format(fmt)
    biased = (amax.float().contiguous().view(torch.int32).to(torch.int64) >> 23) & 0xFF
    code = torch.clamp(biased - fmt.emax, 0, 254)
    return torch.where(amax > 0, code, torch.full_like(code, 127))


def quantize_mx_reference(x: torch.Tensor, fmt="e4m3") -> BlockScaledTensor:
    """OCP MX quantization of (rows, K) ``x`` with 32-element blocks (see the module doc)."""
    fmt = element_format(fmt)
    if fmt not in MX_ELEMENT_FORMATS:
        raise ValueError(f"MX element format must be one of {[f.name for f in MX_ELEMENT_FORMATS]}; got {fmt.name}")
    check_quantizer_input(x, MX_BLOCK)
    rows, k = x.shape
    xf, amax, has_nan = _blocks(x, MX_BLOCK)
    code = mx_scale_codes(amax, fmt)
    # 2**(127 - code) as an fp32 bit pattern: exponent field 254 - code (code <= 252, never subnormal)
    inv = ((254 - code).to(torch.int32) << 23).view(torch.float32)
    y = xf * inv.unsqueeze(-1)
    y = torch.where(has_nan.unsqueeze(-1), torch.zeros_like(y), y)
    q = encode(y.reshape(rows, k), fmt, nan="zero")
    code = torch.where(has_nan, torch.full_like(code, UE8M0_NAN), code)
    scales = to_blocked(code.to(torch.uint8)).view(UE8M0.torch_dtype)
    return BlockScaledTensor(storage_view(pack(q, fmt), fmt), scales, fmt, MX_BLOCK, (rows, k))


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-d decode scale ``amax_finite(x) / (6 * 448)`` (1.0 for an all-zero tensor), on x's device."""
    xf = x.float()
    amax = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), device=x.device)).amax()
    g = amax / torch.tensor(NVFP4_GLOBAL_DENOM, dtype=torch.float32, device=x.device)
    return torch.where(g > 0, g, torch.ones_like(g))


def quantize_nvfp4_reference(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> BlockScaledTensor:
    """NVFP4 quantization (E2M1 elements, E4M3 scale per 16, fp32 global decode scale; see the module doc)."""
    check_quantizer_input(x, NVFP4_BLOCK)
    rows, k = x.shape
    g = nvfp4_global_scale(x) if global_scale is None else check_global_scale(global_scale, x.device)
    xf, amax, has_nan = _blocks(x, NVFP4_BLOCK)
    six = torch.tensor(E2M1.max_finite, dtype=torch.float32, device=x.device)
    sf = (amax / six) / g
    sf = torch.clamp(sf, max=E4M3.max_finite)  # satfinite; sf >= 0 and not NaN for finite g > 0
    s_codes = sf.to(E4M3.torch_dtype).view(torch.uint8)
    s_val = s_codes.view(E4M3.torch_dtype).float()
    denom = s_val * g
    inv = torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
    inv = torch.clamp(inv, max=FP32.max_finite)
    y = xf * inv.unsqueeze(-1)
    y = torch.where(has_nan.unsqueeze(-1), torch.zeros_like(y), y)
    q = encode(y.reshape(rows, k), E2M1, nan="zero")
    s_codes = torch.where(has_nan, torch.full_like(s_codes, E4M3_NAN), s_codes)
    scales = to_blocked(s_codes).view(E4M3.torch_dtype)
    return BlockScaledTensor(storage_view(pack(q, E2M1), E2M1), scales, E2M1, NVFP4_BLOCK, (rows, k), g)


def block_scale_recipe(name: str, scales: torch.Tensor, block_size: int | None = None) -> ScalingRecipe:
    """The block-scaled recipe that scale tensor ``name`` belongs to, from its dtype (``float8_e8m0fnu``:
    MX, ``float8_e4m3fn``: NVFP4); ``block_size``, if given, must agree."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of block scales, got {type(scales).__name__}")
    rec = BLOCK_SCALE_RECIPES.get(scales.dtype)
    if rec is None:
        raise TypeError(
            f"{name} must be torch.float8_e8m0fnu (MX, one scale per {MX_BLOCK} elements) or torch.float8_e4m3fn "
            f"(NVFP4, one per {NVFP4_BLOCK}); got {scales.dtype}"
        )
    if block_size is not None and block_size != rec.k_block:
        raise ValueError(
            f"{name}: scale vector size {block_size} does not match its dtype {scales.dtype}, which implies "
            f"{rec.k_block} (float8_e8m0fnu <-> BlockWise1x32, float8_e4m3fn <-> BlockWise1x16)"
        )
    return rec


def _block_scaled_operand(name, t, fmt, scales, global_scale, rec, k_dim, swizzled) -> BlockScaledTensor:
    fmt = operand_format(name, t, fmt)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    data = as_bytes(t) if k_dim == 1 else as_bytes(t).t()  # (rows, row bytes)
    rows, k = data.shape[0], logical_k(data.shape[1], fmt)
    block = rec.k_block
    check_k(k, block)
    if not swizzled:
        if tuple(scales.shape) != (rows, k // block):
            raise ValueError(
                f"scale_{name}: plain (NO_SWIZZLE) scales must have shape ({rows}, {k // block}) = (rows, K/{block}); "
                f"got {tuple(scales.shape)}"
            )
        scales = to_blocked(scales)
    elif scales.numel() != math.prod(blocked_scale_shape(rows, k // block)):
        pr, pc = blocked_scale_shape(rows, k // block)
        raise ValueError(
            f"scale_{name}: SWIZZLE_32_4_4 scales for {rows} rows x K={k} with {block}-element blocks need {pr} x {pc} "
            f"= {pr * pc} elements (rows padded to 128, scale columns to 4); got {scales.numel()}"
        )
    g = None if global_scale is None else check_global_scale(global_scale, data.device)
    return BlockScaledTensor(data, scales, fmt, block, (rows, k), g)



def reference_blockscaled_mm(a, b, scale_a, scale_b, *, fmt_a=None, fmt_b=None, global_scale_a=None,
                             global_scale_b=None, bias=None, block_size=None, swizzled=True) -> torch.Tensor:
    """float64 ``gA * gB * dequant(a) @ dequant(b) (+ bias)`` for the MX and NVFP4 recipes, on any device.

    ``a`` (M, K) and ``b`` (K, N) (``w.t()`` of a row-major (N, K) ``w``) as the quantizers store them
    (FP8 dtypes, ``float4_e2m1fn_x2``, packed FP6 in uint8 with ``fmt_*``); the scales' dtype names the
    recipe (``float8_e8m0fnu``: MX, 32-element blocks; ``float8_e4m3fn``: NVFP4, 16), SWIZZLE_32_4_4
    blocked or, with ``swizzled=False``, plain (rows, K / block); NVFP4's per-tensor decode scales are
    one-element fp32 tensors.
    """
    rec = block_scale_recipe("scale_a", scale_a, block_size)
    if block_scale_recipe("scale_b", scale_b, block_size) is not rec:
        raise ValueError(
            f"scale_a ({scale_a.dtype}) and scale_b ({scale_b.dtype}) imply different recipes; both MX or both NVFP4"
        )
    if not rec.global_scale and (global_scale_a is not None or global_scale_b is not None):
        raise ValueError("per-tensor global scales belong to NVFP4 (float8_e4m3fn block scales); MX recipes have none")
    qa = _block_scaled_operand("a", a, fmt_a, scale_a, global_scale_a, rec, 1, swizzled)
    qb = _block_scaled_operand("b", b, fmt_b, scale_b, global_scale_b, rec, 0, swizzled)
    if rec is NVFP4_1x16 and (qa.fmt is not E2M1 or qb.fmt is not E2M1):
        raise ValueError(f"NVFP4 (16-element blocks) needs e2m1 x e2m1 operands; got {qa.fmt.name} x {qb.fmt.name}")
    if qa.shape[1] != qb.shape[1]:
        raise ValueError(f"K mismatch: a holds K={qa.shape[1]} values per row, b holds K={qb.shape[1]} per column")
    out = qa.dequantize() @ qb.dequantize().t()
    if bias is not None:
        out = out + bias.double().to(out.device)
    return out


def dequantize_weights(w_int: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                       group: int = 128) -> torch.Tensor:
    """float64 ``(q - z) * s`` of integer weights (N, K) with scales (N, K / group) (``group=0``: (N, 1), one per
    row) and integer zero points of the same shape or None (``numerics.int_packing``'s natural layouts)."""
    n, k = w_int.shape
    g = k if group == 0 else group
    s = scales.double().repeat_interleave(g, dim=1)
    q = w_int.double()
    if zeros is not None:
        q = q - zeros.double().repeat_interleave(g, dim=1)
    return q * s


def reference_weight_only_mm(x: torch.Tensor, w_int: torch.Tensor, scales: torch.Tensor,
                             zeros: torch.Tensor | None = None, group: int = 128) -> torch.Tensor:
    """float64 ``x @ dequantize_weights(...).T``: the weight-only GEMM's reference, (M, N) float64. Pass the scales
    (and zero points) as the kernel reads them (``int_packing.unpack_weights`` returns them rounded to its dtype)."""
    return x.double() @ dequantize_weights(w_int, scales, zeros, group).to(x.device).t()


# ----------------------------------------------------------------------------------------------------
# Grouped (mixture-of-experts) FP8 GEMM
# ----------------------------------------------------------------------------------------------------

#: The grouped GEMM's recipes by name -> the scaling recipe (activations x weights) they apply.
GROUPED_RECIPES = {"tensor": "tensor", "row": "row", "deepseek": "1x128_128x128"}


def _grouped_recipe(recipe) -> ScalingRecipe:
    name = GROUPED_RECIPES.get(recipe, recipe) if isinstance(recipe, str) else recipe
    rec = as_recipe(name)
    if rec.name not in GROUPED_RECIPES.values():
        raise ValueError(f"the grouped GEMM's recipes are {', '.join(map(repr, GROUPED_RECIPES))}; got {recipe!r}")
    return rec


def _check_scale(name: str, s: torch.Tensor, shape: tuple) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != tuple(shape):
        got = f"{s.dtype} of shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"{name} must be float32 of shape {tuple(shape)} for this recipe, got {got}")


def _grouped_operand(q: torch.Tensor, s: torch.Tensor, gran) -> torch.Tensor:
    """float64 rows (rows, K) of A from its codes and the op's scales: (1,) per tensor, (rows, 1) per row,
    (rows, K/128) per 1x128 group (the plain grid whatever the strides)."""
    plain = s.reshape(1, 1) if gran is ScaleGranularity.TENSOR else s
    return dequantize(q, plain, gran)


def reference_grouped_mm(a, b, scale_a, scale_b, offs=None, *, counts=None, recipe,
                         out_dtype=torch.bfloat16) -> torch.Tensor:
    """float64 reference of the grouped FP8 GEMM (``ops.grouped.grouped_scaled_mm``'s operands): per expert e,
    ``dequant(A_e) @ dequant(W_e).T`` with ``b[e]`` = ``W_e.t()`` (W_e the row-major (N, K) weight), rounded once
    to ``out_dtype`` (``torch.float64`` keeps it exact).

    Contiguous layout (``offs``): ``a`` (T, K), the rows of expert e are ``offs[e-1]:offs[e]`` (``offs`` (E,) the
    cumulative end rows; groups may be empty); out (T, N), rows past ``offs[-1]`` (no group's) are NaN.
    Masked layout (``counts``): ``a`` (E, C, K), rows ``< counts[e]`` of expert e are computed; out (E, C, N),
    the other rows NaN (the kernel does not write them: a test sees what was written).

    ``recipe`` and the scales, as the op takes them: "tensor": ``scale_a`` (1,), ``scale_b`` (E,); "row":
    ``scale_a`` (T, 1) (masked (E, C, 1)), ``scale_b`` (E, 1, N); "deepseek": ``scale_a`` (T, K/128) per 1x128
    group (masked (E, C, K/128)), ``scale_b`` (E, K/128, N/128) per 128x128 block of W_e, transposed like W_e.
    Every scale is a decode factor (value = code * scale), fp32. Runs anywhere (host loop over the experts)."""
    rec = _grouped_recipe(recipe)
    if (offs is None) == (counts is None):
        raise ValueError("pass offs (contiguous layout) or counts (masked layout): exactly one of them")
    if b.dim() != 3:
        raise ValueError(f"b must be (E, K, N), got shape {tuple(b.shape)}")
    e, k, n = b.shape
    masked = counts is not None
    if a.dim() != (3 if masked else 2) or a.shape[-1] != k or (masked and a.shape[0] != e):
        want = f"({e}, C, {k})" if masked else f"(T, {k})"
        raise ValueError(f"a must be {want} for b of shape {tuple(b.shape)}, got {tuple(a.shape)}")
    lead = tuple(a.shape[:-1])
    kb, nb = ceil_div(k, 128), ceil_div(n, 128)
    if rec.a is ScaleGranularity.TENSOR:
        if not isinstance(scale_a, torch.Tensor) or scale_a.numel() != 1 or scale_a.dtype != torch.float32:
            raise ValueError("scale_a must be a one-element float32 tensor for the tensor recipe")
        _check_scale("scale_b", scale_b, (e,))
    else:
        _check_scale("scale_a", scale_a, (*lead, 1 if rec.a is ScaleGranularity.ROW else kb))
        _check_scale("scale_b", scale_b, (e, 1, n) if rec.b is ScaleGranularity.ROW else (e, kb, nb))
    weights = []
    for i in range(e):  # W_e (N, K) in float64, its plain scales the op's transposed back
        plain = scale_b[i].reshape(1, 1) if rec.b is ScaleGranularity.TENSOR else scale_b[i].t()
        weights.append(dequantize(b[i].t(), plain, rec.b))
    out = torch.full((*lead, n), float("nan"), dtype=torch.float64, device=a.device)
    if masked:
        c = a.shape[1]
        rows = [int(v) for v in counts.reshape(-1).tolist()]
        if len(rows) != e or any(r < 0 or r > c for r in rows):
            raise ValueError(f"counts must hold {e} values in [0, {c}] (the capacity), got {rows}")
        for i, r in enumerate(rows):
            if r == 0:  # (an empty group has no rows to dequantize)
                continue
            sa = scale_a if rec.a is ScaleGranularity.TENSOR else scale_a[i, :r]
            out[i, :r] = _grouped_operand(a[i, :r], sa, rec.a) @ weights[i].t()
    else:
        ends = [int(v) for v in offs.reshape(-1).tolist()]
        if len(ends) != e or any(y < x for x, y in zip([0, *ends], ends)) or (ends and ends[-1] > a.shape[0]):
            raise ValueError(f"offs must hold {e} nondecreasing end rows in [0, {a.shape[0]}], got {ends}")
        rows_a = _grouped_operand(a, scale_a, rec.a)
        start = 0
        for i, end in enumerate(ends):
            if end > start:
                out[start:end] = rows_a[start:end] @ weights[i].t()
            start = end
    return out.to(out_dtype)

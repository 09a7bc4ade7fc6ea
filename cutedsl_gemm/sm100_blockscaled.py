"""Host entry for the Blackwell block-scaled GEMMs: MXFP8 / MXFP6 / MXFP4 / mixed MX and NVFP4.

``blockscaled_mm(a, b, scale_a, scale_b, ...)`` computes ``gA * gB * decode(a, sfa) @ decode(b, sfb)``
(+ bias) with A (M, K) and ``b`` (K, N) in torch._scaled_mm's convention (``b = w.t()`` of a row-major
(N, K) ``w``), the operand storage of :mod:`cutedsl_gemm.sm100` (FP8 dtypes, ``float4_e2m1fn_x2``,
packed FP6 in uint8), and scale factors in the SWIZZLE_32_4_4 blocked layout
(:mod:`cutedsl_gemm.microscaling`).

==============  ==================  ===================  =====  ======================================
recipe          elements            scale (per K block)  block  tcgen05 kind
==============  ==================  ===================  =====  ======================================
MXFP8/6, mixed  any f8f6f4 pair     ``float8_e8m0fnu``   32     ``kind::mxf8f6f4.block_scale``
MXFP4           e2m1 x e2m1         ``float8_e8m0fnu``   32     ``kind::mxf4.block_scale.scale_vec::2X``
NVFP4           e2m1 x e2m1         ``float8_e4m3fn``    16     ``kind::mxf4nvf4.block_scale.scale_vec::4X``
==============  ==================  ===================  =====  ======================================

NVFP4's per-tensor fp32 global scales are one-element *device* tensors that the epilogue multiplies in
(no host synchronisation); MX recipes have none (1.0).

:func:`scaled_mm` takes ``F.scaled_mm``'s arguments (``ScalingType.BlockWise1x32`` / ``BlockWise1x16``,
``[BlockWise1x16, TensorWise]`` lists for NVFP4 with global scales, ``SwizzleType.SWIZZLE_32_4_4`` or
``NO_SWIZZLE`` plain scales, which are converted) so code written for torch can switch.

Without an sm_100 GPU everything here validates and computes :func:`reference_blockscaled_mm`; the GEMM
itself raises a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from . import microscaling as ms
from .formats import E2M1, E4M3, UE8M0, ElementFormat
from .sm100 import OUT_DTYPES, operand_bytes, resolve_format

MX_SCALE_DTYPE = UE8M0.torch_dtype  # torch.float8_e8m0fnu
NV_SCALE_DTYPE = E4M3.torch_dtype  # torch.float8_e4m3fn
KINDS = ("mxf8f6f4", "mxf4", "mxf4nvf4")


@dataclass(frozen=True)
class BlockScaledConfig:
    """What selects a compiled block-scaled kernel (operand formats inside a kind are run-time values)."""

    kind: str
    sf_vec: int
    out_dtype: str
    has_bias: bool
    use_2cta: bool
    tile_n: int = 128

    def key(self):
        return ("sm100_blockscaled", self.kind, self.sf_vec, self.out_dtype, self.has_bias, self.use_2cta, self.tile_n)


@dataclass
class BlockScaledProblem:
    m: int
    n: int
    k: int
    fmt_a: ElementFormat
    fmt_b: ElementFormat
    a: torch.Tensor  # (M, row_bytes) uint8
    b: torch.Tensor  # (N, row_bytes) uint8
    sfa: torch.Tensor  # blocked, flat uint8
    sfb: torch.Tensor
    global_a: Optional[torch.Tensor]
    global_b: Optional[torch.Tensor]
    config: BlockScaledConfig


def select_kind(fmt_a: ElementFormat, fmt_b: ElementFormat, sf_vec: int) -> str:
    """tcgen05 block-scale kind for an operand pair and scale vector size (see the module table)."""
    both_fp4 = fmt_a is E2M1 and fmt_b is E2M1
    if sf_vec == ms.NVFP4_BLOCK:
        if not both_fp4:
            raise ValueError(
                f"a 16-element scale block (NVFP4, BlockWise1x16) needs e2m1 x e2m1 operands; got "
                f"{fmt_a.name} x {fmt_b.name} (MX formats use 32-element blocks, BlockWise1x32)"
            )
        return "mxf4nvf4"
    if sf_vec == ms.MX_BLOCK:
        return "mxf4" if both_fp4 else "mxf8f6f4"
    raise ValueError(f"scale vector size must be 32 (MX) or 16 (NVFP4); got {sf_vec}")


def _scale_block(name: str, s: torch.Tensor, block_size: Optional[int]) -> int:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of block scales, got {type(s).__name__}")
    if s.dtype == MX_SCALE_DTYPE:
        implied = ms.MX_BLOCK
    elif s.dtype == NV_SCALE_DTYPE:
        implied = ms.NVFP4_BLOCK
    else:
        raise TypeError(
            f"{name} must be torch.float8_e8m0fnu (MX, one scale per 32 elements) or torch.float8_e4m3fn "
            f"(NVFP4, one per 16); got {s.dtype}"
        )
    if block_size is not None and block_size != implied:
        raise ValueError(
            f"{name}: scale vector size {block_size} does not match its dtype {s.dtype}, which implies "
            f"{implied} (float8_e8m0fnu <-> BlockWise1x32, float8_e4m3fn <-> BlockWise1x16)"
        )
    return implied


def _blocked_scales(name: str, s: torch.Tensor, rows: int, k: int, block: int, swizzled: bool) -> torch.Tensor:
    kb = k // block
    if swizzled:
        pr, pc = ms.blocked_scale_shape(rows, kb)
        if s.numel() != pr * pc:
            raise ValueError(
                f"{name}: SWIZZLE_32_4_4 scales for {rows} rows x K={k} with {block}-element blocks need "
                f"{pr} x {pc} = {pr * pc} elements (rows padded to 128, K/{block}={kb} scale columns padded to 4); "
                f"got {s.numel()} (shape {tuple(s.shape)})"
            )
        if not s.is_contiguous():
            raise ValueError(f"{name}: blocked scales must be contiguous")
        return s.view(torch.uint8).reshape(-1)
    if tuple(s.shape) != (rows, kb):
        raise ValueError(f"{name}: plain (NO_SWIZZLE) scales must have shape ({rows}, {kb}) = (rows, K/{block}); got {tuple(s.shape)}")
    return ms.to_blocked(s.view(torch.uint8)).reshape(-1)


def _global(name: str, g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if g is None:
        return None
    if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or g.numel() != 1:
        raise TypeError(f"{name} must be a one-element torch.float32 tensor (per-tensor decode scale)")
    return g.reshape(1)


def prepare_blockscaled(
    a, b, scale_a, scale_b, *, fmt_a=None, fmt_b=None, global_scale_a=None, global_scale_b=None, bias=None,
    out_dtype=torch.bfloat16, block_size: Optional[int] = None, swizzled: bool = True,
    use_2cta: Optional[bool] = None, tile_n: int = 128,
) -> BlockScaledProblem:
    """Every device-independent check; returns byte views, blocked scale bytes and the configuration."""
    fa = resolve_format("a", a, fmt_a)
    fb = resolve_format("b", b, fmt_b)
    m, ka, a_bytes = operand_bytes("a", a, fa, 1)
    n, kb_, b_bytes = operand_bytes("b", b, fb, 0)
    if ka != kb_:
        raise ValueError(f"K mismatch: a holds K={ka} {fa.name} values per row, b holds K={kb_} {fb.name} values per column")
    k = ka
    blk_a = _scale_block("scale_a", scale_a, block_size)
    blk_b = _scale_block("scale_b", scale_b, block_size)
    if blk_a != blk_b:
        raise ValueError(f"scale_a ({scale_a.dtype}) and scale_b ({scale_b.dtype}) imply different recipes; both MX or both NVFP4")
    block = blk_a
    ms.check_k(k, block)
    kind = select_kind(fa, fb, block)
    sfa = _blocked_scales("scale_a", scale_a, m, k, block, swizzled)
    sfb = _blocked_scales("scale_b", scale_b, n, k, block, swizzled)
    ga = _global("global_scale_a", global_scale_a)
    gb = _global("global_scale_b", global_scale_b)
    if kind != "mxf4nvf4" and (ga is not None or gb is not None):
        raise ValueError("per-tensor global scales belong to NVFP4 (float8_e4m3fn block scales); MX recipes have none")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    out_size = torch.empty((), dtype=out_dtype).element_size()
    if (n * out_size) % 16:
        raise ValueError(f"N={n}: output rows must be a multiple of 16 bytes for the TMA store ({16 // out_size} {out_dtype} elements)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError("bias must be a floating-point torch.Tensor of shape (N,)")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if use_2cta is None:
        use_2cta = m > 128 and tile_n >= 128
    cfg = BlockScaledConfig(kind, block, OUT_DTYPES[out_dtype], bias is not None, bool(use_2cta), tile_n)
    return BlockScaledProblem(m, n, k, fa, fb, a_bytes, b_bytes, sfa, sfb, ga, gb, cfg)


# ------------------------------------------------------------------------------------------------
# GEMM entry points
# ------------------------------------------------------------------------------------------------


def blockscaled_mm(
    a, b, scale_a, scale_b, *, fmt_a=None, fmt_b=None, global_scale_a=None, global_scale_b=None, bias=None,
    out_dtype=torch.bfloat16, block_size: Optional[int] = None, swizzled: bool = True,
) -> torch.Tensor:
    """Block-scaled ``A @ B`` on an sm_100 GPU (see the module doc for conventions)."""
    p = prepare_blockscaled(
        a, b, scale_a, scale_b, fmt_a=fmt_a, fmt_b=fmt_b, global_scale_a=global_scale_a,
        global_scale_b=global_scale_b, bias=bias, out_dtype=out_dtype, block_size=block_size, swizzled=swizzled,
    )
    from .sm100 import require_sm100

    require_sm100(a, b, scale_a, scale_b)
    from cutedsl_gemm.kernels.sm100 import blockscaled_gemm

    return blockscaled_gemm.launch(p, bias=bias, out_dtype=out_dtype)


def mm_quantized(qa: ms.BlockScaledTensor, qw: ms.BlockScaledTensor, *, bias=None, out_dtype=torch.bfloat16,
                 reference: bool = False) -> torch.Tensor:
    """``dequant(qa) @ dequant(qw).T`` for two quantizer outputs (A (M, K) and W (N, K))."""
    args = dict(fmt_a=qa.fmt, fmt_b=qw.fmt, global_scale_a=qa.global_scale, global_scale_b=qw.global_scale, bias=bias)
    if reference:
        return reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, **args)
    return blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, out_dtype=out_dtype, **args)


_SCALING_NAMES = {"BlockWise1x32": ms.MX_BLOCK, "BlockWise1x16": ms.NVFP4_BLOCK}


def _enum_name(x) -> str:
    return getattr(x, "name", str(x)).split(".")[-1]


def _split_recipe(name: str, scale, recipe, swizzle):
    """F.scaled_mm's (scale, recipe, swizzle), possibly lists, -> (block scales, block, swizzled, global)."""
    scales = list(scale) if isinstance(scale, (list, tuple)) else [scale]
    recipes = list(recipe) if isinstance(recipe, (list, tuple)) else [recipe]
    swz = list(swizzle) if isinstance(swizzle, (list, tuple)) else [swizzle] * len(scales)
    if len(scales) != len(recipes):
        raise ValueError(f"{name}: {len(scales)} scale tensors but {len(recipes)} scaling recipes")
    names = [_enum_name(r) for r in recipes]
    if names[0] not in _SCALING_NAMES:
        raise ValueError(
            f"{name}: block-scaled GEMMs take ScalingType.BlockWise1x32 (MX) or BlockWise1x16 (NVFP4); got {names[0]}"
        )
    block = _SCALING_NAMES[names[0]]
    glob = None
    if len(scales) == 2:
        if names[1] != "TensorWise" or block != ms.NVFP4_BLOCK:
            raise ValueError(f"{name}: a second scale must be the NVFP4 per-tensor scale: [BlockWise1x16, TensorWise]; got {names}")
        glob = scales[1]
    elif len(scales) != 1:
        raise ValueError(f"{name}: expected 1 or 2 scale tensors, got {len(scales)}")
    s0 = swz[0] if swz else None
    sname = "SWIZZLE_32_4_4" if s0 is None else _enum_name(s0)
    if sname not in ("SWIZZLE_32_4_4", "NO_SWIZZLE"):
        raise ValueError(f"{name}: swizzle must be SwizzleType.SWIZZLE_32_4_4 or NO_SWIZZLE; got {sname}")
    return scales[0], block, sname == "SWIZZLE_32_4_4", glob


def scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None, swizzle_b=None,
              bias=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False,
              *, fmt_a=None, fmt_b=None, reference: bool = False):
    """``torch.nn.functional.scaled_mm`` for the block-scaled recipes (``swizzle`` None means SWIZZLE_32_4_4).

    ``fmt_a`` / ``fmt_b`` are needed only for packed FP6 (uint8) operands. ``reference=True`` returns the
    float64 reference instead of launching the kernel.
    """
    if tuple(contraction_dim) not in ((), (1, 0)):
        raise ValueError(f"contraction_dim must be () or (1, 0) (K is dim 1 of mat_a and dim 0 of mat_b); got {contraction_dim}")
    sa, blk_a, swz_a, ga = _split_recipe("scale_a", scale_a, scale_recipe_a, swizzle_a)
    sb, blk_b, swz_b, gb = _split_recipe("scale_b", scale_b, scale_recipe_b, swizzle_b)
    if blk_a != blk_b:
        raise ValueError(f"scale_recipe_a and scale_recipe_b disagree on the block size ({blk_a} vs {blk_b})")
    if swz_a != swz_b:
        raise ValueError("swizzle_a and swizzle_b must agree (both SWIZZLE_32_4_4 or both NO_SWIZZLE)")
    kw = dict(fmt_a=fmt_a, fmt_b=fmt_b, global_scale_a=ga, global_scale_b=gb, bias=bias, block_size=blk_a, swizzled=swz_a)
    if reference:
        return reference_blockscaled_mm(mat_a, mat_b, sa, sb, **kw).to(output_dtype)
    return blockscaled_mm(mat_a, mat_b, sa, sb, out_dtype=output_dtype, **kw)


# ------------------------------------------------------------------------------------------------
# Reference and quantizers
# ------------------------------------------------------------------------------------------------


def reference_blockscaled_mm(a, b, scale_a, scale_b, *, fmt_a=None, fmt_b=None, global_scale_a=None,
                             global_scale_b=None, bias=None, block_size=None, swizzled=True) -> torch.Tensor:
    """float64 ``gA * gB * dequant(a) @ dequant(b) (+ bias)`` on any device (the GPU tests' oracle)."""
    p = prepare_blockscaled(a, b, scale_a, scale_b, fmt_a=fmt_a, fmt_b=fmt_b, global_scale_a=global_scale_a,
                            global_scale_b=global_scale_b, bias=bias, block_size=block_size, swizzled=swizzled)
    sdt = MX_SCALE_DTYPE if p.config.sf_vec == ms.MX_BLOCK else NV_SCALE_DTYPE
    blk = p.config.sf_vec

    def deq(bytes_, fmt, rows, sf, g):
        t = ms.BlockScaledTensor(bytes_, sf.view(sdt), fmt, blk, (rows, p.k), g)
        return t.dequantize()

    av = deq(p.a, p.fmt_a, p.m, p.sfa, p.global_a)
    wv = deq(p.b, p.fmt_b, p.n, p.sfb, p.global_b)
    out = av @ wv.t()
    if bias is not None:
        out = out + bias.double().to(out.device)
    return out


def quantize_mx(x: torch.Tensor, fmt="e4m3") -> ms.BlockScaledTensor:
    """MX quantizer: the CuTe DSL kernel for CUDA tensors, the torch reference elsewhere (bit-identical)."""
    if x.is_cuda:
        from cutedsl_gemm.kernels.sm100.quantize_mx import quantize_mx as kernel

        return kernel(x, fmt)
    return ms.quantize_mx_reference(x, fmt)


def quantize_nvfp4(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None) -> ms.BlockScaledTensor:
    """NVFP4 quantizer: the CuTe DSL kernel for CUDA tensors, the torch reference elsewhere (bit-identical)."""
    if x.is_cuda:
        from cutedsl_gemm.kernels.sm100.quantize_mx import quantize_nvfp4 as kernel

        return kernel(x, global_scale)
    return ms.quantize_nvfp4_reference(x, global_scale)

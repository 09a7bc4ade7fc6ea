"""Host entry for the Blackwell block-scaled GEMMs: MXFP8 / MXFP6 / MXFP4 / mixed MX and NVFP4.

``blockscaled_mm(a, b, scale_a, scale_b, ...)`` computes ``gA * gB * decode(a, sfa) @ decode(b, sfb)``
(+ bias) with A (M, K) and ``b`` (K, N) in torch._scaled_mm's convention (``b = w.t()`` of a row-major
(N, K) ``w``), the operand storage of :mod:`cutedsl_gemm.sm100` (FP8 dtypes, ``float4_e2m1fn_x2``,
packed FP6 in uint8), and scale factors in the SWIZZLE_32_4_4 blocked layout
(:mod:`cutedsl_gemm.numerics.microscaling`).

==============  ==================  ===================  =====  =============================================
recipe          elements            scale (per K block)  block  tcgen05 kind (PTX; older name)
==============  ==================  ===================  =====  =============================================
MXFP8/6, mixed  any f8f6f4 pair     ``float8_e8m0fnu``   32     ``kind::mxf8f6f4.block_scale.block32`` (1X)
MXFP4           e2m1 x e2m1         ``float8_e8m0fnu``   32     ``kind::mxf4.block_scale.block32`` (2X)
NVFP4           e2m1 x e2m1         ``float8_e4m3fn``    16     ``kind::mxf4nvf4.block_scale.block16`` (4X)
==============  ==================  ===================  =====  =============================================

MXFP4 and NVFP4 keep their operands packed in shared memory: K must be a multiple of 32 elements (16-byte
rows). Pairs through ``mxf8f6f4`` follow the f8f6f4 GEMM's rules (FP6/FP4 operands: K a multiple of 128).

NVFP4's per-tensor fp32 global scales are one-element *device* tensors that the epilogue multiplies in
(no host synchronisation); MX recipes have none (1.0).

:func:`scaled_mm` takes ``F.scaled_mm``'s arguments (``ScalingType.BlockWise1x32`` / ``BlockWise1x16``,
``[BlockWise1x16, TensorWise]`` lists for NVFP4 with global scales, ``SwizzleType.SWIZZLE_32_4_4`` or
``NO_SWIZZLE`` plain scales, which are converted) so code written for torch can switch.

The kernel is the f8f6f4 GEMM with its scale-factor hooks switched on
(``kernels/sm100/blockscaled_gemm.py``), compiled once per (kind, output dtype, bias, 1-/2-CTA): inside
``mxf8f6f4`` the operand formats are run-time values, so MXFP8, MXFP6 and every mixed MX pair share one
compilation. Tiles are 128 x 128 (1-CTA) or 256 x 128 (2-CTA, chosen when M > 128).

Without an sm_100 GPU everything here validates, compiles for sm_100a (``CUTE_DSL_ARCH=sm_100a``) and
computes :func:`reference_blockscaled_mm`; the GEMM itself raises a clear error. It has not been run on a
GPU in this project.

Padding bytes of the blocked scales (rows past M/N, scale columns past K/block) multiply zero-filled
operand data; they must be finite codes (torch and this package pad with 0), a NaN there would poison
the row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from cutedsl_gemm.numerics import microscaling as ms
from cutedsl_gemm.numerics.formats import E2M1, E4M3, UE8M0, ElementFormat
from cutedsl_gemm.runtime.jit import KERNEL_CACHE
from cutedsl_gemm.sm100 import (
    MMA_FORMAT_CODE,
    OUT_DTYPES,
    STORAGE_CLASS,
    Sm100Config,
    bias_argument,
    check_output,
    default_use_2cta,
    empty_product,
    launch_operands,
    max_clusters,
    operand_pair,
    require_sm100,
    resolve_format,
)

MX_SCALE_DTYPE = UE8M0.torch_dtype  # torch.float8_e8m0fnu
NV_SCALE_DTYPE = E4M3.torch_dtype  # torch.float8_e4m3fn
#: kind -> K elements per scale factor
KINDS = {"mxf8f6f4": ms.MX_BLOCK, "mxf4": ms.MX_BLOCK, "mxf4nvf4": ms.NVFP4_BLOCK}
#: kinds whose FP4 operands stay packed in shared memory (loaded as bytes, no TMA unpacking)
PACKED_FP4_KINDS = ("mxf4", "mxf4nvf4")
SCALE_BASE_ALIGN = 16  # TMA global address alignment


@dataclass(frozen=True)
class BlockScaledConfig:
    """What selects a compiled block-scaled kernel (operand formats inside a kind are run-time values)."""

    kind: str
    sf_vec: int
    out_dtype: str
    has_bias: bool
    use_2cta: bool
    tile_n: int = 128

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if self.sf_vec != KINDS[self.kind]:
            raise ValueError(f"kind {self.kind} uses {KINDS[self.kind]}-element scale blocks, got sf_vec={self.sf_vec}")
        if self.out_dtype not in OUT_DTYPES.values():
            raise ValueError(f"out_dtype must be one of {sorted(OUT_DTYPES.values())}, got {self.out_dtype!r}")
        if self.tile_n != 128:
            raise ValueError(f"the block-scaled GEMM is built for tile_n=128 only, got {self.tile_n}")

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
    blk_a = _scale_block("scale_a", scale_a, block_size)
    blk_b = _scale_block("scale_b", scale_b, block_size)
    if blk_a != blk_b:
        raise ValueError(f"scale_a ({scale_a.dtype}) and scale_b ({scale_b.dtype}) imply different recipes; both MX or both NVFP4")
    block = blk_a
    kind = select_kind(fa, fb, block)
    # the FP4 kinds read packed bytes straight into shared memory: 16-byte rows, no unpacking rules
    m, n, k, a_bytes, b_bytes = operand_pair(a, b, fa, fb, unpack=kind not in PACKED_FP4_KINDS)
    ms.check_k(k, block)
    sfa = _blocked_scales("scale_a", scale_a, m, k, block, swizzled)
    sfb = _blocked_scales("scale_b", scale_b, n, k, block, swizzled)
    ga = _global("global_scale_a", global_scale_a)
    gb = _global("global_scale_b", global_scale_b)
    if kind != "mxf4nvf4" and (ga is not None or gb is not None):
        raise ValueError("per-tensor global scales belong to NVFP4 (float8_e4m3fn block scales); MX recipes have none")
    check_output(n, out_dtype, bias)
    cfg = BlockScaledConfig(kind, block, OUT_DTYPES[out_dtype], bias is not None, default_use_2cta(m, tile_n, use_2cta), tile_n)
    return BlockScaledProblem(m, n, k, fa, fb, a_bytes, b_bytes, sfa, sfb, ga, gb, cfg)


# ------------------------------------------------------------------------------------------------
# Compilation
# ------------------------------------------------------------------------------------------------


def fake_args(cfg: BlockScaledConfig):
    """Shape-symbolic arguments of ``call_block_scaled``: the dense kernel's, plus the two scale tensors
    as (row atoms, col atoms x 128) int32 words after the operands."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    from cutedsl_gemm import sm100

    dense = sm100.fake_args(Sm100Config(cfg.out_dtype, cfg.has_bias, cfg.use_2cta, cfg.tile_n))

    def words():
        shape = (cute.sym_int(), cute.sym_int(divisibility=ms.SF_ATOM_BYTES // 4))
        return make_fake_compact_tensor(cutlass.Int32, shape, stride_order=(1, 0), assumed_align=SCALE_BASE_ALIGN)

    return (*dense[:6], words(), words(), *dense[6:])


def build(cfg: BlockScaledConfig, ptx_dir: Optional[str] = None):
    """``cute.compile`` one configuration; with ``ptx_dir`` the PTX is kept (``result.__ptx__``)."""
    import cutlass
    import cutlass.cute as cute

    from cutedsl_gemm.kernels.sm100.blockscaled_gemm import BlockScaling
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import Sm100F8F6F4Gemm

    kernel = Sm100F8F6F4Gemm(getattr(cutlass, cfg.out_dtype), cfg.use_2cta, cfg.tile_n, cfg.has_bias,
                             scaling=BlockScaling(cfg.kind))
    options = "--enable-tvm-ffi"
    if ptx_dir is not None:
        os.makedirs(ptx_dir, exist_ok=True)  # the DSL keeps no PTX text for a dump dir that does not exist
        options += f" --keep-ptx --dump-dir={ptx_dir}"
    return cute.compile(kernel.call_block_scaled, *fake_args(cfg), options=options)


def compiled_kernel(cfg: BlockScaledConfig, *, arch: Optional[str] = None, ptx_dir: Optional[str] = None):
    """The compiled kernel for ``cfg`` from the process / disk cache (compiling at most once)."""
    return KERNEL_CACHE.get(cfg.key(), lambda: build(cfg, ptx_dir), arch=arch)


# ------------------------------------------------------------------------------------------------
# GEMM entry points
# ------------------------------------------------------------------------------------------------


def scale_argument(name: str, blocked: torch.Tensor, rows: int, k: int, block: int) -> torch.Tensor:
    """Blocked scale bytes as the kernel's (row atoms, col atoms x 128) int32 words, base checked for TMA."""
    if blocked.data_ptr() % SCALE_BASE_ALIGN:
        raise ValueError(f"{name}: blocked scales must start on a {SCALE_BASE_ALIGN}-byte boundary (TMA), got 0x{blocked.data_ptr():x}")
    return ms.blocked_scale_words(blocked, rows, k // block)


def launch_arguments(p: BlockScaledProblem, dev: torch.device, bias=None):
    """Everything ``call_block_scaled`` takes after the output, in order, for problem ``p``."""
    packed = p.config.kind in PACKED_FP4_KINDS
    a_args, b_args = launch_operands(dev, p.a, 0 if packed else STORAGE_CLASS[p.fmt_a.name],
                                     p.b, 0 if packed else STORAGE_CLASS[p.fmt_b.name])
    blk = p.config.sf_vec
    sfa = scale_argument("scale_a", p.sfa, p.m, p.k, blk)
    sfb = scale_argument("scale_b", p.sfb, p.n, p.k, blk)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    ga = one if p.global_a is None else p.global_a
    gb = one if p.global_b is None else p.global_b
    return (a_args, b_args, sfa, sfb,
            (ga, gb, bias_argument(dev, bias), p.k, MMA_FORMAT_CODE[p.fmt_a.name], MMA_FORMAT_CODE[p.fmt_b.name],
             max_clusters(dev, p.config.use_2cta)))


def blockscaled_mm(
    a, b, scale_a, scale_b, *, fmt_a=None, fmt_b=None, global_scale_a=None, global_scale_b=None, bias=None,
    out_dtype=torch.bfloat16, block_size: Optional[int] = None, swizzled: bool = True,
    use_2cta: Optional[bool] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Block-scaled ``A @ B`` on an sm_100 GPU (see the module doc for conventions); ``out``, if given,
    is a row-major (M, N) tensor of ``out_dtype`` written in place."""
    p = prepare_blockscaled(
        a, b, scale_a, scale_b, fmt_a=fmt_a, fmt_b=fmt_b, global_scale_a=global_scale_a,
        global_scale_b=global_scale_b, bias=bias, out_dtype=out_dtype, block_size=block_size, swizzled=swizzled,
        use_2cta=use_2cta,
    )
    tensors = [t for t in (a, b, scale_a, scale_b, global_scale_a, global_scale_b, bias) if t is not None]
    dev = require_sm100(*tensors, entry="blockscaled_mm", reference="reference_blockscaled_mm")
    if out is not None:
        _check_out(out, p.m, p.n, out_dtype, dev)
    if p.m == 0 or p.n == 0 or p.k == 0:  # no launch: the kernel's accumulator is only defined for K > 0
        res = empty_product(p.m, p.n, bias, out_dtype, dev)
        return res if out is None else out.copy_(res)
    fn = compiled_kernel(p.config)
    a_args, b_args, sfa, sfb, rest = launch_arguments(p, dev, bias)
    if out is None:
        out = torch.empty(p.m, p.n, dtype=out_dtype, device=dev)
    fn(*a_args, *b_args, sfa, sfb, out, *rest)
    return out


def _check_out(out, m: int, n: int, out_dtype, dev) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype or out.device != dev:
        raise ValueError(f"out must be ({m}, {n}) {out_dtype} on {dev}; got {tuple(out.shape)} {out.dtype} on {out.device}")
    if out.numel() and (out.stride() != (n, 1) or out.data_ptr() % 16):
        raise ValueError("out must be row-major contiguous with a 16-byte aligned base (TMA store)")


def mm_quantized(qa: ms.BlockScaledTensor, qw: ms.BlockScaledTensor, *, bias=None, out_dtype=torch.bfloat16,
                 reference: bool = False, use_2cta: Optional[bool] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dequant(qa) @ dequant(qw).T`` for two quantizer outputs (A (M, K) and W (N, K))."""
    args = dict(fmt_a=qa.fmt, fmt_b=qw.fmt, global_scale_a=qa.global_scale, global_scale_b=qw.global_scale, bias=bias)
    if reference:
        return reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, **args)
    return blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, out_dtype=out_dtype, use_2cta=use_2cta, out=out,
                          **args)


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

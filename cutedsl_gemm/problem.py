"""One description of a GEMM call and every check on its inputs. Each failure names what was expected.

``describe_scaled_mm`` turns the arguments of ``scaled_mm`` into a frozen ``GemmProblem`` (what selection
reads: sizes, formats, recipe, accumulation, arch) and the tensors as the kernel takes them (``GemmOperands``:
operand and scale views in the kernel's layouts). Hopper (sm_90a) and Blackwell (sm_100a) calls are described
alike; what each architecture runs is read from the instance table, and a call it does not run is refused with
what it does run. Nothing here chooses or launches a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from cutedsl_gemm.numerics import codecs, scale_layouts
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import (
    E2M1,
    F8F6F4_FORMATS,
    FLOAT_FORMATS,
    FP8_FORMATS,
    INT8,
    RECIPES,
    ScaleGranularity,
    activation_format,
    ceil_div,
    element_format,
)
from cutedsl_gemm.numerics.formats import (
    recipe as recipe_of,
)
from cutedsl_gemm.runtime.device import device_info
from cutedsl_gemm.selection.dispatch import MAX_SPLITS
from cutedsl_gemm.selection.instances import F8F6F4, SM90, SM100, TABLE, table

G = ScaleGranularity
FP8_DTYPES = tuple(f.torch_dtype for f in FP8_FORMATS)
FP8_NAMES = {f.torch_dtype: f.name for f in FP8_FORMATS}
OUT_NAMES = {f.torch_dtype: f.name for f in FLOAT_FORMATS}
#: The largest K of an int8 GEMM: its int32 sums of K products stay exact (no overflow) for any int8 data, whose
#: products are at most 128 * 128 in magnitude (for the quantizers' |q| <= 127 it would be 133,144).
INT8_MAX_K = (2**31 - 1) // (128 * 128)
#: What the int8 GEMMs take as scales (the row-wise and tensor-wise FP8 layouts)
INT8_SCALES = "fp32 TensorWise (one element each) or RowWise (scale_a (M, 1), scale_b (1, N)) scales"
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned base addresses and row strides
#: TMA unpacking of packed FP4 / FP6 (.b4x16_p64 / .b6x16_p32) reads 128-element rows from 32-byte aligned bases.
SUBBYTE_BASE_ALIGN = 32
SUBBYTE_K_MULTIPLE = 128
#: The rows of the scaled GEMMs (op "gemm": what scaled_mm runs; the weight-only rows are mm_weight_only's).
_GEMM_ROWS = tuple(r for r in TABLE if r.op == "gemm")
#: The archs with GEMM kernels, and per arch the schedules a call may force and the recipes it runs.
ARCHS = tuple(dict.fromkeys(r.arch for r in _GEMM_ROWS))
SCHEDULES = {arch: tuple(dict.fromkeys(r.schedule for r in _GEMM_ROWS if r.arch == arch)) for arch in ARCHS}
ARCH_RECIPES = {arch: tuple(dict.fromkeys(rec for r in _GEMM_ROWS if r.arch == arch for rec in r.recipes))
                for arch in ARCHS}
GPU_NAMES = {SM90: "Hopper (sm_90a)", SM100: "Blackwell (sm_100a)"}
SWIZZLED, NOT_SWIZZLED = "SWIZZLE_32_4_4", "NO_SWIZZLE"


def _scaling_name(rec) -> str:
    return rec.a.scaling_type if rec.a is rec.b else f"{rec.a.scaling_type} x {rec.b.scaling_type}"


@functools.lru_cache(maxsize=None)
def runs(arch: str) -> str:
    """What the instance table runs on ``arch``, for error messages: operand formats and their scale recipes."""
    by_formats: dict = {}
    for r in ARCH_RECIPES[arch]:
        names = {}
        for i in table():
            if i.op == "gemm" and i.arch == arch and i.recipe == r:
                for d in (i.a_dtype, i.b_dtype):
                    formats = F8F6F4_FORMATS if d == F8F6F4 else (element_format(d),)
                    names.update(dict.fromkeys(f.name for f in formats))
        by_formats.setdefault(tuple(names), []).append(_scaling_name(RECIPES[r]))
    return f"{arch} runs " + "; ".join(f"{' / '.join(f)} operands with {', '.join(s)} scales"
                                       for f, s in by_formats.items())


def _tensors(x):
    return x if isinstance(x, (list, tuple)) else (x,)


def require_cuda_tensors(**tensors) -> torch.device:
    """All given tensors (None skipped; lists, such as NVFP4's [block scales, global scale], entry by entry)
    live on one CUDA device; returns it."""
    device = None
    for name, ts in tensors.items():
        for t in _tensors(ts):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            d = t.device
            if d.type != "cuda":
                raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {d} (scaled_mm runs on "
                                 f"{' and '.join(map(GPU_NAMES.get, ARCHS))} GPUs; numerics.reference computes the "
                                 "product on any device)")
            if device is None:
                device = d
            elif d != device:
                raise ValueError(f"all tensors must be on one device: {name} is on {d}, expected {device}")
    return device


def require_fp8(name: str, t: torch.Tensor) -> str:
    if t.dtype not in FP8_DTYPES:
        hint = " (packed FP4 / FP6 operands run on Blackwell, sm_100a)" if t.dtype in (torch.uint8, E2M1.torch_dtype) \
            else ""
        raise TypeError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {t.dtype}{hint}")
    return FP8_NAMES[t.dtype]


def require_out_dtype(dtype) -> str:
    if dtype not in OUT_NAMES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    return OUT_NAMES[dtype]


def require_k_major(name: str, t: torch.Tensor, k_dim: int, layout_hint: str) -> None:
    """K is the contiguous dimension, rows are 16-byte aligned and packed (stride K), and the base pointer is
    16-byte aligned."""
    if t.stride(k_dim) != 1 and t.size(k_dim) > 1:
        raise ValueError(
            f"{name} must be K-major ({layout_hint}): stride along K must be 1, got strides {tuple(t.stride())}; "
            "pass a contiguous tensor (the kernels never copy silently)"
        )
    row_stride = t.stride(1 - k_dim)
    if t.size(1 - k_dim) > 1 and (row_stride * t.element_size()) % TMA_ALIGN:
        raise ValueError(
            f"{name}: TMA needs the row stride to be a multiple of {TMA_ALIGN} bytes; got {row_stride} elements "
            f"({row_stride * t.element_size()} bytes). K must be a multiple of {TMA_ALIGN // t.element_size()}"
        )
    if t.data_ptr() % TMA_ALIGN:
        raise ValueError(f"{name}: TMA needs a {TMA_ALIGN}-byte aligned base address, got 0x{t.data_ptr():x}")
    if t.size(1 - k_dim) > 1 and row_stride != t.size(k_dim):
        # The Hopper kernels are compiled for packed rows (one stride fewer to pass and check per call).
        raise ValueError(
            f"{name} must have packed rows ({layout_hint}): row stride {row_stride} != K={t.size(k_dim)}; "
            "pass a contiguous tensor (the kernels never copy silently)"
        )


def operand_bytes(name: str, t: torch.Tensor, fmt, k_dim: int, *, unpack: bool = True):
    """Check an sm_100a operand against the TMA rules; returns (rows, K, (rows, row bytes) uint8 view).

    ``k_dim`` is the dimension that holds K (1 for a (M, K); 0 for b (K, N)). ``unpack=False`` is for packed
    FP4 that stays packed in shared memory (the MXFP4 / NVFP4 kinds): its bytes are loaded like 8-bit data, so
    only the 16-byte row and base rules apply.
    """
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.stride(k_dim) != 1:
        layout = "row-major (M, K)" if k_dim == 1 else "column-major (K, N), i.e. w.t() of a row-major (N, K) w"
        raise ValueError(f"{name} must be K-contiguous ({layout}); got strides {tuple(t.stride())}")
    raw = codecs.as_bytes(t)
    rows = raw.size(1 - k_dim)
    row_bytes = raw.size(k_dim)
    k = codecs.logical_k(row_bytes, fmt)
    unpacked = fmt.bits < 8 and unpack
    if unpacked:
        base_align, k_mult = SUBBYTE_BASE_ALIGN, SUBBYTE_K_MULTIPLE
    else:
        base_align, k_mult = TMA_ALIGN, TMA_ALIGN * 8 // fmt.bits
    if k % k_mult:
        what = "TMA unpacking of packed FP4/FP6" if unpacked else "TMA (16-byte rows)"
        raise ValueError(
            f"{name}: {what} needs the leading (K) dimension to be a multiple of {k_mult} elements; "
            f"{fmt.name} row of {row_bytes} bytes holds K={k}"
        )
    stride_bytes = raw.stride(1 - k_dim)
    if rows > 1 and row_bytes and stride_bytes != row_bytes:  # (an empty K has no row layout to check)
        raise ValueError(
            f"{name}: rows of K must be packed back to back (row stride {row_bytes} bytes), got a stride of "
            f"{stride_bytes} bytes; pass a contiguous tensor"
        )
    if raw.data_ptr() % base_align:
        raise ValueError(
            f"{name}: base address must be {base_align}-byte aligned for {fmt.name} "
            f"({'TMA unpacking' if unpacked else 'TMA'}), got 0x{raw.data_ptr():x}"
        )
    return rows, k, raw if k_dim == 1 else raw.t()


@dataclass(frozen=True)
class GemmProblem:
    """What selection needs to know about a call: everything but the tensors' data."""

    m: int
    n: int
    k: int
    a_format: str  # element format: "e4m3" | "e5m2" | "int8" (and on sm_100a "e3m2" | "e2m3" | "e2m1")
    b_format: str
    out_name: str  # "bf16" | "fp16" | "fp32"
    bias_name: Optional[str]  # None, or the dtype the kernel reads the bias in
    recipe: str  # numerics.formats.RECIPES key
    accum: str  # "promoted" | "fast"
    arch: str  # "sm_90a", "sm_100a"
    sms: int
    device_index: Optional[int]
    schedule: Optional[str] = None  # forced schedule, or None
    split_k: Optional[int] = None  # forced K splits, or None
    # "bf16" | "fp16" | "fp32": A comes unquantized in this dtype, to be quantized to a_format in 1x128 groups
    # (``describe_quantize_scaled_mm``); None: A comes quantized.
    act_format: Optional[str] = None

    @property
    def is_empty(self) -> bool:
        """M, N or K zero: nothing to launch (the output is empty, zero or the bias)."""
        return self.m == 0 or self.n == 0 or self.k == 0


@dataclass(frozen=True)
class GemmOperands:
    """The tensors of a call as the kernel reads them: on Hopper the operands as given and the scale views;
    on sm_100a (rows, row bytes) uint8 operand views, (1,) per-tensor scales or blocked scale words
    (``scale_words``), an fp32 bias and NVFP4's (1,) global scales."""

    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    bias: Optional[torch.Tensor]
    out: Optional[torch.Tensor]  # the caller's out=, or None
    k_blocks: int  # 128-deep K blocks: the Hopper block-scaled recipes' scale views are cut to them
    global_a: Optional[torch.Tensor] = None
    global_b: Optional[torch.Tensor] = None


def check_bias(bias, n: int, out_dtype, *, any_float: bool = False) -> Optional[str]:
    """The (N,) bias in ``out_dtype`` or fp32 (``any_float``: any floating dtype, read as fp32), contiguous;
    returns its dtype's name (None: no bias)."""
    if bias is None:
        return None
    if any_float and (not isinstance(bias, torch.Tensor) or not bias.is_floating_point()):
        raise TypeError("bias must be a floating-point torch.Tensor of shape (N,)")
    if tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
    if any_float:
        return "fp32"
    if bias.dtype not in (out_dtype, torch.float32):
        raise TypeError(f"bias must be {out_dtype} (the output dtype) or torch.float32, got {bias.dtype}")
    if bias.stride(0) != 1 and n > 1:
        raise ValueError("bias must be contiguous")
    return OUT_NAMES[bias.dtype]


def check_output_rows(n: int, out_dtype) -> None:
    out_size = torch.empty((), dtype=out_dtype).element_size()
    if (n * out_size) % TMA_ALIGN:
        raise ValueError(f"N={n}: the TMA store needs output rows of a multiple of 16 bytes "
                         f"(N % {TMA_ALIGN // out_size} == 0)")


def check_out(out, m: int, n: int, out_dtype) -> None:
    """A caller's out=: (M, N) of ``out_dtype``, row-major with 16-byte aligned rows and base (TMA store)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype:
        raise ValueError(f"out must be a ({m}, {n}) {out_dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if n > 1 and out.stride(1) != 1 or m > 1 and (out.stride(0) * out.element_size()) % TMA_ALIGN:
        raise ValueError(f"out must be row-major with 16-byte aligned rows, got strides {tuple(out.stride())}")
    if out.data_ptr() % TMA_ALIGN:
        raise ValueError("out must have a 16-byte aligned base address (TMA store)")


def check_overrides(schedule, split_k, arch: str = SM90) -> None:
    """``schedule`` and ``split_k`` as scaled_mm takes them (whether the instance can split is selection's)."""
    if schedule is not None and schedule not in SCHEDULES[arch]:
        raise ValueError(f"schedule must be None or one of {', '.join(map(repr, SCHEDULES[arch]))} on {arch}, "
                         f"got {schedule!r}")
    if split_k is not None and (not isinstance(split_k, int) or not 1 <= split_k <= MAX_SPLITS):
        raise ValueError(f"split_k must be an int in 1..{MAX_SPLITS}, got {split_k!r}")


def _swizzle_name(name: str, swizzle) -> Optional[str]:
    """SWIZZLED, NOT_SWIZZLED or None from a SwizzleType, its name, or a list of them (the first: the block scales')."""
    s = swizzle[0] if isinstance(swizzle, (list, tuple)) and swizzle else swizzle
    if s is None or isinstance(s, (list, tuple)):
        return None
    label = str(getattr(s, "name", s)).upper()
    if label not in (SWIZZLED, NOT_SWIZZLED):
        raise ValueError(f"swizzle_{name[-1]} must be SwizzleType.SWIZZLE_32_4_4 or NO_SWIZZLE (or None); got {s!r}")
    return label


def describe_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum, scale_recipe_a, scale_recipe_b,
                       schedule, split_k, device: torch.device, fmt_a=None, fmt_b=None, swizzle_a=None,
                       swizzle_b=None, *, target=None):
    """Validate a ``scaled_mm`` call: (GemmProblem, GemmOperands) for ``device``'s GPU, or with ``target`` =
    (arch, SMs) for that GPU instead (the checks need no device: CPU tensors describe a call too)."""
    arch, sms = device_info(device.index) if target is None else target
    int8 = is_int8_call(a, b)
    if int8:
        _check_int8_call(arch, a, b, scale_a, scale_b, scale_recipe_a, scale_recipe_b, swizzle_a, swizzle_b, fmt_a,
                         fmt_b)
    if arch == SM90:
        if not int8:
            _refuse_on_hopper(a, b, scale_a, scale_b, scale_recipe_a, scale_recipe_b, swizzle_a, swizzle_b, fmt_a,
                              fmt_b)
        return _describe_sm90(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum, scale_recipe_a,
                              scale_recipe_b, schedule, split_k, arch, sms, device.index)
    if arch == SM100:
        return _describe_sm100(a, b, scale_a, scale_b, bias, out_dtype, out, scale_recipe_a, scale_recipe_b, schedule,
                               split_k, fmt_a, fmt_b, swizzle_a, swizzle_b, arch, sms, device.index)
    name = arch if target is not None else f"{torch.cuda.get_device_name(device)} ({arch})"
    raise RuntimeError(f"scaled_mm has kernels for {' and '.join(map(GPU_NAMES.get, ARCHS))} GPUs; {name} is neither")


# ------------------------------------------------------------------------------------------------
# Hopper (sm_90a)
# ------------------------------------------------------------------------------------------------


def is_int8_call(a, b) -> bool:
    """Either operand is torch.int8 (a W8A8 call, checked by ``_check_int8_call``)."""
    return getattr(a, "dtype", None) == INT8.torch_dtype or getattr(b, "dtype", None) == INT8.torch_dtype


def _check_int8_call(arch, a, b, scale_a, scale_b, scale_recipe_a, scale_recipe_b, swizzle_a, swizzle_b, fmt_a,
                     fmt_b):
    """An int8 call runs on Hopper with both operands int8 and epilogue scales; anything else gets one error.
    (Scale shapes and dtypes are checked with the FP8 recipes' rules in ``_describe_sm90``.)"""
    if arch != SM90:
        raise ValueError(f"int8 operands run on Hopper (sm_90a); {runs(arch)}")
    if a.dtype != b.dtype:
        raise TypeError(f"int8 operands pair with int8 (s8 x s8 WGMMA): a is {a.dtype}, b is {b.dtype}; mixed int8 / "
                        "FP8 operands are not supported")
    if fmt_a is not None or fmt_b is not None:
        raise ValueError("fmt_a / fmt_b name the f8f6f4 formats of byte operands; torch.int8 operands take none")
    for name, s, rec, swz in (("scale_a", scale_a, scale_recipe_a, swizzle_a),
                              ("scale_b", scale_b, scale_recipe_b, swizzle_b)):
        grans = [G.named(r) for r in (rec if isinstance(rec, (list, tuple)) else [rec]) if r is not None]
        if isinstance(s, (list, tuple)) or any(g not in (G.TENSOR, G.ROW) for g in grans):
            got = "a list of scales" if isinstance(s, (list, tuple)) else ", ".join(g.scaling_type for g in grans)
            raise ValueError(f"{name}: int8 operands take {INT8_SCALES}; block scales do not apply (got {got})")
        if _swizzle_name(name, swz) == SWIZZLED:
            raise ValueError(f"swizzle_{name[-1]}: int8 operands take {INT8_SCALES}, which have no swizzled layout")


def _check_int8_scales(scale_a, scale_b, m: int, n: int, k: int) -> None:
    """The scale shapes of an int8 call (then ``scale_layouts.resolve`` can only find the tensor or row recipe) and
    its K."""
    if isinstance(scale_a, torch.Tensor) and isinstance(scale_b, torch.Tensor):
        sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
        tensor = scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dim() <= 2 and scale_b.dim() <= 2
        if not tensor and (sa, sb) != ((m, 1), (1, n)):
            raise ValueError(f"int8 operands take {INT8_SCALES}: for M={m}, N={n}, one element each or ({m}, 1) and "
                             f"(1, {n}); got {sa} and {sb} (with per-row scales for A, expand a per-tensor scale of W "
                             "to (1, N))")
    if k > INT8_MAX_K:
        raise ValueError(f"K={k}: an int8 GEMM's int32 sums are exact up to K = {INT8_MAX_K} (products of int8 values "
                         "reach 128 * 128); split K into several GEMMs")


def _refuse_on_hopper(a, b, scale_a, scale_b, scale_recipe_a, scale_recipe_b, swizzle_a, swizzle_b, fmt_a, fmt_b):
    """What only Blackwell runs (FP4 / FP6 operands, MX / NVFP4 block scales) gets one error naming what Hopper runs."""
    for name, t, fmt in (("a", a, fmt_a), ("b", b, fmt_b)):
        if fmt is not None:
            f = codecs.operand_format(name, t, fmt)
            if f not in FP8_FORMATS or t.dtype != f.torch_dtype:
                raise ValueError(f"{name}: {f.name} operands in {t.dtype} run on Blackwell (sm_100a); {runs(SM90)}")
    for name, s, rec, swz in (("scale_a", scale_a, scale_recipe_a, swizzle_a),
                              ("scale_b", scale_b, scale_recipe_b, swizzle_b)):
        if isinstance(s, (list, tuple)) or isinstance(rec, (list, tuple)):
            raise ValueError(f"{name}: lists of scales ([block scales, global scale]) are NVFP4's, which runs on "
                             f"Blackwell (sm_100a); {runs(SM90)}")
        block = R.BLOCK_SCALE_RECIPES.get(getattr(s, "dtype", None))
        if rec is not None:
            try:
                gran = G.named(rec)
            except ValueError:  # scale_layouts.resolve names the recipes it takes
                gran = None
            block = next((r for r in R.BLOCK_SCALE_RECIPES.values() if r.a is gran), block)
        if block is not None:
            raise ValueError(f"{name}: {block.a.scaling_type} ({block.name}) block scales run on Blackwell (sm_100a); "
                             f"{runs(SM90)}")
        if _swizzle_name(name, swz) == SWIZZLED:
            raise ValueError(f"{name}: SWIZZLE_32_4_4 scales are the MX / NVFP4 block scales' layout, which run on "
                             f"Blackwell (sm_100a); {runs(SM90)}")


def _describe_sm90(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum, scale_recipe_a, scale_recipe_b,
                   schedule, split_k, arch, sms, device_index):
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         f"(expected b (K={k}, N))")
    int8 = a.dtype == INT8.torch_dtype  # then b is int8 too (_check_int8_call)
    a_name = INT8.name if int8 else require_fp8("a", a)
    b_name = INT8.name if int8 else require_fp8("b", b)
    out_name = require_out_dtype(out_dtype)
    if int8:
        _check_int8_scales(scale_a, scale_b, m, n, k)
    recipe, sa, sb = scale_layouts.resolve(scale_a, scale_b, m, n, k, scale_recipe_a, scale_recipe_b)
    bias_name = check_bias(bias, n, out_dtype)
    if out is not None:
        check_out(out, m, n, out_dtype)
    # int8 sums are exact whatever use_fast_accum says: its kernels accumulate all of K in the tensor cores.
    fast = int8 or use_fast_accum and recipe in ("tensor", "row")
    problem = GemmProblem(m, n, k, a_name, b_name, out_name, bias_name, recipe, "fast" if fast else "promoted", arch,
                          sms, device_index, schedule, split_k)
    operands = GemmOperands(a, b, sa, sb, bias, out, ceil_div(k, scale_layouts.SCALE_K))
    if problem.is_empty:
        return problem, operands
    require_k_major("a", a, 1, "row-major (M, K)")
    require_k_major("b", b, 0, "column-major (K, N), i.e. w.t() of a row-major (N, K) weight")
    check_output_rows(n, out_dtype)
    check_overrides(schedule, split_k, arch)
    return problem, operands


def activation_quantization(recipe: str, weight) -> tuple[str, str]:
    """(format name, granularity label) ``quantize_scaled_mm`` quantizes its activations to for a GEMM of ``recipe``
    with weights of ``weight`` (format name or torch dtype; ``formats.activation_format``) and the recipe's activation
    scaling (per tensor, per token or 1x128 groups)."""
    return activation_format(weight).name, RECIPES[recipe].a.label


def describe_quantize_scaled_mm(x, b, scale_b, bias, out_dtype, out, scale_recipe_b, split_k, device: torch.device, *,
                                target=None):
    """Validate a ``quantize_scaled_mm`` call -- ``scaled_mm`` of x quantized to the weight's kind with the scaling
    that pairs with W's (``scale_layouts.activation_granularity``) -- for ``device``'s GPU (or ``target`` = (arch,
    SMs)): x is bf16 / fp16 / fp32 (M, K) row-major with K % 16 == 0 (the quantizers' 16-element vectors); b,
    scale_b, bias and out as ``scaled_mm`` takes them. Returns (GemmProblem with ``act_format`` set, GemmOperands
    with x as A and no A scales)."""
    arch, sms = device_info(device.index) if target is None else target
    if arch != SM90:
        raise RuntimeError(f"quantize_scaled_mm runs on Hopper (sm_90a) GPUs; this one is {arch} (call quantize_fp8 "
                           "and scaled_mm)")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D (M, K) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        raise ValueError(f"b must be a 2-D (K, N) tensor, got {getattr(b, 'shape', type(b).__name__)}")
    if x.dtype not in OUT_NAMES:
        raise TypeError(f"x must be bfloat16, float16 or float32 (what the quantizers take), got {x.dtype}")
    m, k = x.shape
    if k % 16:
        raise ValueError(f"K must be a multiple of 16 (the activation quantizer's 16-element vectors), got K={k}")
    if k:
        require_k_major("x", x, 1, "row-major (M, K)")
    gran = scale_layouts.activation_granularity(scale_b, m, b.shape[1], k, scale_recipe_b)
    # b, its scales, bias and out are checked as scaled_mm checks them, beside a stand-in for the quantized x and its
    # scales in the quantizer's layout (meta tensors: shapes and strides only).
    qa = torch.empty((m, k), dtype=activation_format(b.dtype).torch_dtype, device="meta")
    if gran is G.TENSOR:
        sa = torch.empty((), dtype=torch.float32, device="meta")
    elif gran is G.ROW:
        sa = torch.empty((m, 1), dtype=torch.float32, device="meta")
    else:
        sa = torch.empty_strided((m, ceil_div(k, scale_layouts.SCALE_K)), (1, max(m, 1)), dtype=torch.float32,
                                 device="meta")
    recipe_a = None if scale_recipe_b is None else gran
    problem, ops = _describe_sm90(qa, b, sa, scale_b, bias, out_dtype, out, False, recipe_a, scale_recipe_b, None,
                                  split_k, arch, sms, device.index)
    problem = dataclasses.replace(problem, act_format=OUT_NAMES[x.dtype])
    return problem, dataclasses.replace(ops, a=x, scale_a=None)


def check_fp8_output_columns(n: int) -> None:
    """An output quantized in 1x128 groups along its rows has whole groups: N % 128 == 0."""
    group = G.GROUP_1x128.cols
    if n % group:
        raise ValueError(f"N (b.shape[1]) must be a multiple of {group}: the output is quantized in 1x{group} groups "
                         f"along its rows; got N={n}")


def describe_scaled_mm_fp8_out(a, b, scale_a, scale_b, bias, device: torch.device, *, target=None):
    """Validate a ``scaled_mm_fp8_out`` call -- ``quantize_fp8(scaled_mm(a, b, scale_a, scale_b, bias,
    out_dtype=torch.bfloat16), "1x128")`` -- for ``device``'s GPU (or ``target`` = (arch, SMs)): N a multiple of 128
    (whole 1x128 groups along the output's rows), and ``scaled_mm``'s checks of a bf16-output call, whose
    (GemmProblem, GemmOperands) it returns."""
    if isinstance(b, torch.Tensor) and b.dim() == 2:
        check_fp8_output_columns(b.shape[1])
    return describe_scaled_mm(a, b, scale_a, scale_b, bias, torch.bfloat16, None, False, None, None, None, None, device,
                              target=target)


# ------------------------------------------------------------------------------------------------
# Blackwell (sm_100a)
# ------------------------------------------------------------------------------------------------


def _scale_granularity(name: str, s: torch.Tensor, rec):
    if rec is not None:
        return G.named(rec)
    if s.dtype == torch.float32:
        return G.TENSOR
    block = R.BLOCK_SCALE_RECIPES.get(s.dtype)
    if block is None:
        raise TypeError(f"{name} must be torch.float32 (TensorWise), torch.float8_e8m0fnu (MX, BlockWise1x32) or "
                        f"torch.float8_e4m3fn (NVFP4, BlockWise1x16); got {s.dtype}")
    return block.a


def _sm100_operand_scales(name: str, scale, recipe, swizzle, arch: str):
    """One operand's scale arguments as ``F.scaled_mm`` takes them (a tensor or a list, recipe(s), swizzle) ->
    (granularity, scales, global scale or None, SWIZZLE_32_4_4 or not)."""
    scales = list(_tensors(scale))
    recipes = list(recipe) if isinstance(recipe, (list, tuple)) else [recipe] * len(scales)
    if len(scales) != len(recipes):
        raise ValueError(f"{name}: {len(scales)} scale tensors but {len(recipes)} scaling recipes")
    if len(scales) not in (1, 2):
        raise ValueError(f"{name}: expected a scale tensor or [block scales, global scale], got {len(scales)} tensors")
    for s in scales:
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (or a list of two), got {type(s).__name__}")
    grans = [_scale_granularity(name, s, r) for s, r in zip(scales, recipes)]
    gran, s = grans[0], scales[0]
    if gran not in {RECIPES[r].a for r in ARCH_RECIPES[arch]}:
        raise ValueError(f"{name}: {gran.scaling_type} scales do not run on {arch}; {runs(arch)}")
    swizzled = _swizzle_name(name, swizzle)
    if gran is G.TENSOR:
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{name} must be a one-element torch.float32 tensor (per-tensor scale), got {s.dtype} "
                             f"with {s.numel()} elements")
        if swizzled == SWIZZLED:
            raise ValueError(f"swizzle_{name[-1]}: a per-tensor scale has no layout to swizzle")
    else:
        R.block_scale_recipe(name, s, gran.cols)
    glob = None
    if len(scales) == 2:
        if grans[1] is not G.TENSOR or gran is not G.NV_1x16:
            raise ValueError(f"{name}: per-tensor global scales belong to NVFP4 ([BlockWise1x16, TensorWise]); MX "
                             f"recipes have none; got {[g.scaling_type for g in grans]}")
        glob = scales[1]
        if glob.dtype != torch.float32 or glob.numel() != 1:
            raise TypeError(f"{name}: the global scale must be a one-element torch.float32 tensor (per-tensor decode "
                            f"scale), got {glob.dtype} with {glob.numel()} elements")
        glob = glob.reshape(1)
    return gran, s, glob, swizzled != NOT_SWIZZLED  # block scales default to SWIZZLE_32_4_4


def scale_words(name: str, blocked: torch.Tensor, rows: int, k: int, block: int) -> torch.Tensor:
    """Blocked scale bytes as the kernel's (row atoms, col atoms x 128) int32 words, base checked for TMA."""
    if blocked.data_ptr() % TMA_ALIGN:
        raise ValueError(f"{name}: blocked scales must start on a {TMA_ALIGN}-byte boundary (TMA), "
                         f"got 0x{blocked.data_ptr():x}")
    return scale_layouts.blocked_scale_words(blocked, rows, k // block)


def _blocked_scales(name: str, s: torch.Tensor, rows: int, k: int, block: int, swizzled: bool) -> torch.Tensor:
    kb = k // block
    if swizzled:
        pr, pc = scale_layouts.blocked_scale_shape(rows, kb)
        if s.numel() != pr * pc:
            raise ValueError(
                f"{name}: SWIZZLE_32_4_4 scales for {rows} rows x K={k} with {block}-element blocks need "
                f"{pr} x {pc} = {pr * pc} elements (rows padded to 128, K/{block}={kb} scale columns padded to 4); "
                f"got {s.numel()} (shape {tuple(s.shape)})"
            )
        if not s.is_contiguous():
            raise ValueError(f"{name}: blocked scales must be contiguous")
        flat = codecs.as_bytes(s).reshape(-1)
    else:
        if tuple(s.shape) != (rows, kb):
            raise ValueError(f"{name}: plain (NO_SWIZZLE) scales must have shape ({rows}, {kb}) = (rows, K/{block}); "
                             f"got {tuple(s.shape)}")
        flat = scale_layouts.to_blocked(codecs.as_bytes(s)).reshape(-1)
    return scale_words(name, flat, rows, k, block)


def _describe_sm100(a, b, scale_a, scale_b, bias, out_dtype, out, scale_recipe_a, scale_recipe_b, schedule, split_k,
                    fmt_a, fmt_b, swizzle_a, swizzle_b, arch, sms, device_index):
    fa = codecs.operand_format("a", a, fmt_a)
    fb = codecs.operand_format("b", b, fmt_b)
    gran_a, sa, glob_a, swz_a = _sm100_operand_scales("scale_a", scale_a, scale_recipe_a, swizzle_a, arch)
    gran_b, sb, glob_b, swz_b = _sm100_operand_scales("scale_b", scale_b, scale_recipe_b, swizzle_b, arch)
    if gran_a is not gran_b:
        if gran_a is not G.TENSOR and gran_b is not G.TENSOR:
            raise ValueError(f"scale_a ({sa.dtype}) and scale_b ({sb.dtype}) imply different recipes; both MX or "
                             "both NVFP4")
        raise ValueError(f"scale recipes {gran_a.scaling_type} x {gran_b.scaling_type} do not run on {arch}; "
                         f"{runs(arch)}")
    rec = recipe_of(gran_a)
    both_fp4 = fa is E2M1 and fb is E2M1
    if rec.global_scale and not both_fp4:
        raise ValueError(f"a {rec.k_block}-element scale block (NVFP4, BlockWise1x16) needs e2m1 x e2m1 operands; "
                         f"got {fa.name} x {fb.name} (MX formats use 32-element blocks, BlockWise1x32)")
    # the packed FP4 kinds read e2m1 bytes straight into shared memory: 16-byte rows, no unpacking rules
    packed = rec.k_block is not None and both_fp4
    m, k, a_bytes = operand_bytes("a", a, fa, 1, unpack=not packed)
    n, kb, b_bytes = operand_bytes("b", b, fb, 0, unpack=not packed)
    if k != kb:
        raise ValueError(f"K mismatch: a holds K={k} {fa.name} values per row, b holds K={kb} {fb.name} values per "
                         "column")
    out_name = require_out_dtype(out_dtype)
    check_output_rows(n, out_dtype)
    bias_name = check_bias(bias, n, out_dtype, any_float=True)
    if out is not None:
        check_out(out, m, n, out_dtype)
    if rec.k_block is None:
        kernel_sa, kernel_sb = scale_layouts.kernel_views(rec.name, 0, sa, sb)
    else:
        R.check_k(k, rec.k_block)
        kernel_sa = _blocked_scales("scale_a", sa, m, k, rec.k_block, swz_a)
        kernel_sb = _blocked_scales("scale_b", sb, n, k, rec.k_block, swz_b)
    check_overrides(schedule, split_k, arch)
    # tcgen05 accumulates all of K in fp32 tensor memory: the instances are "fast" whatever use_fast_accum says
    problem = GemmProblem(m, n, k, fa.name, fb.name, out_name, bias_name, rec.name, "fast", arch, sms, device_index,
                          schedule, split_k)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    operands = GemmOperands(a_bytes, b_bytes, kernel_sa, kernel_sb, bias32, out, ceil_div(k, scale_layouts.SCALE_K),
                            glob_a, glob_b)
    return problem, operands


# ------------------------------------------------------------------------------------------------
# Weight-only GEMM (ops/weight_only.py): activations x packed integer weights (numerics/int_packing.py)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightOnlyProblem:
    """What selection needs to know about a weight-only call."""

    m: int
    n: int
    k: int
    act_name: str  # "bf16" | "fp16": the activations', the dequantized weights' and the output's dtype
    weight_format: str  # "int4" | "int8"
    recipe: str  # selection.instances.WEIGHT_ONLY_RECIPES key
    arch: str
    sms: int
    device_index: Optional[int]
    split_k: Optional[int] = None  # forced K splits, or None

    @property
    def is_empty(self) -> bool:
        return self.m == 0 or self.n == 0 or self.k == 0


def _check_kernel_vector(name: str, t, shape: tuple, dtype, what: str) -> None:
    """A scale or zero-point tensor in the kernel's layout: ``shape``, ``dtype``, contiguous, 16-byte aligned."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {what}: {dtype} of shape {shape}, got {t.dtype} {tuple(t.shape)} "
                         "(numerics.int_packing.pack_weights returns it)")
    if not t.is_contiguous() or t.data_ptr() % TMA_ALIGN:
        raise ValueError(f"{name} must be contiguous with a {TMA_ALIGN}-byte aligned base address")


def describe_weight_only(x, packed_w, scales, zeros, group: int, bits: int, out, split_k, device: torch.device, *,
                         target=None) -> WeightOnlyProblem:
    """Validate a ``mm_weight_only`` call (layouts: ``numerics.int_packing``) for ``device``'s GPU, or with
    ``target`` = (arch, SMs) for that GPU instead."""
    from cutedsl_gemm.numerics import int_packing as IP
    from cutedsl_gemm.selection.instances import weight_only_recipe

    arch, sms = device_info(device.index) if target is None else target
    if arch != SM90:
        raise RuntimeError(f"the weight-only GEMM runs on Hopper (sm_90a) GPUs; this one is {arch}")
    IP.check_format(bits, group, zeros is not None)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D (M, K) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be torch.bfloat16 or torch.float16 (the weights are dequantized to it), got {x.dtype}")
    m, k = x.shape
    if k:  # (an empty K has no row layout to check)
        require_k_major("x", x, 1, "row-major (M, K)")
    if group and k % group:
        raise ValueError(f"K must be a multiple of the group size: K={k}, group={group}")
    if not isinstance(packed_w, torch.Tensor) or packed_w.dtype != torch.int32 or packed_w.dim() != 3:
        raise ValueError("packed_w must be the int32 (ceil(N / 64), ceil(K / 128), 256 * bits) tensor that "
                         "numerics.int_packing.pack_weights returns; got "
                         f"{getattr(packed_w, 'dtype', type(packed_w).__name__)} "
                         f"{tuple(getattr(packed_w, 'shape', ()))} (unpacked (N, K) weights must be packed first)")
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        raise ValueError(f"scales must be 2-D, (K / group, N) or per channel (1, N); got "
                         f"{tuple(getattr(scales, 'shape', ()))}")
    n = scales.shape[1]
    want = (ceil_div(n, IP.ATOM_ROWS), ceil_div(k, IP.ATOM_K), IP.words_per_atom(bits))
    if tuple(packed_w.shape) != want:
        other = next((b for b in IP.BITS if b != bits and packed_w.shape[2] == IP.words_per_atom(b)), None)
        hint = f" (it holds int{other} weights: pass bits={other})" if other else ""
        raise ValueError(f"packed_w must be int32 {want} for int{bits} weights of N={n} (scales' columns), K={k}; "
                         f"got {tuple(packed_w.shape)}{hint}")
    if not packed_w.is_contiguous() or packed_w.data_ptr() % TMA_ALIGN:
        raise ValueError(f"packed_w must be contiguous with a {TMA_ALIGN}-byte aligned base address")
    if n % 8:
        raise ValueError(f"N (the scales' columns) must be a multiple of 8 (TMA loads rows of N scales), got N={n}")
    if group == IP.PER_CHANNEL:
        _check_kernel_vector("scales", scales, (1, n), torch.float32, "per-channel scales")
    else:
        _check_kernel_vector("scales", scales, (k // group, n), x.dtype, "group-wise scales (K / group, N), x's dtype")
        if zeros is not None:
            _check_kernel_vector("zeros", zeros, (k // group, n), x.dtype, "zero points (K / group, N), x's dtype")
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n) or out.dtype != x.dtype:
            raise ValueError(f"out must be a ({m}, {n}) {x.dtype} tensor, got "
                             f"{tuple(getattr(out, 'shape', ()))} {getattr(out, 'dtype', type(out).__name__)}")
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous (row-major), got strides {tuple(out.stride())}")
    check_overrides(None, split_k, arch)
    return WeightOnlyProblem(m, n, k, OUT_NAMES[x.dtype], f"int{bits}", weight_only_recipe(group, zeros is not None),
                             arch, sms, device.index, split_k)

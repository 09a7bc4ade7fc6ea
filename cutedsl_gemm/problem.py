"""One description of a GEMM call and every check on its inputs. Each failure names what was expected.

``describe_scaled_mm`` turns the arguments of ``scaled_mm`` into a frozen ``GemmProblem`` (what selection
reads: sizes, formats, recipe, accumulation, device) and the tensors as the kernel takes them
(``GemmOperands``: scale views in the kernel's layouts). Nothing here chooses or launches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime.device import device_info
from cutedsl_gemm.selection.dispatch import MAX_SPLITS

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
OUT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned base addresses and row strides


def require_cuda_tensors(**tensors) -> torch.device:
    """All given tensors (None skipped) live on one CUDA device; returns it."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        d = t.device
        if device is None:
            if d.type != "cuda":
                raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {d}")
            device = d
        elif d != device:
            if d.type != "cuda":
                raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {d}")
            raise ValueError(f"all tensors must be on one device: {name} is on {d}, expected {device}")
    return device


def require_hopper(device: torch.device) -> None:
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise RuntimeError(
            f"this kernel needs a Hopper GPU (compute capability 9.0, sm_90a); {torch.cuda.get_device_name(device)} "
            f"is sm_{major}{minor}"
        )


def require_fp8(name: str, t: torch.Tensor) -> str:
    if t.dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {t.dtype}")
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


SCHEDULES = ("cooperative", "small_m")


@dataclass(frozen=True)
class GemmProblem:
    """What selection needs to know about a call: everything but the tensors' data."""

    m: int
    n: int
    k: int
    a_format: str  # "e4m3" | "e5m2"
    b_format: str
    out_name: str  # "bf16" | "fp16" | "fp32"
    bias_name: Optional[str]  # None, or the bias dtype's name
    recipe: str  # numerics.formats.RECIPES key
    accum: str  # "promoted" | "fast"
    arch: str  # "sm_90a", ...
    sms: int
    device_index: int
    schedule: Optional[str] = None  # forced schedule, or None
    split_k: Optional[int] = None  # forced K splits, or None

    @property
    def is_empty(self) -> bool:
        """M, N or K zero: nothing to launch (the output is empty, zero or the bias)."""
        return self.m == 0 or self.n == 0 or self.k == 0


@dataclass(frozen=True)
class GemmOperands:
    """The tensors of a call as the kernel reads them (``scale_a``/``scale_b``: the kernel's scale views)."""

    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    bias: Optional[torch.Tensor]
    out: Optional[torch.Tensor]  # the caller's out=, or None
    k_blocks: int  # 128-deep K blocks: the block-scaled recipes' scale views are cut to them


def check_bias(bias, n: int, out_dtype) -> Optional[str]:
    """The (N,) bias in ``out_dtype`` or fp32, contiguous; returns its dtype's name (None: no bias)."""
    if bias is None:
        return None
    if tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
    if bias.dtype not in (out_dtype, torch.float32):
        raise TypeError(f"bias must be {out_dtype} (the output dtype) or torch.float32, got {bias.dtype}")
    if bias.stride(0) != 1 and n > 1:
        raise ValueError("bias must be contiguous")
    return OUT_NAMES[bias.dtype]


def check_out(out, m: int, n: int, out_dtype) -> None:
    """A caller's out=: (M, N) of ``out_dtype``, row-major with 16-byte aligned rows and base (TMA store)."""
    if tuple(out.shape) != (m, n) or out.dtype != out_dtype:
        raise ValueError(f"out must be a ({m}, {n}) {out_dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if n > 1 and out.stride(1) != 1 or m > 1 and (out.stride(0) * out.element_size()) % TMA_ALIGN:
        raise ValueError(f"out must be row-major with 16-byte aligned rows, got strides {tuple(out.stride())}")
    if out.data_ptr() % TMA_ALIGN:
        raise ValueError("out must have a 16-byte aligned base address (TMA store)")


def check_overrides(schedule, split_k) -> None:
    """``schedule`` and ``split_k`` as scaled_mm takes them (whether the instance can split is selection's)."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be None, 'cooperative' or 'small_m', got {schedule!r}")
    if split_k is not None and (not isinstance(split_k, int) or not 1 <= split_k <= MAX_SPLITS):
        raise ValueError(f"split_k must be an int in 1..{MAX_SPLITS}, got {split_k!r}")


def describe_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum, scale_recipe_a, scale_recipe_b,
                       schedule, split_k, device: torch.device):
    """Validate a Hopper ``scaled_mm`` call on ``device``: (GemmProblem, GemmOperands)."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (expected b (K={k}, N))")
    a_name = require_fp8("a", a)
    b_name = require_fp8("b", b)
    out_name = require_out_dtype(out_dtype)
    recipe, sa, sb = scale_layouts.resolve(scale_a, scale_b, m, n, k, scale_recipe_a, scale_recipe_b)
    bias_name = check_bias(bias, n, out_dtype)
    if out is not None:
        check_out(out, m, n, out_dtype)
    arch, sms = device_info(device.index)
    problem = GemmProblem(m, n, k, a_name, b_name, out_name, bias_name, recipe,
                          "fast" if use_fast_accum and recipe in ("tensor", "row") else "promoted", arch, sms,
                          device.index, schedule, split_k)
    operands = GemmOperands(a, b, sa, sb, bias, out, -(-k // scale_layouts.SCALE_K))
    if problem.is_empty:
        return problem, operands
    require_k_major("a", a, 1, "row-major (M, K)")
    require_k_major("b", b, 0, "column-major (K, N), i.e. w.t() of a row-major (N, K) weight")
    out_size = torch.empty((), dtype=out_dtype).element_size()
    if (n * out_size) % TMA_ALIGN:
        raise ValueError(f"N={n}: the TMA store needs output rows of a multiple of 16 bytes "
                         f"(N % {TMA_ALIGN // out_size} == 0)")
    if not arch.startswith("sm_90"):
        require_hopper(device)
    check_overrides(schedule, split_k)
    return problem, operands

"""Host entry for the Blackwell (sm_100a) f8f6f4 GEMM: validation, compile key, launch, reference.

``sm100_f8f6f4_mm(a, b, fmt_a=..., fmt_b=..., scale_a=..., scale_b=...)`` computes
``(scale_a * scale_b) * decode(a) @ decode(b) (+ bias)`` with ``a`` (M, K) and ``b`` (K, N) in
torch._scaled_mm's convention: ``b`` is column-major, i.e. ``b = w.t()`` for a row-major (N, K) ``w``.

Operand storage (K is always the contiguous dimension):

=========  ===================================================  =======================================
format     accepted torch storage                               per row of K elements
=========  ===================================================  =======================================
e4m3       ``float8_e4m3fn`` (or its ``uint8`` bytes)           K bytes
e5m2       ``float8_e5m2`` (or ``uint8``)                       K bytes
e2m1       ``float4_e2m1fn_x2`` or ``uint8``, 2 per byte        K / 2 bytes (low nibble first)
e2m3/e3m2  ``uint8``, packed 6-bit, 4 values in 3 bytes         3K / 4 bytes (see ``fp_packing``)
=========  ===================================================  =======================================

The kernel is compiled once per (output dtype, bias or not, 1-/2-CTA, tile N): the operand formats are
run-time arguments, so every one of the 25 type pairs reuses one compilation. It is built for sm_100
GPUs; without one this module still validates, compiles (``CUTE_DSL_ARCH=sm_100a``) and computes the
reference, and ``sm100_f8f6f4_mm`` raises a clear error.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from cutedsl_gemm.numerics import fp_packing
from cutedsl_gemm.numerics.formats import E2M1, E4M3, E5M2, F8F6F4_FORMATS, ElementFormat, element_format
from cutedsl_gemm.runtime.jit import KERNEL_CACHE

#: tcgen05 kind::f8f6f4 instruction-descriptor format codes (written into the descriptor at run time).
MMA_FORMAT_CODE = {"e4m3": 0, "e5m2": 1, "e2m3": 3, "e3m2": 4, "e2m1": 5}
#: Which TMA descriptor (storage class) loads each format, and the tensor-map data type it requests.
STORAGE_CLASS = {"e4m3": 0, "e5m2": 0, "e2m3": 1, "e3m2": 1, "e2m1": 2}
TMA_DATA_TYPE = {
    "e4m3": "U8",  # CU_TENSOR_MAP_DATA_TYPE_UINT8
    "e5m2": "U8",
    "e2m3": "U6_UNPACK_U8",  # CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B (.b6x16_p32)
    "e3m2": "U6_UNPACK_U8",
    "e2m1": "U4_UNPACK_U8",  # CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B (.b4x16_p64)
}
OUT_DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}
TILE_K = 128
#: TMA unpacking (.b4x16_p64 / .b6x16_p32) constraints, enforced for the sub-byte formats.
SUBBYTE_BASE_ALIGN = 32
SUBBYTE_K_MULTIPLE = 128
BYTE_BASE_ALIGN = 16
BYTE_K_MULTIPLE = 16
SUPPORTED_SWIZZLES = ("128B", "none")  # what TMA unpacking allows; this kernel uses 128B


@dataclass(frozen=True)
class Sm100Config:
    """Everything that selects a compiled kernel. Operand formats are deliberately absent."""

    out_dtype: str = "BFloat16"
    has_bias: bool = False
    use_2cta: bool = False
    tile_n: int = 128
    swizzle: str = "128B"

    def __post_init__(self):
        if self.out_dtype not in OUT_DTYPES.values():
            raise ValueError(f"out_dtype must be one of {sorted(OUT_DTYPES.values())}, got {self.out_dtype!r}")
        if self.tile_n not in (64, 128, 256) or (self.use_2cta and self.tile_n < 128):
            raise ValueError(f"tile_n must be 64, 128 or 256 (at least 128 with 2-CTA), got {self.tile_n}")
        if self.swizzle not in SUPPORTED_SWIZZLES:
            raise ValueError(
                f"TMA unpacking of FP4/FP6 supports only 128-byte swizzle or none; got {self.swizzle!r}"
            )
        if self.swizzle != "128B":
            raise ValueError("this kernel's shared-memory layout is 128-byte swizzled; swizzle='none' is not built")

    def key(self):
        return ("sm100_f8f6f4", self.out_dtype, self.has_bias, self.use_2cta, self.tile_n, self.swizzle)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)


def _storage_dtypes(fmt: ElementFormat):
    if fmt in (E4M3, E5M2):
        return (fmt.torch_dtype, torch.uint8)
    if fmt is E2M1:
        return tuple(d for d in (_FP4X2, torch.uint8) if d is not None)
    return (torch.uint8,)


def resolve_format(name: str, t: torch.Tensor, fmt) -> ElementFormat:
    """Operand format from ``fmt`` or, when None, from a torch dtype that says it unambiguously."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if fmt is None:
        by_dtype = {E4M3.torch_dtype: E4M3, E5M2.torch_dtype: E5M2}
        if _FP4X2 is not None:
            by_dtype[_FP4X2] = E2M1
        if t.dtype not in by_dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype}, which does not name an f8f6f4 format; pass fmt_{name[0]}= one of "
                "'e4m3', 'e5m2', 'e3m2', 'e2m3', 'e2m1' (packed FP6/FP4 live in uint8)"
            )
        return by_dtype[t.dtype]
    f = element_format(fmt)
    if f not in F8F6F4_FORMATS:
        raise ValueError(f"fmt for {name} must be one of e4m3, e5m2, e3m2, e2m3, e2m1; got {f.name}")
    if t.dtype not in _storage_dtypes(f):
        allowed = ", ".join(str(d) for d in _storage_dtypes(f))
        raise TypeError(f"{name} in format {f.name} must be stored as {allowed}; got {t.dtype}")
    return f


def operand_bytes(name: str, t: torch.Tensor, fmt: ElementFormat, k_dim: int, *, unpack: bool = True):
    """Check one operand against the TMA rules and return (rows, K, (rows, row_bytes) uint8 view).

    ``k_dim`` is the tensor dimension that holds K (1 for A (M, K); 0 for b (K, N)). ``unpack=False``
    is for packed FP4 that stays packed in shared memory (block-scaled kinds mxf4 / mxf4nvf4): its bytes
    are loaded like 8-bit data, so only the 16-byte row and base rules apply.
    """
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.stride(k_dim) != 1:
        layout = "row-major (M, K)" if k_dim == 1 else "column-major (K, N), i.e. w.t() of a row-major (N, K) w"
        raise ValueError(f"{name} must be K-contiguous ({layout}); got strides {tuple(t.stride())}")
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    rows = raw.size(1 - k_dim)
    row_bytes = raw.size(k_dim)
    k = fp_packing.logical_k(row_bytes, fmt)
    unpacked = fmt.bits < 8 and unpack
    if not unpacked:
        base_align, k_mult = BYTE_BASE_ALIGN, BYTE_K_MULTIPLE * 8 // fmt.bits
    else:
        base_align, k_mult = SUBBYTE_BASE_ALIGN, SUBBYTE_K_MULTIPLE
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
    view = raw if k_dim == 1 else raw.t()
    return rows, k, view


def operand_pair(a, b, fmt_a: ElementFormat, fmt_b: ElementFormat, *, unpack: bool = True):
    """Both operands checked (see :func:`operand_bytes`): (M, N, K, A bytes (M, .), B bytes (N, .))."""
    m, ka, a_bytes = operand_bytes("a", a, fmt_a, 1, unpack=unpack)
    n, kb, b_bytes = operand_bytes("b", b, fmt_b, 0, unpack=unpack)
    if ka != kb:
        raise ValueError(f"K mismatch: a holds K={ka} {fmt_a.name} values per row, b holds K={kb} {fmt_b.name} values per column")
    return m, n, ka, a_bytes, b_bytes


def check_output(n: int, out_dtype, bias) -> None:
    """Output dtype, the TMA store's 16-byte rows, and the optional (N,) bias."""
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


def default_use_2cta(m: int, tile_n: int, use_2cta: Optional[bool]) -> bool:
    """2-CTA (256-row MMA) when M spans more than one 128-row tile, unless the caller chose."""
    return bool(m > 128 and tile_n >= 128) if use_2cta is None else bool(use_2cta)


@dataclass
class Problem:
    m: int
    n: int
    k: int
    fmt_a: ElementFormat
    fmt_b: ElementFormat
    a: torch.Tensor  # (M, row_bytes) uint8
    b: torch.Tensor  # (N, row_bytes) uint8
    config: Sm100Config


def prepare(a, b, *, fmt_a=None, fmt_b=None, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16,
            use_2cta: Optional[bool] = None, tile_n: int = 128) -> Problem:
    """All device-independent checks; returns the byte views and the compile configuration."""
    fa = resolve_format("a", a, fmt_a)
    fb = resolve_format("b", b, fmt_b)
    m, n, k, a_bytes, b_bytes = operand_pair(a, b, fa, fb)
    check_output(n, out_dtype, bias)
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor holding one float32 (per-tensor scale), got {type(s).__name__}")
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{name} must be a one-element torch.float32 tensor (per-tensor scale), got {s.dtype} with {s.numel()} elements")
    cfg = Sm100Config(OUT_DTYPES[out_dtype], bias is not None, default_use_2cta(m, tile_n, use_2cta), tile_n)
    return Problem(m, n, k, fa, fb, a_bytes, b_bytes, cfg)


# ------------------------------------------------------------------------------------------------
# Compilation
# ------------------------------------------------------------------------------------------------


def fake_args(cfg: Sm100Config):
    """Shape-symbolic arguments: one compilation serves every M, N, K and every operand format."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    def operand(div, align):
        shape = (cute.sym_int(), cute.sym_int(divisibility=div))
        return make_fake_compact_tensor(cutlass.Uint8, shape, stride_order=(1, 0), assumed_align=align)

    # Row-byte divisibility of each storage view: 16 (8-bit), 96 (128 x 6 bit), 64 (128 x 4 bit); base
    # alignment as validated by operand_bytes (16 bytes for 8-bit, 32 for TMA unpacking).
    def views():
        return [operand(16, BYTE_BASE_ALIGN), operand(96, SUBBYTE_BASE_ALIGN), operand(64, SUBBYTE_BASE_ALIGN)]

    views_a, views_b = views(), views()
    out_t = getattr(cutlass, cfg.out_dtype)
    c = make_fake_compact_tensor(
        out_t, (cute.sym_int(), cute.sym_int(divisibility=128 // out_t.width)), stride_order=(1, 0), assumed_align=16
    )
    sa = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    sb = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    i32 = cutlass.Int32
    return (*views_a, *views_b, c, sa, sb, bias, i32(0), i32(0), i32(0), i32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def build(cfg: Sm100Config, ptx_dir: Optional[str] = None):
    """``cute.compile`` one configuration; with ``ptx_dir`` the PTX is kept (``result.__ptx__``)."""
    import cutlass
    import cutlass.cute as cute

    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import Sm100F8F6F4Gemm

    kernel = Sm100F8F6F4Gemm(getattr(cutlass, cfg.out_dtype), cfg.use_2cta, cfg.tile_n, cfg.has_bias)
    options = "--enable-tvm-ffi"
    if ptx_dir is not None:
        os.makedirs(ptx_dir, exist_ok=True)  # the DSL keeps no PTX text for a dump dir that does not exist
        options += f" --keep-ptx --dump-dir={ptx_dir}"
    return cute.compile(kernel, *fake_args(cfg), options=options)


def compiled_kernel(cfg: Sm100Config, *, arch: Optional[str] = None, ptx_dir: Optional[str] = None):
    """The compiled kernel for ``cfg`` from the process / disk cache (compiling at most once)."""
    return KERNEL_CACHE.get(cfg.key(), lambda: build(cfg, ptx_dir), arch=arch)


# ------------------------------------------------------------------------------------------------
# Launch
# ------------------------------------------------------------------------------------------------


def require_sm100(*tensors: torch.Tensor, entry: str = "sm100_f8f6f4_mm", reference: str = "reference_f8f6f4") -> torch.device:
    devs = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if any(d.type != "cuda" for d in devs):
        raise RuntimeError(
            f"{entry} runs on an NVIDIA Blackwell GPU (sm_100, e.g. B200) and needs CUDA tensors; "
            f"got tensors on {sorted(str(d) for d in devs)}. Use {reference} for a CPU result."
        )
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one CUDA device, got {sorted(str(d) for d in devs)}")
    dev = devs.pop()
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 10:
        raise RuntimeError(
            f"{entry} needs a Blackwell GPU with compute capability 10.x (sm_100a); "
            f"{torch.cuda.get_device_name(dev)} is sm_{major}{minor}"
        )
    return dev


@functools.lru_cache(maxsize=None)
def _dummies(index: int):
    """Stand-ins for the two unused storage views of each operand: valid, aligned, never read."""
    dev = torch.device("cuda", index)
    buf = torch.zeros(128 * 128 + 256, dtype=torch.uint8, device=dev)
    off = (-buf.data_ptr()) % 256
    flat = buf[off: off + 128 * 128]
    views = [flat.view(128, 128), flat[: 128 * 96].view(128, 96), flat[: 128 * 64].view(128, 64)]
    return views, torch.zeros(1, dtype=torch.float32, device=dev)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_operands(dev: torch.device, a_bytes, storage_a: int, b_bytes, storage_b: int):
    """The six operand views a launch passes: each operand in its storage class, dummies elsewhere."""
    views, _ = _dummies(dev.index)
    a_args = list(views)
    b_args = list(views)
    a_args[storage_a] = a_bytes
    b_args[storage_b] = b_bytes
    return a_args, b_args


def max_clusters(dev: torch.device, use_2cta: bool) -> int:
    return _num_sms(dev.index) // (2 if use_2cta else 1)


def sm100_f8f6f4_mm(a, b, *, fmt_a=None, fmt_b=None, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16,
                    use_2cta: Optional[bool] = None, tile_n: int = 128) -> torch.Tensor:
    """``(scale_a * scale_b) * (A @ B) (+ bias)`` for A, B in any of E4M3/E5M2/E3M2/E2M3/E2M1."""
    p = prepare(a, b, fmt_a=fmt_a, fmt_b=fmt_b, scale_a=scale_a, scale_b=scale_b, bias=bias,
                out_dtype=out_dtype, use_2cta=use_2cta, tile_n=tile_n)
    dev = require_sm100(a, b, scale_a, scale_b, *(t for t in (bias,) if t is not None))
    if p.m == 0 or p.n == 0 or p.k == 0:  # no launch: the kernel's accumulator is only defined for K > 0
        return empty_product(p.m, p.n, bias, out_dtype, dev)
    fn = compiled_kernel(p.config)
    a_args, b_args = launch_operands(dev, p.a, STORAGE_CLASS[p.fmt_a.name], p.b, STORAGE_CLASS[p.fmt_b.name])
    out = torch.empty(p.m, p.n, dtype=out_dtype, device=dev)
    fn(*a_args, *b_args, out, scale_a.reshape(1), scale_b.reshape(1), bias_argument(dev, bias), p.k,
       MMA_FORMAT_CODE[p.fmt_a.name], MMA_FORMAT_CODE[p.fmt_b.name], max_clusters(dev, p.config.use_2cta))
    return out


def empty_product(m: int, n: int, bias, out_dtype, dev: torch.device) -> torch.Tensor:
    """The result of a GEMM with M, N or K zero: (M, N) zeros, plus the bias."""
    out = torch.zeros(m, n, dtype=torch.float32, device=dev)
    if bias is not None:
        out += bias.to(device=dev, dtype=torch.float32)
    return out.to(out_dtype)


def bias_argument(dev: torch.device, bias) -> torch.Tensor:
    """fp32 contiguous bias, or a one-element dummy the kernel never reads (has_bias=False)."""
    return _dummies(dev.index)[1] if bias is None else bias.to(torch.float32).contiguous()


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def reference_f8f6f4(a, b, *, fmt_a=None, fmt_b=None, scale_a, scale_b, bias=None) -> torch.Tensor:
    """float64 ``scale_a * scale_b * decode(a) @ decode(b) (+ bias)`` on any device (the GPU tests' oracle)."""
    fa = resolve_format("a", a, fmt_a)
    fb = resolve_format("b", b, fmt_b)
    av = fp_packing.decode_operand(a, fa).double()  # (M, K)
    bv = fp_packing.decode_operand(b.t(), fb).double().t()  # decode along K, then back to (K, N)
    if av.shape[1] != bv.shape[0]:
        raise ValueError(f"K mismatch: a has K={av.shape[1]}, b has K={bv.shape[0]}")
    out = (av @ bv) * (float(scale_a.reshape(-1)[0]) * float(scale_b.reshape(-1)[0]))
    if bias is not None:
        out = out + bias.double()
    return out

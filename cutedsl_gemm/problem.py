"""Input checks shared by the public entry points. Every failure names what was expected."""

from __future__ import annotations

import torch

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

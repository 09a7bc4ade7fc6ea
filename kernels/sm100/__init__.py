"""Blackwell (sm_100a) kernels."""

from .f8f6f4_gemm import MMA_FORMAT_CODE, Sm100F8F6F4Gemm, describe_tma_loads

__all__ = ["MMA_FORMAT_CODE", "Sm100F8F6F4Gemm", "describe_tma_loads"]

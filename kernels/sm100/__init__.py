"""Blackwell (sm_100a) kernels: the tcgen05 f8f6f4 GEMM (dense, and block-scaled through the hooks in
``blockscaled_gemm``) and the MX / NVFP4 quantizers (``quantize_mx``)."""

from .blockscaled_gemm import KINDS as BLOCK_SCALED_KINDS
from .blockscaled_gemm import BlockScaling, ScaleGeometry
from .f8f6f4_gemm import MMA_FORMAT_CODE, Sm100F8F6F4Gemm, describe_resources, describe_tma_loads

__all__ = [
    "BLOCK_SCALED_KINDS",
    "BlockScaling",
    "MMA_FORMAT_CODE",
    "ScaleGeometry",
    "Sm100F8F6F4Gemm",
    "describe_resources",
    "describe_tma_loads",
]

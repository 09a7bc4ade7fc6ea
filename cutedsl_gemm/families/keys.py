"""The names a kernel family is keyed by: the archs and the ops of the instance table's rows.

The registry (``families/registry.py``) maps each (arch, op) to its family; the table
(``selection/instances.py``, which re-exports these names), dispatch and the launch code (``runtime/launch.py``)
read them from here, so that none of them imports a layer above it for a name. Imports nothing.
"""

SM90 = "sm_90a"
SM100 = "sm_100a"
#: The op of the weight-only GEMMs (bf16 / fp16 activations x packed integer weights); the others are "gemm".
WEIGHT_ONLY = "weight_only"
#: The op of the FP8 GEMMs that quantize their bf16 / fp16 activations themselves (1x128 groups, in the decode
#: schedule): ``quantize_scaled_mm``'s one-kernel path. a_dtype is the activations' dtype.
QUANT_GEMM = "quant_gemm"
#: The op of the GEMMs whose epilogue emits the output as e4m3 with 1x128 group scales (``scaled_mm_fp8_out``): twins of
#: unswapped "gemm" rows. out_dtype is the rounding before quantization (bf16).
GEMM_FP8_OUT = "gemm_fp8_out"
#: The op of the grouped FP8 GEMMs of mixture-of-experts layers (``grouped_scaled_mm``, kernels/sm90/grouped_gemm.py):
#: their ``schedule`` is the grouped layout, "contiguous" or "masked".
GROUPED_GEMM = "grouped_gemm"
#: The ops whose rows the Hopper FP8 / INT8 GEMM class (kernels/sm90/fp8_gemm.py) builds.
SM90_GEMM_OPS = ("gemm", QUANT_GEMM, GEMM_FP8_OUT)

"""Tracing the Hopper kernels: fake (shape-symbolic) arguments and cute.compile for one configuration."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cutedsl_gemm.kernels.sm90.block_scales import BLOCK_RECIPES
from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm, Sm90GemmConfig, cutlass_dtype

COMPILE_OPTIONS = "--enable-tvm-ffi"


def fake_gemm_args(cfg: Sm90GemmConfig):
    """Fake tensors with symbolic M, N, K so one compilation serves every shape.

    K and N carry the divisibility TMA needs (16-byte aligned rows) so the kernel may assume it; the host
    validates it before every call.
    """
    m = cute.sym_int()
    n = cute.sym_int(divisibility=16)
    k = cute.sym_int(divisibility=16)
    a = make_fake_compact_tensor(cutlass_dtype(cfg.a_dtype), (m, k), stride_order=(1, 0), assumed_align=16)
    # b follows torch._scaled_mm: (K, N) column-major (the transpose of a row-major (N, K) weight).
    b = make_fake_compact_tensor(cutlass_dtype(cfg.b_dtype), (k, n), stride_order=(0, 1), assumed_align=16)
    d = make_fake_compact_tensor(cutlass_dtype(cfg.out_dtype), (m, n), stride_order=(1, 0), assumed_align=16)
    if cfg.recipe == "tensor":
        sa = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
        sb = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    elif cfg.recipe == "row":
        sa = make_fake_compact_tensor(cutlass.Float32, (m, 1), stride_order=(1, 0), assumed_align=4)
        sb = make_fake_compact_tensor(cutlass.Float32, (1, n), stride_order=(1, 0), assumed_align=4)
    elif cfg.recipe in BLOCK_RECIPES:
        # (rows or row blocks, Kb) with run-time strides: torch's outer-dim-major and padded layouts and
        # plain row-major ones are all read in place. W's scales come transposed to (N or N blocks, Kb).
        kb = cute.sym_int()
        gran_a, gran_b = BLOCK_RECIPES[cfg.recipe]
        sa = make_fake_tensor(cutlass.Float32, (m if gran_a == "group" else cute.sym_int(), kb),
                              (cute.sym_int(), cute.sym_int()), assumed_align=4)
        sb = make_fake_tensor(cutlass.Float32, (n if gran_b == "group" else cute.sym_int(), kb),
                              (cute.sym_int(), cute.sym_int()), assumed_align=4)
    else:
        raise ValueError(f"unknown recipe {cfg.recipe!r}")
    if cfg.bias_dtype:
        bias = make_fake_compact_tensor(cutlass_dtype(cfg.bias_dtype), (n,), assumed_align=4)
    else:
        bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    # Split-K workspace (fp32 partials) and per-tile counters: dummies of any size where unused.
    workspace = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=16)
    counters = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    return (a, b, d, sa, sb, bias, workspace, counters, cutlass.Int32(1), cutlass.Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_gemm(cfg: Sm90GemmConfig, arch: str = "sm_90a"):
    """cute.compile for ``arch`` (the target goes in the options, so no GPU and no env var are needed)."""
    kernel = Sm90Fp8Gemm(cfg)
    return cute.compile(kernel, *fake_gemm_args(cfg), options=f"{COMPILE_OPTIONS} --gpu-arch {arch}")


def compile_instance(inst):
    """``cute.compile`` the kernel of an instance of the table for its arch: the one compile path that the JIT
    cache, precompile, export and the catalog share."""
    if (inst.arch, inst.op) == ("sm_90a", "gemm"):
        return compile_gemm(inst.sm90_config(), inst.arch)
    raise ValueError(f"no compile path for {inst.name} (arch={inst.arch}, op={inst.op})")

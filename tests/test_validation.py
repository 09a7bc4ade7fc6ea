"""Bad input gets a clear error (CPU: the checks themselves; GPU tier: through scaled_mm)."""

import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm.ops import scaled_mm as api
from cutedsl_gemm import problem as V


def fp8(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def test_cpu_tensors_are_rejected_with_device_named():
    one = torch.ones(())
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        cutedsl_gemm.scaled_mm(fp8(4, 32), fp8(16, 32).t(), one, one)


def test_dtype_checks():
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2"):
        V.require_fp8("a", torch.randn(4, 4))
    with pytest.raises(TypeError, match="out_dtype must be"):
        V.require_out_dtype(torch.int8)


def test_k_major_and_tma_alignment_checks():
    with pytest.raises(ValueError, match="must be K-major"):
        V.require_k_major("a", fp8(32, 64).t(), 1, "row-major (M, K)")
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        V.require_k_major("a", fp8(8, 40), 1, "row-major (M, K)")
    base = fp8(8, 80)
    with pytest.raises(ValueError, match="16-byte aligned base address"):
        V.require_k_major("a", base[:, 1:65], 1, "row-major (M, K)")
    with pytest.raises(ValueError, match="packed rows .* row stride 80 != K=64"):
        V.require_k_major("a", base[:, :64], 1, "row-major (M, K)")  # aligned, but rows padded to 80
    V.require_k_major("b", fp8(64, 32).t(), 0, "column-major")  # the torch._scaled_mm layout passes


@pytest.mark.gpu
def test_gpu_bad_inputs():
    dev = "cuda"
    a = torch.randn(64, 256, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(128, 256, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        cutedsl_gemm.scaled_mm(a, w[:, :128].t(), one, one)
    with pytest.raises(ValueError, match="must be K-major"):
        cutedsl_gemm.scaled_mm(a, w.t().contiguous(), one, one)
    with pytest.raises(TypeError, match="float8"):
        cutedsl_gemm.scaled_mm(a.float(), w.t(), one, one)
    with pytest.raises(ValueError, match="on one device|must be a CUDA tensor"):
        cutedsl_gemm.scaled_mm(a, w.t(), torch.ones(()), one)
    with pytest.raises(ValueError, match="bias must have shape"):
        cutedsl_gemm.scaled_mm(a, w.t(), one, one, bias=torch.ones(3, device=dev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        cutedsl_gemm.scaled_mm(a, w.t(), one, one, out=torch.empty(64, 64, device=dev, dtype=torch.bfloat16))
    a2 = torch.randn(64, 264, device=dev).to(torch.float8_e4m3fn)[:, :260]
    w2 = torch.randn(128, 260, device=dev).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16"):
        cutedsl_gemm.scaled_mm(a2, w2.t(), one, one)

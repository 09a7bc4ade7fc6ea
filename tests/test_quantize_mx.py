"""quantize_mx / quantize_nvfp4 host side (ops/quantize.py), on the CPU: backends, checks, the kernel's
compile arguments and layering. The kernels' bit-exactness against the reference runs on a GPU
(tests/test_sm100_blockscaled.py)."""

import ast
import os
from pathlib import Path

import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops import quantize as Q

KERNELS = Path(cutedsl_gemm.kernels.__file__).resolve().parent


def _same(a: R.BlockScaledTensor, b: R.BlockScaledTensor) -> bool:
    same_g = (a.global_scale is None) == (b.global_scale is None) and (
        a.global_scale is None or torch.equal(a.global_scale, b.global_scale))
    return (a.data.dtype == b.data.dtype and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and a.scales.dtype == b.scales.dtype
            and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)) and same_g)


def test_one_quantize_family_at_top_level():
    for name in ("quantize_fp8", "quantize_mx", "quantize_nvfp4"):
        assert getattr(cutedsl_gemm, name) is getattr(Q, name)
        assert name in cutedsl_gemm.__all__


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_cpu_backends_are_the_reference(dtype):
    x = torch.randn(33, 64).to(dtype)
    for backend in ("auto", "reference"):
        assert _same(Q.quantize_mx(x, "e3m2", backend=backend), R.quantize_mx_reference(x, "e3m2"))
        assert _same(Q.quantize_nvfp4(x, backend=backend), R.quantize_nvfp4_reference(x))
    g = torch.tensor(0.25)
    assert _same(Q.quantize_nvfp4(x, g), R.quantize_nvfp4_reference(x, g))


def test_backend_and_input_checks():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        Q.quantize_mx(x, backend="kernel")
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        Q.quantize_nvfp4(x, backend="kernel")
    with pytest.raises(ValueError, match="backend must be 'auto', 'kernel' or 'reference'"):
        Q.quantize_mx(x, backend="cuda")
    with pytest.raises(ValueError, match="multiple of the scale block 32"):
        Q.quantize_mx(torch.zeros(4, 48), backend="kernel")
    with pytest.raises(TypeError, match="bfloat16/float16/float32"):
        Q.quantize_nvfp4(torch.zeros(4, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="MX element format"):
        Q.quantize_mx(x, "ue8m0")
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        Q.compile_quantizer("mx", "e4m3", torch.float16)


@pytest.mark.compile
def test_compile_keeps_ptx_without_writing_files(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.chdir(tmp_path)
    ptx = Q.compile_quantizer("nvfp4", "e2m1", torch.bfloat16, True, keep_ptx=True, arch="sm_100a").__ptx__
    assert ".target sm_100a" in ptx and "atom.global.max.u32" in ptx
    assert list(tmp_path.iterdir()) == []  # nothing dumped into the working directory


@pytest.mark.parametrize("path", ["sm100/quantize_mx.py", "sm90/quantize_fp8.py"])
def test_quantizer_kernels_are_device_code_only(path):
    """No torch and no host module: the host passes every format fact in as plain numbers."""
    tree = ast.parse((KERNELS / path).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    bad = sorted(m for m in imported if m.split(".")[0] in ("torch", "cutedsl_gemm"))
    assert not bad, f"{os.path.join('kernels', path)} imports {bad}"

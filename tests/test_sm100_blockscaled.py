"""Block-scaled GEMM family: quantizer kernels, host validation, compile-only PTX checks, Blackwell runs.

Tiers: plain tests (CPU), ``compile`` tests (build for sm_100a without a GPU and inspect PTX),
``cuda`` quantizer tests (the quantizer kernels use no sm_100-only instruction, so any CUDA GPU runs
them, compiled for its own arch) and ``blackwell`` GEMM tests (need an sm_100 device).
"""

import os
import re

import pytest
import torch

from cutedsl_gemm import microscaling as ms
from cutedsl_gemm.formats import E2M1, E2M3, E3M2, E4M3, E5M2

MX_FMTS = (E4M3, E5M2, E3M2, E2M3, E2M1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _special_input(rows, k, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (rows, k // 16), generator=g).float()).repeat_interleave(16, 1)
    x = torch.randn(rows, k, generator=g) * scale
    x[0, :16] = 0.0
    if rows > 2 and k >= 64:
        x[1, 3] = float("inf")
        x[1, 40] = -float("inf")
        x[2, 17] = float("nan")
        x[2, 50] = 1e-40  # fp32 subnormal
        x[2, 51] = -0.0
    return x.to(dtype).to(device)


# ---------------------------------------------------------------- quantizer kernels (any CUDA GPU)


@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("fmt", MX_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows,k", [(1, 32), (130, 96), (257, 512)])
def test_quantize_mx_kernel_bit_exact(fmt, dtype, rows, k):
    from cutedsl_gemm.kernels.sm100.quantize_mx import quantize_mx

    x = _special_input(rows, k, dtype, rows + k, "cuda")
    got = quantize_mx(x, fmt)
    ref = ms.quantize_mx_reference(x.cpu(), fmt)
    assert got.data.dtype == ref.data.dtype and got.scales.dtype == ref.scales.dtype
    assert torch.equal(ms._as_bytes(got.data).cpu(), ms._as_bytes(ref.data))
    assert torch.equal(got.scales.view(torch.uint8).cpu(), ref.scales.view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("given", (False, True))
@pytest.mark.parametrize("rows,k", [(1, 16), (130, 80), (257, 512)])
def test_quantize_nvfp4_kernel_bit_exact(dtype, given, rows, k):
    from cutedsl_gemm.kernels.sm100.quantize_mx import quantize_nvfp4

    x = _special_input(rows, k, dtype, rows * k, "cuda")
    gs = torch.tensor(0.37, device="cuda") if given else None
    got = quantize_nvfp4(x, gs)
    ref = ms.quantize_nvfp4_reference(x.cpu(), None if gs is None else gs.cpu())
    assert got.global_scale.item() == ref.global_scale.item()
    assert torch.equal(got.data.view(torch.uint8).cpu(), ref.data.view(torch.uint8))
    assert torch.equal(got.scales.view(torch.uint8).cpu(), ref.scales.view(torch.uint8))


# ---------------------------------------------------------------- quantizer compile checks (CPU)


@pytest.fixture(scope="module")
def sm100_env():
    old = {k: os.environ.get(k) for k in ("CUTE_DSL_ARCH",)}
    os.environ["CUTE_DSL_ARCH"] = "sm_100a"
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.compile
@pytest.mark.parametrize(
    "recipe,fmt,dtype,cg",
    [("mx", f, torch.bfloat16, False) for f in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")]
    + [("mx", "e4m3", torch.float32, False), ("nvfp4", "e2m1", torch.bfloat16, True), ("nvfp4", "e2m1", torch.float32, False)],
)
def test_quantizer_compiles_for_sm100(sm100_env, recipe, fmt, dtype, cg):
    from cutedsl_gemm.kernels.sm100.quantize_mx import compile_quantizer

    ptx = compile_quantizer(recipe, fmt, dtype, cg, keep_ptx=True).__ptx__
    assert ptx and ".target sm_100a" in ptx
    # vectorised global loads of the input block, no approximate division anywhere
    assert re.search(r"ld\.global(\.\w+)*\.v[24]\.b(32|64)", ptx)
    assert "div.approx" not in ptx and "div.full" not in ptx and ".ftz" not in ptx
    if recipe == "nvfp4":
        assert "div.rn.f32" in ptx and "rcp.rn.f32" in ptx
        assert ("atom.global.max.u32" in ptx) == cg  # device-side tensor amax only when computing g

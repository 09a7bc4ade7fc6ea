"""FP8 quantization: reference numerics (CPU), compile-only sm_90a PTX checks, GPU kernel == reference.

CPU tests check ``quantize_fp8(backend="reference")`` against an independent per-group loop written here
(numpy float32 arithmetic), the scale layouts, the special-value contract and the argument validation.
GPU tests (``gpu``) compare the CuTe DSL kernels with the reference quantizer bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from cutedsl_gemm.formats import E4M3, E5M2, BLOCK_128x128_128x128, DEEPSEEK_1x128_128x128, ScaleGranularity
from cutedsl_gemm.quantize import quantize_fp8

FMTS = {"e4m3": E4M3, "e5m2": E5M2}
GRANS = {"tensor": (None, None), "row": (1, None), "1x128": (1, 128), "128x128": (128, 128), "256x256": (256, 256)}


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def naive_quantize(x: torch.Tensor, gr, gc, fmt):
    """Independent contract implementation: explicit loop over groups, numpy float32 arithmetic."""
    xf = x.float().numpy()
    rows, k = xf.shape
    gr = rows if gr is None else gr
    gc = k if gc is None else gc
    R, C = -(-rows // gr), -(-k // gc)
    scales = np.ones((R, C), dtype=np.float32)
    y = np.empty_like(xf)
    fmax = np.float32(fmt.max_finite)
    for i in range(R):
        for j in range(C):
            g = xf[i * gr:(i + 1) * gr, j * gc:(j + 1) * gc]
            fin = np.abs(g[np.isfinite(g)])
            amax = np.float32(fin.max()) if fin.size else np.float32(0)
            s = np.float32(amax / fmax) if amax > 0 else np.float32(1)
            scales[i, j] = s
            with np.errstate(all="ignore"):
                y[i * gr:(i + 1) * gr, j * gc:(j + 1) * gc] = np.clip(g / s, -fmax, fmax)
    return torch.from_numpy(y).to(fmt.torch_dtype), torch.from_numpy(scales)


def plain_scales(s: torch.Tensor, gran: str) -> torch.Tensor:
    """Any returned layout -> plain (R, C) fp32 on the CPU."""
    s = s.cpu()
    if gran == "tensor":
        return s.reshape(1, 1)
    return s.contiguous()


def nan_mask(q: torch.Tensor, fmt) -> torch.Tensor:
    b = q.view(torch.uint8).to(torch.int32) & 0x7F
    return b == 0x7F if fmt is E4M3 else b > 0x7C


def assert_q_equal(q, qref, fmt):
    q, qref = q.cpu(), qref.cpu()
    assert q.dtype == qref.dtype == fmt.torch_dtype and q.shape == qref.shape
    nq, nr = nan_mask(q, fmt), nan_mask(qref, fmt)
    assert torch.equal(nq, nr), f"NaN positions differ: {int((nq != nr).sum())} elements"
    bq, br = q.view(torch.uint8), qref.view(torch.uint8)
    bad = (bq != br) & ~nr
    assert not bad.any(), f"{int(bad.sum())} FP8 codes differ, first at {bad.nonzero()[0].tolist()}"


def assert_scales_equal(s, sref):
    s, sref = s.cpu(), sref.cpu()
    assert s.shape == sref.shape and s.stride() == sref.stride(), (s.shape, s.stride(), sref.shape, sref.stride())
    assert torch.equal(s.contiguous().view(torch.int32), sref.contiguous().view(torch.int32)), (s, sref)


def random_input(rows, k, dtype, seed, special=True):
    g = torch.Generator().manual_seed(seed)
    # log-uniform magnitudes over many binades so groups get very different scales
    mag = torch.exp2(torch.empty(rows, k).uniform_(-20, 12, generator=g))
    x = (torch.randn(rows, k, generator=g).sign() * mag)
    x = x * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).float())
    if special and rows * k >= 64:
        flat = x.view(-1)
        idx = torch.randperm(rows * k, generator=g)[:8]
        flat[idx[0]], flat[idx[1]], flat[idx[2]] = float("inf"), float("-inf"), float("nan")
        flat[idx[3]] = 1e-40  # fp32/bf16 subnormal
        x[: min(rows, 3), : min(k, 16)] = 0.0  # zeros inside a group
        if rows > 130 and k > 256:
            x[128:256, 128:256] = 0.0  # an all-zero 128x128 block (and 1x128 groups)
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------------
# CPU: reference numerics
# ----------------------------------------------------------------------------------------------------

SHAPES = [(1, 16), (7, 48), (130, 272), (300, 400), (257, 528)]


@pytest.mark.parametrize("gran", list(GRANS))
@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_naive(gran, fmt, shape):
    f = FMTS[fmt]
    x = random_input(*shape, torch.bfloat16, seed=hash((gran, fmt, shape)) % 1000)
    q, s = quantize_fp8(x, gran, fmt=fmt, backend="reference", scale_layout="row_major" if gran == "1x128" else None)
    qn, sn = naive_quantize(x, *GRANS[gran], f)
    assert torch.equal(plain_scales(s, gran).view(torch.int32), sn.view(torch.int32))
    assert_q_equal(q, qn, f)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reference_other_input_dtypes(dtype):
    x = random_input(200, 384, dtype, seed=3)
    for gran in ("1x128", "128x128"):
        q, s = quantize_fp8(x, gran, backend="reference", scale_layout="row_major")
        qn, sn = naive_quantize(x, *GRANS[gran], E4M3)
        assert torch.equal(s.view(torch.int32), sn.view(torch.int32))
        assert_q_equal(q, qn, E4M3)


@pytest.mark.parametrize("fmt", list(FMTS))
def test_special_values_contract(fmt):
    f = FMTS[fmt]
    x = torch.zeros(2, 128)
    x[0, :4] = torch.tensor([3.0, float("inf"), float("-inf"), float("nan")])
    x[0, 4] = -1.5
    q, s = quantize_fp8(x, "1x128", fmt=fmt, backend="reference", scale_layout="row_major")
    # amax ignores inf/NaN: scale from 3.0
    assert s[0, 0].item() == np.float32(3.0) / np.float32(f.max_finite)
    d = q.float()
    assert d[0, 0].item() == f.max_finite  # the amax element maps to +max
    assert d[0, 1].item() == f.max_finite and d[0, 2].item() == -f.max_finite  # inf saturates
    assert torch.isnan(d[0, 3])  # NaN propagates
    assert d[0, 4].item() == -f.max_finite / 2
    # all-zero group: scale exactly 1, data zero
    assert s[1, 0].item() == 1.0 and torch.all(d[1] == 0)


def test_non_finite_only_group_gets_scale_one():
    x = torch.full((1, 128), float("nan"))
    x[0, 1] = float("inf")
    q, s = quantize_fp8(x, "1x128", backend="reference", scale_layout="row_major")
    assert s.item() == 1.0
    assert torch.isnan(q.float()[0, 0]) and q.float()[0, 1].item() == 448.0


def test_dequantized_error_is_within_half_ulp():
    x = random_input(256, 256, torch.float32, seed=11, special=False)
    q, s = quantize_fp8(x, "128x128", backend="reference")
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    y = x.double() / full.double()
    err = (q.double() - y).abs()
    # E4M3: 3 mantissa bits -> half ulp = 2^-4 relative (normals), absolute 2^-10 for subnormals
    bound = torch.maximum(y.abs() * 2.0**-4, torch.full_like(y, 2.0**-10)) * (1 + 1e-6)
    assert torch.all(err <= bound)


# ----------------------------------------------------------------------------------------------------
# CPU: layouts
# ----------------------------------------------------------------------------------------------------


def test_scale_layouts():
    x = random_input(300, 400, torch.bfloat16, seed=5)
    q, s = quantize_fp8(x, "tensor", backend="reference")
    assert s.shape == () and s.dtype == torch.float32
    q, s = quantize_fp8(x, "row", backend="reference")
    assert s.shape == (300, 1) and s.is_contiguous()
    q, s = quantize_fp8(x, "1x128", backend="reference")
    assert s.shape == (300, 4) and s.stride() == (1, 300)  # torch._scaled_mm BlockWise1x128
    q, s2 = quantize_fp8(x, "1x128", backend="reference", scale_layout="row_major")
    assert s2.stride() == (4, 1) and torch.equal(s, s2)
    q, s = quantize_fp8(x, "128x128", backend="reference")
    assert s.shape == (3, 4) and s.stride() == (4, 1)
    q, s = quantize_fp8(x, "256x256", backend="reference")
    assert s.shape == (2, 2)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn


def test_padded_block_layout_for_cublas():
    x = random_input(260, 272, torch.bfloat16, seed=6)  # Kb = 3 -> L4 = 4
    _, s = quantize_fp8(x, "128x128", backend="reference")
    _, p = quantize_fp8(x, "128x128", backend="reference", scale_layout="padded")
    assert p.shape == (3, 4) and p.stride() == (4, 1)
    assert torch.equal(p[:, :3], s) and torch.all(p[:, 3] == 1.0)
    t = p.t()  # what torch._scaled_mm takes for BlockWise128x128: (L4, N/128), strides (1, L4)
    assert t.shape == (4, 3) and t.stride() == (1, 4)


def test_recipe_objects_and_operands():
    x = random_input(256, 256, torch.bfloat16, seed=7)
    _, sa = quantize_fp8(x, DEEPSEEK_1x128_128x128, operand="a", backend="reference")
    _, sb = quantize_fp8(x, DEEPSEEK_1x128_128x128, operand="b", backend="reference")
    assert sa.shape == (256, 2) and sb.shape == (2, 2)
    _, s = quantize_fp8(x, ScaleGranularity.ROW, backend="reference")
    assert s.shape == (256, 1)
    _, s = quantize_fp8(x, "128x128_128x128", operand="a", backend="reference")
    assert s.shape == (2, 2)


def test_empty_input():
    q, s = quantize_fp8(torch.empty(0, 256), "1x128", backend="reference")
    assert q.shape == (0, 256) and s.shape == (0, 2)


# ----------------------------------------------------------------------------------------------------
# CPU: validation
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        (dict(x=torch.zeros(4, 16, dtype=torch.int32)), TypeError, "bfloat16, float16 or float32"),
        (dict(x=torch.zeros(2, 4, 16)), ValueError, "2-D"),
        (dict(x="nope"), TypeError, "torch.Tensor"),
        (dict(fmt="e2m1"), ValueError, "'e4m3' or 'e5m2'"),
        (dict(fmt="bogus"), ValueError, "unknown element format"),
        (dict(recipe="128x128", block=64), ValueError, "128 or 256"),
        (dict(recipe="1x128", block=256), ValueError, "only applies to 2-D block"),
        (dict(recipe="1x128", scale_layout="padded"), ValueError, "mn_major"),
        (dict(recipe="row", scale_layout="row_major"), ValueError, "does not apply"),
        (dict(recipe="mx"), ValueError, "microscaling"),
        (dict(recipe="9x9"), ValueError, "unknown scaling recipe"),
        (dict(recipe=3.5), TypeError, "ScaleGranularity"),
        (dict(recipe=BLOCK_128x128_128x128, operand="c"), ValueError, "'a' or 'b'"),
        (dict(backend="triton"), ValueError, "backend"),
        (dict(x=torch.zeros(4, 24), backend="kernel"), ValueError, "multiple of 16"),
        (dict(x=torch.zeros(32, 16).t(), backend="kernel"), ValueError, "row-major"),
        (dict(x=torch.zeros(4, 32), backend="kernel"), ValueError, "CUDA"),
    ],
)
def test_validation_errors(kwargs, exc, text):
    args = dict(x=torch.zeros(4, 32), recipe="1x128")
    args.update(kwargs)
    x, r = args.pop("x"), args.pop("recipe")
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)")):
        quantize_fp8(x, r, **args)


# ----------------------------------------------------------------------------------------------------
# compile-only: sm_90a PTX (one subprocess: CUTE_DSL_KEEP/ARCH are read when the DSL is imported)
# ----------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys, cutlass
    from cutedsl_gemm.kernels.sm90 import quantize_fp8 as Q
    out = sys.argv[1]
    B, H, F = cutlass.BFloat16, cutlass.Float16, cutlass.Float32
    E4, E5 = cutlass.Float8E4M3FN, cutlass.Float8E5M2
    jobs = {
        "group_bf16_e4m3": lambda: Q.compile_group(B, E4, 448.0, 128, True),
        "group_f32_e4m3_rowmajor": lambda: Q.compile_group(F, E4, 448.0, 128, False),
        "block128_bf16_e4m3": lambda: Q.compile_block(B, E4, 448.0, 128),
        "block128_f16_e5m2": lambda: Q.compile_block(H, E5, 57344.0, 128),
        "block256_f32_e4m3": lambda: Q.compile_block(F, E4, 448.0, 256),
        "row_bf16_e4m3": lambda: Q.compile_row(B, E4, 448.0),
        "tensor_amax_bf16": lambda: Q.compile_tensor_amax(B),
        "tensor_cast_bf16_e4m3": lambda: Q.compile_tensor_cast(B, E4, 448.0),
    }
    for name, job in jobs.items():
        with open(f"{out}/{name}.ptx", "w") as f:
            f.write(job().__ptx__)
    """
)


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant_ptx")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx")
    # cwd=out: with CUTE_DSL_KEEP the DSL also drops its own .ptx copies into the working directory
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(out)], env=env, cwd=str(out),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return {p.stem: (p, p.read_text()) for p in out.glob("*.ptx") if not p.name.startswith("cutlass_")}


def _count(text, needle):
    return sum(1 for line in text.splitlines() if needle in line)


@pytest.mark.compile
def test_ptx_vectorized_memory(ptx):
    for name in ("group_bf16_e4m3", "block128_bf16_e4m3", "tensor_cast_bf16_e4m3"):
        t = ptx[name][1]
        # 4 passes x 16 bf16 = 8 x 16-byte loads, 4 x 16-byte stores of 16 FP8 bytes
        assert _count(t, "ld.global.v4.b32") == 8, name
        assert _count(t, "st.global.v4.b32") == 4, name
        if name != "tensor_cast_bf16_e4m3":  # (the cast kernel reads the fp32 partial maxima one by one)
            assert _count(t, "ld.global.b") == 0 and _count(t, "ld.global.u") == 0, name  # no scalar loads
    t = ptx["group_f32_e4m3_rowmajor"][1]
    assert _count(t, "ld.global.v4.b32") == 16 and _count(t, "st.global.v4.b32") == 4
    assert _count(ptx["tensor_amax_bf16"][1], "ld.global.v4.b32") == 8


@pytest.mark.compile
def test_ptx_contract_arithmetic(ptx):
    for name, (_, t) in ptx.items():
        assert "div.approx" not in t and "div.full" not in t, name  # IEEE division only
        assert ".ftz" not in t, name  # subnormals are part of the contract
        if name != "tensor_amax_bf16":  # one IEEE division per element held (row: 2 vectors per lane)
            assert _count(t, "div.rn.f32") >= (32 if name.startswith("row") else 64), name
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx["block128_bf16_e4m3"][1]
    assert "cvt.rn.satfinite.e5m2x2.f32" in ptx["block128_f16_e5m2"][1]
    assert "e4m3x2" not in ptx["block128_f16_e5m2"][1]


@pytest.mark.compile
def test_ptx_reductions(ptx):
    g = ptx["group_bf16_e4m3"][1]
    assert _count(g, "shfl.sync.bfly") == 4 * 3  # 8-lane butterflies, 4 passes
    assert "bar.sync" not in g and "barrier.sync" not in g  # 1x128 groups never sync the CTA
    b = ptx["block128_bf16_e4m3"][1]
    assert _count(b, "shfl.sync.bfly") == 5 and ("bar.sync" in b or "barrier.sync" in b)
    assert "atom." not in ptx["tensor_amax_bf16"][1]  # partial maxima, no atomics


@pytest.mark.compile
def test_ptx_block256_fp32_reloads(ptx):
    # 128 fp32 per thread would not fit in registers: the block is read twice (2 x 8 passes x 4 loads)
    assert _count(ptx["block256_f32_e4m3"][1], "ld.global.v4.b32") == 64


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed")
def test_ptxas_no_spills(ptx):
    for name, (path, _) in ptx.items():
        r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(path), "-o", os.devnull], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "0 bytes spill stores" in r.stderr and "0 bytes spill loads" in r.stderr, (name, r.stderr)


# ----------------------------------------------------------------------------------------------------
# GPU: kernels == reference, bit for bit
# ----------------------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 16), (128, 128), (130, 272), (257, 528), (1000, 1040), (512, 4096)]
LAYOUT_CASES = [
    ("tensor", None, 128),
    ("row", None, 128),
    ("1x128", "mn_major", 128),
    ("1x128", "row_major", 128),
    ("128x128", "row_major", 128),
    ("128x128", "padded", 128),
    ("128x128", "row_major", 256),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", list(FMTS))
def test_kernel_matches_reference(case, shape, dtype, fmt):
    gran, layout, block = case
    f = FMTS[fmt]
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; printed on failure
    x = random_input(*shape, dtype, seed=seed)
    q, s = quantize_fp8(x.cuda(), gran, fmt=fmt, block=block, scale_layout=layout, backend="kernel")
    torch.cuda.synchronize()
    qr, sr = quantize_fp8(x, gran, fmt=fmt, block=block, scale_layout=layout, backend="reference")
    try:
        assert_scales_equal(s, sr)
        assert_q_equal(q, qr, f)
    except AssertionError as e:
        raise AssertionError(f"seed={seed}: {e}") from None


@pytest.mark.gpu
def test_kernel_large_random_and_stream():
    x = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16) * 3
    x[5, 7] = float("nan")
    x[9, 300] = float("-inf")
    x[1024:1152, 256:384] = 0
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the kernels launch on the current torch stream
        outs = {g: quantize_fp8(x, g, backend="kernel") for g in ("tensor", "row", "1x128", "128x128")}
    side.synchronize()
    xc = x.cpu()
    for g, (q, s) in outs.items():
        qr, sr = quantize_fp8(xc, g, backend="reference")
        assert_scales_equal(s, sr)
        assert_q_equal(q, qr, E4M3)


@pytest.mark.gpu
def test_kernel_cache_reuses_compilation():
    from cutedsl_gemm.jit import KERNEL_CACHE

    x = torch.randn(64, 256, device="cuda")
    quantize_fp8(x, "1x128")
    n = KERNEL_CACHE.stats.compiles
    quantize_fp8(torch.randn(96, 512, device="cuda"), "1x128")  # new shape, same config
    assert KERNEL_CACHE.stats.compiles == n

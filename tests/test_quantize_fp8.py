"""FP8 quantization: reference numerics (CPU), compile-only sm_90a PTX checks, GPU kernel == reference.

CPU tests check ``quantize_fp8(backend="reference")`` against an independent per-group loop written here
(numpy float32 arithmetic), the scale layouts, the special-value contract and the argument validation, and
prove the kernels' reciprocal division for bf16/fp16 input on every pair of significands (exact emulation).
Compile tests read the sm_90a PTX (vectorized, unconditional loads; instruction mix; registers).
GPU tests (``gpu``) compare the CuTe DSL kernels with the reference quantizer bit for bit, on random data,
on special groups (signed zeros, subnormal and boundary scales, inf/NaN, FP8 ties) and on all significand pairs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import E4M3, E5M2, BLOCK_128x128_128x128, DEEPSEEK_1x128_128x128, ScaleGranularity
from cutedsl_gemm.ops.quantize import quantize_fp8
from cutedsl_gemm.tools.ptx_inspect import find_ptxas, ptxas_registers_and_spills, ptxas_report

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
# CPU: the kernels' reciprocal division (bf16/fp16 input), emulated exactly
# ----------------------------------------------------------------------------------------------------


def _rn32_sum(a, b):
    """fp32 round-to-nearest-even of the exact a + b (float64 arrays): an FMA's single rounding."""
    d = a + b
    bp = d - a
    e = (a - (d - bp)) + (b - bp)  # TwoSum: d + e == a + b exactly
    q = d.astype(np.float32)
    # float64 -> fp32 double-rounds only when d is exactly halfway between two fp32 values and e != 0
    lo = q.astype(np.float64)
    for toward in (np.float32(np.inf), np.float32(-np.inf)):
        nb = np.nextafter(q, toward)
        mid = (lo + nb.astype(np.float64)) / 2
        away = (d == mid) & (np.sign(e) == np.sign(mid - lo)) & (e != 0)
        q = np.where(away, nb, q)
    return q


def emulate_fast_div(x, s):
    """The kernels' per-element sequence (see kernels/sm90/quantize_fp8.py), for finite fp32 x and scale s:
    r = RN(1/s); q0 = RN(x r) clamped to +-2^20; n = RN(q0 s - x); q = RN(q0 - n r)."""
    r = np.float32(1) / s
    with np.errstate(over="ignore", under="ignore"):
        q0 = x * r
    q0 = np.where(np.abs(q0) > 2.0**20, np.copysign(np.float32(2.0**20), q0), q0).astype(np.float32)
    n = _rn32_sum(q0.astype(np.float64) * s.astype(np.float64), -x.astype(np.float64))
    return _rn32_sum(-n.astype(np.float64) * r.astype(np.float64), q0.astype(np.float64))


@pytest.mark.parametrize("mant_bits", [7, 10], ids=["bf16", "fp16"])
def test_fast_division_exhaustive_significands(mant_bits):
    # With everything in the normal range, whether the sequence returns RN(x / s) depends only on the
    # significands of x and s; s = RN(amax / fmax) and both fmax (448 = 1.75 * 2^8, 57344 = 1.75 * 2^15)
    # give the same significands. So this checks every (x, amax) pair of 16-bit inputs.
    m = (1 + np.arange(2**mant_bits) / 2**mant_bits).astype(np.float32)
    s = np.unique(m / np.float32(448.0))
    for xb in (m, m * np.float32(2)):  # both alignments of the quotient's binade
        X, S = (a.ravel() for a in np.meshgrid(xb, s))
        got = emulate_fast_div(X, S)
        bad = got.view(np.int32) != (X / S).view(np.int32)
        assert not bad.any(), f"{int(bad.sum())} pairs differ, e.g. x={X[bad][0]!r} s={S[bad][0]!r}"
    # the emulation is sharp enough to see a wrong sequence: without the correction step many differ
    X, S = (a.ravel() for a in np.meshgrid(m, s))
    assert ((X * (np.float32(1) / S)) != X / S).mean() > 0.05


@pytest.mark.parametrize("fmt", list(FMTS))
def test_fast_division_range_on_fp8_codes(fmt):
    # Every finite bf16 x against scales across the fast path's range (scale >= 2^-64, up to the largest
    # amax): the FP8 codes equal the reference's, including tiny quotients and subnormal inputs.
    f = FMTS[fmt]
    allx = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().numpy()
    allx = allx[np.isfinite(allx)]
    g = np.random.default_rng(1)
    amaxes = [2.0**-64 * f.max_finite, 1.0, 3.3895313892515355e38, 1e-12, 65504.0]
    amaxes += list(np.float32(2.0) ** g.uniform(np.log2(f.max_finite) - 63.9, 127, 40))
    for amax in torch.tensor(amaxes).to(torch.bfloat16).float().tolist():
        s = np.float32(amax) / np.float32(f.max_finite)
        assert s >= 2.0**-64
        x = allx[np.abs(allx) <= amax]
        got = emulate_fast_div(x, np.full_like(x, s))
        with np.errstate(all="ignore"):
            ref = x / s
        gq = R.cast_saturate(torch.from_numpy(got), f).view(torch.uint8)
        rq = R.cast_saturate(torch.from_numpy(ref), f).view(torch.uint8)
        assert torch.equal(gq, rq), f"amax={amax!r}: {int((gq != rq).sum())} codes differ"


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


def test_granularity_names_follow_the_recipe_rule():
    """quantize_fp8 takes what formats.recipe takes: a granularity name is that granularity (for A or W alike,
    the recipe that uses it on both operands), a recipe name with operand= one side of the pair."""
    import torch.nn.functional as TF

    from cutedsl_gemm.numerics.formats import recipe
    from cutedsl_gemm.ops.quantize import resolve_granularity

    for name in ("tensor", "row", "1x128", "128x128"):
        g = resolve_granularity(name)
        assert recipe(name).a is g and recipe(name).b is g  # the default "1x128" is a recipe name too
    assert resolve_granularity(TF.ScalingType.BlockWise1x128) is ScaleGranularity.GROUP_1x128
    assert resolve_granularity("1x128_128x128", "b") is ScaleGranularity.BLOCK_128x128
    assert resolve_granularity("256x256") is ScaleGranularity.BLOCK_128x128
    x = random_input(128, 256, torch.bfloat16, seed=8)
    for alias in ("group", "BlockWise1x128", TF.ScalingType.BlockWise1x128):
        assert torch.equal(quantize_fp8(x, alias, backend="reference")[1], quantize_fp8(x, backend="reference")[1])


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
        (dict(recipe="mx"), ValueError, "quantize_mx and quantize_nvfp4"),
        (dict(recipe="9x9"), ValueError, "unknown recipe '9x9'; expected a granularity ('tensor', 'row', '1x128', "
                                         "'128x128', '256x256' or a ScaleGranularity)"),
        (dict(recipe="1x64"), ValueError, "unknown recipe '1x64'; expected a granularity ('tensor', 'row', '1x128'"),
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
    from cutedsl_gemm.runtime.compile import compile_entry as C
    out = sys.argv[1]
    B, H, F = cutlass.BFloat16, cutlass.Float16, cutlass.Float32
    E4, E5 = cutlass.Float8E4M3FN, cutlass.Float8E5M2
    jobs = {
        "group_bf16_e4m3": lambda: C(*Q.group_entry(B, E4, 448.0, 128, True)),
        "group_f32_e4m3_rowmajor": lambda: C(*Q.group_entry(F, E4, 448.0, 128, False)),
        "block128_bf16_e4m3": lambda: C(*Q.block_entry(B, E4, 448.0, 128)),
        "block128_f16_e5m2": lambda: C(*Q.block_entry(H, E5, 57344.0, 128)),
        "block256_bf16_e4m3": lambda: C(*Q.block_entry(B, E4, 448.0, 256)),
        "block256_f32_e4m3": lambda: C(*Q.block_entry(F, E4, 448.0, 256)),
        "rowblock8192_bf16_e4m3": lambda: C(*Q.row_block_entry(B, E4, 448.0, 8192, threads=256)),
        "row_bf16_e4m3": lambda: C(*Q.row_entry(B, E4, 448.0)),
        "row_f32_e4m3": lambda: C(*Q.row_entry(F, E4, 448.0)),
        "tensor_amax_bf16": lambda: C(*Q.tensor_amax_entry(B)),
        "tensor_cast_bf16_e4m3": lambda: C(*Q.tensor_cast_entry(B, E4, 448.0)),
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


def _loads_before_arithmetic(text):
    """Index of the last global load and of the first arithmetic instruction of the kernel body."""
    lines = text.splitlines()
    last_ld = max(i for i, line in enumerate(lines) if "ld.global.v4" in line)
    math_ops = ("sub.rn.bf16x2", "cvt.f32.bf16", "div.rn")
    first_math = min(i for i, line in enumerate(lines) if any(op in line for op in math_ops))
    return last_ld, first_math


@pytest.mark.compile
def test_ptx_vectorized_memory(ptx):
    for name in ("group_bf16_e4m3", "block128_bf16_e4m3", "tensor_cast_bf16_e4m3"):
        t = ptx[name][1]
        # 4 vectors x 16 bf16 = 8 x 16-byte loads; 4 x 16-byte stores of 16 FP8 bytes on each of the two
        # division paths (reciprocal, and div.rn for tiny scales)
        assert _count(t, "ld.global.v4.b32") == 8, name
        assert _count(t, "st.global.v4.b32") == 8, name
        if name != "tensor_cast_bf16_e4m3":  # (the cast kernel reads the fp32 partial maxima one by one)
            assert _count(t, "ld.global.b") == 0 and _count(t, "ld.global.u") == 0, name  # no scalar loads
        # every load is issued before the first arithmetic, and none sits under a branch
        last_ld, first_math = _loads_before_arithmetic(t)
        assert last_ld < first_math, name
        assert "@%p" not in "".join(line for line in t.splitlines()[:last_ld] if "bra" in line), name
    t = ptx["group_f32_e4m3_rowmajor"][1]  # 2 vectors x 16 fp32 per thread
    assert _count(t, "ld.global.v4.b32") == 8 and _count(t, "st.global.v4.b32") == 2
    assert _count(ptx["tensor_amax_bf16"][1], "ld.global.v4.b32") == 8
    assert _count(ptx["block256_bf16_e4m3"][1], "ld.global.v4.b32") == 8  # held: read once
    assert _count(ptx["rowblock8192_bf16_e4m3"][1], "ld.global.v4.b32") == 4  # 32 elements per thread


@pytest.mark.compile
def test_ptx_contract_arithmetic(ptx):
    for name, (_, t) in ptx.items():
        assert "div.approx" not in t and "div.full" not in t and "rcp.approx" not in t, name  # IEEE only
        assert ".ftz" not in t, name  # subnormals are part of the contract
    for name in ("group_bf16_e4m3", "block128_bf16_e4m3", "block128_f16_e5m2", "tensor_cast_bf16_e4m3"):
        t = ptx[name][1]
        # reciprocal path: per element mul + clamp + 2 FMAs; div.rn kept for tiny-scale groups
        assert _count(t, "mul.rn.f32") == 64 and _count(t, "fma.rn.f32") == 128, name
        assert _count(t, "min.xorsign.abs.f32") == 64, name
        assert _count(t, "div.rn.f32") >= 64, name
        assert _count(t, "setp.ltu.f32") >= 1 or _count(t, "setp.ge.f32") >= 1, name  # the scale >= 2^-64 test
    for name in ("group_f32_e4m3_rowmajor", "block256_f32_e4m3", "row_f32_e4m3"):
        t = ptx[name][1]
        assert "fma.rn.f32" not in t and _count(t, "div.rn.f32") >= 32, name  # fp32 input: div.rn only
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx["block128_bf16_e4m3"][1]
    assert "cvt.rn.satfinite.e5m2x2.f32" in ptx["block128_f16_e5m2"][1]
    assert "e4m3x2" not in ptx["block128_f16_e5m2"][1]
    # 16-bit amax on packed pairs
    assert _count(ptx["group_bf16_e4m3"][1], "max.bf16x2") == 4 * 7
    assert _count(ptx["block128_f16_e5m2"][1], "max.f16x2") == 4 * 7


@pytest.mark.compile
def test_quantizers_let_the_next_kernel_launch_early(ptx):
    """Each quantizer of activations lets a PDL GEMM after it launch at once (to prefetch its weights);
    the amax pass of the per-tensor recipe is followed by the cast kernel, not by a GEMM."""
    for name, (_, t) in ptx.items():
        if not name.startswith("tensor_amax"):
            assert _count(t, "griddepcontrol.launch_dependents") == 1, name


@pytest.mark.compile
def test_ptx_reductions(ptx):
    g = ptx["group_bf16_e4m3"][1]
    assert _count(g, "shfl.sync.bfly") == 4 * 3  # 8-lane butterflies, 4 passes
    assert "bar.sync" not in g and "barrier.sync" not in g  # 1x128 groups never sync the CTA
    b = ptx["block128_bf16_e4m3"][1]
    # warp butterfly (5) + butterfly over the 8 warp maxima (3), one barrier
    assert _count(b, "shfl.sync.bfly") == 5 + 3 and ("bar.sync" in b or "barrier.sync" in b)
    assert "atom." not in ptx["tensor_amax_bf16"][1]  # partial maxima, no atomics


@pytest.mark.compile
def test_ptx_block256_fp32_reloads(ptx):
    # 64 fp32 per thread (1024 threads) would not fit in registers: the block is read twice (2 x 4 x 4 loads)
    assert _count(ptx["block256_f32_e4m3"][1], "ld.global.v4.b32") == 32


@pytest.mark.compile
@pytest.mark.skipif(find_ptxas() is None, reason="no CUDA toolkit ptxas")
def test_ptxas_no_spills_and_occupancy(ptx):
    # registers per thread that still allow the CTAs per SM the bandwidth needs (64K registers per SM)
    max_regs = {"group_bf16_e4m3": 64, "block128_bf16_e4m3": 64, "block128_f16_e5m2": 64,
                "block256_bf16_e4m3": 64, "tensor_cast_bf16_e4m3": 64, "tensor_amax_bf16": 64}
    for name, (path, _) in ptx.items():
        report = ptxas_report(path.read_text(), "sm_90a", find_ptxas())
        regs, spilled = ptxas_registers_and_spills(report)
        assert spilled == 0, (name, report)
        assert regs <= max_regs.get(name, 128), (name, regs)


# ----------------------------------------------------------------------------------------------------
# GPU: kernels == reference, bit for bit
# ----------------------------------------------------------------------------------------------------

# (3, 2032), (5, 8192), (33, 17424): per-row 1xK blocks of 2048 / 8192 / 32768 columns; (3, 65552): the
# two-pass row kernel
GPU_SHAPES = [(1, 16), (128, 128), (130, 272), (257, 528), (1000, 1040), (512, 4096), (3, 2032), (5, 8192),
              (33, 17424), (3, 65552)]
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


def _special_input(pattern, dtype, fmt, rows=300, k=528, seed=0):
    """A whole matrix of one kind of group, so that every granularity sees it."""
    g = torch.Generator().manual_seed(seed)
    fin = torch.finfo(dtype)
    sign = torch.randint(0, 2, (rows, k), generator=g).float() * 2 - 1
    u = torch.rand(rows, k, generator=g)
    if pattern == "signed_zeros":  # -0 must stay -0 (code 0x80), +0 stays +0
        x = sign * 0.0
    elif pattern == "zeros_and_ones":
        x = sign * 0.0
        x[::7, ::5] = sign[::7, ::5]
    elif pattern == "subnormal":  # amax subnormal: a tiny scale (bf16/fp32: below 2^-64, the div.rn path)
        x = sign * torch.randint(1, 64, (rows, k), generator=g).float() * fin.smallest_normal / 64
    elif pattern == "scale_2^-64":  # amax = 2^-64 * fmax: the smallest scale of the reciprocal path
        x = sign * u * (2.0**-64 * fmt.max_finite)
        x[:, ::16] = 2.0**-64 * fmt.max_finite
    elif pattern == "below_2^-64":  # the next smaller amax: div.rn path
        top = torch.tensor(2.0**-64 * fmt.max_finite).to(dtype)
        below = torch.nextafter(top.float(), torch.tensor(0.0)).to(dtype).float()
        if dtype != torch.float32:  # one step of the 16-bit format
            below = (top.view(torch.int16) - 1).view(dtype).float()
        x = sign * u * below
        x[:, ::16] = below
    elif pattern == "huge":  # amax = the format's largest finite value
        x = sign * u * fin.max
        x[:, ::16] = fin.max
    elif pattern == "non_finite":  # inf/NaN-only groups (scale 1) next to zeros
        x = torch.where(u < 0.5, sign * float("inf"), torch.full_like(u, float("nan")))
        x[:, 200:] = 0.0
    elif pattern == "ties":  # values whose quotients land on FP8 rounding midpoints
        x = sign * (torch.randint(0, 32, (rows, k), generator=g).float() * 2 + 1) / 64 * fmt.max_finite / 8
        x[:, ::16] = fmt.max_finite / 8
    else:
        raise AssertionError(pattern)
    return x.to(dtype)


SPECIAL = ["signed_zeros", "zeros_and_ones", "subnormal", "scale_2^-64", "below_2^-64", "huge", "non_finite", "ties"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
# (fp16 cannot represent the amax of the two smallest patterns: those pairs are not generated)
@pytest.mark.parametrize("pattern,dtype", [(p, d) for d in (torch.bfloat16, torch.float16, torch.float32)
                                           for p in SPECIAL
                                           if not (d == torch.float16 and p in ("scale_2^-64", "below_2^-64"))],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("fmt", list(FMTS))
def test_kernel_special_groups(case, pattern, dtype, fmt):
    gran, layout, block = case
    f = FMTS[fmt]
    x = _special_input(pattern, dtype, f)
    q, s = quantize_fp8(x.cuda(), gran, fmt=fmt, block=block, scale_layout=layout, backend="kernel")
    torch.cuda.synchronize()
    qr, sr = quantize_fp8(x, gran, fmt=fmt, block=block, scale_layout=layout, backend="reference")
    assert_scales_equal(s, sr)
    assert_q_equal(q, qr, f)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt", list(FMTS))
def test_kernel_all_significand_pairs(dtype, fmt):
    # The hardware counterpart of test_fast_division_exhaustive_significands: every (amax, x) pair of
    # 16-bit significands through the kernels' reciprocal path. Row i: 1x128 groups whose amax is
    # significand i; the other 127 slots of the groups hold every significand (halved, signs alternating).
    f = FMTS[fmt]
    nb = 7 if dtype == torch.bfloat16 else 10
    n = 2**nb
    m = 1 + torch.arange(n, dtype=torch.float32) / n
    ngroups = -(-n // 127)
    xs = torch.cat([m / 2, m[: ngroups * 127 - n] / 2])  # pad the last group with repeats
    xs = xs * torch.where(torch.arange(xs.numel()) % 2 == 0, 1.0, -1.0)
    body = xs.view(ngroups, 127).expand(n, ngroups, 127)
    x = torch.cat([m.view(n, 1, 1).expand(n, ngroups, 1), body], dim=2).reshape(n, ngroups * 128)
    exps = (-100, -50, 0, 100) if dtype == torch.bfloat16 else (-10, 0, 10)  # (bf16 2^-100: div.rn path)
    x = torch.cat([x * 2.0**e for e in exps]).to(dtype)
    for gran in ("1x128", "row"):
        q, sc = quantize_fp8(x.cuda(), gran, fmt=fmt, backend="kernel")
        qr, sr = quantize_fp8(x, gran, fmt=fmt, backend="reference")
        assert_scales_equal(sc, sr)
        assert_q_equal(q, qr, f)


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
    from cutedsl_gemm.runtime.jit import KERNEL_CACHE

    x = torch.randn(64, 256, device="cuda")
    quantize_fp8(x, "1x128")
    n = KERNEL_CACHE.stats.compiles
    quantize_fp8(torch.randn(96, 512, device="cuda"), "1x128")  # new shape, same config
    assert KERNEL_CACHE.stats.compiles == n


@pytest.mark.parametrize("which", ["fp8", "int8"])
def test_a_repeated_call_reuses_its_kept_launch(monkeypatch, which):
    """The kernel path keeps one launch per call signature; a launch the compiled kernel refuses before running
    (TypeError / ValueError) sends the call the long way, which plans again; an unhashable argument keeps nothing.
    (The launch is stubbed: the path is the host's, the kernels need a GPU.)"""
    from cutedsl_gemm.ops import quantize as Q

    plans, refuse = [], []

    def plan(x, *args):
        plans.append(args)

        def run(t):
            if refuse:
                refuse.pop()
                raise ValueError("refused before launch")
            return ("launched", len(plans))
        return run

    monkeypatch.setattr(Q, "_plan", plan)
    from cutedsl_gemm.runtime.plans import PreparedCalls

    monkeypatch.setattr(Q, "PREPARED", PreparedCalls())
    monkeypatch.setattr(Q, "_fp8_arguments", lambda x, *a: (ScaleGranularity.ROW, E4M3, 128, None, True))
    monkeypatch.setattr(Q, "_int8_arguments", lambda x, *a: (ScaleGranularity.ROW, True))
    x = torch.randn(4, 32)
    call = (lambda: Q.quantize_fp8(x, "row")) if which == "fp8" else (lambda: Q.quantize_int8(x, "row"))
    assert call() == ("launched", 1) and call() == ("launched", 1) and len(plans) == 1
    refuse.append(True)
    assert call() == ("launched", 2) and len(plans) == 2  # refused: planned again, the new launch kept
    assert call() == ("launched", 2) and len(plans) == 2
    if which == "fp8":
        Q.quantize_fp8(x, "row", scale_layout=["unhashable"])
        Q.quantize_fp8(x, "row", scale_layout=["unhashable"])
        assert len(plans) == 4 and Q.PREPARED.count(Q.QUANTIZE) == 1  # planned each time, nothing kept


def test_granularity_is_positional_or_keyword_and_recipe_is_its_deprecated_alias():
    import cutedsl_gemm

    x = torch.randn(8, 256)
    want = quantize_fp8(x, "row")
    for got in (quantize_fp8(x, granularity="row"), cutedsl_gemm.quantize_fp8(x, granularity="row")):
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    with pytest.warns(DeprecationWarning, match=r"quantize_fp8\(recipe=\.\.\.\) is now quantize_fp8\(granularity="):
        old = quantize_fp8(x, recipe="row")
    assert torch.equal(old[1], want[1])
    with pytest.raises(TypeError, match="both granularity and recipe"):
        quantize_fp8(x, "tensor", recipe="row")
    assert quantize_fp8(x)[1].shape == (8, 2)  # the default: 1x128 groups
    # quantize_int8 takes the same keyword; the op keeps its schema (its granularity is passed by position)
    assert cutedsl_gemm.quantize_int8(x, granularity="tensor")[1].shape == ()
    assert torch.equal(torch.ops.cutedsl_gemm.quantize_fp8(x, "row")[1], want[1])

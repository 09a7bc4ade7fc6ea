"""``silu_mul_quantize_fp8``: SiLU(gate) * weight * up quantized in one kernel.

CPU: the reference path against a float64 formula, the layouts, the errors, the op's fake and opcheck, torch.compile
tracing; ``compile``: the kernel's PTX (two loads per vector issued before any arithmetic, no spills, the SiLU,
PDL); ``gpu``: the kernel against the reference codes (a differs from the reference only where the fp32 SiLU
lands within its 2 ulp of a rounding boundary), special values, outputs that were NaN before the call, CUDA graph
replay.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops.gated import silu_mul_quantize_fp8
from cutedsl_gemm.ops.quantize import quantize_fp8

OPS = torch.ops.cutedsl_gemm
FP8 = torch.float8_e4m3fn


def _gated_input(m, i, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, 2 * i, generator=g) * 3
    h = h * torch.exp2(torch.randint(-4, 4, (m, 1), generator=g).float())  # rows of different scales
    w = torch.rand(m, generator=g) + 0.05
    return h.to(dtype).to(device), w.to(device)


def _dequantized(q, s, gran):
    m, i = q.shape
    scales = s.expand(m, i) if gran == "row" else s.repeat_interleave(128, 1)[:, :i]
    return q.double() * scales.double()


def _float64_activation(h, w):
    i = h.shape[1] // 2
    g, u = h[:, :i].double(), h[:, i:].double()
    return g * torch.sigmoid(g) * u * (1.0 if w is None else w.double()[:, None])


# ------------------------------------------------------------------------------------------------------------------
# CPU: the reference path, layouts, errors
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gran", ["row", "1x128"])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("m, i", [(1, 16), (37, 208), (130, 768)])
def test_reference_is_the_quantized_activation(gran, weighted, m, i):
    h, w = _gated_input(m, i, seed=m + i)
    w = w if weighted else None
    q, s = silu_mul_quantize_fp8(h, gran, w)
    want_q, want_s = quantize_fp8(R.silu_mul(h, w), gran)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert q.shape == (m, i) and q.dtype == FP8
    kb = -(-i // 128)
    assert (s.shape, s.stride()) == (((m, 1), (1, 1)) if gran == "row" else ((m, kb), (1, m)))
    err = R.rel_error(_dequantized(q, s, gran), _float64_activation(h, w))
    assert 0 < err < 0.04  # e4m3's 3 mantissa bits (and bf16's rounding of the activation)


def test_empty_rows():
    q, s = silu_mul_quantize_fp8(torch.empty(0, 64, dtype=torch.bfloat16), "row")
    assert q.shape == (0, 32) and s.shape == (0, 1)


@pytest.mark.parametrize("args, kwargs, exc, text", [
    ((torch.randn(4, 33),), {}, ValueError, "2-D (M, 2I)"),
    ((torch.randn(2, 4, 32),), {}, ValueError, "2-D (M, 2I)"),
    ((torch.randn(4, 32).int(),), {}, TypeError, "bfloat16, float16 or float32"),
    ((torch.randn(4, 32), "tensor"), {}, ValueError, "per-tensor scale needs the whole activation"),
    ((torch.randn(4, 32), "128x128"), {}, ValueError, "'row' or '1x128'"),
    ((torch.randn(4, 32), "nonsense"), {}, ValueError, "'row' or '1x128'"),
    ((torch.randn(4, 32), "row", torch.rand(3)), {}, ValueError, "shape (4,)"),
    ((torch.randn(4, 32), "row", torch.rand(4).double()), {}, ValueError, "float32"),
    ((torch.randn(4, 32),), {"fmt": "int8"}, ValueError, "'e4m3' or 'e5m2'"),
    ((torch.randn(4, 32),), {"backend": "kernel"}, ValueError, "needs a CUDA tensor"),
    ((torch.randn(4, 32),), {"backend": "gpu"}, ValueError, "backend must be"),
])
def test_errors_say_what_was_expected(args, kwargs, exc, text):
    with pytest.raises(exc, match=re.escape(text)):
        silu_mul_quantize_fp8(*args, **kwargs)


@pytest.mark.parametrize("gran", ["row", "1x128"])
def test_fake_matches_the_real_outputs(gran):
    h, w = _gated_input(40, 272)
    q, s = silu_mul_quantize_fp8(h, gran, w)
    with FakeTensorMode() as mode:
        fq, fs = OPS.silu_mul_quantize_fp8(mode.from_tensor(h), gran, mode.from_tensor(w))
    for real, fake in ((q, fq), (s, fs)):
        assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride())


def test_opcheck_on_cpu():
    h, w = _gated_input(24, 256)
    torch.library.opcheck(OPS.silu_mul_quantize_fp8.default, (h, "1x128", w))
    torch.library.opcheck(OPS.silu_mul_quantize_fp8.default, (h,), {"fmt": "e5m2"})


def test_compile_traces_the_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(h, w):
        return cutedsl_gemm.silu_mul_quantize_fp8(h, "1x128", w)

    h, w = torch.empty(8, 512, dtype=torch.bfloat16, device="meta"), torch.empty(8, device="meta")
    q, s = torch.compile(fn, fullgraph=True, backend=backend)(h, w)
    assert q.shape == (8, 256) and s.shape == (8, 2) and s.stride() == (1, 8)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("cutedsl_gemm.silu_mul_quantize_fp8" in t for t in targets)


# ------------------------------------------------------------------------------------------------------------------
# compile: the kernel's PTX
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gated_ptx():
    import cutlass

    from cutedsl_gemm.kernels.sm90 import quantize_fp8 as K
    from cutedsl_gemm.runtime.compile import compile_entry

    out = {}
    for name, gran, i, weighted in (("row_w", "row", 768, True), ("group", "1x128", 2048, False)):
        with tempfile.TemporaryDirectory() as d:
            entry = K.gated_entry(cutlass.BFloat16, cutlass.Float8E4M3FN, 448.0, gran, i, weighted)
            out[name] = compile_entry(*entry, "sm_90a", ptx_dump_dir=d).__ptx__
    return out


def _count(text, needle):
    return sum(1 for line in text.splitlines() if needle in line)


@pytest.mark.compile
def test_ptx_two_loads_per_vector_before_any_arithmetic(gated_ptx):
    for name, t in gated_ptx.items():
        # 2 vectors per thread, each a gate and an up vector of 16 bf16 (two 16-byte loads each)
        assert _count(t, "ld.global.v4.b32") == 8, name
        # one 16-byte store of 16 FP8 bytes per vector on each division path
        assert _count(t, "st.global.v4.b32") == 4, name
        lines = t.splitlines()
        last_ld = max(n for n, line in enumerate(lines) if "ld.global" in line)  # the vectors and the weight
        first_math = min(n for n, line in enumerate(lines) if "ex2.approx" in line)
        assert last_ld < first_math, name
        assert ".local" not in t, name  # no spills
        assert _count(t, "ex2.approx.f32") == 32 and ".ftz" not in t, name  # SiLU per element, subnormals kept
        assert _count(t, "griddepcontrol.launch_dependents") == 1, name  # the down GEMM may launch early
    assert _count(gated_ptx["row_w"], "ld.global.b32") >= 1  # the row's weight
    assert _count(gated_ptx["group"], "ld.global.b32") == 0  # unweighted: no weight read
    assert _count(gated_ptx["group"], "shfl.sync.bfly") == 2 * 3  # 8-lane group butterflies


# ------------------------------------------------------------------------------------------------------------------
# GPU: the kernel
# ------------------------------------------------------------------------------------------------------------------


def _nan_pool(*numels):
    """Leave NaN-filled blocks of these sizes in the caching allocator, so outputs that the kernel fails to write
    read back as NaN rather than as zeros."""
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in numels]
    del blocks


def _assert_matches_reference(q, s, h, w, gran):
    want_a = R.silu_mul(h, w)
    want_q, want_s = quantize_fp8(want_a, gran)
    assert q.shape == want_q.shape and s.shape == want_s.shape and s.stride() == want_s.stride()
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)) & ~torch.isnan(want_q.float())
    assert differ.float().mean().item() < 1e-3, f"{int(differ.sum())} codes differ"
    assert torch.isfinite(s).all() and torch.allclose(s, want_s, rtol=2**-7, atol=0)
    err = R.rel_error(_dequantized(q, s, gran), _float64_activation(h, w))
    assert 0 < err < 0.04, err


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["row", "1x128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, i", [(1, 768), (5, 208), (130, 2048), (300, 1536), (64, 14336), (3, 16)])
@pytest.mark.parametrize("weighted", [True, False])
def test_kernel_matches_the_reference(gran, dtype, m, i, weighted):
    h, w = _gated_input(m, i, dtype, seed=7 * m + i, device="cuda")
    w = w if weighted else None
    _nan_pool(m * i, m * i // 4, m * (i // 128 + 1))
    q, s = silu_mul_quantize_fp8(h, gran, w)
    torch.cuda.synchronize()
    _assert_matches_reference(q, s, h, w, gran)


@pytest.mark.gpu
def test_fp32_input_matches_the_reference():
    h, w = _gated_input(33, 384, torch.float32, device="cuda")
    q, s = silu_mul_quantize_fp8(h, "row", w)
    _assert_matches_reference(q, s, h, w, "row")


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["row", "1x128"])
def test_special_values(gran):
    h, w = _gated_input(8, 256, device="cuda")
    h[0, 3], h[1, 5], h[2, 7] = float("inf"), float("-inf"), float("nan")  # gate
    h[3, 256 + 9] = float("inf")  # up
    h[4, 11], h[4, 256 + 11] = -100.0, 2.0  # SiLU(-100) = -0 (e^100 overflows nothing in fp32 here)
    h[5, :256] = 0  # a row of zero activations: scale 1
    q, s = silu_mul_quantize_fp8(h, gran, w)
    want_q, want_s = quantize_fp8(R.silu_mul(h, w), gran)
    assert torch.equal(torch.isnan(q.float()), torch.isnan(want_q.float()))
    assert torch.equal(s, want_s)
    assert s[5].eq(1).all()


@pytest.mark.gpu
def test_graph_replay_follows_new_inputs():
    h, w = _gated_input(64, 768, device="cuda")
    silu_mul_quantize_fp8(h, "row", w)  # compile and keep the launch outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = silu_mul_quantize_fp8(h, "row", w)
    for seed in (1, 2):
        nh, nw = _gated_input(64, 768, seed=seed, device="cuda")
        h.copy_(nh)
        w.copy_(nw)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches_reference(q, s, h, w, "row")


@pytest.mark.gpu
def test_deterministic():
    h, w = _gated_input(257, 1536, device="cuda")
    a = silu_mul_quantize_fp8(h, "1x128", w)
    b = silu_mul_quantize_fp8(h, "1x128", w)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])

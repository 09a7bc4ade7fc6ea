"""quantize_scaled_mm on the GPU: the GEMMs that quantize their bf16 / fp16 activations themselves equal
quantize_fp8(x, "1x128") -- or, per token, quantize_fp8(x, "row") / quantize_int8(x, "row") -- followed by scaled_mm on
the same tiles and splits bit for bit (special values, ragged N and K, forced splits, every tile of the table), match
the float64 reference, and run in CUDA graphs and under torch.compile through the FP8 layer."""

import dataclasses

import pytest
import torch
from gpu_operands import block_magnitudes

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import INSTANCES, QUANT_GEMM

pytestmark = pytest.mark.gpu

RECIPES = ["1x128_128x128", "1x128_1x128"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _weight(n, k, recipe):
    """An e4m3 weight (N, K) with its scales, as b = W.t() and scale_b (scaled_mm's layout) and plain for the
    reference."""
    gran = cutedsl_gemm.recipe(recipe).b
    w = torch.randn(n, k, device="cuda") * block_magnitudes(n, k, gran.rows, "cuda")
    qw, sw = cutedsl_gemm.quantize_fp8(w, gran.label)
    return qw, sw.t().contiguous(), sw[:, :-(-k // 128)]  # (the reference takes no K-block padding)


def _activations(m, k, dtype, special=False):
    """(M, K) activations with a random magnitude per 1x128 group; ``special``: a zero row, +-inf and NaN."""
    x = torch.randn(m, k, device="cuda") * block_magnitudes(m, k, 1, "cuda")
    if special:
        x[0] = 0.0
        if m > 1:
            x[1, 5], x[1, k - 1] = float("inf"), float("-inf")
        if m > 2:
            x[2, 130 % k] = float("nan")
    return x.to(dtype)


def _two_kernels(x, b, scale_b, bias, split_k=None):
    qa, sa = cutedsl_gemm.quantize_fp8(x, "1x128")
    return cutedsl_gemm.scaled_mm(qa, b, sa, scale_b, bias, None, x.dtype, split_k=split_k), (qa, sa)


def _picks(x, b, scale_b, bias, split_k=None):
    """(tile, splits) dispatch runs the one-kernel call and the two-kernel one with."""
    dev = x.device
    q, _ = P.describe_quantize_scaled_mm(x, b, scale_b, bias, x.dtype, None, None, split_k, dev)
    plain = dataclasses.replace(q, act_format=None)
    return [(i.tile_m, i.tile_n, s) for i, s in (dispatch.select(q), dispatch.select(plain))]


def _same(y, ref):
    torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("n,k", [(4096, 4096), (1040, 7056), (576, 2048), (7168, 256)])
@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 32])
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_kernel_equals_quantize_then_scaled_mm(recipe, m, n, k):
    torch.manual_seed(m * 131 + n + k)
    qw, sb, sw = _weight(n, k, recipe)
    for dtype in DTYPES.values():
        x = _activations(m, k, dtype)
        bias = torch.randn(n, device="cuda") if m % 2 else None
        assert dispatch.has_quantizing_rows(
            P.describe_quantize_scaled_mm(x, qw.t(), sb, bias, dtype, None, None, None, x.device)[0])
        one, two = _picks(x, qw.t(), sb, bias)
        assert one == two, (one, two)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        y = cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, bias, out=out, in_kernel=True)
        assert y is out
        ref, (qa, sa) = _two_kernels(x, qw.t(), sb, bias)
        _same(y, ref)
        err = R.rel_error(y, R.reference_gemm(qa, sa, qw, sw, recipe, bias=bias))
        assert err <= 2e-3 if dtype == torch.bfloat16 else 5e-4, f"{dtype}: relative error {err:.3e}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_special_values_and_zero_rows_follow_the_quantizer(recipe):
    m, n, k = 5, 1024, 1040  # K: 8 K tiles and a 16-element tail
    qw, sb, _ = _weight(n, k, recipe)
    x = _activations(m, k, torch.bfloat16, special=True)
    y = cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, in_kernel=True)
    _same(y, _two_kernels(x, qw.t(), sb, None)[0])
    assert torch.isnan(y[2]).all() and torch.isfinite(y[3:]).all() and torch.equal(y[0], torch.zeros_like(y[0]))


@pytest.mark.parametrize("split_k", [1, 3, 8, 16])
def test_forced_splits(split_k):
    m, n, k = 4, 4096, 7168
    qw, sb, _ = _weight(n, k, "1x128_128x128")
    x = _activations(m, k, torch.bfloat16)
    y = cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, split_k=split_k, in_kernel=True)
    _same(y, _two_kernels(x, qw.t(), sb, None, split_k)[0])
    _same(cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, split_k=split_k, in_kernel=True), y)  # deterministic


def _gemm_twin(inst):
    """The scaled_mm instance of a QUANT_GEMM one: the same tile on quantized activations of the weight's kind."""
    want = dataclasses.replace(inst, op="gemm", a_dtype=inst.b_dtype, out_dtype="bf16")
    return next(i for i in INSTANCES if i == want)


QUANT_INSTANCES = [i for i in INSTANCES if i.op == QUANT_GEMM and i.a_dtype == "bf16" and i.bias_dtype is None]


@pytest.mark.parametrize("inst", QUANT_INSTANCES, ids=lambda i: i.name)
def test_every_tile_equals_its_scaled_mm_twin(inst):
    """Each tile of the table, launched directly (dispatch picks few of them), with and without K splits."""
    m, n, k = min(inst.m_max, 29), 1104, 2960
    if inst.recipe == "row":
        qw, sb = _per_channel_weight(n, k, inst.b_dtype)
    else:
        qw, sb, _ = _weight(n, k, inst.recipe)
    x = _activations(m, k, torch.bfloat16, special=True)
    qa, sa = _quantize_per_token(x, inst.b_dtype) if inst.recipe == "row" else cutedsl_gemm.quantize_fp8(x, "1x128")
    kb = -(-k // 128)
    va, vb = scale_layouts.kernel_views(inst.recipe, kb, sa, sb)
    stand_in = torch.ones(1, device="cuda")
    for splits in (1, 5):
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        ref = torch.full_like(y, float("nan"))
        launch.launch(inst, x, qw.t(), stand_in, vb, y, splits=splits)
        launch.launch(_gemm_twin(inst), qa, qw.t(), va, vb, ref, splits=splits)
        _same(y, ref)


def test_above_the_token_tiles_runs_the_two_kernels():
    m, n, k = 64, 2048, 1024
    qw, sb, _ = _weight(n, k, "1x128_128x128")
    x = _activations(m, k, torch.bfloat16)
    assert not dispatch.has_quantizing_rows(
        P.describe_quantize_scaled_mm(x, qw.t(), sb, None, x.dtype, None, None, None, x.device)[0])
    _same(cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb), _two_kernels(x, qw.t(), sb, None)[0])
    with pytest.raises(ValueError, match="in_kernel=True: no kernel quantizes bf16 activations"):
        cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, in_kernel=True)


def test_one_kernel_graphs_and_compiles():
    """quantize_scaled_mm(in_kernel=True) on a DeepSeek-recipe weight (a large layer at M = 1): eager, replayed in a
    CUDA graph and compiled with fullgraph give the two-kernel path's bits."""
    torch.manual_seed(0)
    qw, sb, _ = _weight(28672, 4096, "1x128_128x128")
    bias = torch.randn(28672, device="cuda")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def one(x):
        return cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, bias, in_kernel=True)

    ref, _ = _two_kernels(x, qw.t(), sb, bias)
    _same(one(x), ref)
    _same(one(x), ref)  # the kept plan
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = one(static_x)
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    graph.replay()
    _same(static_y, _two_kernels(x2, qw.t(), sb, bias)[0])
    compiled = torch.compile(one, fullgraph=True)
    _same(compiled(x2), static_y)


# ---- per token: FP8 row-wise and int8 W8A8 ----------------------------------------------------------------------
PER_TOKEN = ["e4m3", "int8"]  # the weight's kind


def _per_channel_weight(n, k, kind):
    """A per-channel quantized weight (N, K): (qw, scale_b (1, N)), channels of random magnitudes."""
    w = torch.randn(n, k, device="cuda") * torch.exp2(torch.randint(-6, 6, (n, 1), device="cuda").float())
    qw, sw = cutedsl_gemm.quantize_int8(w, "row") if kind == "int8" else cutedsl_gemm.quantize_fp8(w, "row")
    return qw, sw.t()


def _quantize_per_token(x, kind):
    return cutedsl_gemm.quantize_int8(x, "row") if kind == "int8" else cutedsl_gemm.quantize_fp8(x, "row")


def _two_kernels_per_token(x, b, scale_b, bias, kind, split_k=None):
    qa, sa = _quantize_per_token(x, kind)
    return cutedsl_gemm.scaled_mm(qa, b, sa, scale_b, bias, None, x.dtype, split_k=split_k), (qa, sa)


def _per_token_reference(qa, sa, qw, sb, kind, bias):
    if kind == "int8":
        return R.reference_int8_mm(qa, qw.t(), sa, sb, bias)
    return R.reference_gemm(qa, sa, qw, sb.t(), "row", bias=bias)


@pytest.mark.parametrize("n,k", [(4096, 4096), (1040, 7056), (576, 2048), (7168, 256)])
@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 32])
@pytest.mark.parametrize("kind", PER_TOKEN)
def test_per_token_one_kernel_equals_quantize_then_scaled_mm(kind, m, n, k):
    torch.manual_seed(m * 131 + n + k)
    qw, sb = _per_channel_weight(n, k, kind)
    for dtype in DTYPES.values():
        x = _activations(m, k, dtype)
        bias = torch.randn(n, device="cuda") if m % 2 else None
        one, two = _picks(x, qw.t(), sb, bias)
        assert one == two, (one, two)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        y = cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, bias, out=out, in_kernel=True)
        assert y is out
        ref, (qa, sa) = _two_kernels_per_token(x, qw.t(), sb, bias, kind)
        _same(y, ref)
        err = R.rel_error(y, _per_token_reference(qa, sa, qw, sb, kind, bias))
        assert err <= 2e-3 if dtype == torch.bfloat16 else 5e-4, f"{dtype}: relative error {err:.3e}"


@pytest.mark.parametrize("kind", PER_TOKEN)
def test_per_token_special_values_follow_the_quantizer(kind):
    """A zero row (scale 1, zero output), +-inf and NaN in rows (FP8: NaN rows; int8: inf -> +-127, NaN -> 0), a
    token whose amax sits in the last K tile, K with a 16-element tail."""
    m, n, k = 6, 1024, 1040
    qw, sb = _per_channel_weight(n, k, kind)
    x = _activations(m, k, torch.bfloat16, special=True)
    x[4, k - 3] = 1e4  # amax in the last (partial) K tile: every earlier tile quantizes with it
    y = cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, in_kernel=True)
    _same(y, _two_kernels_per_token(x, qw.t(), sb, None, kind)[0])
    assert torch.equal(y[0], torch.zeros_like(y[0])) and torch.isfinite(y[3:]).all()


@pytest.mark.parametrize("split_k", [1, 3, 8, 16])
@pytest.mark.parametrize("kind", PER_TOKEN)
def test_per_token_forced_splits(kind, split_k):
    """Every split of a unit finds the same token scales (each reads the whole row)."""
    m, n, k = 4, 4096, 7168
    qw, sb = _per_channel_weight(n, k, kind)
    x = _activations(m, k, torch.bfloat16)
    y = cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, split_k=split_k, in_kernel=True)
    _same(y, _two_kernels_per_token(x, qw.t(), sb, None, kind, split_k)[0])
    _same(cutedsl_gemm.quantize_scaled_mm(x, qw.t(), sb, split_k=split_k, in_kernel=True), y)


@pytest.mark.parametrize("kind", PER_TOKEN)
def test_per_token_token_tiles_change_between_units(kind):
    """M = 29 on 16-wide token tiles (forced through the 17..32 tiles' neighbour by a direct launch): the quantizing
    warps find new scales whenever a unit's token tile differs from the last one's, and the epilogue ring keeps
    each unit's; short K (two K tiles a unit) lets the producers run several units ahead of the epilogue."""
    inst = next(i for i in INSTANCES if i.op == QUANT_GEMM and i.recipe == "row" and i.b_dtype == kind
                and i.a_dtype == "bf16" and i.bias_dtype is None and (i.tile_m, i.tile_n) == (64, 16))
    m, n, k = 29, 4096, 256
    qw, sb = _per_channel_weight(n, k, kind)
    x = _activations(m, k, torch.bfloat16)
    qa, sa = _quantize_per_token(x, kind)
    va, vb = scale_layouts.kernel_views("row", 2, sa, sb)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = torch.full_like(y, float("nan"))
    launch.launch(inst, x, qw.t(), torch.ones(1, device="cuda"), vb, y, splits=1)
    launch.launch(_gemm_twin(inst), qa, qw.t(), va, vb, ref, splits=1)
    _same(y, ref)


@pytest.mark.parametrize("kind", PER_TOKEN)
def test_per_token_graph_replay(kind):
    m, n, k = 3, 2048, 4096
    qw, sb = _per_channel_weight(n, k, kind)
    x = _activations(m, k, torch.bfloat16)
    run = lambda t: cutedsl_gemm.quantize_scaled_mm(t, qw.t(), sb, in_kernel=True)  # noqa: E731
    static_x = x.clone()
    run(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run(static_x)
    x2 = _activations(m, k, torch.bfloat16)
    static_x.copy_(x2)
    graph.replay()
    _same(static_y, _two_kernels_per_token(x2, qw.t(), sb, None, kind)[0])

"""scaled_mm_fp8_out on the GPU: (q, scales) equal ``quantize_fp8(scaled_mm(..., out_dtype=torch.bfloat16), "1x128")``
bit for bit -- in one kernel where dispatch runs the FP8-output twin of scaled_mm's pick, in two elsewhere -- on
random data with and without bias, special values, every FP8-output tile launched directly against its scaled_mm
twin (with and without K splits) into NaN-poisoned outputs, CUDA graph replay and torch.compile through the op."""

import dataclasses

import pytest
import torch
from gpu_operands import block_magnitudes, torch_scale_layout

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import GEMM_FP8_OUT, INSTANCES, select

pytestmark = pytest.mark.gpu

DEEPSEEK = "1x128_128x128"
RECIPES = [DEEPSEEK, "row", "tensor"]
POISON = 0xFF  # e4m3 NaN, and an fp32 NaN in all four bytes


def _operands(m, n, k, recipe):
    """(a, b, scale_a, scale_b) of a random call in scaled_mm's (torch's) layouts, a random magnitude per scale block,
    and the plain scales (sa, sw)."""
    rec = cutedsl_gemm.recipe(recipe)
    a = torch.randn(m, k, device="cuda") * block_magnitudes(m, k, rec.a.rows, "cuda")
    w = torch.randn(n, k, device="cuda") * block_magnitudes(n, k, rec.b.rows, "cuda")
    qa, sa, qw, sw = R.quantize_operands(a, w, recipe)
    if recipe == DEEPSEEK:
        scale_a, scale_b = torch_scale_layout(sa, 1), torch_scale_layout(sw, 128).t()
    elif recipe == "row":
        scale_a, scale_b = sa.reshape(m, 1).contiguous(), sw.reshape(1, n).contiguous()
    else:
        scale_a, scale_b = sa.reshape(()), sw.reshape(())
    return qa, qw.t(), scale_a, scale_b


def _reference(a, b, scale_a, scale_b, bias=None):
    y = cutedsl_gemm.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=torch.bfloat16)
    return cutedsl_gemm.quantize_fp8(y, "1x128")


def _same(got, ref):
    """Bit for bit, layouts included."""
    for g, r in zip(got, ref):
        assert (g.shape, g.dtype, g.stride()) == (r.shape, r.dtype, r.stride())
        assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g.view(torch.int32),
                           r.view(torch.uint8) if r.element_size() == 1 else r.view(torch.int32))


def _poison_allocator(m, n):
    """Leave blocks of the outputs' sizes filled with POISON in the caching allocator, where the call's outputs will
    be allocated: an output element the kernel does not write stays NaN."""
    blocks = [torch.full((m * n,), POISON, dtype=torch.uint8, device="cuda"),
              torch.full((m * (n // 128) * 4,), POISON, dtype=torch.uint8, device="cuda")]
    del blocks


def _poisoned_outputs(m, n):
    q = torch.full((m, n), POISON, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    s = torch.full((n // 128, m * 4), POISON, dtype=torch.uint8, device="cuda").view(torch.float32).t()
    return q, s


def _one_kernel(a, b, scale_a, scale_b, bias=None):
    problem, _ = P.describe_scaled_mm_fp8_out(a, b, scale_a, scale_b, bias, a.device)
    return not problem.is_empty and dispatch.select_fp8_out(problem) is not None


# Prefill shapes whose scaled_mm picks (on an H100) are 128-wide unswapped tiles: one kernel.
PREFILL = ((4096, 7168, 7168), (4096, 512, 7168), (1000, 1536, 7168), (100, 7168, 7168), (100, 512, 7168))


def _one_kernel_operands(recipe, bias=None):
    """(M, N, K) and operands of the first PREFILL shape that runs as one kernel on this GPU."""
    for m, n, k in PREFILL:
        ops = _operands(m, n, k, recipe)
        if _one_kernel(*ops, None if bias is None else bias[:n]):
            return (m, n, k), ops
    pytest.fail(f"no shape of {PREFILL} runs scaled_mm_fp8_out in one kernel on this GPU ({recipe})")


@pytest.mark.parametrize("n,k", [(n, k) for n in (512, 1536, 7168) for k in (512, 7168)] + [(1536, 7056)])
@pytest.mark.parametrize("m", [1, 100, 128, 1000, 4096])
@pytest.mark.parametrize("recipe", RECIPES)
def test_equals_quantize_fp8_of_scaled_mm(recipe, m, n, k):
    torch.manual_seed(m * 131 + n + k + len(recipe))
    a, b, sa, sb = _operands(m, n, k, recipe)
    for bias in (None, torch.randn(n, device="cuda")):
        _poison_allocator(m, n)
        got = cutedsl_gemm.scaled_mm_fp8_out(a, b, sa, sb, bias)
        _same(got, _reference(a, b, sa, sb, bias))
        _same(cutedsl_gemm.scaled_mm_fp8_out(a, b, sa, sb, bias), got)  # the kept plan


def test_prefill_shapes_run_one_kernel_and_decode_two():
    """Dispatch's choice on this GPU: prefill shapes on 128-wide unswapped tiles run one kernel, decode sizes (swapped
    tiles) two."""
    for recipe in RECIPES:
        _one_kernel_operands(recipe)
        assert not _one_kernel(*_operands(1, 7168, 7168, recipe))


def _gemm_twin(inst):
    return next(i for i in INSTANCES if i == dataclasses.replace(inst, op="gemm"))


@pytest.mark.parametrize("inst", select(op=GEMM_FP8_OUT), ids=lambda i: i.name)
def test_every_tile_equals_its_scaled_mm_twin(inst):
    """Each FP8-output tile launched directly (dispatch picks few of them), with and without K splits: M, N and K that
    no tile divides (a partial last tile, a cluster's padding tiles, a partial last K block)."""
    m, n, k = 333, 1152, 2960
    torch.manual_seed(7)
    a, b, sa, sb = _operands(m, n, k, inst.recipe)
    va, vb = scale_layouts.kernel_views(inst.recipe, -(-k // 128), sa, sb)
    bias = torch.randn(n, device="cuda") if inst.bias_dtype else None
    slots = launch.launch_clusters(0, inst) * inst.cluster_m * inst.cluster_n
    for want in (1, 3):
        splits = dispatch.splits_for(inst, m, n, k, slots, want)
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch.launch(_gemm_twin(inst), a, b, va, vb, y, splits=splits, bias=bias)
        q, s = _poisoned_outputs(m, n)
        launch.plan(inst, m, n, splits, 0, k=k).run_fp8_out(a, b, q, s, va, vb, bias)
        _same((q, s), cutedsl_gemm.quantize_fp8(y, "1x128"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_special_values_follow_the_quantizer(recipe):
    """A row of A with a NaN, a row whose products overflow to +-inf (a huge scale of one K block; per-tensor scales
    have no row of their own), a zero row: the epilogue's groups take them as quantize_fp8 does (NaN stays NaN, inf
    saturates to +-448, an all-zero group has scale 1)."""
    torch.manual_seed(3)
    (_, n, _), (a, b, sa, sb) = _one_kernel_operands(recipe)
    a[0, 5] = float("nan")
    a[2] = 0
    if recipe != "tensor":
        sa = sa.clone()
        sa[1, 0] = 3e38
    q, s = cutedsl_gemm.scaled_mm_fp8_out(a, b, sa, sb)
    _same((q, s), _reference(a, b, sa, sb))
    assert torch.isnan(q[0].float()).all() and torch.isfinite(q[3:].float()).all()
    assert torch.equal(s[2], torch.ones_like(s[2])) and torch.equal(q[2].float(), torch.zeros(n, device="cuda"))
    if recipe != "tensor":
        assert (q[1].float().abs() == 448).any()


def test_bf16_bias_and_empty_calls_run_the_two_kernels():
    m, n, k = 4096, 7168, 1024
    a, b, sa, sb = _operands(m, n, k, DEEPSEEK)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    assert not _one_kernel(a, b, sa, sb, bias)
    _same(cutedsl_gemm.scaled_mm_fp8_out(a, b, sa, sb, bias), _reference(a, b, sa, sb, bias))
    empty = cutedsl_gemm.scaled_mm_fp8_out(a[:0], b, sa[:0], sb)
    _same(empty, _reference(a[:0], b, sa[:0], sb))
    with pytest.raises(ValueError, match="multiple of 128"):
        cutedsl_gemm.scaled_mm_fp8_out(a, b[:, :1040], sa, sb[:, :9])


def test_cuda_graph_replay():
    bias = torch.randn(7168, device="cuda")
    (m, n, k), (a, b, sa, sb) = _one_kernel_operands(DEEPSEEK, bias)
    bias = bias[:n]
    static = [t.clone() for t in (a, sa)]
    cutedsl_gemm.scaled_mm_fp8_out(static[0], b, static[1], sb, bias)  # warm-up: compiled, plan kept
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = cutedsl_gemm.scaled_mm_fp8_out(static[0], b, static[1], sb, bias)
    a2, _, sa2, _ = _operands(m, n, k, DEEPSEEK)
    static[0].copy_(a2)
    static[1].copy_(sa2)
    graph.replay()
    torch.cuda.synchronize()
    _same((q, s), _reference(a2, b, sa2, sb, bias))


def test_torch_compile_fullgraph_through_the_op():
    """Two layers: the first emits FP8 for the second, which takes it as its A operand (the DeepSeek recipe)."""
    (m, n, _), (a, b, sa, sb) = _one_kernel_operands(DEEPSEEK)
    _, b2, _, sb2 = _operands(m, 2048, n, DEEPSEEK)

    def two_layers(a, b, sa, sb, b2, sb2):
        q, s = cutedsl_gemm.scaled_mm_fp8_out(a, b, sa, sb)
        return q, s, cutedsl_gemm.scaled_mm(q, b2, s, sb2)

    eager = two_layers(a, b, sa, sb, b2, sb2)
    compiled = torch.compile(two_layers, fullgraph=True)(a, b, sa, sb, b2, sb2)
    _same(eager[:2], _reference(a, b, sa, sb))
    _same(compiled[:2], eager[:2])
    torch.testing.assert_close(compiled[2], eager[2], rtol=0, atol=0)

"""quantize_scaled_mm without a GPU: the instance table's rows of the GEMMs that quantize their activations, their
configuration rules, the compiled kernel's instructions, the call's validation and dispatch, and the op's fake
implementation."""

import dataclasses
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cutedsl_gemm import problem as P
from cutedsl_gemm import quantize_fp8, quantize_int8
from cutedsl_gemm.kernels.sm90.activation_quant import E4M3_MAX, INT8_MAX
from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmPlan
from cutedsl_gemm.numerics.formats import E4M3, INT8
from cutedsl_gemm.ops import library as L
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import INSTANCES, QUANT_GEMM, select
from cutedsl_gemm.tools.ptx_inspect import find_ptxas, inspect_instance, ptxas_performance_notes

HOPPER = ("sm_90a", 132)
DEV = torch.device("cuda", 0)


def _meta_call(m, n, k, x_dtype=torch.bfloat16, recipe="1x128_128x128", scale_b=None, weight=E4M3.torch_dtype):
    """Meta tensors of a call: x (M, K), b = W.t() (K, N) e4m3 (or ``weight``), scale_b in scaled_mm's layout."""
    kb = -(-k // 128)
    x = torch.empty(m, k, dtype=x_dtype, device="meta")
    b = torch.empty(n, k, dtype=weight, device="meta").t()
    if scale_b is None:
        scale_b = {"1x128_128x128": (kb, -(-n // 128)), "1x128_1x128": (kb, n), "row": (1, n), "tensor": ()}[recipe]
    return x, b, torch.empty(scale_b, device="meta")


PER_TOKEN = {"row": E4M3.torch_dtype, "int8": INT8.torch_dtype}  # per-channel weights: FP8, int8


def _describe(*call, bias=None, out_dtype=None, split_k=None):
    x = call[0]
    return P.describe_quantize_scaled_mm(*call, bias, out_dtype or x.dtype, None, None, split_k, DEV, target=HOPPER)


def test_table_has_quantizing_decode_rows():
    rows = select(op=QUANT_GEMM)
    assert {(i.recipe, i.a_dtype, i.b_dtype, i.accum) for i in rows} == {
        (r, a, w, acc) for r, w, acc in (("1x128_128x128", "e4m3", "promoted"), ("1x128_1x128", "e4m3", "promoted"),
                                         ("row", "e4m3", "promoted"), ("row", "int8", "fast"))
        for a in ("bf16", "fp16")}
    for i in rows:
        cfg = i.sm90_config()
        assert i.swap_ab and cfg.a_input == i.a_dtype and cfg.a_dtype == i.b_dtype and i.out_dtype == i.a_dtype
        assert i.tile_n <= Sm90GemmPlan.max_quantizing_tile_n and i.m_max <= 32 and i.can_split_k
        assert Sm90GemmPlan.register_split(cfg) == Sm90GemmPlan.quantizing_regs


def test_activations_are_quantized_to_the_weights_kind_with_the_pairing_scales():
    assert E4M3_MAX == E4M3.max_finite and INT8_MAX == INT8.max_finite
    assert P.activation_quantization("1x128_128x128", "e4m3") == ("e4m3", "1x128")
    assert P.activation_quantization("1x128_1x128", "e5m2") == ("e4m3", "1x128")
    assert P.activation_quantization("row", "e4m3") == ("e4m3", "row")
    assert P.activation_quantization("row", "int8") == ("int8", "row")
    assert P.activation_quantization("tensor", "int8") == ("int8", "tensor")
    for recipe, weight in (("1x128_128x128", E4M3.torch_dtype), ("row", E4M3.torch_dtype), ("row", INT8.torch_dtype),
                           ("tensor", E4M3.torch_dtype), ("tensor", INT8.torch_dtype)):
        problem, ops = _describe(*_meta_call(4, 512, 1024, recipe=recipe, weight=weight))
        assert (problem.recipe, problem.b_format, ops.scale_a) == (recipe, INT8.name if weight == torch.int8 else
                                                                   "e4m3", None)


@pytest.mark.parametrize("change,match", [
    (dict(recipe="tensor"), "1x128 groups"),
    (dict(recipe="128x128_128x128"), "per token"),
    (dict(cluster_m=2), "without clusters"),
    (dict(swap_ab=False), "decode schedule"),
    (dict(tile_n=64), "at most 32 wide"),
    (dict(a_input="fp32"), "'bf16' or 'fp16'"),
    (dict(b_dtype="int8"), "int8 operands pair with int8 only"),
    (dict(a_dtype="e5m2"), "quantized to e4m3 for an FP8 weight or to int8 for an int8 one"),
    (dict(a_dtype="int8", b_dtype="int8", accum="fast"), "int8 GEMMs scale in the epilogue"),
])
def test_config_rules_name_what_is_wrong(change, match):
    cfg = select(op=QUANT_GEMM)[0].sm90_config()
    with pytest.raises(ValueError, match=match):
        Sm90GemmPlan.check_config(dataclasses.replace(cfg, **change))


@pytest.mark.compile
def test_kernel_quantizes_in_the_producer_warps():
    """TMA brings the W tile and the unquantized token tile; the producer warps read the activations from shared
    memory in 16-byte vectors, quantize them with the group quantizer's e4m3 conversion, store them with 16-byte
    shared stores and fence them for the WGMMAs (e4m3 x e4m3)."""
    inst = next(i for i in select(op=QUANT_GEMM, a_dtype="bf16", bias_dtype=None, recipe="1x128_128x128")
                if (i.tile_m, i.tile_n) == (128, 16))
    rep = inspect_instance(inst)
    tma_load = "cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes"
    assert rep.ptx.count(tma_load) == 2 and not rep.has(r"ld\.global(?:\.nc)?\.v4\.b32")
    assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3")
    assert rep.has(r"ld\.shared\.v4\.b32") and rep.has(r"st\.shared\.v4\.b32")
    assert rep.has(r"cvt\.rn\.satfinite\.e4m3x2\.f32") and rep.has(r"fence\.proxy\.async\.shared::cta")
    assert rep.has(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+96\b")
    assert rep.has(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+200\b")
    assert rep.frame_bytes == 0, f"{rep.name} spills ({rep.frame_bytes} B stack frame)"
    ptxas = find_ptxas()
    if ptxas is not None:
        assert not ptxas_performance_notes(rep.ptx, inst.arch, ptxas)


@pytest.mark.compile
@pytest.mark.parametrize("weight", ["e4m3", "int8"])
def test_per_token_kernel_finds_the_token_scales_first(weight):
    """Per token, the three quantizing warps read the token tile's rows from global memory in 16-byte vectors (amax of
    packed bf16 pairs), reduce through shared memory between syncs of their own named barrier (96 threads), and
    quantize each stage with the quantizer's conversion: e4m3, or int8 by round-to-nearest-even."""
    inst = next(i for i in select(op=QUANT_GEMM, a_dtype="bf16", bias_dtype=None, recipe="row", b_dtype=weight)
                if (i.tile_m, i.tile_n) == (128, 16))
    rep = inspect_instance(inst)
    assert rep.has(r"ld\.global(?:\.nc)?\.v4\.b32") and rep.has(r"max\.bf16x2")
    assert len(re.findall(r"bar(?:rier)?\.sync(?:\.aligned)?\s+2,\s*96;", rep.ptx)) == 3
    if weight == "int8":
        assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.s32\.s8\.s8|wgmma\.mma_async\.sync\.aligned"
                       r"\.m64n16k32\.satfinite\.s32\.s8\.s8")
        assert rep.has(r"cvt\.rni\.s32\.f32") and not rep.has(r"cvt\.rn\.satfinite\.e4m3x2\.f32")
    else:
        assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3")
        assert rep.has(r"cvt\.rn\.satfinite\.e4m3x2\.f32")
    assert rep.has(r"st\.shared\.v4\.b32") and rep.has(r"fence\.proxy\.async\.shared::cta")
    assert rep.frame_bytes == 0, f"{rep.name} spills ({rep.frame_bytes} B stack frame)"
    ptxas = find_ptxas()
    if ptxas is not None:
        assert not ptxas_performance_notes(rep.ptx, inst.arch, ptxas)


@pytest.mark.parametrize("kind", PER_TOKEN)
def test_per_token_rows_run_when_asked(kind, monkeypatch):
    """Per-channel weights pair with per-token activations: the table has one-kernel rows for M <= 32 on the same
    decode tiles scaled_mm picks (run with in_kernel=True); a per-tensor weight has none."""
    monkeypatch.setattr(dispatch, "launch_clusters", lambda index, inst: HOPPER[1])
    for m in (1, 16, 17, 32):
        problem, ops = _describe(*_meta_call(m, 28672, 4096, recipe="row", weight=PER_TOKEN[kind]))
        assert problem.recipe == "row" and ops.scale_a is None and dispatch.has_quantizing_rows(problem)
        inst, _ = dispatch.select(problem)
        twin, _ = dispatch.select(dataclasses.replace(problem, act_format=None))
        assert inst.op == QUANT_GEMM and (inst.tile_m, inst.tile_n, inst.accum) == (twin.tile_m, twin.tile_n,
                                                                                   twin.accum)
    assert not dispatch.has_quantizing_rows(_describe(*_meta_call(33, 4096, 4096, recipe="row",
                                                                  weight=PER_TOKEN[kind]))[0])
    assert not dispatch.has_quantizing_rows(_describe(*_meta_call(1, 4096, 4096, recipe="tensor",
                                                                  weight=PER_TOKEN[kind]))[0])


def test_the_two_kernel_path_quantizes_as_the_weight_pairs():
    """What quantize_scaled_mm runs without the one kernel (CPU tensors: the reference quantizers), per weight kind."""
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w = torch.randn(64, 256)
    for quantize, gran, fmt in ((quantize_fp8, "row", "e4m3"), (quantize_int8, "row", "int8"),
                                (quantize_int8, "tensor", "int8"), (quantize_fp8, "tensor", "e4m3")):
        qw, sw = quantize(w, gran)
        problem, _ = _describe(x, qw.t(), sw.t() if gran == "row" else sw)
        assert P.activation_quantization(problem.recipe, problem.b_format) == (fmt, gran)


def test_quantizing_rows_cover_the_decode_token_tiles():
    for m in (1, 16, 17, 32):
        problem, ops = _describe(*_meta_call(m, 4096, 7168))
        assert problem.act_format == "bf16" and problem.recipe == "1x128_128x128" and ops.scale_a is None
        assert dispatch.has_quantizing_rows(problem)
        plain = dataclasses.replace(problem, act_format=None)
        rows = [i for i in INSTANCES if i.op == QUANT_GEMM and i.m_min <= m <= i.m_max and i.a_dtype == "bf16"
                and i.recipe == problem.recipe and i.bias_dtype is None]
        gemm_rows = [i for i in INSTANCES if i.op == "gemm" and i.m_min <= m <= i.m_max and i.a_dtype == "e4m3"
                     and i.b_dtype == "e4m3" and i.out_dtype == "bf16" and i.recipe == plain.recipe
                     and i.bias_dtype is None and not i.split_tail]
        # The same decode tiles compete for scaled_mm at these M: the one-kernel call and quantize_fp8 + scaled_mm
        # pick the same tile (so they give the same bits).
        assert {(i.tile_m, i.tile_n) for i in rows} == {(i.tile_m, i.tile_n) for i in gemm_rows}
    assert not dispatch.has_quantizing_rows(_describe(*_meta_call(33, 4096, 7168))[0])
    assert not dispatch.has_quantizing_rows(_describe(*_meta_call(4, 4096, 7168, torch.float32))[0])
    assert not dispatch.has_quantizing_rows(_describe(*_meta_call(4, 4096, 7168), out_dtype=torch.float32)[0])
    bias = torch.empty(4096, device="meta")
    assert dispatch.has_quantizing_rows(_describe(*_meta_call(4, 4096, 7168), bias=bias)[0])
    assert dispatch.has_quantizing_rows(_describe(*_meta_call(4, 4096, 7168, recipe="1x128_1x128"))[0])


@pytest.mark.parametrize("call,error,match", [
    (lambda: _meta_call(4, 512, 1000), ValueError, "multiple of 16"),
    (lambda: _meta_call(4, 512, 1024, torch.int8), TypeError, "bfloat16, float16 or float32"),
    (lambda: _meta_call(4, 512, 1024, scale_b=(3, 4)), ValueError, "scale_b shape .3, 4. matches no weight scaling"),
    (lambda: _meta_call(4, 512, 1024, scale_b=(512, 1), weight=torch.int8), ValueError, "matches no weight scaling"),
    (lambda: (torch.empty(4, 1024, dtype=torch.bfloat16, device="meta"),
              torch.empty(512, 1024, dtype=torch.bfloat16, device="meta").t(),
              torch.empty(8, 4, device="meta")), TypeError, "float8_e4m3fn"),
])
def test_bad_calls_are_refused_with_what_was_expected(call, error, match):
    with pytest.raises(error, match=match):
        _describe(*call())


def test_other_gpus_are_refused():
    with pytest.raises(RuntimeError, match="runs on Hopper"):
        P.describe_quantize_scaled_mm(*_meta_call(4, 512, 1024), None, torch.bfloat16, None, None, None, DEV,
                                      target=("sm_100a", 148))


def test_op_fake_gives_the_output_shape_and_dtype():
    with L.fake_target("sm_90a"), FakeTensorMode():
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.empty(3, 1024, dtype=dtype, device="cuda")
            b = torch.empty(512, 1024, dtype=E4M3.torch_dtype, device="cuda").t()
            y = L.OPS.quantize_scaled_mm(x, b, torch.empty(8, 4, device="cuda"))
            assert y.shape == (3, 512) and y.dtype == dtype
            y = L.OPS.quantize_scaled_mm(x, b, torch.empty(8, 4, device="cuda"), None, torch.float32)
            assert y.dtype == torch.float32
        for weight in PER_TOKEN.values():  # per-channel weights: the activations are quantized per token
            b = torch.empty(512, 1024, dtype=weight, device="cuda").t()
            y = L.OPS.quantize_scaled_mm(x, b, torch.empty(1, 512, device="cuda"))
            assert y.shape == (3, 512) and y.dtype == torch.float16
        with pytest.raises(ValueError, match="multiple of 16"):
            L.OPS.quantize_scaled_mm(torch.empty(3, 1000, dtype=torch.bfloat16, device="cuda"),
                                     torch.empty(512, 1000, dtype=E4M3.torch_dtype, device="cuda").t(),
                                     torch.empty(8, 4, device="cuda"))


@pytest.mark.parametrize("recipe", ["deepseek", "row", "int8"])
def test_layers_run_the_quantizer_and_the_gemm(recipe, monkeypatch):
    """The one kernel is asked for, never picked: a layer of every recipe it has rows for runs quantize_fp8 /
    quantize_int8 and scaled_mm (traced here on meta tensors through the ops' fakes), not quantize_scaled_mm."""
    from cutedsl_gemm import nn as cnn

    calls = []  # quantize_scaled_mm calls, seen where the op's fake describes them
    real = P.describe_quantize_scaled_mm
    monkeypatch.setattr(P, "describe_quantize_scaled_mm", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 384).to(torch.bfloat16), recipe).to("meta")
    x = torch.empty(2, 3, 256, dtype=torch.bfloat16, device="meta")
    with L.fake_target("sm_90a"):
        y = layer(x)
    assert y.shape == (2, 3, 384) and y.dtype == torch.bfloat16 and calls == []

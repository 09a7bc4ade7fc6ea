"""Every public op and every Hopper layer recipe replayed from a CUDA graph: after one eager call of the shape, a
captured call replayed on new inputs gives the eager call's bits (outputs poisoned before each replay)."""

import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm import nn as cnn
from cutedsl_gemm.numerics import int_packing as IP

pytestmark = pytest.mark.gpu

M, N, K = 24, 1024, 1024


def _fp8_weight(granularity):
    w = torch.randn(N, K, device="cuda")
    qw, sw = cutedsl_gemm.quantize_fp8(w, granularity)
    return qw.t(), sw.t()


def _int4_weight():
    q, s, z = IP.quantize_weights(torch.randn(N, K), bits=4, group=128)
    packed, ks, _ = IP.pack_weights(q, s, z, 128, bits=4, dtype=torch.bfloat16)
    return packed.cuda(), ks.cuda()


def _ops():
    """name -> (make inputs, call): the inputs a fresh random draw each time, the call on them."""
    b_row, sb_row = _fp8_weight("row")
    b_blk, sb_blk = _fp8_weight("128x128")
    packed, ks = _int4_weight()

    def act():
        return torch.randn(M, K, device="cuda", dtype=torch.bfloat16)

    def quantized_row():
        return cutedsl_gemm.quantize_fp8(act(), "row")

    return {
        "scaled_mm": (quantized_row, lambda qa, sa: cutedsl_gemm.scaled_mm(qa, b_row, sa, sb_row)),
        "quantize_scaled_mm": (lambda: (act(),), lambda x: cutedsl_gemm.quantize_scaled_mm(x, b_blk, sb_blk)),
        "quantize_scaled_mm_in_kernel": (lambda: (act(),), lambda x: cutedsl_gemm.quantize_scaled_mm(
            x, b_blk, sb_blk, in_kernel=True)),
        "scaled_mm_fp8_out": (lambda: cutedsl_gemm.quantize_fp8(act(), "1x128"),
                              lambda qa, sa: cutedsl_gemm.scaled_mm_fp8_out(qa, b_blk, sa, sb_blk)),
        "mm_weight_only": (lambda: (act(),), lambda x: cutedsl_gemm.mm_weight_only(x, packed, ks, group=128, bits=4)),
        "quantize_fp8": (lambda: (act(),), lambda x: cutedsl_gemm.quantize_fp8(x, "1x128")),
        "quantize_int8": (lambda: (act(),), lambda x: cutedsl_gemm.quantize_int8(x, "row")),
        "quantize_mx": (lambda: (act(),), lambda x: _parts(cutedsl_gemm.quantize_mx(x, "e4m3"))),
        "quantize_nvfp4": (lambda: (act(),), lambda x: _parts(cutedsl_gemm.quantize_nvfp4(x))),
    }


def _parts(t):
    return tuple(p for p in (t.data, t.scales, getattr(t, "global_scale", None)) if p is not None)


def _flat(out):
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


def _same(got, want):
    """The same bits (NaN codes included)."""
    for g, w in zip(_flat(got), _flat(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.reshape(-1).contiguous().view(torch.uint8), w.reshape(-1).contiguous().view(torch.uint8))


def _replays_like_eager(make, call, draws=3):
    static = [t.clone() for t in make()]
    call(*static)  # the one eager call of the shape: compiles and allocates outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(*static)
    for _ in range(draws):
        fresh = make()
        for s, f in zip(static, fresh):
            s.copy_(f)
        for t in _flat(out):
            if t.is_floating_point() and t.element_size() > 1:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _same(out, call(*fresh))


@pytest.mark.parametrize("name", ["scaled_mm", "quantize_scaled_mm", "quantize_scaled_mm_in_kernel",
                                  "scaled_mm_fp8_out", "mm_weight_only", "quantize_fp8", "quantize_int8",
                                  "quantize_mx", "quantize_nvfp4"])
def test_op_replays_like_eager(name):
    torch.manual_seed(0)
    make, call = _ops()[name]
    _replays_like_eager(make, call)


HOPPER_RECIPES = [name for name, r in cnn.LINEAR_RECIPES.items() if "sm_90a" in r.archs]


@pytest.mark.parametrize("recipe", HOPPER_RECIPES)
def test_layer_replays_like_eager(recipe):
    torch.manual_seed(0)
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(K, N).to("cuda", torch.bfloat16), recipe)
    with torch.no_grad():
        _replays_like_eager(lambda: (torch.randn(4, 6, K, device="cuda", dtype=torch.bfloat16),), layer)

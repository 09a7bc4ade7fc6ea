"""``fuse_qkv``: attention's q / k / v as one stacked GEMM. Which modules fuse and why not, the unchanged saved
format, the slices' results for the usual and for other call orders, torch.compile tracing; ``gpu``: the fused model
against the unfused converted model, CUDA graph replay, save_pretrained / from_pretrained."""

from __future__ import annotations

import pytest
import torch
from converted_models import DIMS, assert_round_trips, converted

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import fused_qkv as Q
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.tools import models as M


@pytest.mark.parametrize("recipe", ["row", "deepseek"])
def test_fuses_every_attention_and_keeps_the_saved_format(recipe):
    model = converted(recipe)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert cnn.fuse_qkv(model) == {"model.layers.0.self_attn": None, "model.layers.1.self_attn": None}
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Q.QKVSlice) and attn.qkv_proj.out_features == 256 + 2 * 128
    assert not list(attn.q_proj.buffers())  # the slices hold nothing
    assert_round_trips(recipe, cnn.fuse_qkv, before, model.state_dict())
    assert cnn.fuse_qkv(model) == {}  # already fused: left alone


def test_slices_run_one_gemm_for_the_usual_calls_and_stay_right_for_others(monkeypatch):
    model = converted("row", layers=1)
    attn = model.model.layers[0].self_attn
    cnn.fuse_qkv(model)
    calls = []
    monkeypatch.setattr(type(attn.qkv_proj), "forward", lambda self, x: calls.append(x) or x.new_full(
        (*x.shape[:-1], self.out_features), float(len(calls))))
    x, other = torch.randn(3, 256), torch.randn(3, 256)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert len(calls) == 1 and q.shape == (3, 256) and k.shape == v.shape == (3, 128)
    assert attn.q_proj._shared.x is None  # dropped once the three parts are taken
    k2 = attn.k_proj(other)  # another input: its own GEMM
    assert len(calls) == 2 and calls[-1] is other and k2.eq(2).all()
    assert attn.q_proj(x).eq(3).all() and len(calls) == 3  # a new input again: its own GEMM


def test_what_is_not_fused_says_why():
    model = M.random_llama(M.llama_config(1, DIMS), "cpu", torch.bfloat16)
    assert "convert the model first" in cnn.fuse_qkv(model)["model.layers.0.self_attn"]
    cnn.convert(model, "int8", filter=lambda name, m: name != "lm_head")
    assert "'int8'" in cnn.fuse_qkv(model)["model.layers.0.self_attn"]


def test_compile_traces_the_fused_attention(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = converted("row", layers=1)
    cnn.fuse_qkv(model)
    cnn.fuse_gated_mlps(model)
    model = model.to("meta")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend=backend)(ids, use_cache=False)
    assert out.logits.shape == (2, 5, 512)
    targets = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"]
    ops = [t for t in targets if "cutedsl_gemm" in t]
    # per layer: the stacked q/k/v, o_proj, gate_up; SiLU-and-multiply with its quantizer, the down GEMM
    assert ops == ["cutedsl_gemm.fp8_linear"] * 3 + ["cutedsl_gemm.silu_mul_quantize_fp8", "cutedsl_gemm.scaled_mm"]


# ------------------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek"])
def test_fused_attention_gives_the_unfused_outputs(recipe):
    model = converted(recipe, "cuda", seed=4)
    ids = torch.randint(0, 512, (3, 17), device="cuda")
    with torch.no_grad():
        want = model(ids).logits
        cnn.fuse_qkv(model)
        got = model(ids).logits
    # the same codes and scales; the stacked GEMM's tiles may differ from the three GEMMs'
    assert R.rel_error(got.float(), want.float()) < 1e-2


@pytest.mark.gpu
def test_fused_model_replays_in_a_cuda_graph_and_saves(tmp_path):
    model = converted("row", "cuda", layers=1)
    cnn.fuse_qkv(model)
    cnn.fuse_gated_mlps(model)
    ids = torch.randint(0, 512, (2, 9), device="cuda")
    with torch.no_grad():
        want = model(ids).logits.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids).logits
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        cnn.save_pretrained(model, tmp_path)
        loaded, _ = cnn.from_pretrained(tmp_path)
        cnn.fuse_qkv(loaded)
        cnn.fuse_gated_mlps(loaded)
        assert torch.equal(loaded(ids).logits, want)


def test_fuse_does_both():
    model = converted("deepseek", layers=1)
    result = cnn.fuse(model)
    assert result == {"model.layers.0.self_attn": None, "model.layers.0.mlp": None}
    assert isinstance(model.model.layers[0].mlp, cnn.QuantizedGatedMLP)
    assert isinstance(model.model.layers[0].self_attn.v_proj, Q.QKVSlice)

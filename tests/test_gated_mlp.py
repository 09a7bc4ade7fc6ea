"""``fuse_gated_mlps`` / ``QuantizedGatedMLP``: which MLPs fuse and why not, the stacked buffers, the unchanged saved
format (state_dict keys and bits, loading either form), torch.compile tracing; ``gpu``: the fused model against the
unfused converted model and the bf16 model, CUDA graph replay, save_pretrained / from_pretrained."""

from __future__ import annotations

import pytest
import torch
from converted_models import DIMS, assert_round_trips, bits, converted

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import gated_mlp as G
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import ScaleGranularity
from cutedsl_gemm.tools import models as M


@pytest.mark.parametrize("recipe", ["row", "deepseek"])
def test_fuses_every_mlp_and_keeps_the_saved_format(recipe):
    model = converted(recipe)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = cnn.fuse_gated_mlps(model)
    assert result == {"model.layers.0.mlp": None, "model.layers.1.mlp": None}
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, cnn.QuantizedGatedMLP) and mlp.gate_up_proj.out_features == 2 * 384
    # the unfused state dict loads into the fused model, and the fused model's into an unfused one
    assert_round_trips(recipe, cnn.fuse_gated_mlps, before, model.state_dict())
    gate, up, down = model.model.layers[1].mlp.unfused()
    key = "model.layers.1.mlp."
    assert torch.equal(bits(gate.weight), bits(before[key + "gate_proj.weight"]))
    assert torch.equal(up.weight_scale, before[key + "up_proj.weight_scale"])
    assert down is model.model.layers[1].mlp.down_proj


def test_the_stacked_scales_follow_the_weights():
    model = converted("deepseek")
    mlp = model.model.layers[0].mlp
    fused = cnn.QuantizedGatedMLP.fused(mlp)
    # DeepSeek's (K / 128, N / 128) blocks: gate's 3 block columns then up's
    assert fused.gate_up_proj.weight_scale.shape == (256 // 128, 2 * 384 // 128)
    assert torch.equal(fused.gate_up_proj.weight_scale[:, 3:], mlp.up_proj.weight_scale)
    w = fused.gate_up_proj.dequantize()
    assert torch.equal(w[:384], mlp.gate_proj.dequantize()) and torch.equal(w[384:], mlp.up_proj.dequantize())


def test_what_is_not_fused_says_why():
    model = M.random_llama(M.llama_config(2, DIMS), "cpu", torch.bfloat16)
    assert all("convert the model first" in why for why in cnn.fuse_gated_mlps(model).values())
    cnn.convert(model, "int8", filter=lambda name, m: name != "lm_head")
    why = cnn.fuse_gated_mlps(model)["model.layers.0.mlp"]
    assert "'int8'" in why and "'row' or 'deepseek'" in why
    model = converted("row")
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: None)
    result = cnn.fuse_gated_mlps(model)
    assert result["model.layers.0.mlp"] == "its act_fn is not SiLU"
    assert "forward hooks" in result["model.layers.1.mlp"]
    with pytest.raises(ValueError, match="cannot be fused: its act_fn is not SiLU"):
        cnn.QuantizedGatedMLP.fused(model.model.layers[0].mlp)


def test_another_forward_is_not_fused():
    class Swapped(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, \
                mlp.act_fn

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    model = converted("row", layers=1)
    odd = Swapped(model.model.layers[0].mlp)
    assert "forward is not" in G.gated_mlp_unsupported(odd)


def test_compile_traces_the_fused_mlp(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = converted("row", layers=1)
    cnn.fuse_gated_mlps(model)
    mlp = model.model.layers[0].mlp.to("meta")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    y = torch.compile(mlp, fullgraph=True, backend=backend)(torch.empty(2, 5, 256, dtype=torch.bfloat16,
                                                                        device="meta"))
    assert y.shape == (2, 5, 256) and y.dtype == torch.bfloat16
    targets = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"]
    ops = ["fp8_linear", "silu_mul_quantize_fp8", "scaled_mm"]  # gate_up, SiLU-and-multiply and its quantizer, down
    assert [t for t in targets if "cutedsl_gemm" in t] == [f"cutedsl_gemm.{op}" for op in ops]


def test_tensor_parallel_refuses_fused_mlps():
    from cutedsl_gemm.nn import parallel

    model = converted("row", layers=1)
    cnn.fuse_gated_mlps(model)

    class Mesh:
        def size(self):
            return 2

    with pytest.raises(ValueError, match="parallelize it without fuse_gated_mlps"):
        parallel.parallelize(model, Mesh())


# ------------------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------------------


def _emulated_mlp(mlp, x, recipe):
    """The fused MLP's numerics in float64 on its dequantized weights: x quantized by the recipe, the gate_up GEMM
    rounded to x's dtype, ``reference.silu_mul`` quantized again, the down GEMM rounded to x's dtype."""
    gran = ScaleGranularity.named(G.GATED_RECIPES[recipe])
    qx, sx = R.quantize(x, gran)
    h = (R.dequantize(qx, sx, gran).double() @ mlp.gate_up_proj.dequantize(torch.float64).t()).to(x.dtype)
    qa, sa = R.quantize(R.silu_mul(h), gran)
    return (R.dequantize(qa, sa, gran).double() @ mlp.down_proj.dequantize(torch.float64).t()).to(x.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek"])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_fused_mlp_matches_its_float64_emulation(recipe, tokens):
    model = converted(recipe, "cuda", layers=1, seed=tokens)
    cnn.fuse_gated_mlps(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to("cuda", torch.bfloat16)
    y = torch.full((tokens, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        y.copy_(mlp(x))
    assert torch.isfinite(y).all()
    # all but the gate_up outputs that fp32 accumulation rounds to the other bf16 neighbour and the SiLU's last bit,
    # and the FP8 codes of the down projection's input those move (0.5-0.75% measured on an H200; a half or a scale
    # block out of place is O(1))
    assert R.rel_error(y, _emulated_mlp(mlp, x, recipe)) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek"])
def test_fused_model_is_as_close_to_bf16_as_the_unfused_one(recipe):
    config = M.llama_config(2, dict(DIMS, hidden_size=512, intermediate_size=1408))
    base = M.random_llama(config, "cuda", torch.bfloat16, seed=3)
    ours = M.sharing_copy(base)
    cnn.convert(ours, recipe, filter=lambda name, m: name != "lm_head")
    fused = M.sharing_copy(ours)
    assert all(why is None for why in cnn.fuse_gated_mlps(fused).values())
    ids = torch.randint(0, config.vocab_size, (3, 17), device="cuda")
    with torch.no_grad():
        want, plain, got = (m(ids).logits.float() for m in (base, ours, fused))
    assert torch.isfinite(got).all()
    # the unfused MLP rounds SiLU(gate) and its product with up to bf16 one after the other, the fused one once:
    # FP8 codes of the down projection's input move, by less than the quantization error itself
    err_plain = R.rel_error(plain, want)
    assert R.rel_error(got, want) < 1.2 * err_plain + 1e-3
    assert R.rel_error(got, plain) < err_plain


@pytest.mark.gpu
def test_fused_mlp_replays_in_a_cuda_graph():
    model = converted("row", "cuda", layers=1)
    cnn.fuse_gated_mlps(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(4, 256, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        mlp(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mlp(x)
        for seed in (1, 2):
            x.copy_(torch.randn(4, 256, generator=torch.Generator().manual_seed(seed)).to(x))
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, mlp(x))


@pytest.mark.gpu
def test_fused_model_saves_and_loads(tmp_path):
    model = converted("row", "cuda")
    cnn.fuse_gated_mlps(model)
    cnn.save_pretrained(model, tmp_path)
    loaded, report = cnn.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (2, 9), device="cuda")
    cnn.fuse_gated_mlps(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_every_stackable_recipe_has_its_gated_quantizer():
    from cutedsl_gemm.nn import stacked

    assert tuple(G.GATED_RECIPES) == stacked.STACKABLE_RECIPES

"""cutedsl_gemm.nn: converting a tiny transformers Llama (which layers, which skipped and why), the saved format
(state_dict / load_state_dict, safetensors), bad inputs; the int4 weight-only recipes' group sizes and zero points
against the torch reference. `-m gpu`: layers and a converted model against the unconverted ones, every Hopper
recipe; `-m blackwell`: the MXFP8 / NVFP4 layers."""

import copy
import types

import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._subclasses.fake_tensor import FakeTensorMode

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import linear as layer_module
from cutedsl_gemm.nn.recipes import LinearRecipe, fp8_operand, packed_operand
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import RECIPES, ScaleGranularity
from cutedsl_gemm.ops import library as L

G = ScaleGranularity
RECIPE_NAMES = list(cnn.LINEAR_RECIPES)
INT4_RECIPES = [name for name, r in cnn.LINEAR_RECIPES.items() if r.element == "int4"]
# hidden 128, intermediate 120 (down_proj: K = 120, a multiple of 8 but not 16), vocabulary 100 (lm_head: N = 100)
TINY = dict(vocab_size=100, hidden_size=128, intermediate_size=120, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
                                                                "self_attn.v_proj", "self_attn.o_proj",
                                                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
CONVERTED = [n for n in LINEARS if not n.endswith("down_proj")]
# what the kernels refuse, in the words of the ops' checks, by recipe
SKIPPED_K = {"row": "multiple of 16 for the FP8 kernels", "deepseek": "multiple of 16 for the FP8 kernels",
             "tensor": "multiple of 16 for the FP8 kernels", "mxfp8": "multiple of the scale block 32",
             "nvfp4": "multiple of the scale block 16", "int8": "multiple of 16 for the FP8 kernels",
             "int8_weight": None} | {
                 name: f"multiple of the group size: K=120, group={cnn.LINEAR_RECIPES[name].group}"
                 for name in INT4_RECIPES}
SKIPPED_N = {r: "(N % 8 == 0)" for r in SKIPPED_K} | {"int8_weight": "multiple of 8"} | {
    name: "multiple of 8" for name in INT4_RECIPES}
DOWN = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


@pytest.fixture(autouse=True)
def _as_without_a_gpu(request, monkeypatch):
    """The CPU tier converts as a machine without a GPU does (checked for the recipe's first arch), whatever GPU
    the machine has."""
    if "gpu" not in request.keywords and "blackwell" not in request.keywords:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def tiny_llama(**overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides})).to(torch.bfloat16)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in zip(a.values(),
                                                                                                     b.values()))


# ------------------------------------------------------------------------------------------------
# conversion
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_convert_tiny_llama_says_what_it_skipped(recipe):
    model = tiny_llama()
    report = cnn.convert(model, recipe)
    converted = CONVERTED if SKIPPED_K[recipe] else LINEARS
    assert report.recipe == recipe and report.converted == converted
    assert list(report.skipped) == ([*DOWN, "lm_head"] if SKIPPED_K[recipe] else ["lm_head"])
    if SKIPPED_K[recipe]:  # (int8_weight takes K = 120: per-channel scales, rows of 16-byte multiples)
        assert report.skipped["model.layers.0.mlp.down_proj"].startswith("K=120, N=128: ")
        assert SKIPPED_K[recipe] in report.skipped["model.layers.1.mlp.down_proj"]
    assert SKIPPED_N[recipe] in report.skipped["lm_head"]
    assert all("\n" not in why for why in report.skipped.values())
    for name, module in model.named_modules():
        if name in converted:
            assert type(module) is cnn.QuantizedLinear and module.recipe == recipe
        elif name in report.skipped:
            assert type(module) is torch.nn.Linear
    assert f"{len(converted)} linear layers converted, {len(report.skipped)} skipped" in str(report)


def test_convert_filter_ties_and_subclasses():
    model = tiny_llama(vocab_size=128, tie_word_embeddings=True)
    model.model.layers[0].extra = torch.nn.modules.linear.NonDynamicallyQuantizableLinear(64, 64)
    report = cnn.convert(model, "row", filter=lambda name, m: "layers.1." not in name)
    assert report.converted == [n for n in CONVERTED if "layers.1." not in n]
    assert report.skipped["model.layers.1.self_attn.q_proj"] == "excluded by filter"
    assert report.skipped["lm_head"] == ("its weight is tied to model.embed_tokens.weight: quantizing it would untie "
                                         "them")
    assert report.skipped["model.layers.0.extra"].startswith("NonDynamicallyQuantizableLinear subclasses nn.Linear")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_module_shared_by_two_parents_is_converted_once():
    shared = torch.nn.Linear(64, 32)
    model = torch.nn.ModuleDict({"a": torch.nn.Sequential(shared), "b": torch.nn.Sequential(shared)})
    report = cnn.convert(model, "tensor")
    assert report.converted == ["a.0"]
    assert model["a"][0] is model["b"][0] and isinstance(model["b"][0], cnn.QuantizedLinear)


def test_convert_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="unknown linear recipe 'fp8'; expected one of 'row', 'deepseek'"):
        cnn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "fp8")
    with pytest.raises(TypeError, match="QuantizedLinear.from_linear"):
        cnn.convert(torch.nn.Linear(64, 64))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32, got torch.float64"):
        cnn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=torch.float64)))
    with pytest.raises(ValueError, match="meta device"):
        cnn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64, device="meta")))
    with pytest.raises(TypeError, match="float16"):  # the MX quantizer kernel takes bf16 / fp32 activations
        cnn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=torch.float16)), "mxfp8")


def test_a_recipe_the_gpu_does_not_run_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(layer_module, "device_info", lambda index: ("sm_90a", 132))
    with pytest.raises(ValueError, match=r"runs on sm_100a, not on this GPU \(sm_90a\); recipes for sm_90a: 'row', "
                                         r"'deepseek', 'tensor'"):
        cnn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "nvfp4")
    monkeypatch.setattr(layer_module, "device_info", lambda index: ("sm_80", 108))
    with pytest.raises(ValueError, match="it has no kernels for this GPU"):
        cnn.QuantizedLinear.from_linear(torch.nn.Linear(64, 64), "row")


def test_from_linear_errors():
    with pytest.raises(TypeError, match="expected a torch.nn.Linear"):
        cnn.QuantizedLinear.from_linear(torch.nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match=r"cannot run recipe 'row' on sm_90a: K=120, N=64: K \(x.shape\[1\]\) must be"):
        cnn.QuantizedLinear.from_linear(torch.nn.Linear(120, 64))
    with pytest.raises(ValueError, match="unknown linear recipe"):
        cnn.QuantizedLinear(64, 64, recipe="int3")


@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor"])
def test_quantized_weight_is_the_reference_in_scaled_mm_layout(recipe):
    torch.manual_seed(0)
    linear = torch.nn.Linear(320, 272).to(torch.bfloat16)
    layer = cnn.QuantizedLinear.from_linear(linear, recipe)
    gran = RECIPES[layer.recipe if recipe != "deepseek" else "1x128_128x128"].b
    q, plain = R.quantize(linear.weight.detach(), gran)
    assert torch.equal(_bits(layer.weight), _bits(q))
    assert layer.weight_scale.is_contiguous()
    assert torch.equal(layer.weight_scale, plain.reshape(()) if gran is G.TENSOR else plain.t())
    assert layer.bias.dtype == torch.float32 and torch.equal(layer.bias, linear.bias.float())


def test_integer_weights_are_the_reference_in_kernel_layout():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 192).to(torch.float16)
    w = linear.weight.detach()
    layer = cnn.QuantizedLinear.from_linear(linear, "int8")
    q, s = R.quantize_int8_reference(w, "row")
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, s.t())
    for recipe, bits, group in (("int8_weight", 8, 0), ("int4_weight", 4, 128)):
        layer = cnn.QuantizedLinear.from_linear(linear, recipe)
        w_int, scales, _ = IP.quantize_weights(w, bits, group)
        got_int, got_scales, _ = IP.unpack_weights(layer.weight, layer.weight_scale, k=256, group=group, bits=bits)
        assert torch.equal(got_int, w_int)
        # per channel fp32; group-wise in the activations' dtype (the linear's, fp16 here)
        assert layer.weight_scale.dtype == (torch.float32 if group == 0 else torch.float16)
        assert torch.equal(got_scales, scales.to(layer.weight_scale.dtype))
    assert "int4 weights, group-128 scales" in cnn.LINEAR_RECIPES["int4_weight"].describe()
    assert cnn.LINEAR_RECIPES["int8"].archs == cnn.LINEAR_RECIPES["int4_weight"].archs == ("sm_90a",)


def test_weight_only_layers_keep_the_activation_dtype_of_their_scales():
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 128).to(torch.bfloat16), "int4_weight")
    fp16 = cnn.QuantizedLinear(256, 128, recipe="int4_weight", dtype=torch.float16)
    assert fp16.weight_scale.dtype == torch.float16 and layer.weight_scale.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"weight_scale: expected torch.float16 \(recipe 'int4_weight'\)"):
        fp16.load_state_dict(layer.state_dict())
    with pytest.raises(TypeError, match="x must be torch.bfloat16 or torch.float16"):  # the kernel's own rule
        cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 128), "int4_weight")
    with pytest.raises(ValueError, match="leaves the activations unquantized"):
        r = cnn.LINEAR_RECIPES["int4_weight"]
        r.quantize(torch.zeros(4, 256), "a", r, L.EAGER)


# ------------------------------------------------------------------------------------------------
# saved format
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_state_dict_round_trip_through_safetensors(recipe, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model = tiny_llama()
    cnn.convert(model, recipe)
    state = model.state_dict()
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert bytes(state["model.layers.0.self_attn.q_proj._extra_state"].tolist()).decode() == \
        f"cutedsl_gemm/{cnn.FORMAT_VERSION}/{recipe}"
    assert (q.dtype, tuple(q.shape)) == {"nvfp4": (torch.float4_e2m1fn_x2, (128, 64)), "int8": (torch.int8, (128, 128)),
                                         "int8_weight": (torch.int32, (2, 1, 2048))}.get(
                                             recipe, (torch.int32, (2, 1, 1024)) if recipe in INT4_RECIPES
                                             else (torch.float8_e4m3fn, (128, 128)))
    assert ("model.layers.0.self_attn.q_proj.weight_global_scale" in state) == (recipe == "nvfp4")
    r = cnn.LINEAR_RECIPES[recipe]
    zero = state.get("model.layers.0.self_attn.q_proj.weight_zero")
    assert (zero is not None) == r.zeros  # K = N = 128: (128 / group, 128) zero points in the activations' dtype
    assert zero is None or (zero.dtype, tuple(zero.shape)) == (torch.bfloat16, (128 // r.group, 128))
    st.save_file(state, tmp_path / "model.safetensors")  # contiguous tensors, none shared
    fresh = tiny_llama()
    torch.manual_seed(1)
    for p in fresh.parameters():
        p.data.normal_()
    cnn.convert(fresh, recipe)
    assert not _same_state(fresh.state_dict(), state)
    fresh.load_state_dict(st.load_file(tmp_path / "model.safetensors"))
    assert _same_state(fresh.state_dict(), state)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_an_empty_layer_has_the_converted_layout(recipe):
    converted = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 384).to(torch.bfloat16), recipe)
    empty = cnn.QuantizedLinear(256, 384, bias=True, recipe=recipe)
    assert {k: (v.dtype, v.shape, v.stride()) for k, v in empty.state_dict().items()} == \
        {k: (v.dtype, v.shape, v.stride()) for k, v in converted.state_dict().items()}
    empty.load_state_dict(converted.state_dict())
    assert _same_state(empty.state_dict(), converted.state_dict())
    assert "recipe='%s'" % recipe in repr(empty)


def test_loading_refuses_another_recipe_or_unconverted_weights():
    model = tiny_llama()
    cnn.convert(model, "row")
    other = tiny_llama()
    cnn.convert(other, "tensor")
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="holds recipe 'row' weights and this layer runs recipe 'tensor'"):
        other.load_state_dict(model.state_dict())
    assert _same_state(other.state_dict(), before)  # refused before anything was copied
    with pytest.raises(ValueError, match=r"q_proj.weight: expected torch.float8_e4m3fn \(recipe 'row'\), got "
                                         "torch.bfloat16"):
        model.load_state_dict(tiny_llama().state_dict())


def test_casting_the_model_keeps_the_quantized_dtypes():
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), "deepseek")
    dtypes = {k: v.dtype for k, v in layer.state_dict().items()}
    layer.half()
    layer.to(torch.bfloat16)
    assert {k: v.dtype for k, v in layer.state_dict().items()} == dtypes
    layer.to("meta")
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float8_e4m3fn


def test_forward_on_the_cpu_is_refused():
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), "row")
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))


def test_forward_shapes_and_input_errors_from_metadata():
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), "row").to("meta")
    with L.fake_target("sm_90a"):
        assert layer(torch.empty(2, 3, 64, dtype=torch.float16, device="meta")).shape == (2, 3, 32)
        with pytest.raises(ValueError, match="inner dimensions differ"):
            layer(torch.empty(2, 48, dtype=torch.bfloat16, device="meta"))
        with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
            layer(torch.empty(2, 64, dtype=torch.int32, device="meta"))


# ------------------------------------------------------------------------------------------------
# int4 weight-only recipes: every group size, symmetric or with zero points
# ------------------------------------------------------------------------------------------------


def test_int4_recipes_cover_every_group_with_and_without_zero_points():
    rows = {(cnn.LINEAR_RECIPES[name].group, cnn.LINEAR_RECIPES[name].zeros): name for name in INT4_RECIPES}
    assert rows == {(128, False): "int4_weight", (64, False): "int4_weight_g64", (32, False): "int4_weight_g32",
                    (128, True): "int4_weight_zp", (64, True): "int4_weight_g64_zp", (32, True): "int4_weight_g32_zp"}
    for name in INT4_RECIPES:  # the instance table has Hopper kernels for each (group, zero points) pair
        r = cnn.LINEAR_RECIPES[name]
        assert r.weight_only and r.bits == 4 and r.keeps_launch and r.archs == ("sm_90a",), name
    assert cnn.LINEAR_RECIPES["int4_weight_g64_zp"].describe() == (
        "'int4_weight_g64_zp' (int4 weights, group-64 scales and zero points; bf16 / fp16 activations)")


def test_int4_recipe_archs_are_the_instance_tables_rows_of_its_group_and_zero_points(monkeypatch):
    from cutedsl_gemm.nn import recipes
    from cutedsl_gemm.selection.instances import table

    rows = tuple(i for i in table() if i.recipe != "group64_zeros")
    monkeypatch.setattr(recipes, "table", lambda: rows)
    assert {name: cnn.LINEAR_RECIPES[name].archs for name in INT4_RECIPES} == {
        name: () if name == "int4_weight_g64_zp" else ("sm_90a",) for name in INT4_RECIPES}


def test_a_recipe_outside_the_kernels_formats_is_refused():
    with pytest.raises(ValueError, match=r"group must be one of \(32, 64, 128\)"):
        LinearRecipe("int4_weight_g16", None, packed_operand, "int4", 16)
    with pytest.raises(ValueError, match="zero points come with group-wise int4 scales"):
        LinearRecipe("int8_weight_zp", None, packed_operand, "int8", 0, True)
    with pytest.raises(ValueError, match="group and zeros belong to weight-only recipes"):
        LinearRecipe("row_zp", RECIPES["row"], fp8_operand, zeros=True)


@pytest.mark.parametrize("typo", ["int4_weight_g16", "int4_weights_zp", "int4_weight_zp_g64", "int4_weight_g128"])
def test_a_misspelt_int4_recipe_is_refused_with_the_names(typo):
    with pytest.raises(ValueError, match=rf"unknown linear recipe '{typo}'; expected one of .*'int4_weight_g64_zp'"):
        cnn.convert(torch.nn.Sequential(torch.nn.Linear(128, 64)), typo)
    with pytest.raises(ValueError, match=f"unknown linear recipe '{typo}'"):
        cnn.QuantizedLinear(128, 64, recipe=typo)


@pytest.mark.parametrize("recipe,k", [("int4_weight_g64", 96), ("int4_weight_g64_zp", 160), ("int4_weight_g32", 80),
                                      ("int4_weight_g32_zp", 48), ("int4_weight_zp", 192)])
def test_k_not_a_multiple_of_the_group_is_refused(recipe, k):
    group = cnn.LINEAR_RECIPES[recipe].group
    with pytest.raises(ValueError, match=rf"cannot run recipe '{recipe}' on sm_90a: K={k}, N=64: K must be a "
                                         rf"multiple of the group size: K={k}, group={group}$"):
        cnn.QuantizedLinear.from_linear(torch.nn.Linear(k, 64).to(torch.bfloat16), recipe)


def test_convert_skips_the_layers_whose_k_the_group_does_not_divide():
    # K = 96, 64, 160, 128: group 32 divides every K, 64 two of them, 128 one
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Linear(64, 160), torch.nn.Linear(160, 128),
                                torch.nn.Linear(128, 96)).to(torch.bfloat16)
    converts = {32: ["0", "1", "2", "3"], 64: ["1", "3"], 128: ["3"]}
    for recipe in INT4_RECIPES:
        r, m = cnn.LINEAR_RECIPES[recipe], copy.deepcopy(model)
        report = cnn.convert(m, recipe)
        assert report.converted == converts[r.group], recipe
        assert report.skipped == {
            name: f"K={model[int(name)].in_features}, N={model[int(name)].out_features}: K must be a multiple of the "
                  f"group size: K={model[int(name)].in_features}, group={r.group}"
            for name in ("0", "1", "2", "3") if name not in converts[r.group]}, recipe
        for name in converts[r.group]:
            assert m[int(name)].recipe == recipe and (m[int(name)].weight_zero is not None) == r.zeros


@pytest.mark.parametrize("recipe", INT4_RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_weights_are_the_reference_and_dequantize_within_half_a_step(recipe, dtype):
    r = cnn.LINEAR_RECIPES[recipe]
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 192, bias=False)
    with torch.no_grad():
        linear.weight.normal_()  # Gaussian: the groups' ranges differ
    linear = linear.to(dtype)
    w = linear.weight.detach()
    layer = cnn.QuantizedLinear.from_linear(linear, recipe)
    w_int, scales, zeros = IP.quantize_weights(w, 4, r.group, symmetric=not r.zeros)
    got_int, got_scales, got_zeros = IP.unpack_weights(layer.weight, layer.weight_scale, layer.weight_zero, k=256,
                                                       group=r.group, bits=4)
    assert torch.equal(got_int, w_int)
    assert layer.weight_scale.dtype == dtype and torch.equal(got_scales, scales.to(dtype))
    if r.zeros:  # unsigned codes and integer zero points in [0, 15], (K / group, N) in the activations' dtype
        assert (layer.weight_zero.dtype, tuple(layer.weight_zero.shape)) == (dtype, (256 // r.group, 192))
        assert torch.equal(got_zeros, zeros.to(dtype)) and int(got_int.min()) >= 0
    else:
        assert layer.weight_zero is None and got_zeros is None and int(got_int.min()) < 0
    # the format's error: half a step of the fp32 scale, plus |q - z| times the scale's rounding to the dtype
    deq = R.dequantize_weights(got_int, got_scales, got_zeros, r.group)
    step = scales.double().repeat_interleave(r.group, dim=1)
    stored = got_scales.double().repeat_interleave(r.group, dim=1)
    bound = 0.5 * step * (1 + 1e-6) + (deq / stored).abs() * (step - stored).abs()
    assert bool(((deq - w.double()).abs() <= bound).all()), recipe


def test_smaller_groups_and_zero_points_quantize_closer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 256, bias=False)
    with torch.no_grad():
        linear.weight.normal_()
    linear = linear.to(torch.bfloat16)
    err = {}
    for recipe in INT4_RECIPES:
        r, layer = cnn.LINEAR_RECIPES[recipe], cnn.QuantizedLinear.from_linear(linear, recipe)
        unpacked = IP.unpack_weights(layer.weight, layer.weight_scale, layer.weight_zero, k=512, group=r.group, bits=4)
        err[r.group, r.zeros] = R.rel_error(R.dequantize_weights(*unpacked, r.group), linear.weight.detach().double())
    for zeros in (False, True):  # (Gaussian weights: 0.118, 0.108, 0.097 symmetric; 0.101, 0.091, 0.081 with zeros)
        assert err[32, zeros] < err[64, zeros] < err[128, zeros] < 0.125, err
    assert all(err[g, True] < err[g, False] for g in IP.GROUPS), err  # 16 levels over [min, max] against 15


def test_zero_points_are_saved_and_checked_on_load(tmp_path):
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 128).to(torch.bfloat16), "int4_weight_zp")
    state = layer.state_dict()
    zero = state["weight_zero"]
    assert list(state) == ["weight", "weight_scale", "weight_zero", "bias", "_extra_state"]
    assert (zero.dtype, tuple(zero.shape)) == (torch.bfloat16, (2, 128)) and torch.equal(zero, zero.round())
    empty = cnn.QuantizedLinear(256, 128, recipe="int4_weight_zp")
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "weight_zero"'):
        empty.load_state_dict({k: v for k, v in state.items() if k != "weight_zero"})
    fp16 = cnn.QuantizedLinear(256, 128, recipe="int4_weight_zp", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"weight_zero: expected torch.float16 \(recipe 'int4_weight_zp'\), got "
                                         "torch.bfloat16"):
        fp16.load_state_dict(state | {"weight_scale": state["weight_scale"].half()})
    with pytest.raises(ValueError, match="holds recipe 'int4_weight_zp' weights and this layer runs recipe "
                                         "'int4_weight'"):
        cnn.QuantizedLinear(256, 128, recipe="int4_weight").load_state_dict(state)
    symmetric = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 128).to(torch.bfloat16), "int4_weight")
    with pytest.raises(ValueError, match="holds recipe 'int4_weight' weights and this layer runs recipe "
                                         "'int4_weight_zp'"):
        empty.load_state_dict(symmetric.state_dict())
    empty.load_state_dict(state)
    assert _same_state(empty.state_dict(), state)
    st = pytest.importorskip("safetensors.torch")
    st.save_file(state, tmp_path / "layer.safetensors")
    loaded = cnn.QuantizedLinear(256, 128, recipe="int4_weight_zp")
    loaded.load_state_dict(st.load_file(tmp_path / "layer.safetensors"))
    assert _same_state(loaded.state_dict(), state)


def test_reassigned_zero_points_drop_the_kept_operands():
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 128).to(torch.bfloat16), "int4_weight_g32_zp")
    assert layer._eager_operands()[3] is layer.weight_zero
    layer.weight_zero = layer.weight_zero.clone()
    assert "_eager" not in layer.__dict__ and layer._eager_operands()[3] is layer.weight_zero


def test_the_layer_hands_its_zero_points_to_every_weight_only_call(monkeypatch):
    """quantized_matmul (the op's function), kept_launch (the layer's repeated calls) and the plan it keeps pass
    the zero points on: stand-ins for mm_weight_only record them (the GPU tests check the numbers)."""
    from cutedsl_gemm.nn import recipes

    seen = []

    def mm_weight_only(x, packed_w, scales, zeros=None, *, group, bits):
        seen.append((zeros, group, bits))
        return x.new_zeros(x.shape[0], scales.shape[1])

    class Plan:
        def run(self, x, packed_w, scales, zeros, out):
            seen.append((zeros, "kept"))
            return out.zero_()

    monkeypatch.setattr(recipes.W, "mm_weight_only", mm_weight_only)
    monkeypatch.setattr(recipes.W, "cached_plan", lambda x, packed_w, scales, zeros, **kw: (Plan(), (x.shape[0], 128)))
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 128).to(torch.bfloat16), "int4_weight_g64_zp")
    b, scale, global_scale, zero, bias, r = layer._eager_operands()
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    ops = types.SimpleNamespace(mm_weight_only=mm_weight_only)
    outputs = [recipes.quantized_matmul(x, b, scale, global_scale, zero, bias, r, ops)]
    y, run = recipes.kept_launch(x, b, scale, zero, bias, r)
    outputs += [y, run(x)]
    assert [(z is zero, *rest) for z, *rest in seen] == [(True, 64, 4), (True, 64, 4), (True, "kept")]
    for y in outputs:  # the stand-ins' zeros plus the bias, in x's shape
        assert torch.equal(y, bias.to(torch.bfloat16).expand(2, 3, 128))


def test_fp8_linear_fake_takes_the_zero_points():
    r = cnn.LINEAR_RECIPES["int4_weight_g64_zp"]
    with L.fake_target("sm_90a"), FakeTensorMode():
        qw, sw, gw, zw = r.quantize_weight(torch.empty(384, 256, dtype=torch.float16, device="cuda"), L.OPS)
        assert (tuple(qw.shape), tuple(sw.shape), tuple(zw.shape), gw) == ((6, 2, 1024), (4, 384), (4, 384), None)
        assert sw.dtype == zw.dtype == torch.float16
        for shape in ((3, 5, 256), (256,), (7, 256)):
            x = torch.empty(shape, dtype=torch.float16, device="cuda")
            y = L.OPS.fp8_linear(x, qw, sw, None, None, r.name, zw)
            assert y.shape == (*shape[:-1], 384) and y.dtype == torch.float16
        with pytest.raises(ValueError, match="'int4_weight_g64_zp' takes zero points: weight_zero must be given"):
            L.OPS.fp8_linear(x, qw, sw, None, None, r.name)
        with pytest.raises(ValueError, match="'int4_weight_g64' has no zero points: weight_zero must be None"):
            L.OPS.fp8_linear(x, qw, sw, None, None, "int4_weight_g64", zw)
        with pytest.raises(ValueError, match=r"zeros must be zero points \(K / group, N\), x's dtype: "
                                             r"torch.float16 of shape \(4, 384\), got torch.float16 \(2, 384\)"):
            L.OPS.fp8_linear(x, qw, sw, None, None, r.name, torch.empty(2, 384, dtype=torch.float16, device="cuda"))
        with pytest.raises(ValueError, match="zeros must be .* got torch.bfloat16"):
            L.OPS.fp8_linear(x, qw, sw, None, None, r.name, torch.empty(4, 384, dtype=torch.bfloat16, device="cuda"))
        with pytest.raises(ValueError, match="K must be a multiple of the group size: K=96, group=64"):
            w96 = r.quantize_weight(torch.empty(384, 96, dtype=torch.float16, device="cuda"), L.OPS)
            L.OPS.fp8_linear(torch.empty(2, 96, dtype=torch.float16, device="cuda"), w96[0], w96[1], None, None,
                             r.name, w96[3])


@pytest.mark.parametrize("recipe", ["int4_weight_g32_zp", "int4_weight_g64"])
def test_compile_int4_layer_records_one_op_with_its_zero_points(recipe):
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 384).to(torch.bfloat16), recipe).to("meta")
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    with L.fake_target("sm_90a"):
        y = compiled(torch.empty(3, 4, 256, dtype=torch.bfloat16, device="meta"))
    assert (y.shape, y.dtype) == ((3, 4, 384), torch.bfloat16)
    calls = [n for g in backend.graphs for n in g.graph.nodes if n.op == "call_function"
             and str(n.target).startswith("cutedsl_gemm.fp8_linear")]
    assert len(calls) == 1 and len(calls[0].args) == 7
    zero = calls[0].args[6]  # the layer's buffer, a graph input; None without zero points
    assert ("weight_zero" in str(zero)) if cnn.LINEAR_RECIPES[recipe].zeros else zero is None


# ------------------------------------------------------------------------------------------------
# GPU: against the unconverted layers and model
# ------------------------------------------------------------------------------------------------

# Relative error of a converted 512 -> 384 layer against the bf16 one on Gaussian data: the recipe's quantization
# error (the reference quantizers give 0.037 for the E4M3 recipes, 0.040 for MXFP8, 0.14 for NVFP4; 0.0085 for int8
# per token x per channel, 0.004 for int8 weights alone, 0.072 for int4 weights in groups of 128, 0.061-0.071 for
# every int4 group and zero-point recipe: nn.Linear's uniform weights gain little from smaller groups), with margin.
RECIPE_ERROR = {"row": 0.05, "deepseek": 0.05, "tensor": 0.05, "mxfp8": 0.06, "nvfp4": 0.2, "int8": 0.015,
                "int8_weight": 0.01} | {name: 0.1 for name in INT4_RECIPES}
INTEGER_RECIPES = ["int8", "int8_weight", "int4_weight"]


def _reference_output(layer, linear, x2):
    """float64 product of the reference quantizers' operands (the bits the kernels produce) + bias."""
    r = cnn.LINEAR_RECIPES[layer.recipe]
    bias = None if linear.bias is None else linear.bias.detach().float()
    w = linear.weight.detach()
    if r.weight_only:
        w_int, scales, zeros = IP.unpack_weights(layer.weight, layer.weight_scale, layer.weight_zero,
                                                 k=layer.in_features, group=r.group, bits=r.bits)
        out = R.reference_weight_only_mm(x2, w_int, scales, zeros, r.group)
        return out if bias is None else out + bias.double()
    if r.element == "int8":
        (qa, sa), (qw, sw) = R.quantize_int8_reference(x2, "row"), R.quantize_int8_reference(w, "row")
        return R.reference_int8_mm(qa, qw.t(), sa, sw.t(), bias)
    if r.quantize is fp8_operand:
        qa, sa = R.quantize(x2, r.scaling.a)
        qw, sw = R.quantize(w, r.scaling.b)
        return R.reference_gemm(qa, sa, qw, sw, r.scaling, bias)
    quant = (lambda t: R.quantize_mx_reference(t, r.element)) if r.scaling.name == "mx" else R.quantize_nvfp4_reference
    qa, qw = quant(x2), quant(w)
    return R.reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, global_scale_a=qa.global_scale,
                                      global_scale_b=qw.global_scale, bias=bias)


def _check_layer(recipe, dtype=torch.bfloat16):
    from gpu_operands import OUT_TOL

    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 384).to("cuda", dtype)
    layer = cnn.QuantizedLinear.from_linear(linear, recipe)
    layer_recipe = cnn.LINEAR_RECIPES[recipe]
    for shape in ((1, 512), (33, 512), (2, 7, 512)):
        x = torch.randn(shape, dtype=dtype, device="cuda")
        with torch.no_grad():
            y, want = layer(x), linear(x)
        assert y.shape == want.shape and y.dtype == dtype
        ref = _reference_output(layer, linear, x.reshape(-1, 512)).reshape(want.shape)
        # the same quantized operands: the output's rounding (the block-scaled and weight-only kernels' tolerances
        # of their tests: they round products or dequantized weights to a 16-bit type; the bias add rounds again)
        exact = not layer_recipe.weight_only and layer_recipe.scaling.scale_format == "fp32"
        assert R.rel_error(y, ref) <= (OUT_TOL[dtype] if exact else 8e-3)
        assert R.rel_error(y, want.double()) <= RECIPE_ERROR[recipe]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor", *INTEGER_RECIPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hopper_layer_matches_reference_and_unconverted(recipe, dtype):
    _check_layer(recipe, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", INT4_RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_layer_matches_its_dequantized_weight(recipe, dtype):
    """Every int4 group size, symmetric or with zero points: the layer's buffers through mm_weight_only into a
    NaN-poisoned output, the layer's own output (the same bits plus the bias), both against the float64 product of
    the dequantized weight."""
    from cutedsl_gemm.ops.weight_only import mm_weight_only

    r = cnn.LINEAR_RECIPES[recipe]
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 384).to("cuda", dtype)
    layer = cnn.QuantizedLinear.from_linear(linear, recipe)
    assert (layer.weight_zero is not None) == r.zeros
    for shape in ((1, 512), (33, 512), (2, 7, 512), (300, 512)):
        x = torch.randn(shape, dtype=dtype, device="cuda")
        x2 = x.reshape(-1, 512)
        out = torch.full((x2.shape[0], 384), float("nan"), dtype=dtype, device="cuda")
        mm_weight_only(x2, layer.weight, layer.weight_scale, layer.weight_zero, group=r.group, bits=r.bits, out=out)
        with torch.no_grad():
            y, want = layer(x), linear(x)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), "some outputs were never written"
        assert y.shape == want.shape and y.dtype == dtype
        assert torch.equal(y.reshape(-1, 384), out.add_(layer.bias))
        ref = _reference_output(layer, linear, x2)
        assert R.rel_error(y.reshape(-1, 384), ref) <= 8e-3, (recipe, dtype, shape)
        assert R.rel_error(y, want.double()) <= RECIPE_ERROR[recipe], (recipe, dtype, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("capture", ["torch.compile", "CUDA graph"])
def test_zero_point_layer_compiled_and_graph_captured(capture):
    """A zero-point layer under torch.compile(fullgraph=True, mode="reduce-overhead") (CUDA graph trees), and
    captured by hand in a CUDA graph after one eager call: the eager layer's bits, for new inputs too."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 384).to("cuda", torch.bfloat16)
    layer = cnn.QuantizedLinear.from_linear(linear, "int4_weight_g64_zp")
    xs = [torch.randn(4, 8, 512, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    with torch.no_grad():
        eager = [layer(x) for x in xs]
        ref = _reference_output(layer, linear, xs[0].reshape(-1, 512))
        assert R.rel_error(eager[0].reshape(-1, 384), ref) <= 8e-3
        if capture == "torch.compile":
            compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
            got = [compiled(x).clone() for x in xs]  # warm-up, record, replay
            torch._dynamo.reset()
        else:
            static_x = xs[0].clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = layer(static_x)
            got = []
            for x in xs:
                static_x.copy_(x)
                graph.replay()
                got.append(static_y.clone())
    for g, e in zip(got, eager):
        assert torch.equal(g, e)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor", *INTEGER_RECIPES, "int4_weight_g64_zp"])
def test_repeated_layer_calls_take_the_kept_launch(recipe):
    from cutedsl_gemm.nn.recipes import quantized_matmul

    torch.manual_seed(0)
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(512, 384).to("cuda", torch.bfloat16), recipe)
    for shape in ((5, 512), (2, 3, 512)):
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            first = layer(x)  # checked, launched, kept
            assert (x.shape, x.dtype, x.get_device()) in layer._launches
            again = layer(x)  # the kept launches
            full = quantized_matmul(x, *layer._eager_operands())  # the public functions
        assert again.shape == (*shape[:-1], 384) and torch.equal(first, again) and torch.equal(again, full)
    misaligned = torch.randn(2 * 512 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(2, 512)
    with pytest.raises(ValueError, match="-byte aligned"):  # the kept launch refuses it: the ops' checks say why
        layer(misaligned)
    layer.bias = layer.bias * 2  # a new operand: the kept launches go
    assert layer._launches is None


def _cuda_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    return model, torch.randint(0, 512, (2, 16), device="cuda")


def _with_torch_fp8(model, names, recipe):
    """A copy of ``model`` whose layers ``names`` run torch's own FP8 path for ``recipe`` (the anchor)."""
    import copy

    from cutedsl_gemm.tools.baselines import TorchFp8Linear

    other = copy.deepcopy(model)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = other.get_submodule(parent)
        linear = getattr(owner, child)
        setattr(owner, child, TorchFp8Linear.from_linear(linear, cnn.LINEAR_RECIPES[recipe].scaling.name))
    return other


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor"])
def test_converted_llama_logits_within_the_torch_fp8_error(recipe):
    """FP8 on a 2-layer, hidden-256 model moves the logits by a few percent: the bound is what torch's own FP8
    path for the same recipe gives on the same model."""
    model, ids = _cuda_llama()
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.double()
        unconverted = _with_torch_fp8(model, [], recipe)
        report = cnn.convert(model, recipe)
        assert len(report.converted) == 15 and not report.skipped
        theirs = R.rel_error(_with_torch_fp8(unconverted, report.converted, recipe)(ids, use_cache=False).logits, want)
        ours = R.rel_error(model(ids, use_cache=False).logits, want)
    assert ours < 0.15, ours
    assert ours <= 1.25 * theirs + 1e-3, (ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor", *INTEGER_RECIPES, "int4_weight_g32_zp"])
def test_converted_llama_reduce_overhead_matches_eager(recipe, monkeypatch):
    """torch.compile(fullgraph=True, mode="reduce-overhead"): CUDA graph trees warm up, record and replay the
    converted model (the kernels' persistent buffers live outside the graphs' memory pool)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.triton, "cudagraph_trees_history_recording", True)  # names a stray tensor
    model, ids = _cuda_llama()
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.double()
        report = cnn.convert(model, recipe)
        assert len(report.converted) == 15 and not report.skipped
        eager = model(ids, use_cache=False).logits
        assert R.rel_error(eager, want) <= 4 * RECIPE_ERROR[recipe]  # a 2-layer model: a few layers' errors add up
        compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        runs = [compiled(ids, use_cache=False).logits.clone() for _ in range(3)]  # warm-up, record, replay
        # Inductor's fused norms and attention change the activations' last bits, and quantizing them flips
        # roundings: the compiled model is as close to the bf16 model as eager is, not bit-equal to eager.
        assert R.rel_error(runs[-1], want) <= 1.25 * R.rel_error(eager, want) + 1e-3
        assert torch.equal(runs[1], runs[2])  # the recorded graph replays what it recorded
        torch._dynamo.reset()


@pytest.mark.blackwell
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "tensor"])
def test_blackwell_layer_matches_reference_and_unconverted(recipe):
    _check_layer(recipe)


def test_the_earlier_layer_name_is_the_same_class():
    assert cnn.Fp8Linear is cnn.QuantizedLinear

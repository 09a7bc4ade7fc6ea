"""cutedsl_gemm.nn: converting a tiny transformers Llama (which layers, which skipped and why), the saved format
(state_dict / load_state_dict, safetensors), bad inputs. `-m gpu`: layers and a converted model against the
unconverted ones, every Hopper recipe; `-m blackwell`: the MXFP8 / NVFP4 layers."""

import pytest
import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import linear as layer_module
from cutedsl_gemm.nn.recipes import fp8_operand
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import RECIPES, ScaleGranularity
from cutedsl_gemm.ops import library as L

G = ScaleGranularity
RECIPE_NAMES = list(cnn.LINEAR_RECIPES)
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
             "int8_weight": None, "int4_weight": "multiple of the group size: K=120, group=128"}
SKIPPED_N = {r: "(N % 8 == 0)" for r in SKIPPED_K} | {"int8_weight": "multiple of 8", "int4_weight": "multiple of 8"}
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
            assert type(module) is cnn.Fp8Linear and module.recipe == recipe
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
    assert model["a"][0] is model["b"][0] and isinstance(model["b"][0], cnn.Fp8Linear)


def test_convert_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="unknown linear recipe 'fp8'; expected one of 'row', 'deepseek'"):
        cnn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), "fp8")
    with pytest.raises(TypeError, match="Fp8Linear.from_linear"):
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
        cnn.Fp8Linear.from_linear(torch.nn.Linear(64, 64), "row")


def test_from_linear_errors():
    with pytest.raises(TypeError, match="expected a torch.nn.Linear"):
        cnn.Fp8Linear.from_linear(torch.nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match=r"cannot run recipe 'row' on sm_90a: K=120, N=64: K \(x.shape\[1\]\) must be"):
        cnn.Fp8Linear.from_linear(torch.nn.Linear(120, 64))
    with pytest.raises(ValueError, match="unknown linear recipe"):
        cnn.Fp8Linear(64, 64, recipe="int3")


@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor"])
def test_quantized_weight_is_the_reference_in_scaled_mm_layout(recipe):
    torch.manual_seed(0)
    linear = torch.nn.Linear(320, 272).to(torch.bfloat16)
    layer = cnn.Fp8Linear.from_linear(linear, recipe)
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
    layer = cnn.Fp8Linear.from_linear(linear, "int8")
    q, s = R.quantize_int8_reference(w, "row")
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, s.t())
    for recipe, bits, group in (("int8_weight", 8, 0), ("int4_weight", 4, 128)):
        layer = cnn.Fp8Linear.from_linear(linear, recipe)
        w_int, scales, _ = IP.quantize_weights(w, bits, group)
        got_int, got_scales, _ = IP.unpack_weights(layer.weight, layer.weight_scale, k=256, group=group, bits=bits)
        assert torch.equal(got_int, w_int)
        # per channel fp32; group-wise in the activations' dtype (the linear's, fp16 here)
        assert layer.weight_scale.dtype == (torch.float32 if group == 0 else torch.float16)
        assert torch.equal(got_scales, scales.to(layer.weight_scale.dtype))
    assert "int4 weights, group-128 scales" in cnn.LINEAR_RECIPES["int4_weight"].describe()
    assert cnn.LINEAR_RECIPES["int8"].archs == cnn.LINEAR_RECIPES["int4_weight"].archs == ("sm_90a",)


def test_weight_only_layers_keep_the_activation_dtype_of_their_scales():
    layer = cnn.Fp8Linear.from_linear(torch.nn.Linear(256, 128).to(torch.bfloat16), "int4_weight")
    fp16 = cnn.Fp8Linear(256, 128, recipe="int4_weight", dtype=torch.float16)
    assert fp16.weight_scale.dtype == torch.float16 and layer.weight_scale.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"weight_scale: expected torch.float16 \(recipe 'int4_weight'\)"):
        fp16.load_state_dict(layer.state_dict())
    with pytest.raises(TypeError, match="x must be torch.bfloat16 or torch.float16"):  # the kernel's own rule
        cnn.Fp8Linear.from_linear(torch.nn.Linear(256, 128), "int4_weight")
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
    assert bytes(state["model.layers.0.self_attn.q_proj._extra_state"].tolist()).decode() == recipe
    assert (q.dtype, tuple(q.shape)) == {"nvfp4": (torch.float4_e2m1fn_x2, (128, 64)), "int8": (torch.int8, (128, 128)),
                                         "int8_weight": (torch.int32, (2, 1, 2048)),
                                         "int4_weight": (torch.int32, (2, 1, 1024))}.get(
                                             recipe, (torch.float8_e4m3fn, (128, 128)))
    assert ("model.layers.0.self_attn.q_proj.weight_global_scale" in state) == (recipe == "nvfp4")
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
    converted = cnn.Fp8Linear.from_linear(torch.nn.Linear(256, 384).to(torch.bfloat16), recipe)
    empty = cnn.Fp8Linear(256, 384, bias=True, recipe=recipe)
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
    layer = cnn.Fp8Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), "deepseek")
    dtypes = {k: v.dtype for k, v in layer.state_dict().items()}
    layer.half()
    layer.to(torch.bfloat16)
    assert {k: v.dtype for k, v in layer.state_dict().items()} == dtypes
    layer.to("meta")
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float8_e4m3fn


def test_forward_on_the_cpu_is_refused():
    layer = cnn.Fp8Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), "row")
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))


def test_forward_shapes_and_input_errors_from_metadata():
    layer = cnn.Fp8Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), "row").to("meta")
    with L.fake_target("sm_90a"):
        assert layer(torch.empty(2, 3, 64, dtype=torch.float16, device="meta")).shape == (2, 3, 32)
        with pytest.raises(ValueError, match="inner dimensions differ"):
            layer(torch.empty(2, 48, dtype=torch.bfloat16, device="meta"))
        with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
            layer(torch.empty(2, 64, dtype=torch.int32, device="meta"))


# ------------------------------------------------------------------------------------------------
# GPU: against the unconverted layers and model
# ------------------------------------------------------------------------------------------------

# Relative error of a converted 512 -> 384 layer against the bf16 one on Gaussian data: the recipe's quantization
# error (the reference quantizers give 0.037 for the E4M3 recipes, 0.040 for MXFP8, 0.14 for NVFP4; 0.0085 for int8
# per token x per channel, 0.004 for int8 weights alone, 0.072 for int4 weights in groups of 128), with margin.
RECIPE_ERROR = {"row": 0.05, "deepseek": 0.05, "tensor": 0.05, "mxfp8": 0.06, "nvfp4": 0.2, "int8": 0.015,
                "int8_weight": 0.01, "int4_weight": 0.1}
INTEGER_RECIPES = ["int8", "int8_weight", "int4_weight"]


def _reference_output(layer, linear, x2):
    """float64 product of the reference quantizers' operands (the bits the kernels produce) + bias."""
    r = cnn.LINEAR_RECIPES[layer.recipe]
    bias = None if linear.bias is None else linear.bias.detach().float()
    w = linear.weight.detach()
    if r.weight_only:
        w_int, scales, _ = IP.unpack_weights(layer.weight, layer.weight_scale, k=layer.in_features, group=r.group,
                                             bits=r.bits)
        out = R.reference_weight_only_mm(x2, w_int, scales, None, r.group)
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
    layer = cnn.Fp8Linear.from_linear(linear, recipe)
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
@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor", *INTEGER_RECIPES])
def test_repeated_layer_calls_take_the_kept_launch(recipe):
    from cutedsl_gemm.nn.recipes import quantized_matmul

    torch.manual_seed(0)
    layer = cnn.Fp8Linear.from_linear(torch.nn.Linear(512, 384).to("cuda", torch.bfloat16), recipe)
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

    from cutedsl_gemm.tools.anchors import TorchFp8Linear

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
@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor", *INTEGER_RECIPES])
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

"""QuantizedLinear's weight in high precision (``dequantize``) against the reference quantizers and dequantizers, for
every recipe; the saved format's version; a static activation scale (``input_scale``). `-m gpu`: the Hopper layers'
outputs against ``x @ dequantize().T``, and the static scale's."""

import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._subclasses.fake_tensor import FakeTensorMode

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn.recipes import quantize_fp8_static
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import E4M3, ScaleGranularity
from cutedsl_gemm.ops import library as L

G = ScaleGranularity
RECIPE_NAMES = list(cnn.LINEAR_RECIPES)
HOPPER_RECIPES = [name for name, r in cnn.LINEAR_RECIPES.items() if "sm_90a" in r.archs]
# the weight's relative error (Frobenius) after quantization, on nn.Linear's uniform weights (measured: 0.026 for
# the E4M3 recipes and MXFP8, 0.10 for NVFP4, 0.004 for int8, 0.064-0.070 for int4 groups), with some margin
WEIGHT_ERROR = {"row": 0.035, "deepseek": 0.035, "tensor": 0.035, "mxfp8": 0.035, "nvfp4": 0.13, "int8": 0.006,
                "int8_weight": 0.006} | {name: 0.09 for name, r in cnn.LINEAR_RECIPES.items() if r.element == "int4"}


@pytest.fixture(autouse=True)
def _as_without_a_gpu(request, monkeypatch):
    """The CPU tier converts as a machine without a GPU does (the recipe's first arch), whatever GPU it has."""
    if "gpu" not in request.keywords and "blackwell" not in request.keywords:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _k(recipe: str) -> int:
    """K a multiple of every recipe's group but not of 128 where the recipe allows it (ragged 128x128 blocks)."""
    return 384 if cnn.LINEAR_RECIPES[recipe].group == 128 else 320


def _linear(k: int, n: int = 272, dtype=torch.bfloat16, device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Linear(k, n).to(device, dtype)


def _bits(t):
    """The bytes of t (an empty layer's buffers are uninitialized memory: NaN patterns compare by their bits)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def _reference_weight(recipe: str, w: torch.Tensor) -> torch.Tensor:
    """float64 W from the reference quantizer of the recipe run on the original weight (plain-layout scales), and
    the reference dequantization of what it returns."""
    r = cnn.LINEAR_RECIPES[recipe]
    if r.weight_only:
        w_int, scales, zeros = IP.quantize_weights(w, r.bits, r.group, symmetric=not r.zeros)
        if r.group:  # group-wise scales and zero points are stored in the activations' dtype
            scales, zeros = scales.to(w.dtype), None if zeros is None else zeros.to(w.dtype)
        return R.dequantize_weights(w_int, scales, zeros, r.group)
    if r.element == "int8":
        return R.dequantize(*R.quantize_int8_reference(w, "row"), G.ROW)
    if r.scaling.scale_format == "fp32":
        return R.dequantize(*R.quantize(w, r.scaling.b), r.scaling.b)
    blocks = R.quantize_mx_reference(w, r.element) if r.scaling.name == "mx" else R.quantize_nvfp4_reference(w)
    return blocks.dequantize()


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_dequantize_is_the_reference_dequantization_of_the_same_bits(recipe):
    k = _k(recipe)
    linear = _linear(k)
    layer = cnn.QuantizedLinear.from_linear(linear, recipe)
    w = linear.weight.detach()
    got = layer.dequantize()
    assert (got.dtype, tuple(got.shape), got.device) == (torch.float32, (272, k), w.device)
    assert torch.equal(got, _reference_weight(recipe, w).float())
    assert R.rel_error(got, w.double()) <= WEIGHT_ERROR[recipe]
    assert torch.equal(layer.dequantize(torch.bfloat16), got.to(torch.bfloat16))


@pytest.mark.parametrize("recipe", ["deepseek", "int4_weight_g32_zp", "nvfp4"])
def test_dequantize_reads_a_loaded_layer(recipe):
    """An empty layer filled by load_state_dict dequantizes to the converted layer's weight."""
    k = _k(recipe)
    converted = cnn.QuantizedLinear.from_linear(_linear(k, dtype=torch.float16 if recipe.startswith("int4")
                                                        else torch.bfloat16), recipe)
    empty = cnn.QuantizedLinear(k, 272, recipe=recipe, dtype=converted.weight_scale.dtype
                                if recipe.startswith("int4") else None)
    empty.load_state_dict(converted.state_dict())
    assert torch.equal(empty.dequantize(), converted.dequantize())


def test_dequantize_block_scales_with_ragged_edges():
    """128x128 weight blocks cut at N = 200 and K = 176: each element times its own block's scale."""
    linear = _linear(176, 200)
    layer = cnn.QuantizedLinear.from_linear(linear, "deepseek")
    assert tuple(layer.weight_scale.shape) == (2, 2)  # (ceil(K / 128), ceil(N / 128)), scaled_mm's scale_b
    got = layer.dequantize()
    for rows, cols in ((slice(0, 128), slice(0, 128)), (slice(128, 200), slice(0, 128)),
                       (slice(0, 128), slice(128, 176)), (slice(128, 200), slice(128, 176))):
        s = layer.weight_scale[cols.start // 128, rows.start // 128]
        assert torch.equal(got[rows, cols], layer.weight[rows, cols].float() * s)


# ------------------------------------------------------------------------------------------------
# saved format: its version
# ------------------------------------------------------------------------------------------------


def _tag(layer_state: dict, key: str = "_extra_state") -> str:
    return bytes(layer_state[key].tolist()).decode("ascii")


def _with_tag(state: dict, text: str, key: str = "_extra_state") -> dict:
    return state | {key: torch.tensor(list(text.encode("ascii")), dtype=torch.uint8)}


@pytest.mark.parametrize("recipe", ["row", "nvfp4", "int4_weight_g64_zp"])
def test_versioned_state_round_trips_through_safetensors(recipe, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    k = _k(recipe)
    layer = cnn.QuantizedLinear.from_linear(_linear(k), recipe)
    state = layer.state_dict()
    assert cnn.FORMAT_VERSION == 2
    assert state["_extra_state"].dtype == torch.uint8 and _tag(state) == f"cutedsl_gemm/2/{recipe}"
    st.save_file(state, tmp_path / "layer.safetensors")
    loaded = cnn.QuantizedLinear(k, 272, recipe=recipe)
    loaded.load_state_dict(st.load_file(tmp_path / "layer.safetensors"))
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(_bits(loaded.state_dict()[key]), _bits(v)) for key, v in state.items())
    assert torch.equal(loaded.dequantize(), layer.dequantize())


def test_a_state_without_a_version_loads_as_the_same_layout():
    """Version 1 saved the recipe's bare name and the same buffers."""
    layer = cnn.QuantizedLinear.from_linear(_linear(320), "deepseek")
    old = _with_tag(layer.state_dict(), "deepseek")
    loaded = cnn.QuantizedLinear(320, 272, recipe="deepseek")
    loaded.load_state_dict(old)
    assert torch.equal(loaded.dequantize(), layer.dequantize())
    assert _tag(loaded.state_dict()) == "cutedsl_gemm/2/deepseek"  # saved again in this version


def test_a_newer_version_or_another_recipe_is_refused_before_anything_loads():
    model = torch.nn.Sequential(cnn.QuantizedLinear.from_linear(_linear(320), "row"))
    state = model.state_dict()
    fresh = torch.nn.Sequential(cnn.QuantizedLinear(320, 272, recipe="row"))
    before = {key: v.clone() for key, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"^0: the checkpoint holds format version 3 of cutedsl_gemm's QuantizedLinear "
                                         r"and this cutedsl_gemm reads versions up to 2; upgrade cutedsl_gemm, or "
                                         r"convert again from the high-precision model$"):
        fresh.load_state_dict(_with_tag(state, "cutedsl_gemm/3/row", "0._extra_state"))
    with pytest.raises(ValueError, match=r"^0: the checkpoint holds recipe 'tensor' weights and this layer runs recipe "
                                         r"'row'; convert with recipe='tensor' before loading$"):
        fresh.load_state_dict(_with_tag(state, "cutedsl_gemm/2/tensor", "0._extra_state"))
    with pytest.raises(ValueError, match="holds recipe 'tensor' weights"):  # version 1, another recipe
        fresh.load_state_dict(_with_tag(state, "tensor", "0._extra_state"))
    with pytest.raises(ValueError, match=r"unreadable format tag 'cutedsl_gemm/two/row'"):
        fresh.load_state_dict(_with_tag(state, "cutedsl_gemm/two/row", "0._extra_state"))
    assert all(torch.equal(_bits(fresh.state_dict()[key]), _bits(v)) for key, v in before.items())


# ------------------------------------------------------------------------------------------------
# a static activation scale
# ------------------------------------------------------------------------------------------------


def _static_layer(k=320, n=272, scale=0.01, device="cpu"):
    """A "tensor" layer converted from a linear, loaded into a layer with a static input_scale."""
    converted = cnn.QuantizedLinear.from_linear(_linear(k, n, device=device), "tensor")
    layer = cnn.QuantizedLinear(k, n, recipe="tensor", device=device, input_scale=True)
    layer.load_state_dict(converted.state_dict() | {"input_scale": torch.tensor(scale, device=device)})
    return converted, layer


def test_the_input_scale_buffer_is_there_only_when_asked_for():
    plain = cnn.QuantizedLinear(320, 272, recipe="tensor")
    assert plain.input_scale is None and "input_scale" not in plain.state_dict()
    layer = cnn.QuantizedLinear(320, 272, recipe="tensor", input_scale=True)
    assert (layer.input_scale.dtype, tuple(layer.input_scale.shape)) == (torch.float32, ())
    assert list(layer.state_dict()) == ["weight", "weight_scale", "bias", "input_scale", "_extra_state"]
    assert "input_scale=True" in repr(layer) and "input_scale" not in repr(plain)
    layer.half()
    assert layer.input_scale.dtype == torch.float32


@pytest.mark.parametrize("recipe", ["row", "deepseek", "int8", "mxfp8", "nvfp4", "int4_weight"])
def test_a_static_input_scale_is_refused_for_other_recipes(recipe):
    with pytest.raises(ValueError, match=rf"input_scale=True \(a static activation scale\) works with recipe 'tensor' "
                                         rf"\(per-tensor FP8 activations\), not '{recipe}'"):
        cnn.QuantizedLinear(256, 128, recipe=recipe, input_scale=True)


def test_the_input_scale_is_saved_and_loaded(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    converted, layer = _static_layer(scale=0.015625)
    state = layer.state_dict()
    assert float(state["input_scale"]) == 0.015625 and _tag(state) == "cutedsl_gemm/2/tensor"
    st.save_file(state, tmp_path / "layer.safetensors")
    loaded = cnn.QuantizedLinear(320, 272, recipe="tensor", input_scale=True)
    loaded.load_state_dict(st.load_file(tmp_path / "layer.safetensors"))
    assert all(torch.equal(_bits(loaded.state_dict()[key]), _bits(v)) for key, v in state.items())
    with pytest.raises(ValueError, match=r"the checkpoint has a static input_scale .* build the layer with "
                                         r"QuantizedLinear\(\.\.\., recipe='tensor', input_scale=True\)"):
        cnn.QuantizedLinear(320, 272, recipe="tensor").load_state_dict(state)
    with pytest.raises(ValueError, match="this layer takes a static input_scale and the checkpoint has none"):
        cnn.QuantizedLinear(320, 272, recipe="tensor", input_scale=True).load_state_dict(converted.state_dict())


def test_static_quantization_is_the_per_tensor_quantizer_with_the_scale_given():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(37, 320) * 3).to(dtype)
        q, scale = R.quantize(x, G.TENSOR)  # the amax's scale: the same bits as quantize_fp8(x, "tensor")
        assert torch.equal(_bits(quantize_fp8_static(x, scale.reshape(()))), _bits(q))
        assert torch.equal(_bits(quantize_fp8_static(x, scale.reshape(1))), _bits(q))
    # another scale: x / s correctly rounded in fp32, saturated to +-448, rounded to nearest even; NaN stays NaN
    x = torch.tensor([[0.0, 1.0, -1.0, 3.0, 1e6, -float("inf"), float("inf"), float("nan"), 0.0021, 0.0019]])
    q = quantize_fp8_static(x, torch.tensor(0.001))
    want = torch.tensor([[0.0, 448.0, -448.0, 448.0, 448.0, -448.0, 448.0]]).to(E4M3.torch_dtype)
    assert q.dtype == E4M3.torch_dtype and torch.equal(_bits(q[:, :7]), _bits(want[:, :7]))
    assert torch.isnan(q[0, 7].float()) and q[0, 8:].float().tolist() == [2.0, 1.875]  # 2.1 and 1.9, rounded
    ties = torch.tensor([[2.125, 2.375, 17.0, 19.0]])  # halfway between E4M3 neighbours: to the even mantissa
    assert quantize_fp8_static(ties, torch.tensor(1.0)).float().tolist() == [[2.0, 2.5, 16.0, 20.0]]


def test_the_traced_layer_passes_its_input_scale_to_the_op():
    _, layer = _static_layer()
    layer.to("meta")
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    try:
        with L.fake_target("sm_90a"):
            y = compiled(torch.empty(3, 4, 320, dtype=torch.bfloat16, device="meta"))
    finally:
        torch._dynamo.reset()  # (the layer's forward is one code object: its compiled entries are shared)
    assert (y.shape, y.dtype) == ((3, 4, 272), torch.bfloat16)
    calls = [n for g in backend.graphs for n in g.graph.nodes if n.op == "call_function"
             and str(n.target).startswith("cutedsl_gemm.fp8_linear")]
    assert len(calls) == 1 and len(calls[0].args) == 8 and "input_scale" in str(calls[0].args[7])


def test_the_op_fake_takes_an_input_scale_and_checks_it():
    r = cnn.LINEAR_RECIPES["tensor"]
    with L.fake_target("sm_90a"), FakeTensorMode():
        qw, sw, _, _ = r.quantize_weight(torch.empty(272, 320, dtype=torch.bfloat16, device="cuda"), L.OPS)
        scale = torch.empty((), dtype=torch.float32, device="cuda")
        for shape in ((5, 320), (2, 3, 320), (320,)):
            x = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            y = L.OPS.fp8_linear(x, qw, sw, None, None, "tensor", None, scale)
            assert y.shape == (*shape[:-1], 272) and y.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="a static input_scale works with recipe 'tensor' .* not 'row'"):
            L.OPS.fp8_linear(x, qw, torch.empty(1, 272, device="cuda"), None, None, "row", None, scale)
        with pytest.raises(TypeError, match="input_scale must be a one-element float32 tensor"):
            L.OPS.fp8_linear(x, qw, sw, None, None, "tensor", None, scale.to(torch.bfloat16))


def test_the_static_layer_on_the_cpu_is_refused():
    _, layer = _static_layer()
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        layer(torch.randn(2, 320, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

# the output against x @ W.T with W the dequantized weight: the activations' quantization (E4M3 per token, tensor or
# 1x128 group: ~0.03; int8 per token: ~0.005) and the output's rounding to bf16 (weight-only: 16-bit products)
OUTPUT_ERROR = {"row": 0.05, "deepseek": 0.05, "tensor": 0.05, "int8": 0.012} | {
    name: 8e-3 for name, r in cnn.LINEAR_RECIPES.items() if r.weight_only}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", HOPPER_RECIPES)
def test_layer_output_is_the_product_with_its_dequantized_weight(recipe):
    k = _k(recipe)
    linear = _linear(k, 384, device="cuda")
    layer = cnn.QuantizedLinear.from_linear(linear, recipe)
    w = layer.dequantize()
    assert w.is_cuda and torch.equal(w.cpu(), layer.to("cpu").dequantize())
    layer.to("cuda")
    for shape in ((1, k), (33, k), (2, 7, k)):
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            y = layer(x)
        want = x.double() @ w.double().t() + layer.bias.double()
        assert R.rel_error(y, want) <= OUTPUT_ERROR[recipe], (recipe, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_static_input_scale_is_the_scale_the_layer_uses(dtype):
    """With the input's own amax scale the static layer is the dynamic "tensor" layer, bit for bit; with a scale 16
    times too small most activations saturate, and the output is the product of those saturated values."""
    from gpu_operands import OUT_TOL

    converted, layer = _static_layer(512, 384, device="cuda")
    converted.to(dtype=dtype)  # (the buffers keep their dtypes)
    w = layer.dequantize().double()
    torch.manual_seed(1)
    for shape in ((1, 512), (33, 512), (2, 7, 512)):
        x = torch.randn(shape, dtype=dtype, device="cuda")
        x2 = x.reshape(-1, 512)
        _, own = R.quantize(x2, G.TENSOR)
        for scale, exact in ((own.reshape(()), True), (own.reshape(()) / 16, False)):
            layer.input_scale = scale.clone()
            with torch.no_grad():
                y, dynamic = layer(x), converted(x)
            assert y.shape == dynamic.shape and y.dtype == dtype
            qa = quantize_fp8_static(x2, scale).double() * scale.double()
            want = (qa @ w.t() + layer.bias.double()).reshape(y.shape)
            assert R.rel_error(y, want) <= OUT_TOL[dtype], (shape, exact)
            ideal = x.double() @ w.t() + layer.bias.double()
            if exact:
                assert torch.equal(y, dynamic) and R.rel_error(y, ideal) <= OUTPUT_ERROR["tensor"]
            else:
                assert R.rel_error(y, ideal) > 0.2, shape  # saturated: the scale is the one in use

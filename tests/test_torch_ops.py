"""The torch operators (torch.ops.cutedsl_gemm.*): registration and schemas, fake implementations (shapes,
dtypes, strides, the ops' own errors), opcheck where the op runs on the CPU (the quantizers' references), and
torch.compile(fullgraph=True) tracing through them on meta tensors. `-m gpu`: opcheck on CUDA, compiled and
CUDA-graph runs against eager; `-m blackwell`: the MX / NVFP4 quantizer ops."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutedsl_gemm
from cutedsl_gemm import nn as cnn
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import E4M3, ScaleGranularity
from cutedsl_gemm.ops import library as L
from cutedsl_gemm.ops import quantize as Q

OPS = torch.ops.cutedsl_gemm
OP_NAMES = ("scaled_mm", "mm_weight_only", "quantize_fp8", "quantize_int8", "quantize_mx", "quantize_nvfp4",
            "fp8_linear")
FP8_CASES = [("tensor", None), ("row", None), ("1x128", None), ("1x128", "row_major"), ("128x128", None),
             ("128x128", "padded"), ("256x256", None)]


@pytest.fixture(autouse=True)
def _as_without_a_gpu(request, monkeypatch):
    """The CPU tier checks fake calls as a machine without a GPU does (or as ``fake_target`` says), whatever GPU
    the machine has."""
    if "gpu" not in request.keywords and "blackwell" not in request.keywords:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _layout(t):
    return tuple(t.shape), t.dtype, tuple(t.stride())


def _recording_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


def _targets(gm):
    """The functions a traced graph calls, an op by its name ("cutedsl_gemm.scaled_mm")."""
    return [str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function"]


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_is_registered_functional_and_pt2_compliant(name):
    op = getattr(OPS, name)
    assert op.overloads() == ["default"]  # no out= variant for the compiler
    schema = op.default._schema
    assert not any(a.alias_info is not None for a in schema.arguments)  # nothing mutated or aliased
    assert all(r.alias_info is None for r in schema.returns)
    assert torch.Tag.pt2_compliant_tag in op.default.tags


def test_schemas_have_real_types():
    assert str(OPS.scaled_mm.default._schema).startswith(
        "cutedsl_gemm::scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, "
        "ScalarType? out_dtype=None, bool use_fast_accum=False, *, str? scale_recipe_a=None")
    assert "int? split_k=None" in str(OPS.scaled_mm.default._schema)
    assert str(OPS.quantize_fp8.default._schema) == (
        'cutedsl_gemm::quantize_fp8(Tensor x, str recipe="1x128", *, str fmt="e4m3", int block=128, '
        'str? scale_layout=None, str operand="a") -> (Tensor, Tensor)')
    assert str(OPS.quantize_nvfp4.default._schema).endswith("-> (Tensor, Tensor, Tensor)")
    assert str(OPS.quantize_int8.default._schema) == (
        'cutedsl_gemm::quantize_int8(Tensor x, str granularity="row") -> (Tensor, Tensor)')
    assert str(OPS.mm_weight_only.default._schema) == (
        "cutedsl_gemm::mm_weight_only(Tensor x, Tensor packed_w, Tensor scales, Tensor? zeros=None, *, int group=128, "
        "int bits=4, int? split_k=None) -> Tensor")
    assert "str recipe, Tensor? weight_zero=None, Tensor? input_scale=None) -> Tensor" in \
        str(OPS.fp8_linear.default._schema)


def test_op_names_of_public_arguments():
    F = torch.nn.functional
    assert L.op_name(ScaleGranularity.GROUP_1x128) == "1x128"
    assert L.op_name(E4M3) == "e4m3" and L.op_name(torch.float8_e5m2) == "e5m2"
    assert L.op_name(cutedsl_gemm.recipe("1x128_128x128")) == "1x128_128x128"
    assert L.op_name(["BlockWise1x16", "TensorWise"]) == "BlockWise1x16" and L.op_name(None) is None
    if hasattr(F, "ScalingType"):
        assert L.op_name(F.ScalingType.RowWise) == "RowWise"
    with pytest.raises(TypeError, match="expected a name"):
        L.op_name(3)


# ------------------------------------------------------------------------------------------------
# fake implementations
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("gran,layout", FP8_CASES)
def test_quantize_fp8_fake_matches_the_real_outputs(gran, layout, device):
    x = torch.randn(200, 384, dtype=torch.bfloat16)
    real = Q.quantize_fp8(x, gran, scale_layout=layout)
    with FakeTensorMode():  # fake CUDA tensors need no GPU; the kernels' layouts are the reference's
        fake = OPS.quantize_fp8(torch.empty(200, 384, dtype=torch.bfloat16, device=device), gran,
                                scale_layout=layout)
    assert [_layout(t) for t in fake] == [_layout(t) for t in real]
    assert all(t.device.type == device for t in fake)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("gran", ["row", "tensor"])
def test_quantize_int8_fake_matches_the_real_outputs(gran, device):
    x = torch.randn(200, 384, dtype=torch.float16)
    real = Q.quantize_int8(x, gran)
    with FakeTensorMode():
        fake = OPS.quantize_int8(torch.empty(200, 384, dtype=torch.float16, device=device), gran)
        with pytest.raises(ValueError, match="per row or per tensor"):
            OPS.quantize_int8(torch.empty(8, 256, device=device), "1x128")
        with pytest.raises(ValueError, match="multiple of 16"):
            OPS.quantize_int8(torch.empty(8, 250, device="cuda"), gran)
    assert [_layout(t) for t in fake] == [_layout(t) for t in real] and real[0].dtype == torch.int8


def _packed_layouts(n, k, bits, group):
    """(shape, dtype) of the packed weight and of its scales as ``int_packing.pack_weights`` returns them."""
    from cutedsl_gemm.numerics import int_packing as IP

    w_int, scales, _ = IP.quantize_weights(torch.randn(n, k), bits, group)
    return [(t.shape, t.dtype) for t in IP.pack_weights(w_int, scales, None, group, bits=bits)[:2]]


@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 0)])
def test_mm_weight_only_fake_shapes_and_errors(bits, group):
    layouts = _packed_layouts(384, 512, bits, group)
    with L.fake_target("sm_90a"), FakeTensorMode():
        x = torch.empty(5, 512, dtype=torch.bfloat16, device="cuda")
        packed, scales = (torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in layouts)
        y = OPS.mm_weight_only(x, packed, scales, group=group, bits=bits)
        assert _layout(y) == ((5, 384), torch.bfloat16, (384, 1))
        with pytest.raises(ValueError, match="pass bits=8" if group == 0 else "int8 weights take per-channel"):
            OPS.mm_weight_only(x, packed, scales, group=group, bits=12 - bits)
        with pytest.raises(ValueError, match="unpacked"):
            OPS.mm_weight_only(x, torch.empty(384, 512, dtype=torch.int8, device="cuda"), scales, group=group,
                               bits=bits)
        with pytest.raises(TypeError, match="x must be torch.bfloat16 or torch.float16"):
            OPS.mm_weight_only(x.float(), packed, scales, group=group, bits=bits)
        if group:
            with pytest.raises(ValueError, match="multiple of the group size"):
                OPS.mm_weight_only(torch.empty(5, 504, dtype=torch.bfloat16, device="cuda"), packed, scales,
                                   group=group, bits=bits)
    with L.fake_target("sm_100a"), FakeTensorMode(), pytest.raises(RuntimeError, match="runs on Hopper"):
        packed, scales = (torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in layouts)
        OPS.mm_weight_only(torch.empty(5, 512, dtype=torch.bfloat16, device="cuda"), packed, scales, group=group,
                           bits=bits)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_block_quantizer_fakes_match_the_real_outputs(device):
    x = torch.randn(130, 256, dtype=torch.bfloat16)
    g = torch.tensor(0.25)
    real = [L.EAGER.quantize_mx(x, "e4m3"), L.EAGER.quantize_mx(x, "e2m1"), L.EAGER.quantize_nvfp4(x),
            L.EAGER.quantize_nvfp4(x, g)]
    with FakeTensorMode():
        xf = torch.empty(130, 256, dtype=torch.bfloat16, device=device)
        fake = [OPS.quantize_mx(xf, "e4m3"), OPS.quantize_mx(xf, "e2m1"), OPS.quantize_nvfp4(xf),
                OPS.quantize_nvfp4(xf, torch.empty((), device=device))]
    for r, f in zip(real, fake):
        assert [_layout(t) for t in f] == [_layout(t) for t in r]


def test_quantizer_fakes_raise_the_ops_errors():
    with FakeTensorMode():
        x = torch.empty(8, 250, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="multiple of 16 for the FP8 kernels"):
            OPS.quantize_fp8(x, "row")  # the kernel's rule, decided on a fake CUDA tensor
        OPS.quantize_fp8(torch.empty(8, 250, dtype=torch.bfloat16), "row")  # the CPU reference takes any K
        with pytest.raises(ValueError, match="must be 2-D"):
            OPS.quantize_fp8(torch.empty(2, 8, 256, device="cuda"), "row")
        with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
            OPS.quantize_fp8(torch.empty(8, 256, dtype=torch.int32, device="cuda"), "row")
        with pytest.raises(ValueError, match="unknown recipe"):
            OPS.quantize_fp8(torch.empty(8, 256, device="cuda"), "3x3")
        with pytest.raises(ValueError, match="row-major contiguous"):
            OPS.quantize_fp8(torch.empty(256, 8, device="cuda").t(), "row")
        with pytest.raises(ValueError, match="multiple of the scale block 32"):
            OPS.quantize_mx(torch.empty(8, 48, device="cuda"))
        with pytest.raises(ValueError, match="MX element format"):
            OPS.quantize_mx(torch.empty(8, 64, device="cuda"), "ue8m0")
        with pytest.raises(TypeError, match="bfloat16 or float32"):
            OPS.quantize_nvfp4(torch.empty(8, 64, dtype=torch.float16, device="cuda"))
        with pytest.raises(TypeError, match="one-element float32"):
            OPS.quantize_nvfp4(torch.empty(8, 64, device="cuda"), torch.empty(2, device="cuda"))


def _hopper_operands(recipe, m=8, n=512, k=256, device="cuda"):
    r = cnn.LINEAR_RECIPES[recipe]
    x = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    w = torch.empty(n, k, dtype=torch.bfloat16, device=device)
    qa, sa, _ = r.quantize(x, "a", r, L.OPS)
    qw, sw, _ = r.quantize(w, "b", r, L.OPS)
    return qa, qw.t(), sa, sw, r


@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor"])
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.float32])
def test_scaled_mm_fake_shapes_on_hopper(recipe, out_dtype):
    with L.fake_target("sm_90a"), FakeTensorMode():
        qa, b, sa, sb, r = _hopper_operands(recipe)
        y = OPS.scaled_mm(qa, b, sa, sb, torch.empty(512, device="cuda"), out_dtype,
                          scale_recipe_a=r.scaling.a.scaling_type, scale_recipe_b=r.scaling.b.scaling_type)
    assert _layout(y) == ((8, 512), out_dtype or torch.bfloat16, (512, 1))


def test_scaled_mm_fake_raises_the_validation_errors():
    with L.fake_target("sm_90a"), FakeTensorMode():
        qa, b, sa, sb, _ = _hopper_operands("row")
        with pytest.raises(ValueError, match="inner dimensions differ"):
            OPS.scaled_mm(qa, torch.empty(512, 128, dtype=E4M3.torch_dtype, device="cuda").t(), sa, sb)
        with pytest.raises(ValueError, match="match no supported recipe"):
            OPS.scaled_mm(qa, b, sa, torch.empty(1, 500, device="cuda"))
        with pytest.raises(ValueError, match="bias must have shape"):
            OPS.scaled_mm(qa, b, sa, sb, torch.empty(7, device="cuda"))
        with pytest.raises(TypeError, match="out_dtype must be"):
            OPS.scaled_mm(qa, b, sa, sb, None, torch.int32)
        with pytest.raises(ValueError, match="must be K-major"):
            OPS.scaled_mm(qa, torch.empty(256, 512, dtype=E4M3.torch_dtype, device="cuda"), sa, sb)
        qa2, b2, sa2, sb2, _ = _hopper_operands("row", n=100)
        with pytest.raises(ValueError, match=r"N % 8 == 0"):
            OPS.scaled_mm(qa2, b2, sa2, sb2)
        qm, sm = OPS.quantize_mx(torch.empty(8, 256, dtype=torch.bfloat16, device="cuda"))
        wm, swm = OPS.quantize_mx(torch.empty(512, 256, dtype=torch.bfloat16, device="cuda"))
        with pytest.raises(ValueError, match="run on Blackwell"):
            OPS.scaled_mm(qm, wm.t(), sm, swm)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "tensor"])
def test_scaled_mm_fake_on_blackwell(recipe):
    with L.fake_target("sm_100a"), FakeTensorMode():
        r = cnn.LINEAR_RECIPES[recipe]
        x = torch.empty(8, 256, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(512, 256, dtype=torch.bfloat16, device="cuda")
        qa, sa, ga = r.quantize(x, "a", r, L.OPS)
        qw, sw, gw = r.quantize(w, "b", r, L.OPS)
        y = OPS.scaled_mm(qa, qw.t(), sa, sw, None, torch.float16, global_scale_a=ga, global_scale_b=gw)
        assert _layout(y) == ((8, 512), torch.float16, (512, 1))
        if recipe == "mxfp8":
            with pytest.raises(ValueError, match="scale_b"):
                OPS.scaled_mm(qa, qw.t(), sa, torch.empty(64, 8, dtype=sw.dtype, device="cuda"))


def test_fakes_without_a_gpu_compute_shapes_only():
    a = torch.empty(8, 256, dtype=E4M3.torch_dtype, device="meta")
    b = torch.empty(500, 256, dtype=E4M3.torch_dtype, device="meta").t()
    y = OPS.scaled_mm(a, b, torch.empty(8, 1, device="meta"), torch.empty(1, 500, device="meta"))
    assert _layout(y) == ((8, 500), torch.bfloat16, (500, 1))  # N % 8 is the GPU's rule: not checked here
    with pytest.raises(ValueError, match="must be 2-D"):
        OPS.scaled_mm(a[0], b, torch.empty(8, 1, device="meta"), torch.empty(1, 500, device="meta"))
    with pytest.raises(ValueError, match="arch must be one of"):
        with L.fake_target("sm_80"):
            pass


def test_fp8_linear_fake_keeps_leading_dims_and_dtype():
    with L.fake_target("sm_90a"), FakeTensorMode():
        _, b, _, sb, r = _hopper_operands("deepseek")
        for shape, dtype in (((3, 5, 256), torch.bfloat16), ((256,), torch.float16), ((4, 256), torch.float32)):
            x = torch.empty(shape, dtype=dtype, device="cuda")
            y = OPS.fp8_linear(x, b.t(), sb, None, None, "deepseek")
            assert y.shape == (*shape[:-1], 512) and y.dtype == dtype
        with pytest.raises(ValueError, match="unknown linear recipe"):
            OPS.fp8_linear(x, b.t(), sb, None, None, "fp8")
        with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
            OPS.fp8_linear(torch.empty(4, 256, dtype=torch.int8, device="cuda"), b.t(), sb, None, None, "deepseek")


def test_fp8_linear_refuses_cpu_inputs():
    w = torch.zeros(64, 32, dtype=E4M3.torch_dtype)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        OPS.fp8_linear(torch.zeros(2, 32, dtype=torch.bfloat16), w, torch.ones(1, 64), None, None, "row")
    with pytest.raises(ValueError, match="must be a CUDA tensor"):  # scaled_mm's own error
        OPS.scaled_mm(torch.zeros(2, 32, dtype=E4M3.torch_dtype), w.t(), torch.ones(2, 1), torch.ones(1, 64))


# ------------------------------------------------------------------------------------------------
# opcheck (the quantizers run their references on the CPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op,args,kwargs", [
    ("quantize_fp8", (torch.randn(64, 256),), {"recipe": "1x128"}),
    ("quantize_fp8", (torch.randn(64, 256, dtype=torch.bfloat16),), {"recipe": "128x128", "scale_layout": "padded"}),
    ("quantize_fp8", (torch.randn(64, 256),), {"recipe": "tensor", "fmt": "e5m2"}),
    ("quantize_mx", (torch.randn(64, 256), "e2m1"), {}),
    ("quantize_nvfp4", (torch.randn(64, 256), torch.tensor(0.01)), {}),
    ("quantize_int8", (torch.randn(64, 256, dtype=torch.bfloat16),), {}),
    ("quantize_int8", (torch.randn(64, 256), "tensor"), {}),
])
def test_opcheck_on_cpu(op, args, kwargs):
    torch.library.opcheck(getattr(OPS, op).default, args, kwargs)


# ------------------------------------------------------------------------------------------------
# tracing
# ------------------------------------------------------------------------------------------------


def test_compile_traces_the_public_functions_without_graph_breaks():
    def fn(x, w, sw, wm, swm):
        q, s = cutedsl_gemm.quantize_fp8(x, "row")
        y = cutedsl_gemm.scaled_mm(q, w.t(), s, sw, out_dtype=torch.float16)
        mx = cutedsl_gemm.quantize_mx(x)
        nv = cutedsl_gemm.quantize_nvfp4(x)
        return y, cutedsl_gemm.scaled_mm(mx.data, wm.t(), mx.scales, swm), nv.data, nv.global_scale

    meta = dict(device="meta")
    args = (torch.empty(8, 256, dtype=torch.bfloat16, **meta), torch.empty(512, 256, dtype=E4M3.torch_dtype, **meta),
            torch.empty(1, 512, **meta), torch.empty(512, 256, dtype=E4M3.torch_dtype, **meta),
            torch.empty(512, 8, dtype=torch.float8_e8m0fnu, **meta))
    graphs = []
    y, ym, nv, g = torch.compile(fn, fullgraph=True, backend=_recording_backend(graphs))(*args)
    assert _layout(y) == ((8, 512), torch.float16, (512, 1)) and ym.shape == (8, 512)
    assert nv.shape == (8, 128) and g.shape == ()
    ops = _targets(graphs[0])
    assert ops.count("cutedsl_gemm.scaled_mm") == 2
    assert {"cutedsl_gemm.quantize_fp8", "cutedsl_gemm.quantize_mx", "cutedsl_gemm.quantize_nvfp4"} <= set(ops)


def test_compile_traces_the_integer_functions_without_graph_breaks():
    def fn(x, packed, scales, w8, sw8):
        q, s = cutedsl_gemm.quantize_int8(x)
        y = cutedsl_gemm.scaled_mm(q, w8.t(), s, sw8)
        return y, cutedsl_gemm.mm_weight_only(x, packed, scales, group=128, bits=4)

    (pshape, pdtype), (sshape, sdtype) = _packed_layouts(384, 256, 4, 128)
    meta = dict(device="meta")
    args = (torch.empty(8, 256, dtype=torch.bfloat16, **meta), torch.empty(pshape, dtype=pdtype, **meta),
            torch.empty(sshape, dtype=sdtype, **meta), torch.empty(384, 256, dtype=torch.int8, **meta),
            torch.empty(1, 384, **meta))
    graphs = []
    y, yw = torch.compile(fn, fullgraph=True, backend=_recording_backend(graphs))(*args)
    assert _layout(y) == _layout(yw) == ((8, 384), torch.bfloat16, (384, 1))
    assert {"cutedsl_gemm.quantize_int8", "cutedsl_gemm.scaled_mm", "cutedsl_gemm.mm_weight_only"} <= \
        set(_targets(graphs[0]))


@pytest.mark.parametrize("recipe", ["int8", "int8_weight", "int4_weight"])
def test_compile_integer_layer(recipe):
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 384).to(torch.bfloat16), recipe).to("meta")
    graphs = []
    compiled = torch.compile(layer, fullgraph=True, backend=_recording_backend(graphs))
    with L.fake_target("sm_90a"):
        assert compiled(torch.empty(3, 4, 256, dtype=torch.bfloat16, device="meta")).shape == (3, 4, 384)
    assert _targets(graphs[0]).count("cutedsl_gemm.fp8_linear") == 1


def test_compiled_out_argument_is_filled():
    def fn(q, b, s, sb, out):
        return cutedsl_gemm.scaled_mm(q, b, s, sb, out=out)

    q = torch.empty(8, 256, dtype=E4M3.torch_dtype, device="meta")
    b = torch.empty(512, 256, dtype=E4M3.torch_dtype, device="meta").t()
    out = torch.empty(8, 512, dtype=torch.bfloat16, device="meta")
    res = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, b, torch.empty(8, 1, device="meta"),
                                                                   torch.empty(1, 512, device="meta"), out)
    assert res.shape == (8, 512)


@pytest.mark.parametrize("recipe", ["row", "deepseek"])
def test_compile_layer_with_dynamic_shapes(recipe):
    layer = cnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 512).to(torch.bfloat16), recipe).to("meta")
    graphs = []
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=_recording_backend(graphs))
    with L.fake_target("sm_90a"):  # the fakes check what a Hopper GPU runs
        for m in (3, 5):
            assert compiled(torch.empty(m, 4, 256, dtype=torch.bfloat16, device="meta")).shape == (m, 4, 512)
        with pytest.raises(Exception, match="inner dimensions differ"):
            compiled(torch.empty(3, 240, dtype=torch.bfloat16, device="meta"))
    assert len(graphs) == 1 and _targets(graphs[0]).count("cutedsl_gemm.fp8_linear") == 1


def test_compile_small_llama_fullgraph():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    report = cnn.convert(model, "row")
    assert len(report.converted) == 15 and not report.skipped
    model.to("meta")
    graphs = []
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend=_recording_backend(graphs))(
            torch.zeros(2, 5, dtype=torch.long, device="meta"), use_cache=False)
    assert out.logits.shape == (2, 5, 128) and out.logits.dtype == torch.bfloat16
    assert _targets(graphs[0]).count("cutedsl_gemm.fp8_linear") == 15


# ------------------------------------------------------------------------------------------------
# GPU: opcheck on CUDA, torch.compile and CUDA graphs against eager
# ------------------------------------------------------------------------------------------------


def _cuda_mlp(recipe, k=512, hidden=1024, n=384):
    torch.manual_seed(0)
    # (no elementwise layer between: compiled and eager runs launch the same kernels on the same inputs)
    mlp = torch.nn.Sequential(torch.nn.Linear(k, hidden), torch.nn.Linear(hidden, n, bias=False))
    mlp = mlp.to("cuda", torch.bfloat16)
    report = cnn.convert(mlp, recipe)
    assert report.converted == ["0", "1"]
    return mlp


def _storages(tree):
    return {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.numel()}


def opcheck(op, args, kwargs=None):
    """``torch.library.opcheck``, and for ops with FP8 / integer inputs its schema test by hand: that test compares
    the inputs before and after the call with ``torch.allclose``, which torch does not run on FP8 tensors. Here:
    every input's bits are unchanged, and no output shares an input's memory."""
    kwargs = kwargs or {}
    leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if all(t.dtype.is_floating_point and t.element_size() > 1 for t in leaves):
        return torch.library.opcheck(op, args, kwargs)
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in leaves]
    out = op(*args, **kwargs)
    for t, b in zip(leaves, before):
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, b), "the op mutated an input"
    assert not _storages(out) & _storages(leaves), "an output aliases an input"
    utils = [u for u in torch.library._OPCHECK_DEFAULT_UTILS if u != "test_schema"]
    return torch.library.opcheck(op, args, kwargs, test_utils=utils)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "deepseek", "tensor", "int8"])
def test_opcheck_on_cuda(recipe):
    r = cnn.LINEAR_RECIPES[recipe]
    x = torch.randn(33, 512, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(384, 512, dtype=torch.bfloat16, device="cuda")
    qw, sw, _ = r.quantize(w, "b", r, L.EAGER)
    qa, sa, _ = r.quantize(x, "a", r, L.EAGER)
    bias = torch.randn(384, device="cuda")
    quantizer = OPS.quantize_int8 if recipe == "int8" else OPS.quantize_fp8
    opcheck(quantizer.default, (x, r.scaling.a.label))
    opcheck(OPS.scaled_mm.default, (qa, qw.t(), sa, sw, bias, torch.bfloat16),
            {"scale_recipe_a": r.scaling.a.scaling_type, "scale_recipe_b": r.scaling.b.scaling_type})
    opcheck(OPS.fp8_linear.default, (x.view(3, 11, 512), qw, sw, None, bias, recipe))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["int8_weight", "int4_weight"])
def test_opcheck_weight_only_on_cuda(recipe):
    r = cnn.LINEAR_RECIPES[recipe]
    x = torch.randn(33, 512, dtype=torch.bfloat16, device="cuda")
    packed, scales, _ = r.quantize(torch.randn(384, 512, dtype=torch.bfloat16, device="cuda"), "b", r, L.EAGER)
    opcheck(OPS.mm_weight_only.default, (x, packed, scales), {"group": r.group, "bits": r.bits})
    opcheck(OPS.fp8_linear.default, (x.view(3, 11, 512), packed, scales, None, torch.randn(384, device="cuda"),
                                     recipe))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_matches_eager(mode):
    mlp = _cuda_mlp("row")
    x = torch.randn(4, 16, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        eager = mlp(x)
        compiled = torch.compile(mlp, fullgraph=True, mode=mode)
        for _ in range(3):  # warm-up, capture, replay
            got = compiled(x.clone())
    assert torch.equal(got, eager)


def assert_replays_like_eager(graph, static, out, mlp, seeds):
    """Replaying ``graph`` (captured on ``static``, writing ``out``) on fresh inputs equals eager calls of ``mlp``."""
    for seed in range(seeds):
        torch.manual_seed(seed)
        x = torch.randn(*static.shape, dtype=static.dtype, device=static.device)
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, mlp(x))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    mlp = _cuda_mlp("deepseek")
    static = torch.randn(16, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        mlp(static)  # compile the kernels and keep the plans outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mlp(static)
        assert_replays_like_eager(graph, static, out, mlp, seeds=3)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["row", "tensor", "int8", "int4_weight"])
def test_cuda_graph_capture_needs_a_warm_up(recipe):
    """A call whose persistent buffers do not exist yet (here: every cache cleared, as in a fresh process) is
    refused inside a capture, with what to do; warmed up, the same capture replays like eager calls."""
    from cutedsl_gemm.runtime import launch
    from cutedsl_gemm.runtime.plans import PREPARED

    mlp = _cuda_mlp(recipe)
    static = torch.randn(16, 512, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        mlp(static)  # compiles the kernels (kept by the process), then forget everything else
        PREPARED.clear()
        launch.forget_buffers()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="run the call once before capturing"):
            with torch.cuda.graph(graph):
                mlp(static)
        mlp(static)  # the warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mlp(static)
        assert_replays_like_eager(graph, static, out, mlp, seeds=2)


@pytest.mark.gpu
@pytest.mark.parametrize("gran", ["row", "1x128", "128x128", "tensor"])
def test_repeated_quantize_fp8_calls_reuse_the_plan(gran):
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    first = cutedsl_gemm.quantize_fp8(x, gran)
    again = cutedsl_gemm.quantize_fp8(x, gran)  # the kept launch
    ref = cutedsl_gemm.quantize_fp8(x.cpu(), gran)
    for a, b, c in zip(first, again, ref):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
        assert torch.equal(a.cpu().view(torch.uint8) if a.element_size() == 1 else a.cpu(),
                           c.view(torch.uint8) if c.element_size() == 1 else c)
        assert _layout(a) == _layout(c)
    with pytest.raises(ValueError, match="row-major contiguous"):  # same signature, refused: the full checks say why
        cutedsl_gemm.quantize_fp8(torch.randn(512, 64, dtype=torch.bfloat16, device="cuda").t(), gran)


@pytest.mark.blackwell
@pytest.mark.parametrize("op,args", [("quantize_mx", ("e4m3",)), ("quantize_mx", ("e2m1",)), ("quantize_nvfp4", ())])
def test_opcheck_block_quantizers_on_cuda(op, args):
    x = torch.randn(130, 256, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(getattr(OPS, op).default, (x, *args))
    real = getattr(L, op)(x, *args)
    ref = (R.quantize_mx_reference(x, *args) if op == "quantize_mx" else R.quantize_nvfp4_reference(x))
    assert torch.equal(real[0].view(torch.uint8), ref.data.view(torch.uint8))

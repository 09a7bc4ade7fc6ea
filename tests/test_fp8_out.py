"""scaled_mm_fp8_out without a GPU: the instance table's rows of the GEMMs whose epilogue emits FP8 in 1x128 groups,
their configuration rules, dispatch (the twin of scaled_mm's own pick), the call's validation, the op's fake
implementation and tracing, and the compiled kernel's instructions."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.generators import catalog as C
from cutedsl_gemm.generators.c_export import skip_reason
from cutedsl_gemm.generators.runner import in_default_set
from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmPlan, smem_capacity
from cutedsl_gemm.numerics.formats import E4M3
from cutedsl_gemm.ops import library as L
from cutedsl_gemm.ops.quantize import quantize_fp8, quantize_fp8_like
from cutedsl_gemm.ops.scaled_mm import _scaled_mm_fp8_out_op, fp8_output_allocator
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import GEMM_FP8_OUT, INSTANCES, InstanceTableError, select, validate

HOPPER = ("sm_90a", 132)
DEV = torch.device("cuda", 0)
ROWS = select(op=GEMM_FP8_OUT)
DEEPSEEK = "1x128_128x128"


@pytest.fixture(autouse=True)
def _as_without_a_gpu(monkeypatch):
    """Fake calls are checked as on a machine without a GPU (or as ``fake_target`` says); dispatch sees an H100's
    resident clusters."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dispatch, "launch_clusters",
                        lambda index, inst: dispatch.cluster_slots(HOPPER[1], inst.cluster_m * inst.cluster_n)
                        * inst.ctas_per_sm)


def _operands(m, n, k, recipe=DEEPSEEK, device="meta", bias=None):
    """(a, b, scale_a, scale_b, bias) of a scaled_mm call in torch's layouts: a (M, K) e4m3, b = W.t() (K, N)."""
    kb = -(-k // 128)
    a = torch.empty(m, k, dtype=E4M3.torch_dtype, device=device)
    b = torch.empty(n, k, dtype=E4M3.torch_dtype, device=device).t()
    if recipe == DEEPSEEK:
        sa = torch.empty(kb, m, device=device).t()
        sb = torch.empty(kb, -(-n // 128), device=device)
    elif recipe == "row":
        sa, sb = torch.empty(m, 1, device=device), torch.empty(1, n, device=device)
    else:
        sa, sb = torch.empty((), device=device), torch.empty((), device=device)
    return a, b, sa, sb, None if bias is None else torch.empty(n, dtype=bias, device=device)


def _problem(m, n, k, recipe=DEEPSEEK, bias=None):
    return P.describe_scaled_mm_fp8_out(*_operands(m, n, k, recipe, bias=bias), DEV, target=HOPPER)[0]


def _layout(t):
    return tuple(t.shape), t.dtype, tuple(t.stride())


# ---- the table and the configuration -------------------------------------------------------------------------------


def test_rows_are_twins_of_every_scaled_mm_row_whose_tiles_hold_whole_groups():
    """Each row is a "gemm" row with another op (so it runs scaled_mm's main loop, tile and clusters), and every
    unswapped promoted e4m3 row of the per-tensor, row-wise and DeepSeek recipes whose tile is 128 wide has one."""
    assert ROWS and len(ROWS) == len(set(ROWS))
    table = set(INSTANCES)
    for inst in ROWS:
        assert dataclasses.replace(inst, op="gemm") in table, inst.name
        cfg = inst.sm90_config()
        assert cfg.d_quant == "1x128" and cfg.out_dtype == "bf16" and not cfg.swap_ab and cfg.tile_n % 128 == 0
        assert inst.can_split_k and dispatch.fp8_out_twin(dataclasses.replace(inst, op="gemm")) == inst
    wanted = {i for i in INSTANCES if i.op == "gemm" and i.arch == "sm_90a" and not i.swap_ab
              and i.recipe in ("tensor", "row", DEEPSEEK) and (i.a_dtype, i.b_dtype, i.out_dtype) == ("e4m3", "e4m3",
                                                                                                  "bf16")
              and i.accum == "promoted" and i.tile_n == 128 and i.bias_dtype in (None, "fp32")}
    assert {dataclasses.replace(i, op="gemm") for i in ROWS} == wanted
    assert any(i.split_tail for i in ROWS) and {i.tile_m for i in ROWS} == {64, 128}


def test_the_epilogue_stages_one_group_wide_buffer():
    for inst in ROWS:
        cfg = inst.sm90_config()
        stages = Sm90GemmPlan.max_stages(cfg)
        assert Sm90GemmPlan.epi_n(cfg) == 128 and Sm90GemmPlan.epi_buffers(cfg, stages) == 1
        assert stages >= 4 and Sm90GemmPlan.smem_usage(cfg, stages, 1) <= smem_capacity(cfg.ctas_per_sm)


@pytest.mark.parametrize("change,match", [
    (dict(d_quant="1x64"), "'1x128' or None"),
    (dict(swap_ab=True), "unswapped schedule"),
    (dict(tile_n=64), "multiple of 128"),
    (dict(tile_n=192), "multiple of 128"),
    (dict(out_dtype="fp16"), "out_dtype must be 'bf16'"),
    (dict(epi_stages=2), "epi_stages 0"),
])
def test_config_rules_name_what_is_wrong(change, match):
    cfg = ROWS[0].sm90_config()
    with pytest.raises(ValueError, match=match):
        Sm90GemmPlan.check_config(dataclasses.replace(cfg, **change))


def test_table_rejects_a_bad_row_with_its_reason():
    with pytest.raises(InstanceTableError, match="multiple of 128"):
        validate(dataclasses.replace(ROWS[0], tile_n=96))


# ---- dispatch ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [DEEPSEEK, "row", "tensor"])
def test_dispatch_runs_the_twin_of_scaled_mms_pick(recipe):
    """The one-kernel path is exactly scaled_mm's own pick (tile, clusters, K splits) with the FP8 epilogue; picks
    without a twin run the two kernels."""
    one = total = 0
    for m in (1, 100, 128, 1000, 4096):
        for n in (512, 1536, 7168):
            for k in (512, 7168):
                problem = _problem(m, n, k, recipe)
                inst, splits = dispatch.select(problem)
                got = dispatch.select_fp8_out(problem)
                total += 1
                twin = dispatch.fp8_out_twin(inst)
                assert got == (None if twin is None else (twin, splits)), (m, n, k)
                if got is not None:
                    one += 1
                    assert dataclasses.replace(got[0], op="gemm") == inst
                if inst.swap_ab or inst.tile_n != 128:
                    assert got is None
    assert 0 < one < total  # both paths run


def test_dispatch_examples():
    """Decode sizes run the two kernels (swapped tiles); prefill sizes on 128-wide tiles one, with the same K splits
    and last-wave split as scaled_mm."""
    assert dispatch.select_fp8_out(_problem(1, 7168, 7168)) is None
    assert dispatch.select_fp8_out(_problem(4096, 1536, 7168)) is None  # scaled_mm picks 128x192
    inst, splits = dispatch.select_fp8_out(_problem(4096, 7168, 7168))
    assert (inst.tile_m, inst.tile_n, inst.cluster_m, splits) == (128, 128, 2, 1) and inst.op == GEMM_FP8_OUT
    inst, splits = dispatch.select_fp8_out(_problem(100, 512, 7168))
    assert (inst.tile_m, inst.tile_n) == (64, 128) and splits > 1
    inst, splits = dispatch.select_fp8_out(_problem(1000, 7168, 7168))
    assert inst.split_tail and splits > 1
    inst, _ = dispatch.select_fp8_out(_problem(4096, 7168, 7168, bias=torch.float32))
    assert inst.bias_dtype == "fp32"
    assert dispatch.select_fp8_out(_problem(4096, 7168, 7168, bias=torch.bfloat16)) is None  # (no bf16-bias twin)


# ---- validation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: _operands(64, 200, 512, "row"), ValueError, "multiple of 128"),
    (lambda: _operands(64, 64, 512, "tensor"), ValueError, "multiple of 128"),
    (lambda: (torch.empty(64, 512, dtype=torch.bfloat16, device="meta"),
              *_operands(64, 256, 512, "tensor")[1:]), TypeError, "float8_e4m3fn"),
    (lambda: _operands(64, 256, 500), ValueError, "multiple of 16"),
    (lambda: (*_operands(64, 256, 512, "row")[:3], torch.empty(1, 255, device="meta"), None), ValueError, "scale"),
    (lambda: _operands(64, 256, 512, "row", bias=torch.float16), TypeError, "bias must be"),
])
def test_bad_calls_are_refused_with_what_was_expected(call, error, match):
    with pytest.raises(error, match=match):
        P.describe_scaled_mm_fp8_out(*call(), DEV, target=HOPPER)


def test_a_call_is_described_as_its_bf16_scaled_mm():
    problem, ops = P.describe_scaled_mm_fp8_out(*_operands(200, 1024, 7168), DEV, target=HOPPER)
    plain, _ = P.describe_scaled_mm(*_operands(200, 1024, 7168), torch.bfloat16, None, False, None, None, None, None,
                                    DEV, target=HOPPER)
    assert problem == plain and problem.out_name == "bf16" and problem.recipe == DEEPSEEK


def test_cpu_tensors_are_refused():
    a, b, sa, sb, _ = _operands(8, 256, 256, "row", device="cpu")
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        cutedsl_gemm.scaled_mm_fp8_out(a, b, sa, sb)


# ---- outputs: quantize_fp8's layout, which the next scaled_mm takes ------------------------------------------------


def test_outputs_are_laid_out_as_quantize_fp8_returns_them():
    y = torch.randn(37, 384, dtype=torch.bfloat16)
    q_ref, s_ref = quantize_fp8(y, "1x128")  # (the reference backend on the CPU)
    q, s = fp8_output_allocator(37, 384)(y)
    assert _layout(q) == _layout(q_ref) and _layout(s) == _layout(s_ref) == ((37, 3), torch.float32, (1, 37))
    # ... the DeepSeek recipe's A operand: the next layer's scaled_mm takes them as they are
    w_next = torch.empty(512, 384, dtype=E4M3.torch_dtype, device="meta")
    nxt, _ = P.describe_scaled_mm(q.to("meta"), w_next.t(), s.to("meta"), torch.empty(3, 4, device="meta"), None,
                                  torch.bfloat16, None, False, None, None, None, None, DEV, target=HOPPER)
    assert nxt.recipe == DEEPSEEK and (nxt.m, nxt.n, nxt.k) == (37, 512, 384)


def test_op_is_registered_functional_and_pt2_compliant():
    op = L.OPS.scaled_mm_fp8_out
    assert op.overloads() == ["default"] and torch.Tag.pt2_compliant_tag in op.default.tags
    assert str(op.default._schema) == ("cutedsl_gemm::scaled_mm_fp8_out(Tensor a, Tensor b, Tensor scale_a, "
                                       "Tensor scale_b, Tensor? bias=None) -> (Tensor, Tensor)")
    assert L.EAGER.scaled_mm_fp8_out is _scaled_mm_fp8_out_op


@pytest.mark.parametrize("recipe", [DEEPSEEK, "row", "tensor"])
def test_op_fake_gives_quantize_fp8s_outputs_of_the_bf16_output(recipe):
    with L.fake_target("sm_90a"), FakeTensorMode():
        a, b, sa, sb, bias = _operands(200, 1024, 512, recipe, device="cuda", bias=torch.float32)
        q, s = L.OPS.scaled_mm_fp8_out(a, b, sa, sb, bias)
        want = quantize_fp8_like(torch.empty(200, 1024, dtype=torch.bfloat16, device="cuda"), "1x128")
        assert (_layout(q), _layout(s)) == tuple(map(_layout, want))
        assert _layout(q) == ((200, 1024), E4M3.torch_dtype, (1024, 1)) and _layout(s) == ((200, 8), torch.float32,
                                                                                          (1, 200))
        with pytest.raises(ValueError, match="multiple of 128"):
            L.OPS.scaled_mm_fp8_out(*_operands(200, 1040, 512, recipe, device="cuda"))
        with pytest.raises(ValueError, match="inner dimensions differ"):
            L.OPS.scaled_mm_fp8_out(a, _operands(200, 1024, 640, recipe, device="cuda")[1], sa, sb)


def test_op_fake_without_a_gpu_checks_shapes_only():
    a, b, sa, sb, _ = _operands(8, 256, 256, "row")
    q, s = L.OPS.scaled_mm_fp8_out(a, b, sa, sb)
    assert _layout(q) == ((8, 256), E4M3.torch_dtype, (256, 1)) and _layout(s) == ((8, 2), torch.float32, (1, 8))
    with pytest.raises(ValueError, match="multiple of 128"):
        L.OPS.scaled_mm_fp8_out(*_operands(8, 144, 256, "row")[:4])
    with pytest.raises(ValueError, match="must be 2-D"):
        L.OPS.scaled_mm_fp8_out(a[0], b, sa, sb)


def test_compile_traces_two_layers_through_the_op_without_graph_breaks():
    def two_layers(a, w1, sa, sw1, w2, sw2):
        q, s = cutedsl_gemm.scaled_mm_fp8_out(a, w1.t(), sa, sw1)
        return cutedsl_gemm.scaled_mm(q, w2.t(), s, sw2)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    a, b1, sa, sb1, _ = _operands(8, 384, 256)
    _, b2, _, sb2, _ = _operands(8, 512, 384)
    y = torch.compile(two_layers, fullgraph=True, backend=backend)(a, b1.t(), sa, sb1, b2.t(), sb2)
    assert _layout(y) == ((8, 512), torch.bfloat16, (512, 1))
    ops = [str(n.target).removesuffix(".default") for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "cutedsl_gemm.scaled_mm_fp8_out" in ops and "cutedsl_gemm.scaled_mm" in ops


# ---- ahead of time ------------------------------------------------------------------------------------------------


def test_default_set_catalog_and_export():
    assert {i for i in ROWS if in_default_set(i)} == {i for i in ROWS if i.recipe == DEEPSEEK}
    assert all(C.code_config(i)["kernel"]["d_quant"] == "1x128" for i in ROWS)
    assert "gemm_fp8_out" in skip_reason(ROWS[0])  # the C registry describes scaled_mm's arguments


# ---- the compiled kernel -------------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("tile_m", [128, 64])
def test_kernel_quantizes_its_output_in_the_epilogue(tile_m):
    """The epilogue stages the bf16 tile (stmatrix), reads 16-element vectors of a row back (16-byte shared loads),
    takes each group's amax on packed bf16 pairs across 8 lanes (shuffles), converts with the group quantizer's e4m3
    conversion and stores 16 FP8 bytes per lane straight to global memory: no TMA store, no spills, no serialized
    WGMMAs."""
    from cutedsl_gemm.tools.ptx_inspect import find_ptxas, inspect_instance, ptxas_performance_notes

    inst = next(i for i in ROWS if i.recipe == DEEPSEEK and i.bias_dtype is None and i.tile_m == tile_m
                and not i.split_tail)
    rep = inspect_instance(inst)
    assert rep.has(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") and rep.has(r"stmatrix")
    assert rep.has(r"cvt\.rn\.satfinite\.e4m3x2\.f32") and rep.has(r"max\.bf16x2")
    assert rep.has(r"shfl\.sync\.bfly\.b32") and rep.has(r"ld\.shared\.v4\.b32")
    assert rep.has(r"st\.global\.v4\.b32")  # 16 FP8 bytes a lane
    assert not rep.has(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta")  # no TMA store of a bf16 output
    assert rep.frame_bytes == 0, f"{rep.name} spills ({rep.frame_bytes} B stack frame)"
    ptxas = find_ptxas()
    if ptxas is not None:
        assert not ptxas_performance_notes(rep.ptx, inst.arch, ptxas)


@pytest.mark.compile
def test_entries_refuse_the_other_kind_of_kernel():
    from cutedsl_gemm.families.sm90_gemm import fake_fp8_out_args, fake_gemm_args
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm
    from cutedsl_gemm.runtime.compile import compile_entry

    fp8_out = ROWS[0].sm90_config()
    plain = dataclasses.replace(fp8_out, d_quant=None)
    with pytest.raises(TypeError, match="entered through __call__"):
        compile_entry(Sm90Fp8Gemm(plain).call_fp8_out, fake_fp8_out_args(plain), "sm_90a")
    with pytest.raises(TypeError, match="entered through call_fp8_out"):
        compile_entry(Sm90Fp8Gemm(fp8_out), fake_gemm_args(fp8_out), "sm_90a")

"""Blackwell f8f6f4 GEMM (per-tensor scales, any pair of E4M3 / E5M2 / E3M2 / E2M3 / E2M1 operands).

CPU tiers: the sm_100a description of a ``scaled_mm`` call (``problem.describe_scaled_mm`` with an sm_100a
target) and its errors, the float64 reference for every type pair, the instruction-descriptor encoding, the
table's sm_100a rows, and (marked ``compile``) sm_100a compilation of the 1-CTA and 2-CTA kernels with PTX
checks and cache reuse across type pairs. ``blackwell`` tests run ``cutedsl_gemm.scaled_mm`` against the
reference; they need an sm_100 GPU (``pytest -m blackwell`` on a B200) and are skipped elsewhere.
"""

import itertools
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import codecs
from cutedsl_gemm.numerics.formats import F8F6F4_FORMATS
from cutedsl_gemm.numerics.reference import reference_f8f6f4, rel_error
from cutedsl_gemm.ops.scaled_mm import empty_result
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.runtime.jit import KERNEL_CACHE
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection import instances as table
from cutedsl_gemm.tools.ptx_inspect import keep_artifacts

FMTS = [f.name for f in F8F6F4_FORMATS]
PAIRS = list(itertools.product(FMTS, FMTS))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
B200 = ("sm_100a", 148)  # (arch, SMs) the CPU tests describe calls for


def _operands(m, n, k, fa, fb, device="cpu", seed=0):
    """a (M, K) and b (K, N) column-major, quantized to fa / fb, plus unit scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) * 2
    a = codecs.quantize_operand(x, fa).to(device)
    b = codecs.quantize_operand(w, fb).to(device).t()  # (K_storage, N), K contiguous
    one = torch.ones(1, dtype=torch.float32, device=device)
    return a, b, one, one.clone()


def describe(a, b, scale_a, scale_b, *, fmt_a=None, fmt_b=None, bias=None, out_dtype=torch.bfloat16, schedule=None):
    """(GemmProblem, GemmOperands) of ``scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=..., fmt_a=...,
    fmt_b=..., schedule=...)`` on an sm_100a GPU, without one."""
    return P.describe_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, None, False, None, None, schedule, None,
                                torch.device("cpu"), fmt_a, fmt_b, target=B200)


def sm100_instance(recipe="tensor", operands=table.F8F6F4, out="bf16", bias="fp32", schedule="2sm"):
    (inst,) = table.select(arch="sm_100a", recipe=recipe, a_dtype=operands, out_dtype=out, bias_dtype=bias,
                           schedule=schedule)
    return inst


# ------------------------------------------------------------------------------------------------
# Reference and validation (CPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fa,fb", PAIRS)
def test_reference_every_pair_matches_decoded_matmul(fa, fb):
    a, b, sa, sb = _operands(8, 16, 128, fa, fb)
    sa.fill_(0.5)
    sb.fill_(3.0)
    bias = torch.linspace(-1, 1, 16)
    ref = reference_f8f6f4(a, b, fmt_a=fa, fmt_b=fb, scale_a=sa, scale_b=sb, bias=bias)
    # Independent path: decode each element through the code tables row by row.
    av = codecs.decode_operand(a, fa).double()
    wv = torch.stack([codecs.decode_operand(b.t()[i : i + 1], fb)[0] for i in range(16)]).double()
    want = 1.5 * av @ wv.t() + bias.double()
    assert ref.dtype == torch.float64 and ref.shape == (8, 16)
    assert torch.allclose(ref, want, rtol=0, atol=1e-9)
    assert want.abs().max() > 0


def test_describe_accepts_torch_fp4_and_infers_formats():
    a, b, sa, sb = _operands(4, 8, 128, "e4m3", "e2m1")
    b4 = b.t().contiguous().view(torch.float4_e2m1fn_x2).t()
    p, ops = describe(a, b4, sa, sb)  # both formats from the dtypes
    assert (p.a_format, p.b_format, p.m, p.n, p.k) == ("e4m3", "e2m1", 4, 8, 128)
    assert ops.b.shape == (8, 64) and ops.b.dtype == torch.uint8
    assert (p.arch, p.recipe, p.accum) == ("sm_100a", "tensor", "fast")


def test_describe_requires_format_for_packed_uint8():
    a, b, sa, sb = _operands(4, 8, 128, "e2m3", "e4m3")
    with pytest.raises(TypeError, match="fmt_a"):
        describe(a, b, sa, sb)
    p, ops = describe(a, b, sa, sb, fmt_a="e2m3")
    assert p.k == 128 and ops.a.shape == (4, 96)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(fa="e2m1", k=64), ValueError, "multiple of 128 elements"),
        (dict(fa="e3m2", k=192), ValueError, "multiple of 128 elements"),
        (dict(fa="e4m3", k=40), ValueError, "multiple of 16 elements"),
        (dict(fa="e5m2", fmt_a="e4m3"), TypeError, "must be stored as"),
        (dict(fa="e4m3", fmt_a="ue8m0"), ValueError, "must be one of e4m3"),
        (dict(fa="e4m3", out_dtype=torch.int8), TypeError, "out_dtype"),
        (dict(fa="e4m3", n=12), ValueError, "multiple of 16 bytes"),
    ],
)
def test_describe_rejects(kwargs, exc, match):
    k = kwargs.pop("k", 128)
    n = kwargs.pop("n", 16)
    fa = kwargs.pop("fa")
    a, b, sa, sb = _operands(4, n, k, fa, "e4m3")
    kw = dict(fmt_a=kwargs.pop("fmt_a", fa if a.dtype == torch.uint8 else None), **kwargs)
    with pytest.raises(exc, match=match):
        describe(a, b, sa, sb, **kw)


def test_describe_rejects_misaligned_subbyte_base_and_layouts():
    a, b, sa, sb = _operands(4, 16, 256, "e2m1", "e4m3")
    storage = torch.zeros(4 * 128 + 16, dtype=torch.uint8)
    shift = (16 - storage.data_ptr() % 32) % 32  # a base that is 16- but not 32-byte aligned
    mis = storage[shift : shift + 4 * 128].view(4, 128)
    assert mis.data_ptr() % 32 == 16
    with pytest.raises(ValueError, match="32-byte aligned"):
        describe(mis, b, sa, sb, fmt_a="e2m1")
    with pytest.raises(ValueError, match="K-contiguous"):
        describe(a, b.t().contiguous(), sa, sb, fmt_a="e2m1", fmt_b="e4m3")  # (N, K)
    with pytest.raises(ValueError, match="packed back to back"):
        describe(torch.zeros(4, 256, dtype=torch.uint8)[:, :128], b, sa, sb, fmt_a="e2m1")
    with pytest.raises(ValueError, match="one-element torch.float32"):
        describe(a, b, torch.ones(4), sb, fmt_a="e2m1")
    with pytest.raises(ValueError, match="K mismatch"):
        a2, _, _, _ = _operands(4, 16, 128, "e2m1", "e4m3")
        describe(a2, b, sa, sb, fmt_a="e2m1")
    with pytest.raises(ValueError, match=r"bias must have shape .*\(16,\)"):
        describe(a, b, sa, sb, fmt_a="e2m1", bias=torch.zeros(8))


def test_resources_unchanged_by_the_scaling_hooks():
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import Sm100F8F6F4Gemm, describe_resources

    r = describe_resources(Sm100F8F6F4Gemm())
    # 6 stages of 128x128 A + B bytes, 256 TMEM columns (two 128-column accumulators), as before the hooks
    assert (r["num_ab_stage"], r["tmem_cols"], r["tma_load_bytes"]) == (6, 256, 32768)
    assert r["smem_bytes"] <= r["smem_capacity"]


def test_zero_k_is_accepted_and_has_a_defined_result():
    _, _, sa, sb = _operands(4, 16, 128, "e4m3", "e4m3")
    a = torch.empty(4, 0, dtype=torch.float8_e4m3fn)
    b = torch.empty(16, 0, dtype=torch.float8_e4m3fn).t()
    p, ops = describe(a, b, sa, sb, bias=torch.ones(16), out_dtype=torch.float32)
    assert (p.m, p.n, p.k) == (4, 16, 0) and p.is_empty
    # what scaled_mm returns for K == 0 instead of launching (the kernel never clears TMEM then)
    assert torch.equal(empty_result(p, ops, torch.empty(4, 16)), torch.ones(4, 16))


def test_every_pair_shares_one_compile_key():
    keys = set()
    for fa, fb in PAIRS:
        a, b, sa, sb = _operands(4, 16, 128, fa, fb)
        keys.add(dispatch.select(describe(a, b, sa, sb, fmt_a=fa, fmt_b=fb)[0]))
    assert len(keys) == 1
    assert not any(name in repr(keys) for name in FMTS)


def test_sm100_rows_select_as_before():
    """Per-tensor calls pick the dense f8f6f4 kernel: 1-CTA up to M = 128, 2-CTA (a 256-row MMA over a 2x1
    cluster) above, 128-wide tiles, the caller's out dtype and bias; schedule= forces either CTA mode."""
    for m, schedule, cluster in ((1, "1sm", 1), (128, "1sm", 1), (129, "2sm", 2), (4096, "2sm", 2)):
        a, b, sa, sb = _operands(m, 16, 128, "e2m3", "e2m1")
        inst, splits = dispatch.select(describe(a, b, sa, sb, fmt_a="e2m3", fmt_b="e2m1")[0])
        assert (inst.arch, inst.mma_kind, inst.schedule, inst.cluster_m, inst.tile_m, inst.tile_n, splits) == \
            ("sm_100a", "f8f6f4", schedule, cluster, 128, 128, 1), inst.name
        assert (inst.out_dtype, inst.bias_dtype) == ("bf16", None)
    a, b, sa, sb = _operands(256, 16, 128, "e4m3", "e4m3")
    for forced in ("1sm", "2sm"):
        inst, _ = dispatch.select(describe(a, b, sa, sb, schedule=forced, bias=torch.zeros(16, dtype=torch.bfloat16),
                                           out_dtype=torch.float16)[0])
        assert (inst.schedule, inst.out_dtype, inst.bias_dtype) == (forced, "fp16", "fp32")  # bias read as fp32
    with pytest.raises(ValueError, match="schedule must be None or one of '1sm', '2sm' on sm_100a"):
        describe(a, b, sa, sb, schedule="cooperative")


def test_sm100_rows_are_checked_by_their_kernel():
    """The table's sm_100a rows: every out dtype and bias in 1- and 2-CTA mode for each kind, validated by the
    kernel's own checks (``instances.validate``)."""
    rows = table.select(arch="sm_100a")
    assert {(i.mma_kind, i.schedule, i.out_dtype, i.bias_dtype) for i in rows} == set(itertools.product(
        ("f8f6f4", "mxf8f6f4", "mxf4", "mxf4nvf4"), ("1sm", "2sm"), ("bf16", "fp16", "fp32"), (None, "fp32")))
    assert len(rows) == 48 and all(i.tile_n == 128 and i.accum == "fast" and not i.can_split_k for i in rows)
    inst = sm100_instance()
    for bad, match in ((dict(tile_n=96), "tile_n must be 64, 128 or 256"),
                       (dict(cluster_m=1), "'2sm' .* in 2x1"),
                       (dict(tile_m=256), "a CTA tile is 128 rows"),
                       (dict(bias_dtype="bf16"), "bias is read as fp32"),
                       (dict(recipe="row"), "is no tcgen05 kind"),
                       (dict(recipe="nvfp4"), "is no tcgen05 kind"),  # NVFP4 takes e2m1 operands only
                       (dict(stages=4), "fixes"),
                       (dict(tile_k=256), "tile_k must be the kernel's K tile, 128")):
        with pytest.raises(table.InstanceTableError, match=match):
            table.validate(replace(inst, **bad))
    table.validate(replace(inst, tile_n=64, schedule="1sm", cluster_m=1))  # the kernel builds 64-wide tiles too


def test_the_table_loads_whatever_arch_the_dsl_targets():
    """Validating the sm_100a rows builds nothing the DSL checks against its target arch (a Blackwell TMA op
    refuses sm_90a), so the package imports on a Hopper GPU or with CUTE_DSL_ARCH=sm_90a."""
    code = "from cutedsl_gemm.selection.instances import INSTANCES; print(len({i.arch for i in INSTANCES}))"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "2", run.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10, reason="sm_100 present")
def test_launch_refuses_cpu_or_non_blackwell():
    a, b, sa, sb = _operands(4, 16, 128, "e4m3", "e2m1")
    a, b, sa, sb = (t.to(DEV) for t in (a, b, sa, sb))
    with pytest.raises(ValueError, match=r"sm_100"):
        cutedsl_gemm.scaled_mm(a, b, sa, sb, fmt_b="e2m1")


def test_static_instruction_descriptor_matches_dsl_builder():
    from cutlass.experimental import primitives as prims

    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import MMA_FORMAT_CODE, Sm100F8F6F4Gemm

    for m, n in ((128, 64), (128, 128), (256, 128), (256, 256)):
        want = int(prims.Tcgen05InstrDesc.build(c_dtype=__import__("cutlass").Float32, m_dim=m, n_dim=n))
        assert Sm100F8F6F4Gemm._static_idesc(m, n) == want
    # Format codes as the PTX instruction-descriptor table (and the DSL's enum) define them.
    assert MMA_FORMAT_CODE == {k: int(getattr(prims.Tcgen05InputFormat, k.upper())) for k in MMA_FORMAT_CODE}


# ------------------------------------------------------------------------------------------------
# Compilation for sm_100a (CPU)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled():
    """1-CTA and 2-CTA kernels (bf16 out, with bias) compiled once for the module through the JIT cache, with
    their PTX kept."""
    before = KERNEL_CACHE.stats.compiles
    out = {}
    for use_2cta in (False, True):
        inst = sm100_instance(schedule="2sm" if use_2cta else "1sm")
        with keep_artifacts("sm_100a"):
            out[use_2cta] = (inst, launch.compiled(inst))
    out["compiles"] = KERNEL_CACHE.stats.compiles - before
    return out


def _mma_lines(ptx):
    return [ln.strip() for ln in ptx.splitlines() if "tcgen05.mma" in ln]


@pytest.mark.compile
@pytest.mark.parametrize("use_2cta,group", [(False, 1), (True, 2)])
def test_ptx_issues_f8f6f4_mma_with_runtime_descriptor(compiled, use_2cta, group):
    _, fn = compiled[use_2cta]
    ptx = fn.__ptx__
    assert ptx and ".target sm_100a" in ptx
    lines = _mma_lines(ptx)
    assert len(lines) == 4, lines  # 4 K blocks of 32 per 128-wide K tile
    idesc_regs = set()
    for ln in lines:
        mt = re.match(rf"tcgen05\.mma\.cta_group::{group}\.kind::f8f6f4\S*\s+\[%r\d+\],\s*%rd\d+,\s*%rd\d+,"
                      r"\s*(%r\d+),", ln)
        assert mt, ln
        idesc_regs.add(mt.group(1))
    assert len(idesc_regs) == 1
    reg = idesc_regs.pop()
    # The descriptor register is (run-time bits) OR (static M/N/accumulator bits) ...
    m_tile = 256 if use_2cta else 128
    static = sm100_static(m_tile, 128)
    defs = re.findall(rf"or\.b32\s+{re.escape(reg)},\s*(%r\d+),\s*(\d+);", ptx)
    assert defs and int(defs[0][1]) == static, defs
    # ... and the run-time bits are two kernel parameters shifted into a_format (7) and b_format (10).
    src = defs[0][0]
    parts = re.findall(rf"or\.b32\s+{re.escape(src)},\s*(%r\d+),\s*(%r\d+);", ptx)
    assert parts, src
    shifts = {}
    for r in parts[0]:
        sh = re.findall(rf"shl\.b32\s+{re.escape(r)},\s*(%r\d+),\s*(\d+);", ptx)
        assert sh, r
        shifts[int(sh[0][1])] = sh[0][0]
    assert sorted(shifts) == [7, 10]
    for r in shifts.values():
        assert re.search(rf"ld\.param\.b32\s+{re.escape(r)},\s*\[\w+_param_\d+\];", ptx), r


def sm100_static(m, n):
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import Sm100F8F6F4Gemm

    return Sm100F8F6F4Gemm._static_idesc(m, n)


@pytest.mark.compile
@pytest.mark.parametrize("use_2cta,group", [(False, 1), (True, 2)])
def test_ptx_structure(compiled, use_2cta, group):
    ptx = compiled[use_2cta][1].__ptx__
    assert f"tcgen05.alloc.cta_group::{group}" in ptx and f"tcgen05.dealloc.cta_group::{group}" in ptx
    assert f"tcgen05.commit.cta_group::{group}" in ptx
    assert "tcgen05.ld.sync.aligned" in ptx
    # the block-scaled hooks of this kernel class are off: no scale copies, no block-scaled MMA
    assert "tcgen05.cp" not in ptx and "block_scale" not in ptx
    # Three TMA descriptors per operand (8-bit, 6-bit unpack, 4-bit unpack): six load sites, one store.
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.tile\.mbarrier::complete_tx::bytes", ptx)
    assert len(loads) == 6
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)) == 1
    # Per-stage byte count is a run-time value (depends on the operand formats).
    assert re.search(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+%rd\d+,\s*\[%r\d+\],\s*%r\d+;", ptx)


@pytest.mark.compile
def test_second_type_pair_reuses_compilation(compiled):
    assert compiled["compiles"] == 2  # one per CTA mode, none per type pair
    before = KERNEL_CACHE.stats.compiles
    for fa, fb in (("e4m3", "e4m3"), ("e2m3", "e2m1"), ("e3m2", "e5m2")):
        a, b, sa, sb = _operands(256, 128, 256, fa, fb)
        p, _ = describe(a, b, sa, sb, fmt_a=fa, fmt_b=fb, bias=torch.zeros(128), schedule="1sm")
        assert launch.compiled(dispatch.select(p)[0]) is compiled[False][1]
    assert KERNEL_CACHE.stats.compiles == before


@pytest.mark.compile
def test_tma_data_type_per_operand_format():
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import (
        MMA_FORMAT_CODE,
        STORAGE_OF_CODE,
        Sm100F8F6F4Gemm,
        describe_tma_loads,
    )

    # Storage class (8-bit, 6-bit unpack, 4-bit unpack) and the tensor-map data type it requests:
    # CU_TENSOR_MAP_DATA_TYPE_UINT8, _16U6_ALIGN16B (.b6x16_p32) and _16U4_ALIGN16B (.b4x16_p64).
    storage_class = {"e4m3": 0, "e5m2": 0, "e2m3": 1, "e3m2": 1, "e2m1": 2}
    tma_data_type = {0: "U8", 1: "U6_UNPACK_U8", 2: "U4_UNPACK_U8"}
    found = describe_tma_loads(Sm100F8F6F4Gemm())
    for fmt in FMTS:
        storage = storage_class[fmt]
        assert STORAGE_OF_CODE[MMA_FORMAT_CODE[fmt]] == storage
        desc = found[storage]
        assert f"tma_format = {tma_data_type[storage]}>" in desc, (fmt, desc)
        # One 128 x 128 K tile moves 128*128*bits of global memory, which is what the TMA warp expects.
        bits = {"e4m3": 8, "e5m2": 8, "e2m3": 6, "e3m2": 6, "e2m1": 4}[fmt]
        assert f"copy_bits = {128 * 128 * bits}," in desc


# ------------------------------------------------------------------------------------------------
# On an sm_100 GPU (pytest -m blackwell on a B200; skipped elsewhere)
# ------------------------------------------------------------------------------------------------


@pytest.mark.blackwell
@pytest.mark.parametrize("fa,fb", PAIRS)
@pytest.mark.parametrize("m,n,k,use_2cta", [(128, 128, 128, False), (300, 200, 384, False), (512, 256, 512, True)])
def test_gpu_matches_reference(fa, fb, m, n, k, use_2cta):
    a, b, sa, sb = _operands(m, n, k, fa, fb, device="cuda", seed=m + n + k)
    sa.fill_(0.25)
    bias = torch.randn(n, device="cuda")
    out = cutedsl_gemm.scaled_mm(a, b, sa, sb, bias, fmt_a=fa, fmt_b=fb, schedule="2sm" if use_2cta else "1sm")
    ref = reference_f8f6f4(a, b, fmt_a=fa, fmt_b=fb, scale_a=sa, scale_b=sb, bias=bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_error(out, ref) <= 2e-3


@pytest.mark.blackwell
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_gpu_output_dtypes_without_bias(out_dtype):
    a, b, sa, sb = _operands(256, 256, 256, "e2m3", "e2m1", device="cuda")
    out = cutedsl_gemm.scaled_mm(a, b, sa, sb, out_dtype=out_dtype, fmt_a="e2m3", fmt_b="e2m1")
    ref = reference_f8f6f4(a, b, fmt_a="e2m3", fmt_b="e2m1", scale_a=sa, scale_b=sb)
    assert out.dtype == out_dtype
    assert rel_error(out, ref) <= (1e-5 if out_dtype == torch.float32 else 2e-3)

"""INT8 (W8A8) without a GPU: the integer formats, the reference quantizer's contract, the int8 GEMM reference,
``scaled_mm``'s checks and kernel choice for int8 operands, and (compile tier) the s8 WGMMA kernels and the int8
quantizer kernels built for sm_90a."""

import re

import numpy as np
import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm import problem as V
from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmConfig, Sm90GemmPlan
from cutedsl_gemm.numerics import formats as F
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import INSTANCES, operand_dtypes, select

H100 = ("sm_90a", 132)


def int8(*shape, seed=0):
    return torch.randint(-127, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


# ------------------------------------------------------------------------------------------------
# Formats and the reference numerics
# ------------------------------------------------------------------------------------------------
def test_integer_formats():
    assert (F.INT8.bits, F.INT8.max_finite, F.INT8.max_code, F.INT8.integer) == (8, 127.0, 127, True)
    assert (F.INT4.bits, F.INT4.max_finite, F.INT4.max_code, F.INT4.elements_per_byte) == (4, 7.0, 7, 2)
    assert F.INT4.integer and F.INT4.torch_dtype is None  # stored two per byte in a uint8 / int8 tensor
    assert F.element_format(torch.int8) is F.INT8 and F.element_format("int4") is F.INT4
    assert F.DTYPE_FORMATS[torch.int8] is F.INT8 and not F.E4M3.integer
    import cutlass

    assert F.INT8.cutlass_dtype() is cutlass.Int8 and F.INT4.cutlass_dtype() is cutlass.Int4
    from cutedsl_gemm.kernels.sm90.quantize_fp8 import INT8_MAX  # the quantizer kernel's own copy

    assert INT8_MAX == F.INT8.max_finite


def test_round_to_int_contract():
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 127.49, 127.5, 300.0, -1e30, float("inf"), float("-inf"),
                      float("nan"), -0.0, 3.4999])
    assert R.round_to_int(y, F.INT8).tolist() == [0, 2, 2, 0, -2, 126, 127, 127, 127, -127, 127, -127, 0, 0, 3]
    assert R.round_to_int(y, "int8").dtype == torch.int8
    with pytest.raises(ValueError, match="integer formats"):
        R.round_to_int(y, F.E4M3)


def naive_quantize_int8(x: torch.Tensor, per_row: bool):
    """The contract written out per group with numpy float32 arithmetic."""
    xf = x.float().numpy()
    groups = [xf[i:i + 1] for i in range(xf.shape[0])] if per_row else [xf]
    qs, scales = [], []
    for g in groups:
        fin = np.abs(g[np.isfinite(g)])
        amax = np.float32(fin.max()) if fin.size else np.float32(0)
        s = np.float32(amax / np.float32(127)) if amax > 0 else np.float32(1)
        with np.errstate(all="ignore"):
            y = np.clip(g / s, np.float32(-127), np.float32(127))
        qs.append(np.nan_to_num(np.rint(y), nan=0.0).astype(np.int8))  # rint: ties to even
        scales.append(s)
    return torch.from_numpy(np.concatenate(qs)), torch.tensor(scales).reshape(-1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("gran", ["row", "tensor"])
def test_reference_quantizer_matches_the_contract(gran, dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 96, generator=g) * torch.exp2(torch.randint(-12, 12, (40, 1), generator=g).float())
    x[0] = 0.0  # an all-zero row: scale 1, zeros
    x[1, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    x[2] = float("nan")  # a non-finite-only row: scale 1
    x[2, 5] = float("-inf")
    x[3, :4] = torch.tensor([0.5, 1.5, 2.5, 127.0])  # ties on a scale-1 row (amax 127)
    x[3, 4:] = 0.0
    x = x.to(dtype)
    q, s = R.quantize_int8_reference(x, gran)
    qn, sn = naive_quantize_int8(x, gran == "row")
    assert q.dtype == torch.int8 and torch.equal(q, qn)
    assert torch.equal(s.reshape(-1), sn.reshape(-1).to(s.dtype))
    assert int(q.min()) >= -127 and int(q.max()) <= 127  # symmetric: -128 never appears
    if gran == "row":
        assert s[0].item() == 1.0 and not q[0].any() and s[2].item() == 1.0
        assert q[1, :3].tolist() == [127, -127, 0] and q[2, 5].item() == -127 and q[2, 0].item() == 0
        assert s[3].item() == 1.0 and q[3, :4].tolist() == [0, 2, 2, 127]
        rows = torch.arange(4, 40)
        assert (q[rows].abs().amax(dim=1) == 127).all()  # each row's amax lands on 127
        # half a step, plus the rounding of the fp32 quotient before it is rounded to an integer
        step = s[rows].double()
        assert ((x[rows].double() - q[rows].double() * step).abs() <= step * (0.5 + 2**-16)).all()


def test_quantize_int8_op_on_the_cpu():
    x = torch.randn(33, 64, dtype=torch.bfloat16)
    q, s = cutedsl_gemm.quantize_int8(x)  # "row", backend auto: the reference on a CPU tensor
    qr, sr = R.quantize_int8_reference(x, "row")
    assert torch.equal(q, qr) and torch.equal(s, sr) and s.shape == (33, 1) and s.is_contiguous()
    q, s = cutedsl_gemm.quantize_int8(x, "TensorWise", backend="reference")
    assert s.shape == () and q.dtype == torch.int8 and q.shape == (33, 64)
    q, s = cutedsl_gemm.quantize_int8(torch.empty(0, 32))
    assert q.shape == (0, 32) and q.dtype == torch.int8 and s.shape == (0, 1)


@pytest.mark.parametrize("args,exc,text", [
    ((torch.randn(4, 32), "1x128"), ValueError, "per row or per tensor"),
    ((torch.randn(4, 32), "bogus"), ValueError, "unknown scale granularity"),
    ((torch.ones(4, 32, dtype=torch.int32),), TypeError, "bfloat16, float16 or float32"),
    ((torch.randn(2, 4, 32),), ValueError, "2-D"),
])
def test_quantize_int8_errors(args, exc, text):
    with pytest.raises(exc, match=text):
        cutedsl_gemm.quantize_int8(*args)


def test_quantize_int8_kernel_backend_errors():
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        cutedsl_gemm.quantize_int8(torch.randn(4, 32), backend="kernel")
    with pytest.raises(ValueError, match="multiple of 16"):
        cutedsl_gemm.quantize_int8(torch.randn(4, 40), backend="kernel")


def test_int8_gemm_reference_is_the_exact_integer_product():
    a, w = int8(9, 300, seed=1), int8(24, 300, seed=2)
    sa, sb = torch.rand(9, 1) + 0.5, torch.rand(1, 24) + 0.5
    exact = (a.long() @ w.long().t()).double()
    assert torch.equal(R.reference_int8_mm(a, w.t(), sa, sb), exact * sa.double() * sb.double())
    bias = torch.randn(24)
    assert torch.equal(R.reference_int8_mm(a, w.t(), torch.tensor(0.5), torch.tensor([[2.0]]), bias),
                       exact + bias.double())
    # the dequantized product (reference_gemm) agrees up to its float64 rounding
    assert R.rel_error(R.reference_gemm(a, sa, w, sb.t(), "row"), R.reference_int8_mm(a, w.t(), sa, sb)) < 1e-14
    with pytest.raises(TypeError, match="torch.int8"):
        R.reference_int8_mm(a.float(), w.t(), sa, sb)


# ------------------------------------------------------------------------------------------------
# scaled_mm: validation and kernel choice (CPU tensors described as an H100's)
# ------------------------------------------------------------------------------------------------
def describe(a, b, scale_a, scale_b, bias=None, use_fast_accum=False, target=H100, **kw):
    return V.describe_scaled_mm(a, b, scale_a, scale_b, bias, torch.bfloat16, None, use_fast_accum,
                                kw.pop("scale_recipe_a", None), kw.pop("scale_recipe_b", None), None, None,
                                torch.device("cpu"), target=target, **kw)


def test_int8_calls_are_described_and_run_by_int8_kernels():
    m, n, k = 64, 512, 256
    a, w = int8(m, k), int8(n, k)
    for fast in (False, True):  # the int32 sum is exact: both run the same (accumulate-all-of-K) kernels
        p, ops = describe(a, w.t(), torch.ones(m, 1), torch.ones(1, n), use_fast_accum=fast)
        assert (p.a_format, p.b_format, p.recipe, p.accum) == ("int8", "int8", "row", "fast")
    p, _ = describe(a, w.t(), torch.ones(()), torch.ones(1, 1))
    assert p.recipe == "tensor"
    assert operand_dtypes("sm_90a", "row", "int8", "int8") == ("int8", "int8")
    for m, schedule in ((1, "small_m"), (16, "small_m"), (32, "small_m"), (4096, "cooperative")):
        inst = dispatch.select_gemm("sm_90a", "row", "int8", "int8", "bf16", None, m, "fast", n=7168, sms=132,
                                    k=2048)
        assert (inst.a_dtype, inst.b_dtype, inst.accum, inst.schedule) == ("int8", "int8", "fast", schedule)
    wide = select(arch="sm_90a", recipe="row", a_dtype="int8", out_dtype="bf16", bias_dtype=None, tile_m=128,
                  tile_n=192, split_tail=False)
    tail = dispatch.last_wave_variant(wide[0])  # the 128x192 tile's last-wave split sibling
    assert tail is not None and tail.split_tail and tail.a_dtype == "int8" and tail.can_split_k


def test_int8_instances_are_valid_fast_epilogue_scaled_kernels():
    mine = [i for i in INSTANCES if i.op == "gemm" and "int8" in (i.a_dtype, i.b_dtype)]
    assert mine and all(i.a_dtype == i.b_dtype == "int8" for i in mine)
    assert {i.recipe for i in mine} == {"tensor", "row"} and {i.accum for i in mine} == {"fast"}
    assert {i.schedule for i in mine} == {"small_m", "cooperative"} and any(i.swap_ab for i in mine)
    assert len(mine) < len(INSTANCES) / 8  # a block of the table, not a second table


@pytest.mark.parametrize("change,text", [
    (dict(accum="promoted"), "accum must be 'fast'"),
    (dict(recipe="1x128_128x128", accum="fast"), "recipe must be 'tensor' or 'row'"),
    (dict(b_dtype="e4m3"), "int8 operands pair with int8 only"),
])
def test_int8_kernel_configuration_rules(change, text):
    cfg = dict(a_dtype="int8", b_dtype="int8", accum="fast", recipe="row", tile_m=128, tile_n=128)
    Sm90GemmPlan.check_config(Sm90GemmConfig(**cfg))
    with pytest.raises(ValueError, match=text):
        Sm90GemmPlan.check_config(Sm90GemmConfig(**{**cfg, **change}))


def test_int8_k_limit_is_exact_for_any_int8_data():
    assert V.INT8_MAX_K == 131071 and V.INT8_MAX_K * 128 * 128 <= 2**31 - 1 < (V.INT8_MAX_K + 1) * 128 * 128
    k = V.INT8_MAX_K + 1
    with pytest.raises(ValueError, match="exact up to K = 131071"):
        describe(torch.zeros(1, k, dtype=torch.int8), torch.zeros(16, k, dtype=torch.int8).t(), torch.ones(()),
                 torch.ones(()))


def test_bad_int8_calls_get_clear_errors():
    m, n, k = 64, 128, 256
    a, w = int8(m, k), int8(n, k)
    fp8 = torch.randn(n, k).to(torch.float8_e4m3fn)
    one = torch.ones(())
    with pytest.raises(TypeError, match="int8 operands pair with int8.*b is torch.float8_e4m3fn"):
        describe(a, fp8.t(), one, one)
    with pytest.raises(TypeError, match="a is torch.float8_e4m3fn, b is torch.int8"):
        describe(fp8[:m], w.t(), one, one)
    with pytest.raises(ValueError, match=r"int8 operands take fp32 TensorWise .* got \(64, 2\) and \(2, 1\)"):
        describe(a, w.t(), torch.ones(m, 2), torch.ones(2, 1))  # the DeepSeek block recipe's shapes
    with pytest.raises(ValueError, match="block scales do not apply \\(got BlockWise1x128\\)"):
        describe(a, w.t(), torch.ones(m, 2), torch.ones(2, n), scale_recipe_a="1x128", scale_recipe_b="1x128")
    with pytest.raises(ValueError, match="block scales do not apply \\(got a list of scales\\)"):
        describe(a, w.t(), [one, one], one)
    with pytest.raises(ValueError, match="expand a per-tensor scale of W to \\(1, N\\)"):
        describe(a, w.t(), torch.ones(m, 1), one)
    with pytest.raises(ValueError, match="one element each or \\(64, 1\\) and \\(1, 128\\)"):
        describe(a, w.t(), torch.ones(m + 1, 1), torch.ones(1, n))
    with pytest.raises(TypeError, match="scale_a must be torch.float32"):
        describe(a, w.t(), torch.ones(m, 1, dtype=torch.float64), torch.ones(1, n))
    from torch.nn.functional import SwizzleType

    with pytest.raises(ValueError, match="no swizzled layout"):
        describe(a, w.t(), one, one, swizzle_a=SwizzleType.SWIZZLE_32_4_4)
    with pytest.raises(ValueError, match="torch.int8 operands take none"):
        describe(a, w.t(), one, one, fmt_a="e4m3")
    with pytest.raises(ValueError, match="int8 operands run on Hopper \\(sm_90a\\); sm_100a runs"):
        describe(a, w.t(), one, one, target=("sm_100a", 148))
    with pytest.raises(ValueError, match="must be K-major"):
        describe(a, w.t().contiguous(), one, one)


def test_bench_gemm_int8_rows_carry_our_fp8_time():
    from benchmarks import bench_gemm

    row = dict(set="square", recipe="int8", m=4096, n=4096, k=4096, ours_us=70.0, cublas_us=110.0, bf16_us=140.0,
               ratio=110 / 70, tflops=1963.0, pct_peak=99.2, gbps=1.0, err=1e-3, cublas_err=1e-3, fp8_us=69.0)
    fp8_row = {k: v for k, v in row.items() if k != "fp8_us"} | {"recipe": "row"}
    columns, table = bench_gemm.result_table([row, fp8_row], ["square"])
    assert columns[-1] == "FP8 us" and table[0][-1] == 69.0 and table[1][-1] != table[1][-1]  # NaN: no FP8 twin
    assert bench_gemm.result_table([fp8_row], ["square"])[0][-1] == "BF16 us"  # FP8-only tables unchanged
    assert bench_gemm.title(["square"], False, ["int8"]).startswith("INT8 (W8A8) GEMM")


# ------------------------------------------------------------------------------------------------
# Compile tier: sm_90a PTX
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int8_reports():
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    # a cooperative tile with split-K compiled in, and the swapped decode kernel with a bias
    coop = select(arch="sm_90a", schedule="cooperative", recipe="row", a_dtype="int8", out_dtype="bf16",
                  bias_dtype=None, tile_m=128, tile_n=192, split_tail=False)[0]
    small = dispatch.select_gemm("sm_90a", "row", "int8", "int8", "bf16", "bf16", 16, "fast")
    assert coop.can_split_k and small.swap_ab and small.can_split_k
    return {"cooperative": inspect_instance(coop), "small_m": inspect_instance(small)}


@pytest.mark.compile
def test_int8_kernels_run_s8_wgmma_into_int32(int8_reports):
    from cutedsl_gemm.tools.ptx_inspect import WGMMA_S8, find_ptxas, ptxas_performance_notes

    for rep in int8_reports.values():
        assert rep.has(WGMMA_S8) and not rep.has(r"wgmma\.mma_async[\w.]*\.f32\."), rep.name
        assert rep.has(r"cvt\.rn\.f32\.s32"), rep.name  # the epilogue converts the exact int32 sums
        assert rep.has(r"cp\.async\.bulk\.tensor") and rep.has(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232\b")
        assert rep.frame_bytes == 0 and 0 < rep.registers <= 168, rep.name
        ptxas = find_ptxas()
        if ptxas is not None:
            assert ptxas_performance_notes(rep.ptx, "sm_90a", ptxas) == [], rep.name
    assert int8_reports["small_m"].has(r"m64n16k32\.satfinite\.s32\.s8\.s8")  # W rows on WGMMA's M side


@pytest.mark.compile
def test_int8_split_k_reduces_in_int32(int8_reports):
    rep = int8_reports["cooperative"]  # no bias, so an fp32 add could only be a float reduction
    assert rep.has(r"ld\.global\.cg\.v4") and rep.has(r"st\.global\.cg\.v4")  # the workspace's 16-byte accesses
    assert not rep.has(r"\badd(?:\.rn)?\.f32\b")


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["row_block", "row", "tensor_cast"])
def test_int8_quantizer_kernels_compile(kind, tmp_path):
    import cutlass

    from cutedsl_gemm.kernels.sm90 import quantize_fp8 as K
    from cutedsl_gemm.runtime.compile import compile_entry

    entry = {"row_block": lambda: K.row_block_entry(cutlass.BFloat16, cutlass.Int8, 127.0, 4096, threads=128),
             "row": lambda: K.row_entry(cutlass.Float16, cutlass.Int8, 127.0),
             "tensor_cast": lambda: K.tensor_cast_entry(cutlass.Float32, cutlass.Int8, 127.0)}[kind]()
    ptx = compile_entry(*entry, arch="sm_90a", ptx_dump_dir=str(tmp_path)).__ptx__
    assert re.search(r"cvt\.rni\.s32\.f32", ptx) and re.search(r"testp\.notanumber\.f32", ptx)
    assert re.search(r"st\.global\.v4\.b32", ptx)  # 16 int8 codes per 16-byte store
    assert not re.search(r"cvt\.rn\.satfinite\.e[45]m[23]x2", ptx)  # no FP8 conversion left in

"""``scaled_mm``: the public GEMM, for every recipe on every architecture. Describe the call (problem), select an
instance (selection), launch it (runtime). A Hopper call signature seen before skips straight to the launch with
the plan kept for it. ``quantize_scaled_mm`` (a linear layer: the activations' quantizer, then ``scaled_mm``, or
one kernel) and ``scaled_mm_fp8_out`` (``scaled_mm`` with FP8 output in 1x128 groups) build on it.

Each op's torch operator (``torch.ops.cutedsl_gemm.scaled_mm``, ``quantize_scaled_mm``, ``scaled_mm_fp8_out``) is
defined beside its function: schema, implementation, fake implementation and the ``traced_*`` form the function
takes under ``torch.compile`` (``ops.library`` has the shared machinery)."""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.families.sm90_gemm import LaunchPlan
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.numerics.formats import ScaleGranularity
from cutedsl_gemm.ops.library import EAGER, OPS, _checked_on_metas, _int, define, op_name
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.runtime.plans import PREPARED
from cutedsl_gemm.selection import dispatch

# Call signature -> (launch plan, recipe, K blocks, output shape). The signature holds what *chooses* the plan: problem
# shape, operand dtypes, device, scale shapes and strides (they pick the recipe and its views) and the
# arguments. What the compiled function checks itself before every launch (TVM-FFI: dtype, rank, every
# extent against the M, N, K it bound, strides, 16-byte base alignment, one device) is not hashed again:
# a repeated signature whose tensors that check refuses (a misaligned or transposed view, a wrong out=) is
# re-run through the full validation, which names what was expected. Only Hopper plans are kept: their scale
# views are rebuilt from the recipe on a hit, which the sm_100a operand and block-scale views are not. Kept in the
# one prepared-call cache (``runtime.plans.PREPARED``) under each op's name.
SCALED_MM, QUANTIZE_SCALED_MM, SCALED_MM_FP8_OUT = "scaled_mm", "quantize_scaled_mm", "scaled_mm_fp8_out"


def call_signature(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, scale_recipe_a, scale_recipe_b,
                   schedule, split_k):
    return (
        a.shape, b.shape, a.dtype, b.dtype, a.get_device(),
        scale_a.shape, scale_a.stride(), scale_b.shape, scale_b.stride(),
        None if bias is None else bias.dtype,
        out_dtype, use_fast_accum, scale_recipe_a, scale_recipe_b, schedule, split_k,
    )


def cached_plan(sig):
    """(launch plan, recipe, K blocks, output shape) that a repeated call with signature ``sig``
    (``call_signature``) reuses; None before the first such call."""
    return PREPARED.get(SCALED_MM, sig)


def empty_result(problem: P.GemmProblem, ops: P.GemmOperands, out: torch.Tensor) -> torch.Tensor:
    """M, N or K zero: nothing to launch; K = 0 leaves the bias (or zeros)."""
    if problem.m and problem.n:
        out.zero_() if ops.bias is None else out.copy_(ops.bias.to(out.dtype).expand(problem.m, problem.n))
    return out


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a,
    scale_b,
    bias: Optional[torch.Tensor] = None,
    scale_result: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
    *,
    scale_recipe_a=None,
    scale_recipe_b=None,
    swizzle_a=None,
    swizzle_b=None,
    out: Optional[torch.Tensor] = None,
    fmt_a=None,
    fmt_b=None,
    schedule: Optional[str] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """Scaled low-precision GEMM in torch's conventions: ``torch._scaled_mm``'s positional arguments
    (``a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum``), and
    ``torch.nn.functional.scaled_mm``'s scale recipes and swizzles by keyword.

    ``out = (a * scale_a) @ (b * scale_b) + bias`` with fp32 accumulation, where ``a`` is (M, K) row-major and
    ``b`` is (K, N) column-major (``w.t()`` of a row-major (N, K) weight). The operand dtypes and the scales
    select the kernel:

    * Hopper (sm_90a): E4M3 / E5M2 operands with fp32 scales in torch's shapes
      (``cutedsl_gemm.numerics.scale_layouts``): tensor-wise (one element each), row-wise (``scale_a`` (M, 1),
      ``scale_b`` (1, N)), or block-scaled per 128-deep K block: 1x128 x 128x128 (DeepSeek-V3: ``scale_a``
      (M, Kb), ``scale_b`` (Kb, ceil(N/128))), 128x128 x 128x128 and 1x128 x 1x128. Or INT8 x INT8
      (W8A8: ``quantize_int8``) with tensor-wise or row-wise fp32 scales: s8 WGMMA, exact int32 sums (K up to
      ``problem.INT8_MAX_K``), so ``use_fast_accum`` makes no difference there.
    * Blackwell (sm_100a): any of E4M3, E5M2, E3M2, E2M3, E2M1 per operand (FP8 dtypes,
      ``float4_e2m1fn_x2``, or uint8 bytes with ``fmt_a``/``fmt_b`` naming the format: packed FP6 always needs
      it), with one-element fp32 scales (tensor-wise), or MX (``float8_e8m0fnu`` scales per 32 elements,
      BlockWise1x32) and NVFP4 (e2m1 x e2m1, ``float8_e4m3fn`` scales per 16, BlockWise1x16, and optionally
      ``[block scales, global scale]`` with ``[BlockWise1x16, TensorWise]``) block scales in the SWIZZLE_32_4_4
      layout (``swizzle_*`` None or SWIZZLE_32_4_4), or plain (rows, K / block) with NO_SWIZZLE.

    The scale shapes and dtypes pick the recipe; ``scale_recipe_a``/``scale_recipe_b`` (strings or
    ``torch.nn.functional.ScalingType``, as in ``F.scaled_mm``) name it explicitly. A combination the GPU does
    not run is refused with what it runs. ``scale_result`` (an fp8 output's scale in torch) must be None:
    outputs are bf16, fp16 or fp32. ``bias`` is (N,) in ``out_dtype`` or fp32 (any float dtype on sm_100a).

    ``use_fast_accum`` as in torch, on Hopper: False (default) adds every 128-deep K tile into an fp32
    accumulator outside the tensor cores (accurate at large K); True lets the tensor cores accumulate all of K
    (faster, larger error at large K). Block-scaled recipes always scale and add each K block outside the
    tensor cores, and sm_100a accumulates all of K in fp32 tensor memory, so the flag does not apply to them.

    ``schedule`` forces a schedule of the instance table (Hopper: "small_m" or "cooperative", chosen by M
    otherwise; sm_100a: "1sm" or "2sm", 2-CTA from M = 129 otherwise); ``split_k`` overrides the Hopper K-split
    heuristic (``dispatch.choose_splits``: split K when there are fewer output tiles than SMs;
    ``dispatch.last_wave_splits``: split the last, partial wave of a long-K problem with a little more than whole
    waves, in the instance's last-wave variant). ``out``, if given, is a row-major (M, N) ``out_dtype`` tensor
    written in place.
    """
    if torch.compiler.is_compiling():  # the op: torch.compile records it instead of tracing into the launch
        return traced_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum,
                                scale_recipe_a=scale_recipe_a, scale_recipe_b=scale_recipe_b, swizzle_a=swizzle_a,
                                swizzle_b=swizzle_b, out=out, fmt_a=fmt_a, fmt_b=fmt_b, schedule=schedule,
                                split_k=split_k)
    sig = None
    if fmt_a is None and fmt_b is None and swizzle_a is None and swizzle_b is None and scale_result is None \
            and type(a) is torch.Tensor and type(b) is torch.Tensor and type(scale_a) is torch.Tensor \
            and type(scale_b) is torch.Tensor and (bias is None or type(bias) is torch.Tensor) \
            and (out is None or type(out) is torch.Tensor):
        sig = call_signature(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, scale_recipe_a,
                             scale_recipe_b, schedule, split_k)
        try:
            hit = PREPARED.get(SCALED_MM, sig)
        except TypeError:  # an unhashable argument: validate the long way (and say what is wrong)
            sig = hit = None
        if hit is not None:
            plan, recipe, k_blocks, out_shape = hit
            # (new_empty: ~1 us less per call than torch.empty(..., device=a.device))
            dst = a.new_empty(out_shape, dtype=out_dtype) if out is None else out
            sa, sb = scale_layouts.kernel_views(recipe, k_blocks, scale_a, scale_b)
            try:
                return plan.run(a, b, dst, sa, sb, bias)
            except (TypeError, ValueError):
                pass  # refused before launch: the full validation below says why (or re-plans for it)
    if scale_result is not None:
        raise ValueError("scale_result (torch._scaled_mm's scale of an fp8 output) must be None: outputs are bf16, "
                         "fp16 or fp32; pass out_dtype by keyword or as the 7th positional argument")
    device = P.require_cuda_tensors(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out=out)
    problem, ops = P.describe_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum,
                                        scale_recipe_a, scale_recipe_b, schedule, split_k, device, fmt_a, fmt_b,
                                        swizzle_a, swizzle_b)
    dst = torch.empty((problem.m, problem.n), dtype=out_dtype, device=device) if out is None else out
    if problem.is_empty:
        return empty_result(problem, ops, dst)
    inst, splits = dispatch.select(problem)
    plan = launch.plan(inst, problem.m, problem.n, splits, device.index, k=problem.k, fmt_a=problem.a_format,
                       fmt_b=problem.b_format)
    if sig is not None and type(plan) is LaunchPlan:  # (the fast path above replays Hopper plans only)
        PREPARED.keep(SCALED_MM, sig, (plan, problem.recipe, ops.k_blocks, (problem.m, problem.n)))
    return plan.run(ops.a, ops.b, dst, ops.scale_a, ops.scale_b, ops.bias, ops.global_a, ops.global_b)


# ----------------------------------------------------------------------------------------------------
# scaled_mm's op
# ----------------------------------------------------------------------------------------------------

SCALED_MM_SCHEMA = (
    "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, ScalarType? out_dtype=None, "
    "bool use_fast_accum=False, *, str? scale_recipe_a=None, str? scale_recipe_b=None, "
    "Tensor? global_scale_a=None, Tensor? global_scale_b=None, str? swizzle_a=None, str? swizzle_b=None, "
    "str? fmt_a=None, str? fmt_b=None, str? schedule=None, int? split_k=None) -> Tensor"
)


def _with_global(scale, recipe, global_scale):
    """NVFP4's ``[block scales, global scale]`` (and recipes) as ``scaled_mm`` takes them."""
    if global_scale is None:
        return scale, recipe
    return [scale, global_scale], (None if recipe is None else [recipe, ScaleGranularity.TENSOR.scaling_type])


def _scaled_mm_op(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, *, scale_recipe_a=None,
                  scale_recipe_b=None, global_scale_a=None, global_scale_b=None, **options):
    """``scaled_mm`` with the op's arguments: ``out_dtype`` None is bf16, NVFP4's global scales are
    ``global_scale_a`` / ``global_scale_b``; ``options``: swizzle_a/b, fmt_a/b, schedule, split_k."""
    if global_scale_a is not None or global_scale_b is not None:
        scale_a, scale_recipe_a = _with_global(scale_a, scale_recipe_a, global_scale_a)
        scale_b, scale_recipe_b = _with_global(scale_b, scale_recipe_b, global_scale_b)
    return scaled_mm(a, b, scale_a, scale_b, bias, None, torch.bfloat16 if out_dtype is None else out_dtype,
                     use_fast_accum, scale_recipe_a=scale_recipe_a, scale_recipe_b=scale_recipe_b, **options)


def _scaled_mm_fake(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, *, scale_recipe_a=None,
                    scale_recipe_b=None, global_scale_a=None, global_scale_b=None, swizzle_a=None, swizzle_b=None,
                    fmt_a=None, fmt_b=None, schedule=None, split_k=None):
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    P.require_out_dtype(out_dtype)

    def describe(target, ma, mb, msa, msb, mbias, mga, mgb):
        msa, ra = _with_global(msa, scale_recipe_a, mga)
        msb, rb = _with_global(msb, scale_recipe_b, mgb)
        P.describe_scaled_mm(ma, mb, msa, msb, mbias, out_dtype, None, use_fast_accum, ra, rb, schedule, split_k,
                             a.device, fmt_a, fmt_b, swizzle_a, swizzle_b, target=target)

    if not _checked_on_metas(a.device, (a, b, scale_a, scale_b, bias, global_scale_a, global_scale_b), describe) \
            and (a.dim() != 2 or b.dim() != 2):
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


define("scaled_mm", SCALED_MM_SCHEMA, _scaled_mm_op, _scaled_mm_fake)
EAGER.scaled_mm = _scaled_mm_op


def traced_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, *, scale_recipe_a,
                     scale_recipe_b, swizzle_a, swizzle_b, out, fmt_a, fmt_b, schedule, split_k):
    """``scaled_mm`` under ``torch.compile``: the op (``out=`` is filled from its result)."""
    if scale_result is not None:
        raise ValueError("scale_result must be None: outputs are bf16, fp16 or fp32")
    global_a = global_b = None
    if isinstance(scale_a, (list, tuple)):
        scale_a, global_a = scale_a if len(scale_a) == 2 else (scale_a[0], None)
    if isinstance(scale_b, (list, tuple)):
        scale_b, global_b = scale_b if len(scale_b) == 2 else (scale_b[0], None)
    res = OPS.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                        scale_recipe_a=op_name(scale_recipe_a), scale_recipe_b=op_name(scale_recipe_b),
                        global_scale_a=global_a, global_scale_b=global_b, swizzle_a=op_name(swizzle_a),
                        swizzle_b=op_name(swizzle_b), fmt_a=op_name(fmt_a), fmt_b=op_name(fmt_b), schedule=schedule,
                        split_k=split_k)
    if out is None:
        return res
    out.copy_(res)
    return out


# Call signature -> (launch plan, B's kernel scale view recipe, K blocks, output shape) of the calls that quantize in
# the kernel; (None, ...) for those that run quantize_fp8 and scaled_mm.


def quantize_call_signature(x, b, scale_b, bias, out_dtype, scale_recipe_b, split_k, in_kernel=None):
    return (x.shape, b.shape, x.dtype, b.dtype, x.get_device(), scale_b.shape, scale_b.stride(),
            None if bias is None else bias.dtype, out_dtype, scale_recipe_b, split_k, in_kernel)


def quantize_scaled_mm(
    x: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    *,
    scale_recipe_b=None,
    out: Optional[torch.Tensor] = None,
    split_k: Optional[int] = None,
    in_kernel: Optional[bool] = None,
) -> torch.Tensor:
    """A linear layer of bf16 / fp16 activations x (M, K) and a quantized weight b = W.t() (K, N): ``scaled_mm`` of x
    quantized the way W's scales pair with, bit for bit --

    ================================  ===============================================
    W (scale_b)                       x quantized by
    ================================  ===============================================
    FP8, 128x128 or 1x128 blocks      ``quantize_fp8(x, "1x128")`` (DeepSeek-V3)
    FP8, per channel (1, N)           ``quantize_fp8(x, "row")`` (per token)
    int8, per channel (1, N)          ``quantize_int8(x, "row")`` (W8A8)
    FP8 / int8, per tensor            ``quantize_fp8(x, "tensor")`` / ``quantize_int8(x, "tensor")``
    ================================  ===============================================

    -- as the two kernels, or with ``in_kernel=True`` in one Hopper kernel: the GEMM quantizes each K tile of its
    token tile itself (``kernels/sm90/activation_quant.py``; per token it first finds each token's scale over all
    of K), so there is no quantizer launch and no round trip of the quantized activations through memory. The one
    kernel is not the default: its quantizing warps cost more than the launch and round trip they save (0.63-1.02x
    the two kernels' speed at M = 1..32 on an H200, ``benchmarks/bench_quantize_scaled_mm.py``).

    ``in_kernel``: True runs the one kernel (an error where the table has none: M above its 32-token tiles, per-tensor
    scaling, fp32 activations or output); False or None the two.
    ``out_dtype``: x's dtype by default; ``scale_recipe_b`` names W's scale recipe (else its shape decides, as in
    ``scaled_mm``); ``out``, ``split_k`` as in ``scaled_mm``.
    """
    if out_dtype is None:
        out_dtype = getattr(x, "dtype", None)
    if torch.compiler.is_compiling():
        return traced_quantize_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b=scale_recipe_b, out=out,
                                         split_k=split_k, in_kernel=in_kernel)
    sig = None
    if type(x) is torch.Tensor and type(b) is torch.Tensor and type(scale_b) is torch.Tensor \
            and (bias is None or type(bias) is torch.Tensor) and (out is None or type(out) is torch.Tensor):
        sig = quantize_call_signature(x, b, scale_b, bias, out_dtype, scale_recipe_b, split_k, in_kernel)
        try:
            hit = PREPARED.get(QUANTIZE_SCALED_MM, sig)
        except TypeError:
            sig = hit = None
        if hit is not None and hit[0] is not None:
            plan, recipe, k_blocks, out_shape = hit
            dst = x.new_empty(out_shape, dtype=out_dtype) if out is None else out
            try:
                sb = scale_layouts.w_kernel_view(recipe, k_blocks, scale_b)
                return plan.run(x, b, dst, plan.dummy_bias, sb, bias)
            except (TypeError, ValueError):
                pass  # refused before launch: the full validation below says why
        elif hit is not None:
            return _quantize_then_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b, out, split_k, hit[1])
    device = P.require_cuda_tensors(x=x, b=b, scale_b=scale_b, bias=bias, out=out)
    problem, ops = P.describe_quantize_scaled_mm(x, b, scale_b, bias, out_dtype, out, scale_recipe_b, split_k, device)
    if in_kernel and not problem.is_empty and not dispatch.has_quantizing_rows(problem):
        raise ValueError(f"in_kernel=True: no kernel quantizes {problem.act_format} activations for recipe "
                         f"{problem.recipe!r}, {problem.b_format} weights, {problem.out_name} output, M={problem.m} "
                         "(the table's rows: e4m3 weights with 1x128 or per-token activation scales, int8 weights "
                         "with per-token ones; bf16 / fp16 in and out, M <= 32)")
    one = bool(in_kernel)
    if problem.is_empty or not one:
        if sig is not None and not problem.is_empty:
            PREPARED.keep(QUANTIZE_SCALED_MM, sig, (None, problem.recipe, None, None))
        return _quantize_then_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b, out, split_k, problem.recipe)
    dst = torch.empty((problem.m, problem.n), dtype=out_dtype, device=device) if out is None else out
    inst, splits = dispatch.select(problem)
    plan = launch.plan(inst, problem.m, problem.n, splits, device.index, k=problem.k)
    if sig is not None:
        PREPARED.keep(QUANTIZE_SCALED_MM, sig, (plan, problem.recipe, ops.k_blocks, (problem.m, problem.n)))
    # (the A scale argument is unused: the kernel computes the scales)
    return plan.run(x, b, dst, plan.dummy_bias, ops.scale_b, ops.bias)


def cached_quantize_plan(sig):
    """What a repeated ``quantize_scaled_mm`` call with signature ``sig`` (``quantize_call_signature``) reuses:
    (launch plan, recipe, K blocks, output shape), (None, ...) for a call that runs two kernels, or None before the
    first such call."""
    return PREPARED.get(QUANTIZE_SCALED_MM, sig)


def _quantize_then_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b, out, split_k, recipe):
    from cutedsl_gemm.ops.quantize import quantize_fp8, quantize_int8

    fmt, groups = P.activation_quantization(recipe, b.dtype)
    qa, sa = quantize_int8(x, groups) if fmt == "int8" else quantize_fp8(x, groups, fmt=fmt)
    recipe_a = None if scale_recipe_b is None else groups
    return scaled_mm(qa, b, sa, scale_b, bias, None, out_dtype, scale_recipe_a=recipe_a, scale_recipe_b=scale_recipe_b,
                     out=out, split_k=split_k)


# ----------------------------------------------------------------------------------------------------
# quantize_scaled_mm's op
# ----------------------------------------------------------------------------------------------------

QUANTIZE_SCALED_MM_SCHEMA = (
    "(Tensor x, Tensor b, Tensor scale_b, Tensor? bias=None, ScalarType? out_dtype=None, *, "
    "str? scale_recipe_b=None, int? split_k=None, bool? in_kernel=None) -> Tensor"
)


def _quantize_scaled_mm_op(x, b, scale_b, bias=None, out_dtype=None, *, scale_recipe_b=None, split_k=None,
                           in_kernel=None):
    """``quantize_scaled_mm`` with the op's arguments (no ``out=``)."""
    return quantize_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b=scale_recipe_b, split_k=split_k,
                              in_kernel=in_kernel)


def _quantize_scaled_mm_fake(x, b, scale_b, bias=None, out_dtype=None, *, scale_recipe_b=None, split_k=None,
                             in_kernel=None):
    out_dtype = x.dtype if out_dtype is None else out_dtype

    def describe(target, *metas):
        P.describe_quantize_scaled_mm(*metas, out_dtype, None, scale_recipe_b, split_k, x.device, target=target)

    if not _checked_on_metas(x.device, (x, b, scale_b, bias), describe):
        P.require_out_dtype(out_dtype)
        if x.dim() != 2 or b.dim() != 2:
            raise ValueError(f"x and b must be 2-D, got shapes {tuple(x.shape)} and {tuple(b.shape)}")
    return x.new_empty((x.shape[0], b.shape[1]), dtype=out_dtype)


define("quantize_scaled_mm", QUANTIZE_SCALED_MM_SCHEMA, _quantize_scaled_mm_op, _quantize_scaled_mm_fake)
EAGER.quantize_scaled_mm = _quantize_scaled_mm_op


def traced_quantize_scaled_mm(x, b, scale_b, bias, out_dtype, *, scale_recipe_b, out, split_k, in_kernel):
    """``quantize_scaled_mm`` under ``torch.compile``: the op (``out=`` is filled from its result)."""
    res = OPS.quantize_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b=op_name(scale_recipe_b),
                                 split_k=split_k, in_kernel=in_kernel)
    if out is None:
        return res
    out.copy_(res)
    return out


# Call signature (``call_signature`` of the bf16 scaled_mm call) -> (launch plan, recipe, K blocks, allocator of the
# outputs) of the scaled_mm_fp8_out calls that run one kernel; (None, ...) for those that run scaled_mm and
# quantize_fp8.


def scaled_mm_fp8_out(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, bias: Optional[torch.Tensor] = None):
    """``quantize_fp8(scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=torch.bfloat16), "1x128")``, bit for bit:
    the GEMM's output as the next layer's FP8 activations, ``(q, scales)`` -- q (M, N) e4m3 and its fp32 scales per
    1x128 group in ``quantize_fp8``'s layout ((M, N / 128), strides (1, M): the DeepSeek recipe's ``scale_a``), so
    they feed the next ``scaled_mm`` directly. Arguments and checks are ``scaled_mm``'s; N must be a multiple of 128.

    On Hopper it runs in one kernel where ``scaled_mm``'s own pick for the bf16 call has a twin whose epilogue
    quantizes the tile (``dispatch.select_fp8_out``: unswapped 128-wide tiles of the e4m3 per-tensor, row-wise and
    DeepSeek recipes, no bias or an fp32 one; ``kernels/sm90/epilogue_quant.py``): the same bf16 values, quantized by
    the quantizer's code, without the bf16 round trip through memory and the quantizer's launch. Elsewhere (decode
    sizes, 192-wide tiles, other GPUs) it runs the two kernels."""
    if torch.compiler.is_compiling():  # the op: torch.compile records it instead of tracing into the launch
        return traced_scaled_mm_fp8_out(a, b, scale_a, scale_b, bias)
    sig = None
    if type(a) is torch.Tensor and type(b) is torch.Tensor and type(scale_a) is torch.Tensor \
            and type(scale_b) is torch.Tensor and (bias is None or type(bias) is torch.Tensor):
        sig = call_signature(a, b, scale_a, scale_b, bias, torch.bfloat16, False, None, None, None, None)
        try:
            hit = PREPARED.get(SCALED_MM_FP8_OUT, sig)
        except TypeError:  # an unhashable argument: validate the long way (and say what is wrong)
            sig = hit = None
        if hit is not None and hit[0] is None:
            return _scaled_mm_then_quantize(a, b, scale_a, scale_b, bias)
        if hit is not None:
            plan, recipe, k_blocks, allocate = hit
            q, scales = allocate(a)
            sa, sb = scale_layouts.kernel_views(recipe, k_blocks, scale_a, scale_b)
            try:
                return plan.run_fp8_out(a, b, q, scales, sa, sb, bias)
            except (TypeError, ValueError):
                pass  # refused before launch: the full validation below says why
    device = P.require_cuda_tensors(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    problem, ops = P.describe_scaled_mm_fp8_out(a, b, scale_a, scale_b, bias, device)
    picked = None if problem.is_empty else dispatch.select_fp8_out(problem)
    if picked is None:
        if sig is not None and not problem.is_empty:
            PREPARED.keep(SCALED_MM_FP8_OUT, sig, (None, None, None, None))
        return _scaled_mm_then_quantize(a, b, scale_a, scale_b, bias)
    inst, splits = picked
    plan = launch.plan(inst, problem.m, problem.n, splits, device.index, k=problem.k)
    allocate = fp8_output_allocator(problem.m, problem.n)
    if sig is not None:
        PREPARED.keep(SCALED_MM_FP8_OUT, sig, (plan, problem.recipe, ops.k_blocks, allocate))
    q, scales = allocate(a)
    return plan.run_fp8_out(ops.a, ops.b, q, scales, ops.scale_a, ops.scale_b, ops.bias)


def fp8_output_allocator(m: int, n: int):
    """like -> empty ``(q, scales)`` on ``like``'s device with the shapes, dtypes and strides that
    ``quantize_fp8(y, "1x128")`` returns for an (M, N) y (``quantize_fp8_like``'s)."""
    from cutedsl_gemm.ops.quantize import quantize_fp8_like

    q, s = quantize_fp8_like(torch.empty((m, n), dtype=torch.bfloat16, device="meta"), "1x128")
    return lambda like: (like.new_empty_strided(q.shape, q.stride(), dtype=q.dtype),
                         like.new_empty_strided(s.shape, s.stride(), dtype=s.dtype))


def _scaled_mm_then_quantize(a, b, scale_a, scale_b, bias):
    from cutedsl_gemm.ops.quantize import quantize_fp8

    return quantize_fp8(scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=torch.bfloat16), "1x128")


# ----------------------------------------------------------------------------------------------------
# scaled_mm_fp8_out's op
# ----------------------------------------------------------------------------------------------------

SCALED_MM_FP8_OUT_SCHEMA = "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None) -> (Tensor, Tensor)"


def _scaled_mm_fp8_out_op(a, b, scale_a, scale_b, bias=None):
    """``scaled_mm_fp8_out`` as the op returns it: (q, scales)."""
    return scaled_mm_fp8_out(a, b, scale_a, scale_b, bias)


def _scaled_mm_fp8_out_fake(a, b, scale_a, scale_b, bias=None):
    from cutedsl_gemm.ops.quantize import quantize_fp8_like

    def describe(target, *metas):
        P.describe_scaled_mm_fp8_out(*metas, a.device, target=target)

    if not _checked_on_metas(a.device, (a, b, scale_a, scale_b, bias), describe):
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        if _int(b.shape[1]) is not None:
            P.check_fp8_output_columns(_int(b.shape[1]))
    # quantize_fp8's outputs for the bf16 output (its checks of N included)
    return quantize_fp8_like(a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16), "1x128")


define("scaled_mm_fp8_out", SCALED_MM_FP8_OUT_SCHEMA, _scaled_mm_fp8_out_op, _scaled_mm_fp8_out_fake)
EAGER.scaled_mm_fp8_out = _scaled_mm_fp8_out_op


def traced_scaled_mm_fp8_out(a, b, scale_a, scale_b, bias):
    """``scaled_mm_fp8_out`` under ``torch.compile``: the op."""
    return OPS.scaled_mm_fp8_out(a, b, scale_a, scale_b, bias)

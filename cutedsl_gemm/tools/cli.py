"""``cutedsl-gemm`` command line: demo, info, bench, export, precompile, catalog (the last three only parse
arguments; the work is in ``cutedsl_gemm.generators``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import sys
import time
from pathlib import Path

import torch

INTERRUPTED = 130  # the shell's exit status for a process ended by SIGINT


def _hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _arch_line() -> str:
    from cutedsl_gemm.runtime.jit import target_arch

    if os.environ.get("CUTE_DSL_ARCH"):
        return f"{target_arch()} (from CUTE_DSL_ARCH)"
    if torch.cuda.is_available():
        return f"{target_arch()} (this GPU)"
    return "none (no GPU and CUTE_DSL_ARCH unset; CUTE_DSL_ARCH=sm_90a compiles for Hopper)"


def cmd_info(args) -> int:
    import cutlass

    from cutedsl_gemm.runtime.jit import cache_dir

    if torch.cuda.is_available():
        from cutedsl_gemm.runtime.device import device_info

        arch, sms = device_info(torch.cuda.current_device())
        print(f"GPU:        {torch.cuda.get_device_name()} ({arch}, {sms} SMs)")
    else:
        print("GPU:        none (kernels compile for a target arch; run with a Hopper GPU to execute them)")
    print(f"arch:       {_arch_line()}")
    print(f"CuTe DSL:   {cutlass.__version__}")
    print(f"torch:      {torch.__version__}")
    print(f"cache dir:  {cache_dir()}")
    return 0


DEMO_SHAPES = [(1, 7168, 2048), (128, 4608, 7168), (1024, 7168, 2048), (4096, 4096, 4096), (6144, 4608, 7168)]


def _demo_gpu() -> int:
    from triton.testing import do_bench

    import cutedsl_gemm
    from cutedsl_gemm.numerics import reference as R
    from cutedsl_gemm.tools.baselines import cublas_call, int_mm_call, make_operands

    print(f"{'recipe':13s} {'M':>5s} {'N':>5s} {'K':>5s} | {'rel err':>8s} | {'ours TFLOPS':>11s} "
          f"{'cuBLAS TFLOPS':>13s} {'ratio':>6s}")
    worst = 0.0
    # (label, recipe, operand format); int8 is timed against torch._int_mm followed by the scale multiply
    for label, recipe, fmt in (("tensor", "tensor", "e4m3"), ("row", "row", "e4m3"),
                               ("1x128_128x128", "1x128_128x128", "e4m3"), ("int8 row", "row", "int8")):
        for m, n, k in DEMO_SHAPES:
            qa, qw, scale_a, scale_b, plain = make_operands(m, n, k, recipe, fmt_a=fmt, fmt_b=fmt)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

            def run(qa=qa, qw=qw, scale_a=scale_a, scale_b=scale_b, out=out):
                return cutedsl_gemm.scaled_mm(qa, qw.t(), scale_a, scale_b, out=out)

            run()
            err = R.rel_error(out, R.reference_gemm(*plain, recipe))
            worst = max(worst, err)
            t_ours = do_bench(run, return_mode="median")
            ops = (qa, qw.t(), scale_a, scale_b)
            try:
                t_ref = do_bench(int_mm_call(*ops) if fmt == "int8" else cublas_call(recipe, *ops),
                                 return_mode="median")
            except (RuntimeError, ValueError):  # cuBLAS refuses some shapes (blockwise and int8 at small M)
                t_ref = float("nan")
            flops = 2 * m * n * k
            print(f"{label:13s} {m:5d} {n:5d} {k:5d} | {err:8.2e} | {flops / t_ours / 1e9:11.0f} "
                  f"{flops / t_ref / 1e9:13.0f} {t_ref / t_ours:6.3f}")
    ok = worst <= 2e-3
    print(f"\n{'PASS' if ok else 'FAIL'}: worst relative error {worst:.2e} (limit 2e-3)")
    fused = _demo_fused_quantization()
    return 0 if ok and fused else 1


def _demo_fused_quantization() -> bool:
    """quantize_scaled_mm with the activations quantized in the GEMM (decode sizes) and scaled_mm_fp8_out (prefill),
    each against its two-kernel form: the bits must agree."""
    import cutedsl_gemm
    from cutedsl_gemm.tools.baselines import make_operands

    def same(a, b):
        def raw(t):
            return t.contiguous().view(torch.uint8)

        return all(torch.equal(raw(x), raw(y)) for x, y in zip(a, b))

    print("\nFused quantization (one kernel against the quantizer and the GEMM, bit for bit):")
    ok = True
    for label, recipe, fmt in (("DeepSeek 1x128", "1x128_128x128", "e4m3"), ("row", "row", "e4m3"),
                               ("int8 row", "row", "int8")):
        for m in (1, 4, 32):
            _, qw, _, scale_b, _ = make_operands(m, 7168, 2048, recipe, fmt_a=fmt, fmt_b=fmt)
            x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            one = cutedsl_gemm.quantize_scaled_mm(x, qw.t(), scale_b, in_kernel=True)
            agree = same([one], [cutedsl_gemm.quantize_scaled_mm(x, qw.t(), scale_b, in_kernel=False)])
            ok &= agree
            print(f"    quantize_scaled_mm {label:15s} M={m:<4d} N=7168 K=2048: {'same bits' if agree else 'DIFFER'}")
    for m in (1024, 4096):
        qa, qw, scale_a, scale_b, _ = make_operands(m, 7168, 2048, "1x128_128x128")
        got = cutedsl_gemm.scaled_mm_fp8_out(qa, qw.t(), scale_a, scale_b)
        want = cutedsl_gemm.quantize_fp8(cutedsl_gemm.scaled_mm(qa, qw.t(), scale_a, scale_b), "1x128")
        agree = same(got, want)
        ok &= agree
        print(f"    scaled_mm_fp8_out  DeepSeek        M={m:<4d} N=7168 K=2048: {'same bits' if agree else 'DIFFER'}")
    print(f"\n{'PASS' if ok else 'FAIL'}: fused quantization")
    return ok


def _demo_cpu() -> int:
    from cutedsl_gemm import problem as P
    from cutedsl_gemm.numerics import int_packing as IP
    from cutedsl_gemm.numerics import reference as R
    from cutedsl_gemm.selection import dispatch
    from cutedsl_gemm.selection.instances import GEMM_FP8_OUT, QUANT_GEMM
    from cutedsl_gemm.tools.ptx_inspect import (
        ACTIVATION_QUANTIZATION,
        FP8_OUTPUT,
        PER_TOKEN_QUANTIZATION,
        WEIGHT_CONVERSION,
        WGMMA_RS,
        WGMMA_S8,
        inspect_instance,
    )

    print("No Hopper GPU here: compiling the FP8, INT8 and weight-only GEMM instances, the GEMMs that quantize their "
          "activations and the one that emits FP8 for sm_90a and inspecting them.\n")
    expect = {"wgmma.mma_async": "tensor-core MMA", "cp.async.bulk.tensor": "TMA",
              "setmaxnreg": "register reallocation"}
    ok = True
    cases = [(recipe, a, b, accum, 4096) for accum in ("promoted", "fast")
             for recipe, a, b in (("row", "e4m3", "e4m3"), ("tensor", "e5m2", "e4m3"))]
    cases += [("1x128_128x128", "e4m3", "e4m3", "promoted", 4096), ("row", "e4m3", "e4m3", "promoted", 16)]
    cases += [("row", "int8", "int8", "fast", m) for m in (4096, 16)]  # W8A8: s8 x s8 -> s32 WGMMA
    insts = [dispatch.select_gemm("sm_90a", recipe, a, b, "bf16", None, m, accum) for recipe, a, b, accum, m in cases]
    # Weight-only: bf16 activations x int4 weights in groups of 128 along K (M = 16), converted in registers and fed
    # to WGMMA as its register-sourced A operand.
    decode = P.WeightOnlyProblem(16, 8192, 8192, "bf16", "int4", "group128", "sm_90a", HOPPER_SMS, None, split_k=1)
    insts.append(dispatch.select_weight_only(decode)[0])
    # quantize_scaled_mm's one kernel at M = 1: bf16 activations quantized to e4m3 in 1x128 groups by its producer
    # warps (the group quantizer's conversion), x DeepSeek-scaled e4m3 weights
    insts.append(dispatch.select_gemm("sm_90a", "1x128_128x128", "bf16", "e4m3", "bf16", None, 1, op=QUANT_GEMM))
    # ... per token for an int8 weight (W8A8): each token's scale from a pass over its row, then int8 codes
    insts.append(dispatch.select_gemm("sm_90a", "row", "bf16", "int8", "bf16", None, 1, "fast", op=QUANT_GEMM))
    # scaled_mm_fp8_out's epilogue at M = 4096: the bf16 tile quantized to e4m3 in 1x128 groups on its way out
    insts.append(dispatch.fp8_out_twin(dispatch.select_gemm("sm_90a", "1x128_128x128", "e4m3", "e4m3", "bf16", None,
                                                            4096, "promoted")))
    # (what the PTX must hold, for the instances it is checked in)
    required = (("the s8 x s8 -> s32 WGMMA", WGMMA_S8, lambda i: i.a_dtype == "int8"),
                ("the register-sourced WGMMA (A: the converted weights)", WGMMA_RS, lambda i: i.op == "weight_only"),
                *((f"the weights' {step}", p, lambda i: i.op == "weight_only")
                  for step, p in WEIGHT_CONVERSION.items()),
                *((f"the activations' {step}", p, lambda i: i.op == QUANT_GEMM and i.recipe != "row")
                  for step, p in ACTIVATION_QUANTIZATION.items()),
                *((f"the activations' {step}", p, lambda i: i.op == QUANT_GEMM and i.recipe == "row")
                  for step, p in PER_TOKEN_QUANTIZATION.items()),
                *((f"the output's {step}", p, lambda i: i.op == GEMM_FP8_OUT) for step, p in FP8_OUTPUT.items()))
    for inst in insts:
        t0 = time.time()
        rep = inspect_instance(inst)
        print("\n".join(rep.summary_lines()) + f"\n    (compiled in {time.time() - t0:.1f} s)")
        for ins, what in expect.items():
            if not any(k.startswith(ins) for k in rep.instructions):
                print(f"    MISSING {ins} ({what})")
                ok = False
        for what, pattern, applies in required:
            if not applies(inst):
                continue
            count = len(re.findall(pattern, rep.ptx))
            if not count:
                print(f"    MISSING {what}")
                ok = False
            elif inst.op in ("weight_only", QUANT_GEMM, GEMM_FP8_OUT):  # its instructions, the first of each shown
                first = re.search(rf"(?:{pattern})[^\n]*", rep.ptx).group(0)
                print(f"    {count:4d} x {what}, e.g. {' '.join(first.split())}")
    print("\nReference numerics (CPU, float64 on dequantized operands):")
    torch.manual_seed(0)
    for recipe, fmt in (("tensor", "e4m3"), ("row", "e4m3"), ("1x128_128x128", "e4m3"), ("128x128_128x128", "e4m3"),
                        ("row", "int8")):
        a, w = torch.randn(256, 512), torch.randn(384, 512)
        qa, sa, qw, sw = R.quantize_operands(a, w, recipe, fmt, fmt)
        err = R.rel_error(R.reference_gemm(qa, sa, qw, sw, recipe), a.double() @ w.double().t())
        label = recipe if fmt == "e4m3" else f"{fmt} {recipe}"
        print(f"    {label:24s} quantization error of the GEMM vs full precision: {err:.2e}")
        ok &= err < 0.1
    # weight-only: the activations as they are, the weights rounded to int4 (about 1/7 of a group's amax a step:
    # some 12% error on Gaussian data) or int8
    for bits, group, bound in ((4, 128, 0.2), (8, 0, 0.02)):
        x, w = torch.randn(256, 512), torch.randn(384, 512)
        err = R.rel_error(R.reference_weight_only_mm(x, *IP.quantize_weights(w, bits, group), group),
                          x.double() @ w.double().t())
        label = f"weight-only int{bits} " + (f"g{group}" if group else "channel")
        print(f"    {label:24s} quantization error of the GEMM vs full precision: {err:.2e}")
        ok &= err < bound
    print(f"\n{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _demo_model() -> bool:
    """Two Llama-3-8B-shaped layers with random weights: bf16, torch's FP8 path and this library's FP8 layers (row
    recipe, LM head bf16), one decode step at batch 1 captured in a CUDA graph; ours must agree with bf16 at
    least as well as torch's FP8 path does (1.1x its logit error)."""
    if not _hopper_available():
        print("\nModel: skipped (needs a Hopper GPU)")
        return True
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("\nModel: skipped (transformers is not installed: pip install -e '.[models]')")
        return True
    from triton.testing import do_bench

    from cutedsl_gemm import nn as cnn
    from cutedsl_gemm.numerics import reference as R
    from cutedsl_gemm.tools import models as M
    from cutedsl_gemm.tools.baselines import TorchFp8Linear

    config, context = M.llama_config(2), 128
    variants = {"bf16": M.random_llama(config)}
    variants["ours"] = M.sharing_copy(variants["bf16"])
    report = cnn.convert(variants["ours"], recipe="row", filter=lambda name, module: name != "lm_head")
    variants["torch FP8"] = M.sharing_copy(variants["bf16"])
    M.replace_modules(variants["torch FP8"], report.converted, lambda lin: TorchFp8Linear.from_linear(lin, "row"))
    print(f"\nModel: 2 Llama-3-8B layers, random weights, {len(report.converted)} linears converted (row, LM head "
          f"bf16); one decode step at batch 1 after {context} tokens, replayed from a CUDA graph")
    prompt, ms, logits = M.random_tokens(config, 1, context), {}, {}
    for name, model in variants.items():
        step = M.DecodeStep(model, 1, context + 1)
        step.prefill(prompt)
        graph, output = M.cuda_graph(step)
        logits[name] = step.check_replay(graph.replay, output)  # each replay writes one cache slot
        ms[name] = do_bench(graph.replay, return_mode="median")
    errors = {name: R.rel_error(logits[name], logits["bf16"]) for name in ("torch FP8", "ours")}
    for name in variants:
        err = f"logits rel err {errors[name]:.3e}" if name in errors else ""
        print(f"    {name:9s} {ms[name] * 1e3:7.1f} us/token {1e3 / ms[name]:7.0f} tokens/s "
              f"{ms['bf16'] / ms[name]:5.2f}x bf16  {err}")
    ok = errors["ours"] <= 1.1 * errors["torch FP8"]
    print(f"{'PASS' if ok else 'FAIL'}: logit error {errors['ours']:.3e} against torch FP8's {errors['torch FP8']:.3e}")
    return ok


#: What the grouped GEMM's PTX must hold: its tensor-core MMA on e4m3 operands, and TMA loads (global -> shared).
GROUPED_PTX = {"WGMMA e4m3 x e4m3": r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
               "TMA load": r"cp\.async\.bulk\.tensor\.\dd\.shared::c(?:ta|luster)\.global"}
#: What the MoE routing kernel's PTX must hold: the pairs counted per expert (a warp's lanes grouped by expert, one
#: shared-memory atomic each) and each token's row converted to FP8.
ROUTE_PTX = {"lanes grouped by expert": r"match\.any\.sync\.b32", "per-expert count": r"atom\.shared\.cta\.add\.u32",
             "e4m3 conversion": r"cvt\.rn\.satfinite\.e4m3x2\.f32"}
#: Rows per expert of the grouped GEMM check (N = 512, K = 256): an empty group and a one-row group among them.
HOPPER_SMS = 132  # the H100 / H200 SXM, what the CPU demo selects for
MOE_GROUPS = (37, 0, 1, 90)
MOE_N, MOE_K = 512, 256
#: How far the tiny converted Mixtral's logits may be from its bf16 twin's (relative Frobenius): FP8 codes with 3
#: mantissa bits on both operands of every attention and expert GEMM; the same numerics emulated in float64 on the
#: CPU (the reference GEMMs of the quantized operands) give 6.0-7.5% on its random weights (seeds 0-2).
MOE_LOGIT_RTOL = 0.15


def _tiny_mixtral(device: str):
    """(bf16, converted, report): a two-layer Mixtral of ``models.TINY_MIXTRAL`` dimensions with random weights and
    a copy sharing its tensors converted by ``cnn.convert`` (row recipe, LM head bf16)."""
    from cutedsl_gemm import nn as cnn
    from cutedsl_gemm.tools import models as M

    bf16 = M.random_causal_lm(M.moe_config("mixtral", 2, M.TINY_MIXTRAL), device)
    ours = M.sharing_copy(bf16)
    report = cnn.convert(ours, recipe="row", filter=lambda name, module: name != "lm_head")
    return bf16, ours, report


def _no_transformers() -> bool:
    """Whether transformers is missing (then the tiny Mixtral is skipped, and the demo says so)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("    tiny Mixtral: skipped (transformers is not installed: pip install -e '.[models]')")
        return True
    return False


def _demo_moe_cpu() -> bool:
    """The grouped GEMM (contiguous layout, row recipe) compiled for sm_90a, its PTX checked for WGMMA on e4m3 and
    TMA loads; a tiny Mixtral converted on the CPU (the weights quantized by the kernels' torch reference)."""
    from cutedsl_gemm.families import sm90_grouped as G
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    print("\nMixture of experts: the grouped FP8 GEMM compiled for sm_90a and inspected; a tiny Mixtral converted on "
          "the CPU")
    problem = G.GroupedProblem("contiguous", "row", len(MOE_GROUPS), sum(MOE_GROUPS), MOE_N, MOE_K, "e4m3", "e4m3",
                               "bf16")
    t0 = time.time()
    rep = inspect_instance(G.select(problem, HOPPER_SMS))
    print("\n".join(rep.summary_lines()) + f"\n    (compiled in {time.time() - t0:.1f} s)")
    ok = _ptx_holds(rep.ptx, GROUPED_PTX)
    t0 = time.time()
    route = _route_ptx()
    print(f"    routing kernel (route_quantize_fp8: 128 experts, top-8, rows of 2048), compiled in "
          f"{time.time() - t0:.1f} s")
    ok &= _ptx_holds(route, ROUTE_PTX)
    if not _no_transformers():
        _, _, report = _tiny_mixtral("cpu")
        print(f"    tiny Mixtral (2 layers, 4 experts, top-2): {str(report).splitlines()[0]}")
        if len(report.converted_experts) != 2:
            print(f"    experts kept: {'; '.join(report.skipped.values()) or 'no reason given'}")
            # a GPU here that is no Hopper: convert keeps the experts it could not run there, as it must
            ok &= torch.cuda.is_available()
    print(f"{'PASS' if ok else 'FAIL'}: grouped GEMM PTX (WGMMA e4m3, TMA loads), routing PTX and the MoE conversion")
    return ok


def _ptx_holds(ptx: str, patterns: dict) -> bool:
    """Print how often each instruction occurs in ``ptx`` (MISSING for none); whether all do."""
    ok = True
    for what, pattern in patterns.items():
        found = re.search(rf"(?:{pattern})\S*", ptx)  # the instruction without its operands (WGMMA's: 64)
        if found is None:
            print(f"    MISSING {what}")
            ok = False
        else:
            print(f"    {len(re.findall(pattern, ptx)):4d} x {what}: {found.group(0)}")
    return ok


#: The routing kernel the demo compiles: the PTX fingerprint sample's (row-wise, bf16 rows of 2048, 128 experts,
#: top-8).
ROUTE_SAMPLE = "sm_90a_moe_route_row_bf16_e4m3_h2048_k8_e128"


def _route_ptx() -> str:
    """The PTX of the MoE routing kernel ``ROUTE_SAMPLE``, compiled for sm_90a."""
    from cutedsl_gemm.tools.ptx_fingerprint import kernel_ptx

    return kernel_ptx(ROUTE_SAMPLE)


def _grouped_operands():
    """Row-recipe operands of the grouped check on the GPU: (codes (T, K), scales (T, 1), weights (E, K, N), their
    scales (E, 1, N), offs (E,) int32)."""
    import cutedsl_gemm

    e, n, k = len(MOE_GROUPS), MOE_N, MOE_K
    w = torch.randn(e * n, k, device="cuda", dtype=torch.bfloat16)
    qw, sw = cutedsl_gemm.quantize_fp8(w, "row")
    qa, sa = cutedsl_gemm.quantize_fp8(torch.randn(sum(MOE_GROUPS), k, device="cuda", dtype=torch.bfloat16), "row")
    offs = torch.tensor(MOE_GROUPS).cumsum(0).to(device="cuda", dtype=torch.int32)
    return qa, sa, qw.view(e, n, k).transpose(1, 2), sw.view(e, 1, n), offs


def _demo_grouped_gpu() -> bool:
    """grouped_scaled_mm in both layouts against the float64 reference, on groups that include an empty one and a
    one-row one."""
    import cutedsl_gemm
    from cutedsl_gemm.numerics import reference as R

    print(f"\nMixture of experts: grouped_scaled_mm, row recipe, {len(MOE_GROUPS)} experts of {list(MOE_GROUPS)} rows "
          f"(N={MOE_N}, K={MOE_K}), against the float64 reference")
    torch.manual_seed(0)
    qa, sa, b, sb, offs = _grouped_operands()
    got = cutedsl_gemm.grouped_scaled_mm(qa, b, sa, sb, offs)
    want = R.reference_grouped_mm(qa, b, sa, sb, offs, recipe="row", out_dtype=torch.float64)
    one = sum(MOE_GROUPS[:MOE_GROUPS.index(1)])  # the one-row group's row
    errors = {"contiguous": R.rel_error(got, want), "contiguous, the one-row group": R.rel_error(
        got[one:one + 1], want[one:one + 1])}
    # masked: each expert's rows at the start of its (C, K) slab, C the largest group; the rest never read
    e, c = len(MOE_GROUPS), max(MOE_GROUPS)
    counts = torch.tensor(MOE_GROUPS, dtype=torch.int32, device="cuda")
    valid = torch.arange(c, device="cuda") < counts[:, None].long()
    codes = torch.zeros(e, c, MOE_K, dtype=torch.uint8, device="cuda")  # (filled as bytes: FP8 has few kernels)
    sm = torch.ones(e, c, 1, dtype=torch.float32, device="cuda")
    codes[valid], sm[valid] = qa.view(torch.uint8), sa.reshape(-1, 1)
    qm = codes.view(qa.dtype)
    got = cutedsl_gemm.grouped_scaled_mm(qm, b, sm, sb, counts=counts)
    want = R.reference_grouped_mm(qm, b, sm, sb, counts=counts, recipe="row", out_dtype=torch.float64)
    errors["masked"] = R.rel_error(got[valid], want[valid])
    for what, err in errors.items():
        print(f"    {what:30s} rel err {err:.2e}")
    worst = max(errors.values())
    ok = worst <= 2e-3
    print(f"{'PASS' if ok else 'FAIL'}: grouped GEMM, worst relative error {worst:.2e} (limit 2e-3)")
    return ok


def _demo_moe_model_gpu() -> bool:
    """The tiny Mixtral and its converted copy, one decode step each replayed from a CUDA graph: the logits must
    agree within ``MOE_LOGIT_RTOL``."""
    if _no_transformers():
        return True
    from cutedsl_gemm.numerics import reference as R
    from cutedsl_gemm.tools import models as M

    bf16, ours, report = _tiny_mixtral("cuda")
    context = 32
    print(f"    tiny Mixtral (2 layers, 4 experts, top-2): {str(report).splitlines()[0]}; one decode step at batch 1 "
          f"after {context} tokens, replayed from a CUDA graph")
    prompt, logits = M.random_tokens(bf16.config, 1, context), {}
    for name, model in (("bf16", bf16), ("ours", ours)):
        step = M.DecodeStep(model, 1, context + 1)
        step.prefill(prompt)
        graph, output = M.cuda_graph(step)
        logits[name] = step.check_replay(graph.replay, output)  # each replay writes one cache slot
    err = R.rel_error(logits["ours"], logits["bf16"])
    ok = len(report.converted_experts) == 2 and err <= MOE_LOGIT_RTOL
    print(f"{'PASS' if ok else 'FAIL'}: tiny Mixtral, logits rel err {err:.3e} against bf16 (limit {MOE_LOGIT_RTOL})")
    return ok


def _demo_moe() -> bool:
    """The mixture-of-experts section: on a Hopper GPU the grouped GEMM and a tiny converted Mixtral run, without
    one the grouped GEMM compiled and inspected and the Mixtral converted on the CPU."""
    if not _hopper_available():
        return _demo_moe_cpu()
    grouped = _demo_grouped_gpu()
    return _demo_moe_model_gpu() and grouped


def cmd_demo(args) -> int:
    rc = _demo_gpu() if _hopper_available() else _demo_cpu()
    moe = _demo_moe()
    return rc if _demo_model() and moe else 1


# ------------------------------------------------------------------------------------------------
# bench: the GEMM benchmark of a source checkout (benchmarks/ is not part of the installed package)
# ------------------------------------------------------------------------------------------------
BENCH_MODULE = "benchmarks.bench_gemm"
BENCH_DESCRIPTION = (
    "Time scaled_mm against cuBLAS (torch._scaled_mm, F.scaled_mm for the block recipes) on a Hopper GPU, with "
    "the relative error of both. Runs the GEMM benchmark of a source checkout, benchmarks/bench_gemm.py "
    "(the same as `python -m benchmarks.bench_gemm`), from the repository root; every argument after `bench` "
    "goes to it.")


def _bench_module():
    """benchmarks.bench_gemm of the source checkout in the working directory, or None."""
    root = Path.cwd()
    if not (root / "benchmarks" / "bench_gemm.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # a console script's path does not hold the working directory
    return importlib.import_module(BENCH_MODULE)


def _bench_help(parser: argparse.ArgumentParser) -> str:
    text = parser.format_help()
    module = _bench_module()
    if module is None:
        return text + ("\nNo benchmarks/bench_gemm.py in the working directory: run from the repository root of a "
                       "source checkout to see and use its options.\n")
    buf, argv0 = io.StringIO(), sys.argv[0]
    sys.argv[0] = "cutedsl-gemm bench"  # the module's parser names itself after argv[0]
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            module.main(["--help"])
    finally:
        sys.argv[0] = argv0
    return text + "\nOptions of benchmarks/bench_gemm.py:\n\n" + buf.getvalue()


def cmd_bench(args) -> int:
    if args.help:
        print(_bench_help(args.parser), end="")
        return 0
    if not _hopper_available():
        print("cutedsl-gemm bench: needs a Hopper GPU", file=sys.stderr)
        return 2
    module = _bench_module()
    if module is None:
        print("cutedsl-gemm bench: no benchmarks/bench_gemm.py in the working directory; run from the repository "
              "root of a source checkout", file=sys.stderr)
        return 2
    return module.main(args.rest) or 0


# ------------------------------------------------------------------------------------------------
# Ahead of time: export, precompile, catalog
# ------------------------------------------------------------------------------------------------
def _interrupted(e, what: str = "kept") -> int:
    print(f"interrupted: {len(e.results)} of {e.total} done, {what}", file=sys.stderr)
    return INTERRUPTED


def cmd_export(args) -> int:
    from cutedsl_gemm.generators import export as E
    from cutedsl_gemm.generators.runner import Interrupted, SelectionError

    try:
        res = E.export(args.arch, args.out, args.filter or (), args.limit, args.jobs, everything=args.all)
        print(f"exported {len(res.instances)} instance(s) ({len(res.kernels)} kernels) for {args.arch} to "
              f"{res.out_dir}; build: cmake -S {res.out_dir} -B build && cmake --build build")
        if args.shared:
            print(f"linked {E.build_shared(res.out_dir)}")
    except Interrupted as e:
        return _interrupted(e, "the export is incomplete: run it again")
    except (SelectionError, E.ExportError, OSError) as e:
        print(f"cutedsl-gemm export: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_precompile(args) -> int:
    from cutedsl_gemm.generators.precompile import PrecompileError, precompile
    from cutedsl_gemm.generators.runner import SelectionError

    try:
        rep = precompile(args.arch, args.filter or (), args.jobs, args.limit, everything=args.all)
    except (SelectionError, PrecompileError, OSError) as e:
        print(f"cutedsl-gemm precompile: {e}", file=sys.stderr)
        return 2
    for name, err in rep.failed:
        print(f"  FAILED {name}: {err}", file=sys.stderr)
    return 1 if rep.failed else 0


def cmd_catalog(args) -> int:
    from cutedsl_gemm.generators import catalog as C
    from cutedsl_gemm.generators.runner import SelectionError

    scope = "; ".join([f"arch {args.arch}"] * bool(args.arch)
                      + [f"names containing any of {args.filter}"] * bool(args.filter)
                      + ["one instance per kernel family"] * args.sample) or "the whole table"
    try:
        insts = C.select(args.arch, args.filter or (), args.limit, args.sample)
        rep = C.write_catalog(args.out, insts, args.jobs, scope)
    except (SelectionError, OSError) as e:
        print(f"cutedsl-gemm catalog: {e}", file=sys.stderr)
        return 2
    for name, err in rep.failed:
        print(f"  FAILED {name}: {err}", file=sys.stderr)
    return 1 if rep.failed else 0


class Parser(argparse.ArgumentParser):
    """The top-level parser: an error (an unknown option, no command) prints the usage, the commands with what
    each does, and one line saying what was wrong."""

    def error(self, message):
        self.print_usage(sys.stderr)
        sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None:
            width = max(len(c.dest) for c in sub._choices_actions)
            lines = [f"  {c.dest:{width}s}  {c.help}" for c in sub._choices_actions]
            sys.stderr.write("\ncommands:\n" + "\n".join(lines) + "\n\n")
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _add_selection(p, what: str, arch_default: str | None = "sm_90a"):
    from cutedsl_gemm.generators.runner import JOBS_HELP

    p.add_argument("--arch", default=arch_default,
                   help=f"target arch of the instances (default {arch_default or 'every arch of the table'})")
    p.add_argument("--filter", action="append", metavar="SUBSTR",
                   help=f"{what} only instances whose name contains SUBSTR (repeatable: any of them)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="at most N instances (table order)")
    p.add_argument("--jobs", type=positive_int, metavar="N", help=JOBS_HELP)


def _add_all(p, what: str):
    from cutedsl_gemm.generators.runner import DEFAULT_SET

    p.add_argument("--all", action="store_true",
                   help=f"{what} every instance of the table (thousands); without --all or --filter: the default "
                        f"set ({DEFAULT_SET})")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cutedsl-gemm", description="FP8/FP6/FP4/INT8 GEMM kernels in the CuTe DSL")
    # (subcommands get plain parsers: their errors show their own usage)
    sub = p.add_subparsers(dest="cmd", parser_class=argparse.ArgumentParser)
    demo_help = "GPU: run and check against cuBLAS; CPU: compile for sm_90a and inspect"
    sub.add_parser("demo", help=demo_help, description=(
        "With a Hopper GPU: run scaled_mm on a few shapes per recipe, check it against the float64 reference "
        "and time it against cuBLAS. Without one: compile GEMM instances for sm_90a and check their PTX for "
        "the tensor-core MMA, TMA and register reallocation instructions (for the weight-only GEMM also its "
        "register-sourced WGMMA and the weights' conversion), then check the reference numerics. "
        "Mixture of experts: with a Hopper GPU, run grouped_scaled_mm in both layouts (an empty and a one-row group "
        "among the experts) against the float64 reference, and a tiny Mixtral converted by cutedsl_gemm.nn against "
        "its bf16 twin; without one, compile the grouped GEMM for sm_90a, check its PTX for WGMMA on e4m3 and TMA "
        "loads, and convert the tiny Mixtral on the CPU. "
        "With a Hopper GPU and transformers, also time one decode step of a two-layer Llama-3-8B-shaped model in "
        "bf16, through torch's FP8 path and converted by cutedsl_gemm.nn, and compare their logits."
    )).set_defaults(fn=cmd_demo)
    sub.add_parser("info", help="GPU, arch, DSL version, cache directory", description=(
        "Print the GPU (if any), the arch kernels compile for, the CuTe DSL and torch versions and the "
        "kernel cache directory.")).set_defaults(fn=cmd_info)
    b = sub.add_parser("bench", help="benchmark against cuBLAS (Hopper GPU; runs benchmarks/bench_gemm.py)",
                       description=BENCH_DESCRIPTION, add_help=False, usage="cutedsl-gemm bench [-h] [OPTION ...]")
    b.add_argument("-h", "--help", action="store_true", help="show this help and the benchmark's options")
    b.set_defaults(fn=cmd_bench, parser=b, rest=[])
    e = sub.add_parser("export", help="AOT: C objects + headers, registry, CMake fragment for table instances (no GPU)",
                       description="Compile table instances for a target arch (no GPU) into C objects and headers "
                                   "with a registry and CMake files. A previous export in --out is replaced once "
                                   "the new one is complete; a failed or interrupted export leaves it as it was. "
                                   "--shared needs a C compiler (cc, gcc or clang, or $CC).")
    _add_selection(e, "export")
    _add_all(e, "export")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--shared", action="store_true", help="also link lib<...>.so with the system C compiler")
    e.set_defaults(fn=cmd_export)
    pc = sub.add_parser("precompile", help="fill the on-disk JIT cache for table instances, in parallel",
                        description="Compile table instances into the on-disk JIT cache, so that the first "
                                    "scaled_mm call of a process loads them instead of compiling. Entries already "
                                    "cached are skipped; Ctrl-C keeps the entries that finished.")
    _add_selection(pc, "compile")
    _add_all(pc, "compile")
    pc.set_defaults(fn=cmd_precompile)
    c = sub.add_parser("catalog", help="render the kernel catalog (markdown + JSON facts) into --out",
                       description="Compile table instances (no GPU) and write DIR/kernels.md and DIR/kernels.json: "
                                   "registers, stack frame, shared memory, stages and MMA instructions per "
                                   "instance. Facts already in DIR for the same sources are reused; Ctrl-C keeps "
                                   "what finished.")
    _add_selection(c, "catalog", arch_default=None)
    c.add_argument("--sample", action="store_true", help="one instance per kernel family (every code path)")
    c.add_argument("--out", default="catalog", metavar="DIR", help="output directory (default: ./catalog)")
    c.set_defaults(fn=cmd_catalog)
    return p


def main(argv=None) -> int:
    from cutedsl_gemm.runtime.jit import ArchError, env_arch

    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if args.cmd is None:
        p.error(f"unrecognized arguments: {' '.join(rest)}" if rest else "no command given")
    if args.cmd == "bench":
        args.rest = rest
    elif rest:
        commands = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
        commands[args.cmd].error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        env_arch()
    except ArchError as e:
        print(f"cutedsl-gemm: {e}", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KeyboardInterrupt as e:
        if hasattr(e, "results"):  # runner.Interrupted: the workers are stopped, finished work is kept
            return _interrupted(e)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED

"""Hopper: activation quantization fused into the GEMM.

Decode: ``quantize_scaled_mm`` takes bf16 activations and an FP8 or int8 weight and quantizes the activations the
way the weight's scales pair with -- 1x128 groups for 128x128-block weights (DeepSeek-V3), per token for per-channel
FP8 or int8 (W8A8) weights -- inside the GEMM (``in_kernel=True``) or as the quantizer then ``scaled_mm``
(``in_kernel=False``); both give the same bits.

Prefill: ``scaled_mm_fp8_out`` emits a layer's output as the next layer's e4m3 activations with 1x128 scales,
the bits of ``quantize_fp8(scaled_mm(..., bf16), "1x128")``, and the next DeepSeek-recipe layer takes them as is.

    python examples/sm90_fused_quantization.py [--m 1 --n 28672 --k 4096 --prefill-m 4096]

On a Hopper GPU it runs both and times them against their two-kernel forms. Without one it finds the kernels these
calls run on an H100 (132 SMs), compiles them for sm_90a and prints the instructions of the quantization inside
them; nothing is executed then.
"""

import argparse
import re

import torch

import cutedsl_gemm


def timed(fn) -> float:
    """Median us of ``fn`` (triton's do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median") * 1e3


def weight(kind, n, k):
    """b = W.t() and scale_b as scaled_mm takes them, for W (N, K) quantized per ``kind``."""
    w = torch.randn(n, k, device="cuda")
    if kind == "deepseek":
        qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128")
        return qw.t(), sw.t().contiguous()
    if kind == "int8":
        qw, sw = cutedsl_gemm.quantize_int8(w, "row")
    else:
        qw, sw = cutedsl_gemm.quantize_fp8(w, "row")
    return qw.t(), sw.t()


def same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def decode(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for kind in ("deepseek", "row", "int8"):
        b, sb = weight(kind, n, k)
        one = cutedsl_gemm.quantize_scaled_mm(x, b, sb, in_kernel=True)
        two = cutedsl_gemm.quantize_scaled_mm(x, b, sb, in_kernel=False)
        t_one, t_two = (timed(lambda b=b, sb=sb, f=fused: cutedsl_gemm.quantize_scaled_mm(x, b, sb, in_kernel=f))
                        for fused in (True, False))
        print(f"decode M={m} N={n} K={k} {kind:8s}: one kernel {t_one:6.1f} us, quantizer + GEMM {t_two:6.1f} us, "
              f"same bits: {same_bits(one, two)}")


def prefill(m, n, k):
    """Two DeepSeek-recipe layers, K -> N -> 2048: the first emits the second's FP8 activations."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    qx, sx = cutedsl_gemm.quantize_fp8(x, "1x128")
    b1, sb1 = weight("deepseek", n, k)
    b2, sb2 = weight("deepseek", 2048, n)

    def fused():
        q, s = cutedsl_gemm.scaled_mm_fp8_out(qx, b1, sx, sb1)
        return cutedsl_gemm.scaled_mm(q, b2, s, sb2)

    def unfused():
        y = cutedsl_gemm.scaled_mm(qx, b1, sx, sb1, out_dtype=torch.bfloat16)
        q, s = cutedsl_gemm.quantize_fp8(y, "1x128")
        return cutedsl_gemm.scaled_mm(q, b2, s, sb2)

    same = same_bits(fused(), unfused())
    t_fused, t_unfused = timed(fused), timed(unfused)
    print(f"prefill M={m}, {k} -> {n} -> 2048: FP8 out of the epilogue {t_fused:7.1f} us, bf16 out + quantizer "
          f"{t_unfused:7.1f} us, same bits: {same}")


def compile_only(m, n, k, prefill_m):
    """No Hopper GPU: the decode calls' one-kernel GEMMs and the prefill layer's FP8-output GEMM that an H100 runs,
    compiled for sm_90a, with the instructions that quantize inside them."""
    from cutedsl_gemm import problem
    from cutedsl_gemm.ops import quantize as Q
    from cutedsl_gemm.selection import dispatch
    from cutedsl_gemm.selection.instances import QUANT_GEMM
    from cutedsl_gemm.tools import ptx_inspect as I

    h100 = ("sm_90a", 132)
    # Meta tensors: only shapes, strides and dtypes decide the kernel (the quantizers' fake implementations give
    # their outputs' layouts).
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    kernels = []
    for kind in ("deepseek", "row", "int8"):
        w = torch.empty(n, k, device="meta")
        qw, sw = Q.quantize_fp8_like(w, "128x128") if kind == "deepseek" else \
            Q.quantize_int8_like(w, "row") if kind == "int8" else Q.quantize_fp8_like(w, "row")
        b, sb = qw.t(), sw.t().contiguous() if kind == "deepseek" else sw.t()
        call, _ = problem.describe_quantize_scaled_mm(x, b, sb, None, torch.bfloat16, None, None, None, x.device,
                                                      target=h100)
        inst = dispatch.select_gemm(call.arch, call.recipe, call.act_format, call.b_format, call.out_name,
                                    call.bias_name, call.m, call.accum, n=call.n, sms=call.sms, k=call.k, op=QUANT_GEMM)
        if call.recipe != "row":  # 1x128 groups
            steps = I.ACTIVATION_QUANTIZATION
        else:  # per token: int8 codes, or e4m3 ones
            steps = {s: p for s, p in I.PER_TOKEN_QUANTIZATION.items() if kind == "int8" or s != "int8 rounding"}
            if kind != "int8":
                steps["e4m3 conversion"] = I.ACTIVATION_QUANTIZATION["e4m3 conversion"]
        kernels.append((f"decode M={m} N={n} K={k} {kind}: quantize_scaled_mm(in_kernel=True)", inst, steps))
    qx, sx = Q.quantize_fp8_like(torch.empty(prefill_m, k, dtype=torch.bfloat16, device="meta"), "1x128")
    qw, sw = Q.quantize_fp8_like(torch.empty(7168, k, device="meta"), "128x128")
    call, _ = problem.describe_scaled_mm_fp8_out(qx, qw.t(), sx, sw.t().contiguous(), None, x.device, target=h100)
    twin = dispatch.fp8_out_twin(dispatch.select_gemm(call.arch, call.recipe, call.a_format, call.b_format,
                                                      call.out_name, call.bias_name, call.m, call.accum, n=call.n,
                                                      sms=call.sms, k=call.k))
    kernels.append((f"prefill M={prefill_m} N=7168 K={k}: scaled_mm_fp8_out", twin, I.FP8_OUTPUT))
    print("No Hopper GPU here: the kernels these calls run on an H100 (132 SMs), compiled for sm_90a, not executed.")
    for what, inst, steps in kernels:
        rep = I.inspect_instance(inst)
        print(f"\n{what}\n  {rep.summary_lines()[0]}")
        for step, pattern in steps.items():
            first = re.search(rf"(?:{pattern})[^\n]*", rep.ptx)
            example = f", e.g. {' '.join(first.group(0).split())}" if first else ""
            print(f"    {len(re.findall(pattern, rep.ptx)):4d} x {step}{example}")
    print("\nRunning them, and comparing their bits and times with the two-kernel forms, needs a Hopper GPU (H100, "
          "H200 or H800).")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=1, help="decode tokens (<= 32 for the one-kernel path)")
    p.add_argument("--n", type=int, default=28672)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--prefill-m", type=int, default=4096)
    args = p.parse_args()
    torch.manual_seed(0)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return compile_only(args.m, args.n, args.k, args.prefill_m)
    decode(args.m, args.n, args.k)
    prefill(args.prefill_m, 7168, args.k)


if __name__ == "__main__":
    main()

"""Hopper: activation quantization fused into the GEMM.

Decode: ``quantize_scaled_mm`` takes bf16 activations and an FP8 or int8 weight and quantizes the activations the
way the weight's scales pair with -- 1x128 groups for 128x128-block weights (DeepSeek-V3), per token for per-channel
FP8 or int8 (W8A8) weights -- inside the GEMM (``in_kernel=True``) or as the quantizer then ``scaled_mm``
(``in_kernel=False``); both give the same bits.

Prefill: ``scaled_mm_fp8_out`` emits a layer's output as the next layer's e4m3 activations with 1x128 scales,
the bits of ``quantize_fp8(scaled_mm(..., bf16), "1x128")``, and the next DeepSeek-recipe layer takes them as is.

    python examples/sm90_fused_quantization.py [--m 1 --n 28672 --k 4096 --prefill-m 4096]

Needs a Hopper GPU; elsewhere use `cutedsl-gemm demo`, which compiles and inspects these kernels.
"""

import argparse

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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=1, help="decode tokens (<= 32 for the one-kernel path)")
    p.add_argument("--n", type=int, default=28672)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--prefill-m", type=int, default=4096)
    args = p.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        raise SystemExit("this example runs on a Hopper GPU; try `cutedsl-gemm demo` for the compile-only view")
    torch.manual_seed(0)
    decode(args.m, args.n, args.k)
    prefill(args.prefill_m, 7168, args.k)


if __name__ == "__main__":
    main()

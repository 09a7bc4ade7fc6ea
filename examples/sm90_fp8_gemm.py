"""Hopper FP8 GEMM, end to end: make inputs, quantize, call, check, time against cuBLAS.

    python examples/sm90_fp8_gemm.py [--m 4096 --n 4608 --k 7168 --recipe row]

Needs a Hopper GPU; elsewhere use `cutedsl-gemm demo`, which compiles and inspects the kernels.
"""

import argparse

import torch

import cutedsl_gemm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4608)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--recipe", choices=["tensor", "row"], default="row")
    args = p.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        raise SystemExit("this example runs on a Hopper GPU; try `cutedsl-gemm demo` for the compile-only view")
    m, n, k = args.m, args.n, args.k

    # Activations and weights in bf16, quantized to E4M3 on the GPU (scales: (M, 1) and (N, 1) per row).
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qx, sx = cutedsl_gemm.quantize_fp8(x, args.recipe)
    qw, sw = cutedsl_gemm.quantize_fp8(w, args.recipe)
    scale_w = sw if args.recipe == "tensor" else sw.reshape(1, n)

    # Same call shape as torch._scaled_mm: b is the (K, N) column-major view of the weight.
    out = cutedsl_gemm.scaled_mm(qx, qw.t(), sx, scale_w, out_dtype=torch.bfloat16)
    ref = torch._scaled_mm(qx, qw.t(), sx, scale_w, out_dtype=torch.bfloat16)
    exact = (qx.double() * sx.double()) @ (qw.double() * sw.double()).t()  # sw: () or (N, 1)
    def err(o):
        return float((o.double() - exact).norm() / exact.norm())

    print(f"relative error vs float64: ours {err(out):.2e}, cuBLAS {err(ref):.2e}")

    from triton.testing import do_bench

    t_ours = do_bench(lambda: cutedsl_gemm.scaled_mm(qx, qw.t(), sx, scale_w), return_mode="median")
    t_ref = do_bench(lambda: torch._scaled_mm(qx, qw.t(), sx, scale_w, out_dtype=torch.bfloat16), return_mode="median")
    def tf(t):
        return 2 * m * n * k / (t * 1e-3) / 1e12

    print(f"M={m} N={n} K={k} {args.recipe}: ours {t_ours * 1e3:.1f} us ({tf(t_ours):.0f} TFLOPS), "
          f"cuBLAS {t_ref * 1e3:.1f} us ({tf(t_ref):.0f} TFLOPS), ratio {t_ref / t_ours:.3f}")


if __name__ == "__main__":
    main()

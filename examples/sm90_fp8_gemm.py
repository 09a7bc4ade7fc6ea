"""Hopper FP8 GEMM, end to end: make inputs, quantize, call, check, time against cuBLAS.

    python examples/sm90_fp8_gemm.py [--m 4096 --n 4608 --k 7168 --recipe row]

On a Hopper GPU it runs the GEMM. Without one it quantizes with the torch reference (the kernels' bits), finds the
kernel ``scaled_mm`` runs for this call on an H100 (132 SMs), compiles it for sm_90a and prints what its PTX holds,
and the quantization error of the float64 reference; nothing is executed then.
"""

import argparse

import torch

import cutedsl_gemm


def compile_only(args):
    """No Hopper GPU: the call described for an H100, its kernel compiled for sm_90a and inspected."""
    from cutedsl_gemm import problem
    from cutedsl_gemm.numerics.reference import rel_error
    from cutedsl_gemm.selection import dispatch
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    m, n, k = args.m, args.n, args.k
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    qx, sx = cutedsl_gemm.quantize_fp8(x, args.recipe)  # on the CPU: the torch reference, the kernels' bits
    qw, sw = cutedsl_gemm.quantize_fp8(w, args.recipe)
    scale_w = sw if args.recipe == "tensor" else sw.reshape(1, n)
    call, _ = problem.describe_scaled_mm(qx, qw.t(), sx, scale_w, None, torch.bfloat16, None, False, None, None, None,
                                         None, x.device, target=("sm_90a", 132))
    # (the K split is chosen on the GPU, from the clusters it holds at once)
    inst = dispatch.select_gemm(call.arch, call.recipe, call.a_format, call.b_format, call.out_name, call.bias_name,
                                call.m, call.accum, n=call.n, sms=call.sms, k=call.k)
    print(f"No Hopper GPU here: on an H100 (132 SMs) scaled_mm runs {inst.name} for M={m} N={n} K={k}; "
          "compiled for sm_90a, not executed:")
    print("\n".join(inspect_instance(inst).summary_lines()))
    rows = slice(0, 64)  # the float64 reference on a few rows
    srows = sx if sx.dim() == 0 else sx[rows]
    exact = (qx[rows].double() * srows.double()) @ (qw.double() * sw.double()).t()
    print(f"quantization error ({args.recipe}, first 64 rows) of the float64 reference vs the bf16 inputs' product: "
          f"{rel_error(exact, x[rows].double() @ w.double().t()):.2e}")
    print("Running the GEMM and timing it against cuBLAS needs a Hopper GPU (H100, H200 or H800).")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4608)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--recipe", choices=["tensor", "row"], default="row")
    args = p.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return compile_only(args)
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

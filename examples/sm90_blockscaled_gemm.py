"""Hopper block-scaled FP8 GEMM (DeepSeek-V3 recipe): quantize activations 1x128 and weights 128x128,
GEMM, check against float64, compare with cuBLAS (torch.nn.functional.scaled_mm, BlockWise1x128 x 128x128).

    python examples/sm90_blockscaled_gemm.py [--m 4096 --n 7168 --k 2048]

On a Hopper GPU it runs the GEMM. Without one it quantizes with the torch reference (the kernels' bits), finds the
kernel ``scaled_mm`` runs for this call on an H100 (132 SMs), compiles it for sm_90a and prints what its PTX holds,
and the quantization error of the float64 reference; nothing is executed then.
"""

import argparse

import torch
import torch.nn.functional as F

import cutedsl_gemm


def dequantized_product(qx, sx, qw, sw):
    """float64 on the dequantized operands: 1x128 scales (M, Kb) for x, padded 128x128 block scales for w."""
    k, n = qx.shape[1], qw.shape[0]
    kb = -(-k // 128)
    xs = sx.double().repeat_interleave(128, 1)[:, :k]
    ws = sw[:, :kb].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (qx.double() * xs) @ (qw.double() * ws).t()


def compile_only(x, w, qx, sx, qw, sw):
    """No Hopper GPU: the call described for an H100, its kernel compiled for sm_90a and inspected."""
    from cutedsl_gemm import problem
    from cutedsl_gemm.numerics.reference import rel_error
    from cutedsl_gemm.selection import dispatch
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    (m, k), n = x.shape, w.shape[0]
    call, _ = problem.describe_scaled_mm(qx, qw.t(), sx, sw.t(), None, torch.bfloat16, None, False, None, None, None,
                                         None, x.device, target=("sm_90a", 132))
    # (the K split is chosen on the GPU, from the clusters it holds at once)
    inst = dispatch.select_gemm(call.arch, call.recipe, call.a_format, call.b_format, call.out_name, call.bias_name,
                                call.m, call.accum, n=call.n, sms=call.sms, k=call.k)
    print(f"No Hopper GPU here: on an H100 (132 SMs) scaled_mm runs {inst.name} for M={m} N={n} K={k} "
          f"(recipe {call.recipe}, read from the scales' shapes); compiled for sm_90a, not executed:")
    print("\n".join(inspect_instance(inst).summary_lines()))
    rows = slice(0, 64)  # the float64 reference on a few rows
    exact = dequantized_product(qx[rows], sx[rows], qw, sw)
    print(f"quantization error (1x128 x 128x128, first 64 rows) of the float64 reference vs the bf16 inputs' product: "
          f"{rel_error(exact, x[rows].double() @ w.double().t()):.2e}")
    print("Running the GEMM and timing it against cuBLAS needs a Hopper GPU (H100, H200 or H800).")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=7168)
    p.add_argument("--k", type=int, default=2048)
    args = p.parse_args()
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    device = "cuda" if hopper else "cpu"  # (on the CPU the quantizers are their torch reference: the same bits)
    m, n, k = args.m, args.n, args.k

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    # Activations: one scale per row per 128 K, returned (M, Kb) M-contiguous -- F.scaled_mm's BlockWise1x128.
    qx, sx = cutedsl_gemm.quantize_fp8(x, "1x128")
    # Weights: one scale per 128x128 block, stored (ceil(N/128), round_up(Kb, 4)) as cuBLAS wants it;
    # its transpose is the (K-blocks, N-blocks) operand in b's orientation.
    qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128", scale_layout="padded")
    if not hopper:
        return compile_only(x, w, qx, sx, qw, sw)

    out = cutedsl_gemm.scaled_mm(qx, qw.t(), sx, sw.t())  # the scale shapes select the recipe
    ref = F.scaled_mm(qx, qw.t(), sx, F.ScalingType.BlockWise1x128, sw.t(), F.ScalingType.BlockWise128x128,
                      output_dtype=torch.bfloat16)

    exact = dequantized_product(qx, sx, qw, sw)  # what both kernels should compute
    def err(o):
        return float((o.double() - exact).norm() / exact.norm())

    print(f"relative error vs float64: ours {err(out):.2e}, cuBLAS {err(ref):.2e}")

    from triton.testing import do_bench

    t_ours = do_bench(lambda: cutedsl_gemm.scaled_mm(qx, qw.t(), sx, sw.t()), return_mode="median")
    t_ref = do_bench(lambda: F.scaled_mm(qx, qw.t(), sx, F.ScalingType.BlockWise1x128, sw.t(),
                                         F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
                     return_mode="median")
    def tf(t):
        return 2 * m * n * k / (t * 1e-3) / 1e12

    print(f"M={m} N={n} K={k} 1x128 x 128x128: ours {t_ours * 1e3:.1f} us ({tf(t_ours):.0f} TFLOPS), "
          f"cuBLAS {t_ref * 1e3:.1f} us ({tf(t_ref):.0f} TFLOPS), ratio {t_ref / t_ours:.3f}")


if __name__ == "__main__":
    main()

"""Hopper block-scaled FP8 GEMM (DeepSeek-V3 recipe): quantize activations 1x128 and weights 128x128,
GEMM, check against float64, compare with cuBLAS (torch.nn.functional.scaled_mm, BlockWise1x128 x 128x128).

    python examples/sm90_blockscaled_gemm.py [--m 4096 --n 7168 --k 2048]

Needs a Hopper GPU; elsewhere use `cutedsl-gemm demo`, which compiles and inspects the kernels.
"""

import argparse

import torch
import torch.nn.functional as F

import cutedsl_gemm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=7168)
    p.add_argument("--k", type=int, default=2048)
    args = p.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        raise SystemExit("this example runs on a Hopper GPU; try `cutedsl-gemm demo` for the compile-only view")
    m, n, k = args.m, args.n, args.k
    kb = -(-k // 128)

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    # Activations: one scale per row per 128 K, returned (M, Kb) M-contiguous -- F.scaled_mm's BlockWise1x128.
    qx, sx = cutedsl_gemm.quantize_fp8(x, "1x128")
    # Weights: one scale per 128x128 block, stored (ceil(N/128), round_up(Kb, 4)) as cuBLAS wants it;
    # its transpose is the (K-blocks, N-blocks) operand in b's orientation.
    qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128", scale_layout="padded")

    out = cutedsl_gemm.scaled_mm(qx, qw.t(), sx, sw.t())  # the scale shapes select the recipe
    ref = F.scaled_mm(qx, qw.t(), sx, F.ScalingType.BlockWise1x128, sw.t(), F.ScalingType.BlockWise128x128,
                      output_dtype=torch.bfloat16)

    # float64 on the dequantized operands: what both kernels should compute.
    xs = sx.double().repeat_interleave(128, 1)[:, :k]
    ws = sw[:, :kb].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    exact = (qx.double() * xs) @ (qw.double() * ws).t()
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

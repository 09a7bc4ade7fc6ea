"""Mixed-precision Blackwell GEMM: E2M3 (FP6) activations x E2M1 (FP4) weights, bf16 output.

On an sm_100 GPU this runs the kernel and checks it against the float64 reference. Anywhere else it
compiles the same kernel for sm_100a and prints what the PTX contains and the resources it asks for
(nothing is executed then).

    python examples/sm100_f8f6f4_gemm.py [--m 1024 --n 1024 --k 2048] [--two-cta]
"""

import argparse
import os
import re
import sys
import tempfile


def on_blackwell() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def run(args):
    import torch

    from cutedsl_gemm import sm100
    from cutedsl_gemm.numerics import fp_packing
    from cutedsl_gemm.numerics.reference import rel_error

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.m, args.k, generator=g)
    w = torch.randn(args.n, args.k, generator=g)
    a = fp_packing.pack(x, "e2m3").cuda()  # (M, 3K/4) uint8, packed 6-bit
    wq = fp_packing.pack(w, "e2m1", as_float4_x2=True).cuda()  # (N, K/2) float4_e2m1fn_x2
    b = wq.t()  # (K/2, N) column-major, torch._scaled_mm's convention
    sa = torch.tensor([0.5], device="cuda")
    sb = torch.tensor([0.25], device="cuda")
    out = sm100.sm100_f8f6f4_mm(a, b, fmt_a="e2m3", fmt_b="e2m1", scale_a=sa, scale_b=sb, use_2cta=args.two_cta)
    ref = sm100.reference_f8f6f4(a, b, fmt_a="e2m3", fmt_b="e2m1", scale_a=sa, scale_b=sb)
    err = rel_error(out, ref)
    print(f"E2M3 x E2M1 -> bf16, {args.m}x{args.n}x{args.k}: relative error {err:.2e} (limit 2e-3)")
    return 0 if err <= 2e-3 else 1


def compile_only(args):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    import cutlass
    import cutlass.cute as cute

    from cutedsl_gemm import sm100
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import Sm100F8F6F4Gemm

    cfg = sm100.Sm100Config(out_dtype="BFloat16", use_2cta=args.two_cta)
    kernel = Sm100F8F6F4Gemm(cutlass.BFloat16, cfg.use_2cta, cfg.tile_n, cfg.has_bias)
    with tempfile.TemporaryDirectory() as d:
        fn = cute.compile(kernel, *sm100.fake_args(cfg), options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")
        ptx = fn.__ptx__
    print(f"No sm_100 GPU here: compiled for {os.environ['CUTE_DSL_ARCH']} only (not executed).")
    print(f"E2M3 x E2M1 would run on the same kernel as every other type pair: formats {sm100.MMA_FORMAT_CODE['e2m3']} "
          f"and {sm100.MMA_FORMAT_CODE['e2m1']} go into the instruction descriptor at run time; TMA formats "
          f"{sm100.TMA_DATA_TYPE['e2m3']} (A) and {sm100.TMA_DATA_TYPE['e2m1']} (B).")
    print("\nInstructions in the PTX:")
    for pat in (r"tcgen05\.mma\S*", r"tcgen05\.(?:alloc|dealloc|commit|ld)\S*", r"cp\.async\.bulk\.tensor\S*",
                r"mbarrier\.arrive\.expect_tx\S*"):
        for name in sorted(set(re.findall(pat, ptx))):
            print(f"  {ptx.count(name):3d} x {name}")
    mma = next(ln.strip() for ln in ptx.splitlines() if "tcgen05.mma" in ln)
    print(f"  e.g. {mma}    (last register before the predicate = run-time instruction descriptor)")
    smem = kernel.num_ab_stage * (kernel.a_stage_bytes + kernel.b_stage_bytes)
    print("\nResources:")
    print(f"  threads/CTA      {kernel.threads_per_cta} (4 epilogue warps, 1 MMA warp, 1 TMA warp)")
    print(f"  cluster          {kernel.cluster_shape_mn} ({'cta_group::2' if cfg.use_2cta else 'cta_group::1'})")
    print(f"  MMA tile         {kernel.mma_tiler}")
    print(f"  A/B smem stages  {kernel.num_ab_stage} x {kernel.a_stage_bytes + kernel.b_stage_bytes} B = {smem} B")
    print(f"  TMEM columns     {kernel.num_tmem_alloc_cols} ({kernel.num_acc_stage} fp32 accumulators)")
    regs = re.findall(r"\.reg \.b32\s+%r<(\d+)>", ptx)
    if regs:
        print(f"  PTX virtual b32 registers declared: {max(map(int, regs))} (ptxas allocation not known without a GPU toolchain run)")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--two-cta", action="store_true", help="cta_group::2 with 256-row MMA tiles")
    args = p.parse_args()
    return run(args) if on_blackwell() else compile_only(args)


if __name__ == "__main__":
    sys.exit(main())

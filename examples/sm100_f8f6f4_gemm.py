"""Mixed-precision Blackwell GEMM: E2M3 (FP6) activations x E2M1 (FP4) weights, bf16 output.

On an sm_100 GPU this runs ``cutedsl_gemm.scaled_mm`` and checks it against the float64 reference. Anywhere
else it compiles the same kernel for sm_100a and prints what the PTX contains and the resources it asks for
(nothing is executed then).

    python examples/sm100_f8f6f4_gemm.py [--m 1024 --n 1024 --k 2048] [--two-cta]
"""

import argparse
import re
import sys


def on_blackwell() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def run(args):
    import torch

    import cutedsl_gemm
    from cutedsl_gemm.numerics import codecs
    from cutedsl_gemm.numerics.reference import reference_f8f6f4, rel_error

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.m, args.k, generator=g)
    w = torch.randn(args.n, args.k, generator=g)
    a = codecs.quantize_operand(x, "e2m3").cuda()  # (M, 3K/4) uint8, packed 6-bit
    wq = codecs.quantize_operand(w, "e2m1", as_float4_x2=True).cuda()  # (N, K/2) float4_e2m1fn_x2
    b = wq.t()  # (K/2, N) column-major, torch._scaled_mm's convention
    sa = torch.tensor([0.5], device="cuda")
    sb = torch.tensor([0.25], device="cuda")
    # uint8 bytes do not say which format they hold: fmt_a names it (b's float4 dtype names its own)
    out = cutedsl_gemm.scaled_mm(a, b, sa, sb, fmt_a="e2m3", schedule="2sm" if args.two_cta else "1sm")
    ref = reference_f8f6f4(a, b, fmt_a="e2m3", scale_a=sa, scale_b=sb)
    err = rel_error(out, ref)
    print(f"E2M3 x E2M1 -> bf16, {args.m}x{args.n}x{args.k}: relative error {err:.2e} (limit 2e-3)")
    return 0 if err <= 2e-3 else 1


def compile_only(args):
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import MMA_FORMAT_CODE, STORAGE_OF_CODE, describe_resources
    from cutedsl_gemm.runtime.compile import compile_instance
    from cutedsl_gemm.selection.instances import select
    from cutedsl_gemm.tools.ptx_inspect import keep_artifacts

    (inst,) = select(arch="sm_100a", recipe="tensor", out_dtype="bf16", bias_dtype=None,
                     schedule="2sm" if args.two_cta else "1sm")
    with keep_artifacts(inst.arch):
        ptx = compile_instance(inst).__ptx__
    kernel = inst.sm100_kernel()
    res = describe_resources(kernel)  # the budgets the kernel's set-up chooses
    print(f"No sm_100 GPU here: compiled {inst.name} for {inst.arch} only (not executed).")
    code_a, code_b = MMA_FORMAT_CODE["e2m3"], MMA_FORMAT_CODE["e2m1"]
    views = {0: "8-bit", 1: "6-bit unpacking", 2: "4-bit unpacking"}
    print(f"E2M3 x E2M1 would run on the same kernel as every other type pair: formats {code_a} and {code_b} go "
          f"into the instruction descriptor at run time; TMA views {views[STORAGE_OF_CODE[code_a]]} (A) and "
          f"{views[STORAGE_OF_CODE[code_b]]} (B).")
    print("\nInstructions in the PTX:")
    for pat in (r"tcgen05\.mma\S*", r"tcgen05\.(?:alloc|dealloc|commit|ld)\S*", r"cp\.async\.bulk\.tensor\S*",
                r"mbarrier\.arrive\.expect_tx\S*"):
        for name in sorted(set(re.findall(pat, ptx))):
            print(f"  {ptx.count(name):3d} x {name}")
    mma = next(ln.strip() for ln in ptx.splitlines() if "tcgen05.mma" in ln)
    print(f"  e.g. {mma}    (last register before the predicate = run-time instruction descriptor)")
    stage = res["a_stage_bytes"] + res["b_stage_bytes"]
    print("\nResources:")
    print(f"  threads/CTA      {kernel.threads_per_cta} (4 epilogue warps, 1 MMA warp, 1 TMA warp)")
    print(f"  cluster          {kernel.cluster_shape_mn} ({'cta_group::2' if args.two_cta else 'cta_group::1'})")
    print(f"  MMA tile         {kernel.mma_tiler}")
    print(f"  A/B smem stages  {res['num_ab_stage']} x {stage} B = {res['num_ab_stage'] * stage} B")
    print(f"  TMEM columns     {res['tmem_cols']} ({kernel.num_acc_stage} fp32 accumulators)")
    regs = re.findall(r"\.reg \.b32\s+%r<(\d+)>", ptx)
    if regs:
        print(f"  PTX virtual b32 registers declared: {max(map(int, regs))} (ptxas allocation not known without "
              "a GPU toolchain run)")
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

"""NVFP4 and MXFP8 GEMM from bf16 inputs through the block-scaled quantizers.

    python examples/sm100_blockscaled_gemm.py [--m 512 --n 256 --k 1024]

Both recipes quantize A (M, K) and W (N, K) from bf16 (CuTe DSL quantizer kernels on a CUDA GPU, the
bit-identical torch reference elsewhere) and compute ``dequant(A) @ dequant(W).T`` with
``cutedsl_gemm.scaled_mm``, the scales passed as ``torch.nn.functional.scaled_mm`` takes them:

* on an sm_100 GPU with the block-scaled tcgen05 GEMM, checked against the float64 reference;
* anywhere else the GEMMs are only compiled for sm_100a (nothing runs): the script prints the float64
  reference's quantization error and what each compiled kernel's PTX contains.
"""

import argparse
import re
import sys

import torch
from torch.nn.functional import ScalingType

import cutedsl_gemm
from cutedsl_gemm import problem
from cutedsl_gemm.numerics.reference import reference_blockscaled_mm, rel_error
from cutedsl_gemm.numerics.scale_layouts import SF_ATOM_BYTES
from cutedsl_gemm.selection import dispatch

RECIPES = (("NVFP4", lambda x: cutedsl_gemm.quantize_nvfp4(x)),
           ("MXFP8 e4m3", lambda x: cutedsl_gemm.quantize_mx(x, "e4m3")))
NVFP4_SCALING = [ScalingType.BlockWise1x16, ScalingType.TensorWise]


def on_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def gemm_args(qa, qw):
    """scaled_mm's arguments for A and W: ``b = W.t()``; NVFP4's per-tensor scales as F.scaled_mm passes them,
    ``[block scales, global scale]`` with ``[BlockWise1x16, TensorWise]``. MX scales (float8_e8m0fnu) name
    their recipe (BlockWise1x32) by their dtype."""
    if qa.global_scale is None:
        return (qa.data, qw.data.t(), qa.scales, qw.scales), {}
    return ((qa.data, qw.data.t(), [qa.scales, qa.global_scale], [qw.scales, qw.global_scale]),
            dict(scale_recipe_a=NVFP4_SCALING, scale_recipe_b=NVFP4_SCALING))


def instance_for(args, kw):
    """The kernel instance scaled_mm picks for this call on an sm_100a GPU (the call described without one)."""
    p, _ = problem.describe_scaled_mm(*args, None, torch.float32, None, False, kw.get("scale_recipe_a"),
                                      kw.get("scale_recipe_b"), None, None, args[0].device, target=("sm_100a", 148))
    return dispatch.select(p)[0]


def report_ptx(inst) -> None:
    from cutedsl_gemm.runtime.compile import compile_instance
    from cutedsl_gemm.tools.ptx_inspect import keep_artifacts

    with keep_artifacts(inst.arch):
        ptx = compile_instance(inst).__ptx__
    mode = "2-CTA 256x128" if inst.cluster_m == 2 else "1-CTA 128x128"
    print(f"  {inst.mma_kind} ({mode} tiles), compiled for {inst.arch}:")
    for pat in (r"tcgen05\.mma\S*", r"tcgen05\.cp\S*", r"cp\.async\.bulk\.tensor\S*complete_tx\S*"):
        for name in sorted(set(re.findall(pat, ptx))):
            print(f"    {ptx.count(name):2d} x {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--k", type=int, default=1024)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    a = torch.randn(args.m, args.k, generator=g).to(torch.bfloat16).to(dev)
    w = torch.randn(args.n, args.k, generator=g).to(torch.bfloat16).to(dev)
    exact = a.double() @ w.double().t()
    run = on_blackwell()
    status = 0
    instances = []

    for name, quant in RECIPES:
        qa, qw = quant(a), quant(w)
        ref = reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, global_scale_a=qa.global_scale,
                                       global_scale_b=qw.global_scale)  # float64 on the dequantized operands
        gemm, kw = gemm_args(qa, qw)
        inst = instance_for(gemm, kw)
        instances.append(inst)
        line = (f"{name:11s} {inst.mma_kind}, scales {tuple(qa.scales.shape)} {qa.scales.dtype}; "
                f"quantization error vs the bf16 GEMM {rel_error(ref, exact):.3e}")
        if run:
            out = cutedsl_gemm.scaled_mm(*gemm, out_dtype=torch.float32, **kw)
            err = rel_error(out, ref)
            status |= err > 1e-5
            line += f"; kernel vs float64 reference {err:.2e} (limit 1e-5)"
        print(line)

    if not run:
        print("\nNo sm_100 GPU here: the GEMMs are compiled for sm_100a only (not executed).")
        for inst in instances:
            report_ptx(inst)
        print(f"  ({SF_ATOM_BYTES}-byte SWIZZLE_32_4_4 scale atoms: one TMA box per operand and stage, "
              "one tcgen05.cp.32x128b.warpx4 per atom)")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())

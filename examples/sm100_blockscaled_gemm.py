"""NVFP4 and MXFP8 GEMM from bf16 inputs through the block-scaled quantizers.

    python examples/sm100_blockscaled_gemm.py [--m 512 --n 256 --k 1024]

On a CUDA GPU the quantizers run as CuTe DSL kernels; elsewhere the bit-identical torch reference runs.
The GEMM needs an sm_100 GPU (and the block-scaled mainloop, see kernels/sm100/blockscaled_gemm.py);
without one the script compiles the sm_100a quantizers and block-scaled MMA probes and prints what
their PTX contains, next to the float64 reference result and the quantization error.
"""

import argparse
import os
import re

import torch

from cutedsl_gemm import microscaling as ms
from cutedsl_gemm import sm100_blockscaled as bs
from cutedsl_gemm.reference import rel_error


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
    on_sm100 = dev == "cuda" and torch.cuda.get_device_capability()[0] == 10

    for name, quant in (("NVFP4", lambda x: bs.quantize_nvfp4(x)), ("MXFP8 e4m3", lambda x: bs.quantize_mx(x, "e4m3"))):
        qa, qw = quant(a), quant(w)
        ref = bs.mm_quantized(qa, qw, reference=True)
        line = f"{name:11s} scales {tuple(qa.scales.shape)} {qa.scales.dtype}; quantization error vs bf16 GEMM {rel_error(ref, exact):.3e}"
        if on_sm100:
            try:
                out = bs.mm_quantized(qa, qw, out_dtype=torch.float32)
                line += f"; kernel vs reference {rel_error(out, ref):.2e}"
            except NotImplementedError as e:
                line += f"; kernel: {str(e).split(':')[0]}"
        print(line)

    if not on_sm100:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
        from cutedsl_gemm.kernels.sm100.blockscaled_gemm import KINDS, compile_probe
        from cutedsl_gemm.kernels.sm100.quantize_mx import compile_quantizer

        print(f"\nno sm_100 GPU: compile and inspect for {os.environ['CUTE_DSL_ARCH']}")
        for recipe, fmt in (("nvfp4", "e2m1"), ("mx", "e4m3")):
            ptx = compile_quantizer(recipe, fmt, torch.bfloat16, recipe == "nvfp4", keep_ptx=True).__ptx__
            ops = sorted(set(re.findall(r"\b(?:ld|st)\.global[\w.]*|\bdiv\.rn\.f32|\brcp\.rn\.f32|\batom\.global[\w.]*", ptx)))
            print(f"  quantize {recipe:5s} {fmt}: {', '.join(ops)}")
        for kind in KINDS:
            ptx = compile_probe(kind).__ptx__
            print(f"  {kind:9s}: {sorted(set(re.findall(r'tcgen05[.](?:mma|cp)[^ ;]*', ptx)))}")


if __name__ == "__main__":
    main()

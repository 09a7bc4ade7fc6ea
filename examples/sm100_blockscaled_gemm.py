"""NVFP4 and MXFP8 GEMM from bf16 inputs through the block-scaled quantizers.

    python examples/sm100_blockscaled_gemm.py [--m 512 --n 256 --k 1024]

Both recipes quantize A (M, K) and W (N, K) from bf16 (CuTe DSL quantizer kernels on a CUDA GPU, the
bit-identical torch reference elsewhere) and compute ``dequant(A) @ dequant(W).T``:

* on an sm_100 GPU with the block-scaled tcgen05 GEMM, checked against the float64 reference;
* anywhere else the GEMMs are only compiled for sm_100a (nothing runs): the script prints the float64
  reference's quantization error and what each compiled kernel's PTX contains.
"""

import argparse
import os
import re
import sys
import tempfile

import torch

from cutedsl_gemm.numerics import microscaling as ms
from cutedsl_gemm import sm100_blockscaled as bs
from cutedsl_gemm.numerics.reference import rel_error

RECIPES = (("NVFP4", lambda x: bs.quantize_nvfp4(x)), ("MXFP8 e4m3", lambda x: bs.quantize_mx(x, "e4m3")))


def on_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def report_ptx(cfg) -> None:
    with tempfile.TemporaryDirectory() as d:
        ptx = bs.build(cfg, ptx_dir=d).__ptx__
    mode = "2-CTA 256x128" if cfg.use_2cta else "1-CTA 128x128"
    print(f"  {cfg.kind} ({mode} tiles), compiled for {os.environ['CUTE_DSL_ARCH']}:")
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
    configs = []

    for name, quant in RECIPES:
        qa, qw = quant(a), quant(w)
        ref = bs.mm_quantized(qa, qw, reference=True)  # float64 on the dequantized operands
        p = bs.prepare_blockscaled(qa.data, qw.data.t(), qa.scales, qw.scales, fmt_a=qa.fmt, fmt_b=qw.fmt,
                                   global_scale_a=qa.global_scale, global_scale_b=qw.global_scale)
        configs.append(p.config)
        line = (f"{name:11s} {p.config.kind}, scales {tuple(qa.scales.shape)} {qa.scales.dtype}; "
                f"quantization error vs the bf16 GEMM {rel_error(ref, exact):.3e}")
        if run:
            out = bs.mm_quantized(qa, qw, out_dtype=torch.float32)
            err = rel_error(out, ref)
            status |= err > 1e-5
            line += f"; kernel vs float64 reference {err:.2e} (limit 1e-5)"
        print(line)

    if not run:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
        print(f"\nNo sm_100 GPU here: the GEMMs are compiled for {os.environ['CUTE_DSL_ARCH']} only (not executed).")
        for cfg in configs:
            report_ptx(cfg)
        print(f"  ({ms.SF_ATOM_BYTES}-byte SWIZZLE_32_4_4 scale atoms: one TMA box per operand and stage, "
              "one tcgen05.cp.32x128b.warpx4 per atom)")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())

"""What the layout of A's 1x128 scales costs the DeepSeek recipe: one compiled kernel per shape (dispatch's pick),
timed with F.scaled_mm's M-major scales (stride (1, M): 64-row tiles may take them by TMA, the scale warp copies
16 bytes per lane) and with the same scales row-major (stride (Kb, 1): the scale warp copies 4 bytes per row),
through ``scaled_mm`` and through the direct call ``tune_tiles`` uses, interleaved with cuBLAS. Every output is
NaN-poisoned and checked against the float64 reference before timing.

    python3 -m benchmarks.a_scale_layouts [--rounds 5] [--shapes 1024x576x7168,...]
"""

from __future__ import annotations

import argparse

import torch

import cutedsl_gemm
from cutedsl_gemm.ops import scaled_mm as api
from cutedsl_gemm.numerics import reference as R

from .common import cublas_call, dispatched, make_operands
from .tune_tiles import direct_call, interleaved_times

RECIPE = "1x128_128x128"
SHAPES = "1024x576x7168,1024x512x7168,512x1536x7168,256x4096x7168,1024x1536x7168"


def _checked(call, out, ref, what):
    call()
    torch.cuda.synchronize()
    err = R.rel_error(out, ref)
    if not err < 2e-3:
        raise SystemExit(f"{what}: relative error {err:.2e} (expected < 2e-3)")
    return call


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", default=SHAPES, help="MxNxK,...")
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        qa, qw, sa, sb, plain = make_operands(m, n, k, RECIPE)
        b = qw.t()
        ref = R.reference_gemm(*plain, RECIPE)
        inst, splits, _ = dispatched(RECIPE, m, n, k, sms)
        calls, names = [cublas_call(RECIPE, qa, b, sa, sb)], ["cuBLAS"]
        for label, scales in (("M-major", sa), ("row-major", sa.contiguous())):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            ours = lambda s=scales, o=out: cutedsl_gemm.scaled_mm(qa, b, s, sb, out_dtype=torch.bfloat16, out=o)
            calls.append(_checked(ours, out, ref, f"scaled_mm {label} {shape}"))
            _, sa_k, sb_k = scale_layouts.resolve(scales, sb, m, n, k)
            out_d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            direct, _, _ = direct_call(inst, qa, b, sa_k, sb_k, out_d, (m, n, k), splits)
            calls.append(_checked(direct, out_d, ref, f"direct {label} {shape}"))
            names += [f"scaled_mm {label}", f"direct {label}"]
        times = interleaved_times(calls, args.rounds)
        print(f"M={m} N={n} K={k}: {inst.tile_m}x{inst.tile_n} c{inst.cluster_m}x{inst.cluster_n}, {splits} split(s)")
        for name, (t, spread) in zip(names, times):
            print(f"   {name:20s} {t:7.1f} us{spread}")


if __name__ == "__main__":
    main()

"""Decode GEMMs back to back, as a model runs them layer after layer: L GEMMs with distinct weights (so
nothing stays in L2), timed as one sequence after the L2 is emptied; the figure is the time per GEMM.

Isolated calls (bench_gemm) pay each kernel's launch latency and pipeline ramp in full; in a sequence the
decode kernels' programmatic dependent launch lets each one start while the previous one finishes. The
same kernels built without it, and cuBLAS (torch._scaled_mm), run the same sequence.

    python -m benchmarks.bench_decode_chain --ms 1,16,64,128 --nk 8192x8192 --layers 8 --recipes row,tensor
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import KernelInstance
from . import common
from .common import HBM_TBPS, bench, make_operands


class _NoPdl(KernelInstance):
    """The same decode kernel built without programmatic dependent launch (for the comparison)."""

    def sm90_config(self):
        return dataclasses.replace(super().sm90_config(), pdl=False)


def _without_pdl(inst: KernelInstance) -> KernelInstance:
    fields = {f.name: getattr(inst, f.name) for f in dataclasses.fields(inst)}
    fields["schedule"] = inst.schedule + "_nopdl"  # its own JIT cache entry
    return _NoPdl(**fields)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,16,64,128")
    p.add_argument("--nk", default="8192x8192")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--recipes", default="row,tensor")
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'recipe':7s} {'M':>4s} {'N':>6s} {'K':>6s} | per GEMM us: ours (PDL) | ours, no PDL | cuBLAS | "
          f"GB/s ours | x cuBLAS   ({args.layers} GEMMs per sequence, distinct weights)")
    for recipe in args.recipes.split(","):
        for nk in args.nk.split(","):
            n, k = map(int, nk.split("x"))
            for m in map(int, args.ms.split(",")):
                layers = [make_operands(m, n, k, recipe) for _ in range(args.layers)]
                qa = layers[0][0]
                outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in layers]

                def ours():
                    for (_, qw, sa, sb, _), out in zip(layers, outs):
                        cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out)

                def theirs():
                    for (_, qw, sa, sb, _), out in zip(layers, outs):
                        torch._scaled_mm(qa, qw.t(), sa, sb, out_dtype=torch.bfloat16)

                # the instance scaled_mm dispatches to (it passes K too)
                inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms, k=k)
                plain = _without_pdl(inst)
                clusters = launch.launch_clusters(0, plain)
                splits = dispatch.choose_splits(plain, m, n, k, clusters * plain.cluster_m * plain.cluster_n)
                views = [scale_layouts.resolve(sa, sb, m, n, k)[1:] for (_, _, sa, sb, _) in layers]
                plain_calls = [launch.bind(plain, qa, qw.t(), sa_k, sb_k, out, splits=splits)
                               for (_, qw, _, _, _), (sa_k, sb_k), out in zip(layers, views, outs)]

                def ours_nopdl():
                    for call in plain_calls:
                        call()

                t_pdl, t_plain, t_cub = (bench(f) * 1e3 / args.layers for f in (ours, ours_nopdl, theirs))
                gbs = (n * k + m * k + 2 * m * n) / t_pdl / 1e3
                print(f"{recipe:7s} {m:4d} {n:6d} {k:6d} | {t_pdl:24.1f} | {t_plain:12.1f} | {t_cub:6.1f} | "
                      f"{gbs:6.0f} ({100 * gbs / (HBM_TBPS * 1e3):.0f}%) | {t_cub / t_pdl:5.2f}")


if __name__ == "__main__":
    main()

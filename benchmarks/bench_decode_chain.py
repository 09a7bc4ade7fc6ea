"""Decode GEMMs back to back, as a model runs them layer after layer: L GEMMs with distinct weights (so
nothing stays in L2), timed as one sequence after the L2 is emptied; the figure is the time per GEMM.

Isolated calls (bench_gemm) pay each kernel's launch latency and pipeline ramp in full; in a sequence the
decode kernels' programmatic dependent launch lets each one start while the previous one finishes. The
same kernels built without it, and cuBLAS (torch._scaled_mm), run the same sequence.

    python -m benchmarks.bench_decode_chain --ms 1,16,64,128 --nk 8192x8192 --layers 8 --recipes row,tensor

The table goes to benchmarks/results/decode_chain.json (``--name``, ``--no-save``: common.write_result).
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
from cutedsl_gemm.tools.anchors import make_operands

from . import common
from .common import HBM_TBPS, bench


class _NoPdl(KernelInstance):
    """The same decode kernel built without programmatic dependent launch (for the comparison)."""

    def sm90_config(self):
        return dataclasses.replace(super().sm90_config(), pdl=False)


def _without_pdl(inst: KernelInstance) -> KernelInstance:
    fields = {f.name: getattr(inst, f.name) for f in dataclasses.fields(inst)}
    fields["schedule"] = inst.schedule + "_nopdl"  # its own JIT cache entry
    return _NoPdl(**fields)


def chain_one(recipe, m, n, k, layers, sms):
    """Time per GEMM (us) of one sequence of ``layers`` GEMMs: ours (PDL), the same kernels without PDL, cuBLAS."""
    operands = [make_operands(m, n, k, recipe) for _ in range(layers)]
    qa = operands[0][0]
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in operands]

    def ours():
        for (_, qw, sa, sb, _), out in zip(operands, outs):
            cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out)

    def theirs():
        for _, qw, sa, sb, _ in operands:
            torch._scaled_mm(qa, qw.t(), sa, sb, out_dtype=torch.bfloat16)

    # the instance scaled_mm dispatches to (it passes K too)
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms, k=k)
    plain = _without_pdl(inst)
    clusters = launch.launch_clusters(0, plain)
    splits = dispatch.choose_splits(plain, m, n, k, clusters * plain.cluster_m * plain.cluster_n)
    views = [scale_layouts.resolve(sa, sb, m, n, k)[1:] for (_, _, sa, sb, _) in operands]
    plain_calls = [launch.bind(plain, qa, qw.t(), sa_k, sb_k, out, splits=splits)
                   for (_, qw, _, _, _), (sa_k, sb_k), out in zip(operands, views, outs)]

    def ours_nopdl():
        for call in plain_calls:
            call()

    return tuple(bench(f) * 1e3 / layers for f in (ours, ours_nopdl, theirs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,16,64,128")
    p.add_argument("--nk", default="8192x8192")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--recipes", default="row,tensor")
    common.add_result_options(p, "decode_chain")
    args = p.parse_args(argv)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'recipe':7s} {'M':>4s} {'N':>6s} {'K':>6s} | per GEMM us: ours (PDL) | ours, no PDL | cuBLAS | "
          f"GB/s ours | x cuBLAS   ({args.layers} GEMMs per sequence, distinct weights)")
    for recipe in args.recipes.split(","):
        for nk in args.nk.split(","):
            n, k = map(int, nk.split("x"))
            for m in map(int, args.ms.split(",")):
                t_pdl, t_plain, t_cub = chain_one(recipe, m, n, k, args.layers, sms)
                gbs = (n * k + m * k + 2 * m * n) / t_pdl / 1e3
                print(f"{recipe:7s} {m:4d} {n:6d} {k:6d} | {t_pdl:24.1f} | {t_plain:12.1f} | {t_cub:6.1f} | "
                      f"{gbs:6.0f} ({common.pct_of_hbm(gbs):.0f}%) | {t_cub / t_pdl:5.2f}")
                rows.append([recipe, m, n, k, round(t_pdl, 2), round(t_plain, 2), round(t_cub, 2),
                             round(t_cub / t_pdl, 3), round(gbs), round(common.pct_of_hbm(gbs), 1)])
    columns = ["recipe", "M", "N", "K", "ours us", "ours without PDL us", "cuBLAS us", "ratio", "GB/s",
               f"% of {HBM_TBPS:g} TB/s"]
    common.save_result(args, "decode_chain", f"Decode GEMMs back to back ({args.layers} per sequence), time per GEMM",
                       columns, rows, notes=f"{common.timing_notes()}, once per sequence of {args.layers} GEMMs with "
                       "distinct weights; cuBLAS timed in the same run; ratio = cuBLAS us / ours us")


if __name__ == "__main__":
    main()

"""Decode-chain timings of kernel options dispatch does not choose today, against its own pick, in the same run:

* ``--what splits``: every swapped decode tile of the pick's token width (128- and 64-row) at 1..4 K splits. At
  M <= 64 the 4096-wide layers run on 32-96 of the SMs (``dispatch.choose_splits`` halves the slots for swapped
  tiles), and the 1.7 waves of 128x16 tiles on 28672 x 4096 leave a partial wave; splitting K spreads both.
* ``--what pdl``: where dispatch picks an unswapped (cooperative) tile (M = 33-128), the same kernel built with
  programmatic dependent launch (``instances.kernel_variant(row, pdl=True)``), which the swapped decode tiles have.

    python -m benchmarks.bench_decode_options --what splits --ms 1,4,16,64
    python -m benchmarks.bench_decode_options --what pdl --ms 48,64,96,128

Each cell is the time per GEMM of a sequence of ``--layers`` GEMMs with distinct weights (``bench_decode_chain``'s
method: the L2 emptied before each sequence), and its fraction of the floor (``bench_sweep.floor_us`` at the
measured floor, benchmarks.measure_floor). Shapes: the sweep's
layers of >= 16 MB (``bench_sweep.LAYERS``) and Llama-3-8B's unfused k/v (1024 x 4096) and gate/up (14336 x 4096)
projections, as transformers runs them. Results go to benchmarks/results/decode_options_<what>.json.
"""

from __future__ import annotations

import argparse

import torch

from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import INSTANCES, kernel_variant
from cutedsl_gemm.tools.baselines import make_operands

from . import bench_sweep, common
from .bench_model import positive_ints
from .common import bench

#: Llama-3-8B's projections that transformers runs unfused: k / v (1024 x 4096), gate / up (14336 x 4096)
UNFUSED = ((1024, 4096), (14336, 4096))
MIN_WEIGHT_BYTES = 16 << 20
SPLITS = (1, 2, 3, 4)
COLUMNS = {
    "splits": ["recipe", "M", "N", "K", "floor us", "pick", "pick us", "tile / splits", "us", "of floor", "x pick"],
    "pdl": ["recipe", "M", "N", "K", "floor us", "pick", "us", "with PDL us", "x without", "of floor with PDL"],
}


def shapes():
    """(N, K) of the sweep's layers of >= 16 MB and the unfused Llama-3-8B projections."""
    out = [(n, k) for _, n, k in bench_sweep.LAYERS if n * k >= MIN_WEIGHT_BYTES]
    return out + [nk for nk in UNFUSED if nk not in out]


def swapped_rows(pick, recipe, m):
    """The table's swapped decode rows a split option is timed on: the pick's token width (or, for an unswapped pick,
    the width M needs), its accumulation, 1x1 clusters, e4m3 into bf16, no bias."""
    tn = pick.tile_n if pick.swap_ab else (16 if m <= 16 else 32 if m <= 32 else 64)
    return [i for i in INSTANCES if i.op == "gemm" and i.schedule == "small_m" and i.swap_ab and i.recipe == recipe
            and (i.a_dtype, i.b_dtype, i.out_dtype, i.bias_dtype) == ("e4m3", "e4m3", "bf16", None)
            and i.accum == pick.accum and i.tile_n == tn and i.cluster_m == 1 and i.cluster_n == 1]


class Chain:
    """``layers`` GEMMs of one shape with distinct weights on one activation, launched by instance and split."""

    def __init__(self, recipe, m, n, k, layers):
        self.m, self.n, self.k = m, n, k
        self.operands = [make_operands(m, n, k, recipe) for _ in range(layers)]
        self.qa = self.operands[0][0]
        self.outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in self.operands]
        self.views = [scale_layouts.resolve(sa, sb, m, n, k)[1:] for (_, _, sa, sb, _) in self.operands]

    def time(self, inst, splits) -> float:
        """us per GEMM of the sequence run by ``inst`` with ``splits`` K splits."""
        calls = [launch.bind(inst, self.qa, qw.t(), sa, sb, out, splits=splits)
                 for (_, qw, _, _, _), (sa, sb), out in zip(self.operands, self.views, self.outs)]

        def run():
            for call in calls:
                call()

        return bench(run) * 1e3 / len(calls)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=tuple(COLUMNS), required=True)
    p.add_argument("--ms", type=positive_ints, default=None, help="rows M (default: 1,4,16,64 for splits, "
                   "48,64,96,128 for pdl)")
    p.add_argument("--recipes", default="row", help="default: row")
    p.add_argument("--layers", type=int, default=8)
    common.add_result_options(p)
    args = p.parse_args(argv)
    common.require_gpu("bench_decode_options")
    floors = common.measured_floors()
    ms = args.ms or ([1, 4, 16, 64] if args.what == "splits" else [48, 64, 96, 128])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for recipe in args.recipes.split(","):
        for n, k in shapes():
            for m in ms:
                pick = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms, k=k)
                if args.what == "pdl" and pick.swap_ab:
                    continue  # (the swapped decode tiles have PDL already)
                slots = launch.launch_clusters(0, pick) * pick.cluster_m * pick.cluster_n
                inst, splits = dispatch.plan_splits(pick, m, n, k, slots)
                chain = Chain(recipe, m, n, k, args.layers)
                floor = bench_sweep.floor_us(m, n, k, floors.fp8_tflops, floors.hbm_tbps)[0]
                t_pick = chain.time(inst, splits)
                label = f"{inst.tile_m}x{inst.tile_n}{'s' if inst.swap_ab else ''}/{splits}"
                if args.what == "pdl":
                    t = chain.time(kernel_variant(inst, pdl=True), splits)
                    rows.append([recipe, m, n, k, round(floor, 2), label, round(t_pick, 2), round(t, 2),
                                 round(t_pick / t, 3), round(floor / t, 3)])
                    print(" ".join(map(str, rows[-1])), flush=True)
                    continue
                for row in swapped_rows(pick, recipe, m):
                    for s in SPLITS:
                        t = chain.time(row, s)
                        rows.append([recipe, m, n, k, round(floor, 2), label, round(t_pick, 2),
                                     f"{row.tile_m}x{row.tile_n}/{s}", round(t, 2), round(floor / t, 3),
                                     round(t_pick / t, 3)])
                        print(" ".join(map(str, rows[-1])), flush=True)
    common.save_result(args, f"decode_options_{args.what}", f"Decode options ({args.what}) against dispatch's pick, "
                       f"{args.layers} GEMMs per sequence", COLUMNS[args.what], rows,
                       notes=f"{common.timing_notes()}, once per sequence of {args.layers} GEMMs with distinct "
                       f"weights; floor: weights, activations and output at {floors.hbm}, or the MMAs at "
                       f"{floors.fp8}, whichever is longer")
    return rows


if __name__ == "__main__":
    main()

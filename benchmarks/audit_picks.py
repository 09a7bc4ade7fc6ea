"""Dispatch's pick against the best tile measured, from ``benchmarks.tune_tiles`` output (no GPU needed).

    python -m benchmarks.tune_tiles --splits 0 --ms 1024,6144 --nk ... --tiles <every candidate> > round1.txt
    python -m benchmarks.audit_picks round1.txt round2.txt [--sms 132]

For each shape and recipe: cuBLAS, the tile ``dispatch.select_gemm`` picks (with its last-wave split variant
where ``dispatch.last_wave_splits`` would use it), the best tile measured and the runners-up, each the fastest
of its runs over all files; then the geomean of cuBLAS / ours with dispatch's picks and with the best tile per
shape. A pick that tune_tiles did not time prints as nan: add its tile to ``--tiles``.
"""

from __future__ import annotations

import argparse
import math
import re
from collections import defaultdict

from cutedsl_gemm.selection import dispatch

from .tune_tiles import tile_label

_SHAPE = re.compile(r"(\S+) M=(\d+) N=(\d+) K=(\d+): cuBLAS ([\d.na]+) us")
_TIMING = re.compile(r"\s+tune\S*\s+(t\S+ c\S+)\s+(promoted|fast)\s+split\s+\d+\s+([\d.]+) us")


def parse(paths):
    """({(recipe, accum, M, N, K): {tile key: [us, ...]}}, {(recipe, M, N, K): [cuBLAS us, ...]}) from
    tune_tiles output files."""
    runs, cublas = defaultdict(lambda: defaultdict(list)), defaultdict(list)
    for path in paths:
        shape = None
        for line in open(path):
            if got := _SHAPE.search(line):
                shape = (got[1], int(got[2]), int(got[3]), int(got[4]))
                cublas[shape].append(float(got[5]))
            elif (got := _TIMING.match(line)) and shape:
                runs[shape[:1] + (got[2],) + shape[1:]][got[1]].append(float(got[3]))
    return runs, cublas


def dispatch_key(recipe, accum, m, n, k, sms):
    """The instance scaled_mm would launch (its last-wave split variant where it would use one), labelled as
    tune_tiles prints it."""
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, accum=accum, n=n, sms=sms, k=k)
    size = inst.cluster_m * inst.cluster_n
    inst, _ = dispatch.plan_splits(inst, m, n, k, dispatch.cluster_slots(sms, size) * size * inst.ctas_per_sm)
    return tile_label(inst)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="tune_tiles output (several runs: each tile's fastest counts)")
    p.add_argument("--sms", type=int, default=132, help="SMs dispatch plans for (H100 and H200 SXM: 132)")
    args = p.parse_args(argv)
    runs, cublas_runs = parse(args.files)
    ratios = defaultdict(lambda: ([], []))
    for (recipe, accum, m, n, k), tiles in runs.items():
        cublas = min(cublas_runs[(recipe, m, n, k)])
        best = {t: min(v) for t, v in tiles.items()}
        pick = dispatch_key(recipe, accum, m, n, k, args.sms)
        ranked = sorted(best, key=best.get)
        t_pick = best.get(pick, math.nan)
        print(f"{recipe:14s} {accum:8s} M={m:5d} N={n:5d} K={k:5d} cuBLAS {cublas:7.1f} | pick {pick:20s} "
              f"{t_pick:7.1f} x{cublas / t_pick:4.2f} | best {ranked[0]:20s} {best[ranked[0]]:7.1f} "
              f"x{cublas / best[ranked[0]]:4.2f} | " + "  ".join(f"{t} {best[t]:.1f}" for t in ranked[1:4]))
        ratios[(recipe, accum)][0].append(cublas / t_pick)
        ratios[(recipe, accum)][1].append(cublas / best[ranked[0]])
    def geo(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    for (recipe, accum), (picks, bests) in ratios.items():
        print(f"geomean cuBLAS / ours, {recipe} {accum}: dispatch's picks {geo(picks):.3f}, best tile per shape "
              f"{geo(bests):.3f} ({len(picks)} shapes)")


if __name__ == "__main__":
    main()

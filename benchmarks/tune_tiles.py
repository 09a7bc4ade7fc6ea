"""Tile/cluster sweep on a Hopper GPU: candidate configurations (not necessarily in the instance table) on the
same data, next to cuBLAS for the same recipe. The instance table's rows are chosen from what this prints.

    python -m benchmarks.tune_tiles --ms 1,16,64,128 --nk 8192x8192          (decode: GB/s matters)
    python -m benchmarks.tune_tiles --ms 8192 --nk 8192x8192 --tiles 128x128c2x1,128x192c2x1 --accums promoted
    python -m benchmarks.tune_tiles --ms 16 --tiles 128x16c1x1s,128x16c1x1sk256 --splits 0,1,2,4

A tile spec is TMxTN c CMxCN, then optional ``s`` (swap A and W: tile_m runs over N), ``k256`` (K depth
per stage), ``st<stages>``, ``o2`` (two CTAs per SM, 64-row tiles), ``lw`` (the last-wave split variant;
with ``--splits 0`` it splits as dispatch would) and ``e<n>`` (n epilogue output buffers; default: as many
as fit beside the stages). ``--splits``: K splits to force (0 = the dispatch heuristic). ``--rounds R`` times
cuBLAS and every candidate R times, interleaved, and prints medians with their spread: on an H100 the same
kernel's time moves by 5-20% between and within calls at 8192^3 (clock at the power cap), more than most
tile differences. ``benchmarks.audit_picks`` compares dispatch's picks with what this prints.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics

import torch

from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import KernelInstance
from cutedsl_gemm.tools.baselines import cublas_call, make_operands

from . import common
from .common import bench

DEFAULT_TILES = "128x64c1x1,128x64c1x2,128x64c2x1,128x128c1x1,128x128c1x2,128x128c2x1"


class _NoSplit(KernelInstance):
    """A candidate compiled without the split-K reduction (to measure what carrying it costs)."""

    @property
    def can_split_k(self):
        return False


def candidates(recipe, tiles, accums, split_variants=(True,)):
    accs = [a for a in accums if a == "promoted" or "x128" not in recipe]
    for tile, accum, split in itertools.product(tiles, accs, split_variants):
        got = re.fullmatch(r"(\d+)x(\d+)c(\d+)x(\d+)(s?)(?:k(\d+))?(?:st(\d+))?(?:o(\d))?(lw)?(?:e(\d+))?", tile)
        if not got:
            raise SystemExit(f"bad tile spec {tile!r} (expected e.g. 128x128c2x1 or 128x16c1x1sk256st10 or "
                             "64x128c1x2o2)")
        tile_m, tile_n, cm, cn = map(int, got.groups()[:4])
        swap, tile_k, stages = bool(got[5]), int(got[6] or 128), int(got[7] or 0)
        per_sm, tail = int(got[8] or 1), bool(got[9])
        epi = int(got[10] or 0)
        if tile_k != 128 and "x128" in recipe:
            continue
        cls = KernelInstance if split else _NoSplit
        yield cls("sm_90a", "gemm", "tune" if split else "tune_nosplit", recipe, "e4m3", "e4m3", "bf16", None,
                  tile_m, tile_n, cm, cn, stages, accum, swap_ab=swap, tile_k=tile_k, ctas_per_sm=per_sm,
                  split_tail=tail, epi_stages=epi)


def tile_label(inst) -> str:
    """How this sweep prints an instance's tile (benchmarks.audit_picks reads it back): t<M>x<N>[s]k<K>
    c<M>x<N>[st<n>][o2][lw][e<n>]. The stage count shows where it is fixed (the DeepSeek recipe's 128x192 row
    has 4): without it that row and a default-staged 128x192 candidate printed alike."""
    return (f"t{inst.tile_m}x{inst.tile_n}{'s' if inst.swap_ab else ''}k{inst.tile_k} "
            f"c{inst.cluster_m}x{inst.cluster_n}"
            f"{f'st{inst.stages}' if inst.stages else ''}"
            f"{'o2' if inst.ctas_per_sm > 1 else ''}{'lw' if inst.split_tail else ''}"
            f"{f'e{inst.epi_stages}' if inst.epi_stages else ''}")


def direct_call(inst, qa, b, sa_k, sb_k, out, mnk, want_splits, bias=None):
    """A call of ``inst``'s compiled kernel that bypasses dispatch, on this device's cluster limit, with
    ``want_splits`` K splits (0: what dispatch would choose; 1 where the instance has no split-K):
    (call, splits, max clusters). ``sa_k``/``sb_k`` are the kernel's scale views."""
    m, n, k = mnk
    clusters = launch.launch_clusters(0, inst)
    slots = clusters * inst.cluster_m * inst.cluster_n  # CTAs resident at once, as scaled_mm counts them
    splits = dispatch.splits_for(inst, m, n, k, slots, want_splits)
    return launch.bind(inst, qa, b, sa_k, sb_k, out, splits=splits, bias=bias), splits, clusters


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,16,64,128")
    p.add_argument("--nk", default="8192x8192", help="NxK,... or 'sweep': bench_sweep's 13 layers")
    p.add_argument("--recipes", default="row,1x128_128x128")
    p.add_argument("--tiles", default=DEFAULT_TILES, help="TMxTNcCMxCN,...")
    p.add_argument("--accums", default="promoted,fast")
    p.add_argument("--split-variants", action="store_true", help="also build each candidate without split-K")
    p.add_argument("--splits", default="1", help="K splits to run each candidate with; 0 = dispatch.choose_splits")
    p.add_argument("--floor", action="store_true", help="also time a read-only pass over W (the bandwidth floor)")
    p.add_argument("--flush", default=common.FLUSH, choices=("read", "zero"),
                   help="L2 eviction before each run (common.bench)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds per shape (medians printed)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    common.require_gpu("tune_tiles")
    common.FLUSH = args.flush
    if args.nk == "sweep":
        from .bench_sweep import LAYERS  # (bench_sweep imports this module)

        nks = [(n, k) for _, n, k in LAYERS]
    else:
        nks = [tuple(map(int, nk.split("x"))) for nk in args.nk.split(",")]
    for recipe in args.recipes.split(","):
        for n, k in nks:
            for m in map(int, args.ms.split(",")):
                sweep_shape(args, recipe, m, n, k)


def sweep_shape(args, recipe, m, n, k):
    """Every candidate of ``args`` on one shape, next to cuBLAS, printed in the format audit_picks reads."""
    qa, qw, sa, sb, plain = make_operands(m, n, k, recipe)
    b = qw.t()
    _, sa_k, sb_k = scale_layouts.resolve(sa, sb, m, n, k)
    ref = R.reference_gemm(*plain, recipe)
    bytes_moved = m * k + n * k + m * n * 2
    cublas = cublas_call(recipe, qa, b, sa, sb)
    try:
        cublas()
    except (RuntimeError, ValueError):  # e.g. cuBLAS blockwise refuses M=1
        cublas = None
    variants = (True, False) if args.split_variants else (True,)
    runs = []  # (instance, splits, call, error), each compiled and checked before any timing
    for inst, want in itertools.product(
            candidates(recipe, args.tiles.split(","), args.accums.split(","), variants),
            map(int, args.splits.split(","))):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        call, splits, _ = direct_call(inst, qa, b, sa_k, sb_k, out, (m, n, k), want)
        call()
        runs.append((inst, splits, call, R.rel_error(out, ref)))
    times = interleaved_times([cublas] + [r[2] for r in runs], args.rounds)
    t_c = times[0][0]

    def tflops(t):
        return 2 * m * n * k / t / 1e6

    print(f"{recipe} M={m} N={n} K={k}: cuBLAS {t_c:.1f} us{times[0][1]} ({bytes_moved / t_c / 1e3:.0f} GB/s, "
          f"{tflops(t_c):.0f} TFLOPS)")
    if args.floor:
        words = qw.view(torch.int32)
        t_f = bench(lambda: torch.amax(words)) * 1e3
        print(f"   read-only amax over W: {t_f:.1f} us ({qw.numel() / t_f / 1e3:.0f} GB/s)")
    for (inst, splits, _, err), (t, spread) in zip(runs, times[1:]):
        gbs = bytes_moved / t / 1e3
        shape = tile_label(inst)
        print(f"   {inst.schedule:13s} {shape:20s} {inst.accum:8s} split {splits:2d} {t:7.1f} us{spread} "
              f"{gbs:6.0f} GB/s {common.pct_of_hbm(gbs):5.1f}% {tflops(t):6.0f} TFLOPS x{t_c / t:5.2f} err {err:.1e}")


def interleaved_times(calls, rounds):
    """(median us, printed spread) per call (None: not timed, nan): ``rounds`` rounds, each timing every call
    once in order, so drift in the clock spreads over all of them instead of favouring the ones timed first."""
    samples = [[] for _ in calls]
    for _ in range(rounds):
        for got, call in zip(samples, calls):
            got.append(bench(call) * 1e3 if call is not None else float("nan"))
    out = []
    for got in samples:
        spread = f" [{min(got):.1f}-{max(got):.1f}]" if rounds > 1 and got[0] == got[0] else ""
        out.append((statistics.median(got), spread))
    return out


if __name__ == "__main__":
    main()

"""Choosing a kernel instance for a call: reads the one manifest (``generators/manifest.py``)."""

from __future__ import annotations

import functools
from dataclasses import replace

from cutedsl_gemm.runtime.launch import launch_clusters
from cutedsl_gemm.selection.instances import INSTANCES, KernelInstance
from cutedsl_gemm.kernels.sm90.block_scales import BLOCK_RECIPES, is_block_scaled


class NoKernelError(ValueError):
    pass


@functools.lru_cache(maxsize=None)
def _candidates(arch, op, recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum, schedule):
    rows = [
        i
        for i in INSTANCES
        if (i.arch, i.op, i.recipe, i.a_dtype, i.b_dtype, i.out_dtype, i.bias_dtype, i.accum)
        == (arch, op, recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum)
        and (schedule is None or i.schedule == schedule)
        and not i.split_tail  # picked per call instead: last_wave_variant
    ]
    return tuple(rows)


# Relative MMA throughput (per mille of the 128x192 tile's) of each unswapped promoted tile shape, measured
# over several waves on the H100 (benchmarks/tune_tiles, per-tensor, K = 2048 and 7168; BENCHMARKS.md, tile
# rates of sessions 5 and 6): smaller tiles move more bytes per MMA, and one consumer warp group (64-row
# tiles) cannot hide its own promotion behind the other's MMAs. Swapped (decode) tiles are memory-bound:
# waves decide, rate 1000. 128x144 keeps 920 though session 10 gave it the overlapped promotion: over large
# outputs it then sustains 0.94-1.04 of 128x192 (median 0.97), but at 970 dispatch sent it shapes it loses
# (M=1408 N=4608 K=4096 58.5 us against 50.0 for the 64x192 pair, M=1664 N=6144 86.4 vs 75.7 for 128x192,
# N=8192 K=1024 5-6% behind 128x128) more often than ones it wins (BENCHMARKS.md, session 10).
TILE_RATES = {(128, 192): 1000, (128, 144): 920, (128, 128): 980, (128, 96): 870, (64, 128): 630, (64, 96): 570,
              (64, 64): 500}
# The same over fast-accumulation tiles (no promotion; 128x256 fits): M=6144 with N=1536 / 3072 / 4608 / 7168,
# 4096x8192x8192 and 8192^3, per mille of 128x192 fast (BENCHMARKS.md, session 7). 64-row tiles gain nothing
# from skipping the promotion: they are bound by their own bytes per MMA.
FAST_TILE_RATES = {(128, 256): 1030, (128, 192): 1000, (128, 144): 955, (128, 128): 965, (128, 96): 855,
                   (64, 128): 620, (64, 96): 570, (64, 64): 510}
# Tiles of two CTAs per SM, swapped or not (per CTA: each has about half an SM). 64x192 c2x1: 8192^3 1008 us
# against 794.6 for 128x192 c2x1 in the same run, i.e. 21 waves x 64x192 / 1.27 (21 waves x 128x192).
PAIRED_TILE_RATES = {(64, 192): 400}


# Block-scaled recipes (all three: the same main loop), per mille of their own 128x128 c2x1 over several
# waves, DeepSeek recipe on the 18 DeepSeek-V3 shapes (benchmarks/tune_tiles, BENCHMARKS.md session 11).
# Scaling each K tile as it is promoted costs the 192-wide tiles more than the 128-wide ones -- they retire
# every K tile before issuing the next -- so here 128x128 leads where waves allow: M=6144 N=7168 K=2304
# 196.7 us against 204.7 for 128x192, N=3072 K=1536 59.6 vs 62.6. 128x192 measured 952-985 (median 973);
# 985 keeps 8192^3 on it (1013-1036 us against 1045-1066 for 128x128, whose 32nd wave holds 2 clusters).
BLOCK_TILE_RATES = {(128, 128): 1000, (128, 192): 985, (64, 128): 730}
# Recipes with per-block W scales (DeepSeek, 2D) read the 192-wide tile's scales a K tile ahead (session 15,
# 3-4%), which lifts that tile to par with 128x128 (session 16 re-sweep of the 20 DeepSeek-V3 / square shapes:
# the two tiles' per-area rates 0.95-1.01 apart, dispatch's picks best or within 2%) and past the 64x192 pair
# at short K under a wave: M=1024 N=3072 K=1536 14.3 us against 15.3 (DeepSeek), M=3072 31.0 vs 33.3-33.8,
# M=768 14.4 vs 14.7-15.3; 2D alike. 1x128 x 1x128 (per-column W scales, no read-ahead) keeps 985: there
# 128x192 loses at M=3072 (40.1-40.7 vs 37.0-37.4) and ties under it (BENCHMARKS.md, session 16).
BLOCK_W_TILE_RATES = {**BLOCK_TILE_RATES, (128, 192): 1000}
# From K = 6144 (48 K tiles) the 192-wide tile of those recipes (the DeepSeek recipe's split in N since session
# 19) is ahead of 128x128 where wave_cost ties the two -- 192 x 2 waves = 128 x 3 waves, common on LLM shapes,
# where the table order gave 128x128: on 12 such shapes at K >= 7168, DeepSeek recipe, 128x192 ran 1-9% faster on
# all but one (M=512 N=10240 K=8192: 1% slower), e.g. M=3072 N=8192 K=8192 331-345 us against 357-360,
# 6144x8192x8192 689-696 against 749-757 (128x128 with its last-wave split). At K = 4096 the ties went both ways
# (M=6144 N=6144: 128x192 4-7% slower, 4-5% faster in a later call; M=1024 / 2048, N=6144: 1-2% faster), at
# K = 1536-2304 to 128x128 or even. Through scaled_mm the benchmarks' block_ties set ran 3.3% faster (geomean;
# the 2D recipe flat; BENCHMARKS.md, session 20). 1001 decides those ties and no more.
LONG_K = 6144
BLOCK_W_LONG_K_TILE_RATES = {**BLOCK_W_TILE_RATES, (128, 192): 1001}
# The DeepSeek recipe takes those ties at every K since producer warp 1 stages the block scales (session 24, which
# sped its 192-wide tile up more than 128x128): on 12 tie and near-tie shapes at K = 1536-4096 (M = 3072 / 6144)
# 128x192 ran 0-8% faster in both rounds but one (M=6144 N=6144 K=4096: 244 / 259 us against 255 / 257); through
# scaled_mm the dsv3 set's three tie shapes ran 2-4% faster, the set 42.9 / 42.7 -> 42.6 / 42.5 us (BENCHMARKS.md,
# session 25). The 2D recipe was not re-measured and keeps the long-K switch.
DEEPSEEK_TILE_RATES = BLOCK_W_LONG_K_TILE_RATES
BLOCK_PAIRED_TILE_RATES = {(64, 192): 440}


# A 4x1 cluster multicasts each W tile to four CTAs: 20 KB per CTA per 128x128 K tile from L2 instead of 24.
# Measured per wave of resident clusters against 2x1 (128x128, per-tensor): M=6144 N=576 +12%, 6144x4096x4096
# +5%, 1024x7168x2048 +2% (128x192: 8192^3 +2%, M=6144 N=4608 +4%); the gain applies to the rate, the
# 4-CTA clusters' fewer slots (``cluster_slots``) to the waves (BENCHMARKS.md, session 10).
CLUSTER_4X1_RATE_GAIN = 1050


def tile_rate(inst: KernelInstance, k: int = 0) -> int:
    """Per mille throughput of ``inst``'s tile for ``wave_cost`` (by recipe family, accumulation and, for the
    2D recipe, whether K >= ``LONG_K``; 1000 where not measured, and for the memory-bound swapped decode
    tiles)."""
    block = is_block_scaled(inst.recipe)
    if inst.ctas_per_sm > 1:
        return (BLOCK_PAIRED_TILE_RATES if block else PAIRED_TILE_RATES)[(inst.tile_m, inst.tile_n)]
    if inst.swap_ab:
        return 1000
    if block:
        if BLOCK_RECIPES[inst.recipe][1] != "block":
            rates = BLOCK_TILE_RATES
        elif inst.recipe == "1x128_128x128":
            rates = DEEPSEEK_TILE_RATES
        else:
            rates = BLOCK_W_LONG_K_TILE_RATES if k >= LONG_K else BLOCK_W_TILE_RATES
    else:
        rates = FAST_TILE_RATES if inst.accum == "fast" else TILE_RATES
    rate = rates.get((inst.tile_m, inst.tile_n), 1000)
    if (inst.cluster_m, inst.cluster_n) == (4, 1):
        rate = rate * CLUSTER_4X1_RATE_GAIN // 1000
    return rate


def cluster_slots(sms: int, cluster_size: int) -> int:
    """Clusters of ``cluster_size`` CTAs (one per SM) resident at once on ``sms`` SMs. A cluster cannot span
    GPCs, so clusters of more than two leave SMs over in each GPC: the H100 SXM's 132 SMs hold 66 clusters
    of 2 but 30 of 4, not 33 (``cudaOccupancyMaxActiveClusters``). Beyond 2 this is that measured fraction
    (10/11 of SMs / size); the launch itself queries the driver (``api._max_active_clusters``). The C
    registry's ``cutedsl_gemm_find`` and its default grid apply the same rule."""
    if cluster_size <= 2:
        return max(1, sms // cluster_size)
    return max(1, sms // cluster_size * 10 // 11)


# A single-CTA tile's epilogue (scale, convert, store) leaves the tensor cores idle for roughly one to two
# 128-deep K blocks' MMAs (in thousandths of a K block); two CTAs per SM hide it behind each other's main
# loops. It decides short-K problems: M=6144, N=7168, K=256 per-tensor, 64x192 pairs 38.4 us against 44.0
# for 128x192 (the same waves: E ~ 0.9 K blocks); N=4096, K=512 33.6 vs 36.0 (E ~ 1.4); and from K=1536
# the 128-row tiles win again (51.5 vs 57.3 us; BENCHMARKS.md, session 9).
EPILOGUE_MILLI_K_BLOCKS = 1500


def wave_cost(inst: KernelInstance, m: int, n: int, sms: int, k: int = 0) -> int:
    """Relative time of an M x N (x K) problem on ``inst``'s tiles: waves of cluster tiles over the GPU's
    cluster slots, times the tile's area over its throughput (``tile_rate``), times the tile's 128-deep K
    blocks plus the epilogue's share (``EPILOGUE_MILLI_K_BLOCKS``, hidden with two CTAs per SM; K = 0:
    left out).
    Wave quantisation decides between tile widths: at M=6144, N=512 the 128x192 tiles make 72 cluster
    tiles, two waves on 66 slots (the second nearly empty), where 128x128 tiles make 96 in two waves of
    two-thirds the work each (48.5 vs 62.0 us); where outputs fill under a wave, smaller tiles put more SMs
    to work (M=1024, N=512, K=7168: 128 64x64 tiles 15.5 us, 24 128x192 tiles in 5 K splits 22.0 us)."""
    slots = cluster_slots(sms, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm
    cost = -(-inst.cluster_tiles(m, n) // slots) * inst.tile_m * inst.tile_n * 1000 // tile_rate(inst, k)
    if k > 0:
        cost *= 1000 * -(-k // 128) + (0 if inst.ctas_per_sm > 1 else EPILOGUE_MILLI_K_BLOCKS)
    return cost


def select_gemm(
    arch: str,
    recipe: str,
    a_dtype: str,
    b_dtype: str,
    out_dtype: str,
    bias_dtype,
    m: int,
    accum: str = "promoted",
    schedule: str = None,
    n: int = 0,
    sms: int = 0,
    k: int = 0,
) -> KernelInstance:
    """The instance for a GEMM call: of the manifest rows whose M range holds ``m``, the one of least
    ``wave_cost`` for an N-wide (K-deep; 0: unknown) output on ``sms`` SMs, the first in table order on
    ties (or when ``n`` or ``sms`` is 0). The C registry's ``cutedsl_gemm_find`` applies the same rule.

    ``schedule`` forces a schedule (e.g. "small_m") whatever M is: its row for ``m`` if it has one, else
    its row for the largest M it covers (every instance computes any M; the ranges are for speed).
    """
    rows = _candidates(arch, "gemm", recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum, schedule)
    holding = [i for i in rows if i.m_min <= m <= i.m_max]
    if holding:
        if n > 0 and sms > 0:
            return min(holding, key=lambda i: wave_cost(i, m, n, sms, k))  # min keeps the first of equals
        return holding[0]
    if schedule is not None and rows:
        return max(rows, key=lambda i: i.m_max)
    raise NoKernelError(
        f"no kernel instance in the manifest for arch={arch} recipe={recipe} A={a_dtype} B={b_dtype} "
 f"out={out_dtype} bias={bias_dtype} accum={accum} M={m}" + (f" schedule={schedule}" if schedule else "")
    )


MAX_SPLITS = 16
MIN_K_TILES_PER_SPLIT = 2  # a split shorter than this spends more on its reduction than it saves


def normalize_splits(splits: int, k_tiles: int) -> int:
    """The split count the kernel will actually use: splits of ceil(k_tiles / splits) K tiles, none empty."""
    splits = max(1, min(splits, k_tiles))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per)


def choose_splits(inst: KernelInstance, m: int, n: int, k: int, slots: int) -> int:
    """Split-K heuristic (the documented dispatch table, see README): split K only to fill SMs that would
    otherwise idle, within one wave --

        splits = min(slots // tiles, 16, k_tiles // 2), at least 1      (slots // (2 * tiles) when swapped)

    where ``tiles`` is the number of output tiles, ``slots`` the CTAs that can be resident at once (SMs,
    rounded down to whole clusters) and ``k_tiles = ceil(K / 128)``. Splitting further (several waves of
    split units) measured slower on the H100: the last split's read-back of the partials sits on the
    tile's critical path (M=1024, N=1536, K=7168 at 128x128 tiles: 47 us with 4 splits, 31 us with none).

    On 132 SMs: M <= 128 (128x128 tiles), N = K = 8192 -> 2; N = 8192, K = 28672 -> 2; N = 10240 -> 1;
    M = 1024, N = 1536, K = 7168 (128x192 tiles) -> 2; M = 1024, N = 576 -> 5. Instances built without
    the reduction (``can_split_k`` False) always get 1.

    The swapped decode kernels split only below half a wave of tiles: streaming W from 64 SMs already
    beats splitting it over 128 plus the reduction (N = K = 8192, M = 16, 128x16 tiles: 29.5 us unsplit,
    32.1 us with 2 splits). On 132 SMs: N = 8192 or 10240 -> 1; N = 4096 -> 2; N = 576, K = 7168 -> 12.
    """
    if not inst.can_split_k:
        return 1
    tiles = inst.output_tiles(m, n)
    if inst.swap_ab:
        slots //= 2
    k_tiles = inst.k_tiles(k)
    splits = max(1, min(slots // tiles, MAX_SPLITS, k_tiles // MIN_K_TILES_PER_SPLIT))
    return normalize_splits(splits, k_tiles)


# Splitting the last, partial wave of a larger problem saves (1 - 1/splits) of a tile's time and costs a
# reduction whose time measured nearly fixed, 7-10 us on the H100 (tune_tiles, 128x192 tiles, BENCHMARKS.md):
# worth it only for long K. M=6144, N=512, K=7168: 65.2 us whole, 56.3 / 52.5 / 53.2 / 52.4 / 54.9 us with
# 2 / 3 / 4 / 6 / 10 last-wave splits; M=1024, N=4608, K=7168: 65.4 -> 58.8 us (2); but M=1024, N=7168,
# K=2048: 35.3 -> 37.4 us (2), 4096^3: 118.0 -> 115.1 us (2), 117.9 us (3).
MIN_K_TILES_FOR_LAST_WAVE_SPLIT = 48
MAX_LAST_WAVE_SPLITS = 4
# ... and only a few waves deep: the split variant runs its whole tiles 1-4% slower than the plain kernel at many
# waves, more than the one partial wave it shortens is worth there (session 22, tune_tiles, two rounds, us, whole
# -> split): per-tensor 128x192 c2x1 768x14336x7168 (3.4 waves) 126.6-127.3 -> 121.4-122.3, 4096x7168x7168 (9.2)
# 335.5-338.4 -> 330.8-337.2, 8192x7168x7168 (18.4) 678.0-685.1 -> 699.6-727.2; DeepSeek 128x128 c2x1
# 1024x7168x7168 (3.4) 93.7-93.9 -> 91.7-92.0, 4096x10240x7168 (19.4) 518.6-520.1 -> 541.0-541.4, 8192x7168x7168
# (27) 748.3-753.8 -> 774.0-791.9 (session 20 alike at 17-23 waves).
MAX_WAVES_FOR_LAST_WAVE_SPLIT = 4


def last_wave_splits(inst: KernelInstance, m: int, n: int, k: int, slots: int) -> int:
    """K splits for the last, partial wave of a problem larger than one wave (1: run it whole). With R
    cluster tiles in that wave: min(cluster slots // R, 4), when K has >= 48 K tiles, the problem is at most
    4 waves deep and the instance has a last-wave split variant. M=6144, N=512, K=7168 at 128x192 c2x1: 72
    cluster tiles on 66 slots, the last 6 in 4 splits."""
    if inst.swap_ab or not inst.can_split_k or inst.output_tiles(m, n) <= slots:
        return 1
    cslots = max(1, slots // (inst.cluster_m * inst.cluster_n))
    ctiles = inst.cluster_tiles(m, n)
    if ctiles > MAX_WAVES_FOR_LAST_WAVE_SPLIT * cslots:
        return 1
    tail = ctiles % cslots
    k_tiles = inst.k_tiles(k)
    if tail == 0 or k_tiles < MIN_K_TILES_FOR_LAST_WAVE_SPLIT or last_wave_variant(inst) is None:
        return 1
    return normalize_splits(max(1, min(cslots // tail, MAX_LAST_WAVE_SPLITS)), k_tiles)


def plan_splits(inst: KernelInstance, m: int, n: int, k: int, slots: int):
    """(instance, K splits) a call runs with when it names no split: ``choose_splits``, or where that gives 1,
    the last-wave split variant with ``last_wave_splits`` splits if it pays. ``slots``: CTAs resident at once.
    ``scaled_mm`` and the benchmarks that replay its choice (raster_groups, audit_picks) all call this."""
    splits = choose_splits(inst, m, n, k, slots)
    if splits == 1 and (tail := last_wave_splits(inst, m, n, k, slots)) > 1:
        return last_wave_variant(inst), tail  # same tiles and clusters
    return inst, splits


@functools.lru_cache(maxsize=None)
def last_wave_variant(inst: KernelInstance):
    """The manifest's last-wave split sibling of ``inst`` (same everything, ``split_tail``), or None."""
    want = replace(inst, split_tail=True)
    return next((i for i in INSTANCES if i == want), None)


def splits_for(inst: KernelInstance, m: int, n: int, k: int, slots: int, want: int = 0) -> int:
    """K splits of a call of ``inst`` that bypasses ``plan_splits`` (tests, benchmarks): ``want`` normalized to
    the K tiles, or with ``want`` 0 what dispatch would choose (the last-wave split of a ``split_tail``
    instance's unsplit sibling); 1 where the instance has no split-K reduction. ``slots``: CTAs resident at once."""
    if not inst.can_split_k:
        return 1
    if want:
        return normalize_splits(want, inst.k_tiles(k))
    if inst.split_tail:
        return last_wave_splits(replace(inst, split_tail=False), m, n, k, slots)
    return choose_splits(inst, m, n, k, slots)


def select(problem):
    """(instance, K splits) for a described call (``problem.GemmProblem``): ``select_gemm``, then the split the
    call forces or ``plan_splits``' choice over the CTAs resident at once on its GPU."""
    inst = select_gemm(problem.arch, problem.recipe, problem.a_format, problem.b_format, problem.out_name,
                       problem.bias_name, problem.m, problem.accum, problem.schedule, n=problem.n, sms=problem.sms,
                       k=problem.k)
    if problem.split_k is not None:
        if not inst.can_split_k:
            raise ValueError(f"split_k: {inst.name} is built without the split-K reduction (use_fast_accum=False "
                             "or schedule='small_m' select instances that have it)")
        return inst, normalize_splits(problem.split_k, inst.k_tiles(problem.k))
    clusters = launch_clusters(problem.device_index, inst)
    # A wave is as many CTAs as can be resident at once; a last-wave split variant keeps the tiles and clusters.
    return plan_splits(inst, problem.m, problem.n, problem.k, clusters * inst.cluster_m * inst.cluster_n)

"""Choosing a kernel instance for a call: reads the one instance table (``selection/instances.py``)."""

from __future__ import annotations

import functools
from dataclasses import replace

from cutedsl_gemm.kernels.sm90.scale_recipes import BLOCK_RECIPES, is_block_scaled
from cutedsl_gemm.runtime.device import launch_clusters
from cutedsl_gemm.selection.instances import (
    GEMM_FP8_OUT,
    QUANT_GEMM,
    WEIGHT_ONLY,
    KernelInstance,
    operand_dtypes,
    table,
)


class NoKernelError(ValueError):
    pass


@functools.lru_cache(maxsize=None)
def _candidates(arch, op, recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum, schedule):
    rows = [
        i
        for i in table()
        if (i.arch, i.op, i.recipe, i.a_dtype, i.b_dtype, i.out_dtype, i.bias_dtype, i.accum)
        == (arch, op, recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum)
        and (schedule is None or i.schedule == schedule)
        and not i.split_tail  # picked per call instead: last_wave_variant
    ]
    return tuple(rows)


@functools.lru_cache(maxsize=None)
def _weight_only_rows(arch, recipe, act_dtype, weight_dtype):
    return tuple(i for i in table() if (i.arch, i.op, i.recipe, i.a_dtype, i.b_dtype) ==
                 (arch, WEIGHT_ONLY, recipe, act_dtype, weight_dtype))


# Sustained MMA throughput of each unswapped promoted tile, per mille of 128x192's: smaller tiles move more bytes
# per MMA, and a 64-row tile's one consumer warp group cannot hide its own promotion. How these are measured, and
# why 128x144 stays at 920: docs/design.md, "The tile rates".
TILE_RATES = {(128, 192): 1000, (128, 144): 920, (128, 128): 980, (128, 96): 870, (64, 128): 630, (64, 96): 570,
              (64, 64): 500}
# The same for fast accumulation (no promotion; 128x256 fits). 64-row tiles gain nothing: bytes per MMA bind them.
FAST_TILE_RATES = {(128, 256): 1030, (128, 192): 1000, (128, 144): 955, (128, 128): 965, (128, 96): 855,
                   (64, 128): 620, (64, 96): 570, (64, 64): 510}
# Tiles of two CTAs per SM, swapped or not, per CTA (each has about half an SM).
PAIRED_TILE_RATES = {(64, 192): 400}


# Block-scaled recipes, per mille of their own 128x128 c2x1: scaling each K tile while promoting it costs the
# 192-wide tiles (which retire every K tile before issuing the next) more than the 128-wide ones.
BLOCK_TILE_RATES = {(128, 128): 1000, (128, 192): 985, (64, 128): 730}
# Recipes with per-block W scales read the 192-wide tile's scales a K tile ahead, which lifts it to par.
BLOCK_W_TILE_RATES = {**BLOCK_TILE_RATES, (128, 192): 1000}
# From K = 6144 the 192-wide tile wins the wave_cost ties with 128x128 (two waves against three); 1001 decides
# those ties and no more.
LONG_K = 6144
BLOCK_W_LONG_K_TILE_RATES = {**BLOCK_W_TILE_RATES, (128, 192): 1001}
# The DeepSeek recipe (its split-N loop, with the scale warp) takes those ties at every K.
DEEPSEEK_TILE_RATES = BLOCK_W_LONG_K_TILE_RATES
BLOCK_PAIRED_TILE_RATES = {(64, 192): 440}


# Decode tiles (``is_decode_tile``), per mille of 128x192's MMA rate: their area per ns over outputs many waves
# deep (M = 128, N = 57344, K = 8192), every recipe. Narrow token tiles run narrow WGMMAs (N = 16, 32), and
# 128x64 runs below 64x64 (docs/design.md, "The tile rates").
DECODE_TILE_RATES = {(128, 16): 210, (64, 16): 190, (128, 32): 330, (128, 64): 440, (64, 64): 500}
# 64x64 runs the unswapped 64x64's WGMMAs, at its rate (ties go to the decode row, which launches early behind the
# previous kernel); with fast accumulation too.
FAST_DECODE_TILE_RATES = {**DECODE_TILE_RATES, (64, 64): FAST_TILE_RATES[(64, 64)]}
# The block-scaled 64x64 decode tile scales every K block in its one warp group: 14-26% slower than 64x128 at
# M = 128 on the large layers.
BLOCK_DECODE_TILE_RATES = {**DECODE_TILE_RATES, (64, 64): 350}
# Decode tiles whose rates are estimated from their neighbours' rather than measured: ``wave_cost`` charges them
# ``ESTIMATED_RATE_MARGIN`` per mille, so that a measured tile within the model's error keeps the shape.
ESTIMATED_DECODE_TILE_RATES = {(64, 32): 300, (128, 128): 550}
ESTIMATED_RATE_MARGIN = 1150


# A 4x1 cluster multicasts each W tile to four CTAs (fewer L2 bytes per MMA): the gain goes into the rate, the
# 4-CTA clusters' fewer slots (``cluster_slots``) into the waves.
CLUSTER_4X1_RATE_GAIN = 1050


def is_decode_tile(inst: KernelInstance) -> bool:
    """Swapped with one CTA per SM: the decode tiles (the swapped two-per-SM pair is rated as a pair)."""
    return inst.swap_ab and inst.ctas_per_sm == 1


def has_estimated_rate(inst: KernelInstance) -> bool:
    """A decode tile whose rate is ``ESTIMATED_DECODE_TILE_RATES``'s."""
    return is_decode_tile(inst) and (inst.tile_m, inst.tile_n) in ESTIMATED_DECODE_TILE_RATES


def tile_rate(inst: KernelInstance, k: int = 0) -> int:
    """Per mille throughput of ``inst``'s tile for ``wave_cost`` (by recipe family, accumulation and, for the
    2D recipe, whether K >= ``LONG_K``; 1000 for an unswapped tile not measured)."""
    block = is_block_scaled(inst.recipe)
    if inst.ctas_per_sm > 1:
        return (BLOCK_PAIRED_TILE_RATES if block else PAIRED_TILE_RATES)[(inst.tile_m, inst.tile_n)]
    if is_decode_tile(inst):
        if has_estimated_rate(inst):
            return ESTIMATED_DECODE_TILE_RATES[(inst.tile_m, inst.tile_n)]
        rates = (BLOCK_DECODE_TILE_RATES if block else FAST_DECODE_TILE_RATES if inst.accum == "fast"
                 else DECODE_TILE_RATES)
        return rates[(inst.tile_m, inst.tile_n)]
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
    GPCs, so clusters of more than two leave SMs over: the H100's 132 SMs hold 66 clusters of 2 but 30 of 4
    (``cudaOccupancyMaxActiveClusters``), so beyond two this takes 10/11 of SMs / size. The launch itself asks
    the driver (``runtime.device.max_active_clusters``); the C registry's ``cutedsl_gemm_find`` uses this rule."""
    if cluster_size <= 2:
        return max(1, sms // cluster_size)
    return max(1, sms // cluster_size * 10 // 11)


# A single-CTA tile's epilogue (scale, convert, store) leaves the tensor cores idle for about 1.5 128-deep K
# blocks (in thousandths of a K block); two CTAs per SM hide it behind each other's main loops. It decides short K.
EPILOGUE_MILLI_K_BLOCKS = 1500


def mma_cost(inst: KernelInstance, k: int = 0) -> int:
    """Relative time of one of ``inst``'s tiles in its tensor cores: area over ``tile_rate``, times the 128-deep
    K blocks plus the epilogue's share (``EPILOGUE_MILLI_K_BLOCKS``, hidden with two CTAs per SM); K = 0: per K
    block, without the epilogue."""
    cost = inst.tile_m * inst.tile_n * 1000 // tile_rate(inst, k)
    if k > 0:
        cost *= 1000 * -(-k // 128) + (0 if inst.ctas_per_sm > 1 else EPILOGUE_MILLI_K_BLOCKS)
    return cost


# A byte streamed at an SM's share of the HBM bandwidth (3.0 TB/s over an H100's 132 SMs: 44 ps a byte) costs what
# 1.7 units of tile area cost in a K block at rate 1000 (128x192 retires 38.6 a ns per SM); in thousandths.
STREAM_MILLI_AREA_PER_BYTE = 1700
# While fewer tiles than slots run, each SM streams up to this many times its share: 66 of 132 SMs already read
# at the full rate (M = 32, N = K = 8192: 64 tiles of 128x32 29.1 us, 128 of 64x64 29.4).
STREAM_SHARE_CAP = 2


def stream_cost(inst: KernelInstance, m: int, n: int, sms: int, k: int = 0) -> int:
    """Relative time, in ``mma_cost``'s units, one of ``inst``'s CTAs needs to stream its share of the problem's
    HBM reads -- A and W once (K = 0: one K block of them) -- over the output tiles, at its SM's share of the
    bandwidth (``STREAM_MILLI_AREA_PER_BYTE``; ``ctas_per_sm`` CTAs share an SM), up to ``STREAM_SHARE_CAP``
    times that while the tiles fill under a wave. Tiles that reread a W tile another tile holds read it from L2:
    only the unique bytes count. The output's stores are the epilogue's, in ``mma_cost``."""
    total = (m + n) * (k if k > 0 else 128)
    slots = cluster_slots(sms, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm
    running = min(inst.cluster_tiles(m, n), slots)
    share = total * STREAM_MILLI_AREA_PER_BYTE * inst.ctas_per_sm // inst.output_tiles(m, n)
    cost = share * running // min(STREAM_SHARE_CAP * running, slots)
    return cost if k > 0 else cost // 1000


# A tile bound by its MMAs hides its loads behind them; one bound by the weight stream still pays this share of
# its MMAs (per mille), which decides between tiles that stream the same bytes (docs/design.md, 3.2).
UNHIDDEN_MILLI = 125


def wave_cost(inst: KernelInstance, m: int, n: int, sms: int, k: int = 0) -> int:
    """Relative time of an M x N (x K) problem on ``inst``'s tiles: waves of cluster tiles over the GPU's
    cluster slots, times a tile's time -- its MMAs (``mma_cost``), or where longer its share of the HBM reads
    (``stream_cost``) plus ``UNHIDDEN_MILLI`` of its MMAs -- charged ``ESTIMATED_RATE_MARGIN`` for a tile whose
    rate is estimated. Large outputs are bound by MMAs, where wave quantisation decides between tile
    widths; decode and mid-M outputs by the weight stream, where the tiles that keep the most SMs streaming
    win. The model and the figures behind it: docs/design.md, "The wave-cost model"."""
    slots = cluster_slots(sms, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm
    mma, stream = mma_cost(inst, k), stream_cost(inst, m, n, sms, k)
    cost = -(-inst.cluster_tiles(m, n) // slots) * max(mma, stream + mma * UNHIDDEN_MILLI // 1000)
    return cost * ESTIMATED_RATE_MARGIN // 1000 if has_estimated_rate(inst) else cost


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
    op: str = "gemm",
) -> KernelInstance:
    """The instance for a GEMM call (``op`` "gemm", or QUANT_GEMM with ``a_dtype`` the activations' unquantized
    dtype): of the table's rows whose M range holds ``m``, the one of least
    ``wave_cost`` for an N-wide (K-deep; 0: unknown) output on ``sms`` SMs, the first in table order on
    ties (or when ``n`` or ``sms`` is 0). The C registry's ``cutedsl_gemm_find`` applies the same rule.

    ``schedule`` forces a schedule (e.g. "small_m") whatever M is: its row for ``m`` if it has one, else
    its row for the largest M it covers (every instance computes any M; the ranges are for speed).
    """
    rows = _candidates(arch, op, recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum, schedule)
    holding = [i for i in rows if i.m_min <= m <= i.m_max]
    if holding:
        if n > 0 and sms > 0 and len(holding) > 1:
            return min(holding, key=lambda i: wave_cost(i, m, n, sms, k))  # min keeps the first of equals
        return holding[0]
    if schedule is not None and rows:
        return max(rows, key=lambda i: i.m_max)
    raise NoKernelError(
        f"no kernel instance in the table for arch={arch} recipe={recipe} A={a_dtype} B={b_dtype} "
 f"out={out_dtype} bias={bias_dtype} accum={accum} M={m}" + (f" schedule={schedule}" if schedule else "")
    )


MAX_SPLITS = 16
MIN_K_TILES_PER_SPLIT = 2  # a split shorter than this spends more on its reduction than it saves
# From this many K tiles a swapped decode tile splits K to fill a whole wave, not half of one: the reduction is
# short against each split's weight stream (H200, decode chains: N = 4096, K = 14336 (112 K tiles) on 64 x 16 tiles
# at M = 1..64, 2 splits 1.10-1.12x one; at K = 8192 (64) 1.01x, at K = 7168 and shorter nothing or a loss).
SWAPPED_FULL_WAVE_K_TILES = 96


def normalize_splits(splits: int, k_tiles: int) -> int:
    """The split count the kernel will actually use: splits of ceil(k_tiles / splits) K tiles, none empty."""
    splits = max(1, min(splits, k_tiles))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per)


def choose_splits(inst: KernelInstance, m: int, n: int, k: int, slots: int) -> int:
    """Split-K heuristic (the documented dispatch table, see README): split K only to fill SMs that would
    otherwise idle, within one wave --

        splits = min(slots // tiles, 16, k_tiles // 2), at least 1
                 (slots // (2 * tiles) when swapped and k_tiles < SWAPPED_FULL_WAVE_K_TILES)

    where ``tiles`` is the number of output tiles, ``slots`` the CTAs that can be resident at once (SMs,
    rounded down to whole clusters) and ``k_tiles = ceil(K / 128)``: past one wave the last split's read-back
    of the partials sits on the tile's critical path. The swapped decode kernels split only below half a wave
    at short K (streaming W from half the SMs already beats the reduction) and to a whole wave at long K.
    Instances built without the reduction (``can_split_k`` False) always get 1. Measurements: docs/design.md,
    "Split-K and last-wave splits".
    """
    if not inst.can_split_k:
        return 1
    tiles = inst.output_tiles(m, n)
    k_tiles = inst.k_tiles(k)
    if inst.swap_ab and k_tiles < SWAPPED_FULL_WAVE_K_TILES:
        slots //= 2
    splits = max(1, min(slots // tiles, MAX_SPLITS, k_tiles // MIN_K_TILES_PER_SPLIT))
    return normalize_splits(splits, k_tiles)


# Splitting the last, partial wave saves (1 - 1/splits) of a tile's time and costs a reduction of nearly fixed
# time: worth it only for long K.
MIN_K_TILES_FOR_LAST_WAVE_SPLIT = 48
MAX_LAST_WAVE_SPLITS = 4
# ... and only a few waves deep: the split variant runs its whole tiles a little slower than the plain kernel,
# more than the one partial wave it shortens is worth at many waves.
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
    ``scaled_mm`` and the benchmarks that replay its choice call this."""
    splits = choose_splits(inst, m, n, k, slots)
    if splits == 1 and (tail := last_wave_splits(inst, m, n, k, slots)) > 1:
        return last_wave_variant(inst), tail  # same tiles and clusters
    return inst, splits


@functools.lru_cache(maxsize=None)
def last_wave_variant(inst: KernelInstance):
    """The table's last-wave split sibling of ``inst`` (same everything, ``split_tail``), or None."""
    want = replace(inst, split_tail=True)
    return next((i for i in table() if i == want), None)


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


def has_quantizing_rows(problem) -> bool:
    """Whether the table has a QUANT_GEMM row for a described call with unquantized activations
    (``problem.act_format``): its M, recipe and dtypes."""
    rows = _candidates(problem.arch, QUANT_GEMM, problem.recipe, problem.act_format, problem.b_format,
                       problem.out_name, problem.bias_name, problem.accum, None)
    return any(i.m_min <= problem.m <= i.m_max for i in rows)


def select(problem):
    """(instance, K splits) for a described call (``problem.GemmProblem``): ``select_gemm`` over the instances
    that run its operand formats (the QUANT_GEMM rows of its activations' dtype when it brings them unquantized),
    then the split the call forces or ``plan_splits``' choice over the CTAs resident at once on its GPU."""
    if problem.act_format is not None:
        op, (a_dtype, b_dtype) = QUANT_GEMM, (problem.act_format, problem.b_format)
    else:
        op, (a_dtype, b_dtype) = "gemm", operand_dtypes(problem.arch, problem.recipe, problem.a_format,
                                                        problem.b_format)
    inst = select_gemm(problem.arch, problem.recipe, a_dtype, b_dtype, problem.out_name, problem.bias_name,
                       problem.m, problem.accum, problem.schedule, n=problem.n, sms=problem.sms, k=problem.k, op=op)
    if problem.split_k is not None:
        if not inst.can_split_k:
            raise ValueError(f"split_k: {inst.name} is built without the split-K reduction (on Hopper, "
                             "use_fast_accum=False or schedule='small_m' select instances that have it)")
        return inst, normalize_splits(problem.split_k, inst.k_tiles(problem.k))
    if not inst.can_split_k:
        return inst, 1
    clusters = launch_clusters(problem.device_index, inst)
    # A wave is as many CTAs as can be resident at once; a last-wave split variant keeps the tiles and clusters.
    return plan_splits(inst, problem.m, problem.n, problem.k, clusters * inst.cluster_m * inst.cluster_n)


@functools.lru_cache(maxsize=None)
def fp8_out_twin(inst: KernelInstance):
    """The table's GEMM_FP8_OUT row of ``inst``'s fields (its tile, clusters and main loop, with the epilogue that
    emits FP8 in 1x128 groups), or None."""
    want = replace(inst, op=GEMM_FP8_OUT)
    return next((i for i in table() if i == want), None)


def select_fp8_out(problem):
    """(instance, K splits) that run a described ``scaled_mm_fp8_out`` call (``problem``: its bf16 ``scaled_mm``) in
    one kernel, or None. It is the FP8-output twin of what ``select`` picks for the bf16 call, with the same K splits:
    the same main loop, reduction and rounding to bf16 give the bf16 values ``scaled_mm`` would write, which the
    epilogue quantizes with ``quantize_fp8``'s code -- so ``scaled_mm_fp8_out`` equals ``quantize_fp8(scaled_mm(...),
    "1x128")`` bit for bit by construction. Picks without a twin (decode tiles, 192-wide tiles) give None: the call
    then runs the two kernels."""
    inst, splits = select(problem)
    twin = fp8_out_twin(inst)
    return None if twin is None else (twin, splits)


def select_weight_only(problem):
    """(instance, K splits) for a described weight-only call (``problem.WeightOnlyProblem``): the first weight-only
    row (op ``WEIGHT_ONLY``) of the table for its recipe, activation and weight formats whose M range holds M, and
    the split the call forces or ``min(SMs // output tiles, 16, K tiles // 2)`` (at least 1): the weight stream is
    memory-bound and wants every SM pulling bytes, so K splits until the work units fill one wave."""
    rows = _weight_only_rows(problem.arch, problem.recipe, problem.act_name, problem.weight_format)
    inst = next((i for i in rows if i.m_min <= problem.m <= i.m_max), None)
    if inst is None:
        raise NoKernelError(f"no weight-only kernel instance for arch={problem.arch} recipe={problem.recipe} "
                            f"activations={problem.act_name} weights={problem.weight_format} M={problem.m}")
    k_tiles = inst.k_tiles(problem.k)
    if problem.split_k is not None:
        return inst, normalize_splits(problem.split_k, k_tiles)
    slots = launch_clusters(problem.device_index, inst)
    splits = max(1, min(slots // inst.output_tiles(problem.m, problem.n), MAX_SPLITS, k_tiles // MIN_K_TILES_PER_SPLIT))
    return inst, normalize_splits(splits, k_tiles)

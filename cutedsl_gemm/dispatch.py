"""Choosing a kernel instance for a call: reads the one manifest (``generators/manifest.py``)."""

from __future__ import annotations

import functools

from cutedsl_gemm.generators.manifest import INSTANCES, KernelInstance


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
    ]
    return tuple(rows)


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
) -> KernelInstance:
    """The instance for a GEMM call: the first manifest row whose M range holds ``m``.

    ``schedule`` forces a schedule (e.g. "small_m") whatever M is; otherwise the M ranges of the table decide.
    """
    rows = _candidates(arch, "gemm", recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum, schedule)
    for inst in rows:
        if schedule is not None or inst.m_min <= m <= inst.m_max:  # a forced schedule serves every M
            return inst
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


# One partial tile read back in the reduction costs about as much as streaming this many K tiles of W
# (a 128x128 fp32 partial is 64 KiB from L2; a K tile of W is 16 KiB from HBM).
PARTIAL_COST_K_TILES = 2


def choose_splits(inst: KernelInstance, m: int, n: int, k: int, sms: int) -> int:
    """Split-K heuristic for the small-M instances (the documented dispatch table, see README):

    * not a small_m instance, or at least as many output tiles as SMs: 1 (no split);
    * otherwise the s <= 16 (with >= 2 K tiles per split) minimising the modelled time
      ``waves(tiles * s) * ceil(k_tiles / s) + (s - 1) * PARTIAL_COST_K_TILES`` -- whole waves of SMs, each
      streaming its K share, plus the last split reading the others' partials; ties go to the smaller s.

    On 132 SMs with 128x128 tiles and M <= 128: N = K = 8192 -> 2; N = 10240, K = 8192 -> 3;
    N = 8192, K = 28672 -> 2; N = 57344 -> 1.
    """
    if inst.schedule != "small_m":
        return 1
    tiles = -(-m // inst.tile_m) * -(-n // inst.tile_n)
    k_tiles = -(-k // 128)
    if tiles >= sms:
        return 1
    cost = lambda s: -(-tiles * s // sms) * -(-k_tiles // s) + (s - 1) * PARTIAL_COST_K_TILES
    candidates = range(1, max(1, min(MAX_SPLITS, k_tiles // MIN_K_TILES_PER_SPLIT)) + 1)
    return normalize_splits(min(candidates, key=lambda s: (cost(s), s)), k_tiles)

"""The row-wise recipe's epilogue scales, staged in shared memory ahead of the epilogue (``producer_roles.
RowScaleProducer``).

Read from global memory in the epilogue, a tile's per-row A scales and per-column W scales stand between the end of
its main loop and its first multiply: an L2 round trip and, on a 192-wide tile, 48 column and 2 row loads per
thread, on every tile's critical path (at K 256-512, where the main loop is short, 10-20% of the kernel). Warp 1 of
the producer warp group instead walks the consumers' work units and, per unit, loads the tile's ``tile_m`` row
scales and ``tile_n`` column scales into one shared-memory slot guarded by a full / empty mbarrier pair (in the
kernel struct's alignment padding: ``unit_scale_bytes``): it issues the next unit's loads as soon as it has handed
over the last ones, and stores them once the consumers have released the slot (after scaling their tile), so they
land during the next main loop. One slot suffices: a whole main loop lies between a release and the next unit's
epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

SCALE_WARP_LANES = 32  # warp 1's lanes, which arrive on the slot's full barrier


# The kernel's shared-memory struct is 1 KiB-aligned, its stages too: the mainloop's mbarriers (at most 8 stages x
# 16 bytes) sit alone in the first KiB, and the few words after the epilogue's buffers (two 1-element scale
# placeholders and the split-K flag, 16-byte aligned) in the last one. The slot's barriers and rows (<= 512 bytes)
# fit beside the former; its columns follow the latter.
TAIL_WORDS_BYTES = 48
STRUCT_ALIGN = 1024


def unit_scale_bytes(tile_n: int) -> int:
    """What the slot adds to the kernel's shared memory: nothing, unless its columns overflow the struct's last KiB
    (then one more)."""
    tail = TAIL_WORDS_BYTES + tile_n * 4
    return (-(-tail // STRUCT_ALIGN) - 1) * STRUCT_ALIGN


@dataclass(frozen=True)
class UnitScales:
    """The slot in shared memory (frozen: the DSL lets it into run-time loops without carrying it)."""

    rows: cute.Tensor  # (tile_m,): the unit's row scales (kernel rows past M hold row M - 1's)
    cols: cute.Tensor  # (tile_n,): its column scales (past N: column N - 1's)
    full: object  # mbarrier: warp 1's lanes arrive once the slot holds a unit's scales
    empty: object  # mbarrier: every consumer thread arrives once it has scaled the unit's tile


def make_unit_scales(rows: cute.Tensor, cols: cute.Tensor, barriers) -> UnitScales:
    """``UnitScales`` over the kernel struct's fields (its rows, its columns, its two mbarriers)."""
    return UnitScales(rows, cols, barriers, barriers + 1)


def init_unit_scale_barriers(barriers, consumer_threads: int):
    """(One thread, before the pipelines' init fence.)"""
    cute.arch.mbarrier_init(barriers, SCALE_WARP_LANES)
    cute.arch.mbarrier_init(barriers + 1, consumer_threads)


@cute.jit
def hand_over_unit_scales(slot: UnitScales, rows: cute.Tensor, cols: cute.Tensor, handed, lane):
    """(Warp 1, once per unit, in schedule order.) Once the consumers have released the slot (``handed``: the
    units handed over before), store this lane's loaded row and column scales (``rows`` / ``cols``: lane ``lane``
    of each 32 in turn) into it and mark it full."""
    lanes = SCALE_WARP_LANES
    bN = cute.size(slot.cols)
    cute.arch.mbarrier_wait(slot.empty, (handed % 2) ^ 1)
    for i in cutlass.range_constexpr(cute.size(rows)):
        slot.rows[i * lanes + lane] = rows[i]
    for i in cutlass.range_constexpr(cute.size(cols)):
        if cutlass.const_expr((i + 1) * lanes <= bN):
            slot.cols[i * lanes + lane] = cols[i]
        elif i * lanes + lane < bN:  # (the 16-column tail of an 80- or 144-wide tile)
            slot.cols[i * lanes + lane] = cols[i]
    cute.arch.mbarrier_arrive(slot.full)


@cute.jit
def wait_unit_scales(slot: UnitScales, units_done):
    """(Consumers, once per unit, in schedule order.) Wait until the slot holds the unit's scales."""
    cute.arch.mbarrier_wait(slot.full, units_done % 2)


def release_unit_scales(slot: UnitScales):
    """(Every consumer thread, after its last read of the unit's scales.)"""
    cute.arch.mbarrier_arrive(slot.empty)

"""The row-wise recipe's unit scales staged in shared memory for the grouped GEMM's 128-row tiles
(``grouped_gemm.py``, ``Sm90GroupedGemmConfig.early_row_scales``): the walk of warp 1 of the producer warp group
that fills the slot, and the consumers' reads of it. The slot and its barriers are the dense kernel's
(``unit_scales.py``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .unit_scales import (
    SCALE_WARP_LANES,
    UnitScales,
    hand_over_unit_scales,
    init_unit_scale_barriers,
    release_unit_scales,
    wait_unit_scales,
)


class StagedRowScales:
    """The row-wise recipe's 128-row tiles with each unit's scales staged in shared memory by warp 1 of the producer
    warp group while the unit's main loop runs (``early_row_scales``), as the dense kernel's row-wise epilogue
    reads them (``unit_scales.py``): read from global memory after the main loop they put an L2 round trip (four,
    chunked, on the 128x192 tile) between its last MMA and its first store, with the tensor cores idle. Warp 1 walks
    the consumers' units with the same cursor, loads the unit's ``tile_m`` row scales (clamped into its group's
    rows) and ``tile_n`` column scales (into N) into registers, and stores them into the slot once the consumers
    have released the previous unit's; a full / empty mbarrier pair guards the slot. A mixin, before the tile's
    kernel class (``Sm90GroupedFp8GemmStagedRowScales``, ``Sm90GroupedFp8GemmSerialStagedRowScales``).

    | warp role | threads | registers | work |
    |---|---|---|---|
    | TMA producer | warp 0 of warp group 0 | 40 | as ``Sm90GroupedFp8Gemm`` |
    | scale stager | warp 1 of warp group 0 | 40 | per unit: its row and column scales into the slot |
    | idle | warps 2, 3 of warp group 0 | 40 | (retire after the register hand-off) |
    | MMA consumers | warp groups 1, 2 | 232 | as the tile's class; the scales read from the slot |

    | pipeline | producer -> consumer | stages |
    |---|---|---|
    | mainloop (PipelineTmaAsync) | TMA warp -> consumer warp groups | ``stages`` (A + W tile) |
    | unit scales (mbarrier pair) | warp 1 -> consumer warp groups | 1 slot (a main loop between release and use) |
    """

    slot_barriers = 2

    def __init__(self, cfg):
        super().__init__(cfg)
        bM, bN, _ = self.tile_shape_mnk
        self.smem_bytes += (bM + bN) * 4  # the slot (its barriers sit beside the stages')

    def _scale_slot_sizes(self):
        bM, bN, _ = self.tile_shape_mnk
        return bM, bN

    def _init_unit_scales(self, storage, tidx):
        barriers = storage.mainloop_barriers.data_ptr() + self.stages * 2
        self._init_slot_barriers(barriers, tidx)
        # (a trace-time handle: the slot's tensors and barriers, read inside the walks' loops)
        bM, bN, _ = self.tile_shape_mnk
        self._slot = UnitScales(storage.sSA.get_tensor(cute.make_layout(bM)),
                                storage.sSB.get_tensor(cute.make_layout(bN)), barriers, barriers + 1)

    @cute.jit
    def _init_slot_barriers(self, barriers, tidx):
        if tidx == 0:
            init_unit_scale_barriers(barriers, self.num_mma_warp_groups * self.threads_per_warp_group)

    def _units_before(self, unit):
        """This CTA's units walked before ``unit``: the slot's hand-overs so far."""
        return (unit - self._first_unit()) // self._unit_stride()

    def _scale_warp(self, walk, mainloop, mSA, mSB, slots, k_tiles):
        self._stage_row_scales_walk(walk, mSA, mSB)

    @cute.jit
    def _stage_row_scales_walk(self, walk, mSA, mSB):
        """(Warp 1.) Every unit of this CTA in the consumers' order: its row and column scales into the slot."""
        _, _, unit_bound, experts, _, _ = walk
        bM, bN, _ = self.tile_shape_mnk
        lanes = SCALE_WARP_LANES
        row_loads, col_loads = bM // lanes, -(-bN // lanes)
        slot = self._slot
        lane = cute.arch.lane_idx()
        n_last = mSB.shape[0] - 1
        rows_r = cute.make_rmem_tensor((row_loads,), Float32)
        cols_r = cute.make_rmem_tensor((col_loads,), Float32)
        e, first_tile, start, rows = self._first_group()
        unit = self._first_unit()
        while unit < unit_bound:
            e, first_tile, start, rows = self._seek(walk, unit, e, first_tile, start, rows)
            if e < experts:
                mt, tn = self._unit_tile(walk, unit, first_tile, rows)
                mt = self._own_tile(mt)
                g = e if cutlass.const_expr(self.masked) else Int32(0)
                r0, last = start + mt * bM, start + rows - 1
                # The loads first: their latency runs while the consumers still hold the slot.
                for i in cutlass.range_constexpr(row_loads):
                    rows_r[i] = Float32(mSA[cutlass.min(r0 + i * lanes + lane, last), g])
                for i in cutlass.range_constexpr(col_loads):
                    cols_r[i] = Float32(mSB[cutlass.min(tn * bN + i * lanes + lane, n_last), e])
                hand_over_unit_scales(slot, rows_r, cols_r, self._units_before(unit), lane)
                unit += self._unit_stride()
            else:
                unit = unit_bound

    def _acquire_unit_scales(self, unit_rows):
        wait_unit_scales(self._slot, self._units_before(unit_rows[3]))

    def _release_unit_scales(self):
        release_unit_scales(self._slot)

    def _row_scale(self, mSA, m, g, unit_rows):
        return self._slot.rows[m]

    def _col_scale(self, mSB, c, e, unit_rows, n):
        return self._slot.cols[c]

"""The TMA warp's part of the Hopper GEMM's producer walk (``producer_roles.TmaProducer.walk``): each K tile's A and
W tiles by TMA, multicast across the cluster, and on 64-row block-scaled tiles A's 1x128 scales with them."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .block_scales import load_a_scale_box
from .gemm_plan import PREFETCH_K_TILES


@dataclass(frozen=True)
class TmaLoads:
    """Warp 0's part of the producer walk (``producer_roles.TmaProducer.walk``): each K tile's A and W tiles by
    TMA, multicast across the cluster (frozen: the DSL lets it into run-time loops without carrying it)."""

    mainloop: object
    tma_a: object
    tma_b: object
    tAgA: object  # A tiles in global memory, (TMA box, tile row, K tile)
    tBgB: object  # W tiles, (TMA box, tile column, K tile)
    tAsA: object  # their stage slots in shared memory
    tBsB: object
    a_mcast_mask: object
    b_mcast_mask: object
    a_scales: object = None  # ATileScalesByTma when A's 1x128 scales may come by TMA
    # (barriers, bytes): B's tiles (the unquantized activations of a kernel that quantizes them) land on barriers
    # of their own, for the quantizing warps, instead of the stage's full barrier (None).
    b_stage: object = None

    def unit_views(self, tm, tn):
        """The unit's A rows and W columns, all K tiles."""
        return self.tAgA[(None, tm, None)], self.tBgB[(None, tn, None)]

    @cute.jit
    def prefetch_weights(self, tm, tn, k_begin, k_count):
        """Prefetch into L2 unit (tm, tn)'s first K tiles of A, the weight in the kernels that launch early (PDL: the
        swapped tiles), up to ``PREFETCH_K_TILES``. A multicast A is left alone (its TMA atom does not prefetch)."""
        if cutlass.const_expr(isinstance(self.a_mcast_mask, int)):  # (a run-time mask when A is multicast)
            tAgA_t = self.tAgA[(None, tm, None)]
            for i in cutlass.range(cutlass.min(k_count, PREFETCH_K_TILES), unroll=1):
                cute.prefetch(self.tma_a, tAgA_t[(None, k_begin + i)])

    def fill_stage(self, views, tm, tn, kt, state):
        """Acquire the stage (wait until it is empty, post its bytes) and issue K tile ``kt``'s loads."""
        tAgA_t, tBgB_t = views
        if cutlass.const_expr(self.a_scales is None):
            self.mainloop.producer_acquire(state)
        else:
            self.a_scales.acquire(self.mainloop, state)
        bar = self.mainloop.producer_get_barrier(state)
        cute.copy(self.tma_a, tAgA_t[(None, kt)], self.tAsA[(None, state.index)], tma_bar_ptr=bar,
                  mcast_mask=self.a_mcast_mask)
        if cutlass.const_expr(self.b_stage is None):
            cute.copy(self.tma_b, tBgB_t[(None, kt)], self.tBsB[(None, state.index)], tma_bar_ptr=bar,
                      mcast_mask=self.b_mcast_mask)
        else:
            b_bar = self.b_stage[0] + state.index
            with cute.arch.elect_one():  # one arrival (the barrier's count) with the tile's bytes
                cute.arch.mbarrier_arrive_and_expect_tx(b_bar, self.b_stage[1])
            cute.copy(self.tma_b, tBgB_t[(None, kt)], self.tBsB[(None, state.index)], tma_bar_ptr=b_bar)
        if cutlass.const_expr(self.a_scales is not None):
            self.a_scales.load(tm, kt, state.index, bar)
        self.mainloop.producer_commit(state)


@dataclass(frozen=True)
class ATileScalesByTma:
    """The TMA warp's share of A's group scales (block_scales.a_scale_tma_view): when the run-time flag is set,
    each stage's bytes include the box and the TMA warp loads it with the stage's tiles; otherwise the scale
    warp copies them (``ScaleStaging``) and the stage's bytes are the tiles' alone."""

    atom: object
    tma_scales: object
    slots: object  # A's scale slots, (tile_m, stages)
    tile_m: int
    by_tma: object  # run-time flag
    tile_bytes: int  # the stage's A and W tile bytes

    def acquire(self, mainloop, state):
        """PipelineTmaAsync.producer_acquire with this call's byte count."""
        mainloop.sync_object_empty.wait(state.index, state.phase)
        extra = cutlass.select_(self.by_tma, Int32(self.tile_m * 4), Int32(0))
        mainloop.sync_object_full.arrive_and_expect_tx(state.index, self.tile_bytes + extra)

    def load(self, tm, kt, stage, bar):
        _load_a_scales_if(self.by_tma, self.atom, self.tma_scales, self.slots, self.tile_m, tm, kt, stage, bar)


@cute.jit
def _load_a_scales_if(by_tma, atom, tma_scales, slots, tile_m: cutlass.Constexpr, tm, kt, stage, bar):
    if by_tma:
        load_a_scale_box(atom, tma_scales, slots, tile_m, tm, kt, stage, bar)

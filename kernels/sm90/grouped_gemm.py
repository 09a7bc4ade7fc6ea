"""Hopper (sm_90a) grouped FP8 GEMM for mixture-of-experts layers: one persistent launch multiplies each expert's
tokens by that expert's weights, with the group sizes read from global memory (no host synchronisation, CUDA-graph
capturable).

Layouts (``Sm90GroupedGemmConfig.layout``):

* ``"contiguous"`` (M-grouped): A (T, K) holds the tokens of all experts back to back; ``groups`` (E,) int32 are the
  cumulative end rows of the groups (torch's ``offs``). D is (T, N). A group may be empty or of any size: its last
  tile's rows past the group are loaded (they belong to the next group, or are zero-filled past T) but never
  stored.
* ``"masked"``: A (E, C, K) holds up to C rows per expert and ``groups`` (E,) int32 the rows of each expert to
  compute; D (E, C, N). Rows past an expert's count are neither computed past their tile nor written.

W is (E, N, K) K-major, seen as torch's (E, K, N) ``b``. Recipes: "tensor" (scale_a (1,), scale_b (E,)) and "row"
(a scale per A row, scale_b per expert and column), applied in fp32 in the epilogue; "1x128_128x128" (DeepSeek-V3:
a scale per A row and 128-deep K block, one per 128x128 block of each expert's W), applied per K tile as the
dense kernel's block-scaled recipes do (``block_scales.py``: staged in the stage, read by the consumers before the
K tile's MMAs, applied in the promotion). Each 128-deep K tile accumulates into a fresh fragment promoted into the
fp32 accumulator (``promoted_mainloops.py``): two fragments alternating, except in the row-wise recipe's 64-row
tile (``Sm90GroupedFp8GemmEarlyRowScales``), which promotes each K tile before issuing the next and
holds instead the unit's row and column scales, loaded as the unit starts so that their latency passes under its
main loop.

| warp role | threads | registers | work |
|---|---|---|---|
| TMA producer | warp 0 of warp group 0 | 40 | per work unit, each K tile's A rows and W tile into a stage |
| scale producer | warp 1 of warp group 0 (block scales) | 40 | the same walk: each K tile's A and W scales |
| scale stager | warp 1 (row-wise 128-row tiles, early row scales) | 40 | the same walk: each unit's scales, a slot |
| idle | the other warps of warp group 0 | 40 | (retire after the register hand-off) |
| MMA consumers | warp groups 1..tile_m/64 (64x256: 1, 2) | 232 | 64 rows (64x256: 128 columns) each: WGMMA, epilogue |

| pipeline | producer -> consumer | stages |
|---|---|---|
| mainloop (PipelineTmaAsync) | TMA warp (+ scale warp) -> consumer warp groups | ``stages`` (A + W tile, scales) |

With ``cluster_m`` 2 (128-row tiles, row-wise and per-tensor) the CTAs run in clusters of two along M: the walk's
m tiles are a cluster's 256 rows, one 128-row tile per CTA (the second past its group where the group has an odd
count of tiles: loaded, not stored), and each CTA's TMA warp loads half of every W tile and multicasts it to both,
so that W crosses from L2 once per pair of m tiles; every consumer warp releases its stage to both CTAs.

The epilogue stores the scaled, converted fragment straight from registers with a row predicate (the group's rows
only; two columns per 32-bit store where N is even): a TMA store would clip at the tensor's edge, not at the
group's.

Work units are the tiles of the groups in turn: a group of g m tiles owns ``g * tiles_n`` consecutive units,
walked in bands of ``band_m`` m tiles (a run-time argument), M fastest within a band, as the dense scheduler does.
``band_m`` 1 is N fastest: the wave's rows re-read their expert's W along N, from L2 while it fits there; past it
(Mixtral's gate_up: 117 MB per expert) the host passes ``RASTER_GROUP_M``, so that a wave shares each W tile among
the band's rows instead of reading W from memory once per m tile. Every role walks the same units with a cursor
over the groups that only moves forward (units grow along each CTA's walk); each warp moves it 32 groups per load
(a lane per group size, a prefix sum and a ballot), so passing the empty groups of a decode step costs no chain of
dependent loads. The host launches ``min(SMs, units bound)`` CTAs with the bound ``tiles_n * (ceil(rows / tile_m)
+ E)``; a CTA stops at the first unit past the last group.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..common.register_fence import fence_registers
from ..common.stage_release import ConsumerMainloop
from ..common.tile_scheduler import banded_coords
from .block_scales import BLOCK_RECIPES, PRODUCER_LANES, SCALE_REGS, ScaleStaging, TileScales
from .gemm_plan import SM90_SMEM_CAPACITY, cutlass_dtype
from .grouped_row_scales import StagedRowScales
from .promoted_mainloops import PromotedMainloops

GROUPED_LAYOUTS = ("contiguous", "masked")
GROUPED_RECIPES = ("tensor", "row", "1x128_128x128")
# m tiles of a group walked before moving along N where its expert's W overflows L2 (the dense scheduler's band for
# one-CTA clusters)
RASTER_GROUP_M = 8
# The wide tile: 64 rows by two warp groups of 128 columns side by side (a unit streams twice the W bytes of a
# 64x128 one per fixed cost of the unit: its group lookup, epilogue and pipeline hand-offs)
WIDE_TILE_N = 256
# The large-group tile: 128 rows by 192 columns, two warp groups of 64 rows, each promoting a K tile before issuing
# the next (two 192-wide fragments and the accumulator would not fit; the other warp group's MMAs fill the gap),
# as the dense kernel's 192-wide tiles
SERIAL_TILE_N = 192
SCALE_CHUNKS = 4  # the 192-wide tile's row-wise scales applied in this many chunks of its fragment


@dataclass(frozen=True)
class Sm90GroupedGemmConfig:
    """Compile-time configuration of one grouped GEMM instance."""

    layout: str = "contiguous"  # GROUPED_LAYOUTS
    recipe: str = "row"  # GROUPED_RECIPES
    a_dtype: str = "e4m3"
    b_dtype: str = "e4m3"
    out_dtype: str = "bf16"
    tile_m: int = 128
    tile_n: int = 128
    stages: int = 0  # 0: as many as shared memory allows
    # Row-wise: the unit's scales in hand before its main loop ends: 64-row tiles load them as it starts
    # (Sm90GroupedFp8GemmEarlyRowScales), 128-row tiles have warp 1 stage them in shared memory (StagedRowScales)
    early_row_scales: bool = False
    # CTAs of a cluster along M (2: each W tile multicast to the two CTAs of a pair of m tiles)
    cluster_m: int = 1

    def check(self) -> None:
        """Raise ValueError for a configuration the kernel cannot build."""
        if self.layout not in GROUPED_LAYOUTS:
            raise ValueError(f"grouped GEMM layout {self.layout!r}: one of {GROUPED_LAYOUTS}")
        if self.recipe not in GROUPED_RECIPES:
            raise ValueError(f"grouped GEMM recipe {self.recipe!r}: one of {GROUPED_RECIPES}")
        if self.a_dtype not in ("e4m3", "e5m2") or self.b_dtype not in ("e4m3", "e5m2"):
            raise ValueError(f"grouped GEMM operands {self.a_dtype} x {self.b_dtype}: FP8 (e4m3, e5m2)")
        if self.out_dtype not in ("bf16", "fp16"):
            raise ValueError(f"grouped GEMM output {self.out_dtype}: bf16 or fp16")
        if self.tile_n == SERIAL_TILE_N:
            if self.tile_m != 128 or self.recipe not in ("row", "tensor"):
                raise ValueError(f"the {SERIAL_TILE_N}-wide tile (serial promotion) is 128 rows of the row-wise or "
                                 f"per-tensor recipe, not {self.recipe} {self.tile_m}x{self.tile_n}")
        elif self.tile_n == WIDE_TILE_N:
            if self.tile_m != 64 or self.recipe not in ("row", "tensor"):
                raise ValueError(f"the {WIDE_TILE_N}-wide tile (two warp groups side by side along N) is 64 rows of "
                                 f"the row-wise or per-tensor recipe, not {self.recipe} {self.tile_m}x{self.tile_n}")
        elif self.tile_m not in (64, 128) or self.tile_n % 16 or not 16 <= self.tile_n <= 128:
            raise ValueError(f"grouped GEMM tile {self.tile_m}x{self.tile_n}: tile_m 64 or 128, tile_n a multiple "
                             f"of 16 up to 128, 64x{WIDE_TILE_N} or 128x{SERIAL_TILE_N}")
        if self.early_row_scales and self.recipe != "row":
            raise ValueError(f"early row scales are the row-wise recipe's, not {self.recipe}'s")
        if self.cluster_m not in (1, 2) or self.cluster_m == 2 and (self.tile_m != 128
                                                                    or self.recipe not in ("row", "tensor")):
            raise ValueError(f"grouped GEMM clusters: 1, or 2 CTAs along M with 128-row tiles of the row-wise or "
                             f"per-tensor recipe, not {self.cluster_m} with {self.recipe} "
                             f"{self.tile_m}x{self.tile_n}")
        if self.stages and self.stages > max_stages(self):
            raise ValueError(f"{self.stages} stages of {stage_bytes(self)} bytes exceed shared memory")


def stage_bytes(cfg: Sm90GroupedGemmConfig) -> int:
    """Shared memory of one mainloop stage: an A tile and a W tile of 128 K bytes each row, and with block scales
    an fp32 slot per tile row and column."""
    scales = (cfg.tile_m + cfg.tile_n) * 4 if cfg.recipe in BLOCK_RECIPES else 0
    return (cfg.tile_m + cfg.tile_n) * 128 + scales


def max_stages(cfg: Sm90GroupedGemmConfig) -> int:
    """Stages that fit beside the barriers (8 at most: more buys nothing once the loads run ahead)."""
    return min(8, (SM90_SMEM_CAPACITY - 2048) // stage_bytes(cfg))


class Sm90GroupedFp8Gemm(PromotedMainloops):
    """Persistent warp-specialized grouped WGMMA FP8 GEMM (see the module docstring for roles and pipelines)."""

    threads_per_warp_group = 128
    producer_regs = 40
    consumer_regs = 232
    # (PromotedMainloops: A's scales never come by TMA here)
    a_scale_tma = False

    def __init__(self, cfg: Sm90GroupedGemmConfig):
        cfg.check()
        self.cfg = cfg
        self.a_dtype, self.b_dtype = cutlass_dtype(cfg.a_dtype), cutlass_dtype(cfg.b_dtype)
        self.d_dtype = cutlass_dtype(cfg.out_dtype)
        self.tile_shape_mnk = (cfg.tile_m, cfg.tile_n, 128)
        self.warp_groups_n = 2 if cfg.tile_n == WIDE_TILE_N else 1  # warp groups side by side along N
        self.num_mma_warp_groups = cfg.tile_m // 64 * self.warp_groups_n
        self.threads_per_cta = (1 + self.num_mma_warp_groups) * self.threads_per_warp_group
        self.stages = cfg.stages or max_stages(cfg)
        self.masked = cfg.layout == "masked"
        self.block_scaled = cfg.recipe in BLOCK_RECIPES
        self.cluster_m = cfg.cluster_m
        self.walk_m = cfg.tile_m * cfg.cluster_m  # rows of the walk's m tiles: a cluster's, one tile per CTA
        self._consumer_mainloop = self._mainloop_promoted
        # SharedStorage: the stages' barriers, then A's and W's stages, each 1024-byte aligned, then the scale slots
        self.smem_bytes = 1024 + self.stages * stage_bytes(cfg)

    # ---- host-side trace ----------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # contiguous: (T, K); masked: (E, C, K); K-major
        mB: cute.Tensor,  # (E, K, N): torch's b, the transpose of (E, N, K) K-major weights
        mD: cute.Tensor,  # contiguous: (T, N); masked: (E, C, N); N-major
        mSA: cute.Tensor,  # "tensor": (1,); "row": (rows, groups of A) -- (T, 1) or (C, E); 1x128: (rows, Kb, groups)
        mSB: cute.Tensor,  # "tensor": (E,); "row": (N, E); 128x128 blocks: (Nb, Kb, E)
        mGroups: cute.Tensor,  # (E,) int32: contiguous, cumulative end rows; masked, rows per expert
        max_ctas: Int32,  # persistent CTAs to launch (the SM count)
        band_m: Int32,  # m tiles of a group walked before moving along N (1: N fastest)
        stream,
    ):
        a3, d3 = self._rows_k_groups(mA), self._rows_k_groups(mD)
        w3 = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[2, 1, 0]))  # (N, K, E)
        bM, bN, bK = self.tile_shape_mnk
        a_layout, b_layout = LayoutEnum.from_tensor(a3), LayoutEnum.from_tensor(w3)
        tiled_mma = self._make_tiled_mma(a_layout, b_layout)
        tiled_mma_fresh = self._make_tiled_mma(a_layout, b_layout)
        a_smem = sm90_utils.make_smem_layout_a(a_layout, self.tile_shape_mnk, self.a_dtype, self.stages)
        b_smem = sm90_utils.make_smem_layout_b(b_layout, self.tile_shape_mnk, self.b_dtype, self.stages)
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tA = cute.nvgpu.cpasync.make_tiled_tma_atom(op, a3, cute.slice_(a_smem, (None, None, 0)), (bM, bK))
        # (with clusters each CTA loads 1 / cluster_m of the W tile, multicast to all of them)
        op_b = op if self.cluster_m == 1 else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(op_b, w3, cute.slice_(b_smem, (None, None, 0)), (bN, bK),
                                                           num_multicast=self.cluster_m)

        slot_rows, slot_cols = self._scale_slot_sizes()

        @cute.struct
        class SharedStorage:
            # the stages' full / empty pairs, then the unit scale slot's (Sm90GroupedFp8GemmStagedRowScales)
            mainloop_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2 + self.slot_barriers]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem)], 1024]
            # block scales of each stage's K tile, or the unit's row-wise scales (1-element placeholders else)
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, slot_rows], 16]
            sSB: cute.struct.Align[cute.struct.MemRange[Float32, slot_cols], 16]

        self.shared_storage = SharedStorage
        rows, n, experts = a3.shape[0], w3.shape[0], w3.shape[2]
        tiles_n = (n + bN - 1) // bN
        # Every group adds at most one partial tile to the tiles of all rows (a cluster's: walk_m rows).
        wm = self.walk_m
        unit_bound = tiles_n * ((rows * a3.shape[2] + wm - 1) // wm + experts)
        grid = cutlass.max(cutlass.min(unit_bound, max_ctas), 1)
        launch = self.kernel(tiled_mma, tiled_mma_fresh, tma_a, tA, tma_b, tB, d3, mSA, mSB, mGroups, a_smem,
                             b_smem, tiles_n, unit_bound, band_m)
        grid_dims, extra = self._launch_shape(grid)
        launch.launch(grid=grid_dims, block=(self.threads_per_cta, 1, 1), smem=SharedStorage.size_in_bytes(),
                      stream=stream, **extra)

    def _scale_slot_sizes(self):
        """(A, W) fp32 words of the scale slots in shared memory: block scales, one per tile row and column of
        each stage."""
        bM, bN, _ = self.tile_shape_mnk
        return (bM * self.stages, bN * self.stages) if self.block_scaled else (1, 1)

    def _launch_shape(self, grid):
        """(grid, further launch options) of ``grid`` units in flight (``max_ctas`` bounds it: the SMs, or the
        clusters that fit): one CTA each, or a cluster each."""
        if self.cluster_m > 1:
            return (self.cluster_m, 1, grid), {"cluster": (self.cluster_m, 1, 1)}
        return (grid, 1, 1), {}

    def _rows_k_groups(self, t: cute.Tensor) -> cute.Tensor:
        """A or D as the kernel's (rows, columns, groups): masked (E, C, X) -> (C, X, E); contiguous (T, X) ->
        (T, X, 1)."""
        if cutlass.const_expr(self.masked):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 2, 0]))
        return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1)))

    def _make_tiled_mma(self, a_layout, b_layout):
        return sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(), Float32,
            (self.tile_shape_mnk[0] // 64, self.warp_groups_n, 1),
            tiler_mn=(64, self.tile_shape_mnk[1] // self.warp_groups_n))

    # ---- the group walk -----------------------------------------------------------------------
    @cute.jit
    def _chunk_rows(self, mGroups, g, experts, limit, start):
        """Lane l's (rows, end row) of group ``g``, the chunk's first group + l; 0 rows past the last group. Contiguous
        groups start where the previous one ended (the chunk's first at ``start``): the ends are made
        non-decreasing by a running maximum over the lanes. Ill-formed sizes are clamped so that no launch reads
        or writes outside its tensors or writes a row twice: ends into [the previous end, ``limit``] (A's rows;
        masked: counts into [0, C]), so a decreasing end offset gives an empty group and offsets past the rows
        end there."""
        raw = cutlass.max(cutlass.min(mGroups[cutlass.min(g, experts - 1)], limit), Int32(0))
        if cutlass.const_expr(self.masked):
            count = cutlass.select_(g < experts, raw, Int32(0))
            return count, count  # (every masked group starts at its row 0)
        end = cutlass.select_(g < experts, cutlass.max(raw, start), start)
        for d in cutlass.range_constexpr(5):  # inclusive running maximum (a lane below 2^d keeps its own)
            end = cutlass.max(end, cute.arch.shuffle_sync_up(end, 1 << d, mask_and_clamp=0))
        before = cute.arch.shuffle_sync_up(end, 1, mask_and_clamp=0)
        return end - cutlass.select_(cute.arch.lane_idx() == 0, start, before), end

    # ---- device ---------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tiled_mma, tiled_mma_fresh, tma_a, mA, tma_b, mB, mD, mSA, mSB, mGroups, a_smem, b_smem,
               tiles_n, unit_bound, band_m):
        bM, bN, bK = self.tile_shape_mnk
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_warp_group)
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        self._init_unit_scales(storage, tidx)
        stage_bytes = (cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0)))
                       + cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, 0))))
        cm = self.cluster_m
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mainloop_barriers.data_ptr(),
            num_stages=self.stages,
            # (block scales: every lane of the scale warp also arrives, once its copies land)
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     1 + PRODUCER_LANES if self.block_scaled else 1),
            # every consumer warp releases a stage to each CTA that multicast into it
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_warp_groups * 4 * cm),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, cm, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(cm, 1), is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        k_tiles = (mA.shape[1] + bK - 1) // bK
        experts = mB.shape[2]
        limit = mA.shape[0]
        pipeline.pipeline_init_wait(cluster_shape_mn=(cm, 1))

        scale_slots = None
        if cutlass.const_expr(self.block_scaled):
            scale_slots = (storage.sSA.get_tensor(cute.make_layout((bM, self.stages))),
                           storage.sSB.get_tensor(cute.make_layout((bN, self.stages))))
        walk = (mGroups, tiles_n, unit_bound, experts, limit, band_m)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                w_mask = self._w_multicast_mask()
                e, first_tile, start, rows = self._first_group()
                unit = self._first_unit()
                while unit < unit_bound:
                    e, first_tile, start, rows = self._seek(walk, unit, e, first_tile, start, rows)
                    if e < experts:
                        mt, tn = self._unit_tile(walk, unit, first_tile, rows)
                        r0 = start + self._own_tile(mt) * bM
                        g = e if cutlass.const_expr(self.masked) else Int32(0)
                        gA = cute.local_tile(cute.domain_offset((r0, 0), mA[(None, None, g)]), (bM, bK), (0, None))
                        gB = cute.local_tile(mB[(None, None, e)], (bN, bK), (tn, None))
                        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                            tma_b, self._cluster_rank(), cute.make_layout(cm), cute.group_modes(sB, 0, 2),
                            cute.group_modes(gB, 0, 2))
                        for kt in cutlass.range(k_tiles, unroll=1):
                            mainloop.producer_acquire(state)
                            bar = mainloop.producer_get_barrier(state)
                            cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                                      mcast_mask=w_mask)
                            mainloop.producer_commit(state)
                            state.advance()
                        unit += self._unit_stride()
                    else:
                        unit = unit_bound
                mainloop.producer_tail(state)
            if warp_idx == 1:
                self._scale_warp(walk, mainloop, mSA, mSB, scale_slots, k_tiles)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            consumer_mainloop = ConsumerMainloop.create(mainloop)
            mma_tidx = tidx - self.threads_per_warp_group
            thr_mma = tiled_mma.get_slice(mma_tidx)
            # (descriptors from the warp group's first thread: warp-uniform, kept in uniform registers)
            thr_mma_wg = tiled_mma.get_slice((wg_idx - 1) * self.threads_per_warp_group)
            tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
            tile_coords = thr_mma.partition_C(cute.make_identity_tensor((bM, bN)))
            acc = cute.make_rmem_tensor(tile_coords.shape, Float32)
            temps = (cute.make_rmem_tensor(tile_coords.shape, Float32),
                     cute.make_rmem_tensor(tile_coords.shape, Float32))
            scale_regs = None
            if cutlass.const_expr(self.block_scaled):
                scale_regs = tuple(cute.make_rmem_tensor(cute.make_layout(SCALE_REGS), Float32) for _ in range(2))
            row_scales = self._row_scale_regs(temps, tile_coords.shape)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            tiled_mma_fresh.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            mmas = (tiled_mma_fresh, tiled_mma)
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            n = mD.shape[1]
            e, first_tile, start, rows = self._first_group()
            unit = self._first_unit()
            while unit < unit_bound:
                e, first_tile, start, rows = self._seek(walk, unit, e, first_tile, start, rows)
                if e < experts:
                    mt, tn = self._unit_tile(walk, unit, first_tile, rows)
                    mt = self._own_tile(mt)
                    g = e if cutlass.const_expr(self.masked) else Int32(0)
                    # first row, rows to store, first column, and the unit (which of this CTA's it is: the slot's phase)
                    unit_rows = (start + mt * bM, rows - mt * bM, tn * bN, unit)
                    self._scales_at_unit_start(row_scales, tile_coords, mSA, mSB, g, e, unit_rows, n)
                    scales = None
                    if cutlass.const_expr(self.block_scaled):
                        scales = TileScales(scale_slots, tile_coords, tn * bN, scale_regs, BLOCK_RECIPES[
                            self.cfg.recipe], (bM, bN))
                    read_state, release_state = self._consumer_mainloop(
                        mmas, acc, temps, tCrA, tCrB, consumer_mainloop, read_state, release_state, k_tiles, scales)
                    self._scales_after_mainloop(row_scales, tile_coords, mSA, mSB, g, e, unit_rows, n)
                    self._store_tile(acc, tile_coords, mD, mSA, mSB, g, e, unit_rows, n, row_scales)
                    unit += self._unit_stride()
                else:
                    unit = unit_bound

    @cute.jit
    def _first_group(self):
        """The walk's cursor before group 0: (group, its first m tile, its first row, its rows)."""
        return Int32(-1), Int32(0), Int32(0), Int32(0)

    @cute.jit
    def _seek(self, walk, unit, e, first_tile, start, rows):
        """Move the cursor forward to the group holding work unit ``unit`` (past the last: ``e`` = E); a group's
        units are those of its m tiles of the concatenated groups. Units only grow along a CTA's walk, so the
        cursor never moves back. The calling warp's lanes walk together, each reading one group size of the next
        32: one coalesced load where a group at a time would make a dependent load per group passed (at decode a
        CTA's next unit lies ~10 groups on). A prefix sum over the lanes gives the groups' first m tiles and a
        ballot the group that holds the unit."""
        mGroups, tiles_n, _, experts, limit, _ = walk
        bM = self.walk_m
        mg = unit // tiles_n
        lane = cute.arch.lane_idx()
        base_e, base_tile, base_start = e + 1, first_tile + (rows + bM - 1) // bM, start + rows
        searching = (e < experts) & (mg >= base_tile)
        while searching:
            g_rows, g_end = self._chunk_rows(mGroups, base_e + lane, experts, limit, base_start)
            tiles = (g_rows + bM - 1) // bM
            incl = tiles
            for d in cutlass.range_constexpr(5):  # inclusive prefix sum of the lanes' m tiles
                up = cute.arch.shuffle_sync_up(incl, 1 << d, mask_and_clamp=0)
                incl = incl + cutlass.select_(lane >= (1 << d), up, Int32(0))
            hits = cute.arch.vote_ballot_sync(base_tile + incl > mg)
            if hits != 0:
                first = cute.arch.popc((hits & -hits) - 1)  # the lowest lane whose group reaches past mg
                e = base_e + first
                first_tile = base_tile + cute.arch.shuffle_sync(incl - tiles, first)
                rows = cute.arch.shuffle_sync(g_rows, first)
                start = cute.arch.shuffle_sync(g_end - g_rows, first)
                searching = False
            elif base_e + 32 >= experts:
                e = experts
                searching = False
            else:
                base_e += 32
                base_tile += cute.arch.shuffle_sync(incl, 31)
                base_start = cute.arch.shuffle_sync(g_end, 31)
        return e, first_tile, start, rows

    @cute.jit
    def _unit_tile(self, walk, unit, first_tile, rows):
        """(m tile within its group, n tile) of work unit ``unit`` of the group the cursor is at: the group's units
        in the banded order."""
        tiles_n, band_m = walk[1], walk[5]
        bM = self.walk_m
        return banded_coords(unit - first_tile * tiles_n, (rows + bM - 1) // bM, tiles_n, band_m)

    # ---- the walk over clusters (one CTA each but with cluster_m 2) ------------------------------------------------
    def _first_unit(self):
        """This CTA's first work unit: its cluster's index (one-CTA launches: the CTA's)."""
        if self.cluster_m > 1:
            return cute.arch.block_idx()[2]
        return cute.arch.block_idx()[0]

    def _unit_stride(self):
        """Units between a CTA's consecutive ones: the clusters launched."""
        if self.cluster_m > 1:
            return cute.arch.grid_dim()[2]
        return cute.arch.grid_dim()[0]

    def _cluster_rank(self):
        """This CTA's rank along the cluster's M (0 without clusters)."""
        if self.cluster_m > 1:
            return cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return 0

    def _own_tile(self, mt):
        """This CTA's m tile of the walk's tile ``mt`` of its group: a cluster's m tiles are consecutive, one per
        CTA (a rank whose tile lies past the group loads rows it does not store)."""
        if self.cluster_m > 1:
            return mt * self.cluster_m + self._cluster_rank()
        return mt

    def _w_multicast_mask(self):
        """The CTAs each of this CTA's W loads goes to: every CTA of its cluster (0, no multicast, without
        clusters; the dense kernel's convention)."""
        if self.cluster_m > 1:
            return cute.make_layout_image_mask(cute.make_layout((self.cluster_m, 1, 1)),
                                               (self._cluster_rank(), 0, 0), mode=0)
        return 0

    # ---- warp 1 of the producer warp group -------------------------------------------------------------------
    slot_barriers = 0  # mbarriers after the stages' (Sm90GroupedFp8GemmStagedRowScales: its slot's two)

    def _init_unit_scales(self, storage, tidx):
        """(Every thread, before the pipelines' init.) Nothing here: the unit scale slot's barriers."""

    def _scale_warp(self, walk, mainloop, mSA, mSB, slots, k_tiles):
        """Warp 1: the block scales' staging; idle for the epilogue-scaled recipes."""
        if cutlass.const_expr(self.block_scaled):
            self._stage_scales_walk(walk, mainloop, mSA, mSB, slots, k_tiles)

    @cute.jit
    def _stage_scales_walk(self, walk, mainloop, mSA, mSB, slots, k_tiles):
        """Warp 1 with block scales: the TMA warp's walk, staging each K tile's A scales (the unit's rows of its
        group, read no further than the group's end) and W scales (its expert's) into the stage
        (``block_scales.ScaleStaging``)."""
        mGroups, tiles_n, unit_bound, experts, limit, _ = walk
        bM, bN, _ = self.tile_shape_mnk
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        e, first_tile, start, rows = self._first_group()
        unit = self._first_unit()
        lane = cute.arch.lane_idx()
        while unit < unit_bound:
            e, first_tile, start, rows = self._seek(walk, unit, e, first_tile, start, rows)
            if e < experts:
                mt, tn = self._unit_tile(walk, unit, first_tile, rows)
                g = e if cutlass.const_expr(self.masked) else Int32(0)
                sa = mSA[(None, None, g)]
                # the unit's rows as a tensor of their own: row 0 is the tile's first, the extent the group's rest
                sa_unit = cute.make_tensor(sa.iterator + cute.crd2idx((start + mt * bM, 0), sa.layout),
                                           cute.make_layout((rows - mt * bM, sa.shape[1]), stride=sa.layout.stride))
                staging = ScaleStaging(mainloop, sa_unit, mSB[(None, None, e)], slots, BLOCK_RECIPES[self.cfg.recipe],
                                       (bM, bN), lane)
                for kt in cutlass.range(k_tiles, unroll=1):
                    staging.fill_stage(None, Int32(0), tn, kt, state)
                    state.advance()
                unit += self._unit_stride()
            else:
                unit = unit_bound

    # ---- the row-wise recipe's scales: hooks (Sm90GroupedFp8GemmEarlyRowScales loads them as the unit starts) ----
    def _row_scale_regs(self, temps, shape):
        """Registers of each fragment element's row and column scale: the promotion fragments, dead by the
        epilogue."""
        return temps

    def _scales_at_unit_start(self, dst, tile_coords, mSA, mSB, g, e, unit_rows, n):
        """Nothing before the main loop: its promotion fragments hold the scales' registers until it ends."""

    def _scales_after_mainloop(self, dst, tile_coords, mSA, mSB, g, e, unit_rows, n):
        if self.cfg.recipe == "row":
            self._load_row_scales(dst, tile_coords, mSA, mSB, g, e, unit_rows, n)

    @cute.jit
    def _load_row_scales(self, dst, tile_coords, mSA, mSB, g, e, unit_rows, n):
        """Row-wise recipe: each fragment element's row scale into ``dst[0]`` and column scale into ``dst[1]``, all
        before the first store (loads after a store to memory that may alias wait for it). A thread's elements
        share 2 rows and 16 column pairs: the repeated loads fold into one each."""
        self._acquire_unit_scales(unit_rows)
        for i in cutlass.range(cute.size(dst[0]), unroll_full=True):
            m, c = tile_coords[i]
            dst[0][i] = self._row_scale(mSA, m, g, unit_rows)
            dst[1][i] = self._col_scale(mSB, c, e, unit_rows, n)
        self._release_unit_scales()

    def _row_scale(self, mSA, m, g, unit_rows):
        """Row ``m`` of the unit's tile's A scale (the index clamped into the group's rows, not predicated: the
        fragments stay in registers)."""
        r0, valid_rows = unit_rows[0], unit_rows[1]
        return Float32(mSA[r0 + cutlass.min(m, valid_rows - 1), g])

    def _col_scale(self, mSB, c, e, unit_rows, n):
        """Column ``c`` of the unit's tile's W scale (clamped into N)."""
        return Float32(mSB[cutlass.min(unit_rows[2] + c, n - 1), e])

    def _acquire_unit_scales(self, unit_rows):
        """Before the unit's first scale read: nothing (they are read from global memory)."""

    def _release_unit_scales(self):
        """After its last: nothing."""

    @cute.jit
    def _store_tile(self, acc, tile_coords, mD, mSA, mSB, g, e, unit_rows, n, row_scales):
        """Scale the tile in fp32 and store the rows of its group (``unit_rows``: its first row, the rows to store,
        its first column; columns below N). Row-wise, ``row_scales`` holds each element's row and column scales
        (``_load_row_scales``); their products go into ``row_scales[0]``."""
        r0, valid_rows, c0 = unit_rows[0], unit_rows[1], unit_rows[2]
        gD = mD[(None, None, g)]
        alpha = Float32(1.0)
        if cutlass.const_expr(self.cfg.recipe == "tensor"):
            alpha = Float32(mSA[0]) * Float32(mSB[e])
        scratch = self._scale_products(acc, row_scales, tile_coords, mSA, mSB, g, e, unit_rows, n)
        # Fragment elements 2j and 2j + 1 are columns c and c + 1 of one row (tests/test_grouped.py): one 32-bit
        # store for both where the row starts 4-byte aligned (N even) and both columns are below N.
        paired = n % 2 == 0
        for j in cutlass.range(cute.size(acc) // 2, unroll_full=True):
            m, c = tile_coords[2 * j]
            if m < valid_rows:
                row, col = r0 + m, c0 + c
                v0, v1 = self._scaled(acc, scratch, alpha, 2 * j), self._scaled(acc, scratch, alpha, 2 * j + 1)
                if paired & (col + 1 < n):
                    pair = cute.make_rmem_tensor(cute.make_layout(2), self.d_dtype)
                    pair[0], pair[1] = v0.to(self.d_dtype), v1.to(self.d_dtype)
                    # (the element offset added to the typed pointer, so the byte address is computed in 64 bits)
                    addr = (gD.iterator + cute.crd2idx((row, col), gD.layout)).toint()
                    cute.autovec_copy(pair, cute.make_tensor(
                        cute.make_ptr(self.d_dtype, addr, cute.AddressSpace.gmem, assumed_align=4),
                        cute.make_layout(2)))
                else:
                    if col < n:
                        gD[row, col] = v0.to(self.d_dtype)
                    if col + 1 < n:
                        gD[row, col + 1] = v1.to(self.d_dtype)

    @cute.jit
    def _scale_products(self, acc, row_scales, tile_coords, mSA, mSB, g, e, unit_rows, n):
        """Row-wise: each element's row scale times its column scale, into ``row_scales[0]`` (returned: what
        ``_scaled`` multiplies by)."""
        scratch = row_scales[0]
        if cutlass.const_expr(self.cfg.recipe == "row"):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                scratch[i] = scratch[i] * row_scales[1][i]
        return scratch

    @cute.jit
    def _scaled(self, acc, scratch, alpha, i: cutlass.Constexpr):
        """Element ``i`` of the tile in fp32 with its scales: per tensor ``alpha``, row-wise ``scratch[i]`` (None:
        already in the accumulator; block scales were applied in the promotion)."""
        v = acc[i]
        if cutlass.const_expr(self.cfg.recipe == "tensor"):
            v = v * alpha
        elif cutlass.const_expr(self.cfg.recipe == "row" and scratch is not None):
            v = v * scratch[i]
        return v


class Sm90GroupedFp8GemmEarlyRowScales(Sm90GroupedFp8Gemm):
    """The row-wise recipe's 64-row tile with the unit's row and column scales loaded as the unit starts, into
    registers of their own, so that their latency passes under the main loop instead of before the stores. The
    registers are the second promotion fragment's: the consumer promotes each K tile before issuing the next
    (``_mainloop_promoted_serial``): its rows are few, its time the W bytes'.

    | warp role | threads | registers | work |
    |---|---|---|---|
    | TMA producer | warp 0 of warp group 0 | 40 | as ``Sm90GroupedFp8Gemm`` |
    | idle | the other warps of warp group 0 | 40 | (retire after the register hand-off) |
    | MMA consumer | warp group 1 | 232 | the unit's scales, then WGMMA with serial promotion, epilogue |

    | pipeline | producer -> consumer | stages |
    |---|---|---|
    | mainloop (PipelineTmaAsync) | TMA warp -> consumer warp group | ``stages`` (A + W tile) |
    """

    def __init__(self, cfg: Sm90GroupedGemmConfig):
        super().__init__(cfg)
        self._consumer_mainloop = self._mainloop_promoted_serial

    def _row_scale_regs(self, temps, shape):
        return tuple(cute.make_rmem_tensor(shape, Float32) for _ in range(2))

    def _scales_at_unit_start(self, dst, tile_coords, mSA, mSB, g, e, unit_rows, n):
        self._load_row_scales(dst, tile_coords, mSA, mSB, g, e, unit_rows, n)

    def _scales_after_mainloop(self, dst, tile_coords, mSA, mSB, g, e, unit_rows, n):
        """(loaded as the unit started)"""


class Sm90GroupedFp8GemmSerial(Sm90GroupedFp8Gemm):
    """The 128x192 tile (``SERIAL_TILE_N``) of groups of many rows: each consumer warp group promotes a K tile
    before issuing the next (``_mainloop_promoted_serial``; the other warp group's MMAs run meanwhile), and the
    row-wise recipe multiplies each accumulator element by its row and column scales before the first store (the
    accumulator and two more 192-wide fragments would not fit in 232 registers).

    | warp role | threads | registers | work |
    |---|---|---|---|
    | TMA producer | warp 0 of warp group 0 | 40 | as ``Sm90GroupedFp8Gemm`` |
    | idle | the other warps of warp group 0 | 40 | (retire after the register hand-off) |
    | MMA consumers | warp groups 1, 2 | 232 | 64 rows each: WGMMA with serial promotion, epilogue |

    | pipeline | producer -> consumer | stages |
    |---|---|---|
    | mainloop (PipelineTmaAsync) | TMA warp -> consumer warp groups | ``stages`` (A + W tile) |
    """

    def __init__(self, cfg: Sm90GroupedGemmConfig):
        super().__init__(cfg)
        self._consumer_mainloop = self._mainloop_promoted_serial

    def _row_scale_regs(self, temps, shape):
        return None  # (the scales go into the accumulator itself: _scale_products)

    def _scales_after_mainloop(self, dst, tile_coords, mSA, mSB, g, e, unit_rows, n):
        """(folded into the accumulator before the stores)"""

    @cute.jit
    def _scale_products(self, acc, row_scales, tile_coords, mSA, mSB, g, e, unit_rows, n):
        """Row-wise: each element of the accumulator times its row scale times its column scale (the same
        product and rounding as the base class's), every load before the first store."""
        if cutlass.const_expr(self.cfg.recipe == "row"):
            self._acquire_unit_scales(unit_rows)
            size = cute.size(acc)
            chunk = size // SCALE_CHUNKS
            for h in cutlass.range_constexpr(SCALE_CHUNKS):
                for i in cutlass.range_constexpr(h * chunk, (h + 1) * chunk):
                    m, c = tile_coords[i]
                    acc[i] = acc[i] * (self._row_scale(mSA, m, g, unit_rows)
                                       * self._col_scale(mSB, c, e, unit_rows, n))
                # (a chunk's scale loads stay after the chunk before: all of them at once would not fit)
                fence_registers(acc)
            self._release_unit_scales()
        return None  # (_scaled multiplies by nothing more)


class Sm90GroupedFp8GemmStagedRowScales(StagedRowScales, Sm90GroupedFp8Gemm):
    """The 128x128 tile (row-wise) with its unit scales staged in shared memory (``StagedRowScales``)."""


class Sm90GroupedFp8GemmSerialStagedRowScales(StagedRowScales, Sm90GroupedFp8GemmSerial):
    """The 128x192 tile (row-wise) with its unit scales staged in shared memory (``StagedRowScales``)."""


def grouped_kernel(cfg: Sm90GroupedGemmConfig) -> Sm90GroupedFp8Gemm:
    """The kernel object that builds ``cfg``."""
    staged = cfg.early_row_scales and cfg.tile_m == 128
    if cfg.tile_n == SERIAL_TILE_N:
        return (Sm90GroupedFp8GemmSerialStagedRowScales if staged else Sm90GroupedFp8GemmSerial)(cfg)
    if staged:
        return Sm90GroupedFp8GemmStagedRowScales(cfg)
    return (Sm90GroupedFp8GemmEarlyRowScales if cfg.early_row_scales else Sm90GroupedFp8Gemm)(cfg)

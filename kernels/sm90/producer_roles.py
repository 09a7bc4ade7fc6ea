"""The producer roles of the Hopper GEMM (``fp8_gemm.Sm90Fp8Gemm``): what warp group 0 does to fill the mainloop's
stages. ``Sm90Fp8Gemm._setup_attributes`` binds one of them (``self.producer``) from the configuration; the kernel
calls its hooks and never asks which one it has.

| role | warp 0 | warps 1 .. 3 | arrivals per stage |
|---|---|---|---|
| ``TmaProducer`` (epilogue-scaled recipes) | A, W tiles by TMA | idle | 1 (expect_tx) |
| ``RowScaleProducer`` (recipe "row") | A, W tiles by TMA | warp 1: each unit's row and column scales | 1 |
| ``BlockScaledProducer`` | A, W tiles (+ A's scales, 64-row tiles) | warp 1: block scales (``ScaleStaging``) | 1 + 32 |
| ``QuantizingProducer`` (``a_input``, 1x128) | W tiles, unquantized token tiles | quantize the token tiles | 1 + 32 |
| ``TokenQuantizingProducer`` (``a_input``, row) | as above | + each token tile's amax pass, hand-off ring | 1 + 32 |

Hooks, in the order the kernel calls them (a producer role overrides any of them):

* host (``__call__``): ``make_b_load(mB, b_smem)`` -- B's TMA load (the unquantized token tiles' stages of a
  quantizing kernel); ``make_a_scale_load(mSA)`` -- A's group scales by TMA; ``make_storage(x_smem)`` -- shared
  memory of the role's own; ``kernel_x(mB)`` -- the activations the kernel reads in global memory.
* device, every thread: ``stage_tx_bytes`` (the TMA bytes a stage's full barrier expects), ``arrivals``,
  ``init_smem`` (the role's barriers), ``b_destination`` (where B's TMA loads land).
* producer warp group: ``run(view, warp_idx)`` -- warp 0's ``TmaLoads`` (``tma_loads.py``; its ``a_tile_scales``
  and ``b_stage`` hooks), then ``helper_warps``; each warp walks the same stages (``walk``).
* consumers, per tile: ``epilogue_scales`` / ``release_epilogue_scales`` -- scales the producer staged for the
  epilogue in shared memory, as (row scales, column scales), either None where the epilogue reads its own: the
  row-wise recipe's both (``RowScaleProducer``), per-token quantization's token scales (the columns).
"""

# (no ``from __future__ import annotations``: ``make_storage``'s cute.struct reads its annotations as types)
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

from .activation_quant import (
    HANDOFF_UNITS,
    QUANT_BARRIER_ID,
    QUANT_WARPS,
    W_SCALE_SLOTS,
    ActivationQuantStaging,
    init_row_scale_barriers,
    make_row_scales,
    make_tag,
    release_token_scales,
    row_scale_floats,
    w_prefetch_floats,
    wait_token_scales,
)
from .block_scales import PRODUCER_LANES, ScaleStaging, a_scale_tma_atom, a_scale_tma_view
from .split_k import k_tile_range
from .tma_loads import ATileScalesByTma, TmaLoads
from .unit_scales import (
    SCALE_WARP_LANES,
    hand_over_unit_scales,
    init_unit_scale_barriers,
    make_unit_scales,
    release_unit_scales,
    wait_unit_scales,
)


@dataclass(frozen=True)
class ProducerView:
    """What the producer warps read, gathered by the kernel (frozen: the DSL lets it into run-time branches without
    carrying it)."""

    mainloop: object
    stage_bytes: object  # the TMA bytes of a stage (``stage_tx_bytes``)
    tma_a: object
    tma_b: object
    tAgA: object
    tBgB: object
    tAsA: object
    tBsB: object
    a_mcast_mask: object
    b_mcast_mask: object
    mSA: object  # the kernel's scales (A's are W's when swapped)
    mSB: object
    mB: object  # the kernel's B operand (the unquantized activations of a quantizing kernel)
    sB: object  # the B stages in shared memory
    b_dst: object  # where B's TMA loads land (``b_destination``)
    x_smem: object  # the unquantized tiles' stage layout (quantizing kernels), else None
    scale_slots: object  # (A, W) block-scale slots of each stage, else None
    a_scale_tma: tuple  # (TMA atom, TMA tensor, run-time flag) of A's group scales, else Nones
    smem: object  # ``init_smem``'s result
    walk: tuple  # (tiles_m, tiles_n, splits, num_clusters, cluster_id, cluster_coord, k_tiles)


class TmaProducer:
    """Warp 0 alone: each K tile's A and W tiles by TMA, multicast across the cluster (the epilogue-scaled recipes)."""

    arrivals = 1  # arrivals on a stage's full barrier: the TMA warp's expect_tx

    def __init__(self, gemm):
        self.gemm = gemm  # the kernel object: its tile shape, dtypes, stages, scheduler

    # ---- host --------------------------------------------------------------------------------------------------
    def make_b_load(self, mB, b_smem):
        """(TMA atom, TMA tensor, the unquantized tiles' stage layout or None) of B's loads."""
        g = self.gemm
        _, bN, bK = g.tile_shape_mnk
        tma_b, tB = g._make_tma_load(mB, b_smem, (bN, bK), g.cfg.cluster_shape_mn[0])
        return tma_b, tB, None

    def make_a_scale_load(self, mSA):
        """(run-time flag, TMA atom, TMA tensor) of A's group scales by TMA (``Sm90Fp8Gemm.a_scale_tma``), or Nones:
        the flag says whether this call's layout allows them (``block_scales.a_scale_tma_view``)."""
        if not self.gemm.a_scale_tma:
            return None, None, None
        a_scales_by_tma, sa_view = a_scale_tma_view(mSA)
        tma_sa, tSA = a_scale_tma_atom(sa_view, self.gemm.tile_shape_mnk[0])
        return a_scales_by_tma, tma_sa, tSA

    def make_storage(self, x_smem):
        """Define the role's own shared-memory struct (allocated after the kernel's, 128-byte aligned); returns the
        bytes it adds to the kernel's."""
        return 0

    def kernel_x(self, mB):
        """The activations in global memory, for a role that reads them itself (else None)."""
        return None

    # ---- device, every thread ----------------------------------------------------------------------------------
    def stage_tx_bytes(self, a_smem, b_smem):
        g = self.gemm
        return (cute.size_in_bytes(g.a_dtype, cute.slice_(a_smem, (None, None, 0)))
                + cute.size_in_bytes(g.b_dtype, cute.slice_(b_smem, (None, None, 0))))

    stages_unit_scales = False  # whether the kernel's struct holds the row-wise unit-scale slot (RowScaleProducer)

    def init_smem(self, smem, storage, tidx, mX):
        """Allocate and initialize the role's shared memory (one thread inits its barriers), or set up its part of
        the kernel's ``storage``; its handle, or None."""
        return None

    def b_destination(self, sB, psmem, x_smem, cluster_coord):
        """(destination stages, CTA rank, CTAs) of B's TMA loads: the B stages, multicast along the cluster's rows."""
        return sB, cluster_coord[0], self.gemm.cfg.cluster_shape_mn[0]

    # ---- producer warp group -----------------------------------------------------------------------------------
    @cute.jit
    def run(self, v: ProducerView, warp_idx):
        """Warp 0 issues the TMA loads; then the role's other warps (``helper_warps``)."""
        if warp_idx == 0:
            loads = TmaLoads(v.mainloop, v.tma_a, v.tma_b, v.tAgA, v.tBgB, v.tAsA, v.tBsB, v.a_mcast_mask,
                             v.b_mcast_mask, self.a_tile_scales(v), self.b_stage(v))
            state = self.walk(*v.walk, loads)
            v.mainloop.producer_tail(state)
        self.helper_warps(v, warp_idx)

    def a_tile_scales(self, v: ProducerView):
        """``ATileScalesByTma`` when A's group scales may ride the TMA warp's loads, else None."""
        if not self.gemm.a_scale_tma:
            return None
        tma_sa, tSA, by_tma = v.a_scale_tma
        return ATileScalesByTma(tma_sa, tSA, v.scale_slots[0], self.gemm.tile_shape_mnk[0], by_tma, v.stage_bytes)

    def b_stage(self, v: ProducerView):
        """(barriers, bytes) when B's tiles land on barriers of their own instead of the stage's (``TmaLoads``)."""
        return None

    def helper_warps(self, v: ProducerView, warp_idx):
        """Warps 1 .. 3 of the producer warp group: idle here."""

    def epilogue_scales(self, psmem, units_done):
        """(Consumers, per unit, before the epilogue.) ((the unit's row scales, column scales) in shared memory,
        either None where the epilogue reads them itself; handle)."""
        return (None, None), None

    def release_epilogue_scales(self, psmem, handle, units_done):
        """(Consumers, after the tile's ``visit``.) Release them; returns the count of units handed over."""
        return units_done

    @cute.jit
    def walk(self, tiles_m, tiles_n, splits, num_clusters, cluster_id, cluster_coord, k_tiles, role):
        """A producer warp's walk: this cluster's work units in schedule order, each unit's K tiles, one mainloop
        stage per K tile. Every producer warp of the role takes it (warp 0's ``TmaLoads``, warp 1's ``ScaleStaging``,
        warps 1..3's ``ActivationQuantStaging``), so they fill the same stages with the same K tiles:
        ``role.unit_views(tm, tn)`` once per unit, ``role.fill_stage(views, tm, tn, kt, state)`` per K tile. Returns
        the producer state past the last stage (the walk's arguments: ``ProducerView.walk``)."""
        sched = self.gemm._scheduler(tiles_m, tiles_n, splits, num_clusters)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.gemm.ab_stages)
        unit = cluster_id
        if cutlass.const_expr(self.gemm.cfg.pdl):
            # While the previous kernel finishes, start the first unit's weight tiles on their way into L2 (a
            # prefetch: L2 stays coherent with that kernel's writes, so it is safe even for a weight it writes).
            if unit < sched.num_units:
                tm, tn, split, nsplit = self.gemm._unit(sched, unit, cluster_coord, splits)
                k_begin, k_count = k_tile_range(k_tiles, nsplit, split)
                role.prefetch_weights(tm, tn, k_begin, k_count)
            # Wait for the previous kernel (its writes are then visible) before the first load. Everything this
            # grid reads or writes follows the producers' loads, so this orders the whole kernel after it.
            # (Loading weight tiles into shared memory before the wait would read a weight the previous kernel
            # may still be writing: FP8 training quantizes W right before its GEMM.)
            cute.arch.griddepcontrol_wait()
        while unit < sched.num_units:
            tm, tn, split, nsplit = self.gemm._unit(sched, unit, cluster_coord, splits)
            views = role.unit_views(tm, tn)
            k_begin, k_count = k_tile_range(k_tiles, nsplit, split)
            for i in cutlass.range(k_count, unroll=1):
                role.fill_stage(views, tm, tn, k_begin + i, state)
                state.advance()
            unit += num_clusters
        return state


class RowScaleProducer(TmaProducer):
    """``TmaProducer`` and warp 1, the scale warp of the row-wise recipe: each work unit's row and column scales into
    a shared-memory slot ahead of the unit's epilogue (``unit_scales.py``), which reads them there."""

    stages_unit_scales = True  # the kernel's struct holds the slot (``Sm90Fp8Gemm._shared_storage``)

    # ---- device, every thread ----------------------------------------------------------------------------------
    @cute.jit
    def init_smem(self, smem, storage, tidx, mX):
        bM, bN, _ = self.gemm.tile_shape_mnk
        if tidx == 0:
            init_unit_scale_barriers(storage.unit_barriers.data_ptr(), self.gemm.num_mma_threads)
        return make_unit_scales(storage.unit_rows.get_tensor(cute.make_layout(bM)),
                                storage.unit_cols.get_tensor(cute.make_layout(bN)), storage.unit_barriers.data_ptr())

    # ---- producer warp group -----------------------------------------------------------------------------------
    @cute.jit
    def helper_warps(self, v: ProducerView, warp_idx):
        if warp_idx == 1:
            tiles_m, tiles_n, splits, num_clusters, cluster_id, cluster_coord, _ = v.walk
            self.stage_scales(v.smem, v.mSA, v.mSB, tiles_m, tiles_n, splits, num_clusters, cluster_id, cluster_coord)

    @cute.jit
    def stage_scales(self, slot, mSA: cute.Tensor, mSB: cute.Tensor, tiles_m, tiles_n, splits, num_clusters,
                     cluster_id, cluster_coord):
        """(Warp 1.) Every work unit of this CTA in the consumers' order: its tile's row scales ``mSA`` (M, 1) and
        column scales ``mSB`` (1, N) (the kernel's orientation) into the slot, indices clamped into M and N."""
        bM, bN, _ = self.gemm.tile_shape_mnk
        lanes = SCALE_WARP_LANES
        row_loads = bM // lanes
        col_loads = -(-bN // lanes)
        m_last = mSA.shape[0] - 1
        n_last = mSB.shape[1] - 1
        lane = cute.arch.lane_idx()
        rows = cute.make_rmem_tensor((row_loads,), Float32)
        cols = cute.make_rmem_tensor((col_loads,), Float32)
        sched = self.gemm._scheduler(tiles_m, tiles_n, splits, num_clusters)
        if cutlass.const_expr(self.gemm.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the kernel before may be writing the scales (a quantizer)
        handed = Int32(0)
        unit = cluster_id
        while unit < sched.num_units:
            tm, tn, _, _ = self.gemm._unit(sched, unit, cluster_coord, splits)
            # The loads first: their latency runs while the consumers still hold the slot.
            for i in cutlass.range_constexpr(row_loads):
                rows[i] = Float32(mSA[cutlass.min(tm * bM + i * lanes + lane, m_last), 0])
            for i in cutlass.range_constexpr(col_loads):
                cols[i] = Float32(mSB[0, cutlass.min(tn * bN + i * lanes + lane, n_last)])
            hand_over_unit_scales(slot, rows, cols, handed, lane)
            handed += 1
            unit += num_clusters

    @cute.jit
    def epilogue_scales(self, psmem, units_done):
        wait_unit_scales(psmem, units_done)
        return (psmem.rows, psmem.cols), None

    def release_epilogue_scales(self, psmem, handle, units_done):
        release_unit_scales(psmem)
        return units_done + 1


class BlockScaledProducer(TmaProducer):
    """``TmaProducer`` and warp 1, the scale warp: each K tile's W scales and (unless they came by TMA) A scales into
    its stage (``block_scales.ScaleStaging``); every lane arrives on the stage's full barrier as its copies land."""

    arrivals = 1 + PRODUCER_LANES

    @cute.jit
    def helper_warps(self, v: ProducerView, warp_idx):
        g = self.gemm
        bM, bN, _ = g.tile_shape_mnk
        if warp_idx == 1:
            staging = ScaleStaging(v.mainloop, v.mSA, v.mSB, v.scale_slots, g.scale_gran, (bM, bN),
                                   cute.arch.lane_idx(), v.a_scale_tma[2] if g.a_scale_tma else False)
            self.walk(*v.walk, staging)
            cute.arch.cp_async_wait_group(0)


@dataclass(frozen=True)
class QuantSmem:
    """A quantizing kernel's shared memory of its own (``QuantizingProducer.init_smem``)."""

    storage: object  # the role's struct (``make_storage``)
    x_full: object  # the unquantized tiles' barriers, one per stage
    row_scales: object = None  # per token: activation_quant.RowScales


class QuantizingProducer(TmaProducer):
    """A kernel that quantizes its activations (``a_input``, ``activation_quant.py``) in 1x128 groups: warp 0 loads
    each stage's W tile onto the stage's full barrier and its unquantized token tile onto a barrier of the stage's
    own; warps 1 .. 3 take the stages in turn (``ActivationQuantStaging``), each filling its stage's FP8 token tile,
    token scales and W scales, and arrive with their 32 lanes."""

    arrivals = 1 + 32  # the TMA warp's expect_tx and the lanes of the quantizing warp that filled the stage
    per_token = False

    # ---- host --------------------------------------------------------------------------------------------------
    def make_b_load(self, mB, b_smem):
        """The unquantized activations' tile of each stage, row-major (the quantizing warps read 16-element vectors
        of a row), loaded by TMA (no clusters)."""
        _, bN, bK = self.gemm.tile_shape_mnk
        self.x_dtype = mB.element_type  # (the kernel sees B as its TMA coordinate tensor)
        x_smem = cute.make_layout((bN, bK, self.gemm.ab_stages), stride=(bK, 1, bN * bK))
        tma_b, tB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(x_smem, (None, None, 0)), (bN, bK))
        return tma_b, tB, x_smem

    def make_storage(self, x_smem):
        stages, bN = self.gemm.ab_stages, self.gemm.tile_shape_mnk[1]
        per_token = self.per_token

        @cute.struct
        class QuantStorage:
            # Each stage's unquantized activation tile and its TMA barrier; the quantizing warps' W-scale buffers.
            sX: cute.struct.Align[cute.struct.MemRange[self.x_dtype, cute.cosize(x_smem)], 128]
            x_barriers: cute.struct.MemRange[cutlass.Int64, stages]
            w_prefetch: cute.struct.Align[cute.struct.MemRange[Float32, w_prefetch_floats()], 16]
            # Per token: the token scales and the epilogue ring's barriers (activation_quant.RowScales).
            row_scales: cute.struct.Align[cute.struct.MemRange[Float32, row_scale_floats(bN) if per_token else 1], 16]
            ring_barriers: cute.struct.MemRange[cutlass.Int64, 2 * HANDOFF_UNITS if per_token else 1]

        self.storage = QuantStorage
        return QuantStorage.size_in_bytes() + 128

    # ---- device, every thread ----------------------------------------------------------------------------------
    def stage_tx_bytes(self, a_smem, b_smem):
        # The quantizing warps write the B tile themselves: TMA brings the A (weight) tile.
        return cute.size_in_bytes(self.gemm.a_dtype, cute.slice_(a_smem, (None, None, 0)))

    @cute.jit
    def init_smem(self, smem, storage, tidx, mX):
        qstorage = smem.allocate(self.storage, byte_alignment=128)
        x_full = qstorage.x_barriers.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(self.gemm.ab_stages):
                cute.arch.mbarrier_init(x_full + s, 1)  # the TMA warp's arrive with the tile's bytes
            self.init_ring_barriers(qstorage)
        return QuantSmem(qstorage, x_full, self.make_row_scales(qstorage, mX))

    def init_ring_barriers(self, qstorage):
        """(Thread 0.) Barriers of the role's epilogue hand-off: none here."""

    def make_row_scales(self, qstorage, mX):
        return None

    def b_destination(self, sB, psmem, x_smem, cluster_coord):
        """The unquantized tiles' stages (no clusters)."""
        return psmem.storage.sX.get_tensor(x_smem), 0, 1

    # ---- producer warp group -----------------------------------------------------------------------------------
    def b_stage(self, v: ProducerView):
        return v.smem.x_full, cute.size_in_bytes(self.x_dtype, cute.slice_(v.x_smem, (None, None, 0)))

    @cute.jit
    def helper_warps(self, v: ProducerView, warp_idx):
        g = self.gemm
        bM, bN, _ = g.tile_shape_mnk
        assert QUANT_WARPS == g.num_threads_per_warp_group // 32 - 1  # every warp but the TMA warp
        if warp_idx >= 1:
            w_buf = v.smem.storage.w_prefetch.get_tensor(cute.make_layout((W_SCALE_SLOTS, QUANT_WARPS)))
            quantizer = ActivationQuantStaging(
                v.mainloop, v.mB, v.b_dst, v.smem.x_full, v.mSA, w_buf, v.sB, v.scale_slots,
                g.scale_gran[0] if g.block_scaled else None, (bM, bN), warp_idx - 1,
                cute.arch.lane_idx(), make_tag(self.per_token), v.walk[6], v.smem.row_scales)
            self.walk(*v.walk, quantizer)


class TokenQuantizingProducer(QuantizingProducer):
    """``QuantizingProducer`` per token (recipe "row", FP8 or int8): at each new token tile the quantizing warps
    first find its tokens' scales over all of K, then hand them to the epilogue through a ring of ``HANDOFF_UNITS``
    units (full / empty barriers): the epilogue hooks ``epilogue_scales`` / ``release_epilogue_scales``."""

    per_token = True

    def kernel_x(self, mB):
        return mB  # the amax pass reads the token rows in global memory

    def init_ring_barriers(self, qstorage):
        init_row_scale_barriers(qstorage.ring_barriers.data_ptr(), self.gemm.num_mma_threads)

    def make_row_scales(self, qstorage, mX):
        bN = self.gemm.tile_shape_mnk[1]
        return make_row_scales(
            mX, qstorage.row_scales.get_tensor(cute.make_layout(row_scale_floats(bN))),
            qstorage.ring_barriers.data_ptr(), bN,
            pipeline.NamedBarrier(barrier_id=QUANT_BARRIER_ID, num_threads=QUANT_WARPS * 32))

    @cute.jit
    def epilogue_scales(self, psmem, units_done):
        ring_slot = wait_token_scales(psmem.row_scales, units_done)
        return (None, psmem.row_scales.ring[(None, ring_slot)]), ring_slot

    def release_epilogue_scales(self, psmem, handle, units_done):
        release_token_scales(psmem.row_scales, handle)
        return units_done + 1

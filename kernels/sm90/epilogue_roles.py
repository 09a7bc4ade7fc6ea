"""The epilogue roles of the Hopper GEMM (``fp8_gemm.Sm90Fp8Gemm``): what its consumer warp groups do with a finished
tile's accumulator. ``Sm90Fp8Gemm._setup_attributes`` binds one of them (``self.epilogue``) from the configuration;
the kernel calls its hooks and never asks which one it has.

| role | output | each tile_m x epi_n slice of a tile |
|---|---|---|
| ``TmaStoreEpilogue`` | bf16 / fp16 / fp32 | stmatrix into one of ``epi_stages`` buffers, TMA store |
| ``epilogue_quant.FP8OutputEpilogue`` | e4m3, 1x128 scales | stmatrix into one buffer, read back, quantized, stored |

Hooks, in the order the kernel calls them (an epilogue role overrides any of them):

* ``make_store(mD, d_smem)`` (host, ``__call__``): the output's TMA store atom and tensor, or ``(None, mD)``.
* ``prefetch(tma_d)`` (warp 0): prefetch the store's descriptor.
* ``setup(tiled_mma, sD, mma_tidx)`` (consumers, once): the fragment's copy into shared memory, the store pipeline,
  the epilogue's named barrier.
* ``begin(mSA, mSB)`` (consumers, once, before the first tile): what the epilogue reads once (the per-tensor scale).
* ``visit(acc, acc_f32, ...)`` (per tile): the fp32 arithmetic on the tile's accumulator -- the int8 sums converted,
  the recipe's scales, the bias. **A fusion of fp32 math (SiLU*mul, a residual add) overrides this hook**, running
  ``TmaStoreEpilogue.visit`` first and its own step after it.
* ``store_tile(...)`` (per tile): the fragment, converted to the output type, slice by slice; each slice goes out
  through ``store_slice`` (the TMA store here, the quantizer of an FP8 output), whose targets ``slice_targets``
  partitions once per tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32

from .block_scales import unrolled_fragment_loops


class TmaStoreEpilogue:
    """The plain epilogue: scale (+ bias) in fp32, convert, stage each tile_m x epi_n slice in shared memory with
    stmatrix and write it with a TMA store (which clips at the M/N edges, so partial tiles need no predication)."""

    def __init__(self, gemm):
        self.gemm = gemm  # the kernel object: its tile shape, dtypes, recipe and epilogue plan

    # ---- host --------------------------------------------------------------------------------------------------
    def make_store(self, mD, d_smem):
        """(TMA atom, TMA tensor) of the output's slice stores."""
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mD, cute.slice_(d_smem, (None, None, 0)), self.gemm.epi_tile)

    # ---- device ------------------------------------------------------------------------------------------------
    def prefetch(self, tma_d):
        cute.nvgpu.cpasync.prefetch_descriptor(tma_d)

    def setup(self, tiled_mma, sD, mma_tidx):
        """(epi: the fragment's stmatrix copy and its shared-memory view, store pipeline, epilogue barrier)."""
        g = self.gemm
        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(g.d_layout, elem_ty_d=g.d_dtype, elem_ty_acc=Float32)
        copy_atom_d = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(g.d_layout.is_m_major_c(), 4), g.d_dtype)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_d, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        epi = (tiled_copy_r2s, thr_copy_r2s.partition_D(sD), cute.shape(thr_copy_r2s.partition_S(sD)))
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=g.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, g.num_mma_threads),
        )
        epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=g.num_mma_threads)
        return epi, store_pipe, epi_barrier

    @cute.jit
    def begin(self, mSA, mSB):
        """The per-tensor recipe's scale product ``alpha`` (else None), read once before the first tile: loaded in
        each tile's epilogue, its L2 latency stands between the main loop and the first multiply of every tile."""
        alpha = None
        if cutlass.const_expr(self.gemm.cfg.recipe == "tensor"):
            if cutlass.const_expr(self.gemm.cfg.pdl):
                cute.arch.griddepcontrol_wait()  # the previous kernel may still be writing them
            alpha = Float32(mSA[0]) * Float32(mSB[0])
        return alpha

    @cute.jit
    def visit(self, acc, acc_f32, thr_mma, mD, mSA, mSB, mBias, tm, tn, alpha, staged_scales):
        """The tile's fp32 arithmetic, in ``acc_f32``: an int8 kernel's exact int32 sums (``acc``) converted, then
        the recipe's scales and the bias (``apply_scales``). The hook a fusion of fp32 math overrides."""
        if cutlass.const_expr(self.gemm.integer):
            acc_f32.store(acc.load().to(Float32))
        self.apply_scales(acc_f32, thr_mma, mD, mSA, mSB, mBias, tm, tn, alpha, staged_scales)

    @cute.jit
    def apply_scales(self, acc, thr_mma, mD, mSA, mSB, mBias, tm, tn, alpha, staged_scales=(None, None)):
        """acc <- acc * scale (+ bias) in fp32, with scale from the epilogue-scaled recipe (per-tensor: the
        product ``alpha`` read before the tile loop; row-wise: row scale x column scale, each from the tile's
        copy the producer staged in shared memory (``staged_scales``: (rows, columns)) or, where that is None,
        from global memory -- per token, the columns' scales the kernel computed)."""
        g = self.gemm
        bM, bN, _ = g.tile_shape_mnk
        M, N = mD.shape
        cD = cute.local_tile(cute.make_identity_tensor((M, N)), (bM, bN), (tm, tn))
        tCcD = thr_mma.partition_C(cD)
        if cutlass.const_expr(g.block_scaled):
            pass  # applied per K tile in the main loop
        elif cutlass.const_expr(g.cfg.recipe == "tensor"):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                acc[i] = acc[i] * alpha
        else:
            row_scales, col_scales = staged_scales
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                m, n = tCcD[i]
                # Rows/columns past the edge are clipped by the TMA store; clamp so the loads stay in bounds.
                if cutlass.const_expr(row_scales is not None):
                    sa = row_scales[m - tm * bM]
                else:
                    sa = Float32(mSA[cutlass.min(m, M - 1), 0])
                if cutlass.const_expr(col_scales is not None):
                    sb = col_scales[n - tn * bN]
                else:
                    sb = Float32(mSB[0, cutlass.min(n, N - 1)])
                acc[i] = acc[i] * (sa * sb)
        if cutlass.const_expr(g.bias_dtype is not None):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                m, n = tCcD[i]
                # The bias runs along the user's N: the kernel's rows when swapped.
                if cutlass.const_expr(g.cfg.swap_ab):
                    acc[i] = acc[i] + Float32(mBias[cutlass.min(m, M - 1)])
                else:
                    acc[i] = acc[i] + Float32(mBias[cutlass.min(n, N - 1)])

    @cute.jit
    def store_tile(self, epi, acc, tma_d, sD, gD, tm, tn, tiles_done, store_pipe, epi_barrier, warp_idx, mQ, mQs):
        """Registers -> output, one tile_m x epi_n slice at a time: each slice of the fp32 fragment converted to the
        output type, then ``store_slice`` (``mQ`` / ``mQs``: an FP8 output and its scales, else unused)."""
        g = self.gemm
        tiled_copy_r2s, tRS_sD, rD_shape = epi
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        tRS_rD = cute.make_rmem_tensor(cute.make_layout(rD_shape[:3]).shape, Float32)
        tRS_rD_out = cute.make_rmem_tensor(cute.make_layout(rD_shape[:3]).shape, g.d_dtype)
        n_per_slice = cute.size(tRS_rD)

        gD_tile = cute.zipped_divide(gD[(None, None, tm, tn)], g.epi_tile)
        slices = cute.size(gD_tile, mode=[1])
        targets = self.slice_targets(tma_d, sD, gD_tile)
        first = tiles_done * slices
        for s in cutlass.range_constexpr(slices):
            with unrolled_fragment_loops():  # register arrays: element indices must be trace-time constants
                for v in cutlass.range_constexpr(n_per_slice):
                    tRS_rD[v] = tRS_rAcc[s * n_per_slice + v]
            tRS_rD_out.store(tRS_rD.load().to(g.d_dtype))
            self.store_slice(tiled_copy_r2s, tRS_rD_out, tRS_sD, sD, s, slices, first, targets, tma_d, store_pipe,
                             epi_barrier, warp_idx, mQ, mQs, tm, tn)

    def slice_targets(self, tma_d, sD, gD_tile):
        """(shared-memory buffers, global slices, slice coordinates) of the tile's TMA stores."""
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_tile
        )
        return bSG_sD, bSG_gD, cute.make_layout(gD_tile.shape[1], stride=(gD_tile.shape[1][1], 1))

    @cute.jit
    def store_slice(self, tiled_copy_r2s, rD, tRS_sD, sD, s: cutlass.Constexpr, slices: cutlass.Constexpr, first,
                    targets, tma_d, store_pipe, epi_barrier, warp_idx, mQ, mQs, tm, tn):
        """Slice ``s`` (``rD``: this thread's converted values of it) into its buffer (stmatrix), then one warp's
        TMA store of it."""
        bSG_sD, bSG_gD, slice_layout = targets
        # A buffer per slice: slice s always uses buffer s (no run-time modulo).
        buf = s if cutlass.const_expr(self.gemm.epi_stages == slices) else (first + s) % self.gemm.epi_stages
        cute.copy(tiled_copy_r2s, rD, tRS_sD[(None, None, None, buf)])
        # stmatrix writes are generic-proxy; the TMA engine reads through the async proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_barrier.arrive_and_wait()
        if warp_idx == 4:
            cute.copy(tma_d, bSG_sD[(None, buf)], bSG_gD[(None, slice_layout.get_hier_coord(s))])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        epi_barrier.arrive_and_wait()

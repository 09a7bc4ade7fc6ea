"""Blackwell (sm_100a) persistent GEMM, tcgen05 ``kind::f8f6f4``, operand formats chosen at run time.

``D[M, N] = (scale_a * scale_b) * (A[M, K] @ B[N, K]^T) (+ bias[N])``, fp32 accumulation in tensor
memory, bf16 / fp16 / fp32 output. A and B are each any of E4M3, E5M2, E3M2, E2M3, E2M1.

The same class is the block-scaled (MX / NVFP4) GEMM when built with ``scaling=BlockScaling(kind)``
(``blockscaled_gemm``): four optional hooks, marked ``[scaling hook N]`` below, add the scale-factor
buffers, loads, ``tcgen05.cp`` + ``.block_scale`` MMAs and TMEM columns; with ``scaling=None`` none of
them is traced and the kernel is the dense f8f6f4 GEMM.

Compile-verified for sm_100a (the compile-tier tests read its PTX; the host side is unit-tested); run with
``pytest -m blackwell`` on a B200.
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.experimental import primitives as prims
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils.gemm.sm100 import (
    epilogue_smem_copy_and_partition,
    epilogue_tmem_copy_and_partition,
    transform_partitioned_tensor_layout,
)

from ..common.tile_scheduler import PersistentTileScheduler

# tcgen05 instruction-descriptor a_format / b_format codes of kind::f8f6f4 (PTX ISA, "Instruction
# descriptor"). These are the run-time kernel arguments ``fmt_a`` / ``fmt_b``.
MMA_FORMAT_CODE = {"e4m3": 0, "e5m2": 1, "e2m3": 3, "e3m2": 4, "e2m1": 5}
# Global-memory storage class of each code: which of the three TMA descriptors loads the operand.
STORAGE_8BIT, STORAGE_6BIT, STORAGE_4BIT = 0, 1, 2
STORAGE_OF_CODE = {0: STORAGE_8BIT, 1: STORAGE_8BIT, 3: STORAGE_6BIT, 4: STORAGE_6BIT, 5: STORAGE_4BIT}
# DSL element type of each storage view; the sub-byte views go through TMA's unpacking formats
# (.b6x16_p32 / .b4x16_p64), which land one element per byte in shared memory.
STORAGE_VIEW_DTYPE = {
    STORAGE_8BIT: cutlass.Uint8,
    STORAGE_6BIT: cutlass.Float6E2M3FN,
    STORAGE_4BIT: cutlass.Float4E2M1FN,
}
# K elements per 16-byte padded shared-memory row chunk is the same for every view, so one K tile of
# 128 elements is one 128-byte swizzle row whatever the operand type.
TILE_K = 128
MMA_K = 32


class Sm100F8F6F4Gemm:
    """Persistent, warp-specialized tcgen05 GEMM whose operand types are run-time values.

    ======================  ==========================================================================
    Warp role               Work
    ======================  ==========================================================================
    warps 0-3  epilogue     allocate TMEM (warp 0); per tile: wait ``acc_full``, tcgen05.ld sub-tiles,
                            ``* scale_a * scale_b (+ bias[n])``, convert, st.shared, TMA store;
                            arrive ``acc_empty``; free TMEM at exit
    warp 4     MMA          leader CTA only: wait ``ab_full``, 4 x ``tcgen05.mma.kind::f8f6f4`` per
                            K tile (K=32 each) with the instruction descriptor built from the run-time
                            format codes, ``tcgen05.commit`` -> ``ab_empty``; per tile commit -> ``acc_full``
    warp 5     TMA          wait ``ab_empty``, pick the TMA descriptor of each operand's storage class
                            (8-bit / 6-bit unpack / 4-bit unpack) and load the A and B K tiles
    ======================  ==========================================================================

    ===================  ================================  ============================================
    Pipeline             Producer -> consumer              Stages
    ===================  ================================  ============================================
    ``ab`` (smem)        TMA warp -> MMA warp              as many 8-bit A+B stages as fit (``num_ab_stage``)
    ``acc`` (TMEM)       MMA warp -> epilogue warps        2 accumulators of ``tile_n`` fp32 columns
    ``c`` (smem)         epilogue warps -> TMA store       2 output sub-tile buffers
    ===================  ================================  ============================================

    Shared memory holds every operand as one byte per element (FP8 as is, FP6/FP4 unpacked by TMA into
    16-byte containers), so stages, swizzle (128B, K-major) and MMA smem descriptors do not depend on
    the operand types. That is what lets one compiled kernel serve all 25 type pairs.

    ``use_2cta``: ``cta_group::2`` with a (2, 1) cluster, MMA tile 256 x ``tile_n``; each CTA loads
    128 rows of A and ``tile_n / 2`` rows of B, the leader CTA issues the MMA.

    ``scaling`` (a ``blockscaled_gemm.BlockScaling``) turns on the block-scaled variant, entered through
    :meth:`call_block_scaled`: the TMA warp also loads each stage's SFA / SFB tiles (same ``ab``
    stages, counted in the same ``expect_tx``), the MMA warp copies them to TMEM with ``tcgen05.cp`` and
    issues ``tcgen05.mma.kind::{mxf8f6f4,mxf4,mxf4nvf4}.block_scale``; the epilogue's
    ``scale_a * scale_b`` carries NVFP4's per-tensor global scales (device values, 1.0 for MX). The
    packed FP4 kinds keep their operands packed in shared memory (one 128-byte row = 256 elements), so
    only the 8-bit TMA view is built and a K tile is 256 elements.
    """

    def __init__(
        self,
        out_dtype: Type[cutlass.Numeric] = cutlass.BFloat16,
        use_2cta: bool = False,
        tile_n: int = 128,
        has_bias: bool = False,
        scaling=None,
    ):
        self.check_config(out_dtype, use_2cta, tile_n)
        self.c_dtype = out_dtype
        self.acc_dtype = cutlass.Float32
        self.use_2cta_instrs = use_2cta
        self.has_bias = has_bias
        self.mma_tiler = (256 if use_2cta else 128, tile_n, TILE_K)
        self.cluster_shape_mn = (2, 1) if use_2cta else (1, 1)
        self.cta_group = tcgen05.CtaGroup.TWO if use_2cta else tcgen05.CtaGroup.ONE
        self.prim_cta_group = prims.CTAGroup.CTA_2 if use_2cta else prims.CTAGroup.CTA_1
        self.epilogue_warp_id = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.threads_per_cta = 32 * 6
        self.epilog_sync_bar_id = 1
        self.tmem_alloc_sync_bar_id = 2
        self.num_acc_stage = 2
        self.num_c_stage = 2
        self.group_m = 8
        self.smem_capacity = 232448  # sm_100 dynamic shared memory per CTA
        self.c_layout = LayoutEnum.ROW_MAJOR
        # Static part of the instruction descriptor: fp32 accumulator, K-major A and B, M and N.
        # a_format (bits 7-9) and b_format (bits 10-12) are OR-ed in at run time.
        self.idesc_static = self._static_idesc(self.mma_tiler[0], tile_n)
        self.scaling = scaling
        self.tile_k = TILE_K  # K elements per 128-byte smem row
        self.storages = (STORAGE_8BIT, STORAGE_6BIT, STORAGE_4BIT)  # TMA views built per operand
        if scaling is not None:
            scaling.configure(tile_n, use_2cta, self.mma_tiler[0])
            self.idesc_static = scaling.idesc_static
            self.tile_k = scaling.tile_k
            if scaling.packed_fp4:
                self.storages = (STORAGE_8BIT,)

    @staticmethod
    def check_config(out_dtype, use_2cta: bool, tile_n: int) -> None:
        """The configuration rules, checked without building anything (the block-scaled ones:
        ``blockscaled_gemm.ScaleGeometry``)."""
        if out_dtype not in (cutlass.BFloat16, cutlass.Float16, cutlass.Float32):
            raise TypeError(f"out_dtype must be cutlass.BFloat16, Float16 or Float32, got {out_dtype}")
        if tile_n not in (64, 128, 256) or (use_2cta and tile_n < 128):
            raise ValueError(f"tile_n must be 64, 128 or 256 (>= 128 with 2-CTA), got {tile_n}")

    @staticmethod
    def _static_idesc(m: int, n: int) -> int:
        """Instruction descriptor bits that are fixed at compile time (PTX ISA tcgen05 idesc table)."""
        c_format_f32 = 1
        return (c_format_f32 << 4) | ((n >> 3) << 17) | ((m >> 4) << 24)

    # ------------------------------------------------------------------------------------------
    # Host-side (trace time) setup
    # ------------------------------------------------------------------------------------------

    def _setup(self):
        # The tiled MMA only provides partitioning and layouts (all 8-bit in smem); the MMA itself is
        # issued with the low-level primitive so its type fields can be run-time values.
        self.tiled_mma = utils.sm100.make_trivial_tiled_mma(
            cutlass.Float8E4M3FN,
            cutlass.Float8E4M3FN,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            self.cta_group,
            self.mma_tiler[:2],
        )
        self.atom_thr = cute.size(self.tiled_mma.thr_id.shape)
        self.cta_tile_shape_mnk = (self.mma_tiler[0] // self.atom_thr, self.mma_tiler[1], self.mma_tiler[2])
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (self.tiled_mma.thr_id.shape,)
        )
        self.epi_tile = utils.sm100.compute_epilogue_tile_shape(
            self.cta_tile_shape_mnk, self.use_2cta_instrs, self.c_layout, self.c_dtype
        )
        smem_8bit = cutlass.Float8E4M3FN  # any 8-bit type: picks the 128B K-major swizzle atom
        a_one = utils.sm100.make_smem_layout_a(self.tiled_mma, self.mma_tiler, smem_8bit, 1)
        b_one = utils.sm100.make_smem_layout_b(self.tiled_mma, self.mma_tiler, smem_8bit, 1)
        c_one = utils.sm100.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 1)
        ab_bytes = cute.size_in_bytes(cutlass.Uint8, a_one) + cute.size_in_bytes(cutlass.Uint8, b_one)
        c_bytes = cute.size_in_bytes(self.c_dtype, c_one) * self.num_c_stage
        # [scaling hook 1] a stage also holds its SFA / SFB tiles
        sf_bytes = 0 if self.scaling is None else self.scaling.stage_bytes
        self.num_ab_stage = (self.smem_capacity - 1024 - c_bytes) // (ab_bytes + sf_bytes)
        self.smem_bytes = 1024 + self.num_ab_stage * (ab_bytes + sf_bytes) + c_bytes
        self.a_smem_layout_staged = utils.sm100.make_smem_layout_a(
            self.tiled_mma, self.mma_tiler, smem_8bit, self.num_ab_stage
        )
        self.b_smem_layout_staged = utils.sm100.make_smem_layout_b(
            self.tiled_mma, self.mma_tiler, smem_8bit, self.num_ab_stage
        )
        self.c_smem_layout_staged = utils.sm100.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.num_c_stage
        )
        # The hand-built MMA smem descriptors assume the canonical K-major SW128 atom: 8 rows x 128 B.
        inner = self.a_smem_layout_staged.inner
        if str(inner) != "S<3,4,3>" or str(self.b_smem_layout_staged.inner) != "S<3,4,3>":
            raise RuntimeError(f"expected 128B-swizzled K-major smem for 8-bit operands, got {inner}")
        self.a_stage_bytes = cute.size_in_bytes(cutlass.Uint8, a_one)
        self.b_stage_bytes = cute.size_in_bytes(cutlass.Uint8, b_one)
        acc_shape = self.tiled_mma.partition_shape_C(self.mma_tiler[:2])
        acc_fake = self.tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
        self.num_tmem_alloc_cols = get_num_tmem_alloc_cols(acc_fake, arch="sm_100")
        if self.scaling is not None:  # [scaling hook 4] scale columns after the accumulators
            self.num_tmem_alloc_cols = self.scaling.geom.tmem_cols(self.num_acc_stage * self.mma_tiler[1])
        # Upper bound (both operands 8-bit); the TMA warp sets the real per-stage count at run time.
        self.num_tma_load_bytes = (self.a_stage_bytes + self.b_stage_bytes + sf_bytes) * self.atom_thr
        if (cute.size(acc_fake.layout.shape[3]) != self.num_acc_stage
                or acc_fake.layout.stride[3] != self.mma_tiler[1]):
            raise RuntimeError(f"unexpected TMEM accumulator layout {acc_fake.layout}: stages must be tile_n "
                               "columns apart")

    def _operand_view(self, t: cute.Tensor, storage: int) -> cute.Tensor:
        """(rows, K, 1) view of a K-major byte tensor in the element type of one storage class."""
        if storage == STORAGE_8BIT:
            v = t
        else:
            v = cute.recast_tensor(t, STORAGE_VIEW_DTYPE[storage])
        rows, k = v.shape
        return cute.make_tensor(
            v.iterator, cute.make_layout((rows, k, 1), stride=(v.layout.stride[0], 1, 0))
        )

    def _make_tma_loads(self, views, smem_layout_staged, make_atom, op):
        smem_layout = cute.slice_(smem_layout_staged, (None, None, None, 0))
        atoms = []
        for storage, view in enumerate(views):
            if storage not in self.storages:  # packed FP4 kinds: no unpacking views
                atoms.append((None, None))
                continue
            atom, tensor = make_atom(
                op,
                view,
                smem_layout,
                self.mma_tiler,
                self.tiled_mma,
                self.cluster_layout_vmnk.shape,
                internal_type=None if storage == STORAGE_8BIT else cutlass.Uint8,
            )
            atoms.append((atom, tensor))
        return atoms

    @cute.jit
    def __call__(
        self,
        a8: cute.Tensor,
        a6: cute.Tensor,
        a4: cute.Tensor,
        b8: cute.Tensor,
        b6: cute.Tensor,
        b4: cute.Tensor,
        c: cute.Tensor,
        scale_a: cute.Tensor,
        scale_b: cute.Tensor,
        bias: cute.Tensor,
        k: cutlass.Int32,
        fmt_a: cutlass.Int32,
        fmt_b: cutlass.Int32,
        max_active_clusters: cutlass.Int32,
        stream,
    ):
        """Operands come as uint8 byte tensors, one per storage class (8-bit, packed 6-bit, packed
        4-bit); the host passes the real operand in its class and a small aligned dummy in the other
        two, so every TMA descriptor encodes validly while only the active one is ever used."""
        if cutlass.const_expr(self.scaling is not None):
            raise TypeError("a kernel built with scaling= is entered through call_block_scaled")
        self._launch(a8, a6, a4, b8, b6, b4, None, None, c, scale_a, scale_b, bias, k, fmt_a, fmt_b,
                     max_active_clusters, stream)

    @cute.jit
    def call_block_scaled(
        self,
        a8: cute.Tensor,
        a6: cute.Tensor,
        a4: cute.Tensor,
        b8: cute.Tensor,
        b6: cute.Tensor,
        b4: cute.Tensor,
        sfa: cute.Tensor,
        sfb: cute.Tensor,
        c: cute.Tensor,
        scale_a: cute.Tensor,
        scale_b: cute.Tensor,
        bias: cute.Tensor,
        k: cutlass.Int32,
        fmt_a: cutlass.Int32,
        fmt_b: cutlass.Int32,
        max_active_clusters: cutlass.Int32,
        stream,
    ):
        """Block-scaled entry: as ``__call__`` plus ``sfa`` / ``sfb``, the SWIZZLE_32_4_4 blocked scales as
        int32 words of shape (row blocks of 128, scale-column blocks of 4 x 128); ``scale_a`` / ``scale_b``
        are the per-tensor global scales (NVFP4) or ones. Packed FP4 kinds take the packed bytes in
        ``a8`` / ``b8``; their other views are ignored."""
        if cutlass.const_expr(self.scaling is None):
            raise TypeError("call_block_scaled needs a kernel built with scaling=BlockScaling(kind)")
        self._launch(a8, a6, a4, b8, b6, b4, sfa, sfb, c, scale_a, scale_b, bias, k, fmt_a, fmt_b,
                     max_active_clusters, stream)

    def _launch(self, a8, a6, a4, b8, b6, b4, sfa, sfb, c, scale_a, scale_b, bias, k, fmt_a, fmt_b,
                max_active_clusters, stream):
        self._setup()
        a_views = [self._operand_view(t, s) for s, t in enumerate((a8, a6, a4))]
        b_views = [self._operand_view(t, s) for s, t in enumerate((b8, b6, b4))]
        a_op = utils.sm100.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, self.tiled_mma.thr_id)
        b_op = utils.sm100.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, self.tiled_mma.thr_id)
        tma_a = self._make_tma_loads(a_views, self.a_smem_layout_staged, cute.nvgpu.make_tiled_tma_atom_A, a_op)
        tma_b = self._make_tma_loads(b_views, self.b_smem_layout_staged, cute.nvgpu.make_tiled_tma_atom_B, b_op)
        tma_sf = ((None, None), (None, None))
        if cutlass.const_expr(self.scaling is not None):  # [scaling hook 2] scale TMA descriptors
            tma_sf = self.scaling.make_tma_loads(sfa, sfb)
        m, n = c.shape
        c3 = cute.make_tensor(c.iterator, cute.make_layout((m, n, 1), stride=(c.layout.stride[0], 1, 0)))
        epi_smem = cute.select(self.c_smem_layout_staged, mode=[0, 1])
        tma_atom_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c3, epi_smem, self.epi_tile
        )
        tiles_m = (m + self.cta_tile_shape_mnk[0] - 1) // self.cta_tile_shape_mnk[0]
        tiles_n = (n + self.mma_tiler[1] - 1) // self.mma_tiler[1]
        k_tiles = (k + self.tile_k - 1) // self.tile_k
        units = ((tiles_m + self.cluster_shape_mn[0] - 1) // self.cluster_shape_mn[0]) * tiles_n
        num_clusters = cutlass.min(units, max_active_clusters)
        self.kernel(
            self.tiled_mma, self.cluster_layout_vmnk, self.a_smem_layout_staged, self.b_smem_layout_staged,
            self.c_smem_layout_staged, self.epi_tile,
            tma_a[0][0], tma_a[0][1], tma_a[1][0], tma_a[1][1], tma_a[2][0], tma_a[2][1],
            tma_b[0][0], tma_b[0][1], tma_b[1][0], tma_b[1][1], tma_b[2][0], tma_b[2][1],
            tma_atom_c, tma_tensor_c, tma_sf[0][0], tma_sf[0][1], tma_sf[1][0], tma_sf[1][1],
            scale_a, scale_b, bias, tiles_m, tiles_n, k_tiles, n, fmt_a, fmt_b,
        ).launch(
            grid=[self.cluster_shape_mn[0], self.cluster_shape_mn[1], num_clusters],
            block=[self.threads_per_cta, 1, 1],
            cluster=[self.cluster_shape_mn[0], self.cluster_shape_mn[1], 1],
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # Device kernel
    # ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        cluster_layout_vmnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        c_smem_layout_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
        tma_atom_a8: cute.CopyAtom, mA8: cute.Tensor,
        tma_atom_a6: cute.CopyAtom, mA6: cute.Tensor,
        tma_atom_a4: cute.CopyAtom, mA4: cute.Tensor,
        tma_atom_b8: cute.CopyAtom, mB8: cute.Tensor,
        tma_atom_b6: cute.CopyAtom, mB6: cute.Tensor,
        tma_atom_b4: cute.CopyAtom, mB4: cute.Tensor,
        tma_atom_c: cute.CopyAtom, mC: cute.Tensor,
        tma_atom_sfa, mSFA, tma_atom_sfb, mSFB,  # None without scaling
        scale_a: cute.Tensor, scale_b: cute.Tensor, bias: cute.Tensor,
        tiles_m: cutlass.Int32, tiles_n: cutlass.Int32, k_tiles: cutlass.Int32, n_size: cutlass.Int32,
        fmt_a: cutlass.Int32, fmt_b: cutlass.Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, bidz = cute.arch.block_idx()
        _, _, num_clusters = cute.arch.grid_dim()
        use_2cta = self.use_2cta_instrs
        mma_coord_v = bidx % self.atom_thr
        is_leader_cta = mma_coord_v == 0
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank)

        # Storage class of each operand (0: 8-bit, 1: packed 6-bit, 2: packed 4-bit), from its code;
        # always 0 for the packed FP4 kinds, which load their packed bytes through the 8-bit view.
        store_a = cutlass.Int32(0)
        store_b = cutlass.Int32(0)
        if cutlass.const_expr(len(self.storages) == 3):
            if fmt_a >= 5:
                store_a = cutlass.Int32(2)
            elif fmt_a >= 3:
                store_a = cutlass.Int32(1)
            if fmt_b >= 5:
                store_b = cutlass.Int32(2)
            elif fmt_b >= 3:
                store_b = cutlass.Int32(1)

        if warp_idx == self.tma_warp_id:
            for atom in (tma_atom_a8, tma_atom_a6, tma_atom_a4, tma_atom_b8, tma_atom_b6, tma_atom_b4, tma_atom_c,
                         tma_atom_sfa, tma_atom_sfb):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_holding_buf: cutlass.Int32

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)

        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.num_tma_load_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        ).make_participants()
        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, len(self.epilogue_warp_id) * (2 if use_2cta else 1)
            ),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=self.tmem_alloc_sync_bar_id,
                num_threads=32 * (1 + len(self.epilogue_warp_id)),
            ),
            allocator_warp_id=self.epilogue_warp_id[0],
            is_two_cta=use_2cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
        )
        pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)

        # 1024-byte alignment: the 128B swizzle pattern is keyed on absolute smem address bits.
        sA = smem.allocate_tensor(
            element_type=cutlass.Uint8,
            layout=a_smem_layout_staged.outer,
            byte_alignment=1024,
            swizzle=a_smem_layout_staged.inner,
        )
        sB = smem.allocate_tensor(
            element_type=cutlass.Uint8,
            layout=b_smem_layout_staged.outer,
            byte_alignment=1024,
            swizzle=b_smem_layout_staged.inner,
        )
        sC = smem.allocate_tensor(
            element_type=self.c_dtype,
            layout=c_smem_layout_staged.outer,
            byte_alignment=128,
            swizzle=c_smem_layout_staged.inner,
        )
        sSFA = sSFB = sf_parts = None
        if cutlass.const_expr(self.scaling is not None):  # [scaling hook 1] per-stage scale buffers
            sSFA, sSFB = self.scaling.allocate_smem(smem, self.num_ab_stage)
            sf_parts = self.scaling.partition(tma_atom_sfa, mSFA, sSFA, tma_atom_sfb, mSFB, sSFB)

        thr_mma = tiled_mma.get_slice(mma_coord_v)
        a_tile = cute.slice_(self.mma_tiler, (None, 0, None))
        b_tile = cute.slice_(self.mma_tiler, (0, None, None))
        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape)

        # Partition all storage views of each operand; the TMA warp picks one per run.
        a_part = (thr_mma.partition_A, a_tile, cluster_coord_vmnk[2], a_cta_layout)
        b_part = (thr_mma.partition_B, b_tile, cluster_coord_vmnk[1], b_cta_layout)
        tAsA, tAgA8 = self._tma_part(tma_atom_a8, mA8, sA, *a_part)
        tBsB, tBgB8 = self._tma_part(tma_atom_b8, mB8, sB, *b_part)
        tAgA6 = tAgA4 = tBgB6 = tBgB4 = None
        if cutlass.const_expr(len(self.storages) == 3):
            _, tAgA6 = self._tma_part(tma_atom_a6, mA6, sA, *a_part)
            _, tAgA4 = self._tma_part(tma_atom_a4, mA4, sA, *a_part)
            _, tBgB6 = self._tma_part(tma_atom_b6, mB6, sB, *b_part)
            _, tBgB4 = self._tma_part(tma_atom_b4, mB4, sB, *b_part)

        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
        gC = cute.local_tile(mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        tCgC = thr_mma.partition_C(gC)
        cC = cute.local_tile(
            cute.make_identity_tensor(mC.shape), cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None)
        )
        tCcC = thr_mma.partition_C(cC)

        pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        # ---------------------------------------------------------------- TMA warp
        if warp_idx == self.tma_warp_id:
            # complete_tx counts the bytes TMA reads from global memory, i.e. the packed size: 8, 6 or
            # 4 bits per element depending on the run-time storage class (same rule as the DSL's
            # blockscaled mxf8f6f4 kernels and TensorMap.global_tx_bytes).
            bits_a = 8 - 2 * store_a
            bits_b = 8 - 2 * store_b
            tx_bytes = (self.a_stage_bytes * bits_a + self.b_stage_bytes * bits_b) // 8 * self.atom_thr
            if cutlass.const_expr(self.scaling is not None):  # [scaling hook 2] the scale tiles' bytes
                tx_bytes = tx_bytes + self.scaling.stage_bytes * self.atom_thr
            sched = PersistentTileScheduler(tiles_m, tiles_n, self.cluster_shape_mn, self.group_m)
            unit = bidz
            while unit < sched.num_units:
                tm, tn, _ = sched.coords(unit, bidx, bidy)
                mma_m = tm // self.atom_thr
                ab_producer.reset()
                for kt in cutlass.range(0, k_tiles, 1, unroll=1):
                    handle = ab_producer.acquire_and_advance(expected_tx=tx_bytes)
                    sa = tAsA[(None, handle.index)]
                    sb = tBsB[(None, handle.index)]
                    if cutlass.const_expr(len(self.storages) == 1):
                        cute.copy(tma_atom_a8, tAgA8[(None, mma_m, kt, 0)], sa, tma_bar_ptr=handle.barrier)
                        cute.copy(tma_atom_b8, tBgB8[(None, tn, kt, 0)], sb, tma_bar_ptr=handle.barrier)
                    else:
                        if store_a == 0:
                            cute.copy(tma_atom_a8, tAgA8[(None, mma_m, kt, 0)], sa, tma_bar_ptr=handle.barrier)
                        elif store_a == 1:
                            cute.copy(tma_atom_a6, tAgA6[(None, mma_m, kt, 0)], sa, tma_bar_ptr=handle.barrier)
                        else:
                            cute.copy(tma_atom_a4, tAgA4[(None, mma_m, kt, 0)], sa, tma_bar_ptr=handle.barrier)
                        if store_b == 0:
                            cute.copy(tma_atom_b8, tBgB8[(None, tn, kt, 0)], sb, tma_bar_ptr=handle.barrier)
                        elif store_b == 1:
                            cute.copy(tma_atom_b6, tBgB6[(None, tn, kt, 0)], sb, tma_bar_ptr=handle.barrier)
                        else:
                            cute.copy(tma_atom_b4, tBgB4[(None, tn, kt, 0)], sb, tma_bar_ptr=handle.barrier)
                    if cutlass.const_expr(self.scaling is not None):
                        # [scaling hook 2] SFA of this CTA's 128 rows (row block tm), SFB of the N tile
                        self.scaling.load(tma_atom_sfa, tma_atom_sfb, sf_parts, handle.index, kt, tm, tn,
                                          handle.barrier)
                unit += num_clusters
            ab_producer.tail()

        # ---------------------------------------------------------------- MMA warp
        if warp_idx == self.mma_warp_id:
            tmem.wait_for_alloc()
            # Raw TMEM address (lane << 16 | column) for the low-level MMA; each accumulator stage is
            # tile_n fp32 columns of 128 lanes.
            tmem_addr = cute.make_tensor(storage.tmem_holding_buf.ptr, cute.make_layout(1))[0]
            # Run-time operand types go straight into the instruction descriptor.
            sfa_smem = sfb_smem = sfa_tmem = sfb_tmem = None
            if cutlass.const_expr(self.scaling is None):
                idesc = cutlass.Int32(self.idesc_static) | (fmt_a << 7) | (fmt_b << 10)
            else:
                idesc = self.scaling.runtime_idesc(fmt_a, fmt_b)
                # [scaling hook 4] SFA then SFB columns right after the accumulator stages
                sfa_tmem = tmem_addr + self.num_acc_stage * self.mma_tiler[1]
                sfb_tmem = sfa_tmem + self.scaling.geom.sfa_tmem_cols
                sfa_smem = sSFA.iterator.toint()
                sfb_smem = sSFB.iterator.toint()
            a_base = sA.iterator.toint()
            b_base = sB.iterator.toint()
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_acc_stage)
            sched = PersistentTileScheduler(tiles_m, tiles_n, self.cluster_shape_mn, self.group_m)
            unit = bidz
            while unit < sched.num_units:
                acc_tmem = cutlass.inttoptr(
                    tmem_addr + acc_state.index * self.mma_tiler[1], cutlass.AddressSpace.tmem, cutlass.Float32
                )
                ab_consumer.reset()
                if is_leader_cta:
                    acc_pipeline.producer_acquire(acc_state)
                    for kt in cutlass.range(0, k_tiles, 1, unroll=1):
                        handle = ab_consumer.wait_and_advance()
                        a_stage = a_base + handle.index * self.a_stage_bytes
                        b_stage = b_base + handle.index * self.b_stage_bytes
                        if cutlass.const_expr(self.scaling is not None):  # [scaling hook 3] scales -> TMEM
                            with cute.arch.elect_one():
                                self.scaling.copy_scales(sfa_smem, sfb_smem, handle.index, sfa_tmem, sfb_tmem)
                        for kb in cutlass.range_constexpr(TILE_K // MMA_K):
                            # K-major SW128: one K block of 32 one-byte elements (or 64 packed FP4)
                            # is 32 bytes along the swizzled row; 8-row groups are 1024 bytes apart.
                            desc_a = prims.Tcgen05SmemDesc.build(
                                start_address=cutlass.Int32(a_stage + kb * MMA_K),
                                leading_byte_offset=16,
                                stride_byte_offset=1024,
                                layout=prims.Tcgen05SmemSwizzle.SWIZZLE_128B,
                            )
                            desc_b = prims.Tcgen05SmemDesc.build(
                                start_address=cutlass.Int32(b_stage + kb * MMA_K),
                                leading_byte_offset=16,
                                stride_byte_offset=1024,
                                layout=prims.Tcgen05SmemSwizzle.SWIZZLE_128B,
                            )
                            accumulate = (kt > 0) | (kb > 0)
                            with cute.arch.elect_one():
                                if cutlass.const_expr(self.scaling is None):
                                    prims.tcgen05_mma(
                                        prims.Tcgen05MMAKind.F8F6F4,
                                        self.prim_cta_group,
                                        acc_tmem,
                                        desc_a,
                                        desc_b,
                                        idesc,
                                        accumulate,
                                    )
                                else:  # [scaling hook 3] block-scaled MMA with this step's scale ids
                                    self.scaling.mma(kb, acc_tmem, desc_a, desc_b, idesc, accumulate, sfa_tmem,
                                                     sfb_tmem)
                        handle.release()
                    acc_pipeline.producer_commit(acc_state)
                acc_state.advance()
                unit += num_clusters
            acc_pipeline.producer_tail(acc_state)

        # ---------------------------------------------------------------- epilogue warps
        if warp_idx < self.mma_warp_id:
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
            alpha = scale_a[0] * scale_b[0]
            c_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.num_c_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(self.epilogue_warp_id)),
            )
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_acc_stage)
            sched = PersistentTileScheduler(tiles_m, tiles_n, self.cluster_shape_mn, self.group_m)
            unit = bidz
            tiles_done = cutlass.Int32(0)
            while unit < sched.num_units:
                tm, tn, _ = sched.coords(unit, bidx, bidy)
                acc_state = self._epilogue_tile(
                    tidx, warp_idx, tma_atom_c, tCtAcc_base, sC, tCgC, tCcC, bias, n_size, alpha, epi_tile,
                    (tm // self.atom_thr, tn, 0), tiles_done, acc_state, acc_pipeline, c_pipeline,
                )
                tiles_done += 1
                unit += num_clusters
            c_pipeline.producer_tail()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

    @staticmethod
    def _tma_part(atom, mX, sX, partition, tile, cta_coord, cta_layout):
        tCgX = partition(cute.local_tile(mX, tile, (None, None, None)))
        return cpasync.tma_partition(atom, cta_coord, cta_layout, cute.group_modes(sX, 0, 3),
                                     cute.group_modes(tCgX, 0, 3))

    @cute.jit
    def _epilogue_tile(
        self,
        tidx: cutlass.Int32,
        warp_idx: cutlass.Int32,
        tma_atom_c: cute.CopyAtom,
        tCtAcc_base: cute.Tensor,
        sC: cute.Tensor,
        tCgC_base: cute.Tensor,
        tCcC_base: cute.Tensor,
        bias: cute.Tensor,
        n_size: cutlass.Int32,
        alpha: cutlass.Float32,
        epi_tile: cute.Tile,
        mma_tile_coord_mnl,
        tiles_done: cutlass.Int32,
        acc_state,
        acc_pipeline,
        c_pipeline,
    ):
        """One output tile: TMEM -> registers -> scale (+ bias) -> smem -> TMA store, in sub-tiles."""
        tCgC = transform_partitioned_tensor_layout(tCgC_base)
        tCcC = transform_partitioned_tensor_layout(tCcC_base)
        tCtAcc = transform_partitioned_tensor_layout(tCtAcc_base)
        tiled_copy_t2r, tTR_tAcc_base, tTR_rAcc = epilogue_tmem_copy_and_partition(
            self, tidx, tCtAcc, tCgC, epi_tile, self.use_2cta_instrs
        )
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
        tiled_copy_r2s, tRS_rC, tRS_sC = epilogue_smem_copy_and_partition(self, tiled_copy_t2r, tTR_rC, tidx, sC)
        tCgC_epi = cute.flat_divide(tCgC, epi_tile)
        bSG_sC, bSG_gC_all = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(tCgC_epi, 0, 2)
        )
        bSG_gC = bSG_gC_all[(None, None, None, *mma_tile_coord_mnl)]
        bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
        # Output coordinates of each accumulator register, for the bias column.
        thr_t2r = tiled_copy_t2r.get_slice(tidx)
        tTR_cC_all = thr_t2r.partition_D(cute.flat_divide(tCcC, epi_tile))
        tTR_cC = tTR_cC_all[(None, None, None, None, None, *mma_tile_coord_mnl)]
        tTR_cC = cute.group_modes(tTR_cC, 3, cute.rank(tTR_cC))

        tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_state.index)]
        tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
        epi_bar = pipeline.NamedBarrier(barrier_id=self.epilog_sync_bar_id, num_threads=32 * len(self.epilogue_warp_id))

        acc_pipeline.consumer_wait(acc_state)
        subtiles = cute.size(tTR_tAcc.shape, mode=[3])
        for s in cutlass.range(subtiles):
            cute.copy(tiled_copy_t2r, tTR_tAcc[(None, None, None, s)], tTR_rAcc)
            if cutlass.const_expr(self.has_bias):
                coords = tTR_cC[(None, None, None, s)]
                for i in cutlass.range_constexpr(cute.size(tTR_rAcc)):
                    col = cutlass.min(coords[i][1], n_size - 1)
                    tTR_rAcc[i] = tTR_rAcc[i] * alpha + bias[col]
                acc = tiled_copy_r2s.retile(tTR_rAcc).load()
            else:
                acc = tiled_copy_r2s.retile(tTR_rAcc).load() * alpha
            tRS_rC.store(acc.to(self.c_dtype))
            buf = (tiles_done * subtiles + s) % self.num_c_stage
            cute.copy(tiled_copy_r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_bar.arrive_and_wait()
            if warp_idx == self.epilogue_warp_id[0]:
                cute.copy(tma_atom_c, bSG_sC[(None, buf)], bSG_gC[(None, s)])
                c_pipeline.producer_commit()
                c_pipeline.producer_acquire()
            epi_bar.arrive_and_wait()
        with cute.arch.elect_one():
            acc_pipeline.consumer_release(acc_state)
        acc_state.advance()
        return acc_state


def describe_tma_loads(kernel: Sm100F8F6F4Gemm) -> dict:
    """Trace only the host-side TMA setup and return, per storage class, the TMA atom's IR type
    (which names the tensor-map data format and the bits one K tile copies from global memory)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    found = {}

    @cute.jit
    def probe(v8: cute.Tensor, v6: cute.Tensor, v4: cute.Tensor):
        kernel._setup()
        views = [kernel._operand_view(t, s) for s, t in enumerate((v8, v6, v4))]
        op = utils.sm100.cluster_shape_to_tma_atom_A(kernel.cluster_shape_mn, kernel.tiled_mma.thr_id)
        loads = kernel._make_tma_loads(views, kernel.a_smem_layout_staged, cute.nvgpu.make_tiled_tma_atom_A, op)
        for storage, (atom, _) in enumerate(loads):
            if atom is not None:  # packed FP4 block-scaled kinds build the 8-bit view only
                found[storage] = str(atom._trait.value.type)

    def fake(div):
        shape = (cute.sym_int(), cute.sym_int(divisibility=div))
        return make_fake_compact_tensor(cutlass.Uint8, shape, stride_order=(1, 0), assumed_align=32)

    cute.compile(probe, fake(16), fake(96), fake(64))
    return found


def describe_resources(kernel: Sm100F8F6F4Gemm) -> dict:
    """Trace only the host-side setup and return the budgets it chose: ``ab`` stages, shared memory
    bytes (barrier block + stages + epilogue buffers), TMEM columns and the per-stage TMA byte bound."""
    found = {}

    @cute.jit
    def probe():
        kernel._setup()
        found.update(
            num_ab_stage=kernel.num_ab_stage, smem_bytes=kernel.smem_bytes, smem_capacity=kernel.smem_capacity,
            tmem_cols=kernel.num_tmem_alloc_cols, tma_load_bytes=kernel.num_tma_load_bytes,
            a_stage_bytes=kernel.a_stage_bytes, b_stage_bytes=kernel.b_stage_bytes,
        )

    cute.compile(probe)
    return found

"""Hopper (sm_90a) persistent warp-specialized FP8 / INT8 GEMM with epilogue scaling.

D (M, N) = scale(A (M, K) @ W (N, K)^T) [+ bias (N,)], A and W K-major E4M3/E5M2 with fp32 accumulation, or
both INT8 (s8 x s8 WGMMA) with int32 accumulation: the integer sum is exact, so int8 kernels accumulate all of K
in the tensor cores (accum "fast") and the epilogue converts it to fp32 before the scales.

With ``swap_ab`` the kernel computes D^T = W @ A^T instead (same arguments, swapped at trace time): the
weight rows fill WGMMA's 64-row M side and the few activation rows (decode: M <= 128) its N side, which
can be as narrow as 16, instead of zero-filling 128-row A tiles.
"""

# (no ``from __future__ import annotations``: ``_shared_storage``'s cute.struct reads its annotations as types)
from dataclasses import dataclass  # noqa: I001

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..common.last_wave_split import LastWaveSplitScheduler
from ..common.stage_release import ConsumerMainloop
from ..common.tile_scheduler import PersistentTileScheduler, ceil_div
from .promoted_mainloops import PromotedMainloops
from .epilogue_quant import FP8OutputEpilogue
from .epilogue_roles import TmaStoreEpilogue
from .split_k import k_tile_range, reduce_partials
from .producer_roles import (
    BlockScaledProducer, ProducerView, QuantizingProducer, RowScaleProducer, TmaProducer, TokenQuantizingProducer,
)
from .block_scales import BLOCK_RECIPES, SCALE_REGS, TileScales, is_block_scaled
# Re-exported: the host compile path and tests import the configuration from here.
from .gemm_plan import Sm90GemmConfig, Sm90GemmPlan, cutlass_dtype, is_integer, smem_capacity  # noqa: F401


@dataclass(frozen=True)
class ConsumerFragments:
    """A consumer warp group's main-loop registers and operand views (``Sm90Fp8Gemm._consumer_fragments``; frozen:
    the DSL lets it into run-time loops without carrying it)."""

    tCrA: object  # A's WGMMA operand views of the stages
    tCrB: object  # W's (split in N: a pair, one per half)
    acc: object  # the fp32 (int8: int32) accumulator
    acc_f32: object  # the fp32 fragment the epilogue scales and stores: ``acc``, or its int32 sums converted
    temps: object  # promoted accumulation: the K-tile fragments (split in N: the two halves); else None
    scale_regs: object  # block-scaled: the scales of each K tile in flight; else None
    tile_coords: object  # block-scaled: each accumulator element's (row, column) in the tile; else None
    half_mmas: object  # split in N: the 64 x tile_n/2 (fresh, accumulating) MMAs; else None


class Sm90Fp8Gemm(PromotedMainloops, Sm90GemmPlan):
    """Persistent cooperative WGMMA FP8 GEMM; INT8 (s8 x s8 -> s32) with ``a_dtype = b_dtype = "int8"``.

    Warp roles (registers per thread after setmaxnreg). Warp group 0 runs the producer role ``self.producer``
    (``producer_roles.py``), the consumer warp groups the main loop ``self._consumer_mainloop`` and then the epilogue
    role ``self.epilogue`` (``epilogue_roles.py``); ``_setup_attributes`` binds all three from the configuration.

    | warps | role (class) | work | registers |
    |---|---|---|---|
    | WG 0, warp 0 | TMA producer (every producer role) | A, W tiles into the stages, cluster multicast [1] | 40 [2] |
    | WG 0, warp 1 | scale warp (``BlockScaledProducer``) | each K tile's block scales into its stage [3] | 40 [2] |
    | WG 0, warp 1 | scale warp (``RowScaleProducer``) | each unit's row and column scales into a slot [6] | 40 |
    | WG 0, warps 1..3 | quantizers (``QuantizingProducer``) | each stage's token tile quantized to FP8 [4] | 96 |
    | WG 1 .. tile_m/64 | consumers | 64 rows of the tile each: main loop, then epilogue | 232 [5] |

    [1] On 64-row block-scaled tiles A's 1x128 scales too, when the call's layout allows (``ATileScalesByTma``).
    A quantizing kernel's warp 0 loads the W tiles and the unquantized token tiles instead.
    [2] 24 for promoted 144-wide tiles; 32 block-scaled with two CTAs per SM; 96 in a quantizing kernel.
    [3] W's and, unless they came by TMA, A's (``block_scales.ScaleStaging``).
    [4] ``activation_quant.ActivationQuantStaging``: stage by stage in turn, its FP8 token tile, token scales and W
    scales. Per token (``TokenQuantizingProducer``, recipe "row"), each token tile's scales are found first and handed
    to the epilogue through a ring of ``HANDOFF_UNITS`` units.
    [5] 240 for promoted 144-wide tiles; 216 with two CTAs per SM (224 block-scaled); 200 in a quantizing kernel.
    [6] The row-wise recipe's epilogue scales, loaded ahead of the epilogue instead of after the main loop
    (``unit_scales.py``).

    Pipelines and their stages:

    | pipeline | from -> to | stages |
    |---|---|---|
    | mainloop (PipelineTmaAsync) | producer warps (``arrivals``) -> consumers | ``ab_stages`` (>= 4 if smem allows) |
    | unquantized token tiles (mbarriers) | TMA warp -> quantizing warps | ``ab_stages`` |
    | token-scale ring (full / empty mbarriers) | quantizing warp 1 -> consumers | ``HANDOFF_UNITS`` |
    | row-wise unit scales (full / empty mbarriers) | scale warp -> consumers | 1 unit |
    | epilogue store (PipelineTmaStore) | consumers -> TMA store engine | ``epi_stages`` slices (>= 2, <= a tile) |

    An FP8 output (``d_quant``) the consumers quantize and store themselves from one 128-column slice buffer
    (``epilogue_quant.FP8OutputEpilogue``).

    Hooks. ``kernel`` branches on no variant: it calls the roles' hooks in order, and a variant is a role class.

    * producer role (``producer_roles.TmaProducer`` and subclasses): host ``make_b_load``, ``make_a_scale_load``,
      ``make_storage``, ``kernel_x``; device ``stage_tx_bytes``, ``arrivals``, ``init_smem``, ``b_destination``,
      ``run`` (warp 0's ``TmaLoads`` with ``a_tile_scales`` / ``b_stage``, then ``helper_warps``), and for the
      consumers ``epilogue_scales`` / ``release_epilogue_scales``.
    * epilogue role (``epilogue_roles.TmaStoreEpilogue`` and subclasses): host ``make_store``; device ``prefetch``,
      ``setup``, ``begin``, ``visit`` (the fp32 tile math), ``store_tile`` (``slice_targets`` / ``store_slice``).
    * main loop (``_consumer_mainloop``): one of ``promoted_mainloops.py``'s loops, or ``_mainloop_fast``.

    A new epilogue fusion (SiLU * mul, a residual add) is one more epilogue role: a subclass of
    ``TmaStoreEpilogue`` (or ``FP8OutputEpilogue``) whose ``visit`` runs the base ``visit`` and then its fp32 step on
    ``acc_f32``, bound in ``_setup_attributes``; an operand it reads enters through an entry of its own, as an FP8
    output's scales enter through ``call_fp8_out``.

    Tiles are visited by the shared persistent scheduler (grouped rasterisation, cluster-aware); one
    compilation serves every M, N, K (all three are run-time values). The epilogue (after converting an int8
    kernel's exact int32 sums to fp32) applies the recipe's scales in fp32 (per-tensor: one scalar product;
    row-wise: per-row A scale x per-column W scale), adds the bias, converts, stages the tile in shared memory
    and writes it with TMA stores (which clip at the M/N edges, so partial tiles need no predication).

    Promoted accumulation (the default) runs each 128-deep K tile into a fresh fragment and adds it into the
    fp32 accumulator; block-scaled recipes scale it while adding. Tiles up to 144 wide alternate two such
    fragments; 192-wide tiles have registers for one: the DeepSeek recipe's issue each K tile as two 96-wide
    halves into two half fragments and promote one half while the other runs (``_mainloop_split_n``), the
    others promote each K tile after it retires (``_mainloop_promoted_serial``); the loops are in
    ``promoted_mainloops.py``. Block scales ride in the K tile's stage, staged there by producer warp 1
    (``block_scales.stage_scales``) or, for A's 1x128 scales in torch's layout on 64-row tiles, loaded by the TMA
    warp with the tiles (``block_scales.a_scale_tma_view``, chosen per call; the consumers then fence their reads
    before each release); each consumer reads its few into registers as
    soon as the stage is full, before issuing the tile's MMAs (``block_scales.read_stage_scales``) -- or, in
    the 192-wide loops, while the K tile before runs (``_mainloop_serial_ahead``) or right after issuing the K
    tile's first half (split in N).

    ``ctas_per_sm=2`` (64-row tiles): two such CTAs share each SM (half the shared memory each, launched at
    128 registers per thread), and the persistent grid holds twice the CTAs. Their consumer warp groups take
    turns on the tensor cores the way a ping-pong schedule's two consumers do, without ordering barriers.

    ``swap_ab`` (the decode schedule) runs the same roles on D^T = W @ A^T: the tile's rows are W rows, its
    16..64 columns activation rows, the output a column-major view of D; scales and bias follow.
    ``tile_m=64`` (one consumer warp group) halves the W rows per tile, so a decode GEMM has twice the tiles
    to spread over the SMs without splitting K.
    """

    def __init__(self, cfg: Sm90GemmConfig):
        self.check_config(cfg)
        self.cfg = cfg
        # The kernel's A and B operands (W and the activations when swapped).
        a, b = (cfg.b_dtype, cfg.a_dtype) if cfg.swap_ab else (cfg.a_dtype, cfg.b_dtype)
        self.a_dtype, self.b_dtype = cutlass_dtype(a), cutlass_dtype(b)
        self.d_dtype = cutlass_dtype(cfg.out_dtype)
        self.bias_dtype = cutlass_dtype(cfg.bias_dtype) if cfg.bias_dtype else None
        # The WGMMA accumulator: fp32, or int32 for s8 x s8 (converted to fp32 for the epilogue).
        self.integer = is_integer(cfg)
        self.acc_dtype = Int32 if self.integer else Float32
        # The kernel quantizes the activations (kernel B when swapped) itself: they arrive in this dtype.
        self.quantizes_a = cfg.a_input is not None
        # ... per token (a scale per activation row, over all of K) rather than in 1x128 groups
        self.per_token_quant = self.quantizes_a and cfg.recipe == "row"
        self.block_scaled = is_block_scaled(cfg.recipe)
        self._setup_attributes()

    def _setup_attributes(self):
        """What the configuration implies: tiles and warp groups, the block-scale plan, stages and registers, and the
        roles (producer, main loop, epilogue) the kernel runs."""
        cfg = self.cfg
        self.tile_shape_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.num_mma_warp_groups = cfg.tile_m // 64
        self.threads_per_cta = (1 + self.num_mma_warp_groups) * self.num_threads_per_warp_group
        self.num_mma_threads = self.num_mma_warp_groups * self.num_threads_per_warp_group
        self.epi_tile = (cfg.tile_m, self.epi_n(cfg))
        # (kernel A, kernel B) scale granularity, or None; swapped operands swap their scales too.
        gran = BLOCK_RECIPES.get(cfg.recipe)
        self.scale_gran = gran[::-1] if gran and cfg.swap_ab else gran
        self.split_n = self.split_n_loop(cfg)
        # The other serial block-scaled tiles with per-block W scales read them a K tile ahead
        # (_mainloop_serial_ahead); per-column W scales are read from the stage in the promotion.
        self.read_ahead = (self.block_scaled and cfg.accum == "promoted" and self.scale_gran[1] == "block"
                           and cfg.tile_n > self.overlapped_promote_max_n and not self.split_n)
        # Both read per-block scales raw (a few registers), products formed in the promotion.
        self.raw_scales = self.split_n or self.read_ahead
        # A's group scales may come by TMA (block_scales.a_scale_tma_view decides per call) into the stage's A
        # slots. The consumers must then fence their reads before each stage release, which costs 128-row tiles
        # more than the TMA box gains them: 64-row tiles only, and not the split-N pairs (docs/design.md). Not in
        # kernels that quantize their activations: their quantizing warps store the W (A) scales into those slots.
        self.a_scale_tma = (self.block_scaled and self.scale_gran[0] == "group" and cfg.tile_m == 64
                            and not self.split_n and not self.quantizes_a)
        self.ab_stages = cfg.stages or self.max_stages(cfg)
        self.epi_stages = self.epi_buffers(cfg, self.ab_stages)
        self.producer_regs, self.consumer_regs = self.register_split(cfg)
        self.smem_bytes = self.smem_usage(cfg, self.ab_stages, self.epi_stages)
        # The roles, bound once. How warp group 0 fills the stages:
        producer = TokenQuantizingProducer if self.per_token_quant else QuantizingProducer if self.quantizes_a else (
            BlockScaledProducer if self.block_scaled else RowScaleProducer if cfg.recipe == "row" else TmaProducer)
        self.producer = producer(self)
        # ... the consumers' main loop (promoted_mainloops.py; ``_mainloop`` for fast accumulation) ...
        self._consumer_mainloop = (
            self._mainloop_fast if cfg.accum == "fast" else self._mainloop_serial_ahead if self.read_ahead
            else self._mainloop_split_n if self.split_n
            else self._mainloop_promoted if cfg.tile_n <= self.overlapped_promote_max_n
            else self._mainloop_promoted_serial)
        # ... and what they do with a finished tile.
        self.epilogue = (FP8OutputEpilogue if cfg.d_quant else TmaStoreEpilogue)(self)

    # The FP8 output's scales while ``call_fp8_out`` traces the kernel (the kernel's ``mQScales``); None otherwise.
    q_scales = None

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (M, K) K-major
        mB: cute.Tensor,  # (K, N) column-major, i.e. W (N, K) K-major seen as torch._scaled_mm's b
        mD: cute.Tensor,  # (M, N) N-major
        mSA: cute.Tensor,  # per-tensor: (1,); row-wise: (M, 1); block-scaled: (M or ceil(M/128), Kb)
        mSB: cute.Tensor,  # per-tensor: (1,); row-wise: (1, N); block-scaled: (N or ceil(N/128), Kb)
        mBias: cute.Tensor,  # (N,) or a 1-element dummy when there is no bias
        mWorkspace: cute.Tensor,  # split-K: fp32 partials, >= split tiles * splits * tile_m * tile_n (else a dummy)
        mCounters: cute.Tensor,  # split-K: int32 per split tile, zero between launches (else a dummy)
        splits: Int32,  # K splits (1 unless split_k)
        max_clusters: Int32,
        stream,
    ):
        mA, mB, mD, mSA, mSB = self._kernel_operands(mA, mB, mD, mSA, mSB)
        self.a_layout = LayoutEnum.from_tensor(mA)
        self.b_layout = LayoutEnum.from_tensor(mB)
        self.d_layout = LayoutEnum.from_tensor(mD)
        bM, bN, bK = self.tile_shape_mnk
        cm, cn = self.cfg.cluster_shape_mn

        tiled_mma = self._make_tiled_mma(bN)
        # A second MMA whose first K block overwrites its fragment (ACCUMULATE off): the promoted main loop
        # starts each K tile with it, so fragments never need zeroing.
        tiled_mma_fresh = self._make_tiled_mma(bN)
        a_smem = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_shape_mnk, self.a_dtype, self.ab_stages)
        b_smem = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_shape_mnk, self.b_dtype, self.ab_stages)
        d_smem = sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, self.epi_tile, self.epi_stages)

        tma_a, tA = self._make_tma_load(mA, a_smem, (bM, bK), cn)
        # x_smem: the unquantized token tiles' stages of a kernel that quantizes its activations (else None)
        tma_b, tB, x_smem = self.producer.make_b_load(mB, b_smem)
        a_scales_by_tma, tma_sa, tSA = self.producer.make_a_scale_load(mSA)
        tma_d, tD = self.epilogue.make_store(mD, d_smem)

        self.shared_storage = self._shared_storage(a_smem, b_smem, d_smem)
        smem_bytes = self.shared_storage.size_in_bytes() + self.producer.make_storage(x_smem)
        assert smem_bytes <= smem_capacity(self.cfg.ctas_per_sm), (smem_bytes, self.cfg)

        M, N = mD.shape
        tiles_m = ceil_div(M, bM)
        tiles_n = ceil_div(N, bN)
        # Cluster tiles that exist; the host caps max_clusters at what fits on the GPU.
        if cutlass.const_expr(not self.cfg.split_k):
            splits = Int32(1)
        ctiles = ceil_div(tiles_m, cm) * ceil_div(tiles_n, cn) * splits
        grid_clusters = cutlass.min(ctiles, max_clusters)

        self.kernel(
            tiled_mma, tiled_mma_fresh, tma_a, tA, tma_b, tB, tma_d, tD, mSA, mSB, tma_sa, tSA, a_scales_by_tma,
            mBias, mWorkspace, mCounters, self.q_scales,
            a_smem, b_smem, d_smem, x_smem, self.producer.kernel_x(mB), tiles_m, tiles_n, splits,
        ).launch(
            grid=(cm, cn, grid_clusters),
            block=(self.threads_per_cta, 1, 1),
            # 1x1 "clusters" launch as a plain grid: with the cluster attribute the hardware places their CTAs
            # worse where many CTAs share operands. A 1-CTA launch is still an implicit 1-CTA cluster.
            cluster=(cm, cn, 1) if cm * cn > 1 else None,
            smem=smem_bytes,
            # With 2, ptxas caps registers at 128 per thread so that two CTAs fit; the carveout (all shared
            # memory) is given here, or the DSL would ask the driver for it while compiling.
            min_blocks_per_mp=self.cfg.ctas_per_sm,
            preferred_smem_carveout=100 if self.cfg.ctas_per_sm > 1 else None,
            stream=stream,
            use_pdl=self.cfg.pdl,
        )

    def _shared_storage(self, a_smem, b_smem, d_smem):
        """The kernel's shared-memory struct. (Plain Python, not traced: the DSL would turn the fields' ``if`` into
        a traced branch.)"""
        bM, bN, _ = self.tile_shape_mnk
        unit_scales = self.producer.stages_unit_scales

        @cute.struct
        class SharedStorage:
            mainloop_barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            if unit_scales:  # (the row-wise unit-scale slot: rows and barriers in the 1 KiB before the stages)
                unit_barriers: cute.struct.MemRange[cutlass.Int64, 2]
                unit_rows: cute.struct.Align[cute.struct.MemRange[Float32, bM], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(d_smem)], 1024]
            # Block scales of each stage's K tile (a 1-element placeholder for epilogue-scaled recipes).
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, bM * self.ab_stages if self.block_scaled else 1],
                                   128 if self.a_scale_tma else 16]
            sSB: cute.struct.Align[cute.struct.MemRange[Float32, bN * self.ab_stages if self.block_scaled else 1], 16]
            split_flag: cute.struct.MemRange[Int32, 1]  # split-K: the tile counter's old value, for all threads
            if unit_scales:  # (... and its columns in the struct's last KiB: unit_scales.unit_scale_bytes)
                unit_cols: cute.struct.Align[cute.struct.MemRange[Float32, bN], 16]

        return SharedStorage

    @cute.jit
    def call_fp8_out(
        self,
        mA: cute.Tensor,  # (M, K) K-major
        mB: cute.Tensor,  # (K, N) column-major
        mQ: cute.Tensor,  # (M, N) e4m3, row-major: the output, quantized
        mQScales: cute.Tensor,  # (M, N / 128) fp32, M-major (quantize_fp8's "1x128" layout): its group scales
        mSA: cute.Tensor,
        mSB: cute.Tensor,
        mBias: cute.Tensor,
        mWorkspace: cute.Tensor,
        mCounters: cute.Tensor,
        splits: Int32,
        max_clusters: Int32,
        stream,
    ):
        """The entry of a kernel built with ``d_quant`` (``epilogue_quant.FP8OutputEpilogue``): ``__call__``'s
        arguments, with the FP8 output and its scales in the output's place."""
        if cutlass.const_expr(self.cfg.d_quant is None):
            raise TypeError("call_fp8_out enters a kernel built with d_quant; this one is entered through __call__")
        self.q_scales = mQScales
        self.__call__(mA, mB, mQ, mSA, mSB, mBias, mWorkspace, mCounters, splits, max_clusters, stream)
        self.q_scales = None

    def _make_tiled_mma(self, n):
        """The warp groups' WGMMA over bM x n (64 x n per warp group)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.tile_shape_mnk[0] // 64, 1, 1),
            tiler_mn=(64, n),
        )

    def _kernel_operands(self, mA, mB, mD, mSA, mSB):
        """The user's operands as the kernel's (rows, K) K-major A and B, output and scales.

        Plain: A, W = b^T, D. Swapped: A' = W, B' = A and D' = D^T (column-major); the scales follow their
        operands (row-wise ones transposed so the kernel's "per row" / "per column" still holds).
        """
        mW = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[1, 0]))  # (K, N) -> (N, K)
        if cutlass.const_expr(not self.cfg.swap_ab):
            return mA, mW, mD, mSA, mSB
        mDt = cute.make_tensor(mD.iterator, cute.select(mD.layout, mode=[1, 0]))
        if cutlass.const_expr(self.cfg.recipe == "row"):
            transpose = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))  # noqa: E731
            # (a kernel quantizing per token computes A's scales: their argument is a 1-D dummy)
            return mW, mA, mDt, transpose(mSB), mSA if self.per_token_quant else transpose(mSA)
        return mW, mA, mDt, mSB, mSA

    def _make_tma_load(self, tensor, smem_layout_staged, tile, mcast):
        op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            if mcast == 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_layout_staged, (None, None, 0)), tile, num_multicast=mcast
        )

    # ---- device ----------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tiled_mma_fresh: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_d: cute.CopyAtom,
        mD: cute.Tensor,
        mSA: cute.Tensor,
        mSB: cute.Tensor,
        tma_sa,  # a_scale_tma: TMA atom, TMA tensor and run-time flag for A's group scales; else None
        tSA,
        a_scales_by_tma,
        mBias: cute.Tensor,
        mWorkspace: cute.Tensor,
        mCounters: cute.Tensor,
        mQScales,  # d_quant: the FP8 output's 1x128 scales (M, N / 128), M-major (else None)
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        d_smem: cute.ComposedLayout,
        x_smem,  # kernels that quantize their activations: the unquantized tiles' stages (else None)
        mX,  # kernels that quantize per token: the activations in global memory (else None)
        tiles_m: Int32,
        tiles_n: Int32,
        splits: Int32,
    ):
        bM, bN, bK = self.tile_shape_mnk
        cm, cn = self.cfg.cluster_shape_mn
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_warp_group)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            self.epilogue.prefetch(tma_d)
        self._launch_dependents(tidx)

        cta_layout = cute.make_layout((cm, cn, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout.get_flat_coord(cta_rank)
        # A is shared by the CTAs of a cluster row (same M), W by those of a cluster column (same N).
        a_mcast_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1) if cn > 1 else 0
        b_mcast_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0) if cm > 1 else 0

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # The bytes TMA brings per stage.
        stage_bytes = self.producer.stage_tx_bytes(a_smem, b_smem)
        # Every consumer warp releases a stage to each CTA that multicast into it.
        consumer_arrivals = (cm + cn - 1) * self.num_mma_warp_groups * 4
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mainloop_barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.producer.arrivals),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, cm, cn, 1)),
            defer_sync=True,
        )
        psmem = self.producer.init_smem(smem, storage, tidx, mX)  # the producer role's own shared memory
        pipeline.pipeline_init_arrive(cluster_shape_mn=(cm, cn), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sD = storage.sD.get_tensor(d_smem.outer, swizzle=d_smem.inner)
        split_flag = storage.split_flag.get_tensor(cute.make_layout(1))
        scale_slots = self._scale_slots(storage)

        gA = cute.local_tile(mA, (bM, bK), (None, None))  # (bM, bK, tiles_m, tiles_k)
        gB = cute.local_tile(mB, (bN, bK), (None, None))
        gD = cute.local_tile(mD, (bM, bN), (None, None))
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a,
            cluster_coord[1],
            cute.make_layout(cn),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        b_dst, b_rank, b_ctas = self.producer.b_destination(sB, psmem, x_smem, cluster_coord)
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b,
            b_rank,
            cute.make_layout(b_ctas),
            cute.group_modes(b_dst, 0, 2),
            cute.group_modes(gB, 0, 2),
        )

        cluster_id = cute.arch.block_idx()[2]
        num_clusters = cute.arch.grid_dim()[2]

        pipeline.pipeline_init_wait(cluster_shape_mn=(cm, cn))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self.producer.run(ProducerView(
                mainloop, stage_bytes, tma_a, tma_b, tAgA, tBgB, tAsA, tBsB, a_mcast_mask, b_mcast_mask, mSA, mSB, mB,
                sB, b_dst, x_smem, scale_slots, (tma_sa, tSA, a_scales_by_tma), psmem,
                (tiles_m, tiles_n, splits, num_clusters, cluster_id, cluster_coord, k_tiles)), warp_idx)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            # Releases with the signalling lane and the mapped barrier address worked out once (stage_release.py).
            consumer_mainloop = ConsumerMainloop.create(mainloop)
            sched = self._scheduler(tiles_m, tiles_n, splits, num_clusters)
            mma_tidx = tidx - self.num_threads_per_warp_group
            thr_mma = tiled_mma.get_slice(mma_tidx)
            # The A/W shared-memory descriptors depend only on the warp group: built from its first thread's
            # slice (a warp-uniform index), ptxas keeps them in uniform registers instead of rebuilding them
            # from the thread index and moving them over with R2UR before every WGMMA.
            frags = self._consumer_fragments(tiled_mma, sA, sB, gD, wg_idx, mma_tidx, thr_mma)
            epi, store_pipe, epi_barrier = self.epilogue.setup(tiled_mma, sD, mma_tidx)

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            mmas = self._mainloop_mmas(tiled_mma, tiled_mma_fresh, frags)
            tiles_done = Int32(0)
            units_done = Int32(0)  # (per-token quantization: the epilogue ring's position)
            alpha = self.epilogue.begin(mSA, mSB)
            unit = cluster_id
            while unit < sched.num_units:
                tm, tn, split, nsplit = self._unit(sched, unit, cluster_coord, splits)
                _, k_count = k_tile_range(k_tiles, nsplit, split)
                read_state, release_state = self._consumer_mainloop(
                    mmas, frags.acc, frags.temps, frags.tCrA, frags.tCrB, consumer_mainloop, read_state, release_state,
                    k_count, self._tile_scales(scale_slots, frags, tn))
                owns_epilogue = self._reduce_splits(sched, unit, cluster_coord, tm, tn, split, splits, tiles_m, tiles_n,
                                                    frags.acc, mWorkspace, mCounters, mma_tidx, epi_barrier, split_flag)
                # (the unit's scales the producer staged in shared memory: row-wise, both; per-token quantization,
                # the token scales its quantizing warps found)
                staged_scales, ring_slot = self.producer.epilogue_scales(psmem, units_done)
                if owns_epilogue:
                    self.epilogue.visit(frags.acc, frags.acc_f32, thr_mma, mD, mSA, mSB, mBias, tm, tn, alpha,
                                        staged_scales)
                units_done = self.producer.release_epilogue_scales(psmem, ring_slot, units_done)
                if owns_epilogue:
                    self.epilogue.store_tile(epi, frags.acc_f32, tma_d, sD, gD, tm, tn, tiles_done, store_pipe,
                                             epi_barrier, warp_idx, mD, mQScales)
                    tiles_done += 1
                unit += num_clusters
            store_pipe.producer_tail()

    @cute.jit
    def _launch_dependents(self, tidx):
        """Programmatic dependent launch: every CTA of a persistent grid is resident from the start, so the next
        kernel may take the idle SMs at once."""
        if cutlass.const_expr(self.cfg.pdl):
            if tidx == 0:
                cute.arch.griddepcontrol_launch_dependents()

    def _scale_slots(self, storage):
        """The block scales' (A, W) slots of each stage (block-scaled recipes; else None)."""
        if not self.block_scaled:
            return None
        bM, bN, _ = self.tile_shape_mnk
        return (
            storage.sSA.get_tensor(cute.make_layout((bM, self.ab_stages))),
            storage.sSB.get_tensor(cute.make_layout((bN, self.ab_stages))),
        )

    def _scheduler(self, tiles_m, tiles_n, splits, num_clusters):
        cm, cn = self.cfg.cluster_shape_mn
        if cutlass.const_expr(self.cfg.split_tail):
            return LastWaveSplitScheduler(tiles_m, tiles_n, (cm, cn), self.cfg.raster_group_m, splits, num_clusters)
        return PersistentTileScheduler(tiles_m, tiles_n, (cm, cn), self.cfg.raster_group_m, splits)

    def _unit(self, sched, unit, cluster_coord, splits):
        """(tile_m, tile_n, k split, k splits of this tile) of a work unit."""
        if cutlass.const_expr(self.cfg.split_tail):
            return sched.coords(unit, cluster_coord[0], cluster_coord[1])
        tm, tn, split = sched.coords(unit, cluster_coord[0], cluster_coord[1])
        return tm, tn, split, splits

    # ---- consumer pieces -------------------------------------------------------------------------
    @cute.jit
    def _consumer_fragments(self, tiled_mma, sA, sB, gD, wg_idx, mma_tidx, thr_mma):
        """A consumer warp group's register fragments and views (``ConsumerFragments``) for the main loop picked in
        ``__init__`` (``_consumer_mainloop``)."""
        bM, bN, _ = self.tile_shape_mnk
        # The A/W shared-memory descriptors depend only on the warp group: built from its first thread's
        # slice (a warp-uniform index), ptxas keeps them in uniform registers instead of rebuilding them
        # from the thread index and moving them over with R2UR before every WGMMA.
        thr_mma_wg = tiled_mma.get_slice((wg_idx - 1) * self.num_threads_per_warp_group)
        tCsA = thr_mma_wg.partition_A(sA)
        tCsB = thr_mma_wg.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        acc_shape = thr_mma.partition_C(gD[(None, None, 0, 0)]).shape
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        # The fp32 fragment the epilogue scales and stores: the accumulator itself, or its int32 sums converted.
        acc_f32 = cute.make_rmem_tensor(acc_shape, Float32) if self.integer else acc
        temps = None
        scale_regs = None
        half_mmas = None
        if cutlass.const_expr(self.split_n):
            # Fresh and accumulating 64 x bN/2 MMAs, and their operands: A as before, W by halves of the
            # stage's tile. A 64 x N WGMMA fragment lists its N/8 column groups in order, four values each,
            # so a half's fragment is elements bN/4 * h.. of the tile's (test_split_n_halves_are_...).
            half_mmas = (self._make_tiled_mma(bN // 2), self._make_tiled_mma(bN // 2))
            half_wg = half_mmas[1].get_slice((wg_idx - 1) * self.num_threads_per_warp_group)
            tCrA = half_mmas[1].make_fragment_A(half_wg.partition_A(sA))
            sB_halves = cute.flat_divide(sB, (bN // 2,))  # (bN/2, 2, bK, stages)
            tCrB = tuple(
                half_mmas[1].make_fragment_B(half_wg.partition_B(sB_halves[(None, h, None, None)]))
                for h in range(2)
            )
            half_shape = half_mmas[1].get_slice(mma_tidx).partition_C(
                cute.make_identity_tensor((bM, bN // 2))).shape
            temps = tuple(cute.make_rmem_tensor(half_shape, self.acc_dtype) for _ in range(2))
        elif cutlass.const_expr(self.cfg.accum == "promoted"):
            n_frags = 2 if bN <= self.overlapped_promote_max_n else 1
            temps = tuple(cute.make_rmem_tensor(acc_shape, self.acc_dtype) for _ in range(n_frags))
        if cutlass.const_expr(self.cfg.accum == "promoted" and self.block_scaled):
            # The scales of each K tile in flight (read_stage_scales / read_raw_scales): one set per
            # fragment; split in N, the K tile running and the one before it; reading ahead, the K tile
            # running and the next one.
            n_sets = 2 if self.read_ahead else len(temps)
            scale_regs = tuple(cute.make_rmem_tensor(cute.make_layout(SCALE_REGS), Float32) for _ in range(n_sets))
        tile_coords = None
        if cutlass.const_expr(self.block_scaled):
            # Each accumulator element's (row, column) inside the tile picks its scales.
            tile_coords = thr_mma.partition_C(cute.make_identity_tensor((bM, bN)))
        return ConsumerFragments(tCrA, tCrB, acc, acc_f32, temps, scale_regs, tile_coords, half_mmas)

    def _mainloop_mmas(self, tiled_mma, tiled_mma_fresh, frags):
        """(fresh, accumulating) MMAs of the main loop: the first K block of a promoted K tile overwrites its
        fragment, the rest accumulate (split in N: the half-width pair)."""
        # ACCUMULATE stays a trace-time constant (True), set outside the run-time loops (a value set
        # inside one would escape its region); zeroing the accumulator per tile is cheap.
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        tiled_mma_fresh.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        mmas = (tiled_mma_fresh, tiled_mma)
        if self.split_n:
            frags.half_mmas[1].set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            frags.half_mmas[0].set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            mmas = frags.half_mmas
        return mmas

    def _tile_scales(self, scale_slots, frags, tn):
        """The block-scaled recipes' ``TileScales`` of tile column ``tn`` (built once per tile, outside its K loop);
        None for the epilogue-scaled ones."""
        if not self.block_scaled:
            return None
        bM, bN, _ = self.tile_shape_mnk
        return TileScales(scale_slots, frags.tile_coords, tn * bN, frags.scale_regs, self.scale_gran, (bM, bN),
                          self.raw_scales)

    @cute.jit
    def _reduce_splits(self, sched, unit, cluster_coord, tm, tn, split, splits, tiles_m, tiles_n, acc, mWorkspace,
                       mCounters, mma_tidx, epi_barrier, split_flag):
        """Split-K: reduce the unit's partial sums (``split_k.reduce_partials``); returns whether this CTA runs the
        tile's epilogue (always, unsplit)."""
        owns_epilogue = True
        if cutlass.const_expr(self.cfg.split_k):
            # Tiles past the edge (cluster padding) have nothing to reduce or store.
            if cutlass.const_expr(self.cfg.split_tail):
                if sched.is_split(unit) and tm < tiles_m and tn < tiles_n:
                    owns_epilogue = reduce_partials(
                        acc, mWorkspace, mCounters, sched.split_slot(unit, cluster_coord[0], cluster_coord[1]),
                        split, splits, mma_tidx, self.num_mma_threads, epi_barrier, split_flag,
                    )
            elif splits > 1 and tm < tiles_m and tn < tiles_n:
                owns_epilogue = reduce_partials(
                    acc, mWorkspace, mCounters, tm * tiles_n + tn, split, splits, mma_tidx,
                    self.num_mma_threads, epi_barrier, split_flag,
                )
        return owns_epilogue

    @cute.jit
    def _mainloop_fast(self, mmas, acc, temps, tCrA, tCrB, mainloop, read_state, release_state, k_tiles, scales):
        """Fast accumulation (``accum="fast"``): ``_mainloop`` with the accumulating MMA, in the promoted loops'
        signature."""
        return self._mainloop(mmas[1], acc, tCrA, tCrB, mainloop, read_state, release_state, k_tiles)

    @cute.jit
    def _mainloop(self, tiled_mma, acc, tCrA, tCrB, mainloop, read_state, release_state, k_tiles):
        """acc = A_tile @ W_tile^T over all K tiles; keeps one WGMMA batch in flight."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0 if self.integer else 0.0)
        cute.nvgpu.warpgroup.fence()
        # First K tile: nothing to release yet. Every later tile frees the stage of the batch before it
        # (wait_group(1) leaves only the batch just issued in flight). k_tiles >= 1 (the host never
        # launches for K == 0).
        mainloop.consumer_wait(read_state)
        self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, num_k_blocks)
        read_state.advance()
        for kt in cutlass.range(1, k_tiles, unroll=1):  # noqa: B007
            mainloop.consumer_wait(read_state)
            self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, num_k_blocks)
            cute.nvgpu.warpgroup.wait_group(1)
            mainloop.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        mainloop.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state

    @cute.jit
    def _mma_k_tile(self, tiled_mma, acc, tCrA, tCrB, stage, num_k_blocks: cutlass.Constexpr):
        for kb in cutlass.range_constexpr(num_k_blocks):
            coord = (None, None, kb, stage)
            cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
        cute.nvgpu.warpgroup.commit_group()

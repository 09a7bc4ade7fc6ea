"""Hopper (sm_90a) weight-only GEMM: bf16 / fp16 activations times int4 / int8 weights, converted in registers.

D (M, N) = X (M, K) @ Wdq (N, K)^T with Wdq = (q - z) * s, fp32 accumulation. The kernel runs swapped,
D^T = Wdq @ X^T: weight rows fill WGMMA's 64-row M side and the M tokens its N side (16..128 wide), so decode
needs no zero-padded activation tile. The weights arrive packed (``numerics/int_packing.py``): each 64 x 128 atom
holds every thread's register fragment contiguously, so a thread reads its K tile's codes with 128-bit
shared-memory loads, turns them into bf16 / fp16 in registers and hands them to WGMMA as the register-sourced A
operand; the activations are WGMMA's B operand in shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..common.register_fence import fence_registers
from ..common.stage_release import ConsumerMainloop
from ..common.tile_scheduler import PersistentTileScheduler, ceil_div
from .gemm_plan import PREFETCH_K_TILES, SM90_SMEM_CAPACITY, cutlass_dtype
from .split_k import k_tile_range, reduce_partials

# Device-side copies of the packed layout's constants (numerics/int_packing.py; tests/test_weight_only.py checks
# that they agree): a 64 x 128 atom per warp group and K tile, 4-word chunks at 512-word strides.
ATOM_ROWS = 64
ATOM_K = 128
ATOM_THREADS = 128
CHUNK_WORDS = 4
PER_CHANNEL = 0

# The magic-number conversion: a code's bits or'ed into the mantissa of 2**7 (bf16) / 2**10 (fp16) are that float
# plus the code, exactly; subtracting the float plus the zero point leaves q - z exactly.
_MAGIC = {"bf16": 0x4300, "fp16": 0x6400}  # 128.0, 1024.0
_ONE = {"bf16": 0x3F80, "fp16": 0x3C00}


# L2 cache policies of the TMA loads (CUTLASS's CacheHintSm90): the weights are streamed once, the activation tiles
# are read again by every weight tile.
_EVICT_FIRST = 0x12F0000000000000
_EVICT_LAST = 0x14F0000000000000


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Compile-time configuration of one weight-only kernel (the instance-table row it was built from)."""

    bits: int = 4  # 4 | 8
    group: int = 128  # 32 | 64 | 128 (scales along K, int4); 0: per output channel, applied in the epilogue
    zeros: bool = False  # integer zero points per group (int4, group-wise)
    act_dtype: str = "bf16"  # "bf16" | "fp16": activations, converted weights and output
    tile_m: int = 128  # weight rows per CTA: 64 per consumer warp group
    tile_n: int = 16  # tokens per CTA (WGMMA N): 16, 32, 64 or 128
    stages: int = 0  # 0: as many as shared memory allows
    split_k: bool = True  # the split-K reduction is compiled in (splits is a run-time argument)
    pdl: bool = True  # programmatic dependent launch (Sm90GemmConfig.pdl)
    group_m: int = 8  # rasterisation: weight tiles walked before the next token tile

    @property
    def per_channel(self) -> bool:
        return self.group == PER_CHANNEL


class WeightOnlyPlan:
    """Rules and shared-memory plan of a configuration (the kernel class inherits it; the instance table validates
    rows with ``check_config`` without tracing)."""

    num_threads_per_warp_group = 128
    producer_regs = 40
    consumer_regs = 232
    max_stage_count = 16
    reserved_bytes = 2048  # mbarriers, the split-K flag and buffer alignment

    @staticmethod
    def words_per_thread(cfg: WeightOnlyConfig) -> int:
        return ATOM_ROWS * ATOM_K * cfg.bits // 32 // ATOM_THREADS

    @staticmethod
    def groups_per_tile(cfg: WeightOnlyConfig) -> int:
        return 0 if cfg.per_channel else ATOM_K // cfg.group

    @classmethod
    def stage_bytes(cls, cfg: WeightOnlyConfig) -> int:
        weights = cfg.tile_m * ATOM_K * cfg.bits // 8
        acts = cfg.tile_n * ATOM_K * 2
        scales = cfg.tile_m * cls.groups_per_tile(cfg) * 2 * (2 if cfg.zeros else 1)
        return weights + acts + scales

    @classmethod
    def max_stages(cls, cfg: WeightOnlyConfig) -> int:
        return min(cls.max_stage_count, (SM90_SMEM_CAPACITY - cls.reserved_bytes) // cls.stage_bytes(cfg))

    @classmethod
    def smem_usage(cls, cfg: WeightOnlyConfig, stages: int) -> int:
        return stages * cls.stage_bytes(cfg) + cls.reserved_bytes

    @classmethod
    def check_config(cls, cfg: WeightOnlyConfig) -> None:
        """Raise ValueError naming the broken rule."""
        if cfg.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {cfg.bits}")
        if cfg.group not in (PER_CHANNEL, 32, 64, 128):
            raise ValueError(f"group must be 32, 64, 128 or 0 (per channel), got {cfg.group}")
        if cfg.bits == 8 and not cfg.per_channel:
            raise ValueError(f"int8 weights take per-channel scales (group=0), got group={cfg.group}")
        if cfg.zeros and cfg.per_channel:
            raise ValueError("zero points come with group-wise int4 scales, not per-channel ones")
        if cfg.act_dtype not in _MAGIC:
            raise ValueError(f"act_dtype must be 'bf16' or 'fp16', got {cfg.act_dtype!r}")
        if cfg.tile_m not in (64, 128):
            raise ValueError(f"tile_m is 64 or 128 (one or two consumer warp groups), got {cfg.tile_m}")
        if cfg.tile_n not in (16, 32, 64, 128):
            raise ValueError(f"tile_n (tokens per tile, WGMMA N) must be 16, 32, 64 or 128, got {cfg.tile_n}")
        stages = cfg.stages or cls.max_stages(cfg)
        if stages < 2 or cls.smem_usage(cfg, stages) > SM90_SMEM_CAPACITY:
            raise ValueError(f"{stages} stages of {cls.stage_bytes(cfg)} B need {cls.smem_usage(cfg, stages)} B of "
                             f"shared memory; the budget is {SM90_SMEM_CAPACITY} B and >= 2 stages")


# ---- the conversion: one PTX instruction per helper ----------------------------------------------------------
@dsl_user_op
def _asm_b32(asm: str, *args, loc=None, ip=None) -> Int32:
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(a).ir_value(loc=loc, ip=ip) for a in args],
            asm,
            ",".join(["=r"] + ["r"] * len(args)),
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _lop3(x, b: int, c: int, lut: int):
    """``lop3.b32`` with two immediate operands: 0xEA is (x & b) | c, 0x6A is (x & b) ^ c."""
    return _asm_b32(f"lop3.b32 $0, $1, {b:#010x}, {c:#010x}, {lut:#04x};", x)


def _fma2(a, b, c, act: str):
    """Packed half-precision a * b + c (round to nearest) in the activation dtype."""
    kind = "bf16x2" if act == "bf16" else "f16x2"
    return _asm_b32(f"fma.rn.{kind} $0, $1, $2, $3;", a, b, c)


def _pair(half: int) -> int:
    return half | (half << 16)


class Sm90WeightOnlyGemm(WeightOnlyPlan):
    """Persistent warp-specialized weight-only GEMM, swapped: D^T (N, M) = Wdq (N, K) @ X^T.

    Warp roles (registers per thread after setmaxnreg):

    * warp group 0, warp 0 -- TMA producer: per K tile, the activation tile (tile_n tokens x 128, bf16/fp16),
      the weight atoms (tile_m / 64 packed 64 x 128 atoms) and, group-wise, the tile's scales (and zero points)
      into one mainloop stage. 40 registers (setmaxnreg.dec).
    * warp groups 1 .. tile_m / 64 -- converting MMA consumers: each owns one 64-row atom of the tile. Per K tile
      it reads its threads' packed words (128-bit loads), converts them to bf16/fp16 in registers (``lop3`` into
      magic numbers, one packed FMA to the exact q - z, one packed FMA with the group's scale) and issues eight
      register-sourced m64nNk16 WGMMAs on them and the stage's activation tile. Then the epilogue. 232 registers
      (setmaxnreg.inc).

    Pipelines:

    * mainloop (PipelineTmaAsync): TMA warp -> the consumer warp groups; ``stages`` stages (up to 16).
    * converted fragments: two register sets per consumer thread. K tile i converts into set i % 2 while K tile
      i - 1's WGMMAs (on the other set) run; ``wgmma.wait_group(1)`` before each conversion retires the WGMMAs
      that read the set it overwrites. The main loop runs K tiles in pairs, so each set is its own registers.

    Work units (output tile, K split) are walked by the shared persistent scheduler; split-K partial sums are
    reduced deterministically (``split_k.reduce_partials``). The epilogue scales per channel (``group=0``) in fp32,
    converts and stores D's elements directly (row m = token, column n = weight row), skipping those past M or N.
    """

    def __init__(self, cfg: WeightOnlyConfig):
        self.check_config(cfg)
        self.cfg = cfg
        self.act_dtype = cutlass_dtype(cfg.act_dtype)
        self.acc_dtype = Float32
        self.tile_shape_mnk = (cfg.tile_m, cfg.tile_n, ATOM_K)
        self.atoms_per_tile = cfg.tile_m // ATOM_ROWS
        self.num_mma_warp_groups = self.atoms_per_tile
        self.threads_per_cta = (1 + self.num_mma_warp_groups) * self.num_threads_per_warp_group
        self.num_mma_threads = self.num_mma_warp_groups * self.num_threads_per_warp_group
        self.atom_words = ATOM_ROWS * ATOM_K * cfg.bits // 32
        self.thread_words = self.words_per_thread(cfg)
        self.gpt = self.groups_per_tile(cfg)
        self.stages = cfg.stages or self.max_stages(cfg)
        self.smem_bytes = self.smem_usage(cfg, self.stages)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, K) activations, K-major
        mW: cute.Tensor,  # (N atoms, K atoms, atom words) int32, packed (numerics/int_packing.py)
        mS: cute.Tensor,  # group-wise: (K / group, N) scales, N-major; per channel: (1, N) fp32
        mZ: cute.Tensor,  # (K / group, N) zero points, N-major (a 1-element dummy without)
        mD: cute.Tensor,  # (M, N) output, N-major
        mWorkspace: cute.Tensor,  # split-K: fp32 partials (else a dummy)
        mCounters: cute.Tensor,  # split-K: int32 per output tile, zero between launches (else a dummy)
        splits: Int32,
        max_clusters: Int32,
        stream,
    ):
        bM, bN, bK = self.tile_shape_mnk
        apt = self.atoms_per_tile
        words = self.atom_words
        # The packed weights as a 4-D TMA tensor (32 words, atom rows of 32 words, K atom, N atom): a box holds the
        # tile's atoms of one K tile, each dimension within TMA's 256-element limit.
        mW4 = cute.make_tensor(
            mW.iterator,
            cute.make_layout((32, words // 32, mW.shape[1], mW.shape[0]),
                             stride=(1, 32, mW.layout.stride[1], mW.layout.stride[0])),
        )
        w_box = (32, words // 32, 1, apt)
        w_smem = cute.make_layout((*w_box, self.stages))
        tma_w, tW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mW4, cute.slice_(w_smem, (None, None, None, None, 0)),
            w_box)

        self.x_layout = LayoutEnum.from_tensor(mX)
        x_smem = sm90_utils.make_smem_layout_b(self.x_layout, self.tile_shape_mnk, self.act_dtype, self.stages)
        tma_x, tX = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mX, cute.slice_(x_smem, (None, None, 0)), (bN, bK))

        gpt = max(self.gpt, 1)
        s_smem = cute.make_layout((bM, gpt, self.stages))
        tma_s = tS = tma_z = tZ = None
        if cutlass.const_expr(not self.cfg.per_channel):
            # (K / group, N) N-major seen as (N, K / group): a box is the tile's rows x the K tile's groups.
            mSt = cute.make_tensor(mS.iterator, cute.select(mS.layout, mode=[1, 0]))
            tma_s, tS = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mSt, cute.slice_(s_smem, (None, None, 0)), (bM, gpt))
            if cutlass.const_expr(self.cfg.zeros):
                mZt = cute.make_tensor(mZ.iterator, cute.select(mZ.layout, mode=[1, 0]))
                tma_z, tZ = cute.nvgpu.cpasync.make_tiled_tma_atom(
                    cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mZt, cute.slice_(s_smem, (None, None, 0)),
                    (bM, gpt))

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.act_dtype, self.act_dtype, OperandMajorMode.K, self.x_layout.sm90_mma_major_mode(), self.acc_dtype,
            (self.num_mma_warp_groups, 1, 1), tiler_mn=(64, bN), a_source=warpgroup.OperandSource.RMEM)

        scale_slots = bM * gpt * self.stages if not self.cfg.per_channel else 1
        zero_slots = scale_slots if self.cfg.zeros else 1

        @cute.struct
        class SharedStorage:
            mainloop_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sW: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(w_smem)], 1024]
            sX: cute.struct.Align[cute.struct.MemRange[self.act_dtype, cute.cosize(x_smem)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[self.act_dtype, scale_slots], 128]
            sZ: cute.struct.Align[cute.struct.MemRange[self.act_dtype, zero_slots], 128]
            split_flag: cute.struct.MemRange[Int32, 1]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= SM90_SMEM_CAPACITY, (SharedStorage.size_in_bytes(), self.cfg)

        M, N = mD.shape
        tiles_m = ceil_div(N, bM)  # the kernel's rows are the weight rows
        tiles_n = ceil_div(M, bN)
        if cutlass.const_expr(not self.cfg.split_k):
            splits = Int32(1)
        grid = cutlass.min(tiles_m * tiles_n * splits, max_clusters)

        self.kernel(
            tiled_mma, tma_w, tW, tma_x, tX, tma_s, tS, tma_z, tZ, mS, mD, mWorkspace, mCounters,
            w_smem, x_smem, s_smem, tiles_m, tiles_n, splits,
        ).launch(
            grid=(1, 1, grid),
            block=(self.threads_per_cta, 1, 1),
            smem=self.shared_storage.size_in_bytes(),
            min_blocks_per_mp=1,  # lets ptxas size the registers setmaxnreg moves between the warp groups
            stream=stream,
            use_pdl=self.cfg.pdl,
        )

    # ---- device ----------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        tma_x: cute.CopyAtom,
        mX: cute.Tensor,
        tma_s,
        tS,
        tma_z,
        tZ,
        mS: cute.Tensor,
        mD: cute.Tensor,
        mWorkspace: cute.Tensor,
        mCounters: cute.Tensor,
        w_smem: cute.Layout,
        x_smem: cute.ComposedLayout,
        s_smem: cute.Layout,
        tiles_m: Int32,
        tiles_n: Int32,
        splits: Int32,
    ):
        bM, bN, bK = self.tile_shape_mnk
        apt = self.atoms_per_tile
        words = self.atom_words
        gpt = max(self.gpt, 1)
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_warp_group)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_w)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_x)
            if cutlass.const_expr(not self.cfg.per_channel):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_s)
                if cutlass.const_expr(self.cfg.zeros):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_z)
        if cutlass.const_expr(self.cfg.pdl):
            if tidx == 0:
                cute.arch.griddepcontrol_launch_dependents()

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mainloop_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_warp_groups * 4),
            tx_count=self.stage_bytes(self.cfg),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sW = storage.sW.get_tensor(w_smem)
        sX = storage.sX.get_tensor(x_smem.outer, swizzle=x_smem.inner)
        sS = storage.sS.get_tensor(s_smem)
        sZ = storage.sZ.get_tensor(s_smem)
        split_flag = storage.split_flag.get_tensor(cute.make_layout(1))

        # (box, N atom tile, K tile) and friends: the TMA views of one tile's K tiles.
        gW = cute.local_tile(mW, (32, words // 32, 1, apt), (0, 0, None, None))  # (box..., K tiles, row tiles)
        gX = cute.local_tile(mX, (bN, bK), (None, None))  # (bN, bK, token tiles, K tiles)
        k_tiles = cute.size(gX, mode=[3])
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 4), cute.group_modes(gW, 0, 4))
        tXsX, tXgX = cute.nvgpu.cpasync.tma_partition(
            tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tSsS = tSgS = tZsZ = tZgZ = None
        if cutlass.const_expr(not self.cfg.per_channel):
            gS = cute.local_tile(tS, (bM, gpt), (None, None))  # (bM, gpt, row tiles, K tiles)
            tSsS, tSgS = cute.nvgpu.cpasync.tma_partition(
                tma_s, 0, cute.make_layout(1), cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
            if cutlass.const_expr(self.cfg.zeros):
                gZ = cute.local_tile(tZ, (bM, gpt), (None, None))
                tZsZ, tZgZ = cute.nvgpu.cpasync.tma_partition(
                    tma_z, 0, cute.make_layout(1), cute.group_modes(sZ, 0, 2), cute.group_modes(gZ, 0, 2))

        num_units_stride = cute.arch.grid_dim()[2]
        first_unit = cute.arch.block_idx()[2]
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                sched = PersistentTileScheduler(tiles_m, tiles_n, (1, 1), self.cfg.group_m, splits)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                if cutlass.const_expr(self.cfg.pdl):
                    # While the previous kernel finishes, start the first unit's packed weight tiles on their way
                    # into L2 (a prefetch, coherent with that kernel's writes); everything this grid reads or
                    # writes follows the loads below: wait for the previous kernel before them.
                    if first_unit < sched.num_units:
                        tm, _, split = sched.coords(first_unit, Int32(0), Int32(0))
                        k_begin, k_count = k_tile_range(k_tiles, splits, split)
                        for i in cutlass.range(cutlass.min(k_count, PREFETCH_K_TILES), unroll=1):
                            cute.prefetch(tma_w, tWgW[(None, k_begin + i, tm)])
                    cute.arch.griddepcontrol_wait()
                unit = first_unit
                while unit < sched.num_units:
                    tm, tn, split = sched.coords(unit, Int32(0), Int32(0))
                    k_begin, k_count = k_tile_range(k_tiles, splits, split)
                    for i in cutlass.range(k_count, unroll=1):
                        kt = k_begin + i
                        mainloop.producer_acquire(state)
                        bar = mainloop.producer_get_barrier(state)
                        cute.copy(tma_x, tXgX[(None, tn, kt)], tXsX[(None, state.index)], tma_bar_ptr=bar,
                                  cache_policy=Int64(_EVICT_LAST))
                        cute.copy(tma_w, tWgW[(None, kt, tm)], tWsW[(None, state.index)], tma_bar_ptr=bar,
                                  cache_policy=Int64(_EVICT_FIRST))
                        if cutlass.const_expr(not self.cfg.per_channel):
                            cute.copy(tma_s, tSgS[(None, tm, kt)], tSsS[(None, state.index)], tma_bar_ptr=bar)
                            if cutlass.const_expr(self.cfg.zeros):
                                cute.copy(tma_z, tZgZ[(None, tm, kt)], tZsZ[(None, state.index)], tma_bar_ptr=bar)
                        mainloop.producer_commit(state)
                        state.advance()
                    unit += num_units_stride
                mainloop.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            mma_tidx = tidx - self.num_threads_per_warp_group
            atom = wg_idx - 1
            t = mma_tidx % self.num_threads_per_warp_group
            # The fragment rows of this thread inside the tile (int_packing.py's fragment).
            row0 = atom * ATOM_ROWS + (t // 32) * 16 + (t % 32) // 4
            thr_mma = tiled_mma.get_slice(mma_tidx)
            # B descriptors from the warp group's first thread (warp-uniform: kept in uniform registers).
            thr_mma_wg = tiled_mma.get_slice(atom * self.num_threads_per_warp_group)
            tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sX))
            frag_shape = thr_mma.partition_A(cute.make_identity_tensor((bM, bK))).shape
            frags = (cute.make_rmem_tensor(frag_shape, self.act_dtype),
                     cute.make_rmem_tensor(frag_shape, self.act_dtype))
            acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor((bM, bN))).shape,
                                        self.acc_dtype)
            tCcD = thr_mma.partition_C(cute.make_identity_tensor((bM, bN)))
            # This thread's packed words in every stage: (4 words, chunk, stage), 16-byte aligned runs.
            sW_mine = cute.make_tensor(
                sW.iterator + atom * words + CHUNK_WORDS * t,
                cute.make_layout((CHUNK_WORDS, self.thread_words // CHUNK_WORDS, self.stages),
                                 stride=(1, CHUNK_WORDS * ATOM_THREADS, words * apt)),
            )
            raw = cute.make_rmem_tensor((CHUNK_WORDS, self.thread_words // CHUNK_WORDS), Int32)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)
            # Scales and zero points are read as 16-bit patterns (they only feed packed bf16/fp16 FMAs).
            consumer = _Consumer(self, ConsumerMainloop.create(mainloop), tiled_mma, tCrB, sW_mine, raw,
                                 cute.recast_tensor(sS, cutlass.Uint16), cute.recast_tensor(sZ, cutlass.Uint16), row0)

            sched = PersistentTileScheduler(tiles_m, tiles_n, (1, 1), self.cfg.group_m, splits)
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            unit = first_unit
            while unit < sched.num_units:
                tm, tn, split = sched.coords(unit, Int32(0), Int32(0))
                _, k_count = k_tile_range(k_tiles, splits, split)
                acc.fill(0.0)
                read_state, release_state = consumer.run(acc, frags, read_state, release_state, k_count)
                owns_epilogue = True
                if cutlass.const_expr(self.cfg.split_k):
                    if splits > 1:
                        owns_epilogue = reduce_partials(
                            acc, mWorkspace, mCounters, tm * tiles_n + tn, split, splits, mma_tidx,
                            self.num_mma_threads, epi_barrier, split_flag,
                        )
                if owns_epilogue:
                    self._epilogue(acc, tCcD, mS, mD, tm, tn)
                unit += num_units_stride

    @cute.jit
    def _epilogue(self, acc, tCcD, mS, mD, tm, tn):
        """acc (tile rows = weight rows n, columns = tokens m) -> D[m, n], per-channel scaled in fp32."""
        bM, bN, _ = self.tile_shape_mnk
        M, N = mD.shape
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            r, c = tCcD[i]
            n = tm * bM + r
            m = tn * bN + c
            if m < M and n < N:
                v = acc[i]
                if cutlass.const_expr(self.cfg.per_channel):
                    v = v * Float32(mS[0, n])
                mD[m, n] = v.to(self.act_dtype)


@dataclass(frozen=True)
class _Consumer:
    """A consumer warp group's main loop: converts each K tile's packed weights into a register fragment and runs
    the K tile's WGMMAs on it (frozen: the DSL lets it into run-time loops without carrying it)."""

    gemm: object
    pipe: object  # the mainloop's ConsumerMainloop
    tiled_mma: object
    tCrB: object  # the activation tiles' WGMMA descriptors, (.., K block, stage)
    sW_mine: object  # this thread's packed words, (4, chunk, stage)
    raw: object  # their registers
    sS: object  # the stages' scales, (tile row, group, stage)
    sZ: object
    row0: object  # this thread's first fragment row in the tile (the other is row0 + 8)

    @cute.jit
    def run(self, acc, frags, read_state, release_state, k_count):
        """acc = Wdq_tile @ X_tile^T over ``k_count`` K tiles (>= 1). K tiles alternate between the two fragment
        sets; pairs of them make one trip of the loop, so neither set is carried around it."""
        self.k_tile(acc, frags[0], read_state)
        read_state.advance()
        for _ in cutlass.range((k_count - 1) // 2, unroll=1):
            self.k_tile(acc, frags[1], read_state)
            self.pipe.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
            self.k_tile(acc, frags[0], read_state)
            self.pipe.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        if (k_count - 1) % 2 == 1:
            self.k_tile(acc, frags[1], read_state)
            self.pipe.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        warpgroup.wait_group(0)
        self.pipe.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state

    @cute.jit
    def k_tile(self, acc, frag, state):
        """Wait for the stage, convert this thread's words into ``frag`` and issue the K tile's WGMMAs; returns with
        the WGMMAs of the K tile before retired (wait_group(1))."""
        self.pipe.consumer_wait(state)
        stage = state.index
        cute.autovec_copy(self.sW_mine[(None, None, stage)], self.raw)
        self.convert(frag, stage)
        fence_registers(frag)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(ATOM_K // 16):
            cute.gemm(self.tiled_mma, acc, frag[(None, None, kb)], self.tCrB[(None, None, kb, stage)], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(1)

    @cute.jit
    def convert(self, frag, stage):
        """This thread's packed words (``raw``) -> the K tile's bf16/fp16 A fragment, scaled group-wise."""
        cfg = self.gemm.cfg
        act = cfg.act_dtype
        words = cute.recast_tensor(frag, Int32)  # K block kb's four registers are words 4 kb .. 4 kb + 3
        raw = self.raw
        one = _const2(_ONE[act])
        if cutlass.const_expr(cfg.bits == 4):
            # Per group of the K tile and fragment row (row0, row0 + 8): the scale in both halves, and the offset
            # -(magic + z) that leaves q - z exactly (symmetric: z = 8, the codes being q + 8).
            scales = []
            offsets = []
            for gi in cutlass.range_constexpr(max(self.gemm.gpt, 1)):
                for h in cutlass.range_constexpr(2):
                    if cutlass.const_expr(not cfg.per_channel):
                        scales.append(_splat(self.sS[(self.row0 + 8 * h, gi, stage)]))
                    if cutlass.const_expr(cfg.zeros):
                        z = _splat(self.sZ[(self.row0 + 8 * h, gi, stage)])
                        offsets.append(_fma2(z, _const2(0x8000 | _ONE[act]), _const2(0x8000 | _MAGIC[act]), act))
                    else:
                        offsets.append(_const2(_SYMMETRIC_OFFSET[act]))
            for kb in cutlass.range_constexpr(ATOM_K // 16):
                x = raw[kb]
                gi = 0 if cfg.per_channel else kb * 16 // cfg.group
                for i in cutlass.range_constexpr(4):
                    # Register i of the K block: elements (2i, 2i + 1), nibbles i and i + 4, row row0 + 8 * (i % 2).
                    m = _lop3(x >> (4 * i) if i else x, 0x000F000F, _pair(_MAGIC[act]), 0xEA)
                    q = _fma2(m, one, offsets[2 * gi + i % 2], act)
                    if cutlass.const_expr(not cfg.per_channel):
                        q = _fma2(q, scales[2 * gi + i % 2], _const2(0x8000), act)
                    words[kb * 4 + i] = q
        else:
            for kb in cutlass.range_constexpr(ATOM_K // 16):
                for h in cutlass.range_constexpr(2):
                    x = raw[2 * kb + h]
                    for i in cutlass.range_constexpr(2):
                        # Bytes (0, 2), then (1, 3): elements (4h, 4h + 1), then (4h + 2, 4h + 3).
                        xi = x >> 8 if i else x
                        if cutlass.const_expr(act == "bf16"):
                            # 128 + the low 7 bits, plus -128, or -256 where the sign bit is set: the byte's value.
                            m = _lop3(xi, 0x007F007F, _pair(0x4300), 0xEA)
                            c = _lop3(xi, 0x00800080, _pair(0xC300), 0xEA)
                            q = _fma2(m, one, c, act)
                        else:
                            # 1024 + (byte ^ 0x80), minus 1152.
                            m = _lop3(xi, 0x00FF00FF, _pair(0x6480), 0x6A)
                            q = _fma2(m, one, _const2(0xE480), act)
                        words[kb * 4 + 2 * h + i] = q


# -(magic + 8): bf16 -136.0, fp16 -1032.0.
_SYMMETRIC_OFFSET = {"bf16": 0xC308, "fp16": 0xE408}


def _const2(half: int) -> Int32:
    """A 16-bit pattern in both halves of an Int32 constant."""
    v = _pair(half)
    return Int32(v - (1 << 32) if v >= 1 << 31 else v)


@cute.jit
def _splat(v):
    """A 16-bit value (read from a Uint16 view) in both halves of a 32-bit register."""
    b = Int32(v)
    return b | (b << 16)

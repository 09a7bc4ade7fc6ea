"""Compile-time plan of the Hopper FP8 / INT8 GEMM (kernels/sm90/fp8_gemm.py): its configuration, the rules a
configuration must meet (MMA shape, clusters, registers, shared memory) and the shared-memory budget that
sizes the A/W stages and the epilogue's output buffers. Host-side only: the instance table validates its rows with
``Sm90GemmPlan.check_config`` without tracing a kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import cutlass

from .activation_quant import HANDOFF_UNITS, row_scale_floats, w_prefetch_floats
from .block_scales import BLOCK_RECIPES, SCALE_BLOCK, is_block_scaled, scale_smem_bytes_per_stage
from .unit_scales import unit_scale_bytes

SM90_SMEM_CAPACITY = 232448  # bytes of dynamic shared memory per CTA on H100 (227 KiB)
SM90_SMEM_PER_SM = 233472  # per SM (228 KiB), of which the driver reserves 1 KiB per resident CTA
SM90_REGISTERS_PER_SM = 65536


def shared_sm_consumer_regs(threads: int, ctas_per_sm: int, producer_regs: int) -> int:
    """Consumer registers per thread of a CTA of ``threads`` (one producer and one consumer warp group's share)
    when ``ctas_per_sm`` CTAs share an SM: the registers the CTA is launched with, moved from the producer warp
    group to the consumer."""
    return 2 * (SM90_REGISTERS_PER_SM // (ctas_per_sm * threads)) - producer_regs


def smem_capacity(ctas_per_sm: int) -> int:
    """Dynamic shared memory one CTA may use when ``ctas_per_sm`` of them share an SM."""
    return SM90_SMEM_CAPACITY if ctas_per_sm == 1 else SM90_SMEM_PER_SM // ctas_per_sm - 1024


# K tiles of weight a PDL kernel prefetches into L2 while the previous kernel finishes: 8 x 64-128 rows x 128 bytes
# per CTA, 8-17 MB over 132 SMs, about what HBM delivers in a small kernel's last microseconds (well inside L2).
PREFETCH_K_TILES = 8


@dataclass(frozen=True)
class Sm90GemmConfig:
    """Compile-time configuration of one kernel instance (the instance-table row it was built from)."""

    a_dtype: str = "e4m3"  # "e4m3" | "e5m2", or "int8" (both operands: s8 x s8 WGMMA, int32 accumulator)
    b_dtype: str = "e4m3"
    out_dtype: str = "bf16"  # "bf16" | "fp16" | "fp32"
    # Epilogue-scaled: "tensor" | "row". Block-scaled (scales applied per 128-deep K block in the main
    # loop): "1x128_128x128" (DeepSeek) | "128x128_128x128" | "1x128_1x128".
    recipe: str = "row"
    bias_dtype: Optional[str] = None  # None = no bias
    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    cluster_n: int = 1
    stages: int = 0  # 0: as many as shared memory allows
    # Rasterisation group in cluster rows (tile_scheduler.py); 0: ``raster_group_m``'s rule.
    group_m: int = 0
    # "fast": WGMMA accumulates the whole K in its accumulator (torch's use_fast_accum=True). "promoted":
    # each 128-deep K tile goes into a fresh accumulator that is added into an fp32 one, bounding the error
    # of the tensor cores' reduced-precision FP8 accumulation (torch's default, use_fast_accum=False).
    accum: str = "promoted"
    # Split-K (for problems with fewer output tiles than SMs, e.g. decode): the number of K splits is a
    # run-time argument; the splits' partial sums are reduced deterministically (kernels/sm90/split_k.py).
    split_k: bool = False
    # With split_k: split only the last, partial wave of tiles (kernels/common/last_wave_split.py) -- for
    # outputs a little over a whole number of waves; the host picks this variant per call.
    split_tail: bool = False
    # Decode schedule: compute D^T = W @ A^T, so tile_m runs over N and tile_n over M (fp8_gemm.py docstring).
    swap_ab: bool = False
    # K depth of one pipeline stage. 256 (fast accumulation only) halves the TMA requests per byte; promoted
    # accumulation and block scales work per 128-deep K tile.
    tile_k: int = 128
    # Programmatic dependent launch: the kernel may start (barriers, descriptors, register set-up) while the
    # previous kernel in the stream finishes; its TMA producer waits for that kernel (griddepcontrol.wait)
    # before its first load, and each CTA lets the next PDL kernel launch as soon as it starts.
    pdl: bool = False
    # Resident CTAs per SM. 2 (64-row tiles only): two one-warp-group CTAs share each SM, with half the shared
    # memory and 128 registers per thread each, so one CTA's MMAs run while the other promotes, stores its
    # epilogue or waits for loads -- the overlap a ping-pong schedule gets from two consumer warp groups.
    ctas_per_sm: int = 1
    # Output buffers (tile_m x epi_n slices) for the TMA-store epilogue. 0: as many as fit in the shared
    # memory the A/W stages leave, up to a whole tile, so that a tile's stores drain while the next tile's
    # MMAs run instead of each slice waiting for the one before it to leave shared memory.
    epi_stages: int = 0
    # The activations' dtype ("bf16" | "fp16") when the kernel quantizes them itself (activation_quant.py): A comes
    # unquantized and each K tile is quantized to ``a_dtype`` on its way into shared memory, in 1x128 groups (the
    # recipes with 1x128 A scales) or per token (recipe "row", e4m3 or int8), with the quantizers' numerics; None: A
    # comes quantized. The decode schedule only.
    a_input: Optional[str] = None
    # "1x128": the epilogue emits the output as e4m3 with 1x128 group scales (epilogue_quant.py), quantize_fp8's
    # numerics on the tile rounded to ``out_dtype`` (bf16) first; None: the output is ``out_dtype``.
    d_quant: Optional[str] = None

    @property
    def cluster_shape_mn(self):
        return (self.cluster_m, self.cluster_n)

    @property
    def raster_group_m(self) -> int:
        """Cluster rows walked before moving along N: a band of 16 CTA rows -- 8 rows of 2x1 clusters, 4 of
        4x1 (with 8 rows of 4x1 clusters a wave holds the A rows of more tiles than run in step, and narrow
        outputs are slower). One-row clusters walk 8."""
        if self.group_m:
            return self.group_m
        return 16 // self.cluster_m if self.cluster_m > 2 else 8


_DTYPES = {
    "e4m3": cutlass.Float8E4M3FN,
    "e5m2": cutlass.Float8E5M2,
    "int8": cutlass.Int8,
    "bf16": cutlass.BFloat16,
    "fp16": cutlass.Float16,
    "fp32": cutlass.Float32,
}


def cutlass_dtype(name: str):
    return _DTYPES[name]


def is_integer(cfg: Sm90GemmConfig) -> bool:
    """s8 x s8 operands: the WGMMA accumulates exact int32 sums, which the epilogue converts to fp32."""
    return cfg.a_dtype == "int8"


class Sm90GemmPlan:
    """Register split and shared-memory plan of a configuration (the kernel class inherits it)."""

    num_threads_per_warp_group = 128
    # The default split after setmaxnreg: room for two K-tile fragments beside the accumulator up to
    # ``default_overlap_max_n`` columns.
    producer_regs = 40
    consumer_regs = 232
    default_overlap_max_n = 128
    # Promoted accumulation: up to 144 wide, two K-tile fragments alternate so a warp group promotes one
    # while its next K tile runs; wider tiles (up to 192) have room for one: the DeepSeek recipe's run each K
    # tile as two N halves into two half fragments and promote one half while the other runs, the others
    # promote each K tile after it retires and rely on the other warp group's MMAs meanwhile (split_n_loop).
    overlapped_promote_max_n = 144
    # 144-wide tiles hold 3 x 72 fp32 fragments per consumer thread: the producer warp group gives up more
    # registers (24 / 240 per thread: 64,512 of the SM's 65,536 over 384 threads).
    wide_overlap_regs = (24, 240)
    # Block-scaled tiles with two CTAs per SM: their producers (TMA warp and scale warp) fit in 32 registers, and
    # at 40 the DeepSeek recipe's fp32-output 64x192 consumers spill.
    paired_block_producer_regs = 32
    max_promoted_tile_n = 192
    max_paired_tile_n = 192
    min_epi_stages = 2  # the A/W stages are sized to leave room for two output slices (one store in flight)
    # Kernels that quantize their activations: the producer warp group's quantizing warps hold a K tile's activation
    # vectors in registers; the narrow decode tiles' consumers need far fewer than 232.
    quantizing_regs = (96, 200)
    # Token tiles of the kernels that quantize their activations: each CTA reads its tokens' K tile unquantized
    # (2 bytes an element) beside the weight tile, so wider token tiles move more bytes than the quantizer saves.
    max_quantizing_tile_n = 32
    # ... and their stages: a stage is in flight from its loads through the quantizing warp to the MMAs, longer than
    # a plain stage, so the weight stream needs more of them in flight than the 8 of the other kernels.
    quantizing_max_stages = 16

    @classmethod
    def register_split(cls, cfg: Sm90GemmConfig) -> Tuple[int, int]:
        """(producer, consumer) registers per thread after setmaxnreg."""
        producer, consumer = cls.producer_regs, cls.consumer_regs
        if cfg.a_input is not None:
            return cls.quantizing_regs
        if cfg.accum == "promoted" and cls.default_overlap_max_n < cfg.tile_n <= cls.overlapped_promote_max_n:
            producer, consumer = cls.wide_overlap_regs
        if cfg.ctas_per_sm > 1:
            if is_block_scaled(cfg.recipe):
                producer = cls.paired_block_producer_regs
            threads = (1 + cfg.tile_m // 64) * cls.num_threads_per_warp_group
            consumer = shared_sm_consumer_regs(threads, cfg.ctas_per_sm, producer)
        return producer, consumer

    @classmethod
    def split_n_loop(cls, cfg: Sm90GemmConfig) -> bool:
        """Whether the promoted K tiles run as two N halves (``Sm90Fp8Gemm._mainloop_split_n``): the DeepSeek
        recipe's (1x128 A x 128x128 W) tiles too wide for two full fragments. The other recipes run slower
        split and stay serial (docs/design.md)."""
        return (cfg.recipe == "1x128_128x128" and not cfg.swap_ab and cfg.accum == "promoted"
                and cfg.tile_n > cls.overlapped_promote_max_n)

    @classmethod
    def wgmma_n(cls, cfg: Sm90GemmConfig) -> int:
        """N of the kernel's ``wgmma.mma_async`` instructions."""
        return cfg.tile_n // 2 if cls.split_n_loop(cfg) else cfg.tile_n

    @classmethod
    def check_config(cls, cfg: Sm90GemmConfig) -> None:
        """Raise ValueError naming the broken rule (MMA shape, cluster, shared-memory budget)."""
        if cfg.tile_m not in (64, 128):
            raise ValueError(
                f"tile_m is 64 (one consumer warp group) or 128 (two, cooperative), got tile_m={cfg.tile_m}")
        if cfg.ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm is 1 or 2, got {cfg.ctas_per_sm}")
        if cfg.ctas_per_sm == 2 and cfg.tile_m != 64:
            raise ValueError(
                f"two CTAs per SM fit only with one consumer warp group (tile_m=64), got tile_m={cfg.tile_m}")
        if cfg.ctas_per_sm == 2 and cfg.tile_n > cls.max_paired_tile_n:
            # Launched at 128 registers per thread, ptxas cannot build wider ones (64x208 fast: C7602).
            raise ValueError(f"two CTAs per SM (128 registers per thread at launch) take tiles at most "
                             f"{cls.max_paired_tile_n} wide, got tile_n={cfg.tile_n}")
        if (cfg.tile_m == 64 and cfg.ctas_per_sm == 1 and cfg.accum == "promoted"
                and cfg.tile_n > cls.overlapped_promote_max_n):
            raise ValueError(f"a 64-row tile has one consumer warp group, whose serial promotion nothing would "
                             f"overlap: promoted tiles must be <= {cls.overlapped_promote_max_n} wide, "
                             f"got tile_n={cfg.tile_n}")
        if cfg.tile_n % 16 or not 16 <= cfg.tile_n <= 256:
            raise ValueError(f"WGMMA N per warp group must be a multiple of 16 in 16..256, got tile_n={cfg.tile_n}")
        if cfg.tile_k not in (128, 256):
            raise ValueError(f"tile_k must be 128 or 256, got {cfg.tile_k}")
        if cfg.tile_k != 128 and is_block_scaled(cfg.recipe):
            raise ValueError(f"block-scaled recipe {cfg.recipe!r} scales each 128-deep K block: it needs tile_k=128, "
                             f"got {cfg.tile_k}")
        if cfg.tile_k != 128 and cfg.accum == "promoted":
            raise ValueError(f"promoted accumulation adds each 128-deep K tile into fp32 "
                             f"(torch's use_fast_accum=False): it needs tile_k=128, got {cfg.tile_k}")
        if cfg.split_tail and (not cfg.split_k or cfg.swap_ab):
            raise ValueError("split_tail (split only the last wave in K) needs split_k and the unswapped schedule")
        if cfg.accum not in ("fast", "promoted"):
            raise ValueError(f"accum must be 'fast' or 'promoted', got {cfg.accum!r}")
        if (cfg.a_dtype == "int8") != (cfg.b_dtype == "int8"):
            raise ValueError(f"int8 operands pair with int8 only (s8 x s8 WGMMA), got {cfg.a_dtype} x {cfg.b_dtype}")
        if is_integer(cfg):
            # The int32 sum is exact: there is no rounding for promotion to bound, and block scales would need it.
            if cfg.accum != "fast":
                raise ValueError(f"int8 GEMMs accumulate exactly in int32: accum must be 'fast', got {cfg.accum!r}")
            if cfg.recipe not in ("tensor", "row"):
                raise ValueError(f"int8 GEMMs scale in the epilogue: recipe must be 'tensor' or 'row', "
                                 f"got {cfg.recipe!r}")
        if cfg.a_input is not None:
            cls._check_quantizing(cfg)
        if cfg.d_quant is not None:
            cls._check_fp8_out(cfg)
        if cfg.recipe not in ("tensor", "row") and not is_block_scaled(cfg.recipe):
            raise ValueError(f"recipe must be 'tensor', 'row' or one of {sorted(BLOCK_RECIPES)}, got {cfg.recipe!r}")
        if is_block_scaled(cfg.recipe) and cfg.accum != "promoted":
            raise ValueError(
                f"block-scaled recipe {cfg.recipe!r} scales each K tile while promoting it: it needs "
                f"accum='promoted', got accum={cfg.accum!r}"
            )
        if cfg.accum == "promoted" and cfg.tile_n > cls.max_promoted_tile_n:
            raise ValueError(
                f"promoted accumulation keeps two or three 64 x tile_n fp32 fragments per warp group in "
                f"registers; tile_n={cfg.tile_n} > {cls.max_promoted_tile_n} does not fit"
            )
        cm, cn = cfg.cluster_shape_mn
        if cm * cn > 4 or cm not in (1, 2, 4) or cn not in (1, 2, 4):
            raise ValueError(f"cluster shape must be powers of two with at most 4 CTAs, got {cfg.cluster_shape_mn}")
        if cfg.epi_stages < 0 or cfg.epi_stages == 1:
            raise ValueError(f"epi_stages is 0 (as many as fit) or >= 2 output buffers, got {cfg.epi_stages}")
        stages = cfg.stages or cls.max_stages(cfg)
        epi = cls.epi_buffers(cfg, stages)
        need = cls.smem_usage(cfg, stages, epi)
        if stages < 2 or need > smem_capacity(cfg.ctas_per_sm):
            raise ValueError(
                f"{stages} stages of {cls.stage_bytes(cfg)} B plus a {cls.epilogue_bytes(cfg, epi)} B epilogue need "
                f"{need} B of shared memory; the budget is {smem_capacity(cfg.ctas_per_sm)} B per CTA "
                f"({cfg.ctas_per_sm} per SM) and >= 2 stages"
            )

    @classmethod
    def _check_quantizing(cls, cfg: Sm90GemmConfig) -> None:
        """The rules of a kernel that quantizes its activations (``a_input``)."""
        if cfg.a_input not in ("bf16", "fp16"):
            raise ValueError(f"a_input (the activations the kernel quantizes) is 'bf16' or 'fp16', got {cfg.a_input!r}")
        if (cfg.a_dtype, cfg.b_dtype) not in (("e4m3", "e4m3"), ("e4m3", "e5m2"), ("int8", "int8")):
            raise ValueError(f"activations are quantized to e4m3 for an FP8 weight or to int8 for an int8 one: got "
                             f"{cfg.a_dtype} x {cfg.b_dtype}")
        gran = BLOCK_RECIPES.get(cfg.recipe)
        if cfg.recipe != "row" and (gran is None or gran[0] != "group"):
            raise ValueError(f"the kernel quantizes activations per token ('row') or in 1x128 groups (recipes "
                             f"{', '.join(r for r, g in BLOCK_RECIPES.items() if g[0] == 'group')}), "
                             f"got {cfg.recipe!r}")
        if not cfg.swap_ab or cfg.cluster_shape_mn != (1, 1) or cfg.ctas_per_sm != 1:
            raise ValueError("activation quantization runs in the decode schedule (swap_ab) without clusters (each "
                             f"CTA quantizes its own token tile), one CTA per SM; got swap_ab={cfg.swap_ab}, cluster "
                             f"{cfg.cluster_shape_mn}, ctas_per_sm={cfg.ctas_per_sm}")
        if cfg.tile_n > cls.max_quantizing_tile_n:
            raise ValueError(f"token tiles of a kernel that quantizes its activations are at most "
                             f"{cls.max_quantizing_tile_n} wide, got tile_n={cfg.tile_n}")

    @classmethod
    def _check_fp8_out(cls, cfg: Sm90GemmConfig) -> None:
        """The rules of a kernel whose epilogue emits FP8 in 1x128 groups (``d_quant``, epilogue_quant.py)."""
        if cfg.d_quant != "1x128":
            raise ValueError(f"d_quant (the output's FP8 scale groups) is '1x128' or None, got {cfg.d_quant!r}")
        if cfg.swap_ab or cfg.a_input is not None:
            raise ValueError("an FP8 output's 1x128 groups run along the tile's rows: the unswapped schedule with "
                             f"quantized operands only; got swap_ab={cfg.swap_ab}, a_input={cfg.a_input!r}")
        if cfg.tile_n % SCALE_BLOCK:
            raise ValueError(f"an FP8 output's tiles hold whole 1x128 groups: tile_n must be a multiple of "
                             f"{SCALE_BLOCK}, got tile_n={cfg.tile_n}")
        if cfg.out_dtype != "bf16" or cfg.epi_stages:
            raise ValueError("an FP8 output is quantized from the tile rounded to bf16, staged in one buffer: "
                             f"out_dtype must be 'bf16' and epi_stages 0, got {cfg.out_dtype!r}, {cfg.epi_stages}")

    # ---- host-side sizing (also used by the instance table's validity rules) -------------------------------
    @staticmethod
    def stage_bytes(cfg: Sm90GemmConfig) -> int:
        # One byte per FP8 / INT8 element, K tile of 128 (+ the K tile's scales for block-scaled recipes).
        scales = scale_smem_bytes_per_stage(cfg.tile_m, cfg.tile_n) if is_block_scaled(cfg.recipe) else 0
        # (+ the unquantized activation tile, 16-bit, of a kernel that quantizes its activations, and its barrier)
        unquantized = cfg.tile_n * cfg.tile_k * 2 + 8 if cfg.a_input else 0
        return (cfg.tile_m + cfg.tile_n) * cfg.tile_k + scales + unquantized

    @staticmethod
    def epi_n(cfg: Sm90GemmConfig) -> int:
        # Output slices must tile tile_n exactly (80- and 144-wide tiles store in 16-column slices); an FP8 output's
        # are its 128-column groups.
        return 128 if cfg.d_quant else 32 if cfg.tile_n % 32 == 0 else 16

    @classmethod
    def slice_bytes(cls, cfg: Sm90GemmConfig) -> int:
        width = {"bf16": 2, "fp16": 2, "fp32": 4}[cfg.out_dtype]
        return cfg.tile_m * cls.epi_n(cfg) * width

    @classmethod
    def epilogue_bytes(cls, cfg: Sm90GemmConfig, epi_stages: int) -> int:
        return cls.slice_bytes(cfg) * epi_stages

    reserved_bytes = 2048  # mbarriers and 1 KiB alignment of the buffers

    @classmethod
    def fixed_bytes(cls, cfg: Sm90GemmConfig) -> int:
        """Shared memory outside the stages and the epilogue: barriers and alignment, the W-scale buffers of
        the quantizing warps (activation_quant.py), the row-wise recipe's unit-scale slot (unit_scales.py)."""
        if not cfg.a_input:
            return cls.reserved_bytes + (unit_scale_bytes(cfg.tile_n) if cfg.recipe == "row" else 0)
        quantizing = w_prefetch_floats() * 4
        if cfg.recipe == "row":  # per token: the token scales and the epilogue ring's barriers
            quantizing += row_scale_floats(cfg.tile_n) * 4 + 2 * HANDOFF_UNITS * 8
        return cls.reserved_bytes + quantizing

    @classmethod
    def smem_usage(cls, cfg: Sm90GemmConfig, stages: int, epi_stages: int) -> int:
        return stages * cls.stage_bytes(cfg) + cls.epilogue_bytes(cfg, epi_stages) + cls.fixed_bytes(cfg)

    @classmethod
    def max_stages(cls, cfg: Sm90GemmConfig) -> int:
        epi = cfg.epi_stages or (1 if cfg.d_quant else cls.min_epi_stages)
        free = smem_capacity(cfg.ctas_per_sm) - cls.epilogue_bytes(cfg, epi) - cls.fixed_bytes(cfg)
        return min(cls.quantizing_max_stages if cfg.a_input else 8, free // cls.stage_bytes(cfg))

    @classmethod
    def epi_buffers(cls, cfg: Sm90GemmConfig, stages: int) -> int:
        """Output slice buffers: ``cfg.epi_stages``, or (0) as many as the A/W stages leave room for, at
        most one tile's slices. The A/W stages come first: a stage is never given up for the epilogue."""
        if cfg.epi_stages:
            return cfg.epi_stages
        if cfg.d_quant:
            return 1  # read back by the epilogue's threads before the next slice is written: no store in flight
        slices = cfg.tile_n // cls.epi_n(cfg)
        free = smem_capacity(cfg.ctas_per_sm) - stages * cls.stage_bytes(cfg) - cls.fixed_bytes(cfg)
        return max(cls.min_epi_stages, min(slices, free // cls.slice_bytes(cfg)))

    # ---- host entry (traced once per configuration) -----------------------------------------------

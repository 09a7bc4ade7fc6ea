"""The kernel instance table: every kernel configuration this library builds, for every architecture, declared once.

Runtime dispatch (``cutedsl_gemm.selection.dispatch``), the JIT cache, the precompiler, the AOT exporter and the
catalog all read ``table()`` (also ``INSTANCES``); there is no other list of configurations. A row is a *tile
configuration* crossed with the type axes it supports; ``expand()`` turns the table into concrete, hashable
instances. An instance is its kernel's configuration: ``KernelInstance.sm90_config``,
``KernelInstance.sm100_kernel``, ``weight_only_config`` and ``grouped_config`` give what each kernel family builds
it from (the families, ``cutedsl_gemm/families/``, derive them). (arch, op) names the instance's family
(``families/registry.py``); ``op`` tells the families' rows apart: "gemm" (``scaled_mm``), ``QUANT_GEMM``
(``quantize_scaled_mm``: the Hopper GEMM quantizing its activations), ``GEMM_FP8_OUT`` (``scaled_mm_fp8_out``: the
Hopper GEMM emitting FP8 in 1x128 groups), ``WEIGHT_ONLY`` (``mm_weight_only``) or ``GROUPED_GEMM``
(``grouped_scaled_mm``); a reader of one family's rows filters by it.

The table is expanded on first use, not at import (``import cutedsl_gemm`` loads neither the DSL nor a kernel
module). Validity rules (shared-memory budget, TMA alignment, MMA shape limits) live with the kernel classes and
their families, and are checked by ``validate`` (the family's ``check``): for every row by ``validate_table`` (a
CPU test, ``precompile``, ``export``), and for an instance when it is compiled (``runtime.compile``), so a bad edit
to the table fails loudly before any launch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

# The archs and ops the kernel families are keyed by (re-exported: the table's readers take them from here).
from cutedsl_gemm.families.keys import (
    GEMM_FP8_OUT,
    GROUPED_GEMM,
    QUANT_GEMM,
    SM90,
    SM90_GEMM_OPS,
    SM100,
    WEIGHT_ONLY,
)

#: Operand class of the sm_100a GEMM: one compiled kernel takes every f8f6f4 format (e4m3, e5m2, e3m2, e2m3,
#: e2m1) as a run-time value.
F8F6F4 = "f8f6f4"
#: tcgen05 MMA kind of each sm_100a (recipe, operand class): the dense GEMM, and the block-scaled ones (the packed
#: FP4 kinds keep e2m1 operands packed in shared memory).
SM100_KINDS = {("tensor", F8F6F4): "f8f6f4", ("mx", F8F6F4): "mxf8f6f4", ("mx", "e2m1"): "mxf4",
               ("nvfp4", "e2m1"): "mxf4nvf4"}
#: Operand pairs of the Hopper INT8 (W8A8) rows: s8 x s8 only (no int8 x FP8 WGMMA).
INT8_PAIRS = (("int8", "int8"),)


@dataclass(frozen=True)
class KernelInstance:
    """One compiled kernel: everything that changes generated code, nothing that doesn't (M, N, K)."""

    arch: str  # "sm_90a" | "sm_100a"
    op: str  # "gemm" | QUANT_GEMM | GEMM_FP8_OUT | WEIGHT_ONLY
    schedule: str  # sm_90a: "cooperative" | "small_m"; sm_100a: "1sm" | "2sm" (cta_group::1 / ::2)
    recipe: str  # formats.RECIPES key ("gemm"), WEIGHT_ONLY_RECIPES key (WEIGHT_ONLY)
    a_dtype: str  # an element format, or the sm_100a operand class F8F6F4
    b_dtype: str
    out_dtype: str
    bias_dtype: Optional[str]
    tile_m: int
    tile_n: int
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 0  # 0 = as many as shared memory allows
    # "promoted" | "fast" (torch's use_fast_accum). sm_100a rows are "fast": tcgen05 accumulates all of K in its
    # fp32 tensor-memory accumulator, with no promotion step.
    accum: str = "promoted"
    # Dispatch: this instance serves problems with m_min <= M <= m_max.
    m_min: int = 1
    m_max: int = 1 << 31
    # D^T = W @ A^T: tile_m runs over the user's N and tile_n over M (the decode kernels).
    swap_ab: bool = False
    tile_k: int = 128
    # Split only the last, partial wave of tiles in K: never picked by M range, but by the call when
    # dispatch.last_wave_splits says so (the sibling of a cooperative row).
    split_tail: bool = False
    # Resident CTAs per SM (2: two 64-row CTAs share an SM, Sm90GemmConfig.ctas_per_sm).
    ctas_per_sm: int = 1
    # Output slice buffers of the epilogue (Sm90GemmConfig.epi_stages); 0 (every table row): as many as fit.
    epi_stages: int = 0
    # Grouped row-wise tiles: the unit's scales in hand before its main loop ends (Sm90GroupedGemmConfig.
    # early_row_scales: 64-row tiles load them into registers as it starts, 128-row ones have warp 1 stage them).
    early_row_scales: bool = False

    @property
    def name(self) -> str:
        bias = f"_bias{self.bias_dtype}" if self.bias_dtype else ""
        extra = ("_swapab" if self.swap_ab else "") + (f"_k{self.tile_k}" if self.tile_k != 128 else "")
        extra += f"_{self.ctas_per_sm}persm" if self.ctas_per_sm != 1 else ""
        extra += f"_epi{self.epi_stages}" if self.epi_stages else ""
        extra += "_earlyscales" if self.early_row_scales else ""
        # (before the tile, so that no instance's name is a substring of another's: name filters stay exact)
        wave = "_lastwave" if self.split_tail else ""
        return (
            f"{self.arch}_{self.op}_{self.schedule}_{self.recipe}_{self.a_dtype}x{self.b_dtype}_{self.out_dtype}{bias}"
            f"{wave}_t{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}_{self.accum}{extra}"
        )

    def _tile_grid(self, m: int, n: int) -> Tuple[int, int]:
        """Output tiles along the kernel's rows and columns (a swapped kernel tiles N by tile_m, M by tile_n)."""
        rows, cols = (n, m) if self.swap_ab else (m, n)
        return -(-rows // self.tile_m), -(-cols // self.tile_n)

    def output_tiles(self, m: int, n: int) -> int:
        """Output tiles of an M x N problem."""
        tiles_r, tiles_c = self._tile_grid(m, n)
        return tiles_r * tiles_c

    def cluster_tiles(self, m: int, n: int) -> int:
        """Cluster tiles (cluster_m x cluster_n blocks of output tiles) of an M x N problem, as the kernel's
        scheduler walks them."""
        tiles_r, tiles_c = self._tile_grid(m, n)
        return -(-tiles_r // self.cluster_m) * -(-tiles_c // self.cluster_n)

    def k_tiles(self, k: int) -> int:
        return -(-k // self.tile_k)

    @property
    def can_split_k(self) -> bool:
        """Compiled with the split-K reduction (dispatch.choose_splits decides per call). Not the 128x256
        fast-accumulation tiles: their 128-register accumulator leaves no room for it without spilling."""
        return self.arch == SM90 and (self.op == WEIGHT_ONLY or self.op in SM90_GEMM_OPS and self.tile_n <= 192)

    def sm90_config(self):
        """The Hopper kernel's configuration: the fields it shares with this instance, plus what follows from them
        (``families.sm90_gemm.config``)."""
        from cutedsl_gemm.families import sm90_gemm

        return sm90_gemm.config(self)

    @property
    def mma_kind(self) -> Optional[str]:
        """The tcgen05 MMA kind of an sm_100a instance (``SM100_KINDS``); None elsewhere."""
        return SM100_KINDS.get((self.recipe, self.a_dtype)) if self.arch == SM100 else None

    def sm100_kernel(self):
        """The Blackwell kernel object this instance compiles (``families.sm100_gemm.kernel``): 2-CTA
        (``cta_group::2``) when its clusters are 2x1, block-scaled through ``BlockScaling`` for the MX / NVFP4
        kinds."""
        from cutedsl_gemm.families import sm100_gemm

        return sm100_gemm.kernel(self)


@dataclass(frozen=True)
class KernelVariant(KernelInstance):
    """A Hopper row built with some fields of its kernel configuration changed (``Sm90GemmConfig``), to time a kernel
    option against the row (benchmarks) and check that it gives the same bits (tests). Not in the table; its repr,
    the JIT cache's key, holds the changes, so it compiles and caches apart from the row."""

    changes: Tuple[Tuple[str, object], ...] = ()  # (Sm90GemmConfig field, value), sorted

    def sm90_config(self):
        return dataclasses.replace(super().sm90_config(), **dict(self.changes))

    @property
    def name(self) -> str:
        return super().name + "".join(f"_{field}{value}" for field, value in self.changes)


def kernel_variant(inst: KernelInstance, **changes) -> KernelVariant:
    """``inst`` built with ``changes`` to its Hopper kernel configuration (checked when it is built)."""
    return KernelVariant(**_shared_fields(inst, KernelInstance), changes=tuple(sorted(changes.items())))


def _shared_fields(src, cls) -> dict:
    """The fields of dataclass ``src`` that dataclass ``cls`` also has, by name."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {f.name: getattr(src, f.name) for f in dataclasses.fields(src) if f.name in names}


def operand_dtypes(arch: str, recipe: str, a_format: str, b_format: str) -> Tuple[str, str]:
    """The (a_dtype, b_dtype) of the instances that run operands in these formats: Hopper builds a kernel per
    FP8 pair; the sm_100a GEMM takes every f8f6f4 format at run time (F8F6F4), except where a kind of its own
    takes the pair (e2m1 x e2m1 under MX or NVFP4 scales: the packed FP4 kinds)."""
    if arch != SM100 or (a_format == b_format and (recipe, a_format) in SM100_KINDS):
        return a_format, b_format
    return F8F6F4, F8F6F4


#: The instance fields a table row gives several values of (``expand`` crosses them), as the row's type axes.
_TYPE_AXES = ("recipe", "a_dtype", "b_dtype", "out_dtype", "bias_dtype")


def _row_fields() -> list:
    """A row's fields: an instance's, with ``recipes`` for its recipe and the type axes after the rest."""
    out = []
    for f in dataclasses.fields(KernelInstance):
        if f.name == "recipe":
            out.append(("recipes", "Tuple[str, ...]"))
        elif f.name not in _TYPE_AXES:
            default = {} if f.default is dataclasses.MISSING else {"default": f.default}
            out.append((f.name, f.type, dataclasses.field(**default)))
    return out + [
        ("ab_dtypes", "Tuple[Tuple[str, str], ...]",
         dataclasses.field(default=(("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2")))),
        ("out_dtypes", "Tuple[str, ...]", dataclasses.field(default=("bf16", "fp16", "fp32"))),
        # None = no bias; "out" = same dtype as the output; "fp32".
        ("bias_kinds", "Tuple[Optional[str], ...]", dataclasses.field(default=(None, "out", "fp32"))),
    ]


TileConfig = dataclasses.make_dataclass("TileConfig", _row_fields(), frozen=True)
TileConfig.__module__ = __name__
TileConfig.__doc__ = """A row of the table: an instance's fields, with the type axes it is built for (``recipes``,
``ab_dtypes``, ``out_dtypes``, ``bias_kinds``) in place of one recipe and dtype each."""


# ------------------------------------------------------------------------------------------------
# Weight-only GEMMs (kernels/sm90/weight_only_gemm.py, op WEIGHT_ONLY): bf16 / fp16 activations (a_dtype, also the
# output's dtype) x packed int4 / int8 weights (b_dtype), scales group-wise along K or per output channel (the
# recipe, a WEIGHT_ONLY_RECIPES key, not a formats.RECIPES one). Their rows are in TABLE, after the Hopper GEMMs'.
# ------------------------------------------------------------------------------------------------
#: recipe -> (group along K, integer zero points); group 0 is one scale per output channel (the epilogue's).
WEIGHT_ONLY_RECIPES = {
    "group32": (32, False), "group64": (64, False), "group128": (128, False),
    "group32_zeros": (32, True), "group64_zeros": (64, True), "group128_zeros": (128, True),
    "channel": (0, False),
}
#: weight format -> the recipes it runs with
WEIGHT_ONLY_FORMATS = {"int4": tuple(WEIGHT_ONLY_RECIPES), "int8": ("channel",)}


def weight_only_recipe(group: int, zeros: bool) -> str:
    """The recipe name of a weight-only (group, zero points) combination."""
    return "channel" if group == 0 else f"group{group}" + ("_zeros" if zeros else "")


def weight_only_config(inst: KernelInstance):
    """The weight-only kernel's configuration of a weight-only instance (op WEIGHT_ONLY;
    ``families.sm90_weight_only.config``)."""
    from cutedsl_gemm.families import sm90_weight_only

    return sm90_weight_only.config(inst)


def grouped_config(inst: KernelInstance):
    """The grouped GEMM's configuration of an instance of op GROUPED_GEMM (its schedule is the layout;
    ``families.sm90_grouped.config``)."""
    from cutedsl_gemm.families import sm90_grouped

    return sm90_grouped.config(inst)


# ------------------------------------------------------------------------------------------------
# THE TABLE (the measurements behind its rows: docs/design.md, "How dispatch chooses")
# ------------------------------------------------------------------------------------------------
#: Smallest M of the Hopper cooperative (unswapped) rows: up to 32 one swapped token tile covers M and streams W
#: at the HBM floor, where an unswapped tile pads M to 64 rows; from 33 they compete by dispatch.wave_cost.
COOPERATIVE_M_MIN = 33

TABLE: Tuple[TileConfig, ...] = (
    # Hopper, small M (decode, M <= 128): the GEMM streams W once and is memory-bound, so the kernels run swapped
    # (D^T = W @ A^T), the M activation rows on WGMMA's N side, as narrow as M allows. From M = 33 the cooperative
    # rows compete with them (dispatch.wave_cost); ties go to the earlier row, so these come first.
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("tensor", "row"), 128, tn, accum=acc, m_min=lo, m_max=hi,
                   swap_ab=True, tile_k=256 if acc == "fast" and tn == 64 else 128)
        for acc in ("promoted", "fast")
        for tn, lo, hi in ((16, 1, 16), (32, 17, 32), (64, 33, 128))
    ),
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, tn,
                   accum="promoted", m_min=lo, m_max=hi, swap_ab=True)
        for tn, lo, hi in ((16, 1, 16), (32, 17, 32), (64, 33, 128))
    ),
    # 64-row tiles (one consumer warp group): twice the tiles, for outputs the 128-row ones fill under a wave of
    # SMs (dispatch.wave_cost; ties go to the 128-row rows above).
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("tensor", "row"), 64, tn, accum=acc, m_min=lo, m_max=hi,
                   swap_ab=True, tile_k=256 if acc == "fast" and tn == 64 else 128)
        for acc in ("promoted", "fast")
        for tn, lo, hi in ((16, 1, 16), (32, 17, 32), (64, 33, 128))
    ),
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 64, tn,
                   accum="promoted", m_min=lo, m_max=hi, swap_ab=True)
        for tn, lo, hi in ((16, 1, 16), (32, 17, 32), (64, 33, 128))
    ),
    # One token tile for M = 65-128 in 2x1 clusters, whose two CTAs (two W tiles) share it by multicast; it
    # competes with 128x64 and the unswapped tiles by dispatch.wave_cost (its rate estimated from its neighbours').
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("tensor", "row"), 128, 128, cluster_m=2, accum=acc, m_min=65,
                   m_max=128, swap_ab=True)
        for acc in ("promoted", "fast")
    ),
    TileConfig("sm_90a", "gemm", "small_m", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, 128,
               cluster_m=2, accum="promoted", m_min=65, m_max=128, swap_ab=True),
    # Hopper, epilogue-scaled FP8: promoted tiles are at most 192 wide (K-tile fragments sit beside the accumulator),
    # fast accumulation adds 128x256; they compete by dispatch.wave_cost. Small tiles run without clusters (about a
    # wave of output), but 64x96 (measured faster in them) and 64x128 above M = 1024 (so wave_cost takes 128x96 there).
    *(
        TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), tm, tn, cluster_m=cm, cluster_n=cn, accum=acc,
                   **{"m_min": COOPERATIVE_M_MIN, **m_range})
        for acc in ("promoted", "fast")
        for tm, tn, cm, cn, m_range in ((128, 192, 2, 1, {}), (128, 128, 2, 1, {}), (128, 96, 1, 1, {}),
                                        (64, 128, 1, 1, {"m_max": 1024}), (64, 128, 1, 2, {"m_min": 1025}),
                                        (64, 64, 1, 1, {}), (128, 144, 2, 1, {}),
                                        (64, 96, 2, 2, {}) if acc == "promoted" else (64, 96, 1, 2, {}))
    ),
    # Two CTAs per SM (64-row tiles, half an SM each): one CTA's epilogue runs while the other keeps the tensor
    # cores busy, which short-K outputs need (dispatch.wave_cost's epilogue term).
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 64, 192, cluster_m=2, cluster_n=1,
               accum="promoted", ctas_per_sm=2, m_min=COOPERATIVE_M_MIN),
    # The same pair swapped (W rows on WGMMA's M side), as cuBLAS runs narrow outputs with many rows; its low rate
    # (dispatch.PAIRED_TILE_RATES) keeps it to such shapes.
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 64, 192, cluster_m=2, cluster_n=1,
               accum="promoted", swap_ab=True, ctas_per_sm=2, m_min=COOPERATIVE_M_MIN),
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 128, 256, cluster_m=2, cluster_n=1, accum="fast",
               m_min=COOPERATIVE_M_MIN),
    # 128x128 in 4x1 clusters: each W tile multicast to four CTAs, for narrow outputs with many rows, which are
    # bound by L2 bytes per MMA (dispatch.CLUSTER_4X1_RATE_GAIN, dispatch.cluster_slots).
    *(
        TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 128, 128, cluster_m=4, cluster_n=1,
                   accum=acc, m_min=COOPERATIVE_M_MIN)
        for acc in ("promoted", "fast")
    ),
    # Hopper, block-scaled FP8: each 128-deep K block is scaled while it is promoted, so these are
    # promoted-accumulation kernels; 128x128 and 128x192 compete by dispatch.wave_cost.
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, 128,
        cluster_m=2, cluster_n=1, accum="promoted", m_min=COOPERATIVE_M_MIN,
    ),
    # The DeepSeek recipe's 128x192 tile (its split-N loop) in 4 A/W stages, which leave room for the whole tile's
    # output slices, so a tile's stores drain while the next tile runs; the other 192-wide loops keep 5.
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128",), 128, 192, cluster_m=2, cluster_n=1, stages=4,
        accum="promoted", m_min=COOPERATIVE_M_MIN,
    ),
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("128x128_128x128", "1x128_1x128"), 128, 192,
        cluster_m=2, cluster_n=1, accum="promoted", m_min=COOPERATIVE_M_MIN,
    ),
    # Two CTAs per SM for short K, as for the epilogue-scaled recipes.
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 64, 192,
        cluster_m=2, cluster_n=1, accum="promoted", ctas_per_sm=2, m_min=COOPERATIVE_M_MIN,
    ),
    # 64-row tiles where a block-scaled output fills under a wave of 128-row tiles, up to M = 1024 (above, the
    # 128-row tiles' last-wave splits, which wave_cost does not see, make up their waves).
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 64, 128,
        cluster_m=1, cluster_n=1, accum="promoted", m_min=COOPERATIVE_M_MIN, m_max=1024,
    ),
    # 128x128 in 4x1 clusters, as for the epilogue-scaled recipes, from M = 1025 (at M = 1024 the 2x1 tile's
    # last-wave split, which wave_cost does not model, is faster).
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, 128,
        cluster_m=4, cluster_n=1, accum="promoted", m_min=1025,
    ),
    # Last-wave split variants of the promoted cooperative rows above (kernels/common/last_wave_split.py), chosen per
    # call in place of their sibling when the last wave would be nearly empty and K is long (dispatch.last_wave_splits).
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 128, 192, cluster_m=2, cluster_n=1,
               accum="promoted", split_tail=True, m_min=COOPERATIVE_M_MIN),
    *(
        TileConfig("sm_90a", "gemm", "cooperative", recipes, 128, tn, cluster_m=2, cluster_n=1, stages=stages,
                   accum="promoted", split_tail=True, m_min=COOPERATIVE_M_MIN)
        for recipes, tn, stages in (
            (("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, 0),
            (("1x128_128x128",), 192, 4),
            (("128x128_128x128", "1x128_1x128"), 192, 0),
        )
    ),
    # Hopper, INT8 (W8A8): the FP8 family's kernel with s8 x s8 WGMMA (same K tile bytes, so the same tiles and
    # stages), tensor-wise or row-wise scales. The int32 sum is exact, so every row accumulates all of K in the
    # tensor cores ("fast"); the rows mirror the FP8 fast ones: swapped small-M tiles first, then the cooperative
    # tiles, the 2-per-SM pair and the last-wave split sibling of 128x192.
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("tensor", "row"), tm, tn, accum="fast", m_min=lo, m_max=hi,
                   swap_ab=True, tile_k=256 if tn == 64 else 128, ab_dtypes=INT8_PAIRS)
        for tm, tn, lo, hi in ((128, 16, 1, 16), (128, 32, 17, 32), (128, 64, 33, 128), (64, 16, 1, 16),
                               (64, 64, 33, 128))
    ),
    *(
        TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), tm, tn, cluster_m=cm, cluster_n=cn,
                   accum="fast", split_tail=tail, ctas_per_sm=per_sm, ab_dtypes=INT8_PAIRS,
                   **{"m_min": COOPERATIVE_M_MIN, **m_range})
        for tm, tn, cm, cn, per_sm, tail, m_range in (
            (128, 256, 2, 1, 1, False, {}), (128, 192, 2, 1, 1, False, {}), (128, 128, 2, 1, 1, False, {}),
            (128, 96, 1, 1, 1, False, {}), (64, 128, 1, 1, 1, False, {"m_max": 1024}),
            (64, 128, 1, 2, 1, False, {"m_min": 1025}), (64, 64, 1, 1, 1, False, {}), (128, 144, 2, 1, 1, False, {}),
            (64, 96, 1, 2, 1, False, {}), (128, 128, 4, 1, 1, False, {}), (64, 192, 2, 1, 2, False, {}),
            (128, 192, 2, 1, 1, True, {}),
        )
    ),
    # Hopper, FP8 GEMMs that quantize their activations (op QUANT_GEMM): the block-scaled decode rows above with bf16 /
    # fp16 activations, quantized in 1x128 groups by the producer warps (kernels/sm90/activation_quant.py). One
    # kernel per decode-sized linear layer; from M = 33 the token tiles read too many unquantized bytes
    # (Sm90GemmPlan.max_quantizing_tile_n) and quantize_scaled_mm runs quantize_fp8 and scaled_mm.
    # Per token ("row": FP8 per token x per channel, promoted like scaled_mm's default; int8 W8A8, exact "fast"), the
    # warps find each token tile's scales over all of K first. The tiles are scaled_mm's decode tiles of the same
    # operands (int8 has no 64x32), so both paths pick the same tile.
    *(
        TileConfig(SM90, QUANT_GEMM, "small_m", recipes, tm, tn, accum=accum, m_min=lo, m_max=hi, swap_ab=True,
                   ab_dtypes=((act, weight),), out_dtypes=(act,), bias_kinds=(None, "fp32"))
        for recipes, weight, accum in ((("1x128_128x128", "1x128_1x128"), "e4m3", "promoted"),
                                       (("row",), "e4m3", "promoted"), (("row",), "int8", "fast"))
        for act in ("bf16", "fp16")
        for tm in (128, 64)
        for tn, lo, hi in ((16, 1, 16), (32, 17, 32))
        if not (weight == "int8" and (tm, tn) == (64, 32))
    ),
    # Hopper, GEMMs emitting FP8 in 1x128 groups (op GEMM_FP8_OUT, kernels/sm90/epilogue_quant.py): twins of the
    # unswapped promoted e4m3 rows above whose tiles hold whole 128-column groups, their fields but the op.
    # scaled_mm_fp8_out runs the twin of scaled_mm's own pick (dispatch.select_fp8_out: same tile, clusters and K
    # splits, so the same bf16 values before quantization); where that pick has none (decode tiles, 192-wide tiles, a
    # bf16 bias) it runs scaled_mm and quantize_fp8.
    *(
        TileConfig(SM90, GEMM_FP8_OUT, "cooperative", recipes, tm, 128, cluster_m=cm, cluster_n=cn, accum="promoted",
                   split_tail=tail, ab_dtypes=(("e4m3", "e4m3"),), out_dtypes=("bf16",), bias_kinds=(None, "fp32"),
                   **{"m_min": COOPERATIVE_M_MIN, **m_range})
        for recipes, tm, cm, cn, tail, m_range in (
            (("1x128_128x128",), 128, 2, 1, False, {}), (("1x128_128x128",), 64, 1, 1, False, {"m_max": 1024}),
            (("1x128_128x128",), 128, 4, 1, False, {"m_min": 1025}), (("1x128_128x128",), 128, 2, 1, True, {}),
            (("tensor", "row"), 128, 2, 1, False, {}), (("tensor", "row"), 64, 1, 1, False, {"m_max": 1024}),
            (("tensor", "row"), 64, 1, 2, False, {"m_min": 1025}), (("tensor", "row"), 128, 4, 1, False, {}),
        )
    ),
    # Hopper, weight-only (op WEIGHT_ONLY): bf16 / fp16 activations x packed int4 / int8 weights, output in the
    # activations' dtype. Decode first: the M tokens on WGMMA's N side, as narrow as M allows; the 128-wide row serves
    # every larger M in 128-token tiles (each weight tile is then read once per token tile). bf16 WGMMAs accumulate
    # in fp32: "fast". dispatch.select_weight_only takes the first row whose M range holds M.
    *(
        TileConfig(SM90, WEIGHT_ONLY, "small_m", WEIGHT_ONLY_FORMATS[w], 128, tn, accum="fast", m_min=lo, m_max=hi,
                   swap_ab=True, ab_dtypes=((act, w),), out_dtypes=(act,), bias_kinds=(None,))
        for act in ("bf16", "fp16")
        for w in WEIGHT_ONLY_FORMATS
        for tn, lo, hi in ((16, 1, 16), (32, 17, 32), (64, 33, 64), (128, 65, 1 << 31))
    ),
    # Hopper, grouped FP8 GEMMs of mixture-of-experts layers (op GROUPED_GEMM, schedule: the grouped layout),
    # per-tensor, row-wise and DeepSeek-V3 block scales, promoted accumulation, bf16 / fp16 out. M ranges are rows
    # per group (families.sm90_grouped.GroupedProblem.rows_per_group): up to 64, 64-row tiles waste fewer rows of
    # each expert's last tile (1.2-1.3x at 2-32 rows per expert), from 128 rows per expert 128-row tiles read each
    # weight tile half as often (1.16-1.4x). The row-wise 64-row tiles load their scales as each unit starts
    # (docs/design.md: 1.01x geomean over 48 MoE GEMMs; no rule by K held across two runs). Per tensor and
    # row-wise, two tiles wider along N (docs/design.md 2.10): 64x256 first, taken only where
    # the 64x128 tiles of the groups expected to hold rows fill more than one wave (sm90_grouped.select; 1.05x
    # geomean over 48 decode GEMMs, 1.3x on Qwen3-30B's down projection), and 128x192 for groups of many rows
    # (contiguous: 1.03x geomean over 12 prefill GEMMs, up to 1.09x on the down projections; masked: 1.04x over
    # 12, up to 1.13x); both timed with the row-wise recipe, per tensor by the same rule (its epilogue scales by
    # two scalars instead of two vectors). Before 128x192, the same tile in 2x1 clusters (W multicast to pairs of
    # m tiles) for contiguous groups of 4096 rows and more, taken only at long K (sm90_grouped.clusters_pay:
    # 1.02-1.08x on Mixtral's down projection, K = 14336, at 4096 rows per expert, 0.97-1.03x at 2048; 0.76-0.99x
    # at K <= 7168 or 1024 rows per expert). The row-wise 128-row tiles stage each unit's scales in shared memory
    # (a producer warp loads them during the main loop: 1.01x geomean over 24 prefill GEMMs, 1.02-1.07x on
    # Qwen3-30B and Qwen3-235B, 1.025x in clusters); the 128x128 tile remains DeepSeek's.
    *(
        TileConfig(SM90, GROUPED_GEMM, layout, recipes, tm, tn, cluster_m=cm, accum="promoted", m_min=lo, m_max=hi,
                   early_row_scales=early, ab_dtypes=(("e4m3", "e4m3"),), out_dtypes=("bf16", "fp16"),
                   bias_kinds=(None,))
        for layout in ("contiguous", "masked")
        for recipes, tm, tn, cm, lo, hi, early in (
            (("row",), 64, 256, 1, 1, 64, True),
            (("tensor",), 64, 256, 1, 1, 64, False),
            (("row",), 64, 128, 1, 1, 64, True),
            (("tensor", "1x128_128x128"), 64, 128, 1, 1, 64, False),
            *(((("row",), 128, 192, 2, 4096, 1 << 31, True),
               (("tensor",), 128, 192, 2, 4096, 1 << 31, False)) if layout == "contiguous" else ()),
            (("row",), 128, 192, 1, 65, 1 << 31, True),
            (("tensor",), 128, 192, 1, 65, 1 << 31, False),
            (("1x128_128x128",), 128, 128, 1, 65, 1 << 31, False),
        )
    ),
    # Blackwell (sm_100a): the tcgen05 GEMM (kernels/sm100), compiled once per out dtype, bias and CTA mode; the
    # operand formats are run-time values, so one kernel serves every f8f6f4 pair (operand class F8F6F4), per
    # tensor ("tensor") or MX-scaled ("mx"). The MXFP4 / NVFP4 kinds keep e2m1 packed in shared memory: a 128-byte
    # row is a 256-element K tile. 1-CTA tiles to M = 128; above, one 256-row MMA over a 2x1 cluster.
    *(
        TileConfig(SM100, "gemm", schedule, recipes, 128, 128, cluster_m=cm, accum="fast", m_min=lo, m_max=hi,
                   tile_k=tile_k, ab_dtypes=((ab, ab),), bias_kinds=(None, "fp32"))
        for recipes, ab, tile_k in ((("tensor", "mx"), F8F6F4, 128), (("mx", "nvfp4"), "e2m1", 256))
        for schedule, cm, lo, hi in (("1sm", 1, 1, 128), ("2sm", 2, 129, 1 << 31))
    ),
)


class InstanceTableError(ValueError):
    pass


def validate(inst: KernelInstance) -> None:
    """Raise InstanceTableError with the reason if an instance cannot be built.

    The rules live with the kernel classes (they own their shared-memory plans) and the instance's kernel family
    (``families/registry.py``) applies them; this only looks the family up.
    """
    from cutedsl_gemm.families.registry import family

    try:
        family(inst).check(inst)
    except (ValueError, TypeError) as e:
        raise InstanceTableError(f"{inst.name}: {e}") from None


def expand(table: Iterable[TileConfig] = TABLE) -> Tuple[KernelInstance, ...]:
    """The rows crossed with their type axes: one instance each (unchecked: ``validate``)."""
    out = []
    for row in table:
        shared = _shared_fields(row, KernelInstance)
        for recipe, (a, b), o, bias in itertools.product(row.recipes, row.ab_dtypes, row.out_dtypes, row.bias_kinds):
            out.append(KernelInstance(**shared, recipe=recipe, a_dtype=a, b_dtype=b, out_dtype=o,
                                      bias_dtype=o if bias == "out" else bias))
    return tuple(out)


@functools.cache
def table() -> Tuple[KernelInstance, ...]:
    """Every instance of ``TABLE``, expanded on first use."""
    return expand()


def validate_table(instances=None) -> int:
    """``validate`` every instance (default: the whole table); the count checked. Loads the kernel modules."""
    rows = table() if instances is None else tuple(instances)
    for inst in rows:
        validate(inst)
    return len(rows)


def __getattr__(name):
    # ``INSTANCES``: the table, expanded when first read (``from ... import INSTANCES`` reads it).
    if name == "INSTANCES":
        return table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def select(instances=None, **want) -> Tuple[KernelInstance, ...]:
    """Instances whose fields equal every keyword given (e.g. ``select(arch="sm_90a", recipe="row")``)."""
    rows = table() if instances is None else instances
    return tuple(i for i in rows if all(getattr(i, k) == v for k, v in want.items()))

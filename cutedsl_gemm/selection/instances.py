"""The kernel instance manifest: every kernel configuration this library builds, declared once.

Runtime dispatch (``cutedsl_gemm.selection.dispatch``), the precompiler, the AOT exporter and the catalog all read
``INSTANCES``; there is no other list of configurations. A row is a *tile configuration* crossed with the
type axes it supports; ``expand()`` turns the table into concrete, hashable instances.

Validity rules (shared-memory budget, TMA alignment, MMA shape limits) are checked by ``validate`` and run
on every row at import time, so a bad edit to the table fails loudly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Tuple



@dataclass(frozen=True)
class KernelInstance:
    """One compiled kernel: everything that changes generated code, nothing that doesn't (M, N, K)."""

    arch: str  # "sm_90a" | "sm_100a"
    op: str  # "gemm" | "quantize"
    schedule: str  # "cooperative" | "pingpong" | "small_m"
    recipe: str  # formats.RECIPES key
    a_dtype: str
    b_dtype: str
    out_dtype: str
    bias_dtype: Optional[str]
    tile_m: int
    tile_n: int
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 0  # 0 = as many as shared memory allows
    accum: str = "promoted"  # "promoted" | "fast" (torch's use_fast_accum)
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

    @property
    def name(self) -> str:
        bias = f"_bias{self.bias_dtype}" if self.bias_dtype else ""
        extra = ("_swapab" if self.swap_ab else "") + (f"_k{self.tile_k}" if self.tile_k != 128 else "")
        extra += f"_{self.ctas_per_sm}persm" if self.ctas_per_sm != 1 else ""
        extra += f"_epi{self.epi_stages}" if self.epi_stages else ""
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
        return self.arch == "sm_90a" and self.op == "gemm" and self.tile_n <= 192

    def sm90_config(self):
        """The kernel-class configuration this instance compiles to."""
        from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmConfig

        return Sm90GemmConfig(
            a_dtype=self.a_dtype,
            b_dtype=self.b_dtype,
            out_dtype=self.out_dtype,
            recipe=self.recipe,
            bias_dtype=self.bias_dtype,
            tile_m=self.tile_m,
            tile_n=self.tile_n,
            cluster_m=self.cluster_m,
            cluster_n=self.cluster_n,
            stages=self.stages,
            accum=self.accum,
            split_k=self.can_split_k,
            swap_ab=self.swap_ab,
            tile_k=self.tile_k,
            split_tail=self.split_tail,
            ctas_per_sm=self.ctas_per_sm,
            epi_stages=self.epi_stages,
            # Decode GEMMs run back to back (layer after layer) and are short: let each one's launch and
            # set-up overlap the previous kernel's tail (programmatic dependent launch).
            pdl=self.swap_ab,
        )


@dataclass(frozen=True)
class TileConfig:
    """A row of the table: a tile/cluster/schedule and the type axes it is built for."""

    arch: str
    op: str
    schedule: str
    recipes: Tuple[str, ...]
    tile_m: int
    tile_n: int
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 0
    accum: str = "promoted"
    m_min: int = 1
    m_max: int = 1 << 31
    swap_ab: bool = False
    tile_k: int = 128
    split_tail: bool = False
    ctas_per_sm: int = 1
    ab_dtypes: Tuple[Tuple[str, str], ...] = (("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2"))
    out_dtypes: Tuple[str, ...] = ("bf16", "fp16", "fp32")
    # None = no bias; "out" = same dtype as the output; "fp32".
    bias_kinds: Tuple[Optional[str], ...] = (None, "out", "fp32")


# ------------------------------------------------------------------------------------------------
# THE TABLE
# ------------------------------------------------------------------------------------------------
TABLE: Tuple[TileConfig, ...] = (
    # Hopper, small M (decode, M <= 128): the GEMM streams W once and is memory-bound. The kernels run
    # swapped (D^T = W @ A^T): 128 (or 64) W rows per tile on WGMMA's M side, the M activation rows on its N side,
    # as narrow as M allows. K is split only when there are far fewer tiles than SMs
    # (dispatch.choose_splits). From benchmarks/tune_tiles (BENCHMARKS.md, decode): 128x16 is best to M=16,
    # 128x32 to M=32, 128x64 above (with 256-deep stages where the accumulation is not promoted per 128);
    # at M=64 128x32 tiles are as fast at N=8192 but make two waves of tiles at N=10240.
    # Rows are tried in order, so these come before the general ones.
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
    # 64-row tiles (one consumer warp group): twice the tiles, so where the 128-row ones fill under a wave
    # of SMs, dispatch.wave_cost picks these (ties go to the 128-row rows above, e.g. N=10240: 80 tiles in
    # one wave beat 160 in two, 35.6 vs 43.3 us). N=K=8192 (benchmarks/tune_tiles, BENCHMARKS.md decode):
    # DeepSeek recipe M=64 29.3 vs 32.8 us, M=16 28.9 vs 29.8; per-tensor M=16 29.1 vs 29.9; fast
    # accumulation M=64 28.2 vs 29.5; N=57344, M=64 175 vs 180. At M=1 row-wise they tie (~30 us).
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("tensor", "row"), 64, tn, accum=acc, m_min=lo, m_max=hi,
                   swap_ab=True, tile_k=256 if acc == "fast" and tn == 64 else 128)
        for acc in ("promoted", "fast")
        for tn, lo, hi in ((16, 1, 16), (64, 33, 128))
    ),
    *(
        TileConfig("sm_90a", "gemm", "small_m", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 64, tn,
                   accum="promoted", m_min=lo, m_max=hi, swap_ab=True)
        for tn, lo, hi in ((16, 1, 16), (64, 33, 128))
    ),
    # Hopper, epilogue-scaled FP8. Promoted accumulation (the default, as torch's use_fast_accum=False) keeps
    # K-tile fragments next to the accumulator, so its tiles are at most 192 wide; fast accumulation affords
    # 128x256 tiles. The promoted rows compete by dispatch.wave_cost (waves x area / measured tile rate):
    # 128x192 for large outputs, 128x128 / 128x96 where they make fewer or fuller waves (M=6144, N=512: 48.5
    # vs 62.0 us; M=1024, N=1536: 24.1 vs 33.2 unsplit), and 64-row tiles (one consumer warp group) where an
    # output fills under a wave of SMs (M=1024, N=512: 15.5 us against 22.0 for 128x192 split 5 ways). Tiles
    # whose width divides narrow outputs evenly: 128x144 (M=1024, N=4608: 256 tiles in two waves, 56.0 vs 63.0
    # us for 128x192) and 64x96 (M=1024, N=576: 96 tiles, 15.7 us against 21.9 for 64x128 and 25.8 for 64x64
    # in two waves). BENCHMARKS.md "Tile rates".
    # Fast accumulation gets the same tiles (and 128x256, below): with 128x256 alone it ran 1.7-2.9x slower
    # than cuBLAS at M=1024, N=576 / 1536 / 4608 (dsv3 geomean 0.77x; BENCHMARKS.md, session 7).
    # 128x96, 64x128 (up to M=1024) and 64x64 run without clusters: they serve outputs of about a wave, where
    # multicast saves little L2 traffic (and, presumably, a cluster's CTAs wait for each other's stages; not
    # measured). Since 1x1 kernels launch as a plain grid (session 27), 1x1 beats the 1x2 / 2x1 clusters these rows had
    # (tune_tiles, row-wise, medians of 3 interleaved rounds, promoted / fast, us, session 28): 64x128 M=256
    # N=4096 K=7168 26.3 / 26.8 -> 19.6 / 19.2, M=512 N=1536 K=2048 11.7 / 11.0 -> 10.4 / 9.3, M=768 N=1024
    # K=7168 fast 19.8 -> 15.3; 64x64 M=256 N=576 K=7168 12.7 / 12.6 -> 11.6 / 12.3, M=1024 N=512 15.6 / 15.4
    # -> 15.0 / 14.0; 128x96 M=1536 N=576 K=7168 21.5 / 22.1 -> 20.4 / 19.3, even at M=256 N=4608 and M=512
    # N=3072. The 128x112 row in 2x2 clusters for M 897-1024 (session 16) is gone: 128x96 without a cluster
    # beats it where it served (M=1000 / 1024, N=1536, K=2048 / 7168: 11.7 / 11.2 / 21.7 / 22.2 against 12.0 /
    # 12.0 / 23.6 / 23.2 row-wise, 11.1 / 10.5 / 21.6 / 21.2 against 11.4 / 11.6 / 23.2 / 22.8 per-tensor).
    # Kept: 64x96's clusters (per-tensor M=1024 N=576 K=7168 15.2 us in 2x2, 16.4 in 1x1; N=512 16.2 vs 20.3),
    # the large tiles' 2x1 (many waves: L2 bytes per MMA count) and 64x128's 1x2 above M=1024: a 64x128
    # output tile there with no cluster to pad its wave out-bids 128x96 in wave_cost where it is slower (M=1536
    # N=576 K=7168 24.1 us against 20.4).
    *(
        TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), tm, tn, cluster_m=cm, cluster_n=cn, accum=acc,
                   **m_range)
        for acc in ("promoted", "fast")
        for tm, tn, cm, cn, m_range in ((128, 192, 2, 1, {}), (128, 128, 2, 1, {}), (128, 96, 1, 1, {}),
                                        (64, 128, 1, 1, {"m_max": 1024}), (64, 128, 1, 2, {"m_min": 1025}),
                                        (64, 64, 1, 1, {}), (128, 144, 2, 1, {}),
                                        (64, 96, 2, 2, {}) if acc == "promoted" else (64, 96, 1, 2, {}))
    ),
    # Two CTAs per SM (64-row tiles, half an SM each): a CTA's epilogue runs while the other CTA on its SM
    # keeps the tensor cores busy, which short-K outputs need (dispatch.wave_cost's epilogue term): M=6144,
    # N=7168, K=256 38.4 us against 44.0 for 128x192 (cuBLAS 42.9); N=4096, K=512 33.6 vs 35.9 (cuBLAS
    # 35.5); M=1024, N=7168, K=256 12.8 vs 13.6 (14.3). From K=1536 the 128-row tiles' fewer bytes per MMA
    # win again.
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 64, 192, cluster_m=2, cluster_n=1,
               accum="promoted", ctas_per_sm=2),
    # The same pair swapped (W rows on WGMMA's M side, 192 activation rows on its N side), as cuBLAS runs
    # M=6144, N=512: 256 tiles fill one wave of 264 CTA slots (43.6 us against 48.0 for 128x128 tiles,
    # cuBLAS 41.9). Its low rate (dispatch.PAIRED_TILE_RATES) keeps it to such shapes.
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 64, 192, cluster_m=2, cluster_n=1,
               accum="promoted", swap_ab=True, ctas_per_sm=2),
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 128, 256, cluster_m=2, cluster_n=1, accum="fast"),
    # 128x128 in 4x1 clusters: each W tile multicast to four CTAs. Narrow outputs with many rows are bound
    # by L2 bytes per MMA: M=6144, N=576, K=7168 48.8 us against 54.5 for 2x1 (cuBLAS 44.2, itself 128x128
    # in 4-CTA clusters); elsewhere the 4-CTA clusters' fewer slots (30 on the H100) usually cost a wave
    # (dispatch.cluster_slots, CLUSTER_4X1_RATE_GAIN).
    *(
        TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 128, 128, cluster_m=4, cluster_n=1,
                   accum=acc)
        for acc in ("promoted", "fast")
    ),
    # Hopper, block-scaled FP8: each 128-deep K block is scaled while it is promoted, so these are
    # promoted-accumulation kernels. Two rows hold every M and compete by dispatch.wave_cost (N-aware):
    # 128x192 wins on large outputs and loses where it would leave a wave nearly empty or SMs idle
    # (M=1024, N=1536). Against 128x128 everywhere: DeepSeek 8192^3 1098 -> 1075 us, M=6144 N=1536
    # 139 -> 128 us, N=4608 433 -> 407 us, M=1024 N=3072 18.2 -> 15.4 us; 1x128 x 1x128 8192^3 1410 -> 1234.
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, 128,
        cluster_m=2, cluster_n=1, accum="promoted",
    ),
    # The DeepSeek recipe's 128x192 tile (its split-N loop) in 4 A/W stages: the 5 that fit beside its scale
    # slots leave room for only 2 output slices, the 4 for the whole tile's 6, so a tile's stores drain while
    # the next tile runs. Against 5 stages, same call (tune_tiles, session 22): 1-3% faster at K >= 2048
    # (M=6144 N=7168 K=2048 158.0 / 160.2 -> 155.2 us, N=4608 K=7168 337.1 / 349.4 -> 330.9), 4-10% at short
    # K (M=6144 N=7168 K=256 46.6 / 46.8 -> 41.9, N=4096 K=512 37.4 / 38.0 -> 35.1). The 2D recipe's 192-wide
    # loop (read-ahead) lost 1-4% at long K with 4 stages, so it and 1x128 x 1x128 keep 5.
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128",), 128, 192, cluster_m=2, cluster_n=1, stages=4,
        accum="promoted",
    ),
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("128x128_128x128", "1x128_1x128"), 128, 192,
        cluster_m=2, cluster_n=1, accum="promoted",
    ),
    # Two CTAs per SM for short K, as for the epilogue-scaled recipes (dispatch.wave_cost's epilogue term).
    # DeepSeek recipe, M=6144: N=7168, K=256 41.2 us against 46.8 for 128x128 and 49.5 for 128x192 (cuBLAS
    # 45.1); N=4096, K=512 38.2 vs 38.6 (38.5); M=1024, N=7168, K=256 13.0 vs 13.6 (14.5) (session 9).
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 64, 192,
        cluster_m=2, cluster_n=1, accum="promoted", ctas_per_sm=2,
    ),
    # 64-row tiles (one consumer warp group) where a block-scaled output fills under a wave of 128-row tiles:
    # DeepSeek recipe M=1024 N=512 K=7168 16.8-17.3 us (2 K splits) against 18.9-19.5 for 128x128 (4 splits),
    # cuBLAS 25.2 (session 11; dispatch.BLOCK_TILE_RATES). Up to M=1024 only: above, the 128-row tiles'
    # last-wave splits, which wave_cost does not see, make up their waves (M=6144 N=512: 128x128 with a split
    # last wave 49.7 us, 64x128 50.3). Without a cluster since session 28 (1x2 before: A multicast), as the
    # epilogue-scaled small tiles (tune_tiles, DeepSeek recipe, medians of 3 rounds, us, 1x2 -> 1x1): M=1024
    # N=576 K=7168 21.1 -> 19.3, N=512 17.1 -> 16.2, N=1024 K=4096 15.8 -> 13.4; M=256 N=4096 K=7168 25.1 ->
    # 20.4, N=576 K=1536 17.0 -> 11.5; M=768 N=1024 K=7168 20.1 -> 19.3. 2D recipe M=1024 N=576 / 512 21.5 /
    # 16.7 -> 18.8 / 16.2; 1x128 x 1x128 24.2 / 19.5 -> 25.7 / 18.4 (its one loss measured).
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 64, 128,
        cluster_m=1, cluster_n=1, accum="promoted", m_max=1024,
    ),
    # 128x128 in 4x1 clusters, as for the epilogue-scaled recipes (W tiles multicast to four CTAs). Once the
    # block-scaled main loop no longer saturated its warps' instruction issue (session 12), the L2 bytes
    # saved pay here too: DeepSeek recipe M=6144 N=576 K=7168 50.0-50.8 us against 55.0-56.1 in 2x1
    # clusters (cuBLAS 47.6), M=3072 N=576 27.1 vs 31.7 (27.4), M=1408 N=5120 K=4096 55.4 vs 70.3 (56.7),
    # M=1408 N=7168 K=4096 80.7 vs 106.7 (70.2); session 10, with the older loop, measured no gain. From
    # M=1025: at M=1024 N=4608 K=7168 the 2x1 tile's last-wave split (62.4 us), which wave_cost does not
    # model, beats 4x1 (67.9), and the other M=1024 shapes gain only 1-5%.
    TileConfig(
        "sm_90a", "gemm", "cooperative", ("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, 128,
        cluster_m=4, cluster_n=1, accum="promoted", m_min=1025,
    ),
    # Last-wave split variants of the promoted cooperative rows above (kernels/common/last_wave_split.py):
    # chosen per call, in place of their sibling, when a little more than a whole number of waves would
    # leave the last one nearly empty and K is long (dispatch.last_wave_splits). M=6144, N=512, K=7168:
    # 63.2 -> 54.4 us row-wise; M=1024, N=4608, K=7168: 65.4 -> 58.8 us (BENCHMARKS.md).
    TileConfig("sm_90a", "gemm", "cooperative", ("tensor", "row"), 128, 192, cluster_m=2, cluster_n=1,
               accum="promoted", split_tail=True),
    *(
        TileConfig("sm_90a", "gemm", "cooperative", recipes, 128, tn, cluster_m=2, cluster_n=1, stages=stages,
                   accum="promoted", split_tail=True)
        for recipes, tn, stages in (
            (("1x128_128x128", "128x128_128x128", "1x128_1x128"), 128, 0),
            (("1x128_128x128",), 192, 4),
            (("128x128_128x128", "1x128_1x128"), 192, 0),
        )
    ),
)


class ManifestError(ValueError):
    pass


def validate(inst: KernelInstance) -> None:
    """Raise ManifestError with the reason if an instance cannot be built.

    The rules live with the kernel classes (they own their shared-memory plans); this only routes.
    """
    if inst.arch == "sm_90a" and inst.op == "gemm":
        from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmPlan

        try:
            Sm90GemmPlan.check_config(inst.sm90_config())
        except ValueError as e:
            raise ManifestError(f"{inst.name}: {e}") from None
    else:
        raise ManifestError(f"{inst.name}: no kernel family for arch={inst.arch} op={inst.op}")


def expand(table: Iterable[TileConfig] = TABLE) -> Tuple[KernelInstance, ...]:
    out = []
    for row in table:
        for recipe, (a, b), o, bias in itertools.product(row.recipes, row.ab_dtypes, row.out_dtypes, row.bias_kinds):
            out.append(
                KernelInstance(
                    arch=row.arch,
                    op=row.op,
                    schedule=row.schedule,
                    recipe=recipe,
                    a_dtype=a,
                    b_dtype=b,
                    out_dtype=o,
                    bias_dtype=o if bias == "out" else bias,
                    tile_m=row.tile_m,
                    tile_n=row.tile_n,
                    cluster_m=row.cluster_m,
                    cluster_n=row.cluster_n,
                    stages=row.stages,
                    accum=row.accum,
                    m_min=row.m_min,
                    m_max=row.m_max,
                    swap_ab=row.swap_ab,
                    tile_k=row.tile_k,
                    split_tail=row.split_tail,
                    ctas_per_sm=row.ctas_per_sm,
                )
            )
    for inst in out:
        validate(inst)
    return tuple(out)


INSTANCES: Tuple[KernelInstance, ...] = expand()


def select(instances=None, **want) -> Tuple[KernelInstance, ...]:
    """Instances whose fields equal every keyword given (e.g. ``select(arch="sm_90a", recipe="row")``)."""
    rows = INSTANCES if instances is None else instances
    return tuple(i for i in rows if all(getattr(i, k) == v for k, v in want.items()))

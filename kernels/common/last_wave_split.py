"""Persistent schedule that splits only the last, partial wave of tiles in K.

When an output has a little more than a whole number of waves of cluster tiles (M=6144, N=512 at 128x192
tiles in 2x1 clusters: 72 cluster tiles on 66 cluster slots), the last wave leaves most of the GPU idle
for a whole tile's time. This schedule runs the full waves' cluster tiles whole and splits each of the
remaining ones (fewer than the grid's clusters) into ``splits`` K ranges, so the last wave is spread over
the grid; the split tiles are reduced by the kernel's split-K reduction (kernels/sm90/split_k.py).

It is a separate class (and a separate compile-time kernel variant, ``split_tail``) because its extra
per-unit state slows the shapes it does not split when built into every kernel.
``unsplit_cluster_tiles`` is the rule the host sizes the workspace with (``runtime.launch.split_tiles``).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values

from .tile_scheduler import PersistentTileScheduler
from .waves import unsplit_cluster_tiles


class LastWaveSplitScheduler(PersistentTileScheduler):
    """Work units: the whole cluster tiles first (in the base scheduler's rasterised order), then
    ``splits`` adjacent units per remaining cluster tile, one per K range."""

    def __init__(self, tiles_m: Int32, tiles_n: Int32, cluster_shape_mn: tuple, group_m: int, splits: Int32,
                 num_clusters: Int32):
        super().__init__(tiles_m, tiles_n, cluster_shape_mn, group_m)  # its own walk is unsplit
        self.splits = splits
        self.whole = unsplit_cluster_tiles(self.ctiles_m * self.ctiles_n, num_clusters)

    @property
    def num_units(self):
        return self.whole + (self.ctiles_m * self.ctiles_n - self.whole) * self.splits

    def __extract_mlir_values__(self):
        fields = (self.ctiles_m, self.ctiles_n, self.split_k, self.splits, self.whole)
        return [v for x in fields for v in extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values):
        new = object.__new__(LastWaveSplitScheduler)
        new.cluster_m, new.cluster_n, new.group_m = self.cluster_m, self.cluster_n, self.group_m
        new.ctiles_m, new.ctiles_n, new.split_k, new.splits, new.whole = (Int32(v) for v in values)
        return new

    def coords(self, unit: Int32, cta_m_in_cluster: Int32, cta_n_in_cluster: Int32):
        """(tile_m, tile_n, k_split, k_splits) of work unit ``unit``; ``k_splits`` is 1 for a whole tile."""
        in_tail = unit >= self.whole
        v = cutlass.max(unit - self.whole, Int32(0))
        k_splits = cutlass.select_(in_tail, self.splits, Int32(1))
        t = cutlass.select_(in_tail, self.whole + v // self.splits, unit)
        tm, tn, _ = super().coords(t, cta_m_in_cluster, cta_n_in_cluster)
        return tm, tn, v % self.splits, k_splits

    def is_split(self, unit: Int32):
        """Whether ``unit`` is one of several K ranges of its tile (recomputed after the main loop, so
        nothing extra stays live through it)."""
        return (unit >= self.whole) & (self.splits > 1)

    def split_slot(self, unit: Int32, cta_m_in_cluster: Int32, cta_n_in_cluster: Int32):
        """The split CTA tile's number among all split ones: its partial sums' place in the split-K
        workspace and its counter's."""
        t = (unit - self.whole) // self.splits
        return t * (self.cluster_m * self.cluster_n) + cta_m_in_cluster + cta_n_in_cluster * self.cluster_m

"""Persistent schedule that balances the last waves of tiles over the grid by splitting their K (stream-K).

When an output has a little more than a whole number of waves of cluster tiles (M=6144, N=576 at 128x192
tiles in 2x1 clusters: 72 cluster tiles on 66 cluster slots), the last wave leaves most of the GPU idle
for a whole tile's time. This schedule runs all but the last two waves' worth of cluster tiles whole (the
data-parallel part), then hands each cluster an equal, contiguous share of the remaining tiles' K tiles
(K tiles of tile t numbered t * k_tiles ...), so every cluster finishes at about the same time:
72 x 56 K tiles over 66 clusters is 61.1 each, against two whole tiles (112) for the busiest cluster.

A cluster's share is a run of *segments*, one per tile it touches: it starts in the middle of one tile
(the tile's K tail) and ends in the middle of a later one (that tile's K head). A tile cut into pieces is
finished by the cluster that holds its head (piece 0, the last segment of that cluster's share): the
clusters holding the other pieces handle them as their *first* segment, publish their partial sums at the
slot of their own cluster and count in at the tile's counter; the head's cluster waits for that count,
adds the pieces in piece order (deterministic) and runs the epilogue (kernels/sm90/split_k.py). Waits only
point at first segments of later clusters, which never wait before publishing, and the persistent grid
is resident at once, so the schedule cannot deadlock.

It is a separate class (and a separate compile-time kernel variant, ``split_tail``) because per-unit state
like this measured 6-15% slower on the shapes it does not split when built into every kernel.
``unsplit_cluster_tiles`` and ``stream_k_pieces`` are the rules the host sizes the workspace with
(``dispatch.split_workspace``).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values

from .tile_scheduler import PersistentTileScheduler


def unsplit_cluster_tiles(cluster_tiles, num_clusters):
    """Cluster tiles run whole before the balanced part: all but the last two waves (at least one full
    wave and the partial one are balanced, so no tile is cut into more than a few pieces). Plain ints on
    the host, Int32 in the kernel."""
    full = cluster_tiles // num_clusters
    waves = full - 1
    if isinstance(waves, int):
        waves = max(waves, 0)
    else:
        waves = cutlass.max(waves, Int32(0))
    return waves * num_clusters


class LastWaveSplitScheduler(PersistentTileScheduler):
    """Work units: the whole cluster tiles first (in the base scheduler's rasterised order), then one unit
    per segment of each cluster's share (unit = whole + segment * num_clusters + cluster, so the persistent
    walk visits a cluster's own segments in order and ends at ``units_for(cluster)``). With ``splits`` <= 1
    every tile is whole."""

    def __init__(self, tiles_m: Int32, tiles_n: Int32, cluster_shape_mn: tuple, group_m: int, splits: Int32,
                 num_clusters: Int32, k_tiles: Int32):
        super().__init__(tiles_m, tiles_n, cluster_shape_mn, group_m)  # its own walk is unsplit
        ctiles = self.ctiles_m * self.ctiles_n
        self.whole = cutlass.select_(splits > 1, unsplit_cluster_tiles(ctiles, num_clusters), ctiles)
        self.clusters = num_clusters
        self.k_tiles = k_tiles
        self.shared = (ctiles - self.whole) * k_tiles  # K tiles balanced over the clusters

    def units_for(self, cluster: Int32):
        """End (exclusive) of ``cluster``'s walk: its whole tiles, then one unit per tile its share touches."""
        start, end = self._share(cluster)
        segments = cutlass.select_(end > start, (end - 1) // self.k_tiles - start // self.k_tiles + 1, Int32(0))
        return self.whole + segments * self.clusters

    def __extract_mlir_values__(self):
        fields = (self.ctiles_m, self.ctiles_n, self.split_k, self.whole, self.clusters, self.k_tiles, self.shared)
        return [v for x in fields for v in extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values):
        new = object.__new__(LastWaveSplitScheduler)
        new.cluster_m, new.cluster_n, new.group_m = self.cluster_m, self.cluster_n, self.group_m
        (new.ctiles_m, new.ctiles_n, new.split_k, new.whole, new.clusters, new.k_tiles,
         new.shared) = (Int32(v) for v in values)
        return new

    def _share(self, cluster: Int32):
        """[start, end) of ``cluster``'s balanced K tiles."""
        return cluster * self.shared // self.clusters, (cluster + 1) * self.shared // self.clusters

    def _owner(self, k_unit: Int32):
        """The cluster whose share holds balanced K tile ``k_unit``: the largest c with c * shared //
        clusters <= k_unit."""
        return ((k_unit + 1) * self.clusters - 1) // cutlass.max(self.shared, Int32(1))

    def segment(self, unit: Int32):
        """(balanced tile, first K tile, K tiles, piece, pieces, cluster) of a balanced-part unit."""
        j = unit - self.whole
        c = j % self.clusters
        s = j // self.clusters
        start, end = self._share(c)
        first_tile = start // self.k_tiles
        seg_start = cutlass.select_(s == 0, start, (first_tile + s) * self.k_tiles)
        seg_end = cutlass.min(end, (first_tile + s + 1) * self.k_tiles)
        t = first_tile + s
        k_count = cutlass.max(seg_end - seg_start, Int32(0))
        head = self._owner(t * self.k_tiles)
        pieces = self._owner((t + 1) * self.k_tiles - 1) - head + 1
        return t, seg_start - t * self.k_tiles, k_count, c - head, pieces, c

    def coords(self, unit: Int32, cta_m_in_cluster: Int32, cta_n_in_cluster: Int32):
        """(tile_m, tile_n, first K tile, K tiles) of work unit ``unit``; K tiles is 0 for an empty unit."""
        balanced = unit >= self.whole
        t, k_begin, k_count, _, _, _ = self.segment(cutlass.max(unit, self.whole))
        tile = cutlass.select_(balanced, self.whole + t, unit)
        tm, tn, _ = super().coords(cutlass.min(tile, self.ctiles_m * self.ctiles_n - 1), cta_m_in_cluster,
                                   cta_n_in_cluster)
        return (tm, tn, cutlass.select_(balanced, k_begin, Int32(0)),
                cutlass.select_(balanced, k_count, self.k_tiles))

    def piece(self, unit: Int32, cta_m_in_cluster: Int32, cta_n_in_cluster: Int32):
        """For a unit of the balanced part: (piece, pieces, counter slot, the first later cluster's partial
        slot). Piece 0 is the tile's K head, which finishes the tile; piece p > 0 belongs to cluster
        head + p. Recomputed after the main loop, so nothing extra stays live through it."""
        t, _, _, p, pieces, c = self.segment(unit)
        cta = cta_m_in_cluster + cta_n_in_cluster * self.cluster_m
        per_cluster = self.cluster_m * self.cluster_n
        return p, pieces, t * per_cluster + cta, c * per_cluster + cta

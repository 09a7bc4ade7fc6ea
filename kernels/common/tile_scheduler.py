"""Persistent tile scheduler shared by the GEMM kernels.

The grid is (cluster_m, cluster_n, num_persistent_clusters): every cluster walks the output's *cluster
tiles* (a cluster_m x cluster_n block of CTA tiles) with a stride of the number of launched clusters.
Cluster tiles are rasterised in groups of ``group_m`` cluster-rows (the usual "grouped" order): walking
down a narrow band of M before moving along N keeps the band's A rows and a few B columns in L2.

Everything is plain Int32 arithmetic on values the host passes at run time, so one compiled kernel serves
every problem shape; the only compile-time knobs are the cluster shape and ``group_m``.

Split-K schedules extend the same walk with a K-split index (see ``split_k`` below): a work unit is then
(cluster tile, k split) and the walk stays deterministic (each unit is owned by exactly one cluster).
"""

from __future__ import annotations

import cutlass
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values


def ceil_div(a, b):
    return (a + b - 1) // b


def banded_coords(t, tiles_m, tiles_n, group_m):
    """(m, n) of tile ``t`` of a tiles_m x tiles_n grid in the grouped order: bands of ``group_m`` rows (a Python
    int or a run-time Int32; the last band what is left), each walked M fastest, then along N."""
    span = tiles_n * group_m
    band = t // span
    first_m = band * group_m
    rows = cutlass.min(tiles_m - first_m, Int32(group_m))
    r = t - band * span
    return first_m + r % rows, r // rows


class PersistentTileScheduler:
    """Maps a linear work index to (tile_m, tile_n, k_split) coordinates for one CTA.

    Built inside a kernel from run-time problem sizes (in tiles) and the CTA's position in its cluster.
    Create it inside the warp-role branch that uses it: the DSL cannot carry a plain Python object
    through a run-time ``if``.
    """

    def __init__(
        self,
        tiles_m: Int32,
        tiles_n: Int32,
        cluster_shape_mn: tuple,
        group_m: int,
        split_k: Int32 = None,
    ):
        self.cluster_m, self.cluster_n = cluster_shape_mn
        self.group_m = group_m
        self.ctiles_m = ceil_div(tiles_m, self.cluster_m)
        self.ctiles_n = ceil_div(tiles_n, self.cluster_n)
        self.split_k = Int32(1) if split_k is None else split_k

    @property
    def num_units(self):
        return self.ctiles_m * self.ctiles_n * self.split_k

    # The DSL carries objects used inside run-time loops as lists of IR values.
    def __extract_mlir_values__(self):
        return [v for x in (self.ctiles_m, self.ctiles_n, self.split_k) for v in extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values):
        new = object.__new__(PersistentTileScheduler)
        new.cluster_m, new.cluster_n, new.group_m = self.cluster_m, self.cluster_n, self.group_m
        new.ctiles_m, new.ctiles_n, new.split_k = (Int32(v) for v in values)
        return new

    def coords(self, unit: Int32, cta_m_in_cluster: Int32, cta_n_in_cluster: Int32):
        """(tile_m, tile_n, k_split) of work unit ``unit`` for the CTA at the given cluster position.

        K splits of one output tile are adjacent units so that the CTAs reducing into the same tile run
        close in time.
        """
        k_split = unit % self.split_k
        cm, cn = banded_coords(unit // self.split_k, self.ctiles_m, self.ctiles_n, self.group_m)
        return (
            cm * self.cluster_m + cta_m_in_cluster,
            cn * self.cluster_n + cta_n_in_cluster,
            k_split,
        )

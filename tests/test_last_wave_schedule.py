"""The balanced last-wave (stream-K) schedule of kernels/common/last_wave_split.py, walked on the host with
plain integers: every K tile of every output tile is computed exactly once, each cut tile is finished by
its K head after its other pieces, and the slots stay inside the workspace dispatch sizes."""

import itertools

import cutlass
import pytest
from cutlass import Int32

from cutedsl_gemm import dispatch
from cutedsl_gemm.kernels.common.last_wave_split import LastWaveSplitScheduler


@pytest.fixture
def host_select(monkeypatch):
    # The scheduler's run-time selects, evaluated on host integers.
    monkeypatch.setattr(cutlass, "select_", lambda c, a, b: a if c else b)


def walk(tiles_m, tiles_n, cluster, clusters, k_tiles, splits):
    """Every cluster's units in walk order: (cluster, unit, tile_m, tile_n, k_begin, k_count, piece info)."""
    sched = LastWaveSplitScheduler(Int32(tiles_m), Int32(tiles_n), cluster, 8, Int32(splits), Int32(clusters),
                                   Int32(k_tiles))
    out = []
    for c in range(clusters):
        unit, end = c, int(sched.units_for(Int32(c)))
        while unit < end:
            tm, tn, k0, kn = (int(v) for v in sched.coords(Int32(unit), Int32(0), Int32(0)))
            piece = None
            if unit >= int(sched.whole):
                piece = tuple(int(v) for v in sched.piece(Int32(unit), Int32(0), Int32(0)))
            out.append((c, unit, tm, tn, k0, kn, piece))
            unit += clusters
    return sched, out


CASES = [
    # (tiles_m, tiles_n, k_tiles, clusters): M=6144 N=576 at 128x192 c2x1 (72 cluster tiles on 66), M=1024
    # N=4608, a shape with several whole waves first, fewer tiles than clusters, and K shorter than a share.
    (48, 3, 56, 66), (8, 24, 56, 66), (64, 43, 64, 66), (8, 8, 56, 66), (48, 5, 3, 66), (3, 7, 200, 5),
]


@pytest.mark.parametrize("tiles_m,tiles_n,k_tiles,clusters", CASES)
def test_balanced_schedule_covers_every_k_tile_once(host_select, tiles_m, tiles_n, k_tiles, clusters):
    sched, units = walk(tiles_m, tiles_n, (2, 1), clusters, k_tiles, dispatch.BALANCED_TAIL)
    ctiles = (tiles_m // 2 + tiles_m % 2) * tiles_n
    seen = {}
    for c, unit, tm, tn, k0, kn, _ in units:
        assert kn > 0, f"cluster {c} unit {unit} is empty"
        for kt in range(k0, k0 + kn):
            assert (tm, tn, kt) not in seen, f"K tile {kt} of tile {(tm, tn)} twice"
            seen[(tm, tn, kt)] = c
    want = {(tm, tn, kt) for tm in range(0, 2 * (ctiles // tiles_n), 2) for tn in range(tiles_n) for kt in range(k_tiles)}
    assert set(seen) == want
    # balanced: the busiest cluster does at most one K tile more than the average (plus its whole tiles)
    per_cluster = {}
    for c, unit, *_, kn, piece in units:
        if piece is not None:
            per_cluster[c] = per_cluster.get(c, 0) + kn
    if per_cluster:
        assert max(per_cluster.values()) - min(per_cluster.values()) <= 1


@pytest.mark.parametrize("tiles_m,tiles_n,k_tiles,clusters", CASES)
def test_cut_tiles_are_finished_by_their_head_after_the_other_pieces(host_select, tiles_m, tiles_n, k_tiles, clusters):
    sched, units = walk(tiles_m, tiles_n, (2, 1), clusters, k_tiles, dispatch.BALANCED_TAIL)
    cut = {}
    first_balanced = {}
    published = {}
    for c, unit, tm, tn, k0, kn, piece in units:
        if piece is None:
            continue
        p, pieces, counter_slot, partial_slot = piece
        first_balanced.setdefault(c, unit)
        if pieces > 1:
            cut.setdefault((tm, tn), []).append((p, pieces, counter_slot, partial_slot, c, unit, k0))
            if p > 0:
                # a later piece is its cluster's first balanced unit: it never waits before publishing
                assert unit == first_balanced[c]
                assert partial_slot not in published, "two pieces publish into one slot"
                published[partial_slot] = (tm, tn)
    ctas = 2
    floats, counters = dispatch.split_workspace(_inst(), 128 * tiles_m, 192 * tiles_n, dispatch.BALANCED_TAIL, clusters)
    for (tm, tn), pieces in cut.items():
        pieces.sort()
        n = pieces[0][1]
        assert [p for p, *_ in pieces] == list(range(n)) and all(x[1] == n for x in pieces)
        head_cluster = pieces[0][4]
        assert [x[4] for x in pieces] == list(range(head_cluster, head_cluster + n))  # piece p: cluster head + p
        assert [x[6] for x in pieces] == sorted(x[6] for x in pieces) and pieces[0][6] == 0  # head starts at K 0
        assert len({x[2] for x in pieces}) == 1  # one counter per tile
        for p, _, _, partial_slot, *_ in pieces[1:]:
            assert partial_slot == pieces[0][3] + p * ctas  # where the head reads it
        assert pieces[0][2] < counters and max(x[3] for x in pieces) < clusters * ctas
        assert floats == clusters * ctas * 128 * 192


def _inst():
    return next(i for i in dispatch.INSTANCES if i.split_tail and i.recipe == "tensor" and i.tile_n == 192)


def test_without_balancing_every_tile_is_whole(host_select):
    _, units = walk(48, 3, (2, 1), 66, 56, 1)
    assert len(units) == 72 and all(kn == 56 and piece is None for *_, kn, piece in units)


def test_whole_waves_come_first():
    # all but the last two waves of cluster tiles run whole: the balanced part is one to two waves
    from cutedsl_gemm.kernels.common.last_wave_split import unsplit_cluster_tiles

    for ctiles, clusters in itertools.product((5, 66, 72, 131, 132, 700), (66, 33)):
        whole = unsplit_cluster_tiles(ctiles, clusters)
        assert whole % clusters == 0 and (ctiles - whole < 2 * clusters) and (whole == 0 or ctiles - whole >= clusters)

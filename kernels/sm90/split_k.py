"""Split-K for the Hopper GEMM: several CTAs share one output tile's K range, and the partial sums are
reduced deterministically -- no float atomics, the same bits every run.

Every split writes its fp32 partial accumulator to a workspace, fences, and counts itself in at the
tile's counter. The split that arrives last sums all partials *in split order* (so the result does not
depend on which split finished first), resets the counter for the next launch (CUDA-graph safe: nothing
to re-zero on the host) and runs the epilogue; the others skip it.

Workspace layout: ``[tile][split][fragment element][consumer thread]`` fp32, so that for one fragment
element the 256 consumer threads touch 1 KiB of consecutive memory.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def k_tile_range(k_tiles: Int32, splits: Int32, split: Int32):
    """(first K tile, K tile count) of one split; the host picks ``splits`` so none is empty."""
    per = (k_tiles + splits - 1) // splits
    begin = split * per
    return begin, cutlass.min(per, k_tiles - begin)


@cute.jit
def reduce_partials(
    acc: cute.Tensor,
    workspace: cute.Tensor,
    counters: cute.Tensor,
    tile: Int32,
    split: Int32,
    splits: Int32,
    tid: Int32,
    num_threads: cutlass.Constexpr,
    barrier,
    flag: cute.Tensor,
):
    """Leave the full sum of the tile's splits in ``acc`` of the last-arriving split; returns whether this
    CTA is that split (uniform across its consumer threads)."""
    n = cute.size(acc)
    per_split = n * num_threads
    mine = cutlass.Int64(tile * splits + split) * per_split + tid
    for i in cutlass.range_constexpr(n):
        workspace[mine + i * num_threads] = acc[i]
    # Publish the partial before counting in (threadfence-reduction pattern).
    cute.arch.fence_acq_rel_gpu()
    barrier.arrive_and_wait()
    if tid == 0:
        flag[0] = cute.arch.atomic_add(counters.iterator + tile, Int32(1), sem="acq_rel", scope="gpu")
    barrier.arrive_and_wait()
    last = flag[0] == splits - 1
    if last:
        cute.arch.fence_acq_rel_gpu()
        first = cutlass.Int64(tile * splits) * per_split + tid
        # .cg: read at L2, where the other SMs' partials are, never a stale L1 line.
        for i in cutlass.range_constexpr(n):
            acc[i] = cute.arch.load(workspace.iterator + (first + i * num_threads), Float32, cop="cg")
        for j in cutlass.range(1, splits, unroll=1):
            base = first + cutlass.Int64(j) * per_split
            for i in cutlass.range_constexpr(n):
                acc[i] = acc[i] + cute.arch.load(workspace.iterator + (base + i * num_threads), Float32, cop="cg")
        if tid == 0:
            counters[tile] = Int32(0)
    return last

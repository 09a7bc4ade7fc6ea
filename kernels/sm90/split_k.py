"""Split-K for the Hopper GEMM: several CTAs share one output tile's K range, and the partial sums are
reduced deterministically -- no float atomics, the same bits every run.

Every split writes its partial accumulator (fp32, or the int32 sums of the int8 GEMMs) to a workspace, fences,
and counts itself in at the tile's counter. The split that arrives last sums all partials *in split order* (so
the result does not depend on which split finished first), resets the counter for the next launch (CUDA-graph
safe: nothing to re-zero on the host) and runs the epilogue; the others skip it.

int32 partials are reduced in int32: exact, so the int8 GEMM's split-K result equals the unsplit one bit for bit
(the host's fp32 workspace holds them: same width).

Workspace layout: ``[tile][split][fragment element // 4][consumer thread][fragment element % 4]`` 32-bit words:
each thread moves its fragment four elements (16 bytes) per instruction, and one such instruction of the
256 consumer threads covers 4 KiB of consecutive memory (4x fewer memory instructions than scalar
accesses).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir


@cute.jit
def k_tile_range(k_tiles: Int32, splits: Int32, split: Int32):
    """(first K tile, K tile count) of one split; the host picks ``splits`` so none is empty."""
    per = (k_tiles + splits - 1) // splits
    begin = split * per
    return begin, cutlass.min(per, k_tiles - begin)


VEC = 4  # 32-bit accumulator elements per workspace access (16 bytes)


@cute.jit
def _store_vec(acc: cute.Tensor, first: cutlass.Constexpr, ptr):
    v = cute.make_rmem_tensor((VEC,), acc.element_type)
    for j in cutlass.range_constexpr(VEC):
        v[j] = acc[first + j]
    cute.arch.store(ptr, v.load().ir_value(), cop="cg")


@cute.jit
def _load_vec(ptr, dtype: cutlass.Constexpr):
    # .cg: read at L2, where the other SMs' partials are, never a stale L1 line.
    raw = cute.arch.load(ptr, ir.VectorType.get([VEC], dtype.mlir_type), cop="cg")
    v = cute.make_rmem_tensor((VEC,), dtype)
    v.store(cute.TensorSSA(raw, (VEC,), dtype))
    return v


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
    assert n % VEC == 0, "WGMMA fragments hold a multiple of 4 accumulator elements per thread"
    dtype = acc.element_type
    words = workspace.iterator  # the host's fp32 workspace, seen as the accumulator's 32-bit type
    if cutlass.const_expr(dtype is not Float32):
        words = cute.recast_ptr(words, dtype=dtype)
    per_split = n * num_threads
    group = VEC * num_threads  # elements of one vector access by every consumer thread
    mine = cutlass.Int64(tile * splits + split) * per_split + tid * VEC
    for g in cutlass.range_constexpr(n // VEC):
        _store_vec(acc, g * VEC, words + (mine + g * group))
    # Publish the partial before counting in (threadfence-reduction pattern).
    cute.arch.fence_acq_rel_gpu()
    barrier.arrive_and_wait()
    if tid == 0:
        flag[0] = cute.arch.atomic_add(counters.iterator + tile, Int32(1), sem="acq_rel", scope="gpu")
    barrier.arrive_and_wait()
    last = flag[0] == splits - 1
    if last:
        cute.arch.fence_acq_rel_gpu()
        first = cutlass.Int64(tile * splits) * per_split + tid * VEC
        for g in cutlass.range_constexpr(n // VEC):
            v = _load_vec(words + (first + g * group), dtype)
            for j in cutlass.range_constexpr(VEC):
                acc[g * VEC + j] = v[j]
        for s in cutlass.range(1, splits, unroll=1):
            base = first + cutlass.Int64(s) * per_split
            for g in cutlass.range_constexpr(n // VEC):
                v = _load_vec(words + (base + g * group), dtype)
                for j in cutlass.range_constexpr(VEC):
                    acc[g * VEC + j] = acc[g * VEC + j] + v[j]
        if tid == 0:
            counters[tile] = Int32(0)
    return last

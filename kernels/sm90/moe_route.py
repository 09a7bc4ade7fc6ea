"""The routing of a mixture-of-experts layer in two kernels around its grouped GEMMs: ``RouteQuant`` places the
(token, slot) pairs by expert and writes each token's row quantized to FP8 into every row its pairs take;
``PairSum`` adds each token's rows of the experts' output back up.

``RouteQuant``: one CTA per token t, all its threads in every phase, the phases between CTA barriers (no pipeline,
no stages; the row's loads are issued first, so their latency hides behind the counting).

=========  ===================================================================================================
phase      what the CTA of token t does
=========  ===================================================================================================
load       issues the loads of row t (16-element vectors, ``P`` per thread, held in registers)
count      reads all T*k expert ids: per expert the pairs routed to it (``total``) and those of tokens before t
           (``before``), shared-memory integer atomics (exact, so every CTA counts the same), one per expert and
           warp (``match.any`` groups a warp's lanes by expert)
scan       warp 0: the exclusive prefix sum of ``total`` over the experts, each expert's first row (contiguous);
           CTA 0 writes the groups (the cumulative end rows, or per expert the counts clamped to the capacity)
place      thread j < k: pair (t, j)'s row, ``start[e] + before[e] + (slots j' < j with expert e)`` (contiguous:
           the stable sort's order by expert) or ``e * C + rank`` while rank < C (masked), -1 for a pair dropped
           by the capacity or with an id outside [0, E); writes it (``pos``) and its fp32 routing weight there
quantize   row t's scale (per token, or per 1x128 group) and codes, ``quantize_fp8``'s numerics bit for bit,
           stored into each of the k rows (a row -1 stores nothing)
=========  ===================================================================================================

Every CTA reads all T*k ids: the form for decode and small batches (a few thousand pairs); past that, a sort
costs less than T reads of every id.

``PairSum``: CTA (t, c) adds the k rows ``pos[t, :]`` of the experts' output in column chunk c, in fp32 in slot
order, and rounds once to the output dtype; a row -1 (a dropped pair) makes the token's output NaN, so that it
shows rather than vanishes. One 16-byte vector per thread, the k loads issued before any add.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .quantize_fp8 import (
    FAST_MIN_SCALE,
    VEC,
    _block_allreduce_max,
    emit_quantized,
    finite_amax,
    group_scale,
    launch_dependents,
    reciprocal,
    scale_of,
)

GRAN_ROW = "row"
GRAN_1x128 = "1x128"
GRAN_TENSOR = "tensor"  # one scale: the amax kernel's partial maxima over all of hidden, folded by every CTA
MAX_TOP_K = 32  # the place phase gives a pair a thread of warp 0
MAX_EXPERTS = 1024  # three int32 counters per expert in shared memory
MAX_HIDDEN = 65536  # at most 4 vectors of the row per thread at 1024 threads
COUNT_LOADS = 4  # expert ids each thread loads at once in the count phase
ROUTE_BLOCK_TOKENS = 64  # tokens per block of the blocked routing's count (RouteCount)


def route_threads(hidden: int) -> tuple:
    """(threads, vectors per thread) of the CTA that quantizes a row of ``hidden`` elements: a power of two from 128
    to 1024 threads (the CTA-wide maximum folds warps by a butterfly), about two vectors per thread."""
    nvec = hidden // VEC
    threads = 128
    while threads < 1024 and 2 * threads < nvec:
        threads *= 2
    return threads, -(-nvec // threads)


class RouteQuant:
    """Compile-time configuration of the routing quantizer (see the module docstring): input and output element
    types, the expert ids' and routing weights' types, ``granularity`` "row" or "1x128", the row width ``hidden``,
    ``top_k``, ``experts`` and whether the layout is ``masked``."""

    def __init__(self, in_dtype, out_dtype, fmax: float, granularity: str, *, hidden: int, top_k: int, experts: int,
                 masked: bool, id_dtype=cutlass.Int64, weight_dtype=Float32):
        if granularity not in (GRAN_ROW, GRAN_1x128, GRAN_TENSOR):
            raise ValueError(f"granularity must be 'row', '1x128' or 'tensor', got {granularity!r}")
        if hidden % VEC or not 0 < hidden <= MAX_HIDDEN:
            raise ValueError(f"hidden must be a multiple of {VEC} in [{VEC}, {MAX_HIDDEN}], got {hidden}")
        if not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must lie in [1, {MAX_TOP_K}], got {top_k}")
        if not 1 <= experts <= MAX_EXPERTS:
            raise ValueError(f"experts must lie in [1, {MAX_EXPERTS}], got {experts}")
        self.in_dtype, self.out_dtype, self.fmax = in_dtype, out_dtype, float(fmax)
        self.id_dtype, self.weight_dtype = id_dtype, weight_dtype
        self.group = granularity == GRAN_1x128
        self.tensor = granularity == GRAN_TENSOR
        self.H, self.k, self.E, self.masked = hidden, top_k, experts, bool(masked)
        self.T, self.P = route_threads(hidden)
        self.NW = self.T // 32
        self.nvec = hidden // VEC
        self.div = "ieee" if in_dtype.width == 32 else "fma"

    @cute.jit
    def launch(self, mX: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
               mPW: cute.Tensor, mPos: cute.Tensor, mGroups: cute.Tensor, capacity: Int32, mHist: cute.Tensor,
               mStart: cute.Tensor, mPart: cute.Tensor, stream):
        self.kernel(mX, mIds, mW, mQ, mS, mPW, mPos, mGroups, capacity, mHist, mStart, mPart).launch(
            grid=[mX.shape[0], 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mW: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
               mPW: cute.Tensor, mPos: cute.Tensor, mGroups: cute.Tensor, capacity: Int32, mHist: cute.Tensor,
               mStart: cute.Tensor, mPart: cute.Tensor):
        launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        k = self.k
        gX = cute.zipped_divide(mX, (1, VEC))
        gQ = cute.zipped_divide(mQ, (1, VEC))

        # load: row t's vectors (an index past the row re-reads its last vector: same row, same last group)
        frags = []
        for p in cutlass.range_constexpr(self.P):
            v = p * self.T + tidx
            f = cute.make_rmem_tensor((1, VEC), self.in_dtype)
            cute.autovec_copy(gX[(None, (t, cutlass.min(v, self.nvec - 1)))], f)
            frags.append(f)

        smem = cutlass.memory.SmemAllocator()
        earlier = smem.allocate_tensor(Int32, cute.make_layout(k), 16)  # pairs of slot j's expert before token t
        first = smem.allocate_tensor(Int32, cute.make_layout(k), 16)  # slot j's expert's first row (contiguous)
        rows = smem.allocate_tensor(Int32, cute.make_layout(k), 16)
        red = smem.allocate_tensor(Float32, cute.make_layout(self.NW), 16)
        self._count(smem, mIds, mGroups, capacity, mHist, mStart, t, tidx, earlier, first)
        cute.arch.barrier()

        # place
        if tidx < k:
            p = t * k + tidx
            raw = mIds[p]
            valid = (raw >= 0) & (raw < self.E)
            e = cutlass.select_(valid, Int32(raw), Int32(0))
            dup = Int32(0)
            for j in cutlass.range_constexpr(k):  # earlier slots of this token with the same expert
                dup = dup + cutlass.select_((tidx > j) & (mIds[t * k + j] == raw), Int32(1), Int32(0))
            rank = earlier[tidx] + dup
            row = Int32(-1)
            if cutlass.const_expr(self.masked):
                row = cutlass.select_(valid & (rank < capacity), e * capacity + rank, Int32(-1))
            else:
                row = cutlass.select_(valid, first[tidx] + rank, Int32(-1))
            rows[tidx] = row
            mPos[p] = row
            if row >= 0:
                mPW[row] = Float32(mW[p])
        cute.arch.barrier()

        # quantize, and store into the k rows: each vector's (scale, reciprocal, fast path), then its codes
        row_scaling = None  # (the row's or the tensor's, shared by its vectors; 1x128: each vector's group's)
        if cutlass.const_expr(not self.group):
            amax = Float32(0.0)
            if cutlass.const_expr(self.tensor):  # the partial maxima of the amax kernel, over every row
                for i in range(tidx, mPart.shape[0], self.T):
                    amax = cute.arch.fmax(amax, mPart[i])
            else:
                for p in cutlass.range_constexpr(self.P):
                    amax = finite_amax(frags[p], amax)
            scale = scale_of(_block_allreduce_max(amax, red, tidx, self.NW), self.fmax)
            row_scaling = (scale, reciprocal(scale), scale >= Float32(FAST_MIN_SCALE))
        codes = []
        scales = []
        for p in cutlass.range_constexpr(self.P):
            scaling = group_scale(frags[p], 8, self.fmax) if cutlass.const_expr(self.group) else row_scaling
            q = cute.make_rmem_tensor((1, VEC), self.out_dtype)
            emit_quantized(frags[p], *scaling, q, cutlass.Boolean(True), self.out_dtype, self.div)
            codes.append(q)
            scales.append(scaling[0])
        for j in cutlass.range_constexpr(k):
            row = rows[j]
            if row >= 0:
                for p in cutlass.range_constexpr(self.P):
                    v = p * self.T + tidx
                    if v < self.nvec:
                        cute.autovec_copy(codes[p], gQ[(None, (row, v))])
                        if cutlass.const_expr(self.group):
                            if v % 8 == 0:
                                mS[row, v // 8] = scales[p]
                if cutlass.const_expr(not self.group and not self.tensor):
                    if tidx == 0:
                        mS[row, 0] = scales[0]
        if cutlass.const_expr(self.tensor):
            if (t == 0) & (tidx == 0):
                mS[0] = scales[0]

    # ---- the count: every CTA over all T*k ids (BlockedRouteQuant: from the block counts) ----
    @cute.jit
    def _count(self, smem, mIds, mGroups, capacity, mHist, mStart, t, tidx, earlier, first):
        """Fill ``earlier[j]`` (the pairs of slot j's expert in tokens before t) and ``first[j]`` (that expert's
        first row, contiguous) for the token's k slots; CTA 0 writes the groups. (Every thread; the caller
        syncs.)"""
        E, k = self.E, self.k
        total = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        before = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        start = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        for e in range(tidx, E, self.T):
            total[e] = Int32(0)
            before[e] = Int32(0)
        cute.arch.barrier()
        count_by_expert(mIds, Int32(0), mIds.shape[0], t * k, total, before, tidx, self.T, E, self.id_dtype)
        cute.arch.barrier()
        if cutlass.const_expr(self.masked):
            if t == 0:
                for e in range(tidx, E, self.T):
                    mGroups[e] = cutlass.min(total[e], capacity)
        else:
            if tidx < 32:
                scan_experts(total, start, mGroups, t == 0, E)
        cute.arch.barrier()
        if tidx < k:
            raw = mIds[t * k + tidx]
            e = cutlass.select_((raw >= 0) & (raw < E), Int32(raw), Int32(0))
            earlier[tidx] = before[e]
            first[tidx] = start[e]


@cute.jit
def count_by_expert(mIds, lo, hi, mine, total, before, tidx, threads: cutlass.Constexpr, E: cutlass.Constexpr,
                    id_dtype: cutlass.Constexpr):
    """Pairs ``lo`` .. ``hi`` - 1 of ``mIds`` counted per expert into ``total`` (and those below ``mine`` into
    ``before``, unless None) with shared-memory atomics, one per expert and warp: ``match.any`` groups a warp's
    lanes by expert and the lowest lane of each adds the group's count (a hot expert's pairs do not serialise on
    its counter). The loop's trips are warp-uniform (the match takes every lane)."""
    lane = tidx % 32
    below = cute.arch.lanemask_lt()
    for first in range(lo + tidx - lane, hi, threads * COUNT_LOADS):
        ids = []  # COUNT_LOADS loads in flight before the first atomic (a slot past the range reads as id -1)
        for u in cutlass.range_constexpr(COUNT_LOADS):
            p = first + u * threads + lane
            ids.append(cutlass.select_(p < hi, mIds[cutlass.min(p, hi - 1)], id_dtype(-1)))
        for u in cutlass.range_constexpr(COUNT_LOADS):
            raw = ids[u]
            valid = (raw >= 0) & (raw < E)
            e = cutlass.select_(valid, Int32(raw), Int32(-1))
            peers = cute.arch.match_sync(0xFFFFFFFF, e)
            if cutlass.const_expr(before is None):
                if valid & ((peers & below) == 0):  # the lowest lane of its expert's peers
                    cute.arch.atomic_add(total.iterator + e, Int32(cute.arch.popc(peers)), scope="cta")
            else:
                earlier = cute.arch.vote_ballot_sync(first + u * threads + lane < mine)
                if valid & ((peers & below) == 0):
                    cute.arch.atomic_add(total.iterator + e, Int32(cute.arch.popc(peers)), scope="cta")
                    n_before = cute.arch.popc(peers & earlier)
                    if n_before > 0:
                        cute.arch.atomic_add(before.iterator + e, Int32(n_before), scope="cta")


@cute.jit
def scan_experts(total, start, mGroups, write_groups, E: cutlass.Constexpr):
    """(Warp 0.) ``start[e]``: the exclusive prefix sum of ``total`` over the experts (each expert's first row);
    with ``write_groups``, the inclusive one (the cumulative end rows) into ``mGroups``."""
    lane = cute.arch.lane_idx()
    run = Int32(0)
    for base in cutlass.range_constexpr(0, E, 32):
        e = base + lane
        c = cutlass.select_(e < E, total[cutlass.min(e, E - 1)], Int32(0))
        incl = c
        for d in cutlass.range_constexpr(5):  # inclusive prefix sum over the lanes
            up = cute.arch.shuffle_sync_up(incl, 1 << d, mask_and_clamp=0)
            incl = incl + cutlass.select_(lane >= (1 << d), up, Int32(0))
        if e < E:
            start[e] = run + incl - c
            if write_groups:
                mGroups[e] = run + incl
        run = run + cute.arch.shuffle_sync(incl, 31)


class BlockedRouteQuant(RouteQuant):
    """The routing quantizer past one kernel's size (prefill): ``RouteCount`` counts each block of
    ``ROUTE_BLOCK_TOKENS`` tokens' pairs per expert into ``hist`` (B, E), ``RouteTotals`` the experts' totals,
    first rows (``start``) and groups, and this kernel's CTA of token t adds, for each of its k slots, the counts of
    the blocks before its own and those of its own block's tokens before t (a warp reduction per slot, then one
    shared-memory atomic per warp), instead of reading every id. The place and quantize phases are
    ``RouteQuant``'s.

    | phase | what the CTA of token t does |
    |---|---|
    | load | issues the loads of row t |
    | count | per slot j: the pairs of its expert in blocks before t's (``hist``) and in t's block before t |
    | place, quantize | as ``RouteQuant`` |
    """

    @cute.jit
    def _count(self, smem, mIds, mGroups, capacity, mHist, mStart, t, tidx, earlier, first):
        E, k = self.E, self.k
        block = t // ROUTE_BLOCK_TOKENS
        mine = smem.allocate_tensor(Int32, cute.make_layout(k), 16)  # the slots' experts (-1: outside [0, E))
        if tidx < k:
            raw = mIds[t * k + tidx]
            e = cutlass.select_((raw >= 0) & (raw < E), Int32(raw), Int32(-1))
            mine[tidx] = e
            earlier[tidx] = Int32(0)
            first[tidx] = cutlass.select_(e >= 0, mStart[cutlass.max(e, Int32(0))], Int32(0))
        cute.arch.barrier()
        lane = tidx % 32
        lo = block * ROUTE_BLOCK_TOKENS * k
        for j in cutlass.range_constexpr(k):
            e = mine[j]
            n = Int32(0)
            if e >= 0:
                for b in range(tidx, block, self.T):  # the blocks before t's
                    n = n + mHist[b, e]
                for p in range(lo + tidx, t * k, self.T):  # t's block's pairs before t's
                    n = n + cutlass.select_(mIds[p] == mIds[t * k + j], Int32(1), Int32(0))
            for d in cutlass.range_constexpr(5):
                n = n + cute.arch.shuffle_sync_bfly(n, offset=1 << d)
            if (lane == 0) & (n > 0):
                cute.arch.atomic_add(earlier.iterator + j, n, scope="cta")


class RouteCount:
    """The blocked routing's count: CTA b counts the pairs of tokens [b * ROUTE_BLOCK_TOKENS, (b + 1) *
    ROUTE_BLOCK_TOKENS) per expert into ``hist[b, :]`` (shared-memory atomics, one per expert and warp).

    | phase | what CTA b does |
    |---|---|
    | count | its block's pairs into a shared-memory histogram |
    | store | the histogram into ``hist[b, :]`` |
    """

    def __init__(self, *, top_k: int, experts: int, id_dtype=cutlass.Int64, threads: int = 256):
        self.k, self.E, self.id_dtype, self.T = top_k, experts, id_dtype, int(threads)

    @cute.jit
    def launch(self, mIds: cute.Tensor, mHist: cute.Tensor, stream):
        self.kernel(mIds, mHist).launch(grid=[mHist.shape[0], 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mHist: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        hist = cutlass.memory.SmemAllocator().allocate_tensor(Int32, cute.make_layout(self.E), 16)
        for e in range(tidx, self.E, self.T):
            hist[e] = Int32(0)
        cute.arch.barrier()
        lo = b * ROUTE_BLOCK_TOKENS * self.k
        hi = cutlass.min(lo + ROUTE_BLOCK_TOKENS * self.k, mIds.shape[0])
        count_by_expert(mIds, lo, hi, Int32(0), hist, None, tidx, self.T, self.E, self.id_dtype)
        cute.arch.barrier()
        for e in range(tidx, self.E, self.T):
            mHist[b, e] = hist[e]


class RouteTotals:
    """The blocked routing's totals (one CTA): each expert's pairs summed over the blocks (a warp per expert, its
    lanes striding over the blocks), then their exclusive prefix sum (each expert's first row, ``start``) and the
    groups (contiguous: the cumulative end rows; masked: the counts clamped to the capacity).

    | warps | what they do |
    |---|---|
    | all | per expert, the sum of ``hist[:, e]`` into shared memory |
    | warp 0 | the scan over the experts; the groups |
    """

    def __init__(self, *, experts: int, masked: bool, threads: int = 1024):
        self.E, self.masked, self.T = experts, bool(masked), int(threads)

    @cute.jit
    def launch(self, mHist: cute.Tensor, mStart: cute.Tensor, mGroups: cute.Tensor, capacity: Int32, stream):
        self.kernel(mHist, mStart, mGroups, capacity).launch(grid=[1, 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mHist: cute.Tensor, mStart: cute.Tensor, mGroups: cute.Tensor, capacity: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        total = smem.allocate_tensor(Int32, cute.make_layout(self.E), 16)
        start = smem.allocate_tensor(Int32, cute.make_layout(self.E), 16)
        lane, warp = tidx % 32, tidx // 32
        for e in range(warp, self.E, self.T // 32):
            n = Int32(0)
            for b in range(lane, mHist.shape[0], 32):
                n = n + mHist[b, e]
            for d in cutlass.range_constexpr(5):
                n = n + cute.arch.shuffle_sync_bfly(n, offset=1 << d)
            if lane == 0:
                total[e] = n
        cute.arch.barrier()
        if cutlass.const_expr(self.masked):
            for e in range(tidx, self.E, self.T):
                mGroups[e] = cutlass.min(total[e], capacity)
        else:
            if tidx < 32:
                scan_experts(total, start, mGroups, True, self.E)
            cute.arch.barrier()
            for e in range(tidx, self.E, self.T):
                mStart[e] = start[e]


class PairSum:
    """Compile-time configuration of the pair sum (see the module docstring): the element type, ``top_k`` and the
    threads per CTA (one 16-byte vector each)."""

    def __init__(self, dtype, top_k: int, threads: int = 128):
        if not 1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must lie in [1, {MAX_TOP_K}], got {top_k}")
        self.dtype, self.k, self.T = dtype, top_k, int(threads)
        self.V = 128 // dtype.width  # elements per 16-byte vector

    @cute.jit
    def launch(self, mY: cute.Tensor, mPos: cute.Tensor, mOut: cute.Tensor, stream):
        chunks = (mOut.shape[1] // self.V + self.T - 1) // self.T
        self.kernel(mY, mPos, mOut).launch(grid=[mOut.shape[0], chunks, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mPos: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, c, _ = cute.arch.block_idx()
        gY = cute.zipped_divide(mY, (1, self.V))
        gO = cute.zipped_divide(mOut, (1, self.V))
        v = c * self.T + tidx
        if v < mOut.shape[1] // self.V:
            frags = []
            dropped = cutlass.Boolean(False)
            for j in cutlass.range_constexpr(self.k):
                row = mPos[t * self.k + j]
                dropped = dropped | (row < 0)
                f = cute.make_rmem_tensor((1, self.V), self.dtype)
                cute.autovec_copy(gY[(None, (cutlass.max(row, Int32(0)), v))], f)
                frags.append(f)
            acc = frags[0].load().to(Float32)
            for j in cutlass.range_constexpr(1, self.k):
                acc = acc + frags[j].load().to(Float32)
            out = cute.make_rmem_tensor((1, self.V), Float32)
            out.store(acc)
            if dropped:
                out.fill(Float32(float("nan")))
            o = cute.make_rmem_tensor((1, self.V), self.dtype)
            o.store(out.load().to(self.dtype))
            cute.autovec_copy(o, gO[(None, (t, v))])


# ----------------------------------------------------------------------------------------------------
# compilation entry points (fake tensors: no GPU needed)
# ----------------------------------------------------------------------------------------------------


def route_entry(in_dtype, out_dtype, fmax, granularity: str, *, hidden: int, top_k: int, experts: int, masked: bool,
                id_dtype, weight_dtype, blocked: bool = False):
    """Call as f(x (T, H), ids (T*k,), weights (T*k,), q (R, H), s, pair_weights (R,) fp32, pos (T*k,) int32,
    groups (E,) int32, capacity, hist (B, E) int32, start (E,) int32, part (G,) fp32), s (R, 1) for rows, (R,
    ceil(H / 128)) M-major for 1x128 groups or (1,) for the tensor; R = T * k (contiguous) or E * capacity (masked;
    capacity is ignored otherwise); part: the tensor amax kernel's partial maxima over x (read for "tensor" only).
    ``blocked``: ``BlockedRouteQuant``, after ``RouteCount`` and ``RouteTotals`` (which write hist, start and the
    groups); otherwise hist and start are not read."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    cls = BlockedRouteQuant if blocked else RouteQuant
    kern = cls(in_dtype, out_dtype, fmax, granularity, hidden=hidden, top_k=top_k, experts=experts, masked=masked,
               id_dtype=id_dtype, weight_dtype=weight_dtype)
    tokens, pairs, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def vec(dtype, n, align=4):
        return make_fake_compact_tensor(dtype, (n,), assumed_align=align)

    x = make_fake_compact_tensor(in_dtype, (tokens, hidden), stride_order=(1, 0), assumed_align=16)
    q = make_fake_compact_tensor(out_dtype, (rows, hidden), stride_order=(1, 0), assumed_align=16)
    if granularity == GRAN_ROW:
        s = make_fake_compact_tensor(Float32, (rows, 1), stride_order=(1, 0), assumed_align=4)
    elif granularity == GRAN_TENSOR:
        s = make_fake_compact_tensor(Float32, (1,), assumed_align=4)
    else:
        s = make_fake_compact_tensor(Float32, (rows, -(-hidden // 128)), stride_order=(0, 1), assumed_align=4)
    ids, w = vec(id_dtype, pairs, id_dtype.width // 8), vec(weight_dtype, pairs, weight_dtype.width // 8)
    hist = make_fake_compact_tensor(Int32, (cute.sym_int(), experts), stride_order=(1, 0), assumed_align=4)
    part = vec(Float32, cute.sym_int())
    return kern.launch, (x, ids, w, q, s, vec(Float32, rows), vec(Int32, pairs), vec(Int32, experts), Int32(1), hist,
                         vec(Int32, experts), part, make_fake_stream(use_tvm_ffi_env_stream=True))


def count_entry(top_k: int, experts: int, id_dtype):
    """Call as f(ids (T*k,), hist (B, E) int32), B = ceil(T / ROUTE_BLOCK_TOKENS)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    ids = make_fake_compact_tensor(id_dtype, (cute.sym_int(),), assumed_align=id_dtype.width // 8)
    hist = make_fake_compact_tensor(Int32, (cute.sym_int(), experts), stride_order=(1, 0), assumed_align=4)
    kern = RouteCount(top_k=top_k, experts=experts, id_dtype=id_dtype)
    return kern.launch, (ids, hist, make_fake_stream(use_tvm_ffi_env_stream=True))


def totals_entry(experts: int, masked: bool):
    """Call as f(hist (B, E) int32, start (E,) int32, groups (E,) int32, capacity)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    hist = make_fake_compact_tensor(Int32, (cute.sym_int(), experts), stride_order=(1, 0), assumed_align=4)
    start = make_fake_compact_tensor(Int32, (experts,), assumed_align=4)
    groups = make_fake_compact_tensor(Int32, (experts,), assumed_align=4)
    kern = RouteTotals(experts=experts, masked=masked)
    return kern.launch, (hist, start, groups, Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True))


def pair_sum_entry(dtype, top_k: int):
    """Call as f(y (R, H), pos (T*k,) int32, out (T, H)), H a multiple of 16 bytes' elements."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    kern = PairSum(dtype, top_k)
    h = cute.sym_int(divisibility=kern.V)
    y = make_fake_compact_tensor(dtype, (cute.sym_int(), h), stride_order=(1, 0), assumed_align=16)
    out = make_fake_compact_tensor(dtype, (cute.sym_int(), h), stride_order=(1, 0), assumed_align=16)
    pos = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
    return kern.launch, (y, pos, out, make_fake_stream(use_tvm_ffi_env_stream=True))

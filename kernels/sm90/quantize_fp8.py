"""FP8 (E4M3 / E5M2) quantization kernels: per-tensor, per-row, 1xB groups and BxB blocks.

Plain CUDA-core code (no tensor cores, no TMA), so it compiles for sm_90a and sm_100a alike. The numerics
are the contract of ``cutedsl_gemm/reference.py`` bit for bit: amax over finite |x|, fp32 IEEE
``scale = amax / fmax`` (1 for an all-zero group), ``q = cvt.rn.satfinite(x / scale)`` with an IEEE
``div.rn.f32`` per element (a reciprocal multiply would differ from the reference in the last bit).

Thread/block mapping
--------------------
Every thread works on *vectors* of 16 consecutive elements of one row: two 16-byte loads for bf16/fp16
(four for fp32) and exactly one 16-byte store of 16 FP8 bytes. ``K % 16 == 0`` is therefore required
(the FP8 GEMMs need it anyway for 16-byte aligned rows); rows are arbitrary.

* Tile kernel (1xB groups, BxB blocks, per-tensor cast): a CTA owns a tile of ``BR x BC`` elements.
  ``TPR = BC / 16`` neighbouring lanes cover one row segment of BC elements (8 lanes for 128), so a
  warp reads ``32 / TPR`` whole 256-byte row segments: fully coalesced. The CTA's ``T`` threads cover
  ``RPP = T / TPR`` rows per pass and make ``P = BR / RPP`` passes. All P loads of a thread are issued
  before any arithmetic (8 x 16 B in flight per thread for bf16) and the data stays in registers, so
  the input is read exactly once.

  - 1xB groups (BR = 128, BC = B): a group is one row segment = TPR aligned lanes; its amax is a
    butterfly shuffle over those lanes (3 steps for 128). Each pass is an independent set of groups.
  - BxB blocks (BR = BC = B): the CTA owns one whole block. Thread max -> warp butterfly -> one float per
    warp in shared memory -> every thread folds the warp maxima. For 256x256 with fp32 input the data
    would not fit in registers (128 floats per thread), so that one configuration re-reads its block
    (mostly from L2) instead of holding it.
  - Per-tensor cast: 128x128 tiles whose scale comes from the partial maxima of the amax kernel.

* Amax kernel (per-tensor, pass 1): a fixed grid of G CTAs strides over 128x128 tiles and writes one
  partial maximum per CTA (no atomics, no memset, deterministic); the cast kernel folds the G partials
  (a few hundred floats from L2) in every CTA.

* Row kernel (per-row): one warp per row, 32 lanes x 16 elements = 512 columns per step, two vectors per
  lane per iteration. Rows can be long (K = 8192 bf16 is 16 KB), so the row is read twice: amax, then
  cast (the second read hits L1/L2).

Performance notes (from ptxas -v for sm_90a; not yet measured): the tile kernels use 128 registers, so
2 CTAs = 512 threads per SM, each with 8 x 16 B loads in flight (64 KB per SM, several times what
3 TB/s needs). The ALU work is dominated by the per-element IEEE ``div.rn.f32`` (~10 instructions with
its slow-path check) that the contract requires; should the H100 run show < 80% of 3.0 TB/s, the
bit-exact alternative is one correctly rounded reciprocal per group plus an FMA-corrected quotient
(Markstein), with plain division kept for groups whose scale is near the fp32 range limits.

Scale layouts are the caller's: the kernels index a 2-D cute tensor with whatever (compact) strides it
was compiled for (M-major (1, M) or row-major), and for the cuBLAS layout of BxB scales whose K-block
dimension is padded to a multiple of 4, the CTA of the last K block also writes 1.0 into the padding
(those are empty groups, which get scale 1 by the contract).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

VEC = 16  # elements per thread vector: 16 FP8 bytes out = one 16-byte store


# ----------------------------------------------------------------------------------------------------
# device helpers (traced inline)
# ----------------------------------------------------------------------------------------------------


def _finite_amax(frag, acc):
    """acc = max(acc, |x|) over the finite elements of a register vector.

    ``a + (a - a)`` is ``a`` for finite a and NaN for +-inf/NaN; ``max.f32`` returns its non-NaN operand,
    so non-finite inputs drop out of the maximum in three instructions and without a branch.
    """
    v = frag.load().to(Float32)
    for i in range(VEC):  # plain Python loop: helpers are traced, not preprocessed
        a = abs(v[i])
        acc = cute.arch.fmax(acc, a + (a - a))
    return acc


def _lane_allreduce_max(val, lanes: int):
    """Butterfly max over aligned groups of ``lanes`` lanes (a power of two <= 32)."""
    off = lanes // 2
    while off >= 1:
        val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=off))
        off //= 2
    return val


def _scale_of(amax, fmax: float):
    # The reference: where(amax > 0, amax / fmax, 1), fp32 IEEE division.
    s = amax / Float32(fmax)
    return cutlass.select_(amax > Float32(0.0), s, Float32(1.0))


def _cast(frag, scale, out_dtype):
    y = frag.load().to(Float32) / scale  # div.rn.f32 per element: the reference's exact quotient
    qf = cute.make_rmem_tensor((1, VEC), out_dtype)
    qf.store(y.to(out_dtype))  # cvt.rn.satfinite.{e4m3,e5m2}x2.f32: +-inf/overflow -> +-max, NaN -> NaN
    return qf


def _zeros(dtype):
    f = cute.make_rmem_tensor((1, VEC), dtype)
    f.fill(0)  # out-of-range vectors count as zeros, like the reference's padding
    return f


# ----------------------------------------------------------------------------------------------------
# tile kernel: 1xB groups, BxB blocks, per-tensor cast
# ----------------------------------------------------------------------------------------------------

MODE_GROUP = "group"  # 1 x BC groups
MODE_BLOCK = "block"  # BR x BC blocks, one per CTA
MODE_TENSOR_CAST = "tensor_cast"  # scale from the amax kernel's partials


class TileQuant:
    """Compile-time configuration of the tile kernel (see the module docstring)."""

    def __init__(self, in_dtype, out_dtype, fmax: float, mode: str, block: int = 128):
        self.in_dtype, self.out_dtype, self.fmax, self.mode = in_dtype, out_dtype, float(fmax), mode
        if mode == MODE_TENSOR_CAST:
            block = 128
        if block not in (128, 256):
            raise ValueError(f"block must be 128 or 256, got {block}")
        self.BC = block
        self.TPR = block // VEC
        if mode == MODE_BLOCK:
            self.T = 256 if block == 128 else 512
            self.BR = block
        else:
            self.T = 256
            self.BR = 4 * (self.T // self.TPR)
        self.RPP = self.T // self.TPR
        self.P = self.BR // self.RPP
        self.NW = self.T // 32
        # Hold the tile in registers unless that needs more than 64 registers of data per thread.
        self.hold = self.P * VEC * (in_dtype.width // 8) <= 256

    @cute.jit
    def launch(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mPart: cute.Tensor, stream):
        gx = (mX.shape[1] + self.BC - 1) // self.BC
        gy = (mX.shape[0] + self.BR - 1) // self.BR
        self.kernel(mX, mQ, mS, mPart).launch(grid=[gx, gy, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mPart: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cb, rb, _ = cute.arch.block_idx()
        M = mX.shape[0]
        K = mX.shape[1]
        gX = cute.zipped_divide(mX, (1, VEC))  # ((1, 16), (M, K / 16))
        gQ = cute.zipped_divide(mQ, (1, VEC))
        tr = tidx // self.TPR
        cv = cb * self.TPR + tidx % self.TPR  # this thread's vector column
        col_ok = cv * VEC < K

        rows = []
        oks = []
        frags = []
        for p in cutlass.range_constexpr(self.P):
            row = rb * self.BR + p * self.RPP + tr
            rows.append(row)
            oks.append((row < M) & col_ok)
            if cutlass.const_expr(self.hold):  # issue every load before any arithmetic
                f = _zeros(self.in_dtype)
                if oks[p]:
                    cute.autovec_copy(gX[(None, (row, cv))], f)
                frags.append(f)

        if cutlass.const_expr(self.mode == MODE_GROUP):
            for p in cutlass.range_constexpr(self.P):
                amax = _lane_allreduce_max(_finite_amax(frags[p], Float32(0.0)), self.TPR)
                scale = _scale_of(amax, self.fmax)
                qf = _cast(frags[p], scale, self.out_dtype)
                if oks[p]:
                    cute.autovec_copy(qf, gQ[(None, (rows[p], cv))])
                if (tidx % self.TPR == 0) & (rows[p] < M):
                    mS[rows[p], cb] = scale
        else:
            red = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.NW), 4)
            amax = Float32(0.0)
            if cutlass.const_expr(self.mode == MODE_BLOCK):
                for p in cutlass.range_constexpr(self.P):
                    if cutlass.const_expr(self.hold):
                        amax = _finite_amax(frags[p], amax)
                    else:
                        f = _zeros(self.in_dtype)
                        if oks[p]:
                            cute.autovec_copy(gX[(None, (rows[p], cv))], f)
                        amax = _finite_amax(f, amax)
            else:
                # per-tensor: fold the amax kernel's per-CTA partial maxima
                for i in range(tidx, mPart.shape[0], self.T):
                    amax = cute.arch.fmax(amax, mPart[i])
            amax = _lane_allreduce_max(amax, 32)
            if tidx % 32 == 0:
                red[tidx // 32] = amax
            cute.arch.barrier()
            amax = red[0]
            for w in cutlass.range_constexpr(1, self.NW):
                amax = cute.arch.fmax(amax, red[w])
            scale = _scale_of(amax, self.fmax)
            for p in cutlass.range_constexpr(self.P):
                if cutlass.const_expr(self.hold):
                    qf = _cast(frags[p], scale, self.out_dtype)
                else:  # re-read the block (L2) rather than spill it
                    f = _zeros(self.in_dtype)
                    if oks[p]:
                        cute.autovec_copy(gX[(None, (rows[p], cv))], f)
                    qf = _cast(f, scale, self.out_dtype)
                if oks[p]:
                    cute.autovec_copy(qf, gQ[(None, (rows[p], cv))])
            if cutlass.const_expr(self.mode == MODE_BLOCK):
                if tidx == 0:
                    mS[rb, cb] = scale
                # cuBLAS-padded layout: the last K block also fills the (empty) padding groups with 1.
                if (cb == cute.arch.grid_dim()[0] - 1) & (tidx >= 1) & (tidx < 4):
                    if cb + tidx < mS.shape[1]:
                        mS[rb, cb + tidx] = Float32(1.0)
            else:
                if (tidx == 0) & (cb == 0) & (rb == 0):
                    mS[0] = scale


# ----------------------------------------------------------------------------------------------------
# per-tensor amax kernel (pass 1)
# ----------------------------------------------------------------------------------------------------


class TensorAmax:
    """Grid-stride partial amax over 128x128 tiles; one fp32 partial per CTA into mPart[blockIdx.x]."""

    def __init__(self, in_dtype):
        self.in_dtype = in_dtype
        self.T, self.TPR, self.B = 256, 128 // VEC, 128
        self.RPP = self.T // self.TPR
        self.P = self.B // self.RPP
        self.NW = self.T // 32

    @cute.jit
    def launch(self, mX: cute.Tensor, mPart: cute.Tensor, stream):
        self.kernel(mX, mPart).launch(grid=[mPart.shape[0], 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPart: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        G = cute.arch.grid_dim()[0]
        M = mX.shape[0]
        K = mX.shape[1]
        gX = cute.zipped_divide(mX, (1, VEC))
        ntx = (K + self.B - 1) // self.B
        ntiles = ntx * ((M + self.B - 1) // self.B)
        tr = tidx // self.TPR
        amax = Float32(0.0)
        for t in range(bid, ntiles, G):
            cv = (t % ntx) * self.TPR + tidx % self.TPR
            frags = []
            for p in cutlass.range_constexpr(self.P):  # issue all loads, then reduce
                row = (t // ntx) * self.B + p * self.RPP + tr
                f = _zeros(self.in_dtype)
                if (row < M) & (cv * VEC < K):
                    cute.autovec_copy(gX[(None, (row, cv))], f)
                frags.append(f)
            for p in cutlass.range_constexpr(self.P):
                amax = _finite_amax(frags[p], amax)
        red = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.NW), 4)
        amax = _lane_allreduce_max(amax, 32)
        if tidx % 32 == 0:
            red[tidx // 32] = amax
        cute.arch.barrier()
        if tidx == 0:
            m = red[0]
            for w in cutlass.range_constexpr(1, self.NW):
                m = cute.arch.fmax(m, red[w])
            mPart[bid] = m


# ----------------------------------------------------------------------------------------------------
# per-row kernel
# ----------------------------------------------------------------------------------------------------


class RowQuant:
    """One warp per row; amax pass then cast pass over the row (see the module docstring)."""

    U = 2  # vectors per lane per loop iteration (loads in flight)

    def __init__(self, in_dtype, out_dtype, fmax: float):
        self.in_dtype, self.out_dtype, self.fmax = in_dtype, out_dtype, float(fmax)
        self.T = 128
        self.RPC = self.T // 32  # rows per CTA

    @cute.jit
    def launch(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        g = (mX.shape[0] + self.RPC - 1) // self.RPC
        self.kernel(mX, mQ, mS).launch(grid=[g, 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        M = mX.shape[0]
        K = mX.shape[1]
        gX = cute.zipped_divide(mX, (1, VEC))
        gQ = cute.zipped_divide(mQ, (1, VEC))
        lane = tidx % 32
        row = bid * self.RPC + tidx // 32
        row_ok = row < M
        step = 32 * VEC * self.U
        nsteps = (K + step - 1) // step

        amax = Float32(0.0)
        for j in range(nsteps):
            frags = []
            for u in cutlass.range_constexpr(self.U):
                cv = (j * self.U + u) * 32 + lane
                f = _zeros(self.in_dtype)
                if row_ok & (cv * VEC < K):
                    cute.autovec_copy(gX[(None, (row, cv))], f)
                frags.append(f)
            for u in cutlass.range_constexpr(self.U):
                amax = _finite_amax(frags[u], amax)
        amax = _lane_allreduce_max(amax, 32)
        scale = _scale_of(amax, self.fmax)
        if (lane == 0) & row_ok:
            mS[row, 0] = scale
        for j in range(nsteps):  # second read of the row: L1/L2 hits
            frags = []
            for u in cutlass.range_constexpr(self.U):
                cv = (j * self.U + u) * 32 + lane
                f = _zeros(self.in_dtype)
                if row_ok & (cv * VEC < K):
                    cute.autovec_copy(gX[(None, (row, cv))], f)
                frags.append(f)
            for u in cutlass.range_constexpr(self.U):
                cv = (j * self.U + u) * 32 + lane
                qf = _cast(frags[u], scale, self.out_dtype)
                if row_ok & (cv * VEC < K):
                    cute.autovec_copy(qf, gQ[(None, (row, cv))])


# ----------------------------------------------------------------------------------------------------
# compilation entry points (fake tensors: no GPU needed)
# ----------------------------------------------------------------------------------------------------


def _fake_2d(dtype, shape, *, row_major=True, align=16):
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(dtype, shape, stride_order=(1, 0) if row_major else (0, 1), assumed_align=align)


def _fakes_xq(in_dtype, out_dtype):
    M = cute.sym_int()
    K = cute.sym_int(divisibility=VEC)
    return _fake_2d(in_dtype, (M, K)), _fake_2d(out_dtype, (M, K))


def _compile(fn, *args):
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(fn, *args, make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


def compile_group(in_dtype, out_dtype, fmax, block=128, scale_mn_major=True):
    """1xblock groups. Call as f(x (M,K), q (M,K), s (M, ceil(K/block)), s) with s M-major or row-major."""
    k = TileQuant(in_dtype, out_dtype, fmax, MODE_GROUP, block)
    x, q = _fakes_xq(in_dtype, out_dtype)
    s = _fake_2d(Float32, (cute.sym_int(), cute.sym_int()), row_major=not scale_mn_major, align=4)
    return _compile(k.launch, x, q, s, s)


def compile_block(in_dtype, out_dtype, fmax, block=128):
    """blockxblock blocks. Call as f(x, q, s, s) with s row-major (ceil(M/block), L), L >= ceil(K/block)."""
    k = TileQuant(in_dtype, out_dtype, fmax, MODE_BLOCK, block)
    x, q = _fakes_xq(in_dtype, out_dtype)
    s = _fake_2d(Float32, (cute.sym_int(), cute.sym_int()), align=4)
    return _compile(k.launch, x, q, s, s)


def compile_tensor_amax(in_dtype):
    """Per-tensor pass 1. Call as f(x, part (G,)): grid = G CTAs, one partial max each."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    part = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    x, _ = _fakes_xq(in_dtype, cutlass.Float8E4M3FN)
    return _compile(TensorAmax(in_dtype).launch, x, part)


def compile_tensor_cast(in_dtype, out_dtype, fmax):
    """Per-tensor pass 2. Call as f(x, q, s (1,), part (G,))."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    part = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    s = make_fake_compact_tensor(Float32, (1,), assumed_align=4)
    x, q = _fakes_xq(in_dtype, out_dtype)
    return _compile(TileQuant(in_dtype, out_dtype, fmax, MODE_TENSOR_CAST).launch, x, q, s, part)


def compile_row(in_dtype, out_dtype, fmax):
    """Per-row. Call as f(x, q, s (M, 1) contiguous)."""
    x, q = _fakes_xq(in_dtype, out_dtype)
    s = _fake_2d(Float32, (cute.sym_int(), 1), align=4)
    return _compile(RowQuant(in_dtype, out_dtype, fmax).launch, x, q, s)

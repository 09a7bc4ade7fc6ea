"""FP8 (E4M3 / E5M2) and INT8 quantization kernels: per-tensor, per-row, 1x128 groups and BxB blocks.

Plain CUDA-core code (no tensor cores, no TMA), so it compiles for sm_90a and sm_100a alike. The numerics
are the contract of ``cutedsl_gemm/numerics/reference.py`` bit for bit: amax over finite |x|, fp32 IEEE
``scale = amax / fmax`` (1 for an all-zero group), ``q = cvt.rn.satfinite(RN(x / scale))`` with the
correctly rounded fp32 quotient. An Int8 target (fmax 127) takes the same scale and quotient and rounds it to
an integer instead (``_to_int8``): ``q = RNE(clamp(RN(x / scale), -127, 127))``, NaN -> 0, +-inf -> +-127.

Division
--------
fp32 input divides with ``div.rn.f32`` per element. bf16/fp16 input (the bandwidth-critical case) computes
one IEEE reciprocal ``r = RN(1/scale)`` per group and per element

    q0 = RN(x * r);  q0 = copysign(min(|q0|, 2^20), q0);  n = RN(q0 * scale - x);  q = RN(q0 - n * r)

(4 instructions instead of ~10 with a slow-path branch). ``n`` is exact (the FMA remainder of a
near-correct quotient) and one correction step then gives the correctly rounded quotient for every pair
of bf16/fp16 significands: ``tests/test_quantize_fp8.py`` checks all of them exhaustively (the result only
depends on the two significands while everything stays in the normal range). The range conditions are
guaranteed by using this path only for groups with ``scale >= 2^-64`` (others take ``div.rn``): then
``1/scale`` is normal and every quotient that can round to a non-zero FP8 value (|q| >= 2^-20) has an
exact remainder. The clamp to 2^20 (above any finite |x / scale|) makes +-inf give +-inf instead of
inf - inf = NaN; NaN stays NaN through ``n``; computing ``-n`` rather than ``x - q0 * scale`` keeps -0.

Thread/block mapping
--------------------
Every thread works on *vectors* of 16 consecutive elements of one row: two 16-byte loads for bf16/fp16
(four for fp32) and exactly one 16-byte store of 16 FP8 bytes. ``K % 16 == 0`` is therefore required.

A CTA of ``T`` threads owns a tile of ``BR x BC`` elements: ``TPR`` neighbouring lanes cover ``TPR * 16``
columns of one row (fully coalesced), ``RPP = T / TPR`` rows per pass, ``PR`` row passes and ``PC``
column passes, i.e. ``P = PR * PC`` vectors per thread. All P loads are issued before any arithmetic and
are *unconditional*: an out-of-range vector re-reads the nearest in-range vector of its own row/column
(row M-1, last vector of the row), which lies in the same scale group and so cannot change its maximum;
only the stores are predicated. (A load under a branch would make the warp wait for it before it could
issue the next one: one vector in flight instead of P.)

* 1x128 groups: TPR = 8, PC = 1; a group's amax is a 3-step butterfly shuffle over its 8 lanes.
  The Hopper GEMM that quantizes its own activations (``activation_quant.py``) runs the same group code
  (``group_scale``, ``emit_quantized``), so its FP8 activations and scales are these bits.
* BxB blocks (also per-row, as 1 x 2^n blocks for K <= 65536): the CTA owns one block; thread max -> warp
  butterfly -> one float per warp in shared memory -> butterfly over those. The block stays in registers
  (``hold``) unless that would need too many registers (fp32 256x256, fp32 rows > 32768); then it is read
  twice, the second time from L2.
* Per-tensor: the amax kernel (a fixed grid of CTAs striding over 128x128 tiles, one partial maximum per
  CTA: no atomics, deterministic) then the cast kernel, which folds the partials in every CTA and visits
  the tiles in reverse order so that its first reads find the amax kernel's last tiles still in L2.
* Per-row for K > 65536: one warp per row, amax pass then cast pass (L2 re-read).

Scale layouts are the caller's: the kernels index a 2-D cute tensor with whatever (compact) strides it
was compiled for (M-major (1, M) or row-major), and for the cuBLAS layout of BxB scales whose K-block
dimension is padded to a multiple of 4, the CTA of the last K block also writes 1.0 into the padding
(those are empty groups, which get scale 1 by the contract).
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

VEC = 16  # elements per thread vector: 16 FP8 bytes out = one 16-byte store
FAST_MIN_SCALE = 2.0**-64  # reciprocal path only at or above this scale (see the module docstring)
_CLAMP = "0f49800000"  # 2^20 as a PTX f32 immediate: above any finite |x / scale| (<= 57344 * (1 + 2^-23))

# Four instructions per element. ptxas folds the two neg.f32 into FFMA operand modifiers.
_DIV_FMA_PTX = (
    "{ .reg .f32 q, n;\n"
    " mul.rn.f32 q, {$r0}, {$r2};\n"
    f" min.xorsign.abs.f32 q, q, {_CLAMP};\n"
    " neg.f32 n, {$r0};\n"
    " fma.rn.f32 n, q, {$r1}, n;\n"
    " neg.f32 n, n;\n"
    " fma.rn.f32 {$w0}, n, {$r2}, q;\n"
    "}"
)


# ----------------------------------------------------------------------------------------------------
# device helpers (traced inline)
# ----------------------------------------------------------------------------------------------------


def finite_amax(frag, acc):
    """acc = max(acc, |x|) over the finite elements of a register vector (fp32 accumulator).

    ``a + (a - a)`` is ``a`` for finite a and NaN for +-inf/NaN; ``max`` returns its non-NaN operand,
    so non-finite inputs drop out of the maximum without a branch. 16-bit inputs do this on packed pairs
    (``max.bf16x2`` / ``max.f16x2``: exact, subnormals kept, 2 instructions per element instead of 4, and
    no fp32 copies of the data to keep live until the cast).
    """
    if cutlass.const_expr(frag.element_type.width == 16):
        kind = "bf16x2" if frag.element_type is cutlass.BFloat16 else "f16x2"
        words = cute.recast_tensor(frag, Int32).load()
        fin = ("{ .reg .b32 a, t;\n and.b32 a, {$r0}, 0x7FFF7FFF;\n"
               f" sub.rn.{kind} t, a, a;\n add.rn.{kind} t, a, t;\n")
        # (word 0 starts the accumulator: a constant 0 operand would become an immediate, which max.bf16x2 rejects)
        acc2 = cute.arch.inline_ptx(fin + " mov.b32 {$w0}, t;\n}", write_only_types=[Int32], read_only_args=[words[0]])
        for i in range(1, cute.size(frag) // 2):  # plain Python loop: helpers are traced, not preprocessed
            acc2 = cute.arch.inline_ptx(fin + f" max.{kind} {{$w0}}, {{$r1}}, t;\n}}",
                                        write_only_types=[Int32], read_only_args=[words[i], acc2])
        if cutlass.const_expr(kind == "bf16x2"):
            unpack = ("{ .reg .b32 lo, hi;\n .reg .f32 flo, fhi;\n shl.b32 lo, {$r0}, 16;\n"
                      " and.b32 hi, {$r0}, 0xFFFF0000;\n mov.b32 flo, lo;\n mov.b32 fhi, hi;\n"
                      " max.f32 {$w0}, flo, fhi;\n}")
        else:
            unpack = ("{ .reg .b16 lo, hi;\n .reg .f32 flo, fhi;\n mov.b32 {lo, hi}, {$r0};\n"
                      " cvt.f32.f16 flo, lo;\n cvt.f32.f16 fhi, hi;\n max.f32 {$w0}, flo, fhi;\n}")
        return cute.arch.fmax(acc, cute.arch.inline_ptx(unpack, write_only_types=[Float32], read_only_args=[acc2]))
    v = frag.load().to(Float32)
    for i in range(cute.size(frag)):
        a = abs(v[i])
        acc = cute.arch.fmax(acc, a + (a - a))
    return acc


def lane_allreduce_max(val, lanes: int):
    """Butterfly max over aligned groups of ``lanes`` lanes (a power of two <= 32)."""
    off = lanes // 2
    while off >= 1:
        val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=off))
        off //= 2
    return val


def scale_of(amax, fmax: float):
    # The reference: where(amax > 0, amax / fmax, 1), fp32 IEEE division.
    s = amax / Float32(fmax)
    return cutlass.select_(amax > Float32(0.0), s, Float32(1.0))


def reciprocal(scale):
    return Float32(1.0) / scale  # div.rn.f32: the correctly rounded reciprocal, once per group


INT8_MAX = 127  # symmetric int8 range [-127, 127] (numerics.formats.INT8.max_finite; tests check they agree)


def _f32_imm(v: float) -> str:
    """A PTX f32 immediate (0fXXXXXXXX)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


# fp32 -> integer in [-127, 127]: clamp (max/min return the non-NaN operand, so NaN is selected to 0 after), then
# cvt.rni (round to nearest even) of a value that is already in range. Nothing relies on cvt's own NaN or
# out-of-range rules.
_TO_INT8_PTX = (
    "{ .reg .f32 c;\n .reg .pred nan;\n"
    f" max.f32 c, {{$r0}}, {_f32_imm(-INT8_MAX)};\n"
    f" min.f32 c, c, {_f32_imm(INT8_MAX)};\n"
    " testp.notanumber.f32 nan, {$r0};\n"
    " selp.f32 c, 0f00000000, c, nan;\n"
    " cvt.rni.s32.f32 {$w0}, c;\n"
    "}"
)


def _to_int8(y, n: int):
    """Int8 codes of an fp32 vector of ``n`` quotients (see _TO_INT8_PTX)."""
    q = cute.make_rmem_tensor((n,), Int32)
    for i in range(n):
        q[i] = cute.arch.inline_ptx(_TO_INT8_PTX, write_only_types=[Int32], read_only_args=[y[i]])
    return q.load().to(cutlass.Int8)


def _narrow(y, out_dtype, n: int = VEC):
    """The quantized vector of ``n`` fp32 quotients ``y``, in ``out_dtype``."""
    qf = cute.make_rmem_tensor((1, n), out_dtype)
    if out_dtype is cutlass.Int8:
        qf.store(_to_int8(y, n))
    else:
        qf.store(y.to(out_dtype))  # cvt.rn.satfinite.{e4m3,e5m2}x2.f32: +-inf/overflow -> +-max, NaN -> NaN
    return qf


def _cast_div(frag, scale, out_dtype):
    return _narrow(frag.load().to(Float32) / scale, out_dtype, cute.size(frag))  # div.rn.f32 per element


def _cast_fma(frag, scale, rcp, out_dtype):
    n = cute.size(frag)
    v = frag.load().to(Float32)
    y = cute.make_rmem_tensor((n,), Float32)
    for i in range(n):
        y[i] = cute.arch.inline_ptx(_DIV_FMA_PTX, write_only_types=[Float32], read_only_args=[v[i], scale, rcp])
    return _narrow(y.load(), out_dtype, n)


def group_scale(frag, lanes: int, fmax: float):
    """(scale, its reciprocal, whether the reciprocal path applies) of one 1 x (lanes * n) group whose n-element
    vectors ``lanes`` aligned neighbouring lanes hold, one each (``frag`` is this lane's): the contract's scale."""
    amax = lane_allreduce_max(finite_amax(frag, Float32(0.0)), lanes)
    scale = scale_of(amax, fmax)
    return scale, reciprocal(scale), scale >= Float32(FAST_MIN_SCALE)


def emit_quantized(frag, scale, rcp, fast, dst, ok, out_dtype, div: str):
    """Quantize one vector by ``scale`` and store it into ``dst`` where ``ok``: the reciprocal path (``div`` "fma",
    16-bit input) where ``fast``, ``div.rn`` otherwise (see the module docstring)."""
    def store(cast):
        return lambda: cutlass.if_generate(ok, lambda: cute.autovec_copy(cast(), dst))

    by_div = store(lambda: _cast_div(frag, scale, out_dtype))
    if div == "fma":
        cutlass.if_generate(fast, store(lambda: _cast_fma(frag, scale, rcp, out_dtype)), by_div)
    else:
        by_div()


def _block_allreduce_max(amax, red, tidx, nw: int):
    """CTA-wide max (every thread gets it): warp butterfly, one float per warp in smem, butterfly again."""
    amax = lane_allreduce_max(amax, 32)
    if nw == 1:
        return amax
    lane = tidx % 32
    cutlass.if_generate(lane == 0, lambda: red.__setitem__(tidx // 32, amax))
    cute.arch.barrier()
    return lane_allreduce_max(red[lane % nw], nw)


# ----------------------------------------------------------------------------------------------------
# tile kernel: 1xB groups, BxB blocks (and 1xK rows), per-tensor cast
# ----------------------------------------------------------------------------------------------------

MODE_GROUP = "group"  # 1 x 128 groups
MODE_BLOCK = "block"  # BR x BC blocks, one per CTA
MODE_TENSOR_CAST = "tensor_cast"  # scale from the amax kernel's partials


def default_threads(mode: str, in_width: int, block_rows: int, block_cols: int) -> int:
    """Threads per CTA: 128 bytes of input per thread for a block (64 x 16-bit or 32 x fp32), else 256."""
    elems = block_rows * block_cols
    if mode == MODE_BLOCK:
        per_thread = 64 if in_width <= 16 else 32
        # (fp32 256x256 re-reads the block from L2; 1024 threads measured faster than 512 there)
        return max(32, min(1024, elems // per_thread))
    return 256


def launch_dependents():
    """Let the next kernel launch now if it launches early (PDL, the GEMMs of swapped tiles): it waits for this
    one to finish before reading what it writes, and meanwhile prefetches its weights (a no-op otherwise)."""
    cute.arch.griddepcontrol_launch_dependents()


class TileQuant:
    """Compile-time configuration of the tile kernel (see the module docstring).

    ``block_rows x block_cols``: the scale block for MODE_BLOCK (128x128, 256x256, or 1xBC for rows); for
    the group and tensor-cast modes ``block_rows`` is the CTA's tile height (128 columns wide).
    ``threads``: CTA size. ``hold``: keep the tile in registers (None: when it fits). ``div``: "fma"
    (reciprocal + correction, bf16/fp16 only; the default there) or "ieee" (div.rn per element).
    ``reverse``: tensor-cast tile order (see the module docstring).
    """

    def __init__(self, in_dtype, out_dtype, fmax: float, mode: str, *, block_rows=128, block_cols=128,
                 threads=None, hold=None, div=None, reverse=True):
        self.in_dtype, self.out_dtype, self.fmax, self.mode = in_dtype, out_dtype, float(fmax), mode
        if mode not in (MODE_GROUP, MODE_BLOCK, MODE_TENSOR_CAST):
            raise ValueError(f"unknown mode {mode!r}")
        if mode != MODE_BLOCK:
            block_cols = 128
        self.BR, self.BC = int(block_rows), int(block_cols)
        self.T = int(threads or default_threads(mode, in_dtype.width, self.BR, self.BC))
        nvec_row = self.BC // VEC
        if self.BC % VEC or self.T % 32 or self.T > 1024:
            raise ValueError(f"bad tile {self.BR}x{self.BC} with {self.T} threads")
        if mode == MODE_GROUP:
            self.TPR = 8  # one 128-wide group = 8 lanes x 16
        else:
            self.TPR = min(nvec_row, self.T)
        self.PC = nvec_row // self.TPR
        self.RPP = self.T // self.TPR
        self.PR = max(1, self.BR // self.RPP)
        if self.PC * self.TPR != nvec_row or self.PR * self.RPP != self.BR:
            raise ValueError(f"tile {self.BR}x{self.BC} does not split over {self.T} threads")
        self.P = self.PR * self.PC
        self.NW = self.T // 32
        width = in_dtype.width
        # Hold the tile in registers unless its raw data needs more than half of the registers a thread
        # can have at this CTA size (64 at most); otherwise read it twice.
        self.hold = (self.P * VEC * width // 32 <= min(64, 65536 // self.T // 2)) if hold is None else bool(hold)
        if mode != MODE_BLOCK and not self.hold:
            raise ValueError("only the block mode can re-read its tile")
        if div is None:
            div = "ieee" if width == 32 else "fma"
        if div not in ("fma", "ieee"):
            raise ValueError(f"div must be 'fma' or 'ieee', got {div!r}")
        if div == "fma" and width == 32:
            # The exhaustive proof of the correction step covers 8- and 11-bit significands only.
            raise ValueError("the reciprocal division is only verified for bf16/fp16 input")
        self.div = div
        self.reverse = bool(reverse)
        self.batch = max(1, 32 // (VEC * width // 32))  # re-read mode: vectors in flight = 32 registers

    @cute.jit
    def launch(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mPart: cute.Tensor, stream):
        # row tiles on grid.x (up to 2^31 - 1), column tiles on grid.y (up to 65535)
        gr = (mX.shape[0] + self.BR - 1) // self.BR
        gc = (self._cols(mX) + self.BC - 1) // self.BC
        self.kernel(mX, mQ, mS, mPart).launch(grid=[gr, gc, 1], block=[self.T, 1, 1], stream=stream)

    def _vec_coords(self, p, rb, cb, tidx):
        pr, pc = p // self.PC, p % self.PC
        row = rb * self.BR + pr * self.RPP + tidx // self.TPR
        cv = cb * (self.BC // VEC) + pc * self.TPR + tidx % self.TPR
        return row, cv

    # --- what the tile quantizes: hooks (GatedTileQuant computes it from two vectors of its input) ---

    def _cols(self, mX):
        """K: the columns quantized (and of the codes ``mQ``) for input ``mX``."""
        return mX.shape[1]

    def _issue(self, gX, row, cv, nv, mPart):
        """Issue the loads of vector ``cv`` of row ``row`` (both in range); what they load."""
        f = cute.make_rmem_tensor((1, VEC), self.in_dtype)
        cute.autovec_copy(gX[(None, (row, cv))], f)
        return f

    def _value(self, raw):
        """The in_dtype vector to quantize from what ``_issue`` loaded (after every load of the tile is issued)."""
        return raw

    def _read_batch(self, srcs, first: int):
        """Issue the loads of vectors first .. first + batch - 1 (all in flight at once); their fragments."""
        batch = []
        for p in range(first, min(first + self.batch, self.P)):
            f = cute.make_rmem_tensor((1, VEC), self.in_dtype)
            cute.autovec_copy(srcs[p], f)
            batch.append(f)
        return batch

    def _emit(self, frag, scale, rcp, fast, dst, ok):
        emit_quantized(frag, scale, rcp, fast, dst, ok, self.out_dtype, self.div)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mPart: cute.Tensor):
        launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        rb, cb, _ = cute.arch.block_idx()
        gr, gc, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.mode == MODE_TENSOR_CAST and self.reverse):
            # CTAs start in launch order (x fastest); give them the amax kernel's row-major tile order
            # reversed, so that the first reads find its last tiles still in L2
            t = gr * gc - 1 - (rb + cb * gr)
            rb = t // gc
            cb = t % gc
        M = mX.shape[0]
        nv = self._cols(mX) // VEC
        gX = cute.zipped_divide(mX, (1, VEC))  # ((1, 16), (M, K / 16))
        gQ = cute.zipped_divide(mQ, (1, VEC))

        rows = []
        cvs = []
        oks = []
        srcs = []
        raws = []
        for p in cutlass.range_constexpr(self.P):
            row, cv = self._vec_coords(p, rb, cb, tidx)
            rows.append(row)
            cvs.append(cv)
            oks.append((row < M) & (cv < nv))
            # out of range: re-read the nearest in-range vector of the same group (see the docstring)
            in_row, in_cv = cutlass.select_(row < M, row, M - 1), cutlass.select_(cv < nv, cv, nv - 1)
            if cutlass.const_expr(self.hold):  # issue every load before any arithmetic
                raws.append(self._issue(gX, in_row, in_cv, nv, mPart))
            else:
                srcs.append(gX[(None, (in_row, in_cv))])
        frags = [self._value(raw) for raw in raws]

        if cutlass.const_expr(self.mode == MODE_GROUP):
            for p in cutlass.range_constexpr(self.P):
                scale, rcp, fast = group_scale(frags[p], self.TPR, self.fmax)
                self._emit(frags[p], scale, rcp, fast, gQ[(None, (rows[p], cvs[p]))], oks[p])
                if (tidx % self.TPR == 0) & (rows[p] < M):
                    mS[rows[p], cb] = scale
        else:
            red = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(max(self.NW, 1)), 4)
            amax = Float32(0.0)
            if cutlass.const_expr(self.mode == MODE_BLOCK):
                if cutlass.const_expr(self.hold):
                    for p in cutlass.range_constexpr(self.P):
                        amax = finite_amax(frags[p], amax)
                else:  # first read: a batch of loads in flight, reduce, next batch
                    for b in cutlass.range_constexpr(0, self.P, self.batch):
                        for f in self._read_batch(srcs, b):
                            amax = finite_amax(f, amax)
            else:
                # per-tensor: fold the amax kernel's per-CTA partial maxima
                for i in range(tidx, mPart.shape[0], self.T):
                    amax = cute.arch.fmax(amax, mPart[i])
            amax = _block_allreduce_max(amax, red, tidx, self.NW)
            scale = scale_of(amax, self.fmax)
            rcp = reciprocal(scale)
            fast = scale >= Float32(FAST_MIN_SCALE)
            if cutlass.const_expr(self.hold):
                for p in cutlass.range_constexpr(self.P):
                    self._emit(frags[p], scale, rcp, fast, gQ[(None, (rows[p], cvs[p]))], oks[p])
            else:  # second read (L2), same batches
                for b in cutlass.range_constexpr(0, self.P, self.batch):
                    batch = self._read_batch(srcs, b)
                    for j in cutlass.range_constexpr(len(batch)):
                        p = b + j
                        self._emit(batch[j], scale, rcp, fast, gQ[(None, (rows[p], cvs[p]))], oks[p])
            if cutlass.const_expr(self.mode == MODE_BLOCK):
                if tidx == 0:
                    mS[rb, cb] = scale
                # cuBLAS-padded layout: the last K block also fills the (empty) padding groups with 1.
                if (cb == gc - 1) & (tidx >= 1) & (tidx < 4):
                    if cb + tidx < mS.shape[1]:
                        mS[rb, cb + tidx] = Float32(1.0)
            else:
                if (tidx == 0) & (cb == 0) & (rb == 0):
                    mS[0] = scale


# ----------------------------------------------------------------------------------------------------
# gated activation: SiLU(gate) * up (times a per-row weight), quantized in the same pass
# ----------------------------------------------------------------------------------------------------

_LOG2E_NEG = _f32_imm(-1.4426950408889634)

# SiLU(g) = g / (1 + e^-g): e^-g = 2^(-g log2 e) by ex2.approx (2 ulp), the quotient by div.rn (IEEE) as torch's
# fp32 SiLU divides. g -> -inf: 2^+inf = inf, g / inf = -0; g -> +inf: g / 1; NaN stays NaN.
_SILU_PTX = (
    "{ .reg .f32 t;\n"
    f" mul.rn.f32 t, {{$r0}}, {_LOG2E_NEG};\n"
    " ex2.approx.f32 t, t;\n"
    " add.rn.f32 t, t, 0f3F800000;\n"
    " div.rn.f32 {$w0}, {$r0}, t;\n"
    "}"
)


class GatedTileQuant(TileQuant):
    """The tile kernel on the gated activation of a gate/up projection's output ``mX`` (M, 2K), gate columns first:
    it quantizes ``a = RN_in(SiLU(gate) * w * up)`` (M, K), each product in fp32 (``w``: the row's fp32 weight from
    ``mPart`` (M,) with ``weighted``, else none) rounded once to the input dtype -- the vector the plain kernel
    would read had ``a`` been stored -- so the codes and scales are the plain kernel's on ``a``: 1x128 groups
    (MODE_GROUP) or one 1 x K row (MODE_BLOCK, block_rows 1). Each vector is a gate and an up load (both issued
    before any arithmetic, as the plain kernel issues its one); the tile is held in registers."""

    def __init__(self, in_dtype, out_dtype, fmax: float, mode: str, *, weighted: bool, **kw):
        if mode == MODE_TENSOR_CAST or (mode == MODE_BLOCK and kw.get("block_rows", 128) != 1):
            raise ValueError("the gated quantizer takes 1x128 groups or rows (a 1 x K block)")
        super().__init__(in_dtype, out_dtype, fmax, mode, hold=True, **kw)
        self.weighted = bool(weighted)

    def _cols(self, mX):
        return mX.shape[1] // 2

    def _issue(self, gX, row, cv, nv, mPart):
        g = cute.make_rmem_tensor((1, VEC), self.in_dtype)
        u = cute.make_rmem_tensor((1, VEC), self.in_dtype)
        cute.autovec_copy(gX[(None, (row, cv))], g)
        cute.autovec_copy(gX[(None, (row, cv + nv))], u)
        return g, u, (mPart[row] if cutlass.const_expr(self.weighted) else Float32(1.0))

    def _value(self, raw):
        g, u, w = raw[0].load().to(Float32), raw[1].load().to(Float32), raw[2]
        y = cute.make_rmem_tensor((VEC,), Float32)
        for i in range(VEC):
            silu = cute.arch.inline_ptx(_SILU_PTX, write_only_types=[Float32], read_only_args=[g[i]])
            if cutlass.const_expr(self.weighted):
                silu = silu * w
            y[i] = silu * u[i]
        a = cute.make_rmem_tensor((1, VEC), self.in_dtype)
        a.store(y.load().to(self.in_dtype))
        return a


# ----------------------------------------------------------------------------------------------------
# per-tensor amax kernel (pass 1)
# ----------------------------------------------------------------------------------------------------


class TensorAmax:
    """Grid-stride partial amax over 128x128 tiles; one fp32 partial per CTA into mPart[blockIdx.x]."""

    def __init__(self, in_dtype, threads=256, loads=4):
        self.in_dtype = in_dtype
        self.T, self.TPR, self.B = threads, 128 // VEC, 128
        self.RPP = self.T // self.TPR
        self.P = self.B // self.RPP
        self.U = loads  # vectors in flight per thread per step
        self.NW = self.T // 32
        if self.P % self.U:
            raise ValueError(f"{self.P} vectors per tile do not split into steps of {self.U}")

    @cute.jit
    def launch(self, mX: cute.Tensor, mPart: cute.Tensor, stream):
        self.kernel(mX, mPart).launch(grid=[mPart.shape[0], 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPart: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        G = cute.arch.grid_dim()[0]
        M = mX.shape[0]
        nv = mX.shape[1] // VEC
        gX = cute.zipped_divide(mX, (1, VEC))
        ntx = (nv + self.TPR - 1) // self.TPR
        nsteps = ntx * ((M + self.B - 1) // self.B) * (self.P // self.U)
        tr = tidx // self.TPR
        amax = Float32(0.0)
        for t in range(bid, nsteps, G):  # a step = U row passes of one tile
            tile = t // (self.P // self.U)
            p0 = (t % (self.P // self.U)) * self.U
            cv = (tile % ntx) * self.TPR + tidx % self.TPR
            cv = cutlass.select_(cv < nv, cv, nv - 1)
            frags = []
            for u in cutlass.range_constexpr(self.U):  # issue all loads, then reduce
                row = (tile // ntx) * self.B + (p0 + u) * self.RPP + tr
                f = cute.make_rmem_tensor((1, VEC), self.in_dtype)
                # out of range: a duplicate of an in-range element, harmless for a maximum
                cute.autovec_copy(gX[(None, (cutlass.select_(row < M, row, M - 1), cv))], f)
                frags.append(f)
            for u in cutlass.range_constexpr(self.U):
                amax = finite_amax(frags[u], amax)
        red = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.NW), 4)
        amax = _block_allreduce_max(amax, red, tidx, self.NW)
        if tidx == 0:
            mPart[bid] = amax


# ----------------------------------------------------------------------------------------------------
# per-row kernel for long rows (two passes)
# ----------------------------------------------------------------------------------------------------


class RowQuant:
    """One warp per row; amax pass then cast pass over the row (second read from L2)."""

    U = 4  # vectors per lane per loop iteration (loads in flight)

    def __init__(self, in_dtype, out_dtype, fmax: float, div=None):
        self.in_dtype, self.out_dtype, self.fmax = in_dtype, out_dtype, float(fmax)
        self.T = 128
        self.RPC = self.T // 32  # rows per CTA
        self.div = ("ieee" if in_dtype.width == 32 else "fma") if div is None else div

    @cute.jit
    def launch(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        g = (mX.shape[0] + self.RPC - 1) // self.RPC
        self.kernel(mX, mQ, mS).launch(grid=[g, 1, 1], block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        M = mX.shape[0]
        nv = mX.shape[1] // VEC
        gX = cute.zipped_divide(mX, (1, VEC))
        gQ = cute.zipped_divide(mQ, (1, VEC))
        lane = tidx % 32
        row = bid * self.RPC + tidx // 32
        row_ok = row < M
        rowc = cutlass.select_(row_ok, row, M - 1)
        nsteps = (nv + 32 * self.U - 1) // (32 * self.U)

        amax = Float32(0.0)
        for j in range(nsteps):
            frags = []
            for u in cutlass.range_constexpr(self.U):
                cv = (j * self.U + u) * 32 + lane
                f = cute.make_rmem_tensor((1, VEC), self.in_dtype)
                cute.autovec_copy(gX[(None, (rowc, cutlass.select_(cv < nv, cv, nv - 1)))], f)
                frags.append(f)
            for u in cutlass.range_constexpr(self.U):
                amax = finite_amax(frags[u], amax)
        amax = lane_allreduce_max(amax, 32)
        scale = scale_of(amax, self.fmax)
        rcp = reciprocal(scale)
        fast = scale >= Float32(FAST_MIN_SCALE)
        if (lane == 0) & row_ok:
            mS[row, 0] = scale
        for j in range(nsteps):  # second read of the row: L2 hits
            frags = []
            for u in cutlass.range_constexpr(self.U):
                cv = (j * self.U + u) * 32 + lane
                f = cute.make_rmem_tensor((1, VEC), self.in_dtype)
                cute.autovec_copy(gX[(None, (rowc, cutlass.select_(cv < nv, cv, nv - 1)))], f)
                frags.append(f)
            for u in cutlass.range_constexpr(self.U):
                cv = (j * self.U + u) * 32 + lane
                ok = row_ok & (cv < nv)
                dst = gQ[(None, (row, cv))]
                if cutlass.const_expr(self.div == "fma"):
                    if fast:
                        if ok:
                            cute.autovec_copy(_cast_fma(frags[u], scale, rcp, self.out_dtype), dst)
                    else:
                        if ok:
                            cute.autovec_copy(_cast_div(frags[u], scale, self.out_dtype), dst)
                else:
                    if ok:
                        cute.autovec_copy(_cast_div(frags[u], scale, self.out_dtype), dst)


# ----------------------------------------------------------------------------------------------------
# compilation entry points (fake tensors: no GPU needed)
# ----------------------------------------------------------------------------------------------------

ROW_BLOCK_MAX_K = 65536  # per-row: K up to this is one 1xK block per CTA (above: the two-pass kernel)


def row_tile(K: int, in_width: int):
    """(threads, block_cols) of the 1 x block_cols block that covers a row of K elements, or None.

    64 bytes of input per thread up to 1024 threads, then more vectors per thread (held in registers while
    they fit, else read twice: see TileQuant.hold)."""
    per_thread = 32 if in_width <= 16 else 16
    for bc in (2048, 4096, 8192, 16384, 32768, 65536):
        if K <= bc:
            return min(1024, bc // per_thread), bc
    return None


def _fake_2d(dtype, shape, *, row_major=True, align=16):
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(dtype, shape, stride_order=(1, 0) if row_major else (0, 1), assumed_align=align)


def _fakes_xq(in_dtype, out_dtype):
    M = cute.sym_int()
    K = cute.sym_int(divisibility=VEC)
    return _fake_2d(in_dtype, (M, K)), _fake_2d(out_dtype, (M, K))


def _entry(fn, *args):
    """(entry, fake arguments) for ``cute.compile``, which the host runs (runtime.compile.compile_entry)."""
    from cutlass.cute.runtime import make_fake_stream

    return fn, (*args, make_fake_stream(use_tvm_ffi_env_stream=True))


def group_entry(in_dtype, out_dtype, fmax, block=128, scale_mn_major=True, **tune):
    """1xblock groups. Call as f(x (M,K), q (M,K), s (M, ceil(K/block)), s) with s M-major or row-major."""
    if block != 128:
        raise ValueError(f"group width must be 128, got {block}")
    tune.setdefault("block_rows", 128 if in_dtype.width <= 16 else 64)  # 4 (fp32: 2) vectors per thread
    k = TileQuant(in_dtype, out_dtype, fmax, MODE_GROUP, **tune)
    x, q = _fakes_xq(in_dtype, out_dtype)
    s = _fake_2d(Float32, (cute.sym_int(), cute.sym_int()), row_major=not scale_mn_major, align=4)
    return _entry(k.launch, x, q, s, s)


def block_entry(in_dtype, out_dtype, fmax, block=128, **tune):
    """blockxblock blocks. Call as f(x, q, s, s) with s row-major (ceil(M/block), L), L >= ceil(K/block)."""
    if block not in (128, 256):
        raise ValueError(f"block must be 128 or 256, got {block}")
    k = TileQuant(in_dtype, out_dtype, fmax, MODE_BLOCK, block_rows=block, block_cols=block, **tune)
    x, q = _fakes_xq(in_dtype, out_dtype)
    s = _fake_2d(Float32, (cute.sym_int(), cute.sym_int()), align=4)
    return _entry(k.launch, x, q, s, s)


def row_block_entry(in_dtype, out_dtype, fmax, block_cols, **tune):
    """Per-row for K <= block_cols: one 1 x block_cols block per CTA. Call as f(x, q, s (M, 1), s)."""
    k = TileQuant(in_dtype, out_dtype, fmax, MODE_BLOCK, block_rows=1, block_cols=block_cols, **tune)
    x, q = _fakes_xq(in_dtype, out_dtype)
    s = _fake_2d(Float32, (cute.sym_int(), 1), align=4)
    return _entry(k.launch, x, q, s, s)


def gated_entry(in_dtype, out_dtype, fmax, granularity: str, k: int, weighted: bool, **tune):
    """SiLU(gate) * (w *) up of an (M, 2K) input, quantized: ``granularity`` "1x128" (scales M-major (M, ceil(K/128)))
    or "row" (scales (M, 1); ``k`` picks the row block, ``row_tile``). Call as f(h (M, 2K), q (M, K), s, w (M,) fp32)
    (w is read only when ``weighted``; pass s otherwise)."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    if granularity == "1x128":
        tune.setdefault("block_rows", 64)  # two gated vectors per thread
        kern = GatedTileQuant(in_dtype, out_dtype, fmax, MODE_GROUP, weighted=weighted, **tune)
        s = _fake_2d(Float32, (cute.sym_int(), cute.sym_int()), row_major=False, align=4)
    elif granularity == "row":
        tile = row_tile(k, in_dtype.width)
        if tile is None:
            raise ValueError(f"the gated row quantizer takes K <= {ROW_BLOCK_MAX_K}, got {k}")
        kern = GatedTileQuant(in_dtype, out_dtype, fmax, MODE_BLOCK, weighted=weighted, block_rows=1,
                              block_cols=tile[1], threads=tile[0], **tune)
        s = _fake_2d(Float32, (cute.sym_int(), 1), align=4)
    else:
        raise ValueError(f"the gated quantizer takes granularity '1x128' or 'row', got {granularity!r}")
    M = cute.sym_int()
    h = _fake_2d(in_dtype, (M, cute.sym_int(divisibility=2 * VEC)))
    q = _fake_2d(out_dtype, (M, cute.sym_int(divisibility=VEC)))
    w = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    return _entry(kern.launch, h, q, s, w if weighted else s)


def tensor_amax_entry(in_dtype, **tune):
    """Per-tensor pass 1. Call as f(x, part (G,)): grid = G CTAs, one partial max each."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    part = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    x, _ = _fakes_xq(in_dtype, cutlass.Float8E4M3FN)
    return _entry(TensorAmax(in_dtype, **tune).launch, x, part)


def tensor_cast_entry(in_dtype, out_dtype, fmax, **tune):
    """Per-tensor pass 2. Call as f(x, q, s (1,), part (G,))."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    tune.setdefault("block_rows", 128 if in_dtype.width <= 16 else 64)
    part = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    s = make_fake_compact_tensor(Float32, (1,), assumed_align=4)
    x, q = _fakes_xq(in_dtype, out_dtype)
    return _entry(TileQuant(in_dtype, out_dtype, fmax, MODE_TENSOR_CAST, **tune).launch, x, q, s, part)


def row_entry(in_dtype, out_dtype, fmax, **tune):
    """Per-row, two passes (any K). Call as f(x, q, s (M, 1) contiguous)."""
    x, q = _fakes_xq(in_dtype, out_dtype)
    s = _fake_2d(Float32, (cute.sym_int(), 1), align=4)
    return _entry(RowQuant(in_dtype, out_dtype, fmax, **tune).launch, x, q, s)

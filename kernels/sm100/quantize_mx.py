"""CuTe DSL quantizers for the block-scaled GEMMs: MX (UE8M0 / 32) and NVFP4 (E4M3 / 16 + fp32 global).

``x`` (rows, K) in bf16 or fp32 -> packed elements (rows, K * bits / 8) uint8 and scale factors in the
SWIZZLE_32_4_4 blocked layout (padding rows to 128 and scale columns to 4, padding bytes zero), exactly
the layout ``tcgen05.mma ... .block_scale`` and ``F.scaled_mm`` read. The numerics are the contract of
``cutedsl_gemm.numerics.reference`` (OCP floor rule for UE8M0, NVIDIA's recipe for NVFP4); the element
encoder is the same integer algorithm as ``cutedsl_gemm.numerics.codecs.encode``, so kernel and torch
reference agree bit for bit. Only IEEE-rounded fp32 operations appear (``div.rn``, ``rcp.rn``,
``mul.rn``; no fast-math), and nothing in the kernels is specific to sm_100: they are compiled for
sm_100a with the GEMMs, and run as well on any CUDA GPU the DSL targets.

Device code only: the host (``cutedsl_gemm.ops.quantize``) passes every format fact in as plain numbers
(:class:`ElementCode`) and allocates, checks and caches.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
from cutlass import Float32, Int32, Uint8, Uint32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

THREADS = 128
_F32_MAX = 0x7F7FFFFF
_F32_INF = 0x7F800000


class ElementCode(NamedTuple):
    """What the encoder needs to know of a minifloat format, as plain numbers."""

    bits: int
    man_bits: int
    bias: int
    max_bits: int  # fp32 bit pattern of the largest finite value
    max_code: int  # code of the largest finite value
    emax: int  # exponent of the largest normal value (the MX scale rule)


class BlockRecipe(NamedTuple):
    """What the quantizer needs to know of a block-scaling recipe, as plain numbers."""

    name: str  # "mx" (power-of-two UE8M0 scales) or "nvfp4" (E4M3 scales and an fp32 global scale)
    block: int  # K elements per scale
    scale_nan: int  # scale code of a block holding a NaN
    scale: ElementCode | None = None  # nvfp4: the E4M3 scale's encoding
    global_denom: float = 0.0  # nvfp4: element max * scale max, the global scale's denominator


@dsl_user_op
def _f2u(x, *, loc=None, ip=None) -> Uint32:
    return Uint32(llvm.bitcast(Uint32.mlir_type, Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _u2f(x, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(Float32.mlir_type, Uint32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _sel(cond, a, b, ty=Uint32):
    return ty(cutlass.select_(cond, ty(a), ty(b)))


def _rne_shr(v: Uint32, sh) -> Uint32:
    """Round-to-nearest-even ``v >> sh`` (sh in [1, 31]); v < 2**31 so nothing overflows."""
    one = Uint32(1)
    return (v + ((one << (sh - one)) - one) + ((v >> sh) & one)) >> sh


def encode_element(bits: Uint32, fmt: ElementCode) -> Uint32:
    """fp32 bit pattern -> element code: RNE, saturating, sign kept, NaN -> 0 (= codecs.encode(nan="zero"))."""
    m, b = fmt.man_bits, fmt.bias
    max_bits = fmt.max_bits
    max_code = fmt.max_code
    sign = bits >> Uint32(31)
    a = bits & Uint32(0x7FFFFFFF)
    exp_field = a >> Uint32(23)
    # normal: round at the target mantissa width, the carry walks into the exponent (wraps for small
    # a, where the subnormal branch is selected instead)
    normal = _rne_shr(a, Uint32(23 - m)) - Uint32((127 - b) << m)
    mant = (a & Uint32(0x7FFFFF)) | _sel(exp_field > Uint32(0), 0x800000, 0)
    e = cutlass.max(exp_field, Uint32(1))
    sh = Int32(151 - b - m) - Int32(e)  # 23 + (1 - b - m) - (e - 127)
    sh = Uint32(cutlass.min(cutlass.max(sh, Int32(1)), Int32(31)))
    sub = _rne_shr(mant, sh)
    code = _sel(e >= Uint32(128 - b), normal, sub)
    code = _sel(a >= Uint32(max_bits), max_code, code)
    code = code | (sign << Uint32(fmt.bits - 1))
    return _sel(a > Uint32(_F32_INF), 0, code)


def _decode_e4m3(code: Uint32) -> Float32:
    ex = (code >> Uint32(3)) & Uint32(0xF)
    man = code & Uint32(7)
    normal = _u2f(((ex + Uint32(120)) << Uint32(23)) | (man << Uint32(20)))
    sub = Float32(Int32(man)) * Float32(2.0**-9)
    return Float32(cutlass.select_(ex > Uint32(0), normal, sub))


class BlockScaleQuantizer:
    """One kernel per (recipe, element format, input dtype, global-scale mode).

    ============  =======================  ====================================================================
    kernel        threads                  work
    ============  =======================  ====================================================================
    ``amax``      128 / CTA, 1 block each  NVFP4 without a given global scale: max finite ``|x|`` of a 16-element
                                           block, warp shuffle max, one ``atom.global.max.u32`` per warp on the
                                           fp32 bit pattern (non-negative floats order like unsigned ints)
    ``quantize``  128 / CTA, 1 block each  one scale block per thread over the *padded* scale grid
                                           (round_up(rows,128) x round_up(K/block,4)): vector-load 16/32
                                           elements, block amax + NaN flag, scale, encode, pack, vector-store
                                           the packed bytes; write the scale byte at its SWIZZLE_32_4_4
                                           offset (zero on padding). NVFP4: the global decode scale is read
                                           from device memory (given, or ``amax / 2688`` from the amax kernel,
                                           written back by thread 0): no host synchronisation.
    ============  =======================  ====================================================================

    No shared memory, no pipelines: the kernel is bound by DRAM traffic (2-4 bytes read and 0.5-1 byte
    written per element); consecutive threads own consecutive blocks of a row, so loads coalesce.
    """

    def __init__(self, recipe: BlockRecipe, element: ElementCode, in_dtype, compute_global: bool = False):
        if recipe.name not in ("mx", "nvfp4") or (recipe.name == "nvfp4" and recipe.scale is None):
            raise ValueError(f"recipe must be 'mx' or 'nvfp4' (with its scale encoding); got {recipe}")
        self.recipe = recipe.name
        self.block = recipe.block
        self.scale_nan = recipe.scale_nan
        self.scale_code = recipe.scale
        self.global_denom = recipe.global_denom
        self.fmt = element
        self.in_dtype = in_dtype
        self.compute_global = compute_global and recipe.name == "nvfp4"
        self.out_bytes = self.block * self.fmt.bits // 8

    # ------------------------------------------------------------------ device code

    @cute.jit
    def _load_block(self, mX: cute.Tensor, r, c):
        gX = cute.local_tile(mX, (1, self.block), (r, c))
        rX = cute.make_fragment_like(gX)
        cute.autovec_copy(gX, rX)
        return rX

    @cute.jit
    def _amax_nan(self, rX):
        amax = Uint32(0)
        nan = Uint32(0)
        for i in cutlass.range_constexpr(self.block):
            a = _f2u(Float32(rX[i])) & Uint32(0x7FFFFFFF)
            amax = cutlass.max(amax, _sel(a < Uint32(_F32_INF), a, 0))
            nan = nan | _sel(a > Uint32(_F32_INF), 1, 0)
        return amax, nan

    @cute.kernel
    def amax_kernel(self, mX: cute.Tensor, mAmax: cute.Tensor, n_blocks: Int32, kb: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gid = bidx * THREADS + tidx
        amax = Uint32(0)
        if gid < n_blocks:
            rX = self._load_block(mX, gid // kb, gid % kb)
            amax, _nan = self._amax_nan(rX)
        amax = cute.arch.warp_reduction_max(amax)
        if tidx % 32 == 0:
            cute.arch.atomic_max(mAmax.iterator.llvm_ptr, amax)

    @cute.kernel
    def quantize_kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mG: cute.Tensor,
                        mAmax: cute.Tensor, rows: Int32, kb: Int32, pkb: Int32, total: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gid = bidx * THREADS + tidx
        fmt = self.fmt
        g = Float32(1.0)
        if cutlass.const_expr(self.recipe == "nvfp4"):
            if cutlass.const_expr(self.compute_global):
                amax_t = _u2f(Uint32(mAmax[0]))
                g = amax_t / Float32(self.global_denom)
                g = Float32(cutlass.select_(g > Float32(0.0), g, Float32(1.0)))
                if gid == 0:
                    mG[0] = g
            else:
                g = Float32(mG[0])
        if gid < total:
            r = gid // pkb
            c = gid % pkb
            scode = Uint32(0)
            if r < rows and c < kb:
                rX = self._load_block(mX, r, c)
                amax, nan = self._amax_nan(rX)
                mul = Float32(0.0)
                if cutlass.const_expr(self.recipe == "mx"):
                    # OCP floor rule: code = biased_exp(amax) - emax, clamped; all-zero block -> 1.0
                    code = Int32(amax >> Uint32(23)) - Int32(fmt.emax)
                    code = cutlass.min(cutlass.max(code, Int32(0)), Int32(254))
                    code = Uint32(_sel(amax > Uint32(0), Uint32(code), 127))
                    mul = _u2f((Uint32(254) - code) << Uint32(23))  # 2**(127 - code), exact
                    scode = _sel(nan > Uint32(0), self.scale_nan, code)
                else:
                    sf = (_u2f(amax) / Float32(6.0)) / g
                    code = encode_element(_f2u(sf), self.scale_code)  # RNE + satfinite, as torch's cast
                    denom = _decode_e4m3(code) * g
                    inv = Float32(1.0) / denom
                    inv = Float32(cutlass.select_(denom > Float32(0.0), inv, Float32(0.0)))
                    mul = Float32(cutlass.min(inv, _u2f(Uint32(_F32_MAX))))
                    scode = _sel(nan > Uint32(0), self.scale_nan, code)
                # a NaN block keeps its NaN scale and all-zero codes (+0, whatever the input signs)
                keep = _sel(nan > Uint32(0), 0, 0xFFFFFFFF)
                codes = cute.make_rmem_tensor((self.block,), Uint32)
                for i in cutlass.range_constexpr(self.block):
                    codes[i] = encode_element(_f2u(Float32(rX[i]) * mul), fmt) & keep
                gQ = cute.local_tile(mQ, (1, self.out_bytes), (r, c))
                rQ = cute.make_fragment_like(gQ)
                self._pack(codes, rQ)
                cute.autovec_copy(rQ, gQ)
            # SWIZZLE_32_4_4 offset of scale (r, c); padding entries get a zero byte
            off = ((r // 128) * (pkb // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            mS[off] = Uint8(scode)

    @cute.jit
    def _pack(self, codes, rQ):
        bits = self.fmt.bits
        if cutlass.const_expr(bits == 8):
            for i in cutlass.range_constexpr(self.block):
                rQ[i] = Uint8(codes[i])
        elif cutlass.const_expr(bits == 4):
            for j in cutlass.range_constexpr(self.block // 2):
                rQ[j] = Uint8(codes[2 * j] | (codes[2 * j + 1] << Uint32(4)))
        else:  # 6-bit little-endian stream: 4 codes -> 3 bytes
            for j in cutlass.range_constexpr(self.block // 4):
                w = (codes[4 * j] | (codes[4 * j + 1] << Uint32(6)) | (codes[4 * j + 2] << Uint32(12))
                     | (codes[4 * j + 3] << Uint32(18)))
                rQ[3 * j] = Uint8(w & Uint32(0xFF))
                rQ[3 * j + 1] = Uint8((w >> Uint32(8)) & Uint32(0xFF))
                rQ[3 * j + 2] = Uint8((w >> Uint32(16)) & Uint32(0xFF))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, mG: cute.Tensor,
                 mAmax: cute.Tensor, stream):
        rows = mX.shape[0]
        kb = mX.shape[1] // self.block
        prows = (rows + 127) // 128 * 128
        pkb = (kb + 3) // 4 * 4
        total = prows * pkb
        if cutlass.const_expr(self.compute_global):
            n_blocks = rows * kb
            self.amax_kernel(mX, mAmax, n_blocks, kb).launch(
                grid=[(n_blocks + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)
        self.quantize_kernel(mX, mQ, mS, mG, mAmax, rows, kb, pkb, total).launch(
            grid=[(total + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)


# ---------------------------------------------------------------------- compilation


def block_scale_entry(recipe: BlockRecipe, element: ElementCode, in_dtype, compute_global: bool = False):
    """(entry, fake dynamic-shape arguments) of the quantizer for ``cute.compile``, which the host runs
    (runtime.compile.compile_entry).

    ``in_dtype`` is ``cutlass.BFloat16`` or ``cutlass.Float32``. The compiled function's call signature:
    ``fn(x, q_bytes, scale_bytes, global_scale, amax_scratch)`` on the current stream.
    """
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    q = BlockScaleQuantizer(recipe, element, in_dtype, compute_global)
    rows = cute.sym_int()
    k = cute.sym_int(divisibility=q.block)
    qcols = cute.sym_int(divisibility=q.out_bytes)
    fx = make_fake_compact_tensor(q.in_dtype, (rows, k), stride_order=(1, 0), assumed_align=16)
    fq = make_fake_compact_tensor(Uint8, (rows, qcols), stride_order=(1, 0), assumed_align=16)
    fs = make_fake_compact_tensor(Uint8, (cute.sym_int(),), assumed_align=16)
    fg = make_fake_compact_tensor(Float32, (1,), assumed_align=4)
    fa = make_fake_compact_tensor(Int32, (1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return q, (fx, fq, fs, fg, fa, stream)

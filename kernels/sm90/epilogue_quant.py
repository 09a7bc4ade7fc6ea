"""An FP8 output in 1x128 groups from the Hopper GEMM's epilogue (``Sm90GemmConfig.d_quant``): the GEMM emits the
next layer's activations as e4m3 with one fp32 scale per 128 columns of a row -- what ``quantize_fp8(y, "1x128")``
returns for the bf16 output y -- instead of y, so a prefill layer needs no quantizer launch and no bf16 round trip.

A tile 128 columns wide (or a multiple) holds whole groups. The epilogue computes the tile as for a bf16 output
(scales, bias, rounding to bf16, ``stmatrix`` into shared memory) one 128-column slice at a time, and instead of the
TMA store its threads read the slice back, 8 lanes a row (16 elements a lane: one group), and quantize it with the
group quantizer's own code (``quantize_fp8.group_scale`` / ``emit_quantized``: amax over the 8 lanes by shuffles,
the fp32 scale, the reciprocal division, ``cvt.rn.satfinite.e4m3x2.f32``). Each lane stores its 16 FP8 bytes
straight to global memory (8 lanes: a row's 128 contiguous bytes) and the group's first lane its scale; rows and
columns past the output's edge are skipped. The slice's one shared-memory buffer is written after the epilogue's
threads finish reading the one before and read after all of them wrote it (two named-barrier waits per slice).

Bit for bit: the bf16 values staged are the ones the TMA store would have written (the same fragment, conversion
and copy), and the quantizer's code turns them into ``quantize_fp8``'s bits, so on the same tile and K splits the
output is ``quantize_fp8(scaled_mm(..., out_dtype=torch.bfloat16), "1x128")``'s.

``FP8OutputEpilogue`` is the epilogue role (``epilogue_roles.py``) that ``Sm90Fp8Gemm`` binds for ``d_quant``: the
kernel's entry ``Sm90Fp8Gemm.call_fp8_out`` takes the FP8 output and its scales in the output's place, and the role's
``store_slice`` hook quantizes each staged slice where ``TmaStoreEpilogue`` issues its TMA store.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .activation_quant import E4M3_MAX
from .block_scales import SCALE_BLOCK
from .epilogue_roles import TmaStoreEpilogue
from .quantize_fp8 import VEC, emit_quantized, group_scale

LANES_PER_GROUP = SCALE_BLOCK // VEC  # 8 lanes x 16 elements: one 1x128 group of a row


class FP8OutputEpilogue(TmaStoreEpilogue):
    """The FP8-output epilogue role of ``Sm90Fp8Gemm`` (the module docstring): ``TmaStoreEpilogue`` up to the bf16
    slice, which its threads then quantize and store themselves (no TMA store, one slice buffer)."""

    def make_store(self, mD, d_smem):
        return None, mD  # stored by the epilogue's threads: no TMA store

    def prefetch(self, tma_d):
        pass

    def slice_targets(self, tma_d, sD, gD_tile):
        return None

    @cute.jit
    def store_slice(self, tiled_copy_r2s, rD, tRS_sD, sD, s: cutlass.Constexpr, slices: cutlass.Constexpr, first,
                    targets, tma_d, store_pipe, epi_barrier, warp_idx, mQ, mQScales, tm, tn):
        """Stage slice ``s`` of tile (tm, tn) (``rD``: this thread's bf16 values of it) in the one buffer, read it back
        and store it quantized into ``mQ`` and ``mQScales``."""
        if cutlass.const_expr(mQScales is None):
            raise TypeError("a kernel built with d_quant is entered through call_fp8_out")
        epi_barrier.arrive_and_wait()  # every thread has read the previous slice
        cute.copy(tiled_copy_r2s, rD, tRS_sD[(None, None, None, 0)])
        epi_barrier.arrive_and_wait()  # ... and written this one
        g = self.gemm
        bM, bN, _ = g.tile_shape_mnk
        tidx, _, _ = cute.arch.thread_idx()
        _quantize_groups(sD[(None, None, 0)], mQ, mQScales, tm * bM, tn * bN + s * SCALE_BLOCK,
                         tidx - g.num_threads_per_warp_group, g.num_mma_threads, bM)


@cute.jit
def _quantize_groups(sSlice, mQ, mQScales, row0, col0, thread, threads: cutlass.Constexpr, rows: cutlass.Constexpr):
    """Quantize a staged ``rows`` x 128 slice (bf16, the output's rows ``row0``.., columns ``col0``..) in 1x128
    groups into ``mQ`` and ``mQScales``, ``threads`` threads (this one: ``thread``) 8 lanes a row."""
    sV = cute.zipped_divide(sSlice, (1, VEC))  # ((1, 16), (rows, 8))
    gQ = cute.zipped_divide(mQ, (1, VEC))
    M, N = mQ.shape
    rows_per_pass = threads // LANES_PER_GROUP
    sub = thread // LANES_PER_GROUP
    v = thread % LANES_PER_GROUP
    frags = []
    for p in cutlass.range_constexpr(rows // rows_per_pass):  # every read before any arithmetic
        f = cute.make_rmem_tensor((1, VEC), sSlice.element_type)
        cute.autovec_copy(sV[(None, (p * rows_per_pass + sub, v))], f)
        frags.append(f)
    for p in cutlass.range_constexpr(rows // rows_per_pass):
        row = row0 + p * rows_per_pass + sub
        # (a cluster's padding tiles lie past N; rows past M are the partial tile's)
        ok = (row < M) & (col0 < N)
        scale, rcp, fast = group_scale(frags[p], LANES_PER_GROUP, E4M3_MAX)
        emit_quantized(frags[p], scale, rcp, fast, gQ[(None, (row, col0 // VEC + v))], ok, mQ.element_type, "fma")
        if (v == 0) & ok:
            mQScales[row, col0 // SCALE_BLOCK] = scale

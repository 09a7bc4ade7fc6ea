"""Activation quantization inside the Hopper GEMM's decode schedule (``Sm90GemmConfig.a_input``): the GEMM takes the
activations in bf16 / fp16 and quantizes each K tile of its token tile to FP8 in 1x128 groups on the way into
shared memory, so a decode-sized linear layer is one kernel instead of ``quantize_fp8`` and ``scaled_mm``.

Swapped (D^T = W @ A^T), the tokens are the kernel's B operand: a stage's B tile is ``tile_n`` tokens x one
128-deep K block, exactly one 1x128 group per token. The TMA warp loads each stage's weight tile onto the stage's
full barrier and its unquantized token tile (row-major, zero-filled past M and K) onto a barrier of the stage's
own. Three warps of the producer warp group (``QUANT_WARPS``) take the stages in turn (stage ``i`` goes to warp
``i % 3``); a warp

1. waits for the stage's unquantized tile to land (the TMA warp issued it once the stage was empty, so the stage is
   free for the warp's writes too),
2. stores the K tile's weight scales into the stage's slots (copied by ``cp.async`` into a buffer of the warp's when
   it finished its previous stage: their latency passes while it waits; a load into registers there would be
   waited for at the walk's next branch),
3. per token (8 lanes a token, 16 elements a lane): reads the vectors from shared memory; amax over the 8 lanes,
   scale, quantize -- ``quantize_fp8.group_scale`` / ``emit_quantized``, the group quantizer's own code, so the
   FP8 values and scales are ``quantize_fp8(x, "1x128")``'s bits -- and stores each lane's 16 FP8 bytes into the
   swizzled B tile (one 16-byte store) and the token's scale into the stage's B slots; groups of tokens past M are
   skipped (their outputs are clipped),
4. fences its shared-memory writes for the async proxy (the consumers' WGMMAs read them through it) and arrives on
   the stage's full barrier with all 32 lanes (the barrier counts the TMA warp's one arrival and 32).

A stage's unquantized tile is reused only once the TMA warp finds the stage empty again, which the consumers signal
after the MMAs that read the warp's output: no barrier of its own is needed for that. The consumers see a
block-scaled stage as from ``block_scales.ScaleStaging``: nothing on their side changes. The output equals
``quantize_fp8(x, "1x128")`` followed by ``scaled_mm`` on the same tiles and splits bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .block_scales import SCALE_BLOCK, blocks_touched
from .quantize_fp8 import VEC, emit_quantized, group_scale

QUANT_WARPS = 3  # warps 1..3 of the producer warp group (warp 0 issues the TMA loads)
LANES_PER_TOKEN = SCALE_BLOCK // VEC  # 8 lanes x 16 elements: one 1x128 group
TOKENS_PER_PASS = 32 // LANES_PER_TOKEN
E4M3_MAX = 448.0  # the quantized activations' format (numerics.formats.E4M3.max_finite; a test checks they agree)
W_SCALE_SLOTS = 128  # per quantizing warp: a 128-row tile's per-row W scales (or its one or two block scales)


def w_prefetch_floats() -> int:
    """Shared memory (fp32 elements) of the quantizing warps' W-scale buffers."""
    return QUANT_WARPS * W_SCALE_SLOTS


def make_tag():
    """What a quantizing warp carries from one of its stages to the next: which (K tile, W tile) its W-scale
    buffer holds or is being copied (-1: none)."""
    tag = cute.make_rmem_tensor((2,), cutlass.Int32)
    tag.fill(-1)
    return tag


@dataclass(frozen=True)
class ActivationQuantStaging:
    """Warps 1..3's part of the producer walk (``Sm90Fp8Gemm._walk_producer_stages``) in a kernel that quantizes
    its activations (module docstring). Frozen: the DSL lets it into run-time loops without carrying it (the
    register it carries is an rmem tensor, stored to)."""

    mainloop: object
    x: cute.Tensor  # (M, K): the unquantized activations' extents (the kernel's TMA view of them)
    sX: cute.Tensor  # their stages in shared memory, (tile_n, 128, stages) row-major
    x_full: object  # the stages' barriers for them
    scales_w: cute.Tensor  # the weight's scales (rows or 128-row blocks, Kb)
    w_buf: cute.Tensor  # the quantizing warps' W-scale buffers, (W_SCALE_SLOTS, QUANT_WARPS)
    sB: cute.Tensor  # the B stages (tile_n, 128, stages), FP8, swizzled
    slots: tuple  # (W, token) scale slots of each stage
    w_gran: str  # the weight's scale granularity: "group" (per row) or "block" (per 128 rows)
    tile_mn: tuple  # (bM, bN)
    warp: object  # 0 .. QUANT_WARPS - 1
    lane: object
    tag: object  # make_tag
    k_tiles: object  # K tiles of the problem

    def unit_views(self, tm, tn):
        return None

    def fill_stage(self, views, tm, tn, kt, state):
        _fill_if_mine(self.mainloop, self.x, self.sX, self.x_full, self.scales_w, self.w_buf, self.sB, self.slots[0],
                      self.slots[1], self.w_gran, self.tile_mn, self.warp, self.lane, self.tag, self.k_tiles, tm, tn,
                      kt, state)


@cute.jit
def _fill_if_mine(mainloop, x, sX, x_full, scales_w, w_buf, sB, slots_w, slots_x, w_gran: cutlass.Constexpr,
                  tile_mn: cutlass.Constexpr, warp, lane, tag, k_tiles, tm, tn, kt, state):
    if state.count % QUANT_WARPS == warp:
        mine = w_buf[(None, warp)]
        # The buffer holds this stage's W scales unless it starts a unit (another tile or split).
        if (tag[0] != kt) | (tag[1] != tm):
            _copy_w_scales(scales_w, mine, w_gran, tile_mn[0], tm, kt, lane)
        # (a producer's state: its phase bit is the empty barriers'; this barrier fills, so the other one)
        cute.arch.mbarrier_wait(x_full + state.index, state.phase ^ 1)
        cute.arch.cp_async_wait_group(0)
        _store_w_scales(mine, slots_w, w_gran, tile_mn[0], state.index, lane)
        _quantize_tile(x, sX, sB, slots_x, tile_mn[1], tn, state.index, lane)
        # Generic-proxy stores, read by the WGMMAs through the async proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(mainloop.producer_get_barrier(state))
        nxt = kt + QUANT_WARPS  # this warp's next stage, if the unit goes on that far
        if nxt < k_tiles:
            _copy_w_scales(scales_w, mine, w_gran, tile_mn[0], tm, nxt, lane)
            tag[0], tag[1] = nxt, tm
        else:
            tag[0] = -1


@cute.jit
def _copy_w_scales(scales_w, buf, gran: cutlass.Constexpr, extent: cutlass.Constexpr, tm, kt, lane):
    """``cp.async`` the W tile's scales of K block ``kt`` into the warp's buffer: a row per lane and 32 rows apart
    ("group"), or a lane's 128-row block ("block"). Rows past the edge re-read the last one (their slots reach no
    stored output)."""
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
    rows = scales_w.shape[0]
    if cutlass.const_expr(gran == "group"):
        for j in cutlass.range_constexpr(-(-extent // 32)):
            row = tm * extent + lane + j * 32
            _copy_one(atom, scales_w, (cutlass.select_(row < rows, row, rows - 1), kt), buf, lane + j * 32)
    else:
        blk = tm * extent // SCALE_BLOCK + cutlass.select_(lane < blocks_touched(extent), lane, 0)
        if lane < blocks_touched(extent):
            _copy_one(atom, scales_w, (cutlass.select_(blk < rows, blk, rows - 1), kt), buf, lane)
    cute.arch.cp_async_commit_group()


@cute.jit
def _copy_one(atom, src: cute.Tensor, src_coord, dst: cute.Tensor, dst_index):
    cute.copy(atom, cute.make_tensor(src.iterator + cute.crd2idx(src_coord, src.layout), cute.make_layout(1)),
              cute.make_tensor(dst.iterator + cute.crd2idx(dst_index, dst.layout), cute.make_layout(1)))


@cute.jit
def _store_w_scales(buf, slots, gran: cutlass.Constexpr, extent: cutlass.Constexpr, stage, lane):
    """The W tile's scales of the stage's K block from the warp's buffer into the stage's slots: one per row
    ("group"), or one per 128-row block the tile touches ("block")."""
    if cutlass.const_expr(gran == "group"):
        for j in cutlass.range_constexpr(-(-extent // 32)):
            if lane + j * 32 < extent:
                slots[(lane + j * 32, stage)] = buf[lane + j * 32]
    else:
        if lane < blocks_touched(extent):
            slots[(lane, stage)] = buf[lane]


@cute.jit
def _quantize_tile(x, sX, sB, slots_x, tile_n: cutlass.Constexpr, tn, stage, lane):
    """Quantize the stage's unquantized token tile (zero past M and K) into its B tile and token scale slots."""
    fp8 = sB.element_type
    sXv = cute.zipped_divide(sX[(None, None, stage)], (1, VEC))  # ((1, 16), (tile_n, 8))
    sV = cute.zipped_divide(sB[(None, None, stage)], (1, VEC))
    sub = lane // LANES_PER_TOKEN
    v = lane % LANES_PER_TOKEN
    tokens_left = x.shape[0] - tn * tile_n
    passes = tile_n // TOKENS_PER_PASS
    frags = []
    for p in cutlass.range_constexpr(passes):  # every read before any arithmetic
        f = cute.make_rmem_tensor((1, VEC), sX.element_type)
        cute.autovec_copy(sXv[(None, (p * TOKENS_PER_PASS + sub, v))], f)
        frags.append(f)
    for p in cutlass.range_constexpr(passes):
        # Passes wholly past the last token are skipped (M = 1 quantizes one of a 16-wide tile's four): their B
        # columns and scales stay stale and only reach outputs past M, which the TMA store clips.
        if p * TOKENS_PER_PASS < tokens_left:
            r = p * TOKENS_PER_PASS + sub
            scale, rcp, fast = group_scale(frags[p], LANES_PER_TOKEN, E4M3_MAX)
            emit_quantized(frags[p], scale, rcp, fast, sV[(None, (r, v))], True, fp8, "fma")
            if v == 0:
                slots_x[(r, stage)] = scale

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

Per-token scales (recipe "row": FP8 per token x per channel, and int8 W8A8)
--------------------------------------------------------------------------
A token's scale is its amax over all of K, which the first K tile cannot show. So at the start of every work unit
whose token tile differs from the last one's (``RowScales``), the three warps read their tokens' rows once from
global memory (16-element vectors, L2-resident after the first CTA: every CTA reads the same rows), reduce the
finite amax per token (lanes by shuffles, warps through shared memory, between named-barrier syncs of the three
warps) and keep each token's scale and reciprocal in shared memory. Each stage then quantizes with them (step 3
without the group amax; no weight scales to stage: the epilogue applies the per-channel ones), so the codes are
``quantize_fp8(x, "row")`` / ``quantize_int8(x, "row")``'s. The epilogue needs the token scales too, after the
quantizing warps may have moved on to another token tile: warp 1 copies them, once per unit, into a ring of
``HANDOFF_UNITS`` buffers guarded by full / empty barriers, which the consumers wait for before scaling the unit's
tile and release after. The output equals the row quantizer followed by ``scaled_mm`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .block_scales import SCALE_BLOCK, blocks_touched
from .quantize_fp8 import (
    FAST_MIN_SCALE,
    INT8_MAX,
    VEC,
    emit_quantized,
    finite_amax,
    group_scale,
    lane_allreduce_max,
    reciprocal,
    scale_of,
)

QUANT_WARPS = 3  # warps 1..3 of the producer warp group (warp 0 issues the TMA loads)
LANES_PER_TOKEN = SCALE_BLOCK // VEC  # 8 lanes x 16 elements: one 1x128 group
E4M3_MAX = 448.0  # the quantized activations' format (numerics.formats.E4M3.max_finite; a test checks they agree)
W_SCALE_SLOTS = 128  # per quantizing warp: a 128-row tile's per-row W scales (or its one or two block scales)
HANDOFF_UNITS = 4  # per-token scales: work units the quantizing warps may run ahead of the epilogue
QUANT_BARRIER_ID = 2  # the named barrier of the quantizing warps (1 is the epilogue's)
ROW_LOADS = 4  # 16-element vectors per thread in flight in the token amax pass


def w_prefetch_floats() -> int:
    """Shared memory (fp32 elements) of the quantizing warps' W-scale buffers."""
    return QUANT_WARPS * W_SCALE_SLOTS


def row_scale_floats(tile_n: int) -> int:
    """Shared memory (fp32 elements) of a per-token kernel's scales: the warps' partial amaxes, each token's scale
    and reciprocal, and the epilogue's ring."""
    return tile_n * (QUANT_WARPS + 2 + HANDOFF_UNITS)


def activation_max(dtype) -> float:
    """The largest code of the quantized activations (the scale is amax over it)."""
    return float(INT8_MAX) if dtype is cutlass.Int8 else E4M3_MAX


def make_tag(per_token: bool = False):
    """What a quantizing warp carries from one of its stages to the next: which (K tile, W tile) its W-scale
    buffer holds or is being copied (-1: none); per token instead: the token tile whose scales it holds (-1: none)
    and how many units' scales it has handed to the epilogue."""
    tag = cute.make_rmem_tensor((2,), cutlass.Int32)
    tag.fill(-1)
    if cutlass.const_expr(per_token):
        tag[1] = 0
    return tag


@dataclass(frozen=True)
class RowScales:
    """The per-token scales of a kernel that quantizes per token (module docstring), in shared memory."""

    x: cute.Tensor  # (M, K): the activations in global memory (the amax pass reads them)
    partial: cute.Tensor  # (tile_n, QUANT_WARPS): each warp's amax of each token
    tok: cute.Tensor  # (tile_n, 2): each token's scale and its reciprocal
    ring: cute.Tensor  # (tile_n, HANDOFF_UNITS): the epilogue's copies, one per unit in flight
    full: object  # HANDOFF_UNITS barriers: warp 1's 32 lanes arrive once a ring slot holds a unit's scales
    empty: object  # HANDOFF_UNITS barriers: every consumer thread arrives once it has scaled the unit's tile
    sync: object  # the quantizing warps' named barrier


def make_row_scales(x, floats: cute.Tensor, barriers, tile_n: int, sync) -> RowScales:
    """``RowScales`` over the kernel's ``row_scale_floats`` buffer and its 2 * HANDOFF_UNITS barriers."""
    base = floats.iterator
    partial = cute.make_tensor(base, cute.make_layout((tile_n, QUANT_WARPS), stride=(1, tile_n)))
    tok = cute.make_tensor(base + tile_n * QUANT_WARPS, cute.make_layout((tile_n, 2), stride=(1, tile_n)))
    ring = cute.make_tensor(base + tile_n * (QUANT_WARPS + 2),
                            cute.make_layout((tile_n, HANDOFF_UNITS), stride=(1, tile_n)))
    return RowScales(x, partial, tok, ring, barriers, barriers + HANDOFF_UNITS, sync)


def init_row_scale_barriers(barriers, consumer_threads: int):
    """(One thread, before the pipelines' init fence.) The ring's full barriers count warp 1's lanes, the empty ones
    every consumer thread."""
    for i in range(HANDOFF_UNITS):  # (a plain helper, traced inline)
        cute.arch.mbarrier_init(barriers + i, 32)
        cute.arch.mbarrier_init(barriers + HANDOFF_UNITS + i, consumer_threads)


@cute.jit
def wait_token_scales(rows: RowScales, unit_count):
    """(Consumers, once per unit, in schedule order.) Wait until the unit's token scales are in the ring; returns
    the unit's slot there."""
    slot = unit_count % HANDOFF_UNITS
    cute.arch.mbarrier_wait(rows.full + slot, (unit_count // HANDOFF_UNITS) % 2)
    return slot


def release_token_scales(rows: RowScales, slot):
    """(Every consumer thread, after its last read of the unit's scales.)"""
    cute.arch.mbarrier_arrive(rows.empty + slot)


@dataclass(frozen=True)
class ActivationQuantStaging:
    """Warps 1..3's part of the producer walk (``producer_roles.TmaProducer.walk``) in a kernel that quantizes
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
    rows: object = None  # RowScales when the kernel quantizes per token (then scales_w, w_buf, slots are unused)

    def unit_views(self, tm, tn):
        if cutlass.const_expr(self.rows is not None):
            _start_row_unit(self.rows, self.tag, self.tile_mn[1], activation_max(self.sB.element_type), self.warp,
                            self.lane, tn)
        return None

    def prefetch_weights(self, tm, tn, k_begin, k_count):
        """(The TMA warp's part: ``TmaLoads.prefetch_weights``.)"""

    def fill_stage(self, views, tm, tn, kt, state):
        if cutlass.const_expr(self.rows is not None):
            _fill_rows_if_mine(self.mainloop, self.x, self.sX, self.x_full, self.sB, self.rows.tok, self.tile_mn[1],
                               self.warp, self.lane, tn, state)
        else:
            _fill_if_mine(self.mainloop, self.x, self.sX, self.x_full, self.scales_w, self.w_buf, self.sB,
                          self.slots[0], self.slots[1], self.w_gran, self.tile_mn, self.warp, self.lane,
                          self.tag, self.k_tiles, tm, tn, kt, state)


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
def _quantize_tile(x, sX, sB, slots_x, tile_n: cutlass.Constexpr, tn, stage, lane, tok=None):
    """Quantize the stage's unquantized token tile (zero past M and K) into its B tile, 8 lanes a token: each
    token's 1x128 group with the group's scale, stored into the stage's token scale slots ``slots_x``; or, per token
    (``tok``: each token's scale and reciprocal), with the token's scale (``slots_x`` unused)."""
    fp8 = sB.element_type
    lanes = LANES_PER_TOKEN
    width = SCALE_BLOCK // lanes  # elements a lane: 16
    per_pass = 32 // lanes  # tokens a pass of the warp
    sXv = cute.zipped_divide(sX[(None, None, stage)], (1, width))  # ((1, width), (tile_n, lanes))
    sV = cute.zipped_divide(sB[(None, None, stage)], (1, width))
    sub = lane // lanes
    v = lane % lanes
    tokens_left = x.shape[0] - tn * tile_n
    passes = tile_n // per_pass
    frags = []
    for p in cutlass.range_constexpr(passes):  # every read before any arithmetic
        f = cute.make_rmem_tensor((1, width), sX.element_type)
        cute.autovec_copy(sXv[(None, (p * per_pass + sub, v))], f)
        frags.append(f)
    for p in cutlass.range_constexpr(passes):
        # Passes wholly past the last token are skipped (M = 1 quantizes one of a 16-wide tile's four): their B
        # columns and scales stay stale and only reach outputs past M, which the TMA store clips.
        if p * per_pass < tokens_left:
            r = p * per_pass + sub
            if cutlass.const_expr(tok is None):
                scale, rcp, fast = group_scale(frags[p], lanes, E4M3_MAX)
                emit_quantized(frags[p], scale, rcp, fast, sV[(None, (r, v))], True, fp8, "fma")
                if v == 0:
                    slots_x[(r, stage)] = scale
            else:
                scale = tok[(r, 0)]
                emit_quantized(frags[p], scale, tok[(r, 1)], scale >= Float32(FAST_MIN_SCALE), sV[(None, (r, v))],
                               True, fp8, "fma")


# ---- per-token scales ----------------------------------------------------------------------------------------------
@cute.jit
def _start_row_unit(rows: RowScales, tag, tile_n: cutlass.Constexpr, fmax: cutlass.Constexpr, warp, lane, tn):
    """(All three quantizing warps, at every unit's start.) The token tile's scales, computed unless they are the
    previous unit's; then warp 1 hands them to the epilogue's ring."""
    if tag[0] != tn:
        rows.sync.arrive_and_wait()  # every warp is past its stages of the previous token tile
        _token_amax(rows.x, rows.partial, tile_n, tn, warp, lane)
        rows.sync.arrive_and_wait()
        t = warp * 32 + lane
        if t < tile_n:
            amax = rows.partial[(t, 0)]
            for w in cutlass.range_constexpr(1, QUANT_WARPS):
                amax = cute.arch.fmax(amax, rows.partial[(t, w)])
            scale = scale_of(amax, fmax)  # 1 for a token past M (amax 0)
            rows.tok[(t, 0)] = scale
            rows.tok[(t, 1)] = reciprocal(scale)
        rows.sync.arrive_and_wait()
        tag[0] = tn
    if warp == 0:
        n = tag[1]
        slot = n % HANDOFF_UNITS
        cute.arch.mbarrier_wait(rows.empty + slot, ((n // HANDOFF_UNITS) % 2) ^ 1)
        if lane < tile_n:
            rows.ring[(lane, slot)] = rows.tok[(lane, 0)]
        cute.arch.mbarrier_arrive(rows.full + slot)
        tag[1] = n + 1


@cute.jit
def _token_amax(x: cute.Tensor, partial: cute.Tensor, tile_n: cutlass.Constexpr, tn, warp, lane):
    """Each warp's finite amax of each token of tile ``tn`` over all of K (0 past M) into ``partial``: the three
    warps' 96 lanes read a row's 16-element vectors in turn, ``ROW_LOADS`` of them in flight per lane."""
    gX = cute.zipped_divide(x, (1, VEC))
    nv = x.shape[1] // VEC
    tokens = x.shape[0] - tn * tile_n
    t = warp * 32 + lane
    stride = QUANT_WARPS * 32
    steps = (nv + stride * ROW_LOADS - 1) // (stride * ROW_LOADS)
    for r in cutlass.range(tile_n, unroll=1):
        amax = Float32(0.0)
        if r < tokens:
            row = tn * tile_n + r
            for j in cutlass.range(steps, unroll=1):
                frags = []
                for u in cutlass.range_constexpr(ROW_LOADS):
                    cv = (j * ROW_LOADS + u) * stride + t
                    f = cute.make_rmem_tensor((1, VEC), x.element_type)
                    # (past the row's end: its last vector again, which leaves the maximum as it is)
                    cute.autovec_copy(gX[(None, (row, cutlass.select_(cv < nv, cv, nv - 1)))], f)
                    frags.append(f)
                for u in cutlass.range_constexpr(ROW_LOADS):
                    amax = finite_amax(frags[u], amax)
            amax = lane_allreduce_max(amax, 32)
        if lane == 0:
            partial[(r, warp)] = amax


@cute.jit
def _fill_rows_if_mine(mainloop, x, sX, x_full, sB, tok, tile_n: cutlass.Constexpr, warp, lane, tn, state):
    if state.count % QUANT_WARPS == warp:
        cute.arch.mbarrier_wait(x_full + state.index, state.phase ^ 1)
        _quantize_tile(x, sX, sB, None, tile_n, tn, state.index, lane, tok)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(mainloop.producer_get_barrier(state))


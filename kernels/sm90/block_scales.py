"""Block scales for the Hopper FP8 GEMM: which scale each operand carries per 128-deep K block, how the
producer stages them in shared memory, and how the consumers read them (into registers as soon as a stage
is full, ``read_stage_scales``, or -- in the 192-wide loops -- a K tile ahead or right after the K tile's
first half is issued, ``read_raw_scales``) and apply them when promoting a K tile or half of one
(``promote_block_scaled``).

Per 128-deep K block ``kb`` an operand carries either

* ``group``: one scale per row (A) or column (W) -- the 1x128 granularity (DeepSeek's activations), or
* ``block``: one scale per 128 rows/columns -- the 128x128 granularity (DeepSeek's weights, GridQuant).

The kernel sees the scales as 2-D fp32 tensors ``(rows, Kb)`` for ``group`` and ``(ceil(rows/128), Kb)``
for ``block``, with run-time strides, so torch's outer-dim-major / padded layouts and plain row-major ones
are all read in place.

Staging: the scales of one K tile ride in the same mainloop stage as its A/W tiles.

* On 64-row tiles (``Sm90Fp8Gemm.a_scale_tma`` says why not others), A's ``group`` scales in torch's M-major
  layout (rows contiguous, the K-block stride a multiple of 4, 16-byte aligned: ``a_scale_tma_view`` decides per
  call) come by TMA: the TMA warp loads the tile's rows of the K block as one more box on the stage's full
  barrier (``load_a_scale_box``), its bytes in the stage's transaction count; faster than the scale warp's
  copies on those tiles. The consumers read them with ordinary (generic-proxy) loads and the next refill writes
  them through the async proxy, so each consumer thread fences its reads before releasing the stage
  (``PromotedMainloops._release_stage``): without that fence the consumers read wrong A scales.
* Everything else is copied by the scale warp (warp 1 of the producer warp group), not the TMA warp, which
  keeps the TMA warp's path from a freed stage to its next TMA issue short: ``group`` scales that form one
  contiguous, 16-byte aligned run in 16-byte ``cp.async`` copies, four rows per lane; otherwise (other layouts,
  the last partial tile, and ``block`` scales, one or two per tile) 4-byte ``cp.async``. ``block`` scales stay
  with the scale warp because a TMA box's rows must be 16 bytes: a box starting at an arbitrary K block
  (4 bytes into a row) faults.
* Every scale-warp lane signals the stage's full barrier with ``cp.async.mbarrier.arrive.noinc`` once its
  copies land (it still copies W's scales when A's come by TMA) -- the barrier therefore expects 1 (the TMA
  warp's expect_tx) + 32 arrivals. (One ``cp.async.bulk`` per contiguous run, counted in the stage's
  transaction bytes, let consumers read stale A scales, likely for want of the proxy fence above.)
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning

from .scale_recipes import BLOCK_RECIPES, is_block_scaled  # noqa: F401  (the kernels import them from here)

SCALE_BLOCK = 128  # K (and, for "block", M/N) extent of one scale
ROWS_PER_VECTOR = 4  # fp32 scales per 16-byte cp.async
PRODUCER_LANES = 32  # lanes of the scale warp that arrive on the full barrier after their cp.async


@contextlib.contextmanager
def unrolled_fragment_loops():
    """The static loops traced inside run over a register fragment (up to 96 elements) and must unroll fully at
    trace time: only a constant index keeps an element in a register. The DSL's warning about static loops of 64
    or more iterations (a ``DSLOptimizationWarning``) is silenced there and nowhere else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This static loop has", category=DSLOptimizationWarning)
        yield


def scale_smem_bytes_per_stage(tile_m: int, tile_n: int) -> int:
    """One fp32 slot per tile row of A and per tile column of W (``block`` uses the first few: one per
    128-block the tile touches)."""
    return (tile_m + tile_n) * 4


def blocks_touched(tile_extent: int) -> int:
    """Most 128-blocks a tile of this extent can overlap: tiles start at multiples of the extent, so a
    tile starts at most 128 - gcd(extent, 128) into a block (a 192-wide tile overlaps two)."""
    worst_offset = SCALE_BLOCK - math.gcd(tile_extent, SCALE_BLOCK)
    return -(-(tile_extent + worst_offset) // SCALE_BLOCK)


@cute.jit
def stage_scales(
    scales: cute.Tensor,
    slots: cute.Tensor,
    granularity: cutlass.Constexpr,
    tile_extent: cutlass.Constexpr,
    tile: cutlass.Int32,
    kt: cutlass.Int32,
    stage,
    lane,
):
    """Producer side: copy one K tile's scales of one operand into its slots of a stage.

    ``scales`` is the operand's scale tensor (rows or row blocks, Kb); ``slots`` the (tile extent, stages)
    fp32 shared-memory tensor. Called by all 32 lanes of the scale warp, which then arrive on the stage's full
    barrier as their copies land.
    """
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
    if cutlass.const_expr(granularity == "group"):
        rows = scales.shape[0]
        row0 = tile * tile_extent
        src = scales.iterator.toint() + cute.crd2idx((row0, kt), scales.layout) * 4
        # A whole tile of row scales that is one contiguous, 16-byte aligned run (torch's M-contiguous
        # layout with M % 4 == 0) goes in 16-byte copies, far fewer instructions than per-row 4-byte ones.
        # Other layouts and the last, partial tile take the per-row copies.
        if (tile_extent % ROWS_PER_VECTOR == 0 and scales.layout.stride[0] == 1 and row0 + tile_extent <= rows
                and src % 16 == 0):
            vec = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)
            chunks = tile_extent // ROWS_PER_VECTOR
            dst0 = slots.iterator.toint() + cute.crd2idx((0, stage), slots.layout) * 4
            for j in cutlass.range_constexpr(-(-chunks // PRODUCER_LANES)):
                c = lane + j * PRODUCER_LANES
                if c < chunks:
                    r = c * ROWS_PER_VECTOR
                    cute.copy(
                        vec,
                        cute.make_tensor(cute.make_ptr(Float32, src + r * 4, cute.AddressSpace.gmem, assumed_align=16),
                                         cute.make_layout(ROWS_PER_VECTOR)),
                        cute.make_tensor(cute.make_ptr(Float32, dst0 + r * 4, cute.AddressSpace.smem, assumed_align=16),
                                         cute.make_layout(ROWS_PER_VECTOR)),
                    )
        else:
            for j in cutlass.range_constexpr(-(-tile_extent // PRODUCER_LANES)):
                r = lane + j * PRODUCER_LANES
                row = row0 + r
                # Rows past the edge are never stored (the TMA store clips them): leave their slots stale.
                # (A 16-wide tile uses 16 of the 32 lanes.)
                if row < rows and r < tile_extent:
                    _copy_one(atom, scales, (row, kt), slots, (r, stage))
    else:
        first = tile * tile_extent // SCALE_BLOCK
        if lane < blocks_touched(tile_extent):
            if first + lane < scales.shape[0]:
                _copy_one(atom, scales, (first + lane, kt), slots, (lane, stage))


@dataclass(frozen=True)
class ScaleStaging:
    """Warp 1's part of the producer walk (``producer_roles.TmaProducer.walk``) in the block-scaled kernels:
    once a stage is empty, copy its K tile's A and W scales into it and arrive on its full barrier as the copies
    land. It waits as the TMA warp does (a wait does not consume the phase). Kept off the TMA warp because the
    work between a freed stage and its TMA issue is on the refill path (staging the scales there is slower).
    Frozen: the DSL lets it into run-time loops without carrying it."""

    mainloop: object
    scales_a: cute.Tensor
    scales_w: cute.Tensor
    slots: tuple  # (A, W) scale slots of each stage
    grans: tuple  # (A, W) scale granularity
    tile_mn: tuple  # (bM, bN)
    lane: object
    a_by_tma: object = False  # run-time flag: A's scales come by TMA (the TMA warp's ``load_a_scale_box``)

    def unit_views(self, tm, tn):
        return None

    def prefetch_weights(self, tm, tn, k_begin, k_count):
        """(The TMA warp's part: ``TmaLoads.prefetch_weights``.)"""

    def fill_stage(self, views, tm, tn, kt, state):
        self.mainloop.sync_object_empty.wait(state.index, state.phase)
        bar = self.mainloop.producer_get_barrier(state)
        _stage_a_unless(self.a_by_tma, self.scales_a, self.slots[0], self.grans[0], self.tile_mn[0], tm, kt,
                        state.index, self.lane)
        stage_scales(self.scales_w, self.slots[1], self.grans[1], self.tile_mn[1], tn, kt, state.index, self.lane)
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)


@cute.jit
def _stage_a_unless(a_by_tma, scales, slots, gran: cutlass.Constexpr, extent: cutlass.Constexpr, tile, kt, stage,
                    lane):
    if not a_by_tma:
        stage_scales(scales, slots, gran, extent, tile, kt, stage, lane)


@cute.jit
def _copy_one(atom, scales: cute.Tensor, src_coord, slots: cute.Tensor, dst_coord):
    src = cute.make_tensor(scales.iterator + cute.crd2idx(src_coord, scales.layout), cute.make_layout(1))
    dst = cute.make_tensor(slots.iterator + cute.crd2idx(dst_coord, slots.layout), cute.make_layout(1))
    cute.copy(atom, src, dst)


# ---- A's group scales by TMA ---------------------------------------------------------------------------
@cute.jit
def a_scale_tma_view(scales: cute.Tensor):
    """(whether this call's A group scales can come by TMA, a view of them the TMA descriptor is built from).

    They can when rows are contiguous, the K-block stride is at least the row count and a multiple of 4 floats,
    and the base is 16-byte aligned (torch's M-major layout with M % 4 == 0). Otherwise the view is a
    well-formed stand-in over the same memory that is never loaded from: one compiled kernel takes either path,
    chosen by the flag at run time."""
    rows, kb = scales.shape
    row_stride, kb_stride = scales.layout.stride
    addr = scales.iterator.toint()
    ok = (row_stride == 1) & (kb_stride >= rows) & (kb_stride % 4 == 0) & (addr % 16 == 0)
    stride = cutlass.select_(ok, kb_stride, (rows + 3) // 4 * 4)
    base = cute.make_ptr(Float32, addr - addr % 16, cute.AddressSpace.gmem, assumed_align=16)
    return ok, cute.make_tensor(base, cute.make_layout((rows, kb), stride=(1, stride)))


def a_scale_tma_atom(view: cute.Tensor, tile_m: int):
    """(TMA atom, TMA tensor) loading one K block's scales of a tile's ``tile_m`` rows per box."""
    box = cute.make_layout((tile_m, 1))
    return cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), view, box, box.shape)


@cute.jit
def load_a_scale_box(atom, tma_scales, slots, tile_m: cutlass.Constexpr, tm, kt, stage, bar):
    """TMA: A scales of tile row ``tm``, K block ``kt`` into ``stage``'s A slots, on the stage's barrier ``bar``
    (rows past M arrive as zeros; their outputs are clipped)."""
    src = cute.local_tile(tma_scales, (tile_m, 1), (tm, kt))
    dst = cute.make_tensor(slots.iterator + cute.crd2idx((0, stage), slots.layout), cute.make_layout((tile_m, 1)))
    s_part, g_part = cute.nvgpu.cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2), cute.group_modes(src, 0, 2)
    )
    cute.copy(atom, g_part, s_part, tma_bar_ptr=bar)


SCALE_REGS = 4  # per consumer thread and K-tile fragment: the scale products (or A scales) of one K tile


@cute.jit
def _read_a_scales(slots_a, tile_coords, gran: cutlass.Constexpr, stage):
    """The A scales of this thread's two row halves in ``stage``: the rows of its elements 0 and 2
    (``group``), or the tile's one A block (a 64/128-row tile lies in one)."""
    if cutlass.const_expr(gran == "group"):
        return Float32(slots_a[(tile_coords[0][0], stage)]), Float32(slots_a[(tile_coords[2][0], stage)])
    sa = Float32(slots_a[(0, stage)])
    return sa, sa


@cute.jit
def _scale_products(dst, sa0, sa1, sb0, sb1, tile_n: cutlass.Constexpr):
    """dst = (sa0, sa1) x the tile's first W block scale, then x the second for tiles that straddle two
    (``sb1`` is read only then)."""
    dst[0], dst[1] = sa0 * sb0, sa1 * sb0
    if cutlass.const_expr(SCALE_BLOCK % tile_n != 0):
        dst[2], dst[3] = sa0 * sb1, sa1 * sb1


@cute.jit
def read_stage_scales(regs, slots_a, slots_b, tile_coords, grans: cutlass.Constexpr, tile_mn: cutlass.Constexpr,
                      stage):
    """Consumer side: this thread's scales of the K tile in ``stage``, read into ``regs`` as soon as the stage
    is full -- before its MMAs are issued -- so that the promotion after the MMA wait does not wait on shared
    memory (the shared-memory latency and the products would be on that path).

    ``regs`` gets (A scale of row half 0, of row half 1) x the W block scale, then x the second W block scale
    for tiles that straddle two; with per-column (``group``) W scales, which differ per element, the two A
    scales alone (``promote_block_scaled`` reads the W scales from the stage then).
    """
    _, bN = tile_mn
    sa = _read_a_scales(slots_a, tile_coords, grans[0], stage)
    if cutlass.const_expr(grans[1] == "group"):
        regs[0], regs[1] = sa[0], sa[1]
    else:
        sb1 = Float32(slots_b[(1, stage)]) if cutlass.const_expr(SCALE_BLOCK % bN != 0) else None
        _scale_products(regs, sa[0], sa[1], Float32(slots_b[(0, stage)]), sb1, bN)


@cute.jit
def promote_block_scaled(acc, frag, regs, slots_b, tile_coords, grans: cutlass.Constexpr,
                         tile_mn: cutlass.Constexpr, origin_n, stage, elem_base: cutlass.Constexpr = 0):
    """acc += frag * sa(row) * sb(column) for one retired K tile of a 64 x N WGMMA fragment, ``regs`` holding
    what ``read_stage_scales`` read for it.

    The fragment layout is WGMMA's ((2 columns, 2 rows, N/8 column groups), 1, 1): element i sits in row
    half (i // 2) % 2 and column group i // 4, so the scale of each element is known at trace time except
    for a "block" W scale on tiles that straddle 128-column blocks (a 192-wide tile): there the tile's
    offset into its first block (one of a few values) selects it.
    """
    _, bN = tile_mn
    assert cute.size(acc) == bN // 2, "expected a 64 x N WGMMA accumulator per warp group"
    # ``frag`` may be one half of the tile's (the split-N loop): elements elem_base.. of ``acc``.
    n = cute.size(frag)
    assert elem_base + n <= bN // 2 and elem_base % 4 == 0, (elem_base, n, bN)
    if cutlass.const_expr(grans[1] == "group"):
        with unrolled_fragment_loops():  # acc / frag are register arrays: element indices must be constants
            for f in cutlass.range_constexpr(n):
                i = elem_base + f
                sb = Float32(slots_b[(tile_coords[i][1], stage)])
                acc[i] = acc[i] + frag[f] * (regs[(i // 2) % 2] * sb)
    elif cutlass.const_expr(SCALE_BLOCK % bN == 0):
        s = (regs[0], regs[1])  # the tile lies in one W block
        with unrolled_fragment_loops():  # acc / frag are register arrays: element indices must be constants
            for f in cutlass.range_constexpr(n):
                i = elem_base + f
                acc[i] = acc[i] + frag[f] * s[(i // 2) % 2]
    else:
        # Which W block a column group falls in depends on the tile's offset into its first block, one of
        # a few run-time values: each (column group pattern, row half) picks its scale once per K tile with
        # selects (two for a 192-wide tile), which is faster than one copy of the promotion per offset behind
        # a branch.
        s = ((regs[0], regs[1]), (regs[2], regs[3]))
        offset = origin_n % SCALE_BLOCK
        offsets = _tile_offsets(bN)
        picked = {}
        with unrolled_fragment_loops():  # acc / frag are register arrays: element indices must be constants
            for f in cutlass.range_constexpr(n):
                i = elem_base + f
                half = (i // 2) % 2
                blocks = tuple((off + 8 * (i // 4)) // SCALE_BLOCK for off in offsets)  # per possible offset
                key = (blocks, half)
                if cutlass.const_expr(key not in picked):
                    scale = s[blocks[0]][half]
                    for j in cutlass.range_constexpr(1, len(offsets)):
                        if cutlass.const_expr(blocks[j] != blocks[0]):
                            scale = cutlass.select_(offset == offsets[j], s[blocks[j]][half], scale)
                    picked[key] = scale
                acc[i] = acc[i] + frag[f] * picked[key]


@cute.jit
def read_raw_scales(regs, slots_a, slots_b, tile_coords, grans: cutlass.Constexpr, tile_mn: cutlass.Constexpr,
                    stage):
    """``read_stage_scales`` for ``block`` W scales without the products: the raw scales of the K tile in
    ``stage`` (A scale of row half 0, of row half 1, W block scale, second W block scale when the tile
    straddles two), so nothing waits for the loads until the promotion (``promote_raw_scales``): with the
    products formed at the read, ptxas places the multiplies between the WGMMAs."""
    _, bN = tile_mn
    regs[0], regs[1] = _read_a_scales(slots_a, tile_coords, grans[0], stage)
    regs[2] = Float32(slots_b[(0, stage)])
    if cutlass.const_expr(SCALE_BLOCK % bN != 0):
        regs[3] = Float32(slots_b[(1, stage)])


@cute.jit
def promote_raw_scales(acc, frag, regs, tile_coords, grans: cutlass.Constexpr, tile_mn: cutlass.Constexpr,
                       origin_n, elem_base: cutlass.Constexpr = 0):
    """``promote_block_scaled`` on the raw scales of ``read_raw_scales``: the (row half, W block) products
    are formed here, well after the loads were issued."""
    _, bN = tile_mn
    prods = cute.make_rmem_tensor(cute.make_layout(SCALE_REGS), Float32)
    sb1 = regs[3] if cutlass.const_expr(SCALE_BLOCK % bN != 0) else None
    _scale_products(prods, regs[0], regs[1], regs[2], sb1, bN)
    promote_block_scaled(acc, frag, prods, None, tile_coords, grans, tile_mn, origin_n, None, elem_base)


@dataclass(frozen=True)
class TileScales:
    """A consumer warp group's block-scale state for one output tile, built once per tile outside its K loop
    (frozen: the DSL lets it into run-time loops without carrying it)."""

    slots: tuple  # (A, W) scale slots of each stage, in shared memory (stage_scales fills them)
    tile_coords: object  # each accumulator element's (row, column) inside the tile
    origin_n: object  # the tile's first output column (places a 192-wide tile in its W scale blocks)
    regs: tuple  # per K tile in flight: SCALE_REGS registers each
    grans: tuple  # (A, W) scale granularity
    tile_mn: tuple  # (bM, bN)
    raw: bool = False  # raw scales (read_raw), products formed in the promotion

    def read(self, slot, stage):
        """Read the K tile in ``stage``'s scales for fragment ``slot`` (read_stage_scales)."""
        read_stage_scales(self.regs[slot], self.slots[0], self.slots[1], self.tile_coords, self.grans,
                          self.tile_mn, stage)

    def read_raw(self, slot, stage):
        """Raw scales of the K tile in ``stage`` into register set ``slot`` (read_raw_scales)."""
        read_raw_scales(self.regs[slot], self.slots[0], self.slots[1], self.tile_coords, self.grans,
                        self.tile_mn, stage)

    def promote(self, acc, frag, slot, stage, elem_base: cutlass.Constexpr = 0):
        """acc += frag, scaled (promote_block_scaled); ``stage`` still holds the K tile's W scales.
        ``frag`` may be the part of the tile's fragment that starts at element ``elem_base``."""
        if self.raw:
            promote_raw_scales(acc, frag, self.regs[slot], self.tile_coords, self.grans, self.tile_mn,
                               self.origin_n, elem_base)
        else:
            promote_block_scaled(acc, frag, self.regs[slot], self.slots[1], self.tile_coords, self.grans,
                                 self.tile_mn, self.origin_n, stage, elem_base)


def _tile_offsets(tile_extent: int):
    """Offsets into its first 128-block at which a tile of this extent can start."""
    return sorted({(t * tile_extent) % SCALE_BLOCK for t in range(SCALE_BLOCK)})

"""Block scales for the Hopper FP8 GEMM: which scale each operand carries per 128-deep K block, how the
producer stages them in shared memory, and how the consumers read them when promoting a K tile.

Per 128-deep K block ``kb`` an operand carries either

* ``group``: one scale per row (A) or column (W) -- the 1x128 granularity (DeepSeek's activations), or
* ``block``: one scale per 128 rows/columns -- the 128x128 granularity (DeepSeek's weights, GridQuant).

The kernel sees the scales as 2-D fp32 tensors ``(rows, Kb)`` for ``group`` and ``(ceil(rows/128), Kb)``
for ``block``, with run-time strides, so torch's outer-dim-major / padded layouts and plain row-major ones
are all read in place.

Staging: the scales of one K tile ride in the same mainloop stage as its A/W tiles. The producer warp's 32
lanes copy them with 4-byte ``cp.async`` (the M-contiguous scale rows are not 16-byte aligned in general,
so TMA cannot address them) and each lane signals the stage's full barrier with
``cp.async.mbarrier.arrive.noinc`` -- the barrier therefore expects 1 (TMA expect_tx) + 32 arrivals.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

# recipe name -> (A granularity, W granularity)
BLOCK_RECIPES = {
    "1x128_128x128": ("group", "block"),
    "128x128_128x128": ("block", "block"),
    "1x128_1x128": ("group", "group"),
}
SCALE_BLOCK = 128  # K (and, for "block", M/N) extent of one scale
PRODUCER_LANES = 32  # lanes of the producer warp that arrive on the full barrier after their cp.async


def is_block_scaled(recipe: str) -> bool:
    return recipe in BLOCK_RECIPES


def scale_smem_bytes_per_stage(tile_m: int, tile_n: int) -> int:
    """One fp32 slot per tile row of A and per tile column of W (only slot 0 is used for ``block``)."""
    return (tile_m + tile_n) * 4


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
    fp32 shared-memory tensor. Called by all 32 lanes of the producer warp.
    """
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
    if cutlass.const_expr(granularity == "group"):
        rows = scales.shape[0]
        for j in cutlass.range_constexpr(tile_extent // PRODUCER_LANES):
            r = lane + j * PRODUCER_LANES
            row = tile * tile_extent + r
            # Rows past the edge are never stored (the TMA store clips them): leave their slots stale.
            if row < rows:
                _copy_one(atom, scales, (row, kt), slots, (r, stage))
    else:
        if lane == 0:
            _copy_one(atom, scales, (tile * tile_extent // SCALE_BLOCK, kt), slots, (0, stage))


@cute.jit
def _copy_one(atom, scales: cute.Tensor, src_coord, slots: cute.Tensor, dst_coord):
    src = cute.make_tensor(scales.iterator + cute.crd2idx(src_coord, scales.layout), cute.make_layout(1))
    dst = cute.make_tensor(slots.iterator + cute.crd2idx(dst_coord, slots.layout), cute.make_layout(1))
    cute.copy(atom, src, dst)


@cute.jit
def tile_scale(slots_a: cute.Tensor, slots_b: cute.Tensor, gran_a: cutlass.Constexpr, gran_b: cutlass.Constexpr, m, n, stage):
    """The combined dequantization factor of accumulator element (m, n) (tile coordinates) for a stage."""
    row = 0
    col = 0
    if cutlass.const_expr(gran_a == "group"):
        row = m
    if cutlass.const_expr(gran_b == "group"):
        col = n
    return Float32(slots_a[(row, stage)]) * Float32(slots_b[(col, stage)])

"""Instances of the table the generator and export tests compile: picked through dispatch (the tiles the table gives
a shape change as the table does) or by their table fields."""

from cutedsl_gemm.selection import instances as M
from cutedsl_gemm.selection.dispatch import select_gemm

# Whatever the table dispatches to (its tiles change): the no-bias row-wise bf16 GEMM (the GPU test
# runs it) and a tensor-wise fp32 one with bias (bias length is a third shared extent).
M_TEST = 1000  # not a multiple of any tile: the GPU run has a partial tile
ROW_BF16 = select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, M_TEST, "promoted").name
# 128x256 fast accumulation (what an 8192-wide output gets): the one Hopper tile built without the split-K
# reduction
TENSOR_BIAS = select_gemm("sm_90a", "tensor", "e4m3", "e5m2", "fp32", "fp32", M_TEST, "fast", n=8192, sms=132).name
M_SMALL = 64  # decode-sized: the small-M (split-K) schedule, where the table has one
SMALL = select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, M_SMALL, "promoted").name
# M = 128, N = 57344: the unswapped 64x128 (dispatch.wave_cost: its WGMMAs outrun 128x64 swapped's on the same
# tiles); and the swapped 128x128 in 2x1 clusters, whose estimated rate costs dispatch.ESTIMATED_RATE_MARGIN
MID = select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 128, "promoted", n=57344, sms=132, k=8192).name
WIDE_DECODE = next(i.name for i in M.select(arch="sm_90a", recipe="row", a_dtype="e4m3", b_dtype="e4m3",
                                            out_dtype="bf16", bias_dtype=None, accum="promoted", swap_ab=True,
                                            tile_m=128, tile_n=128, cluster_m=2))
# A short-K output: the two-CTAs-per-SM tile that dispatch's epilogue term picks there
PAIR = select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 6144, "promoted", n=7168, sms=132, k=256).name
# A narrow, tall output: 128x128 tiles in 4x1 clusters (30 cluster slots on 132 SMs, not 33)
CLUSTER4 = select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 6144, "promoted", n=576, sms=132, k=7168).name
# 2D recipe, M=3072 N=8192: 128x192 in two waves ties 128x128 in three (wave_cost); the long-K rate
# (dispatch.LONG_K) gives the tie to 128x192 from K = LONG_K, 128x128 keeps it below (the DeepSeek recipe gives
# it to 128x192 at every K)
BLOCK2D_SHORT_K = select_gemm("sm_90a", "128x128_128x128", "e4m3", "e4m3", "bf16", None, 3072, "promoted", n=8192,
                              sms=132, k=1536).name
BLOCK2D_LONG_K = select_gemm("sm_90a", "128x128_128x128", "e4m3", "e4m3", "bf16", None, 3072, "promoted", n=8192,
                             sms=132, k=8192).name
# The weight-only GEMMs of int4 weights in groups of 128 at M <= 16 and of int8 weights per channel from M = 65
WEIGHT_ONLY_DECODE = M.select(op=M.WEIGHT_ONLY, recipe="group128", a_dtype="bf16", b_dtype="int4", tile_n=16)[0].name
WEIGHT_ONLY_INT8 = M.select(op=M.WEIGHT_ONLY, recipe="channel", a_dtype="bf16", b_dtype="int8", tile_n=128)[0].name
# the AOT tests' instances: scaled GEMMs, and weight-only GEMMs in the same export
EXPORTED = tuple(dict.fromkeys([ROW_BF16, TENSOR_BIAS, SMALL, MID, WIDE_DECODE, PAIR, CLUSTER4, BLOCK2D_SHORT_K,
                                 BLOCK2D_LONG_K]))
WEIGHT_ONLY_EXPORTED = (WEIGHT_ONLY_DECODE, WEIGHT_ONLY_INT8)
# The GEMMs quantizing their bf16 activations (op QUANT_GEMM), every tile of three calls' rows, so that the C lookup
# chooses among what dispatch.select does: 1x128 groups x 128x128 W blocks (DeepSeek), per token x per channel FP8,
# W8A8; bf16 output, no bias
QUANT_GEMM_CALLS = (("1x128_128x128", "e4m3"), ("row", "e4m3"), ("row", "int8"))
QUANT_GEMM_EXPORTED = tuple(i.name for recipe, weights in QUANT_GEMM_CALLS
                            for i in M.select(op=M.QUANT_GEMM, recipe=recipe, a_dtype="bf16", b_dtype=weights,
                                              out_dtype="bf16", bias_dtype=None))


def instance(name):
    """The table's instance of that name."""
    hits = [i for i in M.INSTANCES if i.name == name]
    assert hits, f"{name} is not in the table"
    return hits[0]

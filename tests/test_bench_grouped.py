"""bench_grouped's operands on the CPU: each recipe's quantization of the same x and w, in both layouts, is what the
grouped op takes (its float64 reference on them gives the product of x and w within FP8's error)."""

import pytest
import torch

from benchmarks import bench_grouped as B
from cutedsl_gemm.numerics import reference as R


@pytest.mark.parametrize("recipe", ["row", "tensor", "deepseek"])
def test_each_recipes_operands_multiply_to_x_times_w(recipe):
    g = torch.Generator().manual_seed(3)
    e, n, k = 4, 256, 384
    sizes = torch.tensor([5, 0, 130, 1])
    x = torch.randn(int(sizes.sum()), k, generator=g).to(torch.bfloat16)
    w = torch.randn(e, n, k, generator=g).to(torch.bfloat16)
    if recipe == "row":
        from cutedsl_gemm import quantize_fp8

        qa, sa = quantize_fp8(x, "row")
        q, s = quantize_fp8(w.reshape(e * n, k), "row")
        ops = qa, sa, q.view(e, n, k).transpose(1, 2), s.view(e, 1, n)
    else:
        ops = B.recipe_operands(recipe, x, w)
    qa, sa, b, sb = ops
    assert b.shape == (e, k, n) and b.stride(1) == 1
    offs = sizes.cumsum(0).to(torch.int32)
    want = torch.cat([x[lo:hi].double() @ w[i].double().t() for i, (lo, hi) in
                      enumerate(zip([0, *offs[:-1].tolist()], offs.tolist()))])
    got = R.reference_grouped_mm(qa, b, sa, sb, offs, recipe=B.RECIPES[recipe], out_dtype=torch.float64)
    assert R.rel_error(got, want) < 0.08
    cap = int(sizes.max())
    am, sam = B.masked_operands(qa, sa, recipe, sizes, cap)
    masked = R.reference_grouped_mm(am, b, sam, sb, counts=sizes.to(torch.int32), recipe=B.RECIPES[recipe],
                                    out_dtype=torch.float64)
    start = 0
    for i, size in enumerate(sizes.tolist()):
        assert torch.equal(masked[i, :size], got[start:start + size])
        start += size

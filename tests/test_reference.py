"""Reference numerics (CPU): the quantizer contract and the float64 GEMM every kernel is checked against."""

import pytest
import torch

from cutedsl_gemm.numerics import formats as F
from cutedsl_gemm.numerics import reference as R


@pytest.mark.parametrize("gran", [F.ScaleGranularity.TENSOR, F.ScaleGranularity.ROW, F.ScaleGranularity.GROUP_1x128, F.ScaleGranularity.BLOCK_128x128])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_roundtrip_and_scale_shapes(gran, fmt):
    torch.manual_seed(1)
    x = torch.randn(200, 300) * 5  # partial 128-blocks in both dims
    q, s = R.quantize(x, gran, fmt)
    f = F.element_format(fmt)
    assert q.dtype == f.torch_dtype and q.shape == x.shape
    assert s.shape == (F.scale_shape(gran, 200, 300) or (1, 1))
    # Every group uses its range: the largest |q| of each group is the format's max.
    back = R.dequantize(q, s, gran)
    rel = (back - x.double()).norm() / x.double().norm()
    assert rel < (0.04 if fmt == "e4m3" else 0.08)
    assert q.float().abs().max() == f.max_finite


def test_group_scales_follow_contract():
    x = torch.zeros(130, 256)
    x[0, 0] = 448 * 3.0  # block (0,0) of 1x128 groups: amax 1344 -> scale 3
    x[129, 200] = -7.0
    q, s = R.quantize(x, F.ScaleGranularity.GROUP_1x128)
    assert s.shape == (130, 2)
    assert s[0, 0] == 3.0
    assert s[129, 1] == torch.tensor(7.0) / torch.tensor(448.0)
    assert s[5, 0] == 1.0  # all-zero group -> 1, no division by zero
    assert q[0, 0].float() == 448.0


def test_nonfinite_inputs_saturate_and_propagate_nan():
    x = torch.tensor([[1.0, float("inf"), -float("inf"), float("nan"), 2.0] + [0.0] * 11])
    q, s = R.quantize(x, F.ScaleGranularity.ROW)
    assert s.item() == pytest.approx(2.0 / 448.0)  # inf/nan ignored for amax
    qf = q.float()
    assert qf[0, 1] == 448 and qf[0, 2] == -448 and torch.isnan(qf[0, 3])


def test_reference_gemm_against_explicit_dequant():
    torch.manual_seed(2)
    a, w = torch.randn(33, 256), torch.randn(40, 256)
    for rec in ["tensor", "row", "1x128_128x128", "128x128_128x128", "1x128_1x128"]:
        qa, sa, qw, sw = R.quantize_operands(a, w, rec)
        r = F.recipe(rec)
        da = qa.double() * R.expand_scales(sa.double(), r.a, 33, 256)
        dw = qw.double() * R.expand_scales(sw.double(), r.b, 40, 256)
        bias = torch.randn(40)
        ref = R.reference_gemm(qa, sa, qw, sw, rec, bias=bias)
        assert torch.allclose(ref, da @ dw.t() + bias.double())
        assert R.rel_error(ref - bias.double(), a.double() @ w.double().t()) < 0.06


def test_rel_error_flags_nan_and_wrong_values():
    ref = torch.randn(8, 8, dtype=torch.float64)
    assert R.rel_error(ref.clone(), ref) == 0
    bad = ref.clone()
    bad[3, 3] = float("nan")
    assert R.rel_error(bad, ref) == float("inf")
    assert R.rel_error(ref * 1.01, ref) == pytest.approx(0.01)


def test_formats_tables():
    assert F.element_format(torch.float8_e4m3fn) is F.E4M3
    assert F.E2M1.max_finite == 6.0 and F.E2M3.max_finite == 7.5 and F.E3M2.max_finite == 28.0
    assert F.recipe("1x128_128x128").k_block == 128 and F.recipe("row").k_block is None
    with pytest.raises(ValueError, match="unknown scaling recipe"):
        F.recipe("nope")

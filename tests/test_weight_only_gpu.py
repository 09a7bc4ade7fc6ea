"""The weight-only GEMM on a Hopper GPU: numerics against the float64 product of the dequantized weights for every
format (int4 group 32 / 64 / 128 with and without zero points, int4 and int8 per channel), bf16 and fp16
activations, ragged N and K, M from decode to prefill, split K; outputs NaN-poisoned first."""

import pytest
import torch

from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops.weight_only import mm_weight_only

pytestmark = pytest.mark.gpu

FORMATS = [(4, g, z) for g in IP.GROUPS for z in (False, True)] + [(4, 0, False), (8, 0, False)]
# Relative Frobenius error at the output's precision: the dequantized weight and the output are each rounded once.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 2e-3}


def _operands(m, n, k, bits, group, zeros, act, seed=0, *, integer=False):
    """(x, packed, scales, zeros) on the GPU and the float64 reference. ``integer``: x in {-1, 0, 1} and unit
    scales."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    q, s, z = IP.quantize_weights(w, bits, group, symmetric=not zeros)
    if integer:
        s = torch.ones_like(s)
        x = torch.randint(-1, 2, (m, k), generator=gen).to(act)
    else:
        x = torch.randn(m, k, generator=gen).to(act)
    packed, ks, kz = IP.pack_weights(q, s, z, group, bits=bits, dtype=act)
    q2, s2, z2 = IP.unpack_weights(packed, ks, kz, k=k, group=group, bits=bits)  # the scales the kernel reads
    ref = R.reference_weight_only_mm(x, q2, s2, z2, group)
    cuda = [None if t is None else t.cuda() for t in (x, packed, ks, kz)]
    return (*cuda, ref)


def _run(x, packed, scales, zeros, group, bits, **kw):
    out = torch.full((x.shape[0], scales.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    res = mm_weight_only(x, packed, scales, zeros, group=group, bits=bits, out=out, **kw)
    torch.cuda.synchronize()
    assert res is out
    assert not torch.isnan(out).any(), "some outputs were never written"
    return out


@pytest.mark.parametrize("bits,group,zeros", FORMATS)
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16, 100, 128, 1000, 4096])
def test_numerics_every_format(bits, group, zeros, act, m):
    n, k = 296, 384  # N ragged against the 128-row tiles and 64-row atoms; three K tiles
    x, packed, s, z, ref = _operands(m, n, k, bits, group, zeros, act, seed=m)
    out = _run(x, packed, s, z, group, bits)
    err = R.rel_error(out.cpu(), ref)
    assert err < TOLERANCE[act], (bits, group, zeros, act, m, err)


@pytest.mark.parametrize("bits,group,zeros", FORMATS)
def test_integer_data_is_exact(bits, group, zeros):
    """Unit scales, x in {-1, 0, 1}: every product and sum is an exact integer in fp32, so the output must be the
    float64 reference rounded once to fp16, bit for bit (a misplaced element or scale shows here)."""
    x, packed, s, z, ref = _operands(37, 200, 384, bits, group, zeros, torch.float16, seed=7, integer=True)
    out = _run(x, packed, s, z, group, bits)
    assert torch.equal(out.cpu(), ref.to(torch.float16)), (bits, group, zeros)


@pytest.mark.parametrize("group,k", [(32, 96), (32, 1056), (64, 320), (64, 4160), (128, 640)])
@pytest.mark.parametrize("zeros", [False, True])
def test_ragged_k(group, k, zeros):
    """K a multiple of the group but not of the 128-deep K tile: the last tile's missing groups read as zero."""
    x, packed, s, z, ref = _operands(16, 136, k, 4, group, zeros, torch.bfloat16, seed=k)
    out = _run(x, packed, s, z, group, 4)
    assert R.rel_error(out.cpu(), ref) < TOLERANCE[torch.bfloat16], (group, k, zeros)


@pytest.mark.parametrize("m", [1, 16, 128])
def test_split_k_matches_and_repeats_bit_for_bit(m):
    x, packed, s, z, ref = _operands(m, 1024, 4096, 4, 128, False, torch.bfloat16, seed=11)
    runs = {splits: _run(x, packed, s, z, 128, 4, split_k=splits) for splits in (1, 2, 3, 5, 16)}
    for splits, out in runs.items():
        assert R.rel_error(out.cpu(), ref) < TOLERANCE[torch.bfloat16], splits
        assert torch.equal(out, _run(x, packed, s, z, 128, 4, split_k=splits)), f"split {splits} is not deterministic"
    auto = _run(x, packed, s, z, 128, 4)  # dispatch's split
    assert R.rel_error(auto.cpu(), ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("bits,group", [(4, 128), (8, 0)])
def test_llama_decode_shape(bits, group):
    x, packed, s, z, ref = _operands(16, 8192, 8192, bits, group, False, torch.bfloat16, seed=3)
    out = _run(x, packed, s, z, group, bits)
    assert R.rel_error(out.cpu(), ref) < TOLERANCE[torch.bfloat16]


def test_repeated_calls_reuse_the_plan_and_new_outputs():
    x, packed, s, z, ref = _operands(5, 256, 512, 4, 64, True, torch.bfloat16, seed=5)
    first = mm_weight_only(x, packed, s, z, group=64)
    second = mm_weight_only(x, packed, s, z, group=64)  # the cached plan, a new output tensor
    torch.cuda.synchronize()
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)
    assert R.rel_error(second.cpu(), ref) < TOLERANCE[torch.bfloat16]
    # The same signature with a misaligned x: the compiled function refuses it, the full validation says why.
    misaligned = torch.empty(5 * 512 + 1, dtype=x.dtype, device=x.device)[1:].view(5, 512)
    misaligned.copy_(x)
    with pytest.raises(ValueError, match="16-byte aligned base"):
        mm_weight_only(misaligned, packed, s, z, group=64)


def test_empty_problems():
    x, packed, s, z, _ = _operands(1, 64, 128, 4, 128, False, torch.bfloat16)
    assert mm_weight_only(x[:0], packed, s, z).shape == (0, 64)
    empty_k = IP.pack_weights(torch.zeros(64, 0, dtype=torch.int8), torch.ones(64, 0), None, 128)
    out = mm_weight_only(torch.zeros(3, 0, dtype=torch.bfloat16, device="cuda"), *(t.cuda() for t in empty_k[:2]))
    assert torch.equal(out, torch.zeros(3, 64, dtype=torch.bfloat16, device="cuda"))

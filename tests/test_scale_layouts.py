"""Recipe detection and scale views for scaled_mm (CPU: only shapes, strides and dtypes matter)."""

import pytest
import torch
import torch.nn.functional as F

from cutedsl_gemm.numerics.scale_layouts import resolve


def _torch_1x128(rows, kb):
    # torch's BlockWise1x128 operand: (rows, Kb), outer-dim-major
    return torch.rand(kb, rows).t()


def _torch_128x128(rb, kb):
    # torch's BlockWise128x128 operand: (rb, Kb) with the row stride padded to a multiple of 4
    l4 = -(-kb // 4) * 4
    return torch.rand(rb, l4)[:, :kb]


def test_epilogue_recipes():
    m, n, k = 5, 32, 256
    r, sa, sb = resolve(torch.ones(()), torch.ones(1), m, n, k)
    assert r == "tensor" and sa.shape == (1,) and sb.shape == (1,)
    assert resolve(torch.ones(m, 1), torch.ones(1, n), m, n, k)[0] == "row"
    with pytest.raises(ValueError, match=r"row x row: \(5, 1\) x \(1, 32\)"):
        resolve(torch.ones(m, 1), torch.ones(n, 1), m, n, k)
    with pytest.raises(TypeError, match="scale_b must be torch.float32"):
        resolve(torch.ones(()), torch.ones((), dtype=torch.bfloat16), m, n, k)
    with pytest.raises(ValueError, match="must be contiguous"):
        resolve(torch.ones(m, 2)[:, :1], torch.ones(1, n), m, n, k)


@pytest.mark.parametrize("m,n,k", [(1, 576, 7168), (129, 512, 7056), (1000, 4608, 256)])
def test_block_recipes_from_torch_layouts(m, n, k):
    kb, mb, nb = -(-k // 128), -(-m // 128), -(-n // 128)
    # DeepSeek: A 1x128, W 128x128 -- scale_b in b's orientation (Kb, ceil(N/128)), i.e. the transpose of
    # the weight's (ceil(N/128), Kb) grid.
    sw = _torch_128x128(nb, kb)
    r, sa, sb = resolve(_torch_1x128(m, kb), sw.t(), m, n, k)
    assert r == "1x128_128x128"
    assert sa.shape == (m, kb) and sb.shape == (nb, kb) and torch.equal(sb, sw)
    # 128x128 x 128x128 (not for M=1, where A's block grid is also a valid 1x128 grid)
    if m > 1:
        r, sa, sb = resolve(_torch_128x128(mb, kb), sw.t(), m, n, k)
        assert r == "128x128_128x128" and sa.shape == (mb, kb)
    # 1x128 x 1x128: scale_b (Kb, N)
    sw1 = _torch_1x128(n, kb)
    r, sa, sb = resolve(_torch_1x128(m, kb), sw1.t(), m, n, k)
    assert r == "1x128_1x128" and sb.shape == (n, kb) and torch.equal(sb, sw1)


def test_padded_block_scales_are_trimmed():
    m, n, k = 300, 640, 640  # Kb = 5, padded to 8
    sw = torch.rand(5, 8)  # (ceil(N/128), L4) as cuBLAS stores it
    r, sa, sb = resolve(torch.rand(m, 5), sw.t(), m, n, k)
    assert r == "1x128_128x128" and sb.shape == (5, 5) and torch.equal(sb, sw[:, :5])


def test_explicit_recipes_and_errors():
    m, n, k = 256, 256, 512
    st = F.ScalingType
    r, _, _ = resolve(torch.rand(m, 4), torch.rand(4, 2), m, n, k, st.BlockWise1x128, st.BlockWise128x128)
    assert r == "1x128_128x128"
    assert resolve(torch.rand(m, 4), torch.rand(4, 2), m, n, k, "1x128", "128x128")[0] == "1x128_128x128"
    with pytest.raises(ValueError, match=r"scale_b for 128x128 scaling must have shape \(4, 2\)"):
        resolve(torch.rand(m, 4), torch.rand(2, 4), m, n, k, "1x128", "128x128")
    with pytest.raises(ValueError, match="128x128 x 1x128 are not supported"):
        resolve(torch.rand(2, 4), torch.rand(4, n), m, n, k, st.BlockWise128x128, st.BlockWise1x128)
    with pytest.raises(ValueError, match="give both"):
        resolve(torch.rand(m, 4), torch.rand(4, 2), m, n, k, "1x128")
    with pytest.raises(ValueError, match="unknown scale recipe"):
        resolve(torch.rand(m, 4), torch.rand(4, 2), m, n, k, "1x64", "128x128")
    with pytest.raises(ValueError, match=r"1x128 x 128x128: \(256, 4\) x \(4, 2\)"):
        resolve(torch.rand(m, 3), torch.rand(4, 2), m, n, k)


def kept_for(cache: dict, t: torch.Tensor) -> bool:
    """Whether a view cache keyed by id() holds an entry for ``t`` itself (an id can be reused by a new tensor once
    the tensor of a stale entry is gone; the entry's weak reference tells them apart)."""
    entry = cache.get(id(t))
    return entry is not None and entry[0]() is t


def test_per_tensor_scale_views_are_kept_and_refreshed():
    """kernel_views keeps the (1,) view of a 0-dim W scale per tensor, never stale, never for big storages; never
    A's (activations' scales are new per call: a kept view would pin their memory, in a CUDA graph pool too)."""
    from cutedsl_gemm.numerics import scale_layouts as L

    s, t = torch.tensor(2.0), torch.tensor(3.0)
    va, vb = L.kernel_views("tensor", 1, t, s)
    assert vb.shape == (1,) and float(vb) == 2.0 and float(va) == 3.0
    assert L.kernel_views("tensor", 1, t, s)[1] is vb  # kept
    assert not kept_for(L._SCALAR_VIEWS, t)  # A's: not kept
    s.fill_(5.0)
    assert float(L.kernel_views("tensor", 1, t, s)[1]) == 5.0  # same storage: sees in-place updates
    s.set_(torch.tensor(7.0).untyped_storage())  # new storage: a new view
    v2 = L.kernel_views("tensor", 1, t, s)[1]
    assert v2 is not vb and float(v2) == 7.0
    big = torch.arange(1000, dtype=torch.float32)
    elem = big[3]  # a 0-dim view into a big buffer: not kept (the view would pin the buffer)
    assert float(L.kernel_views("tensor", 1, t, elem)[1]) == 3.0
    assert not kept_for(L._SCALAR_VIEWS, elem)
    one = torch.ones(1)
    assert L.kernel_views("tensor", 1, one, one)[1] is one  # already (1,)


def test_block_w_scale_views_are_kept_and_refreshed():
    """The (column blocks, Kb) view of torch's padded W block scales is kept per tensor (weights outlive
    calls); a new storage or an in-place restride makes a new one; A scales are passed as they are when
    nothing is padded, sliced when they are."""
    from cutedsl_gemm.numerics import scale_layouts as L

    kb = 3
    sa = torch.rand(256, kb)
    sb = torch.rand(4, 2)  # Kb padded to 4, N/128 = 2
    va, vb = L.kernel_views("1x128_128x128", kb, sa, sb)
    assert va is sa
    assert vb.shape == (2, kb) and torch.equal(vb, sb[:kb].t())
    assert L.kernel_views("1x128_128x128", kb, sa, sb)[1] is vb  # kept
    sb.mul_(2.0)
    assert torch.equal(L.kernel_views("1x128_128x128", kb, sa, sb)[1], sb[:kb].t())  # sees in-place updates
    sb.set_(torch.rand(4, 2).untyped_storage(), 0, (4, 2), (2, 1))  # new storage: a new view
    v2 = L.kernel_views("1x128_128x128", kb, sa, sb)[1]
    assert v2 is not vb and torch.equal(v2, sb[:kb].t())
    sb.as_strided_((4, 2), (1, 4))  # same pointer, other strides: a new view
    v3 = L.kernel_views("1x128_128x128", kb, sa, sb)[1]
    assert v3 is not v2 and torch.equal(v3, sb[:kb].t())
    assert L.kernel_views("1x128_128x128", 2, sa, sb)[1].shape == (2, 2)  # another Kb: not the kept view
    padded_a = torch.rand(256, 4)
    assert torch.equal(L.kernel_views("1x128_128x128", kb, padded_a, sb)[0], padded_a[:, :kb])
    big = torch.rand(1 << 19, 2)  # 4 MiB of scales: not kept (the view would pin the buffer)
    L.kernel_views("1x128_128x128", kb, sa, big)
    assert not kept_for(L._W_BLOCK_VIEWS, big)


# ---------------------------------------------------------------- SWIZZLE_32_4_4 blocked layout (MX / NVFP4 scales)

RAGGED = [(1, 1), (5, 3), (127, 4), (128, 4), (129, 5), (300, 9), (256, 8), (33, 17)]


def loop_to_blocked(plain: torch.Tensor) -> torch.Tensor:
    """cuBLAS 'block scaling factors layout' formula, one element at a time (flat uint8)."""
    rows, cols = plain.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    out = torch.zeros(row_tiles * col_tiles * 512, dtype=torch.uint8)
    for i in range(rows):
        for j in range(cols):
            tile = (i // 128) * col_tiles + j // 4
            outer, inner = i % 128, j % 4
            out[512 * tile + (outer % 32) * 16 + (outer // 32) * 4 + inner] = plain[i, j]
    return out


@pytest.mark.parametrize("rows,cols", RAGGED)
def test_to_blocked_matches_cublas_formula(rows, cols):
    from cutedsl_gemm.numerics import scale_layouts as L

    g = torch.Generator().manual_seed(rows * 100 + cols)
    plain = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=g)
    blocked = L.to_blocked(plain)
    assert blocked.shape == L.blocked_scale_shape(rows, cols)
    assert torch.equal(blocked.flatten(), loop_to_blocked(plain))
    assert torch.equal(L.from_blocked(blocked, rows, cols), plain)
    # the offset helper (used by the kernel's address arithmetic) agrees with the same formula
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    off = L.blocked_offset(r, c, cols)
    assert torch.equal(blocked.flatten()[off], plain)


def test_blocked_padding_is_zero_and_keeps_dtype():
    from cutedsl_gemm.numerics import scale_layouts as L

    plain = torch.full((130, 5), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    b = L.to_blocked(plain)
    assert b.dtype == torch.float8_e8m0fnu and b.shape == (256, 8)
    nz = (b.view(torch.uint8) != 0).sum().item()
    assert nz == 130 * 5
    assert torch.equal(L.from_blocked(b.flatten(), 130, 5).view(torch.uint8), plain.view(torch.uint8))


def test_blocked_validation():
    from cutedsl_gemm.numerics import scale_layouts as L

    with pytest.raises(ValueError, match="2-D"):
        L.to_blocked(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="one-byte"):
        L.to_blocked(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="128"):
        L.from_blocked(torch.zeros(100, dtype=torch.uint8), 4, 4)
    with pytest.raises(ValueError, match="one-byte blocked scales"):
        L.blocked_scale_words(torch.zeros(100, dtype=torch.uint8), 4, 4)


def test_recipe_pairs_follow_the_recipe_table():
    """scaled_mm's supported pairs are formats.RECIPES' fp32 recipes, in its order, named by the granularity."""
    from cutedsl_gemm.numerics import formats as FM
    from cutedsl_gemm.numerics import scale_layouts as L

    fp32 = [r for r in FM.RECIPES.values() if r.scale_format == "fp32"]
    assert list(L._PAIRS.items()) == [((r.a, r.b), r.name) for r in fp32]
    assert L.granularity(F.ScalingType.BlockWise1x128) is FM.ScaleGranularity.GROUP_1x128
    assert L.granularity("rowwise") is FM.ScaleGranularity.ROW
    m, n, k = 64, 64, 128
    with pytest.raises(ValueError, match="1x32 x 1x32 are not supported"):  # known, but not a Hopper recipe
        resolve(torch.rand(m, 4), torch.rand(4, 2), m, n, k, "1x32", F.ScalingType.BlockWise1x32)

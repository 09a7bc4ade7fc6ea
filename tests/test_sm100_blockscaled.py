"""Block-scaled GEMM family: quantizer kernels, host validation, compile-only PTX checks, Blackwell runs.

Tiers: plain tests (CPU: the sm_100a description of ``scaled_mm`` calls, without a GPU), ``compile`` tests
(build for sm_100a without a GPU and inspect PTX), ``cuda`` quantizer tests (the quantizer kernels use no
sm_100-only instruction, so any CUDA GPU runs them, compiled for its own arch) and ``blackwell`` GEMM tests
(``pytest -m blackwell`` on a B200; skipped elsewhere).
"""

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.families import sm100_gemm
from cutedsl_gemm.numerics import codecs, scale_layouts
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import E2M1, E2M3, E3M2, E4M3, E5M2, RECIPES
from cutedsl_gemm.runtime import launch, resources
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection import instances as table
from cutedsl_gemm.tools.ptx_inspect import keep_artifacts

MX_FMTS = (E4M3, E5M2, E3M2, E2M3, E2M1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _special_input(rows, k, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (rows, k // 16), generator=g).float()).repeat_interleave(16, 1)
    x = torch.randn(rows, k, generator=g) * scale
    x[0, :16] = 0.0
    if rows > 2 and k >= 64:
        x[1, 3] = float("inf")
        x[1, 40] = -float("inf")
        x[2, 17] = float("nan")
        x[2, 50] = 1e-40  # fp32 subnormal
        x[2, 51] = -0.0
    return x.to(dtype).to(device)


# ---------------------------------------------------------------- quantizer kernels (any CUDA GPU)


@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("fmt", MX_FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows,k", [(1, 32), (130, 96), (257, 512)])
def test_quantize_mx_kernel_bit_exact(fmt, dtype, rows, k):
    x = _special_input(rows, k, dtype, rows + k, "cuda")
    got = cutedsl_gemm.quantize_mx(x, fmt, backend="kernel")
    ref = R.quantize_mx_reference(x.cpu(), fmt)
    assert got.data.dtype == ref.data.dtype and got.scales.dtype == ref.scales.dtype
    assert torch.equal(codecs.as_bytes(got.data).cpu(), codecs.as_bytes(ref.data))
    assert torch.equal(got.scales.view(torch.uint8).cpu(), ref.scales.view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("given", (False, True))
@pytest.mark.parametrize("rows,k", [(1, 16), (130, 80), (257, 512)])
def test_quantize_nvfp4_kernel_bit_exact(dtype, given, rows, k):
    x = _special_input(rows, k, dtype, rows * k, "cuda")
    gs = torch.tensor(0.37, device="cuda") if given else None
    got = cutedsl_gemm.quantize_nvfp4(x, gs, backend="kernel")
    ref = R.quantize_nvfp4_reference(x.cpu(), None if gs is None else gs.cpu())
    assert got.global_scale.item() == ref.global_scale.item()
    assert torch.equal(got.data.view(torch.uint8).cpu(), ref.data.view(torch.uint8))
    assert torch.equal(got.scales.view(torch.uint8).cpu(), ref.scales.view(torch.uint8))


# ---------------------------------------------------------------- quantizer compile checks (CPU)


@pytest.fixture(scope="module")
def sm100_env():
    old = {k: os.environ.get(k) for k in ("CUTE_DSL_ARCH",)}
    os.environ["CUTE_DSL_ARCH"] = "sm_100a"
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.compile
@pytest.mark.parametrize(
    "recipe,fmt,dtype,cg",
    [("mx", f, torch.bfloat16, False) for f in ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")]
    + [("mx", "e4m3", torch.float32, False), ("nvfp4", "e2m1", torch.bfloat16, True),
       ("nvfp4", "e2m1", torch.float32, False)],
)
def test_quantizer_compiles_for_sm100(sm100_env, recipe, fmt, dtype, cg):
    from cutedsl_gemm.ops.quantize import compile_quantizer

    ptx = compile_quantizer(recipe, fmt, dtype, cg, keep_ptx=True, arch="sm_100a").__ptx__
    assert ptx and ".target sm_100a" in ptx
    # vectorised global loads of the input block, no approximate division anywhere
    assert re.search(r"ld\.global(\.\w+)*\.v[24]\.b(32|64)", ptx)
    assert "div.approx" not in ptx and "div.full" not in ptx and ".ftz" not in ptx
    if recipe == "nvfp4":
        assert "div.rn.f32" in ptx and "rcp.rn.f32" in ptx
        assert ("atom.global.max.u32" in ptx) == cg  # device-side tensor amax only when computing g


# ---------------------------------------------------------------- scaled_mm's block-scaled calls (CPU)

from torch.nn.functional import ScalingType, SwizzleType  # noqa: E402

B200 = ("sm_100a", 148)  # (arch, SMs) the CPU tests describe calls for
NVFP4_RECIPE = [ScalingType.BlockWise1x16, ScalingType.TensorWise]


def _operands(m, n, k, fa, fb, seed=0, nvfp4=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    if nvfp4:
        return R.quantize_nvfp4_reference(a), R.quantize_nvfp4_reference(w)
    return R.quantize_mx_reference(a, fa), R.quantize_mx_reference(w, fb)


def describe(a, b, scale_a, scale_b, *, scale_recipe_a=None, scale_recipe_b=None, swizzle_a=None, swizzle_b=None,
             fmt_a=None, fmt_b=None, bias=None, out_dtype=torch.bfloat16, schedule=None):
    """(GemmProblem, GemmOperands) of ``scaled_mm`` with these arguments on an sm_100a GPU, without one."""
    return P.describe_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, None, False, scale_recipe_a, scale_recipe_b,
                                schedule, None, torch.device("cpu"), fmt_a, fmt_b, swizzle_a, swizzle_b, target=B200)


def scaled_mm_args(qa, qw):
    """``scaled_mm``'s arguments for two quantizer outputs A (M, K) and W (N, K): ``b = W.t()``; NVFP4's global
    scales as F.scaled_mm passes them, [block scales, global] with [BlockWise1x16, TensorWise]."""
    if qa.global_scale is None:
        return (qa.data, qw.data.t(), qa.scales, qw.scales), dict(fmt_a=qa.fmt.name, fmt_b=qw.fmt.name)
    return ((qa.data, qw.data.t(), [qa.scales, qa.global_scale], [qw.scales, qw.global_scale]),
            dict(scale_recipe_a=NVFP4_RECIPE, scale_recipe_b=NVFP4_RECIPE))


def reference(qa, qw, bias=None):
    """float64 ``dequant(qa) @ dequant(qw).T (+ bias)`` through numerics.reference."""
    return R.reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales, fmt_a=qa.fmt, fmt_b=qw.fmt,
                                      global_scale_a=qa.global_scale, global_scale_b=qw.global_scale, bias=bias)


@pytest.mark.parametrize(
    "fa,fb,kind",
    [(E4M3, E4M3, "mxf8f6f4"), (E5M2, E4M3, "mxf8f6f4"), (E3M2, E2M3, "mxf8f6f4"), (E4M3, E2M1, "mxf8f6f4"),
     (E2M1, E2M1, "mxf4")],
    ids=lambda v: getattr(v, "name", v),
)
def test_reference_mm_mx_and_kind(fa, fb, kind):
    qa, qw = _operands(130, 72, 256, fa, fb, seed=1)
    p, _ = describe(qa.data, qw.data.t(), qa.scales, qw.scales, fmt_a=fa, fmt_b=fb)
    assert dispatch.select(p)[0].mma_kind == kind and RECIPES[p.recipe].k_block == 32
    out = reference(qa, qw)
    # independent: dequantize through plain scales and the element decoder
    def deq(q):
        return (codecs.decode(q.codes(), q.fmt).double().view(q.shape[0], -1, 32)
                * torch.exp2(q.plain_scales().view(torch.uint8).double() - 127).unsqueeze(-1)).view(q.shape)

    assert torch.allclose(out, deq(qa) @ deq(qw).t(), rtol=1e-12, atol=1e-12)


def test_reference_mm_nvfp4_global_scales():
    qa, qw = _operands(64, 32, 128, E2M1, E2M1, seed=2, nvfp4=True)
    args, kw = scaled_mm_args(qa, qw)
    p, ops = describe(*args, **kw)
    assert dispatch.select(p)[0].mma_kind == "mxf4nvf4" and RECIPES[p.recipe].k_block == 16
    assert torch.equal(ops.global_a, qa.global_scale.reshape(1))
    assert torch.equal(ops.global_b, qw.global_scale.reshape(1))
    out = reference(qa, qw)
    assert torch.allclose(out, qa.dequantize() @ qw.dequantize().t(), rtol=1e-12, atol=1e-12)
    # the global scales really are applied: dropping them changes the result by their product
    no_g = R.reference_blockscaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales)
    ratio = qa.global_scale.double().item() * qw.global_scale.double().item()
    assert torch.allclose(out, no_g * ratio, rtol=1e-12)


def test_scaled_mm_arguments_follow_torch_conventions():
    """F.scaled_mm's recipes and swizzles describe the same kernel operands as the defaults: SWIZZLE_32_4_4
    scales read in place, NO_SWIZZLE plain scales converted to the blocked layout, NVFP4's [block, global] lists."""
    qa, qw = _operands(128, 64, 256, E4M3, E4M3, seed=3)
    _, direct = describe(qa.data, qw.data.t(), qa.scales, qw.scales)
    p, via = describe(qa.data, qw.data.t(), qa.scales, qw.scales, scale_recipe_a=ScalingType.BlockWise1x32,
                      scale_recipe_b=ScalingType.BlockWise1x32, swizzle_a=SwizzleType.SWIZZLE_32_4_4,
                      swizzle_b=SwizzleType.SWIZZLE_32_4_4, out_dtype=torch.float32)
    assert (p.recipe, p.out_name) == ("mx", "fp32")
    assert torch.equal(via.scale_a, direct.scale_a) and torch.equal(via.scale_b, direct.scale_b)
    assert via.scale_a.data_ptr() == qa.scales.data_ptr()  # the blocked scales are read in place
    # NO_SWIZZLE plain scales are converted to the blocked layout
    _, plain = describe(qa.data, qw.data.t(), qa.plain_scales(), qw.plain_scales(), scale_recipe_a="BlockWise1x32",
                        scale_recipe_b="BlockWise1x32", swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b="NO_SWIZZLE")
    assert torch.equal(plain.scale_a, direct.scale_a) and torch.equal(plain.scale_b, direct.scale_b)
    assert torch.equal(R.reference_blockscaled_mm(qa.data, qw.data.t(), qa.plain_scales(), qw.plain_scales(),
                                                  swizzled=False), reference(qa, qw))
    # NVFP4 with [BlockWise1x16, TensorWise] lists (the recipes may also be left to the scale dtypes)
    na, nw = _operands(64, 32, 128, E2M1, E2M1, seed=4, nvfp4=True)
    args, kw = scaled_mm_args(na, nw)
    for recipes in (kw, {}):
        p, nv = describe(*args, **recipes)
        assert p.recipe == "nvfp4" and float(nv.global_a) == float(na.global_scale)
        assert torch.equal(nv.scale_a, P.scale_words("scale_a", na.scales.view(-1), 64, 128, 16))


def test_validation_errors():
    qa, qw = _operands(128, 64, 256, E4M3, E4M3, seed=5)
    na, nw = _operands(128, 64, 256, E2M1, E2M1, seed=5, nvfp4=True)
    st = ScalingType
    # wrong vector size for the scale dtype
    with pytest.raises(ValueError, match="vector size 16 does not match"):
        describe(qa.data, qw.data.t(), qa.scales, qw.scales, scale_recipe_a=st.BlockWise1x16,
                 scale_recipe_b=st.BlockWise1x16)
    # a recipe sm_100a does not run: the error names the ones it does
    with pytest.raises(ValueError, match="BlockWise1x32"):
        describe(qa.data, qw.data.t(), qa.scales, qw.scales, scale_recipe_a=st.BlockWise1x128,
                 scale_recipe_b=st.BlockWise1x128)
    # wrong scale dtype
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        describe(qa.data, qw.data.t(), qa.scales.view(torch.uint8), qw.scales)
    # NVFP4 scales with FP8 operands
    with pytest.raises(ValueError, match="e2m1 x e2m1"):
        describe(qa.data, qw.data.t(), na.scales, nw.scales)
    # mixed recipes
    with pytest.raises(ValueError, match="different recipes"):
        describe(na.data, nw.data.t(), na.scales, R.quantize_mx_reference(torch.ones(64, 256), "e2m1").scales)
    # K not a multiple of the block (FP8 K=48 passes TMA's 16-element rule but not MX's 32)
    a48 = torch.zeros(128, 48).to(torch.float8_e4m3fn)
    w48 = torch.zeros(64, 48).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of the scale block 32"):
        describe(a48, w48.t(), qa.scales, qw.scales)
    # scale element count for the wrong shape names the padded expectation
    with pytest.raises(ValueError, match="rows padded to 128"):
        describe(qa.data, qw.data.t(), qa.scales[:64], qw.scales)
    # global scales only with NVFP4
    with pytest.raises(ValueError, match="belong to NVFP4"):
        describe(qa.data, qw.data.t(), [qa.scales, torch.ones(1)], qw.scales,
                 scale_recipe_a=[st.BlockWise1x32, st.TensorWise], scale_recipe_b=st.BlockWise1x32)
    with pytest.raises(TypeError, match="float32"):
        describe(na.data, nw.data.t(), [na.scales, torch.ones(2)], nw.scales, scale_recipe_a=NVFP4_RECIPE,
                 scale_recipe_b=st.BlockWise1x16)
    # the GEMM itself needs a Blackwell GPU and says so
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Blackwell"):
            cutedsl_gemm.scaled_mm(qa.data, qw.data.t(), qa.scales, qw.scales)


def test_quantize_dispatch_cpu_is_reference():
    x = torch.randn(33, 64)
    a = cutedsl_gemm.quantize_mx(x, "e3m2")
    b = R.quantize_mx_reference(x, "e3m2")
    assert torch.equal(a.data, b.data) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))


# ---------------------------------------------------------------- block-scaled GEMM: host-side pieces (CPU)

from cutedsl_gemm.kernels.sm100 import blockscaled_gemm as bk  # noqa: E402

KIND_BLOCK = {"mxf8f6f4": 32, "mxf4": 32, "mxf4nvf4": 16}

# Instruction descriptors the DSL's own dense_blockscaled_gemm_persistent example compiles to for sm_100a
# (read from its PTX, static part before the run-time negate bits): MXF8 128x128 and 256x128, NVFP4
# 256x256, and MXFP4 128x128 (which that example issues as kind::mxf4nvf4.block32 with the same bits).
DSL_IDESC = {("mxf8f6f4", 128, 128): 0x08A00000, ("mxf8f6f4", 256, 128): 0x10A00000,
             ("mxf4nvf4", 256, 256): 0x10400480, ("mxf4", 128, 128): 0x08A00480}


@pytest.mark.parametrize("kind,sf_fmt", [("mxf8f6f4", 1), ("mxf4", 1), ("mxf4nvf4", 0)])
def test_block_scaled_idesc_fields(kind, sf_fmt):
    for m in (128, 256):
        d = bk.mx_idesc(kind, m, 128)
        assert (d >> 17) & 0x3F == 128 >> 3  # n_dim
        assert (d >> 27) & 0x3 == m >> 7  # m_dim
        assert (d >> 23) & 0x3 == sf_fmt  # scale format: UE8M0 (MX) / UE4M3 (NVFP4)
        assert (d >> 15) & 0x3 == 0  # K-major A and B
        assert (d >> 29) & 0x3 == 0 and (d >> 4) & 0x3 == 0  # scale ids come per MMA
        fmt = 1 if kind != "mxf8f6f4" else 0  # FP4 kinds: E2M1 is code 1; mxf8f6f4: OR-ed at run time
        assert (d >> 7) & 0x7 == fmt and (d >> 10) & 0x7 == fmt  # bit 12 clear (reserved on sm_100)
    for (k, m, n), want in DSL_IDESC.items():
        assert bk.mx_idesc(k, m, n) == want, (k, m, n)


@pytest.mark.parametrize("kind", sorted(KIND_BLOCK))
def test_scale_geometry_numbers(kind):
    g = bk.ScaleGeometry(kind, 128, False)
    per_mma = {"mxf8f6f4": 1, "mxf4": 2, "mxf4nvf4": 4}[kind]
    assert g.tile_k == (128 if kind == "mxf8f6f4" else 256)  # 128 bytes of each operand row
    assert g.k_atoms * 4 * KIND_BLOCK[kind] == g.tile_k  # atoms of 4 scale columns cover the K tile
    assert g.sfa_stage_bytes == g.sfb_stage_bytes == 512 * g.k_atoms
    assert g.tmem_cols(2 * 128) == 512 and g.sfa_tmem_cols == 4 * g.k_atoms
    # each atom its own 512 smem bytes and its own 4 TMEM columns, all within the operand's budget
    plan = g.copy_plan(2)
    assert sorted(o for o, _ in plan) == [512 * i for i in range(2 * g.k_atoms)]
    assert sorted(c for _, c in plan) == [4 * i for i in range(2 * g.k_atoms)]
    slots = [bk.scale_slot(kind, kb) for kb in range(4)]
    assert [c * 4 + b for c, b in slots] == [kb * per_mma for kb in range(4)]
    # the scale TMEM address carries the byte in bits 30-31, exactly like the descriptor's ids
    for kb in range(4):
        off_a, off_b, byte = g.scale_tmem_offsets(kb)
        assert (off_a & 0xFFFFFFFF) >> 30 == byte == (g.sf_id_bits(kb) >> 29) == (g.sf_id_bits(kb) >> 4) & 3
        assert off_a & 0xFFFF == slots[kb][0] * 4 and off_b & 0xFFFF == slots[kb][0] * 4
    with pytest.raises(ValueError, match="tile_n=128"):
        bk.ScaleGeometry(kind, 256, True)
    with pytest.raises(ValueError, match="kind must be one of"):
        bk.ScaleGeometry("mxf6", 128, False)


def _emulate_scale_path(kind, plain, rows, k):
    """The kernel's scale data path in torch, from the blocked global tensor to what MMA step kb of K
    tile kt reads for row r: TMA box -> smem stage [row atom][k atom][512 B] -> tcgen05.cp.32x128b.warpx4
    (smem row i of an atom -> lane i, 16 bytes -> 4 columns, copied to all four 32-lane groups) -> the
    MMA reading row r at lane r % 32, column block + r // 32, byte (see ScaleGeometry)."""
    g = bk.ScaleGeometry(kind, 128, False)
    # (row atoms, col atoms * 128)
    words = scale_layouts.blocked_scale_words(scale_layouts.to_blocked(plain), rows, plain.shape[1])
    row_atoms, w = words.shape
    col_atoms = w // 128
    view = words.view(row_atoms, col_atoms, 128)  # the kernel's (128, col_atoms, row_atoms), reversed
    k_tiles = -(-k // g.tile_k)
    got = torch.zeros(rows, k_tiles * g.tile_k // KIND_BLOCK[kind], dtype=torch.uint8)
    for tile in range(row_atoms):
        for kt in range(k_tiles):
            box = torch.zeros(g.k_atoms, 128, dtype=torch.int32)  # TMA zero-fills past the last column atom
            n_in = min(g.k_atoms, col_atoms - kt * g.k_atoms)
            box[:n_in] = view[tile, kt * g.k_atoms: kt * g.k_atoms + n_in]
            smem = box.view(torch.uint8).view(-1)  # rows_a_atoms == 1: [k atom][512 B]
            tmem = torch.zeros(128, g.sfa_tmem_cols * 4, dtype=torch.uint8)  # lanes x bytes
            for smem_off, col in g.copy_plan(g.rows_a_atoms):  # what the MMA warp's tcgen05.cp do
                tmem[:, col * 4: col * 4 + 16] = smem[smem_off: smem_off + 512].view(32, 16).repeat(4, 1)
            for kb in range(4):
                off, _, byte = g.scale_tmem_offsets(kb)
                assert off & 0xFFFF == bk.scale_slot(kind, kb)[0] * 4 * g.rows_a_atoms
                for r in range(128):
                    row = tile * 128 + r
                    if row >= rows:
                        continue
                    for j in range(g.info.mma_k // g.info.sf_vec):
                        cell = (off & 0xFFFF) + r // 32
                        got[row, (kt * 4 + kb) * (g.info.mma_k // g.info.sf_vec) + j] = tmem[r, cell * 4 + byte + j]
    return got[:, : plain.shape[1]]


@pytest.mark.parametrize("kind", sorted(KIND_BLOCK))
@pytest.mark.parametrize("rows,k", [(128, 512), (200, 96 * 32 // 32 * 4), (33, 1024 + 160)])
def test_scale_path_emulation_delivers_every_scale(kind, rows, k):
    k = k - k % (2 * KIND_BLOCK[kind])
    kb = k // KIND_BLOCK[kind]
    plain = torch.randint(1, 255, (rows, kb), generator=torch.Generator().manual_seed(rows + k), dtype=torch.uint8)
    assert torch.equal(_emulate_scale_path(kind, plain, rows, k), plain)


@pytest.mark.parametrize("kind,vec,ab", [("mxf8f6f4", 32, "Float8E4M3FN"), ("mxf4", 32, "Float4E2M1FN"),
                                         ("mxf4nvf4", 16, "Float4E2M1FN")])
def test_scale_geometry_matches_dsl_layouts(kind, vec, ab):
    """Our smem order and TMEM placement equal the DSL's make_smem_layout_sfa / make_tmem_layout_sfa
    (the layouts its own block-scaled kernels use) at sampled (row, K element, MMA step) points."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    import cutlass.utils.blockscaled_layout as bsl
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    g = bk.ScaleGeometry(kind, 128, False)
    mma_k, spm = g.info.mma_k, g.info.mma_k // vec
    pts = [(r, kk, kb) for r in (0, 5, 31, 32, 37, 64, 100, 127) for kk in range(0, mma_k, vec) for kb in range(4)]
    got = {}

    @cute.jit
    def probe():
        dt = getattr(cutlass, ab)
        sf = cutlass.Float8E4M3FN if vec == 16 else cutlass.Float8E8M0FNU
        mma = sm100_utils.make_blockscaled_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, sf, vec,
                                                              tcgen05.CtaGroup.ONE, (128, 128))
        tiler = (128, 128, g.tile_k)
        smem = cute.slice_(bsl.make_smem_layout_sfa(mma, tiler, vec, 1), (None, None, None, 0))
        tmem = bsl.make_tmem_layout_sfa(mma, tiler, vec, smem)
        for r, kk, kb in pts:
            kcrd = (kk % vec, kk // vec) if spm > 1 else (kk % vec, 0)
            mcrd = (((r % 32, r // 32), 0), kcrd)
            kb_crd = (kb % 2, kb // 2) if kind == "mxf4" else kb
            got[(r, kk, kb)] = (smem((mcrd, 0, kb_crd)), tmem((mcrd, 0, kb_crd)))  # TMEM: replica 0 of 4

    probe()
    for (r, kk, kb), (s_off, t_off) in got.items():
        block, byte0 = bk.scale_slot(kind, kb)
        c = block * 4 + byte0 + kk // vec  # scale column inside the K tile
        want_smem = (c // 4) * 512 + (r % 32) * 16 + (r // 32) * 4 + c % 4
        lane, col, byte = r % 32, block * 4 + r // 32, byte0 + kk // vec  # 8-bit TMEM element offsets:
        want_tmem = lane * (1 << 18) + col * 4 + byte  # lane << 16 in 32-bit columns, 4 bytes a column
        assert (s_off, t_off) == (want_smem, want_tmem), (r, kk, kb)


@pytest.mark.parametrize("kind", sorted(KIND_BLOCK))
def test_scale_tma_boxes(kind):
    g = bk.ScaleGeometry(kind, 128, True)
    for use_2cta in (False, True):
        found = bk.describe_scale_tma(kind, use_2cta)
        for name, stage in (("sfa", g.sfa_stage_bytes), ("sfb", g.sfb_stage_bytes)):
            d = found[name]
            assert "tma_format = U32" in d and f"copy_bits = {stage * 8}," in d, d
            assert ("sm_100_2sm" in d) == use_2cta, d  # 2-CTA loads signal the leader CTA's barrier


def test_budgets_smem_tmem_and_expect_tx():
    import cutlass

    from cutedsl_gemm.kernels.sm100 import BlockScaling, Sm100F8F6F4Gemm, describe_resources

    dense = describe_resources(Sm100F8F6F4Gemm())
    for kind in KIND_BLOCK:
        for use_2cta in (False, True):
            r = describe_resources(Sm100F8F6F4Gemm(cutlass.BFloat16, use_2cta, 128, False, scaling=BlockScaling(kind)))
            g = bk.ScaleGeometry(kind, 128, use_2cta)
            sf = g.sfa_stage_bytes + g.sfb_stage_bytes
            ab = r["a_stage_bytes"] + r["b_stage_bytes"]
            assert r["smem_bytes"] <= r["smem_capacity"] < r["smem_bytes"] + ab + sf  # as many stages as fit
            assert r["num_ab_stage"] >= 4
            assert r["tma_load_bytes"] == (ab + sf) * (2 if use_2cta else 1)
            assert r["tmem_cols"] == 512 >= 2 * 128 + g.sfa_tmem_cols + g.sfb_tmem_cols
    assert dense["tmem_cols"] == 256 and dense["tma_load_bytes"] == 32768


def test_blocked_scale_words_and_alignment():
    plain = torch.arange(200 * 9, dtype=torch.int64).remainder(251).to(torch.uint8).view(200, 9)
    blocked = scale_layouts.to_blocked(plain)
    w = scale_layouts.blocked_scale_words(blocked, 200, 9)
    assert w.shape == (2, 3 * 128) and w.dtype == torch.int32 and w.data_ptr() == blocked.data_ptr()
    atom = w[1, 128:256].contiguous().view(torch.uint8)  # row block 1, column block 1
    r, c = 130 - 128, 5 - 4
    assert atom[(r % 32) * 16 + (r // 32) * 4 + c] == plain[130, 5]
    assert P.scale_words("scale_a", blocked, 200, 9 * 32, 32).shape == (2, 384)
    with pytest.raises(ValueError, match="16-byte boundary"):  # TMA needs an aligned global base
        P.scale_words("scale_a", torch.zeros(512 + 4, dtype=torch.uint8)[4:], 128, 128, 32)


def test_packed_fp4_kinds_use_byte_rules():
    # K=32 FP4 passes for MXFP4 (packed bytes, 16-byte rows) but not for the unpacking mixed kind
    a = R.quantize_mx_reference(torch.randn(64, 32), "e2m1")
    w = R.quantize_mx_reference(torch.randn(16, 32), "e2m1")
    p, ops = describe(a.data, w.data.t(), a.scales, w.scales)
    assert dispatch.select(p)[0].mma_kind == "mxf4" and ops.a.shape == (64, 16)
    w8 = R.quantize_mx_reference(torch.randn(16, 32), "e4m3")
    with pytest.raises(ValueError, match="multiple of 128 elements"):
        describe(a.data, w8.data.t(), a.scales, w8.scales)
    # NVFP4 K=16 is one scale block but only 8 bytes per row: TMA needs 16
    n = R.quantize_nvfp4_reference(torch.randn(64, 16))
    with pytest.raises(ValueError, match="multiple of 32 elements"):
        describe(n.data, n.data.t(), n.scales, n.scales)


def test_block_scaled_rows_validate_and_out_checks():
    """The block-scaled rows are checked by the kernel's geometry (128-wide tiles only) and the table's kinds."""
    (inst,) = table.select(arch="sm_100a", recipe="mx", a_dtype="e2m1", out_dtype="bf16", bias_dtype=None,
                           schedule="1sm")
    assert inst.mma_kind == "mxf4" and inst.tile_k == 256  # 128 bytes of packed e2m1 per row and K tile
    with pytest.raises(table.InstanceTableError, match="tile_n=128"):
        table.validate(replace(inst, tile_n=64))
    with pytest.raises(table.InstanceTableError, match="is no tcgen05 kind"):
        table.validate(replace(inst, recipe="nvfp4", a_dtype=table.F8F6F4, b_dtype=table.F8F6F4))
    with pytest.raises(table.InstanceTableError, match="is no tcgen05 kind"):
        table.validate(replace(inst, recipe="1x128_128x128"))
    with pytest.raises(ValueError, match=r"out must be a \(4, 8\)"):
        P.check_out(torch.empty(4, 9), 4, 8, torch.float32)
    with pytest.raises(ValueError, match="row-major"):
        P.check_out(torch.empty(8, 4).t(), 4, 8, torch.float32)


def test_launch_plans_pass_the_kernel_arguments_in_order(monkeypatch):
    """What ``launch`` hands the compiled sm_100a kernels, in their parameter order (``Sm100F8F6F4Gemm.__call__``
    and ``call_block_scaled``): each operand in the storage view of its format, stand-ins elsewhere, K, the
    instruction-descriptor format codes and one persistent CTA per SM."""
    calls = []
    views = tuple(torch.zeros(128, w, dtype=torch.uint8) for w in (128, 96, 64))
    unit, no_bias = torch.ones(1), torch.zeros(1)
    monkeypatch.setattr(resources, "compiled", lambda inst: lambda *args: calls.append(args))
    monkeypatch.setattr(sm100_gemm, "device_info", lambda index: ("sm_100a", 148))
    monkeypatch.setattr(sm100_gemm, "_stand_ins", lambda index: (views, unit))
    monkeypatch.setattr(resources, "dummy_bias", lambda index: no_bias)

    def same(got, want):
        assert len(got) == len(want) and all(g is w if isinstance(w, torch.Tensor) else g == w
                                              for g, w in zip(got, want)), (got, want)

    a, b, out, sa, sb, bias = (torch.zeros(1) for _ in range(6))
    (dense,) = table.select(arch="sm_100a", recipe="tensor", out_dtype="bf16", bias_dtype="fp32", schedule="2sm")
    launch.plan(dense, 300, 64, 1, 0, k=256, fmt_a="e2m3", fmt_b="e2m1").run(a, b, out, sa, sb, bias)
    same(calls[-1], (views[0], a, views[2], views[0], views[1], b, out, sa, sb, bias, 256, 3, 5, 74))
    mx_1cta = block_scaled_instance("mxf8f6f4", False)
    launch.plan(mx_1cta, 64, 64, 1, 0, k=128, fmt_a="e4m3", fmt_b="e5m2").run(a, b, out, sa, sb, None)
    same(calls[-1], (a, views[1], views[2], b, views[1], views[2], sa, sb, out, unit, unit, no_bias, 128, 0, 1, 148))
    ga, gb = torch.ones(1), torch.ones(1)
    launch.plan(block_scaled_instance("mxf4nvf4", True), 256, 64, 1, 0, k=512, fmt_a="e2m1", fmt_b="e2m1").run(
        a, b, out, sa, sb, bias, ga, gb)  # packed FP4: the bytes go through the 8-bit view
    same(calls[-1], (a, views[1], views[2], b, views[1], views[2], sa, sb, out, ga, gb, bias, 512, 5, 5, 74))
    with pytest.raises(ValueError, match="without the split-K reduction"):
        launch.plan(mx_1cta, 64, 64, 2, 0, k=128, fmt_a="e4m3", fmt_b="e4m3")
    with pytest.raises(ValueError, match="give fmt_a and fmt_b"):
        launch.bind(mx_1cta, a, b, sa, sb, out)


def test_every_mx_pair_shares_one_compile_key():
    keys = set()
    for fa, fb in [(E4M3, E4M3), (E5M2, E2M3), (E3M2, E2M1), (E2M1, E4M3)]:
        qa, qw = _operands(128, 64, 256, fa, fb, seed=7)
        keys.add(dispatch.select(describe(qa.data, qw.data.t(), qa.scales, qw.scales, fmt_a=fa, fmt_b=fb,
                                          schedule="1sm")[0])[0])
    assert len(keys) == 1 and keys.pop().mma_kind == "mxf8f6f4"


# ---------------------------------------------------------------- block-scaled GEMM: sm_100a PTX (compile only)

CONFIGS = [(kind, two) for kind in ("mxf8f6f4", "mxf4", "mxf4nvf4") for two in (False, True)]
KIND_ROWS = {"mxf8f6f4": ("mx", table.F8F6F4), "mxf4": ("mx", "e2m1"), "mxf4nvf4": ("nvfp4", "e2m1")}


def block_scaled_instance(kind, two, out="bf16", bias="fp32"):
    recipe, operands = KIND_ROWS[kind]
    (inst,) = table.select(arch="sm_100a", recipe=recipe, a_dtype=operands, out_dtype=out, bias_dtype=bias,
                           schedule="2sm" if two else "1sm")
    assert inst.mma_kind == kind
    return inst


@pytest.fixture(scope="module")
def bs_compiled():
    """Every kind in 1-CTA and 2-CTA mode (with bias) compiled once for the module through the JIT cache, PTX kept."""
    from cutedsl_gemm.runtime.jit import KERNEL_CACHE

    out = {}
    before = KERNEL_CACHE.stats.compiles
    for kind, two in CONFIGS:
        with keep_artifacts("sm_100a"):
            out[(kind, two)] = launch.compiled(block_scaled_instance(kind, two)).__ptx__
    out["compiles"] = KERNEL_CACHE.stats.compiles - before
    return out


TMEM_OPERAND = r"\[(%r\d+(?:\+-?\d+)?)\]"


def _def_const(ptx, operand, base=None):
    """Offset from the TMEM base of an address operand ``%rN`` or ``%rN+OFF``: ``%rN`` is either formed
    by ``add.s32 %rN, <base>, CONST`` or is ``base`` itself (how scale TMEM addresses appear in the PTX)."""
    reg, _, off = operand.partition("+")
    m = re.search(rf"add\.s32\s+{re.escape(reg)},\s*(%r\d+),\s*(-?\d+);", ptx)
    if m and (base is None or m.group(1) == base):
        return int(m.group(2)) + int(off or 0)
    return int(off or 0) if reg == base else None


def _tmem_base(ptx, operand):
    """The register an ``add.s32`` scale address is formed from (the allocated TMEM address)."""
    return re.search(rf"add\.s32\s+{re.escape(operand.partition('+')[0])},\s*(%r\d+),", ptx).group(1)


@pytest.mark.compile
@pytest.mark.parametrize("kind,two", CONFIGS, ids=lambda v: {True: "2cta", False: "1cta"}.get(v, v))
def test_blockscaled_gemm_ptx(bs_compiled, kind, two):
    ptx = bs_compiled[(kind, two)]
    grp = 2 if two else 1
    g = bk.ScaleGeometry(kind, 128, two)
    assert ptx and ".target sm_100a" in ptx
    assert "kind::f8f6f4" not in ptx  # no dense MMA left in
    mmas = re.findall(rf"tcgen05\.mma\.cta_group::{grp}\.kind::{kind}\.block_scale\.block(\d+)\S*\s+"
                      rf"\[%r\d+\],\s*%rd\d+,\s*%rd\d+,\s*%r\d+,\s*{TMEM_OPERAND},\s*{TMEM_OPERAND}", ptx)
    assert len(mmas) == 4 and {b for b, _, _ in mmas} == {str(KIND_BLOCK[kind])}, mmas
    # scales: SFA right after the two 128-column accumulators, SFB after SFA; per MMA the column block
    # and the byte (bits 30-31) of ScaleGeometry
    base = _tmem_base(ptx, mmas[1][1])
    for kb, (_, ra, rb) in enumerate(mmas):
        off_a, off_b, _ = g.scale_tmem_offsets(kb)
        assert _def_const(ptx, ra, base) == 256 + off_a, (kb, ra)
        assert _def_const(ptx, rb, base) == 256 + g.sfa_tmem_cols + off_b, (kb, rb)
    # instruction descriptor of each MMA: static bits + that step's scale ids (run-time formats OR-ed
    # in for mxf8f6f4)
    static = bk.mx_idesc(kind, 256 if two else 128, 128)
    for kb in range(4):
        assert re.search(rf",\s*{static | g.sf_id_bits(kb)};", ptx), (kb, static | g.sf_id_bits(kb))
    # smem -> TMEM scale copies: one 32x128b.warpx4 per 512-byte atom of SFA and SFB, 16-byte
    # rows 128 B apart per 8 (descriptor 0x400800010000: SBO 8, LBO 1, version 1, no swizzle)
    cps = re.findall(rf"tcgen05\.cp\.cta_group::{grp}\.32x128b\.warpx4\s+{TMEM_OPERAND}", ptx)
    want = ({256 + c for _, c in g.copy_plan(g.rows_a_atoms)}
            | {256 + g.sfa_tmem_cols + c for _, c in g.copy_plan(g.rows_b_atoms)})
    assert len(cps) == len(want) == g.k_atoms * (g.rows_a_atoms + g.rows_b_atoms)
    assert {_def_const(ptx, r, base) for r in cps} == want
    assert re.search(r"or\.b64\s+%rd\d+,\s*%rd\d+,\s*70403103981568;", ptx)
    # TMA: operand loads (3 storage views each for mxf8f6f4, packed bytes only for FP4) + SFA + SFB,
    # all on the stage barrier; 2-CTA loads signal the leader CTA
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\.tile\.mbarrier::complete_tx::bytes\S*", ptx)
    assert len(loads) == (8 if kind == "mxf8f6f4" else 4), loads
    assert all(("cta_group::2" in ld) == two for ld in loads)
    assert f"tcgen05.alloc.cta_group::{grp}" in ptx and f"tcgen05.commit.cta_group::{grp}" in ptx


@pytest.mark.compile
def test_blockscaled_runtime_formats_and_compile_reuse(bs_compiled):
    assert bs_compiled["compiles"] == len(CONFIGS)  # one per kind and CTA mode
    ptx = bs_compiled[("mxf8f6f4", False)]
    # a_format / b_format come from two kernel parameters shifted to bits 7 and 10
    assert re.search(r"shl\.b32\s+%r\d+,\s*%r\d+,\s*7;", ptx) and re.search(r"shl\.b32\s+%r\d+,\s*%r\d+,\s*10;", ptx)
    from cutedsl_gemm.runtime.jit import KERNEL_CACHE

    before = KERNEL_CACHE.stats.compiles
    for fa, fb in [(E4M3, E4M3), (E5M2, E2M3), (E3M2, E2M1)]:
        qa, qw = _operands(256, 128, 256, fa, fb, seed=8)
        p, _ = describe(qa.data, qw.data.t(), qa.scales, qw.scales, fmt_a=fa, fmt_b=fb, bias=torch.zeros(128))
        inst, _ = dispatch.select(p)
        assert inst.schedule == "2sm" and launch.compiled(inst).__ptx__ == bs_compiled[("mxf8f6f4", True)]
    assert KERNEL_CACHE.stats.compiles == before


# ---------------------------------------------------------------- on an sm_100 GPU (pytest -m blackwell on a B200)

GPU_RECIPES = [("mx", E4M3, E4M3), ("mx", E5M2, E5M2), ("mx", E2M3, E2M3), ("mx", E3M2, E3M2), ("mx", E2M1, E2M1),
               ("mx", E4M3, E2M1), ("mx", E2M3, E5M2), ("nvfp4", E2M1, E2M1)]


def _gpu_quantized(recipe, fa, fb, m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g).float())).cuda()
    w = torch.randn(n, k, generator=g).cuda()
    if recipe == "nvfp4":
        return cutedsl_gemm.quantize_nvfp4(a), cutedsl_gemm.quantize_nvfp4(w)
    return cutedsl_gemm.quantize_mx(a, fa), cutedsl_gemm.quantize_mx(w, fb)


@pytest.mark.blackwell
@pytest.mark.parametrize("recipe,fa,fb", GPU_RECIPES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("m,n,k,use_2cta", [(128, 128, 256, False), (300, 136, 512, False), (300, 136, 512, True),
                                             (1024, 512, 2048, True)])
def test_blockscaled_gemm_vs_float64(recipe, fa, fb, m, n, k, use_2cta):
    from cutedsl_gemm.numerics.reference import rel_error

    qa, qw = _gpu_quantized(recipe, fa, fb, m, n, k, m + n + k)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")  # every element must be written
    args, kw = scaled_mm_args(qa, qw)
    got = cutedsl_gemm.scaled_mm(*args, out_dtype=torch.float32, schedule="2sm" if use_2cta else "1sm", out=out, **kw)
    ref = qa.dequantize() @ qw.dequantize().t()  # float64 on dequantized inputs (NVFP4: global scales in)
    assert got is out and torch.isfinite(out).all()
    assert rel_error(out, ref) < 1e-5  # fp32 accumulation of products exact in fp32


@pytest.mark.blackwell
@pytest.mark.parametrize("recipe", ["mx", "nvfp4"])
def test_blockscaled_gemm_bias_bf16_and_scaled_mm_adapter(recipe):
    from cutedsl_gemm.numerics.reference import rel_error

    m, n, k = 384, 256, 1024
    qa, qw = _gpu_quantized(recipe, E4M3, E4M3, m, n, k, 11)
    bias = torch.randn(n, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    args, kw = scaled_mm_args(qa, qw)
    got = cutedsl_gemm.scaled_mm(*args, bias, out_dtype=torch.bfloat16, out=out, **kw)
    ref = qa.dequantize() @ qw.dequantize().t() + bias.double()
    assert torch.isfinite(got).all() and rel_error(got, ref) < 8e-3  # bf16 output rounding
    # the same product through F.scaled_mm's arguments, plain (NO_SWIZZLE) scales converted on the device
    if recipe == "mx":
        via = cutedsl_gemm.scaled_mm(qa.data, qw.data.t(), qa.plain_scales(), qw.plain_scales(),
                                     out_dtype=torch.float32, scale_recipe_a=ScalingType.BlockWise1x32,
                                     scale_recipe_b=ScalingType.BlockWise1x32, swizzle_a=SwizzleType.NO_SWIZZLE,
                                     swizzle_b=SwizzleType.NO_SWIZZLE)
    else:
        via = cutedsl_gemm.scaled_mm(qa.data, qw.data.t(), [qa.scales, qa.global_scale], [qw.scales, qw.global_scale],
                                     out_dtype=torch.float32, scale_recipe_a=NVFP4_RECIPE, scale_recipe_b=NVFP4_RECIPE)
    assert rel_error(via, ref - bias.double()) < 1e-5


@pytest.mark.compile
def test_compile_instance_targets_the_instance_arch_whatever_the_dsl_default():
    """compile_instance builds an sm_100a kernel with CUTE_DSL_ARCH=sm_90a set (as on an H100 host): the
    block-scaled constructor's Blackwell TMA op checks the DSL's target arch, which compile_instance sets."""
    code = """
from cutedsl_gemm.runtime.compile import compile_instance
from cutedsl_gemm.selection.instances import select
from cutedsl_gemm.tools.ptx_inspect import keep_artifacts
(inst,) = select(arch="sm_100a", recipe="nvfp4", out_dtype="bf16", bias_dtype=None, schedule="2sm")
with keep_artifacts("sm_100a"):
    ptx = compile_instance(inst).__ptx__
print(".target sm_100a" in ptx and "kind::mxf4nvf4.block_scale" in ptx)
"""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("True"), run.stderr[-2000:]


@pytest.mark.compile
def test_sm100_kernels_trace_without_deprecated_dsl_names(sm100_env, deprecations):
    """As the Hopper GEMM (test_sm90_compile): the f8f6f4 and block-scaled kernels, 2-CTA with bias, trace
    without a DeprecationWarning (4.8 deprecated ``tcgen05.OperandMajorMode``, ``utils.TmemAllocator``, ...)."""
    from cutedsl_gemm.runtime.compile import compile_instance

    (dense,) = table.select(arch="sm_100a", recipe="tensor", out_dtype="bf16", bias_dtype="fp32", schedule="2sm")
    found = deprecations(
        lambda: compile_instance(dense),
        lambda: compile_instance(block_scaled_instance("mxf4nvf4", True)),
    )
    assert not found, found

"""The weight-only GEMM on the CPU: packing round trips (exhaustive on small tensors), the packed layout against
the DSL's WGMMA fragment, the register conversion's bit tricks, validation errors, selection, and the compile tier
(register-sourced WGMMA, the conversion instructions, no serialized WGMMAs)."""

import functools
import itertools
import re
import struct

import pytest
import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection import instances as table

HOPPER = ("sm_90a", 132)
# (bits, group, zero points) of every format the kernel runs
FORMATS = [(4, g, z) for g in IP.GROUPS for z in (False, True)] + [(4, 0, False), (8, 0, False)]


def _codes(n, k, bits, zeros, gen):
    lo, hi = IP.code_range(bits, zeros)
    return torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int64).to(torch.int8)


def _group_tensors(n, k, group, zeros, bits, gen):
    cols = 1 if group == 0 else k // group
    scales = torch.rand(n, cols, generator=gen) + 0.5
    z = torch.randint(0, (1 << bits), (n, cols), generator=gen, dtype=torch.int32) if zeros else None
    return scales, z


# ---- packing -----------------------------------------------------------------------------------------------------
def test_atom_layout_is_a_permutation_with_the_documented_corners():
    for bits in IP.BITS:
        idx = IP.atom_element_index(bits)
        assert idx.shape == (IP.words_per_atom(bits), 32 // bits)
        assert torch.equal(idx.flatten().sort().values, torch.arange(IP.ATOM_ROWS * IP.ATOM_K))
    idx = IP.atom_element_index(4)
    # thread 0, K block 0: elements (0,0) (0,1) (8,0) (8,1) (0,8) (0,9) (8,8) (8,9) at nibbles 0 4 1 5 2 6 3 7
    want = [(0, 0), (8, 0), (0, 8), (8, 8), (0, 1), (8, 1), (0, 9), (8, 9)]
    assert [divmod(int(v), IP.ATOM_K) for v in idx[0]] == want
    # thread 37 (warp 1, lane 5): rows 16 + 1 (+8), K 2 (+1, +8); its K block 5 is word 5 -> chunk 1, slot 1
    assert divmod(int(idx[512 + 4 * 37 + 1, 0]), IP.ATOM_K) == (17, 16 * 5 + 2)
    # int8: word 2kb + h holds elements 4h .. 4h + 3 at bytes 0 2 1 3; thread 0's word 1 is K block 0, elements 4..7
    idx8 = IP.atom_element_index(8)
    assert [divmod(int(v), IP.ATOM_K) for v in idx8[1]] == [(0, 8), (8, 8), (0, 9), (8, 9)]


@pytest.mark.parametrize("bits,group,zeros,n,k", [
    (*f, n, k) for f in FORMATS for n, k in ((8, 128), (72, 96), (200, 384), (64, 256)) if not f[1] or k % f[1] == 0])
def test_pack_unpack_round_trip(bits, group, zeros, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k + bits)
    q = _codes(n, k, bits, zeros, gen)
    scales, z = _group_tensors(n, k, group, zeros, bits, gen)
    packed, ks, kz = IP.pack_weights(q, scales, z, group, bits=bits)
    assert packed.dtype == torch.int32 and packed.shape == (-(-n // 64), -(-k // 128), 256 * bits)
    if group:
        assert ks.shape == (k // group, n) and ks.dtype == torch.bfloat16 and ks.is_contiguous()
        assert torch.equal(ks.t(), scales.to(torch.bfloat16))
    else:
        assert ks.shape == (1, n) and ks.dtype == torch.float32
    assert (kz is None) == (not zeros)
    q2, s2, z2 = IP.unpack_weights(packed, ks, kz, k=k, group=group, bits=bits)
    assert torch.equal(q2, q)
    assert torch.equal(s2.float(), ks.float().t() if group else scales)
    if zeros:
        assert torch.equal(z2.to(torch.int32), z)


@pytest.mark.parametrize("bits,zeros", [(4, False), (4, True), (8, False)])
def test_every_code_at_every_position_round_trips(bits, zeros):
    """Each position of one atom holds each code once over the codes' range (exhaustive on a 64 x 128 atom)."""
    lo, hi = IP.code_range(bits, zeros)
    span = hi - lo + 1
    base = torch.arange(IP.ATOM_ROWS * IP.ATOM_K).view(IP.ATOM_ROWS, IP.ATOM_K)
    for shift in range(span):
        q = ((base + shift) % span + lo).to(torch.int8)
        group = 128 if bits == 4 and zeros else 0
        scales = torch.ones(IP.ATOM_ROWS, 1)
        z = torch.zeros(IP.ATOM_ROWS, 1, dtype=torch.int32) if zeros else None
        packed, ks, kz = IP.pack_weights(q, scales, z, group, bits=bits)
        assert torch.equal(IP.unpack_weights(packed, ks, kz, k=IP.ATOM_K, group=group, bits=bits)[0], q)


def test_empty_k_packs_and_describes():
    packed, ks, _ = IP.pack_weights(torch.zeros(64, 0, dtype=torch.int8), torch.ones(64, 0), None, 128)
    assert packed.shape == (1, 0, 1024) and ks.shape == (0, 64)
    assert IP.unpack_weights(packed, ks, k=0)[0].shape == (64, 0)
    assert _describe(torch.zeros(3, 0, dtype=torch.bfloat16), packed, ks, None).is_empty


def test_padding_is_q_zero():
    q = torch.full((8, 32), 3, dtype=torch.int8)
    packed, _, _ = IP.pack_weights(q, torch.ones(8, 1), None, 32, bits=4)
    padded = IP.unpack_weights(packed, torch.ones(1, 64, dtype=torch.bfloat16), None, k=128, group=32, bits=4)[0]
    assert torch.equal(padded[:8, :32], q) and bool((padded[8:] == 0).all()) and bool((padded[:, 32:] == 0).all())


def test_quantize_weights_bounds_and_error():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen)
    for bits, group, sym in [(4, 32, True), (4, 128, False), (8, 0, True), (4, 0, True)]:
        q, s, z = IP.quantize_weights(w, bits, group, sym)
        lo, hi = IP.code_range(bits, not sym)
        assert q.dtype == torch.int8 and int(q.min()) >= lo and int(q.max()) <= hi
        assert (z is None) == sym
        deq = R.dequantize_weights(q, s, z, group)
        g = 256 if group == 0 else group
        step = s.double().repeat_interleave(g, dim=1)
        assert bool(((deq - w.double()).abs() <= step * 0.5 + 1e-6).all()), (bits, group, sym)
    with pytest.raises(ValueError, match="int8 weights take per-channel scales"):
        IP.quantize_weights(w, 8, 128)
    with pytest.raises(ValueError, match="zero points come with group-wise"):
        IP.quantize_weights(w, 4, 0, symmetric=False)


@pytest.mark.parametrize("call,match", [
    (lambda q, s: IP.pack_weights(q, s, None, 48), "group must be one of"),
    (lambda q, s: IP.pack_weights(q, s, None, 128, bits=3), "bits must be 4 or 8"),
    (lambda q, s: IP.pack_weights(q[:, :96], s[:, :1], None, 64), "K must be a multiple of the group"),
    (lambda q, s: IP.pack_weights(q[:12], s[:12], None, 128), "N must be a multiple of 8"),
    (lambda q, s: IP.pack_weights(q * 2, s, None, 128), r"codes symmetric \(signed\) must lie in \[-8, 7\]"),
    (lambda q, s: IP.pack_weights(q, s[:, :1].repeat(1, 3), None, 128), r"scales must be \(N, K / group\)"),
    (lambda q, s: IP.pack_weights(q.float(), s, None, 128), "must be an integer tensor"),
    (lambda q, s: IP.pack_weights(q + 8, s, torch.full((16, 2), 0.5), 128), "integer zero points"),
    (lambda q, s: IP.pack_weights(q, s, None, 128, dtype=torch.float32), "torch.bfloat16 or torch.float16"),
])
def test_pack_weights_refuses_bad_input(call, match):
    q = torch.randint(-8, 8, (16, 256), dtype=torch.int8)
    s = torch.ones(16, 2)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, s)


def test_kernel_layout_constants_agree_with_the_packer():
    from cutedsl_gemm.kernels.sm90 import weight_only_gemm as K

    assert (K.ATOM_ROWS, K.ATOM_K, K.ATOM_THREADS, K.CHUNK_WORDS, K.PER_CHANNEL) == \
        (IP.ATOM_ROWS, IP.ATOM_K, IP.ATOM_THREADS, IP.CHUNK_WORDS, IP.PER_CHANNEL)
    for bits in IP.BITS:
        cfg = K.WeightOnlyConfig(bits=bits, group=0)
        assert K.WeightOnlyPlan.words_per_thread(cfg) == IP.words_per_thread(bits)


# ---- the register conversion, emulated bit for bit --------------------------------------------------------------
def _half(bits16: int, act: str) -> float:
    if act == "bf16":
        return struct.unpack("<f", struct.pack("<I", bits16 << 16))[0]
    return struct.unpack("<e", struct.pack("<H", bits16))[0]


def _round_half(v: float, act: str) -> float:
    return float(torch.tensor(v, dtype=torch.float64).to(torch.bfloat16 if act == "bf16" else torch.float16))


def _fma2(a: int, b: int, c: int, act: str) -> list:
    """fma.rn.{bf16x2,f16x2}: each half rounded once from the exact a * b + c."""
    return [_round_half(_half((a >> s) & 0xFFFF, act) * _half((b >> s) & 0xFFFF, act) + _half((c >> s) & 0xFFFF, act),
                        act) for s in (0, 16)]


def _bits(v: float, act: str) -> int:
    t = torch.tensor([v], dtype=torch.bfloat16 if act == "bf16" else torch.float16)
    return int(t.view(torch.int16).item()) & 0xFFFF


@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_int4_conversion_gives_q_minus_z_exactly(act):
    """The kernel's steps on one word (``_Consumer.convert``): lop3 into the magic number, one FMA with -(magic + z)."""
    from cutedsl_gemm.kernels.sm90 import weight_only_gemm as K

    magic, one = K._pair(K._MAGIC[act]), K._pair(K._ONE[act])
    for u0, u1 in itertools.product(range(16), repeat=2):
        x = u0 | (u1 << 16)  # nibble 0 and nibble 4 of the word: the register's two elements
        m = (x & 0x000F000F) | magic
        sym = _fma2(m, one, K._pair(K._SYMMETRIC_OFFSET[act]), act)
        assert sym == [u0 - 8.0, u1 - 8.0]
        for z in (0, 5, 15):
            zp = K._pair(_bits(float(z), act))
            offset = _fma2(zp, K._pair(0x8000 | K._ONE[act]), K._pair(0x8000 | K._MAGIC[act]), act)
            off_bits = _bits(offset[0], act) | (_bits(offset[1], act) << 16)
            assert _fma2(m, one, off_bits, act) == [u0 - z, u1 - z]


@pytest.mark.parametrize("act", ["bf16", "fp16"])
def test_int8_conversion_gives_the_byte_exactly(act):
    for b0, b2 in itertools.product(range(256), range(0, 256, 7)):
        x = b0 | (b2 << 16)
        want = [float(b0 - 256 * (b0 >= 128)), float(b2 - 256 * (b2 >= 128))]
        if act == "bf16":
            m = (x & 0x007F007F) | 0x43004300
            c = (x & 0x00800080) | 0xC300C300
            got = _fma2(m, 0x3F803F80, c, act)
        else:
            m = (x & 0x00FF00FF) ^ 0x64806480
            got = _fma2(m, 0x3C003C00, 0xE480E480, act)
        assert got == want, (b0, b2)


# ---- references ----------------------------------------------------------------------------------------------------
def test_reference_is_the_float64_product_of_the_dequantized_weights():
    gen = torch.Generator().manual_seed(1)
    q = _codes(16, 64, 4, True, gen)
    s, z = _group_tensors(16, 64, 32, True, 4, gen)
    x = torch.randn(3, 64, generator=gen)
    w = (q.double() - z.double().repeat_interleave(32, 1)) * s.double().repeat_interleave(32, 1)
    assert torch.allclose(R.reference_weight_only_mm(x, q, s, z, 32), x.double() @ w.t())
    assert torch.allclose(R.dequantize_weights(q, s[:, :1], None, 0), q.double() * s[:, :1].double())


# ---- validation ----------------------------------------------------------------------------------------------------
def _operands(m=4, n=64, k=256, bits=4, group=128, zeros=False, act=torch.bfloat16):
    gen = torch.Generator().manual_seed(2)
    q = _codes(n, k, bits, zeros, gen)
    s, z = _group_tensors(n, k, group, zeros, bits, gen)
    packed, ks, kz = IP.pack_weights(q, s, z, group, bits=bits, dtype=act)
    return torch.randn(m, k, generator=gen).to(act), packed, ks, kz


def _describe(x, w, s, z, group=128, bits=4, out=None, split_k=None, target=HOPPER):
    return P.describe_weight_only(x, w, s, z, group, bits, out, split_k, torch.device("cpu"), target=target)


def test_describe_reads_the_shapes():
    x, w, s, z = _operands(m=5, n=200, k=384, group=64, zeros=True)
    p = _describe(x, w, s, z, group=64)
    assert (p.m, p.n, p.k, p.act_name, p.weight_format, p.recipe) == (5, 200, 384, "bf16", "int4", "group64_zeros")
    x, w, s, _ = _operands(bits=8, group=0, act=torch.float16)
    p = _describe(x, w, s, None, group=0, bits=8)
    assert (p.act_name, p.weight_format, p.recipe) == ("fp16", "int8", "channel")


@pytest.mark.parametrize("mutate,match", [
    (lambda o: {**o, "group": 64}, r"scales must be group-wise scales .* of shape \(4, 64\)"),
    (lambda o: {**o, "x": o["x"][:, :192].contiguous()}, "K must be a multiple of the group size"),
    (lambda o: {**o, "s": torch.ones(2, 128, dtype=torch.bfloat16)}, r"packed_w must be int32 \(2, 2, 1024\)"),
    (lambda o: {**o, "s": o["s"].float()}, "scales must be group-wise scales"),
    (lambda o: {**o, "w": torch.zeros(64, 128, dtype=torch.int8)}, "unpacked .* weights must be packed first"),
    (lambda o: {**o, "w": torch.zeros(1, 2, 2048, dtype=torch.int32)}, "holds int8 weights: pass bits=8"),
    (lambda o: {**o, "bits": 8}, "int8 weights take per-channel scales"),
    (lambda o: {**o, "x": o["x"].float()}, "x must be torch.bfloat16 or torch.float16"),
    (lambda o: {**o, "x": o["x"].t().contiguous().t()}, "x must be K-major"),
    (lambda o: {**o, "z": torch.zeros(2, 64, dtype=torch.bfloat16), "group": 0}, "zero points come with group-wise"),
    (lambda o: {**o, "z": torch.zeros(2, 64, dtype=torch.float16)}, "zeros must be zero points"),
    (lambda o: {**o, "out": torch.empty(4, 64)}, r"out must be a \(4, 64\) torch.bfloat16 tensor"),
    (lambda o: {**o, "split_k": 0}, "split_k must be an int"),
    (lambda o: {**o, "target": ("sm_100a", 148)}, "runs on Hopper"),
])
def test_describe_refuses_bad_calls(mutate, match):
    x, w, s, z = _operands()
    call = mutate({"x": x, "w": w, "s": s, "z": z, "group": 128, "bits": 4, "out": None, "split_k": None,
                   "target": HOPPER})
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        _describe(call["x"], call["w"], call["s"], call["z"], call["group"], call["bits"], call["out"],
                  call["split_k"], call["target"])


def test_ragged_n_needs_whole_scale_rows():
    gen = torch.Generator().manual_seed(3)
    q = _codes(64, 128, 4, False, gen)
    packed, ks, _ = IP.pack_weights(q, torch.ones(64, 1), None, 128)
    with pytest.raises(ValueError, match=r"N \(the scales' columns\) must be a multiple of 8"):
        _describe(torch.zeros(1, 128, dtype=torch.bfloat16), packed, ks[:, :60].contiguous(), None)


# ---- the instance table and selection ------------------------------------------------------------------------------
WEIGHT_ONLY_ROWS = table.select(op=table.WEIGHT_ONLY)


def test_table_covers_every_format_and_m():
    for act, (w, recipes) in itertools.product(("bf16", "fp16"), table.WEIGHT_ONLY_FORMATS.items()):
        for recipe in recipes:
            rows = [i for i in WEIGHT_ONLY_ROWS if (i.a_dtype, i.b_dtype, i.recipe) == (act, w, recipe)]
            for m in (1, 16, 17, 64, 65, 128, 1000, 1 << 20):
                assert sum(i.m_min <= m <= i.m_max for i in rows) == 1, (act, w, recipe, m)
    assert all(i.can_split_k and i.arch == "sm_90a" for i in WEIGHT_ONLY_ROWS)
    assert len(WEIGHT_ONLY_ROWS) == 2 * 8 * 4  # activations x (weight format, recipe) x M ranges
    # rows of the one table: the other ops are the scaled GEMMs (dense and grouped), whose readers never see a
    # weight-only recipe
    assert {i.op for i in table.INSTANCES} == {"gemm", table.QUANT_GEMM, table.GEMM_FP8_OUT, table.WEIGHT_ONLY,
                                               table.GROUPED_GEMM}
    assert not {i.recipe for i in WEIGHT_ONLY_ROWS} & set(P.ARCH_RECIPES["sm_90a"])
    assert P.SCHEDULES["sm_90a"] == ("small_m", "cooperative")


def test_instance_names_are_stable():
    """The disk cache and the catalog key instances by name."""
    names = [i.name for i in WEIGHT_ONLY_ROWS]
    assert len(set(names)) == len(names)
    assert names[0] == "sm_90a_weight_only_small_m_group32_bf16xint4_bf16_t128x16_c1x1_fast_swapab"
    assert "sm_90a_weight_only_small_m_channel_fp16xint8_fp16_t128x128_c1x1_fast_swapab" in names


def test_table_rejects_bad_rows_with_reason():
    inst = WEIGHT_ONLY_ROWS[0]
    for change, match in (({"recipe": "row"}, "run with recipes"), ({"out_dtype": "fp32"}, "activations' dtype"),
                          ({"tile_n": 24}, "tile_n"), ({"swap_ab": False}, "fixes")):
        with pytest.raises(table.InstanceTableError, match=match):
            table.validate(table.dataclasses.replace(inst, **change))


def _problem(m, n, k, split_k=None, recipe="group128"):
    return P.WeightOnlyProblem(m, n, k, "bf16", "int4", recipe, "sm_90a", 132, 0, split_k)


def test_selection_by_m_and_k_splits(monkeypatch):
    monkeypatch.setattr(dispatch, "launch_clusters", lambda index, inst: 132)
    for m, tile_n in ((1, 16), (16, 16), (17, 32), (64, 64), (100, 128), (4096, 128)):
        inst, _ = dispatch.select_weight_only(_problem(m, 8192, 8192))
        assert (inst.tile_m, inst.tile_n, inst.recipe, inst.b_dtype) == (128, tile_n, "group128", "int4")
    # N = K = 8192 decode: 64 weight tiles on 132 SMs -> 2 splits; a wide output needs none; short K bounds them
    assert dispatch.select_weight_only(_problem(1, 8192, 8192))[1] == 2
    assert dispatch.select_weight_only(_problem(1, 1024, 8192))[1] == 16
    assert dispatch.select_weight_only(_problem(1, 1024, 512))[1] == 2
    assert dispatch.select_weight_only(_problem(1, 57344, 8192))[1] == 1
    assert dispatch.select_weight_only(_problem(1, 8192, 8192, split_k=5))[1] == 5
    with pytest.raises(dispatch.NoKernelError, match="recipe=row"):
        dispatch.select_weight_only(_problem(1, 64, 128, recipe="row"))
    # the scaled GEMM's selection never takes a weight-only row, even named by its recipe and types
    with pytest.raises(dispatch.NoKernelError, match="recipe=group128"):
        dispatch.select_gemm("sm_90a", "group128", "bf16", "int4", "bf16", None, 16, "fast")


def test_kernel_resources_of_every_row():
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import WeightOnlyPlan
    from cutedsl_gemm.tools.ptx_inspect import kernel_resources

    for inst in WEIGHT_ONLY_ROWS:
        cfg = table.weight_only_config(inst)
        smem, stages = kernel_resources(inst)
        assert stages == WeightOnlyPlan.max_stages(cfg) >= 2, inst.name
        assert smem == WeightOnlyPlan.smem_usage(cfg, stages), inst.name


# ---- compile tier ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _compiled(act, weights, recipe, tile_n):
    from cutedsl_gemm.runtime.compile import compile_instance
    from cutedsl_gemm.tools.ptx_inspect import inspect_compiled, keep_artifacts

    inst = next(i for i in WEIGHT_ONLY_ROWS
                if (i.a_dtype, i.b_dtype, i.recipe, i.tile_n) == (act, weights, recipe, tile_n))
    with keep_artifacts(inst.arch):
        return inst, inspect_compiled(inst.name, compile_instance(inst))


COMPILED = [("bf16", "int4", "group128", 16), ("bf16", "int4", "group32_zeros", 64), ("fp16", "int8", "channel", 128)]


@pytest.mark.compile
def test_packed_layout_is_the_wgmma_register_fragment():
    """Trace the kernel's register-sourced MMA and check every element of every thread's fragment (both warp
    groups of a 128-row tile) against the packer's layout."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from cutedsl_gemm.runtime.compile import targeting

    coords = {}

    @cute.jit
    def trace():
        mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32, (2, 1, 1),
            tiler_mn=(64, 16), a_source=warpgroup.OperandSource.RMEM)
        ident = cute.make_identity_tensor((128, IP.ATOM_K))
        parts = [mma.get_slice(t).partition_A(ident) for t in range(256)]
        coords.update({t: [p[i] for i in range(cute.size(p))] for t, p in enumerate(parts)})
        frag = cute.make_rmem_tensor(parts[0].shape, cutlass.BFloat16)
        coords["layouts"] = (str(frag.layout), str(cute.recast_tensor(frag, cutlass.Int32).layout))

    with targeting("sm_90a"):
        cute.compile(trace, options="--gpu-arch sm_90a")
    # The kernel writes K block kb's register i as word 4 kb + i of the recast fragment: elements (2i, 2i + 1).
    assert coords["layouts"] == ("((2,2,2),1,8):((1,2,4),0,8)", "((1,2,2),1,8):((1,1,2),0,4)")
    for bits in IP.BITS:
        idx = IP.atom_element_index(bits)
        for t in range(256):
            atom, tt = divmod(t, IP.ATOM_THREADS)
            for kb, e in itertools.product(range(IP.ATOM_K // 16), range(8)):
                if bits == 4:
                    word, slot = kb, IP.NIBBLE_OF_ELEMENT[e]
                else:
                    word, slot = 2 * kb + e // 4, IP.BYTE_OF_ELEMENT[e % 4]
                stored = (word // 4) * 4 * IP.ATOM_THREADS + 4 * tt + word % 4
                row, k = coords[t][kb * 8 + e]
                assert divmod(int(idx[stored, slot]), IP.ATOM_K) == (row - IP.ATOM_ROWS * atom, k), (bits, t, kb, e)


@pytest.mark.compile
@pytest.mark.parametrize("which", COMPILED)
def test_register_sourced_wgmma_and_conversion_instructions(which):
    from cutedsl_gemm.tools.ptx_inspect import WEIGHT_CONVERSION, WGMMA_RS

    inst, rep = _compiled(*which)
    act = "bf16" if inst.a_dtype == "bf16" else "f16"
    # A from four registers, B from a shared-memory descriptor: 8 K blocks per K tile, 4 K tiles in the loop's code
    rs = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{inst.tile_n}k16\.f32\.{act}\.{act}\s+"
                    r"\{[^}]*\},\s*\{%r\d+, %r\d+, %r\d+, %r\d+\},\s*%rd\d+", rep.ptx)
    assert len(rs) == 32, rep.name
    assert len(re.findall(WGMMA_RS, rep.ptx)) == 32, rep.name  # the pattern the CPU demo reports
    assert not rep.has(r"wgmma\.mma_async[^\n]*\},\s*%rd\d+,\s*%rd\d+")  # no shared-memory A
    assert rep.has(r"lop3\.b32"), rep.name
    assert rep.has(rf"fma\.rn\.{act}x2"), rep.name
    assert all(rep.has(p) for p in WEIGHT_CONVERSION.values()), rep.name
    assert rep.has(r"ld\.shared\.v4\.b32"), rep.name  # 128-bit reads of the packed words
    assert rep.has(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global"), rep.name  # the weight atoms by TMA
    assert rep.frame_bytes == 0, f"{rep.name} spills"
    # launched early (PDL, every weight-only kernel): the first weight atoms go into L2 before the wait for the
    # previous kernel
    assert rep.ptx.index("cp.async.bulk.prefetch.tensor.4d.L2.global") < rep.ptx.index("griddepcontrol.wait")


@pytest.mark.compile
@pytest.mark.parametrize("which", COMPILED)
def test_wgmma_never_serialized(which):
    """ptxas serializes every WGMMA when it finds the A registers or accumulators touched while in flight (C7514,
    C7515); the converted fragments alternate between two register sets, retired by wait_group(1)."""
    from cutedsl_gemm.tools.ptx_inspect import (
        find_ptxas,
        ptxas_performance_notes,
        ptxas_registers_and_spills,
        ptxas_report,
    )

    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("no CUDA toolkit ptxas on this machine (PATH, CUDA_HOME, /usr/local/cuda*)")
    inst, rep = _compiled(*which)
    assert ptxas_performance_notes(rep.ptx, inst.arch, ptxas) == [], rep.name
    assert ptxas_registers_and_spills(ptxas_report(rep.ptx, inst.arch, ptxas))[1] == 0, rep.name


@pytest.mark.compile
def test_cpu_demo_lists_the_weight_only_and_activation_quantizing_kernels(capsys):
    from cutedsl_gemm.tools import cli

    assert cli._demo_cpu() == 0
    out = capsys.readouterr().out
    assert "MISSING" not in out and out.rstrip().endswith("PASS")
    assert "sm_90a_weight_only_small_m_group128_bf16xint4_bf16_t128x16_c1x1_fast_swapab: " in out
    assert re.search(r"\n +32 x the register-sourced WGMMA \(A: the converted weights\), e\.g\. wgmma\.mma_async\.sync"
                     r"\.aligned\.m64n16k16\.f32\.bf16\.bf16 \{[^}]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+", out)
    assert re.search(r"\n +\d+ x the weights' magic-number conversion, e\.g\. lop3\.b32 ", out)
    assert re.search(r"\n +\d+ x the weights' scale FMA, e\.g\. fma\.rn\.bf16x2 ", out)
    assert re.search(r"weight-only int4 g128 +quantization error", out)
    # quantize_scaled_mm's one kernel, with the group quantizer's instructions in its producer warps
    assert "sm_90a_quant_gemm_small_m_1x128_128x128_bf16xe4m3_bf16_t128x16_c1x1_promoted_swapab: " in out
    assert re.search(r"\n +\d+ x the activations' e4m3 conversion, e\.g\. cvt\.rn\.satfinite\.e4m3x2\.f32 ", out)
    assert re.search(r"\n +\d+ x the activations' 16-byte shared stores, e\.g\. st\.shared\.v4\.b32 ", out)
    # ... per token for an int8 weight, and the epilogue emitting FP8 in 1x128 groups
    assert "sm_90a_quant_gemm_small_m_row_bf16xint8_bf16_t128x16_c1x1_fast_swapab: " in out
    assert re.search(r"\n +\d+ x the activations' row reads \(16 bytes\), e\.g\. ld\.global(\.nc)?\.v4\.b32 ", out)
    assert re.search(r"\n +\d+ x the activations' int8 rounding, e\.g\. cvt\.rni\.s32\.f32 ", out)
    assert "sm_90a_gemm_fp8_out_cooperative_1x128_128x128_e4m3xe4m3_bf16_t128x128_c2x1_promoted: " in out
    assert re.search(r"\n +\d+ x the output's 16-byte global stores, e\.g\. st\.global\.v4\.b32 ", out)

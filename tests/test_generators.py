"""generators/ and the command line: table validity rules, AOT export (C objects, registry, CMake, linking),
precompile into the JIT cache, the kernel catalog rendered for one instance per kernel family, the parallel
runner (progress, Ctrl-C) and the CLI's arguments and errors. Compiling tests keep to a few instances."""

import ctypes
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cutedsl_gemm.generators import catalog as C
from cutedsl_gemm.generators.runner import Interrupted, SelectionError, TaskResult, code_key, pick
from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmPlan
from cutedsl_gemm.selection import dispatch
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
# The weight-only GEMM of int4 weights in groups of 128 at M <= 16 (the C export skips the weight-only family)
WEIGHT_ONLY_DECODE = M.select(op=M.WEIGHT_ONLY, recipe="group128", a_dtype="bf16", b_dtype="int4", tile_n=16)[0].name
# the AOT tests' instances
EXPORTED = tuple(dict.fromkeys([ROW_BF16, TENSOR_BIAS, SMALL, MID, WIDE_DECODE, PAIR, CLUSTER4, BLOCK2D_SHORT_K,
                                 BLOCK2D_LONG_K]))


def _instance(name):
    hits = [i for i in M.INSTANCES if i.name == name]
    assert hits, f"{name} is not in the table"
    return hits[0]


# ------------------------------------------------------------------------------------------------
# Instance table and selection (no compile)
# ------------------------------------------------------------------------------------------------
def test_validate_rejects_promoted_tile_too_wide_for_registers():
    bad = replace(_instance(ROW_BF16), tile_n=256, accum="promoted")
    with pytest.raises(M.InstanceTableError, match=r"promoted accumulation.*tile_n=256 > \d+ does not fit") as e:
        M.validate(bad)
    assert bad.name in str(e.value)


def test_validate_rejects_stages_beyond_shared_memory():
    with pytest.raises(M.InstanceTableError,
                       match=r"12 stages of \d+ B .* need \d+ B of shared memory; the budget is \d+ B"):
        M.validate(replace(_instance(ROW_BF16), stages=12))


def test_validate_rejects_a_paired_tile_too_wide_for_its_registers():
    # two CTAs per SM launch at 128 registers per thread: ptxas cannot build 64x208 (C7602), 64x192 builds
    paired = replace(_instance(PAIR), accum="fast", tile_n=256)
    with pytest.raises(M.InstanceTableError, match=r"two CTAs per SM .* at most 192 wide, got tile_n=256"):
        M.validate(paired)
    M.validate(replace(paired, tile_n=192))


def test_expand_refuses_a_bad_table_row():
    row = M.TileConfig("sm_90a", "gemm", "cooperative", ("row",), 128, 256, accum="promoted")
    with pytest.raises(M.InstanceTableError, match="does not fit"):
        M.expand([row])


def test_pick_selects_filters_and_explains_empty_selections():
    sel = pick("sm_90a", [ROW_BF16])
    assert [i.name for i in sel] == [ROW_BF16]
    assert len(pick("sm_90a", ["_bf16_"], limit=3)) == 3
    assert len(set(pick("sm_90a"))) == len(pick("sm_90a"))  # identical expanded rows appear once
    with pytest.raises(SelectionError, match=r"no sm_80 instances \(archs with instances: (sm_\w+, )*sm_90a"):
        pick("sm_80")
    with pytest.raises(SelectionError, match="no sm_90a instance name contains"):
        pick("sm_90a", ["no-such-kernel"])


def test_cli_export_of_an_arch_without_instances_is_an_error(tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    assert main(["export", "--arch", "sm_80", "--out", str(tmp_path)]) == 2
    assert "no sm_80 instances" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cli_export_of_an_arch_without_an_exporter_is_an_error(tmp_path, capsys, monkeypatch):
    from cutedsl_gemm.generators import export as E
    from cutedsl_gemm.tools.cli import main

    arch = next((i.arch for i in M.INSTANCES if i.arch != "sm_90a"), None)
    if arch is None:
        pytest.skip("the table holds only sm_90a instances")
    # Every family of the table has an exporter: stand for a new one that has none yet.
    monkeypatch.setattr(E, "exportable", lambda inst: inst.arch == "sm_90a")
    assert main(["export", "--arch", arch, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cutedsl-gemm export: no AOT exporter for {arch} gemm instances") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------
# AOT export
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from cutedsl_gemm.generators import export as E

    out = tmp_path_factory.mktemp("aot")
    t0 = time.perf_counter()
    names = [*EXPORTED, WEIGHT_ONLY_DECODE]
    res = E.export("sm_90a", out, names, jobs=0, stream=io.StringIO())  # in-process: the DSL is loaded already
    res.seconds = time.perf_counter() - t0
    return res


@pytest.fixture(scope="module")
def exported_lib(exported):
    from cutedsl_gemm.generators import export as E

    # Share the CUDA runtime torch loaded, where it did (GPU machines); else the toolkit's.
    return E.build_shared(exported.out_dir, cudart=E.loaded_cudart())


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * 4),
                ("stride", ctypes.c_int64 * 4)]


class Kernel(ctypes.Structure):
    _fields_ = ([(f, ctypes.c_char_p) for f in ("name", "arch", "op", "schedule", "recipe", "a_dtype", "b_dtype",
                                                "out_dtype", "bias_dtype", "accum")]
                + [(f, ctypes.c_int32) for f in ("tile_m", "tile_n", "cluster_m", "cluster_n", "stages", "split_k",
                                                 "swap_ab", "split_tail", "ctas_per_sm", "rate", "rate_long_k")]
                + [("m_min", ctypes.c_int64), ("m_max", ctypes.c_int64), ("launch", ctypes.c_void_p)])


def _args_type(arg_fields):
    """cutedsl_gemm_args_t as the export rendered it (its fields follow the kernel entry's arguments)."""
    ctypes_of = {"cutedsl_gemm_tensor_t": Tensor, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64}
    return type("Args", (ctypes.Structure,), {"_fields_": [(f["field"], ctypes_of[f["ctype"]]) for f in arg_fields]})


def _open(path, args_type):
    lib = ctypes.CDLL(str(path))
    lib.cutedsl_gemm_find.restype = ctypes.POINTER(Kernel)
    lib.cutedsl_gemm_find.argtypes = ([ctypes.c_char_p] * 8
                                      + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32])
    lib.cutedsl_gemm_find_by_name.restype = ctypes.POINTER(Kernel)
    lib.cutedsl_gemm_kernel_at.restype = ctypes.POINTER(Kernel)
    lib.cutedsl_gemm_launch.argtypes = [ctypes.POINTER(Kernel), ctypes.POINTER(args_type), ctypes.c_void_p]
    lib.cutedsl_gemm_last_error.restype = ctypes.c_char_p
    return lib


def _view(data, shape, stride):
    return Tensor(data, len(shape), (ctypes.c_int64 * 4)(*shape), (ctypes.c_int64 * 4)(*stride))


def _fake_args(args_type, m, n, k, base=1 << 20):
    """Descriptors of a valid row-wise problem at made-up, aligned addresses (checks only, no launch).
    Fields not set here (bias, split-K buffers) stay empty: the registry fills in what the kernel ignores."""
    return args_type(a=_view(base, (m, k), (k, 1)), b=_view(base + (1 << 24), (k, n), (1, k)),
                     d=_view(base + (2 << 24), (m, n), (n, 1)), scale_a=_view(base + (3 << 24), (m, 1), (1, 1)),
                     scale_b=_view(base + (4 << 24), (1, n), (n, 1)))


def _check_exported_objects(out, keys):
    """Each exported key has its header (wrapper, module loader) and an object defining its init and entry."""
    for key in keys:
        header = (out / "kernels" / f"{key}.h").read_text()
        assert f"cute_dsl_{key}_wrapper" in header and f"{key}_Kernel_Module_Load" in header
        syms = subprocess.run(["nm", "-g", "--defined-only", str(out / "kernels" / f"{key}.o")],
                              capture_output=True, text=True, check=True).stdout
        assert f"_mlir_{key}_cuda_init" in syms and f"_mlir_{key}__mlir_ciface_" in syms


@pytest.mark.compile
def test_export_writes_objects_headers_registry_and_build_files(exported):
    out = exported.out_dir
    keys = [code_key(_instance(n)) for n in EXPORTED]
    assert sorted(exported.kernels) == sorted(keys)
    # the weight-only instance selected with them is skipped by name, and recorded with the reason
    assert [i.name for i in exported.skipped] == [WEIGHT_ONLY_DECODE]
    assert not (out / "kernels" / f"{code_key(_instance(WEIGHT_ONLY_DECODE))}.o").exists()
    skipped = json.loads((out / "export.json").read_text())["skipped"]
    assert list(skipped) == [WEIGHT_ONLY_DECODE] and "cutedsl_gemm_args_t" in skipped[WEIGHT_ONLY_DECODE]
    _check_exported_objects(out, keys)
    registry = (out / "cutedsl_gemm_registry.c").read_text()
    assert all(f"cdg_launch_{k}" in registry for k in keys)
    assert "cutedsl_gemm_find" in (out / "cutedsl_gemm_registry.h").read_text()
    assert "add_library(cutedsl_gemm_kernels STATIC" in (out / "cutedsl_gemm_kernels.cmake").read_text()
    record = json.loads((out / "export.json").read_text())  # what the next export into `out` removes
    assert record["complete"] and {str(p.relative_to(out)) for p in exported.files} <= set(record["files"])
    print(f"export of {len(keys)} instances: {exported.seconds:.1f} s")


@pytest.mark.compile
@pytest.mark.parametrize("library", ["exported_lib", "exported_sm100_lib"])
def test_exported_library_links_with_every_symbol_resolved(library, request):
    # build_shared links with -Wl,--no-undefined (and -Werror on the registry), so reaching here proves it.
    syms = subprocess.run(["nm", "-D", "--defined-only", str(request.getfixturevalue(library))], capture_output=True,
                          text=True, check=True).stdout
    for fn in ("cutedsl_gemm_find", "cutedsl_gemm_launch", "cutedsl_gemm_kernel_count", "cutedsl_gemm_last_error"):
        assert f" T {fn}\n" in syms


@pytest.mark.compile
def test_registry_lookup_and_argument_checks(exported, exported_lib):
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    assert lib.cutedsl_gemm_kernel_count() == len(EXPORTED)
    k = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", M_TEST, 0, 0, 0)
    assert k and k.contents.name.decode() == ROW_BF16 and k.contents.m_max == 1 << 31 and k.contents.cluster_m == 2
    assert k.contents.bias_dtype is None and k.contents.tile_n == _instance(ROW_BF16).tile_n
    assert k.contents.rate == dispatch.tile_rate(_instance(ROW_BF16)) and k.contents.ctas_per_sm == 1
    assert k.contents.rate_long_k == dispatch.tile_rate(_instance(ROW_BF16), dispatch.LONG_K)
    small = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", M_SMALL,
                                  0, 0, 0)
    assert small.contents.name.decode() == SMALL and small.contents.swap_ab == 1 and k.contents.swap_ab == 0
    # with K too: the epilogue term sends short K to the two-CTAs-per-SM tile, long K to the 128-row one,
    # as dispatch.wave_cost does over the same candidates
    assert _instance(PAIR).ctas_per_sm == 2 and _instance(ROW_BF16).ctas_per_sm == 1
    for kdim, want in ((256, PAIR), (7168, ROW_BF16)):
        by_python = min((_instance(x) for x in (ROW_BF16, PAIR)),
                        key=lambda i, kdim=kdim: dispatch.wave_cost(i, 6144, 7168, 132, kdim))
        got = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", 6144,
                                    7168, kdim, 132)
        assert got.contents.name.decode() == by_python.name == want, (kdim, lib.cutedsl_gemm_last_error())
    # with N (and K) and the SM count, over every exported row-wise candidate, C picks what dispatch.wave_cost picks,
    # 4-CTA cluster slots included
    assert _instance(CLUSTER4).cluster_m == 4
    row_names = [x for x in EXPORTED if _instance(x).recipe == "row"]
    for m, n, kdim in ((M_TEST, 512, 1024), (6144, 576, 7168), (1024, 4096, 512), (6144, 7168, 256),
                       (8192, 8192, 8192), (3072, 576, 7168)):
        holding = [_instance(x) for x in row_names if _instance(x).m_min <= m <= _instance(x).m_max]
        by_python = min(holding, key=lambda i: dispatch.wave_cost(i, m, n, 132, kdim))
        got = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", m, n,
                                    kdim, 132)
        assert got.contents.name.decode() == by_python.name, (m, n, kdim)
    assert lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", 6144, 576,
                                 7168, 132).contents.name.decode() == CLUSTER4
    # decode and mid-M outputs: the weight stream against the MMAs, with and without K, and the estimated rate's
    # margin (M = 128, N = 10240: without it the swapped 128x128 would take the shape from the pair)
    assert (_instance(MID).tile_m, _instance(MID).swap_ab, _instance(SMALL).swap_ab) == (64, False, True)
    wide = _instance(WIDE_DECODE)
    assert dispatch.has_estimated_rate(wide) and not any(dispatch.has_estimated_rate(_instance(x)) for x in
                                                         EXPORTED if x != WIDE_DECODE)

    def by_python(m, n, kdim):
        holding = [_instance(x) for x in row_names if _instance(x).m_min <= m <= _instance(x).m_max]
        return min(holding, key=lambda i: dispatch.wave_cost(i, m, n, 132, kdim)).name

    for m, n, kdim in ((64, 8192, 8192), (64, 57344, 8192), (128, 57344, 8192), (128, 57344, 0), (100, 4096, 14336),
                       (128, 10240, 8192), (96, 16384, 0)):
        got = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", m, n,
                                    kdim, 132)
        assert got.contents.name.decode() == by_python(m, n, kdim), (m, n, kdim)
    # 64x128 and 128x64 swapped run the same tiles: the faster WGMMAs take them
    assert by_python(128, 57344, 8192) == by_python(64, 57344, 8192) == MID
    assert by_python(128, 10240, 8192) == PAIR
    margin = dispatch.ESTIMATED_RATE_MARGIN
    try:
        dispatch.ESTIMATED_RATE_MARGIN = 1000
        assert by_python(128, 10240, 8192) == WIDE_DECODE
    finally:
        dispatch.ESTIMATED_RATE_MARGIN = margin
    # the 2D recipe's long-K rate: C switches at the same K as dispatch.tile_rate
    assert (_instance(BLOCK2D_SHORT_K).tile_n, _instance(BLOCK2D_LONG_K).tile_n) == (128, 192)
    for kdim, want in ((1536, BLOCK2D_SHORT_K), (dispatch.LONG_K - 128, BLOCK2D_SHORT_K),
                       (dispatch.LONG_K, BLOCK2D_LONG_K), (8192, BLOCK2D_LONG_K)):
        got = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"128x128_128x128", b"e4m3", b"e4m3", b"bf16", None,
                                    b"promoted", 3072, 8192, kdim, 132)
        by_python = min((_instance(x) for x in (BLOCK2D_SHORT_K, BLOCK2D_LONG_K)),
                        key=lambda i, kdim=kdim: dispatch.wave_cost(i, 3072, 8192, 132, kdim))
        assert got.contents.name.decode() == by_python.name == want, kdim
        assert got.contents.rate_long_k == dispatch.tile_rate(_instance(want), dispatch.LONG_K)
    kb = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"tensor", b"e4m3", b"e5m2", b"fp32", b"fp32", b"fast", M_TEST,
                               0, 0, 0)
    assert kb and kb.contents.name.decode() == TENSOR_BIAS
    assert not lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e5m2", b"e4m3", b"bf16", None, b"promoted",
                                     1, 0, 0, 0)
    assert b"no exported kernel for op=gemm arch=sm_90a recipe=row A=e5m2" in lib.cutedsl_gemm_last_error()

    def refused(args, kernel=k):
        rc = lib.cutedsl_gemm_launch(kernel, ctypes.byref(args), None)
        return rc, lib.cutedsl_gemm_last_error().decode()

    bad = _fake_args(Args, 256, 512, 1024)
    bad.b.shape[0] = 512  # K of b differs from K of a
    rc, msg = refused(bad)
    assert rc == 1 and "b.shape[0]=512 must equal a.shape[1]=1024" in msg
    bad = _fake_args(Args, 256, 512, 1000)  # K must be a multiple of 16 (TMA rows)
    assert refused(bad) == (1, f"{ROW_BF16}: a.shape[1]=1000 must be a multiple of 16")
    bad = _fake_args(Args, 256, 512, 1024)
    bad.a.data += 8
    assert "a.data" in refused(bad)[1] and "not 16-byte aligned" in refused(bad)[1]
    bad = _fake_args(Args, 256, 512, 1024)
    bad.scale_a.ndim = 1
    assert "scale_a must have 2 modes, got ndim=1" in refused(bad)[1]
    bad = _fake_args(Args, 256, 512, 1024)
    bad.d.stride[1] = 2
    assert "d.stride[1] must be 1 (compiled-in layout), got 2" in refused(bad)[1]
    # The bias instance ties the bias length to N and takes (1,) scales.
    args = _fake_args(Args, 256, 512, 1024)
    args.scale_a, args.scale_b = _view(1 << 20, (1,), (1,)), _view(1 << 20, (1,), (1,))
    args.bias = _view(1 << 20, (496,), (1,))
    assert "bias.shape[0]=496 must equal b.shape[1]=512" in refused(args, kb)[1]
    # An empty output launches nothing and needs no GPU.
    assert lib.cutedsl_gemm_launch(k, ctypes.byref(_fake_args(Args, 0, 512, 1024)), None) == 0
    if not torch.cuda.is_available():
        rc, msg = refused(_fake_args(Args, 256, 512, 1024))  # valid: gets as far as asking CUDA for the SM count
        assert rc == 2 and "querying the SM count failed" in msg


# ------------------------------------------------------------------------------------------------
# AOT export of the sm_100a GEMMs: the same exporter and registry
# ------------------------------------------------------------------------------------------------
SM100_1SM = select_gemm("sm_100a", "tensor", M.F8F6F4, M.F8F6F4, "bf16", None, 128, "fast").name
SM100_2SM = select_gemm("sm_100a", "tensor", M.F8F6F4, M.F8F6F4, "bf16", None, 129, "fast").name
SM100_NVFP4 = select_gemm("sm_100a", "nvfp4", "e2m1", "e2m1", "bf16", "fp32", 64, "fast").name
SM100_EXPORTED = (SM100_1SM, SM100_2SM, SM100_NVFP4)


@pytest.fixture(scope="module")
def exported_sm100(tmp_path_factory):
    from cutedsl_gemm.generators import export as E

    out = tmp_path_factory.mktemp("aot_sm100")
    return E.export("sm_100a", out, list(SM100_EXPORTED), jobs=0, stream=io.StringIO())


@pytest.fixture(scope="module")
def exported_sm100_lib(exported_sm100):
    from cutedsl_gemm.generators import export as E

    return E.build_shared(exported_sm100.out_dir, cudart=E.loaded_cudart())


def _sm100_args(args_type, m, n, k, a_bytes=None, b_bytes=None, base=1 << 20):
    """Descriptors of a valid e4m3 x e4m3 (or, with a_bytes / b_bytes, packed e2m1 in the 8-bit views) sm_100a
    problem at made-up, 256-byte aligned addresses: the unused 6- and 4-bit views are stand-ins."""
    a_bytes, b_bytes = a_bytes or k, b_bytes or k
    stand_in = {bits: _view(base + (7 << 24), (128, row), (row, 1)) for bits, row in ((6, 96), (4, 64))}
    return args_type(a8=_view(base, (m, a_bytes), (a_bytes, 1)), a6=stand_in[6], a4=stand_in[4],
                     b8=_view(base + (1 << 24), (n, b_bytes), (b_bytes, 1)), b6=stand_in[6], b4=stand_in[4],
                     d=_view(base + (2 << 24), (m, n), (n, 1)), scale_a=_view(base + (3 << 24), (1,), (1,)),
                     scale_b=_view(base + (4 << 24), (1,), (1,)), k=k, fmt_a=0, fmt_b=0)


def test_merged_params_hold_every_entrys_arguments_once():
    from cutedsl_gemm.generators.c_export import ExportError
    from cutedsl_gemm.generators.export import merged_params

    dense = (("a8", "tensor"), ("c", "tensor"), ("k", "int32"), ("stream", "stream"))
    scaled = (("a8", "tensor"), ("sfa", "tensor"), ("c", "tensor"), ("k", "int32"), ("stream", "stream"))
    assert merged_params({dense, scaled}) == scaled
    assert merged_params({dense}) == dense
    with pytest.raises(ExportError, match="argument k is a int64 in one selected entry"):
        merged_params({dense, (("a8", "tensor"), ("k", "int64"), ("stream", "stream"))})


@pytest.mark.compile
def test_sm100_export_writes_objects_headers_and_registry(exported_sm100):
    out = exported_sm100.out_dir
    insts = [_instance(n) for n in SM100_EXPORTED]
    assert [(i.schedule, i.mma_kind) for i in insts] == [("1sm", "f8f6f4"), ("2sm", "f8f6f4"), ("1sm", "mxf4nvf4")]
    keys = [code_key(i) for i in insts]
    assert sorted(exported_sm100.kernels) == sorted(keys)
    _check_exported_objects(out, keys)
    # The dense kernels' __call__ and the block-scaled call_block_scaled, in one argument struct.
    assert [n for n, _ in exported_sm100.kernels[keys[0]]["params"]][6:8] == ["c", "scale_a"]
    assert [n for n, _ in exported_sm100.kernels[keys[2]]["params"]][6:9] == ["sfa", "sfb", "c"]
    fields = [f["field"] for f in exported_sm100.arg_fields]
    assert fields == ["a8", "a6", "a4", "b8", "b6", "b4", "sfa", "sfb", "d", "scale_a", "scale_b", "bias", "k",
                      "fmt_a", "fmt_b", "max_clusters"]
    header = (out / "cutedsl_gemm_registry.h").read_text()
    assert "cutedsl_gemm_tensor_t sfa;  /* sm_100a block-scaled kinds: a's block scales" in header
    assert "int32_t fmt_a;  /* sm_100a: a's format" in header
    assert 'cutedsl_gemm_find("gemm", "sm_100a", "tensor", "f8f6f4", "f8f6f4",' in header
    registry = (out / "cutedsl_gemm_registry.c").read_text()
    assert all(f"cdg_launch_{k}" in registry for k in keys)
    record = json.loads((out / "export.json").read_text())
    assert record["complete"] and [e["name"] for e in record["instances"]] == list(SM100_EXPORTED)


@pytest.mark.compile
def test_sm100_registry_lookup_and_argument_checks(exported_sm100, exported_sm100_lib):
    Args = _args_type(exported_sm100.arg_fields)
    lib = _open(exported_sm100_lib, Args)
    assert lib.cutedsl_gemm_kernel_count() == len(SM100_EXPORTED)

    def find(m, n=0, kdim=0, sms=0, recipe=b"tensor", ab=b"f8f6f4", bias=None):
        return lib.cutedsl_gemm_find(b"gemm", b"sm_100a", recipe, ab, ab, b"bf16", bias, b"fast", m, n, kdim, sms)

    # dispatch's rule: 1-CTA tiles to M = 128, the 2-CTA MMA above; C picks what select_gemm picks
    for m in (1, 100, 128, 129, 1000, 1 << 20):
        for n, kdim, sms in ((0, 0, 0), (7168, 4096, 148)):
            got = find(m, n, kdim, sms)
            want = select_gemm("sm_100a", "tensor", M.F8F6F4, M.F8F6F4, "bf16", None, m, "fast", n=n, sms=sms, k=kdim)
            assert got and got.contents.name.decode() == want.name, (m, n)
            assert got.contents.schedule.decode() == ("1sm" if m <= 128 else "2sm")
    k1 = find(128)
    assert k1.contents.name.decode() == SM100_1SM and (k1.contents.cluster_m, k1.contents.split_k) == (1, 0)
    assert find(129).contents.cluster_m == 2 and find(129).contents.m_min == 129
    kb = find(64, recipe=b"nvfp4", ab=b"e2m1", bias=b"fp32")
    assert kb and kb.contents.name.decode() == SM100_NVFP4 and kb.contents.bias_dtype == b"fp32"
    assert not find(64, recipe=b"nvfp4", ab=b"e2m1")  # only the bias instance was exported
    assert b"no exported kernel for op=gemm arch=sm_100a recipe=nvfp4 A=e2m1" in lib.cutedsl_gemm_last_error()
    assert not find(129, recipe=b"nvfp4", ab=b"e2m1", bias=b"fp32")  # its 2-CTA sibling was not exported

    def refused(args, kernel=k1):
        rc = lib.cutedsl_gemm_launch(kernel, ctypes.byref(args), None)
        return rc, lib.cutedsl_gemm_last_error().decode()

    bad = _sm100_args(Args, 256, 512, 1024)
    bad.a6.data += 16  # the sub-byte views are 32-byte aligned (TMA's unpacking formats)
    assert refused(bad) == (1, f"{SM100_1SM}: a6.data {hex(bad.a6.data)} is not 32-byte aligned")
    bad = _sm100_args(Args, 256, 512, 1024)
    bad.a6.shape[1] = 100
    assert refused(bad) == (1, f"{SM100_1SM}: a6.shape[1]=100 must be a multiple of 96")
    bad = _sm100_args(Args, 256, 500, 1024)  # bf16 rows of 16 bytes
    assert "d.shape[1]=500 must be a multiple of 8" in refused(bad)[1]
    bad = _sm100_args(Args, 256, 512, 1024)
    bad.fmt_a = 2
    assert refused(bad) == (1, f"{SM100_1SM}: fmt_a=2 is not a format code of this kernel "
                               "(e4m3 0, e5m2 1, e2m3 3, e3m2 4, e2m1 5)")
    bad.fmt_a = 3  # e2m3 is read from the 6-bit view, which holds a stand-in here
    assert refused(bad) == (1, f"{SM100_1SM}: e2m3 operand a is read from a6, which must be 256 x 768 bytes "
                               "(M x K=1024 x 6 bits), got 128 x 96")
    bad = _sm100_args(Args, 256, 512, 1024)
    bad.k = 2048
    assert "e4m3 operand a is read from a8, which must be 256 x 2048 bytes" in refused(bad)[1]
    bad = _sm100_args(Args, 256, 512, 1024)
    bad.b8.shape[0] = 256
    assert "e4m3 operand b is read from b8, which must be 512 x 1024 bytes (N x K=1024" in refused(bad)[1]
    bad.k = -1
    assert refused(bad) == (1, f"{SM100_1SM}: k=-1 is negative")
    # The packed FP4 kind takes e2m1 only, two per byte in the 8-bit views, and a bias of N.
    fp4 = _sm100_args(Args, 64, 512, 1024, a_bytes=512, b_bytes=512)
    fp4.sfa, fp4.sfb = _view(1 << 20, (1, 128 * 2), (256, 1)), _view(1 << 20, (4, 128 * 2), (256, 1))
    fp4.bias = _view(1 << 20, (512,), (1,))
    assert refused(fp4, kb) == (1, f"{SM100_NVFP4}: fmt_a=0 is not a format code of this kernel (e2m1 5)")
    fp4.fmt_a = fp4.fmt_b = 5
    bad = _sm100_args(Args, 64, 512, 1024)
    bad.sfa, bad.sfb, bad.bias, bad.fmt_a, bad.fmt_b = fp4.sfa, fp4.sfb, fp4.bias, 5, 5
    assert "e2m1 operand a is read from a8, which must be 64 x 512 bytes" in refused(bad, kb)[1]
    bad = _sm100_args(Args, 64, 512, 1024, a_bytes=512, b_bytes=512)
    bad.sfa, bad.sfb, bad.bias, bad.fmt_a, bad.fmt_b = _view((1 << 20) + 4, (1, 256), (256, 1)), fp4.sfb, fp4.bias, 5, 5
    assert "sfa.data" in refused(bad, kb)[1] and "not 16-byte aligned" in refused(bad, kb)[1]
    # An empty output launches nothing and needs no GPU.
    assert lib.cutedsl_gemm_launch(k1, ctypes.byref(_sm100_args(Args, 0, 512, 1024)), None) == 0
    if not torch.cuda.is_available():  # valid: they get as far as asking CUDA for the SM count
        for kernel, args in ((k1, _sm100_args(Args, 256, 512, 1024)), (kb, fp4)):
            rc, msg = refused(args, kernel)
            assert rc == 2 and "querying the SM count failed" in msg, msg


@pytest.mark.compile
def test_registry_split_k_rules(exported, exported_lib):
    fields = [f["field"] for f in exported.arg_fields]
    if "splits" not in fields or not getattr(_instance(SMALL).sm90_config(), "split_k", False):
        pytest.skip("the table has no split-K instance")
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    small = lib.cutedsl_gemm_find_by_name(SMALL.encode())
    coop = lib.cutedsl_gemm_find_by_name(ROW_BF16.encode())
    nosplit = lib.cutedsl_gemm_find_by_name(TENSOR_BIAS.encode())
    assert small.contents.split_k == 1 and coop.contents.split_k == 1 and nosplit.contents.split_k == 0

    def launch(kernel, args):
        return lib.cutedsl_gemm_launch(kernel, ctypes.byref(args), None), lib.cutedsl_gemm_last_error().decode()

    args = _fake_args(Args, 64, 1040, 1024)
    tensorwise = _fake_args(Args, 64, 1040, 1024)  # the non-split instance is per-tensor with a bias
    tensorwise.scale_a, tensorwise.scale_b = _view(5 << 24, (1,), (1,)), _view(6 << 24, (1,), (1,))
    tensorwise.bias = _view(7 << 24, (1040,), (1,))
    tensorwise.splits = 2
    rc, msg = launch(nosplit, tensorwise)
    assert rc == 1 and "splits=2, but this is not a split-K instance" in msg, msg
    args.splits = 3  # 8 K tiles: splits of 3, 3, 2
    args.max_clusters = 132  # given: the buffers are checked after the grid is known, without a device query
    inst = _instance(SMALL)
    tiles = inst.output_tiles(64, 1040)  # the swapped decode kernel tiles N by tile_m, M by tile_n
    need = tiles * 3 * inst.tile_m * inst.tile_n
    assert inst.swap_ab and tiles == 9 * -(-64 // inst.tile_n)
    rc, msg = launch(small, args)
    assert rc == 1 and f"splits=3 needs a workspace of >= {need} fp32" in msg, msg
    args.workspace = _view(1 << 30, (need - 1,), (1,))
    assert "needs a workspace" in launch(small, args)[1]
    args.workspace = _view(1 << 30, (need,), (1,))
    rc, msg = launch(small, args)
    assert rc == 1 and f"splits=3 needs >= {tiles} zeroed int32 counters" in msg, msg
    args.splits = 99
    assert "splits=99, at most" in launch(small, args)[1]


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_fragment_builds_a_consumer(exported, tmp_path):
    src = tmp_path / "consumer"
    src.mkdir()
    (src / "main.c").write_text(
        '#include <stdio.h>\n#include "cutedsl_gemm_registry.h"\n'
        "int main(void) {\n"
        "    for (int i = 0; i < cutedsl_gemm_kernel_count(); ++i)\n"
        "        printf(\"%s\\n\", cutedsl_gemm_kernel_at(i)->name);\n"
        "    return 0;\n}\n")
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(consumer C)\n"
        f'include("{exported.out_dir}/cutedsl_gemm_kernels.cmake")\n'
        "add_executable(consumer main.c)\ntarget_link_libraries(consumer PRIVATE cutedsl_gemm_kernels)\n")
    build = tmp_path / "build"
    for cmd in (["cmake", "-S", str(src), "-B", str(build)], ["cmake", "--build", str(build)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = subprocess.run([str(build / "consumer")], capture_output=True, text=True, check=True)
    assert sorted(run.stdout.split()) == sorted(EXPORTED)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["cooperative", "split_k", "cluster4"])
def test_exported_gemm_runs_and_matches_reference(exported, exported_lib, which):
    from cutedsl_gemm.numerics import reference as R

    name, m, splits = {"cooperative": (ROW_BF16, M_TEST, 0), "split_k": (SMALL, M_SMALL, 3),
                       "cluster4": (CLUSTER4, M_TEST, 0)}[which]
    inst = _instance(name)
    if which == "split_k" and not getattr(inst.sm90_config(), "split_k", False):
        pytest.skip("the table has no split-K instance")
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    torch.manual_seed(7)
    n, k = 1040, 1024
    a, w = torch.randn(m, k, device="cuda") * 3, torch.randn(n, k, device="cuda")
    qa, sa, qw, sw = R.quantize_operands(a, w, "row")
    scale_a, scale_b = sa.reshape(m, 1).contiguous(), sw.reshape(1, n).contiguous()
    b = qw.t()  # (K, N) column-major, as torch._scaled_mm takes it
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # unwritten tiles stay NaN

    def view(t):
        return _view(t.data_ptr(), tuple(t.shape), tuple(t.stride()))

    # bias (none) and max_clusters (0: the device's SM count) stay empty
    args = Args(a=view(qa), b=view(b), d=view(out), scale_a=view(scale_a), scale_b=view(scale_b))
    if which == "split_k":
        tiles = inst.output_tiles(m, n)
        workspace = torch.empty(tiles * splits * inst.tile_m * inst.tile_n, dtype=torch.float32, device="cuda")
        counters = torch.zeros(tiles, dtype=torch.int32, device="cuda")
        args.workspace, args.counters, args.splits = view(workspace), view(counters), splits
    if which == "cluster4":  # max_clusters 0: the registry's default, 30 4-CTA clusters on the H100
        kern = lib.cutedsl_gemm_find_by_name(name.encode())
    else:
        kern = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", m, n,
                                     k, 0)
    assert kern and kern.contents.name.decode() == name, lib.cutedsl_gemm_last_error()
    rc = lib.cutedsl_gemm_launch(kern, ctypes.byref(args), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert rc == 0, lib.cutedsl_gemm_last_error()
    torch.cuda.synchronize()
    err = R.rel_error(out, R.reference_gemm(qa, sa, qw, sw, "row"))
    assert err <= 2e-3, f"{name}: relative Frobenius error {err:.2e} > 2e-3"
    if which == "split_k":
        assert int(counters.abs().sum()) == 0  # the kernel hands the counters back zeroed


# ------------------------------------------------------------------------------------------------
# Precompile into the JIT cache
# ------------------------------------------------------------------------------------------------
def test_precompile_uses_the_runtime_cache_key(monkeypatch):
    """precompile must fill exactly the entry scaled_mm looks up."""
    from cutedsl_gemm.generators.precompile import cache_key
    from cutedsl_gemm.runtime import launch

    seen = []

    class Recorder:
        def get(self, key, build, *, arch=None, load=True):
            seen.append((key, arch))
            return "compiled"

    monkeypatch.setattr(launch, "KERNEL_CACHE", Recorder())
    insts = [_instance(ROW_BF16), _instance(WEIGHT_ONLY_DECODE)]
    for inst in insts:
        launch.compiled(inst)
    assert seen == [cache_key(i) for i in insts]


@pytest.mark.compile
def test_precompile_fills_the_cache_once(tmp_path, monkeypatch):
    from cutedsl_gemm.generators.precompile import precompile
    from cutedsl_gemm.runtime.jit import KERNEL_CACHE

    monkeypatch.setenv("CUTEDSL_GEMM_CACHE_DIR", str(tmp_path))
    names = [ROW_BF16, WEIGHT_ONLY_DECODE]  # a GEMM and a weight-only GEMM
    first = precompile("sm_90a", names, jobs=1)  # one spawned worker process
    assert (first.selected, first.compiled, first.failed) == (2, 2, [])
    for name in names:
        assert KERNEL_CACHE.entry_path(_instance(name), "sm_90a").stat().st_size > 0
    t0 = time.perf_counter()
    second = precompile("sm_90a", names, jobs=1)
    took = time.perf_counter() - t0
    assert (second.compiled, second.already_cached) == (0, 2)
    assert took < 0.5, f"a precompile with everything cached took {took:.2f} s"
    print(f"precompile no-op: {took * 1e3:.1f} ms")


# ------------------------------------------------------------------------------------------------
# Catalog
# ------------------------------------------------------------------------------------------------
def test_catalog_sample_is_one_instance_per_kernel_family():
    sample = C.sample(M.INSTANCES)
    families = {C.family_key(i) for i in M.INSTANCES}
    assert sorted(map(C.family_key, sample)) == sorted(families)  # every family, once
    assert C.select(sampled=True) == sample
    hopper = C.select("sm_90a", sampled=True)
    assert 8 <= len(hopper) <= 20 and set(hopper) <= set(sample)
    for arch in {i.arch for i in M.INSTANCES}:  # every recipe and type of each arch's GEMMs
        mine, table = ([i for i in rows if i.arch == arch and i.op == "gemm"] for rows in (sample, M.INSTANCES))
        for axis in C.SAMPLE_AXES:
            assert {getattr(i, axis) for i in mine} == {getattr(i, axis) for i in table}, (arch, axis)
    # the weight-only GEMMs: a family per weight format and kind of scales (a group size is a parameter), with
    # every activation type
    weight_only = [i for i in sample if i.op == M.WEIGHT_ONLY]
    assert sorted((i.b_dtype, C.family_key(i)[3]) for i in weight_only) == [
        ("int4", "group-wise"), ("int4", "group-wise with zero points"), ("int4", "per-channel"),
        ("int8", "per-channel")]
    assert {i.a_dtype for i in weight_only} == {"bf16", "fp16"}
    # the Hopper family key separates the code paths: schedules, block scales, swapped, paired, last-wave split,
    # accumulation
    assert {i.schedule for i in hopper} == {"small_m", "cooperative"}
    assert {(i.swap_ab, i.ctas_per_sm, i.split_tail, i.accum) for i in hopper} >= {
        (True, 1, False, "promoted"), (False, 1, False, "fast"), (False, 2, False, "promoted"),
        (True, 2, False, "promoted"), (False, 1, True, "promoted")}


def _expected_mma(inst) -> str:
    """The MMA instruction an instance's PTX must hold, from its configuration."""
    if inst.op == M.WEIGHT_ONLY:  # the converted weights (register-sourced A) x the activations, both in their dtype
        act = {"bf16": "bf16", "fp16": "f16"}[inst.a_dtype]
        return rf"wgmma\.mma_async\.sync\.aligned\.m64n{inst.tile_n}k16\.f32\.{act}\.{act}"
    if inst.arch == "sm_90a":  # the swapped kernels run W on WGMMA's A side; the operands are the kernel's (a kernel
        # that quantizes its activations multiplies them in its a_dtype)
        cfg = inst.sm90_config()
        first, second = (cfg.b_dtype, cfg.a_dtype) if inst.swap_ab else (cfg.a_dtype, cfg.b_dtype)
        n = Sm90GemmPlan.wgmma_n(cfg)
        if inst.a_dtype == "int8":
            return rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.satfinite\.s32\.s8\.s8"
        return rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.{first}\.{second}"
    return rf"tcgen05\.mma\.cta_group::{inst.cluster_m}\.kind::{inst.mma_kind}\.[\w.:]+"


@pytest.mark.compile
def test_catalog_renders_the_sample_with_its_facts(tmp_path, monkeypatch):
    sample = C.select(sampled=True)
    rep = C.write_catalog(tmp_path, sample, jobs=2, scope="sample", stream=io.StringIO())
    assert (rep.selected, rep.compiled, rep.failed) == (len(sample), len(sample), [])
    data = json.loads((tmp_path / C.FACTS_NAME).read_text())
    doc = (tmp_path / C.DOC_NAME).read_text()
    for inst in sample:
        key = code_key(inst)
        facts = data["entries"][key]
        assert data["instances"][inst.name] == key
        assert facts["registers"] > 0 and facts["smem_bytes"] > 0 and facts["stages"] >= 2, key
        (mma, count), = facts["mma"].items()
        assert re.fullmatch(_expected_mma(inst), mma) and count > 0, (key, facts["mma"])
        assert f"`{key}`" in doc and f"`{mma}`" in doc
    # A second run into the same directory reuses every fact
    monkeypatch.setattr(C, "collect_facts", lambda i: pytest.fail("must not compile again"))
    again = C.write_catalog(tmp_path, sample, jobs=0, stream=io.StringIO())
    assert (again.compiled, again.reused) == (0, len(sample))
    doc = (tmp_path / C.DOC_NAME).read_text()
    assert "not compiled" not in doc and all(f"`{code_key(i)}`" in doc for i in sample)


def _fake_facts(inst):
    return {"fingerprint": C.facts_fingerprint(), "config": C.code_config(inst), "registers": 1, "frame_bytes": 0,
            "smem_bytes": 1, "stages": 2, "mma": {"wgmma.fake": 1}}


def test_interrupted_catalog_keeps_what_finished_and_resumes(tmp_path, monkeypatch):
    insts = pick("sm_90a", limit=4)
    done = []

    def interrupt_third(inst):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(inst)
        return _fake_facts(inst)

    monkeypatch.setattr(C, "collect_facts", interrupt_third)
    with pytest.raises(Interrupted) as e:
        C.write_catalog(tmp_path, insts, jobs=0, stream=io.StringIO())
    assert (len(e.value.results), e.value.total) == (2, 4)
    kept = json.loads((tmp_path / C.FACTS_NAME).read_text())["entries"]
    assert sorted(kept) == sorted(code_key(i) for i in insts[:2])
    doc = (tmp_path / C.DOC_NAME).read_text()
    assert doc.count("not compiled: interrupted") == 2 and f"`{code_key(insts[3])}`" in doc
    compiled = []
    monkeypatch.setattr(C, "collect_facts", lambda i: compiled.append(i) or _fake_facts(i))
    rep = C.write_catalog(tmp_path, insts, jobs=0, stream=io.StringIO())
    assert compiled == list(insts[2:]) and (rep.compiled, rep.reused) == (2, 2)
    assert "interrupted" not in (tmp_path / C.DOC_NAME).read_text()


def test_catalog_output_must_be_a_directory(tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    path = tmp_path / "taken"
    path.write_text("x")
    assert main(["catalog", "--out", str(path), "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"cutedsl-gemm catalog: --out {path} is a file, not a directory"


# ------------------------------------------------------------------------------------------------
# Ahead-of-time selections
# ------------------------------------------------------------------------------------------------
def test_unfiltered_ahead_of_time_builds_take_the_default_set():
    from cutedsl_gemm.generators.runner import in_default_set, pick_ahead_of_time

    table = pick("sm_90a")
    default = pick_ahead_of_time("sm_90a")
    assert default.instances == tuple(i for i in table if in_default_set(i))
    assert 0 < len(default.instances) < len(table) / 10 and f"--all for all {len(table)}" in default.scope
    gemms = [i for i in default.instances if i.op == "gemm"]
    assert {(i.a_dtype, i.b_dtype, i.out_dtype) for i in gemms} == {("e4m3", "e4m3", "bf16"), ("int8", "int8", "bf16")}
    assert {i.bias_dtype for i in gemms} == {None, "bf16"}
    # every tile, schedule and recipe of the GEMMs is in it
    def shape(i):
        return (i.schedule, i.recipe, i.tile_m, i.tile_n, i.cluster_m, i.cluster_n, i.accum, i.swap_ab, i.split_tail,
                i.ctas_per_sm, i.stages)

    assert {shape(i) for i in gemms} == {shape(i) for i in table if i.op == "gemm"}
    # and the common weight-only kernels, every tile (M range) of each
    weight_only = [i for i in default.instances if i.op == M.WEIGHT_ONLY]
    assert {(i.a_dtype, i.b_dtype, i.recipe) for i in weight_only} == {("bf16", "int4", "group128"),
                                                                      ("bf16", "int8", "channel")}
    assert len(weight_only) == 8 and {i.tile_n for i in weight_only} == {16, 32, 64, 128}
    assert pick_ahead_of_time("sm_90a", everything=True).instances == table
    assert len(pick_ahead_of_time("sm_90a", limit=3).instances) == 3
    # a filter selects from the whole table
    fp32 = pick_ahead_of_time("sm_90a", ["_fp32_"]).instances
    assert fp32 and not any(in_default_set(i) for i in fp32)


def test_precompile_says_how_many_kernels_it_will_compile(monkeypatch):
    from cutedsl_gemm.generators import precompile as P
    from cutedsl_gemm.generators.runner import in_default_set

    seen = []
    monkeypatch.setattr(P, "run_parallel", lambda fn, items, *a, **k: seen.append(list(items)) or [])
    out = io.StringIO()
    rep = P.precompile("sm_90a", stream=out)
    n = sum(map(in_default_set, pick("sm_90a")))
    assert rep.selected == n and len(seen[0]) == n  # nothing cached in the tests' cache directory
    first = out.getvalue().splitlines()[0]
    assert first.startswith(f"precompile: {n} instance(s) of sm_90a (the default set: e4m3 x e4m3")
    assert first.endswith(f": {n} to compile, 0 already cached")


# ------------------------------------------------------------------------------------------------
# Parallel runner: progress and Ctrl-C
# ------------------------------------------------------------------------------------------------
def test_progress_lines_count_and_estimate_the_time_left():
    from cutedsl_gemm.generators.runner import Progress, duration

    out = io.StringIO()
    progress = Progress(3, "precompile", out)
    progress.step("first", True, 1.0)
    progress.step("second", False, 2.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and " 1/3 " in lines[0] and " 2/3 " in lines[1]
    assert re.search(r" ETA \d+s ok  first \(1\.0s\)$", lines[0]) and " ERR second" in lines[1]
    assert [duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_an_interrupt_in_process_returns_what_finished():
    from cutedsl_gemm.generators.runner import run_parallel

    ran = []

    def task(x):
        if x == 2:
            raise KeyboardInterrupt
        ran.append(x)
        return x * 10

    with pytest.raises(Interrupted) as e:
        run_parallel(task, range(5), 0, "test", stream=io.StringIO())
    assert [r.value for r in e.value.results] == [0, 10] and e.value.total == 5
    assert ran == [0, 1]  # nothing after the interrupt ran


INTERRUPTED_SCRIPT = """
import sys, time
from cutedsl_gemm.generators.runner import Interrupted, run_parallel

def task(x):
    if x >= 2:
        time.sleep(600)
    return x * 10

if __name__ == "__main__":
    try:
        run_parallel(task, range(6), 2, "test")
    except Interrupted as e:
        print("kept", [r.value for r in e.results], "of", e.total, flush=True)
        sys.exit(130)
    sys.exit(1)
"""


def test_ctrl_c_stops_the_worker_processes_and_keeps_what_finished(tmp_path):
    script = tmp_path / "interrupted_run.py"
    script.write_text(textwrap.dedent(INTERRUPTED_SCRIPT))
    # in a process group of its own, which Ctrl-C reaches as a terminal's would
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stderr:  # wait for the two quick tasks; the others sleep
            if " 2/6 " in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert out.strip() == "kept [0, 10] of 6"
    assert "Traceback" not in err
    deadline = time.time() + 10  # the workers are gone (their parent waited for them)
    while time.time() < deadline and _group_alive(proc.pid):
        time.sleep(0.1)
    assert not _group_alive(proc.pid)


def _group_alive(pgid) -> bool:
    """Whether a live (not zombie) process is left in the process group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["precompile", "export", "catalog"])
@pytest.mark.parametrize("jobs", ["-3", "0", "two"])
def test_cli_refuses_a_bad_job_count_in_one_line(cmd, jobs, tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    extra = ["--out", str(tmp_path)] if cmd != "precompile" else []
    with pytest.raises(SystemExit) as e:
        main([cmd, "--jobs", jobs, *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"cutedsl-gemm {cmd}: error: argument --jobs: expected a whole number >= 1, got " in err
    assert "Traceback" not in err


def test_cli_reports_an_interrupt_in_one_line(monkeypatch, capsys):
    from cutedsl_gemm.generators import precompile as P
    from cutedsl_gemm.tools.cli import main

    def interrupted(*a, **k):
        raise Interrupted([TaskResult(None, True)] * 2, 5)

    monkeypatch.setattr(P, "precompile", interrupted)
    assert main(["precompile"]) == 130
    assert capsys.readouterr().err == "interrupted: 2 of 5 done, kept\n"


def test_export_of_weight_only_instances_alone_is_an_error_saying_why(tmp_path, capsys):
    from cutedsl_gemm.generators import export as E
    from cutedsl_gemm.tools.cli import main

    assert main(["export", "--out", str(tmp_path), "--filter", "_weight_only_"]) == 2
    lines = capsys.readouterr().err.splitlines()
    n = len(M.select(op=M.WEIGHT_ONLY))
    assert lines[0].startswith(f"export: skipping {n} weight_only instance(s) (e.g. sm_90a_weight_only_")
    assert lines[1].startswith(f"cutedsl-gemm export: nothing to export: the {n} selected instance(s) are "
                               "weight_only kernels, which the C export skips: the weight-only GEMM's entry")
    assert len(lines) == 2 and not any(tmp_path.iterdir())
    with pytest.raises(E.ExportError, match="no AOT exporter for arch=sm_90a op=weight_only: the weight-only"):
        E.export_one((_instance(WEIGHT_ONLY_DECODE), str(tmp_path)))


def test_cli_export_into_a_file_is_a_one_line_error(tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    path = tmp_path / "registry.c"
    path.write_text("int x;\n")
    assert main(["export", "--out", str(path), "--filter", ROW_BF16]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"cutedsl-gemm export: --out {path}: {path} is a file, not a directory"
    assert path.read_text() == "int x;\n"


def test_reexport_removes_the_previous_exports_files(tmp_path, monkeypatch):
    from cutedsl_gemm.generators import export as E

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    old = ["cutedsl_gemm_registry.c", "CMakeLists.txt", "kernels/old_kernel.o", "kernels/old_kernel.h"]
    for rel in old:
        (tmp_path / rel).write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    (kernels / "hand_written.h").write_text("mine")
    outside = tmp_path.parent / f"{tmp_path.name}_outside.o"
    outside.write_text("not the exporter's")
    (tmp_path / E.EXPORT_RECORD).write_text(json.dumps({"files": [*old, E.EXPORT_RECORD, f"../{outside.name}"]}))
    # the new export fails to compile: the old files are gone all the same, and its own are listed
    monkeypatch.setattr(E, "run_parallel", lambda fn, jobs, *a, **k: [TaskResult(j, False, error="boom") for j in jobs])
    with pytest.raises(E.ExportError, match="1 of 1 instances failed to export"):
        E.export("sm_90a", tmp_path, [ROW_BF16], stream=io.StringIO())
    assert not any((tmp_path / rel).exists() for rel in old)
    assert (tmp_path / "notes.txt").exists() and (kernels / "hand_written.h").exists() and outside.exists()
    record = json.loads((tmp_path / E.EXPORT_RECORD).read_text())
    key = code_key(_instance(ROW_BF16))
    assert record["complete"] is False
    assert {f"kernels/{key}.o", f"kernels/{key}.h", E.EXPORT_RECORD} <= set(record["files"])
    assert E.remove_previous_export(tmp_path) == [(tmp_path / E.EXPORT_RECORD).resolve()]


def test_cli_help_describes_every_command(capsys):
    from cutedsl_gemm.tools.cli import main

    for cmd, words in (("demo", "With a Hopper GPU: run scaled_mm"), ("info", "Print the GPU (if any), the arch"),
                       ("catalog", "kernels.md"), ("precompile", "--all"), ("export", "--all")):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert words in " ".join(capsys.readouterr().out.split()), cmd


def test_cli_bench_help_shows_the_benchmarks_options(capsys, monkeypatch, tmp_path):
    from cutedsl_gemm.tools.cli import main

    monkeypatch.chdir(tmp_path)  # no checkout here: the description alone, and where the options come from
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Runs the GEMM benchmark of a source checkout" in out and "No benchmarks/bench_gemm.py" in out
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the repository root
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Runs the GEMM benchmark of a source checkout, benchmarks/bench_gemm.py" in out
    for option in ("--sets", "--recipes", "--shapes", "--fast-accum"):
        assert option in out
    assert "usage: cutedsl-gemm bench [-h] [--sets SETS]" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_cli_bench_passes_its_options_on_and_needs_a_gpu(capsys):
    from cutedsl_gemm.tools.cli import main

    assert main(["bench", "--sets", "dsv3", "--recipes", "row"]) == 2
    assert capsys.readouterr().err == "cutedsl-gemm bench: needs a Hopper GPU\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_cli_info_prints_an_arch_line_without_a_gpu(capsys, monkeypatch):
    from cutedsl_gemm.tools.cli import main

    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "arch:       none (no GPU and CUTE_DSL_ARCH unset; CUTE_DSL_ARCH=sm_90a compiles for Hopper)" in lines
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert main(["info"]) == 0
    assert "arch:       sm_100a (from CUTE_DSL_ARCH)" in capsys.readouterr().out.splitlines()

"""The AOT export (generators/export.py, generators/c_export.py): C objects and headers per instance, the registry
(lookups that follow dispatch, argument checks), CMake and linking, for the Hopper GEMMs, those quantizing their
activations and the weight-only GEMMs (the sm_100a GEMMs: test_export_sm100.py); on a GPU, exported kernels run
through the registry against the references. Compiling tests keep to a few instances."""

import ctypes
import io
import json
import shutil
import subprocess
import time
from dataclasses import replace

import pytest
import torch
from table_picks import (
    BLOCK2D_LONG_K,
    BLOCK2D_SHORT_K,
    CLUSTER4,
    EXPORTED,
    M_SMALL,
    M_TEST,
    MID,
    PAIR,
    QUANT_GEMM_EXPORTED,
    ROW_BF16,
    SMALL,
    TENSOR_BIAS,
    WEIGHT_ONLY_DECODE,
    WEIGHT_ONLY_EXPORTED,
    WEIGHT_ONLY_INT8,
    WIDE_DECODE,
    instance,
)

from cutedsl_gemm.generators.runner import code_key, in_default_set
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection import instances as M


# ------------------------------------------------------------------------------------------------
# AOT export
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from cutedsl_gemm.generators import export as E

    out = tmp_path_factory.mktemp("aot")
    t0 = time.perf_counter()
    names = [*EXPORTED, *WEIGHT_ONLY_EXPORTED, *QUANT_GEMM_EXPORTED]
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
                + [(f, ctypes.c_int32) for f in ("tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "stages",
                                                 "split_k", "swap_ab", "split_tail", "ctas_per_sm", "rate",
                                                 "rate_long_k")]
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
    lib.cutedsl_gemm_find_weight_only.restype = ctypes.POINTER(Kernel)
    lib.cutedsl_gemm_find_weight_only.argtypes = ([ctypes.c_char_p] * 4 + [ctypes.c_int64] * 3
                                                  + [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)])
    lib.cutedsl_gemm_find_quant_gemm.restype = ctypes.POINTER(Kernel)
    lib.cutedsl_gemm_find_quant_gemm.argtypes = ([ctypes.c_char_p] * 6 + [ctypes.c_int64] * 3
                                                 + [ctypes.c_int32, ctypes.POINTER(ctypes.c_int32)])
    lib.cutedsl_gemm_find_by_name.restype = ctypes.POINTER(Kernel)
    lib.cutedsl_gemm_kernel_at.restype = ctypes.POINTER(Kernel)
    lib.cutedsl_gemm_launch.argtypes = [ctypes.POINTER(Kernel), ctypes.POINTER(args_type), ctypes.c_void_p]
    lib.cutedsl_gemm_last_error.restype = ctypes.c_char_p
    return lib


def launch_refusal(lib, kernel, args):
    """(return code, last error) of a registry launch of ``kernel`` with ``args`` (refused ones launch nothing)."""
    rc = lib.cutedsl_gemm_launch(kernel, ctypes.byref(args), None)
    return rc, lib.cutedsl_gemm_last_error().decode()


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
    keys = [code_key(instance(n)) for n in (*EXPORTED, *WEIGHT_ONLY_EXPORTED, *QUANT_GEMM_EXPORTED)]
    assert sorted(exported.kernels) == sorted(keys)
    assert not exported.skipped and json.loads((out / "export.json").read_text())["skipped"] == {}
    _check_exported_objects(out, keys)
    registry = (out / "cutedsl_gemm_registry.c").read_text()
    assert all(f"cdg_launch_{k}" in registry for k in keys)
    header = (out / "cutedsl_gemm_registry.h").read_text()
    assert all(f"{fn}(" in header for fn in ("cutedsl_gemm_find", "cutedsl_gemm_find_weight_only",
                                               "cutedsl_gemm_find_quant_gemm"))
    # one argument struct: the scaled GEMMs' fields, then the weight-only entry's own (its activations are a)
    fields = [f["field"] for f in exported.arg_fields]
    assert fields[-3:] == ["packed_w", "w_scales", "w_zeros"] and fields.count("a") == 1
    assert "cutedsl_gemm_tensor_t packed_w;  /* weight-only: int32 (ceil(N / 64), ceil(K / 128), 256 x bits)" in header
    assert "add_library(cutedsl_gemm_kernels STATIC" in (out / "cutedsl_gemm_kernels.cmake").read_text()
    record = json.loads((out / "export.json").read_text())  # what the next export into `out` removes
    assert record["complete"] and {str(p.relative_to(out)) for p in exported.files} <= set(record["files"])
    # the GEMMs quantizing their activations are exported, not skipped
    listed = {e["name"]: e["op"] for e in record["instances"]}
    assert all(listed[n] == M.QUANT_GEMM for n in QUANT_GEMM_EXPORTED) and record["skipped"] == {}
    print(f"export of {len(keys)} instances: {exported.seconds:.1f} s")


def check_links(library):
    """The exported library defines the registry's entry points. build_shared links with -Wl,--no-undefined (and
    -Werror on the registry), so that it was built proves every symbol resolved."""
    syms = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                          check=True).stdout
    for fn in ("cutedsl_gemm_find", "cutedsl_gemm_find_weight_only", "cutedsl_gemm_find_quant_gemm",
               "cutedsl_gemm_launch", "cutedsl_gemm_kernel_count", "cutedsl_gemm_last_error"):
        assert f" T {fn}\n" in syms


@pytest.mark.compile
def test_exported_library_links_with_every_symbol_resolved(exported_lib):
    check_links(exported_lib)


@pytest.mark.compile
def test_registry_lookup_and_argument_checks(exported, exported_lib):
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    assert lib.cutedsl_gemm_kernel_count() == len(EXPORTED) + len(WEIGHT_ONLY_EXPORTED) + len(QUANT_GEMM_EXPORTED)
    k = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", M_TEST, 0, 0, 0)
    assert k and k.contents.name.decode() == ROW_BF16 and k.contents.m_max == 1 << 31 and k.contents.cluster_m == 2
    assert k.contents.bias_dtype is None and k.contents.tile_n == instance(ROW_BF16).tile_n
    assert k.contents.rate == dispatch.tile_rate(instance(ROW_BF16)) and k.contents.ctas_per_sm == 1
    assert k.contents.rate_long_k == dispatch.tile_rate(instance(ROW_BF16), dispatch.LONG_K)
    small = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", M_SMALL,
                                  0, 0, 0)
    assert small.contents.name.decode() == SMALL and small.contents.swap_ab == 1 and k.contents.swap_ab == 0
    # with K too: the epilogue term sends short K to the two-CTAs-per-SM tile, long K to the 128-row one,
    # as dispatch.wave_cost does over the same candidates
    assert instance(PAIR).ctas_per_sm == 2 and instance(ROW_BF16).ctas_per_sm == 1
    for kdim, want in ((256, PAIR), (7168, ROW_BF16)):
        by_python = min((instance(x) for x in (ROW_BF16, PAIR)),
                        key=lambda i, kdim=kdim: dispatch.wave_cost(i, 6144, 7168, 132, kdim))
        got = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", 6144,
                                    7168, kdim, 132)
        assert got.contents.name.decode() == by_python.name == want, (kdim, lib.cutedsl_gemm_last_error())
    # with N (and K) and the SM count, over every exported row-wise candidate, C picks what dispatch.wave_cost picks,
    # 4-CTA cluster slots included
    assert instance(CLUSTER4).cluster_m == 4
    row_names = [x for x in EXPORTED if instance(x).recipe == "row"]
    for m, n, kdim in ((M_TEST, 512, 1024), (6144, 576, 7168), (1024, 4096, 512), (6144, 7168, 256),
                       (8192, 8192, 8192), (3072, 576, 7168)):
        holding = [instance(x) for x in row_names if instance(x).m_min <= m <= instance(x).m_max]
        by_python = min(holding, key=lambda i: dispatch.wave_cost(i, m, n, 132, kdim))
        got = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", m, n,
                                    kdim, 132)
        assert got.contents.name.decode() == by_python.name, (m, n, kdim)
    assert lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e4m3", b"e4m3", b"bf16", None, b"promoted", 6144, 576,
                                 7168, 132).contents.name.decode() == CLUSTER4
    # decode and mid-M outputs: the weight stream against the MMAs, with and without K, and the estimated rate's
    # margin (M = 128, N = 10240: without it the swapped 128x128 would take the shape from the pair)
    assert (instance(MID).tile_m, instance(MID).swap_ab, instance(SMALL).swap_ab) == (64, False, True)
    wide = instance(WIDE_DECODE)
    assert dispatch.has_estimated_rate(wide) and not any(dispatch.has_estimated_rate(instance(x)) for x in
                                                         EXPORTED if x != WIDE_DECODE)

    def by_python(m, n, kdim):
        holding = [instance(x) for x in row_names if instance(x).m_min <= m <= instance(x).m_max]
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
    assert (instance(BLOCK2D_SHORT_K).tile_n, instance(BLOCK2D_LONG_K).tile_n) == (128, 192)
    for kdim, want in ((1536, BLOCK2D_SHORT_K), (dispatch.LONG_K - 128, BLOCK2D_SHORT_K),
                       (dispatch.LONG_K, BLOCK2D_LONG_K), (8192, BLOCK2D_LONG_K)):
        got = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"128x128_128x128", b"e4m3", b"e4m3", b"bf16", None,
                                    b"promoted", 3072, 8192, kdim, 132)
        by_python = min((instance(x) for x in (BLOCK2D_SHORT_K, BLOCK2D_LONG_K)),
                        key=lambda i, kdim=kdim: dispatch.wave_cost(i, 3072, 8192, 132, kdim))
        assert got.contents.name.decode() == by_python.name == want, kdim
        assert got.contents.rate_long_k == dispatch.tile_rate(instance(want), dispatch.LONG_K)
    kb = lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"tensor", b"e4m3", b"e5m2", b"fp32", b"fp32", b"fast", M_TEST,
                               0, 0, 0)
    assert kb and kb.contents.name.decode() == TENSOR_BIAS
    assert not lib.cutedsl_gemm_find(b"gemm", b"sm_90a", b"row", b"e5m2", b"e4m3", b"bf16", None, b"promoted",
                                     1, 0, 0, 0)
    assert b"no exported kernel for op=gemm arch=sm_90a recipe=row A=e5m2" in lib.cutedsl_gemm_last_error()

    def refused(args, kernel=k):
        return launch_refusal(lib, kernel, args)

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
        # torch strides a (1, N) tensor (1, 1): the stride of a mode of extent 1 is never applied, so it passes
        args = _fake_args(Args, 256, 512, 1024)
        args.scale_b = _view(4 << 24, (1, 512), (1, 1))
        rc, msg = refused(args)
        assert rc == 2 and "querying the SM count failed" in msg, msg


@pytest.mark.compile
def test_registry_split_k_rules(exported, exported_lib):
    fields = [f["field"] for f in exported.arg_fields]
    if "splits" not in fields or not getattr(instance(SMALL).sm90_config(), "split_k", False):
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
    inst = instance(SMALL)
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


def _weight_only_python(m, n, k, recipe, weights, monkeypatch):
    """(instance name, K splits) of dispatch.select_weight_only for bf16 activations on 132 SMs."""
    from cutedsl_gemm import problem as P

    # the resident clusters the C lookup assumes (dispatch.cluster_slots), in place of asking a GPU
    monkeypatch.setattr(dispatch, "launch_clusters",
                        lambda index, inst: dispatch.cluster_slots(132, inst.cluster_m * inst.cluster_n)
                        * inst.ctas_per_sm)
    problem = P.WeightOnlyProblem(m=m, n=n, k=k, act_name="bf16", weight_format=weights, recipe=recipe,
                                  arch="sm_90a", sms=132, device_index=None)
    inst, splits = dispatch.select_weight_only(problem)
    return inst.name, splits


@pytest.mark.compile
def test_weight_only_lookup_follows_select_weight_only(exported, exported_lib, monkeypatch):
    lib = _open(exported_lib, _args_type(exported.arg_fields))

    def find(m, n, kdim, recipe=b"group128", weights=b"int4", sms=132, act=b"bf16"):
        splits = ctypes.c_int32(-1)
        got = lib.cutedsl_gemm_find_weight_only(b"sm_90a", recipe, act, weights, m, n, kdim, sms, ctypes.byref(splits))
        return (got.contents.name.decode() if got else None), splits.value

    # decode (int4, M <= 16) and prefill (int8, M >= 65): N = K = 8192 takes 2 splits on 132 SMs, narrower outputs
    # more (up to 16), short K fewer (two K tiles a split), K = 9 K tiles normalised from 4 splits to 3, a wide or
    # tall output none
    cases = [(1, 8192, 8192, "group128", "int4"), (3, 1024, 8192, "group128", "int4"),
             (16, 1024, 512, "group128", "int4"), (1, 1024, 9 * 128, "group128", "int4"),
             (1, 57344, 8192, "group128", "int4"), (100, 1024, 4096, "channel", "int8"),
             (1000, 8192, 8192, "channel", "int8"), (4096, 4096, 1024, "channel", "int8")]
    got = {c: find(*c[:3], recipe=c[3].encode(), weights=c[4].encode()) for c in cases}
    for c in cases:
        assert got[c] == _weight_only_python(*c, monkeypatch), c
        assert got[c][0] in WEIGHT_ONLY_EXPORTED
    assert [got[c][1] for c in cases] == [2, 16, 2, 3, 1, 16, 1, 1]
    k = lib.cutedsl_gemm_find_by_name(WEIGHT_ONLY_DECODE.encode()).contents
    assert (k.op, k.tile_m, k.tile_n, k.tile_k, k.split_k, k.swap_ab, k.rate) == (b"weight_only", 128, 16, 128, 1, 1, 0)
    # without N, K or the SM count: the same kernel, unsplit
    assert find(1, 0, 8192) == find(1, 8192, 8192, sms=0) == (WEIGHT_ONLY_DECODE, 1)
    assert lib.cutedsl_gemm_find_weight_only(b"sm_90a", b"group128", b"bf16", b"int4", 1, 8192, 8192, 132, None)

    # what was not exported is not found, and the message says what was asked
    assert find(1, 8192, 8192, recipe=b"group64") == (None, -1)
    assert lib.cutedsl_gemm_last_error() == (b"no exported weight-only kernel for arch=sm_90a recipe=group64 "
                                             b"activations=bf16 weights=int4 M=1")
    assert _weight_only_python(17, 8192, 8192, "group128", "int4", monkeypatch)[0] not in WEIGHT_ONLY_EXPORTED
    assert find(17, 8192, 8192) == (None, -1)  # the table's 128x32 row serves M = 17: not exported
    assert find(1, 8192, 8192, act=b"fp16")[0] is None and find(1, 8192, 8192, weights=b"int8")[0] is None
    # the scaled GEMMs' lookup neither finds weight-only rows nor applies its wave cost to them
    assert not lib.cutedsl_gemm_find(b"weight_only", b"sm_90a", b"group128", b"bf16", b"int4", b"bf16", None, b"fast",
                                     1, 8192, 8192, 132)
    assert b"look them up with cutedsl_gemm_find_weight_only" in lib.cutedsl_gemm_last_error()


def _weight_only_args(args_type, m, n, k, group=128, bits=4, zeros=False, base=1 << 20):
    """Descriptors of a valid weight-only call (bf16 activations) at made-up, aligned addresses (checks only)."""
    words = 256 * bits
    atoms = (-(-n // 64), -(-k // 128), words)
    rows = k // group if group else 1
    args = args_type(a=_view(base, (m, k), (k, 1)),
                     packed_w=_view(base + (1 << 24), atoms, (atoms[1] * words, words, 1)),
                     w_scales=_view(base + (2 << 24), (rows, n), (n, 1)), d=_view(base + (3 << 24), (m, n), (n, 1)))
    if zeros:
        args.w_zeros = _view(base + (4 << 24), (rows, n), (n, 1))
    return args


@pytest.mark.compile
def test_weight_only_launch_checks_its_arguments(exported, exported_lib):
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    int4 = lib.cutedsl_gemm_find_by_name(WEIGHT_ONLY_DECODE.encode())
    int8 = lib.cutedsl_gemm_find_by_name(WEIGHT_ONLY_INT8.encode())

    def refused(args, kernel=int4):
        return launch_refusal(lib, kernel, args)

    bad = _weight_only_args(Args, 3, 1040, 1024)
    bad.packed_w.shape[0] = 16  # 1040 rows are 17 atoms
    assert refused(bad) == (1, f"{WEIGHT_ONLY_DECODE}: packed_w must hold (17, 8) atoms for N=1040, K=1024 (atoms of "
                               "64 rows x 128 K), got (16, 8)")
    bad = _weight_only_args(Args, 3, 1040, 1024, bits=8)  # int8 atoms handed to the int4 kernel
    assert refused(bad) == (1, f"{WEIGHT_ONLY_DECODE}: packed_w.shape[2] must be 1024 (compiled in), got 2048")
    bad = _weight_only_args(Args, 3, 1040, 1024)
    bad.w_scales.shape[0] = 4
    assert refused(bad) == (1, f"{WEIGHT_ONLY_DECODE}: w_scales.shape[0]=4 must be K / 128 = 8 "
                               "(one row per group of K)")
    bad = _weight_only_args(Args, 3, 1040, 1088, group=64)  # K a multiple of 64 (and of the 8 TMA needs), not of 128
    assert refused(bad) == (1, f"{WEIGHT_ONLY_DECODE}: K=1088 must be a multiple of the group size 128")
    bad = _weight_only_args(Args, 3, 1040, 1024)
    bad.w_scales.shape[1] = 1032
    assert "d.shape[1]=1040 must equal w_scales.shape[1]=1032 (the same problem extent)" in refused(bad)[1]
    bad = _weight_only_args(Args, 3, 1040, 1024, zeros=True)
    assert refused(bad) == (1, f"{WEIGHT_ONLY_DECODE}: w_zeros given, but recipe group128 has no zero points "
                               "(w_zeros.data must be NULL)")
    bad = _weight_only_args(Args, 3, 1040, 1024)
    bad.d.data = None
    assert refused(bad) == (1, f"{WEIGHT_ONLY_DECODE}: d.data is NULL")
    # per channel: (1, N) fp32 scales, K free of any group
    bad = _weight_only_args(Args, 100, 1040, 1000, group=0, bits=8)
    bad.w_scales.shape[0] = 2
    assert refused(bad, int8) == (1, f"{WEIGHT_ONLY_INT8}: w_scales.shape[0] must be 1 (compiled in), got 2")
    # split K needs the workspace and counters the chosen splits take
    args = _weight_only_args(Args, 3, 1040, 1024)
    args.splits, args.max_clusters = 4, 132
    tiles = instance(WEIGHT_ONLY_DECODE).output_tiles(3, 1040)
    assert tiles == 9 and refused(args)[1].endswith(f"splits=4 needs a workspace of >= {tiles * 4 * 128 * 16} fp32 "
                                                    "(split tiles x splits x 128 x 16)")
    # an empty output launches nothing; a valid call gets as far as asking CUDA for the SM count
    assert lib.cutedsl_gemm_launch(int4, ctypes.byref(_weight_only_args(Args, 0, 1040, 1024)), None) == 0
    if not torch.cuda.is_available():
        for kernel, args in ((int4, _weight_only_args(Args, 3, 1040, 1024)),
                             (int8, _weight_only_args(Args, 100, 1040, 1000, group=0, bits=8))):
            rc, msg = refused(args, kernel)
            assert rc == 2 and "querying the SM count failed" in msg, msg


# ------------------------------------------------------------------------------------------------
# The GEMMs quantizing their activations (op quant_gemm): quantize_scaled_mm's one-kernel path
# ------------------------------------------------------------------------------------------------
def _quant_gemm_python(m, n, k, recipe, weights, monkeypatch):
    """(instance name, K splits) of dispatch.select for a quantize_scaled_mm call of bf16 activations on 132 SMs
    (scale_b in scaled_mm's layout), or (None, None) where the table has no row quantizing them."""
    from cutedsl_gemm import problem as P

    monkeypatch.setattr(dispatch, "launch_clusters",  # the resident clusters the C lookup assumes, without a GPU
                        lambda index, inst: dispatch.cluster_slots(132, inst.cluster_m * inst.cluster_n)
                        * inst.ctas_per_sm)
    kb = -(-k // 128)
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    b = torch.empty(n, k, dtype=torch.int8 if weights == "int8" else torch.float8_e4m3fn, device="meta").t()
    scale_b = torch.empty({"1x128_128x128": (kb, -(-n // 128)), "row": (1, n), "tensor": ()}[recipe], device="meta")
    problem, _ = P.describe_quantize_scaled_mm(x, b, scale_b, None, torch.bfloat16, None, None, None,
                                               torch.device("cuda", 0), target=("sm_90a", 132))
    if not dispatch.has_quantizing_rows(problem):
        return None, None
    inst, splits = dispatch.select(problem)
    return inst.name, splits


@pytest.mark.compile
def test_quant_gemm_lookup_follows_dispatch_select(exported, exported_lib, monkeypatch):
    lib = _open(exported_lib, _args_type(exported.arg_fields))

    def find(m, n, kdim, recipe, weights, sms=132, act=b"bf16", bias=None):
        splits = ctypes.c_int32(-1)
        got = lib.cutedsl_gemm_find_quant_gemm(b"sm_90a", recipe.encode(), act, weights.encode(), act, bias, m, n,
                                               kdim, sms, ctypes.byref(splits))
        return (got.contents.name.decode(), splits.value) if got else (None, None)

    picks = {}
    for recipe, weights in (("1x128_128x128", "e4m3"), ("row", "e4m3"), ("row", "int8")):
        for m in (1, 4, 16, 17, 32):
            for n, kdim in ((1024, 1024), (1040, 1024), (7168, 2048), (576, 7168), (12288, 512), (18432, 7168)):
                got = find(m, n, kdim, recipe, weights)
                assert got == _quant_gemm_python(m, n, kdim, recipe, weights, monkeypatch), (recipe, weights, m, n,
                                                                                             kdim)
                picks[(recipe, weights, m, n, kdim)] = got
    # the wave cost decides between token tiles (64-row ones for narrow layers, 128-row ones for wide), and the
    # K splits fill half a wave: several on narrow layers, none on wide ones
    tiles = {instance(name).tile_m for name, _ in picks.values()}
    assert tiles == {64, 128} and {name for name, _ in picks.values()} <= set(QUANT_GEMM_EXPORTED)
    assert picks[("1x128_128x128", "e4m3", 4, 1040, 1024)][1] == 3 and picks[("row", "int8", 17, 576, 7168)][1] == 12
    assert picks[("row", "e4m3", 1, 18432, 7168)][1] == 1
    k = lib.cutedsl_gemm_find_by_name(picks[("row", "int8", 17, 576, 7168)][0].encode()).contents
    assert (k.op, k.accum, k.tile_m, k.tile_n, k.swap_ab, k.split_k) == (b"quant_gemm", b"fast", 128, 32, 1, 1)
    assert k.rate == dispatch.tile_rate(instance(k.name.decode())) > 0
    # without N, K or the SM count: the first row in table order, unsplit
    assert find(4, 0, 1024, "row", "e4m3") == find(4, 1024, 1024, "row", "e4m3", sms=0)
    assert find(4, 0, 1024, "row", "e4m3")[1] == 1

    # not found: M above the 32-token tiles and per-tensor weights (no rows: quantize_scaled_mm runs two kernels),
    # fp16 activations and an fp32 bias (rows of the table, not exported); the message says what was asked
    for m, recipe in ((33, "1x128_128x128"), (33, "row"), (4, "tensor")):
        assert _quant_gemm_python(m, 1024, 1024, recipe, "e4m3", monkeypatch) == (None, None)
        assert find(m, 1024, 1024, recipe, "e4m3") == (None, None)
    assert lib.cutedsl_gemm_last_error() == (b"no exported kernel quantizing its activations for arch=sm_90a "
                                             b"recipe=tensor activations=bf16 weights=e4m3 out=bf16 bias=none M=4")
    assert find(4, 1024, 1024, "row", "e4m3", act=b"fp16") == (None, None)
    assert find(4, 1024, 1024, "row", "e4m3", bias=b"fp32") == (None, None)
    # the scaled GEMMs' lookup points at this one
    assert not lib.cutedsl_gemm_find(b"quant_gemm", b"sm_90a", b"row", b"bf16", b"e4m3", b"bf16", None, b"promoted", 4,
                                     1024, 1024, 132)
    assert b"looked up with cutedsl_gemm_find_quant_gemm" in lib.cutedsl_gemm_last_error()


QUANT_BLOCK = next(n for n in QUANT_GEMM_EXPORTED if "_1x128_128x128_" in n and "_t64x16_" in n)
QUANT_ROW = next(n for n in QUANT_GEMM_EXPORTED if "_row_bf16xe4m3_" in n and "_t64x16_" in n)


def _quant_gemm_args(args_type, m, n, k, recipe="1x128_128x128", base=1 << 20):
    """Descriptors of a valid quant_gemm call (bf16 activations, W's scales in the kernel's view: (N / 128, K / 128)
    blocks or (1, N)) at made-up, aligned addresses (checks only); scale_a stays empty."""
    nb, kb = -(-n // 128), -(-k // 128)
    scale_b = _view(base + (3 << 24), (nb, kb), (1, nb)) if recipe != "row" else _view(base + (3 << 24), (1, n), (n, 1))
    return args_type(a=_view(base, (m, k), (k, 1)), b=_view(base + (1 << 24), (k, n), (1, k)),
                     d=_view(base + (2 << 24), (m, n), (n, 1)), scale_b=scale_b)


@pytest.mark.compile
def test_quant_gemm_launch_checks_its_arguments(exported, exported_lib):
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    block = lib.cutedsl_gemm_find_by_name(QUANT_BLOCK.encode())
    row = lib.cutedsl_gemm_find_by_name(QUANT_ROW.encode())

    def refused(args, kernel=block):
        return launch_refusal(lib, kernel, args)

    bad = _quant_gemm_args(Args, 4, 1040, 1024)
    bad.scale_a = _view(5 << 24, (4, 8), (8, 1))  # the kernel computes the activations' scales itself
    assert refused(bad) == (1, f"{QUANT_BLOCK}: scale_a given, but this kernel quantizes a itself and computes its "
                               "scales (scale_a.data must be NULL)")
    bad = _quant_gemm_args(Args, 4, 1040, 1024)
    bad.scale_b.shape[1] = 9  # scaled_mm's padded K blocks: the kernel's view is cut to K's
    assert refused(bad) == (1, f"{QUANT_BLOCK}: scale_b must hold (9, 8) scales for N=1040, K=1024 (one per 128 x 128 "
                               "block of W: N blocks x K blocks), got (9, 9)")
    bad = _quant_gemm_args(Args, 4, 1040, 1024)
    bad.scale_b.shape[0] = 1040  # per-channel scales handed to the block kernel
    assert "scale_b must hold (9, 8) scales" in refused(bad)[1]
    assert refused(_quant_gemm_args(Args, 4, 1040, 1000)) == (1, f"{QUANT_BLOCK}: a.shape[1]=1000 must be a multiple "
                                                                 "of 16")
    bad = _quant_gemm_args(Args, 4, 1040, 1024)
    bad.a.data += 8
    assert refused(bad) == (1, f"{QUANT_BLOCK}: a.data {hex(bad.a.data)} is not 16-byte aligned")
    bad = _quant_gemm_args(Args, 4, 1040, 1024)
    bad.b.shape[0] = 2048
    assert "b.shape[0]=2048 must equal a.shape[1]=1024" in refused(bad)[1]
    bad = _quant_gemm_args(Args, 4, 1040, 1024, recipe="row")
    bad.scale_b.shape[0] = 2
    assert refused(bad, row) == (1, f"{QUANT_ROW}: scale_b.shape[0] must be 1 (compiled in), got 2")
    # split K needs the workspace and counters the chosen splits take
    args = _quant_gemm_args(Args, 4, 1040, 1024)
    args.splits, args.max_clusters = 3, 132
    tiles = instance(QUANT_BLOCK).output_tiles(4, 1040)
    assert tiles == 17 and refused(args)[1].endswith(f"splits=3 needs a workspace of >= {tiles * 3 * 64 * 16} fp32 "
                                                     "(split tiles x splits x 64 x 16)")
    # an empty output launches nothing; a valid call gets as far as asking CUDA for the SM count
    assert lib.cutedsl_gemm_launch(block, ctypes.byref(_quant_gemm_args(Args, 0, 1040, 1024)), None) == 0
    if not torch.cuda.is_available():
        for kernel, args in ((block, _quant_gemm_args(Args, 4, 1040, 1024)),
                             (row, _quant_gemm_args(Args, 16, 1040, 1024, recipe="row"))):
            rc, msg = refused(args, kernel)
            assert rc == 2 and "querying the SM count failed" in msg, msg


def test_default_export_takes_the_quant_gemm_rows_and_skips_the_fp8_output_ones(tmp_path, monkeypatch):
    from cutedsl_gemm.generators import export as E
    from cutedsl_gemm.generators.c_export import NOT_EXPORTED
    from cutedsl_gemm.generators.runner import TaskResult

    # compiling nothing: the selection handed to the workers and the skipped ops' lines are the test
    compiled = []

    def run_parallel(fn, jobs, *a, **k):
        compiled.extend(code_key(inst) for inst, _ in jobs)
        return [TaskResult(j, False, error="not compiled") for j in jobs]

    monkeypatch.setattr(E, "run_parallel", run_parallel)
    stream = io.StringIO()
    with pytest.raises(E.ExportError, match="instances failed to export"):
        E.export("sm_90a", tmp_path, stream=stream)
    skips = [ln for ln in stream.getvalue().splitlines() if ln.startswith("export: skipping")]
    assert len(skips) == 2, skips  # one line per op the registry has no form for, with its reason
    for op in (M.GEMM_FP8_OUT, M.GROUPED_GEMM):
        assert [ln for ln in skips if f" {op} " in ln and ln.endswith(NOT_EXPORTED[op])], (op, skips)
    quant = [i for i in M.select(op=M.QUANT_GEMM, arch="sm_90a") if in_default_set(i)]
    assert quant and all(code_key(i) in compiled for i in quant)
    assert not any(M.GEMM_FP8_OUT in key for key in compiled)


def test_quant_gemm_export_refuses_rows_its_lookup_cannot_tell_apart(monkeypatch):
    from cutedsl_gemm.generators import export as E

    row, block = instance(QUANT_ROW), instance(QUANT_BLOCK)
    E._check_quant_gemm_accumulation([row, block, instance(ROW_BF16)])
    with pytest.raises(E.ExportError, match="serve the same calls with different accumulation, which "
                                            "cutedsl_gemm_find_quant_gemm does not take"):
        E._check_quant_gemm_accumulation([row, replace(row, accum="fast", tile_m=128)])
    idx = {"scale_a": 3, "scale_b": 4}
    assert E._quant_gemm_plan(block, idx) == {"scale_a": 3, "scale_b": 4, "blocks": True, "w_rows": 128,
                                              "w_cols": 128}
    assert E._quant_gemm_plan(row, idx)["blocks"] is False
    # an unswapped row with a last-wave split variant would need dispatch.last_wave_splits, which the lookup lacks
    monkeypatch.setattr(E, "last_wave_variant", lambda inst: replace(inst, split_tail=True))
    with pytest.raises(E.ExportError, match="without dispatch.plan_splits' last-wave split variants"):
        E._quant_gemm_plan(replace(row, swap_ab=False), idx)
    assert E._quant_gemm_plan(row, idx)  # swapped rows never take one


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
    assert sorted(run.stdout.split()) == sorted((*EXPORTED, *WEIGHT_ONLY_EXPORTED, *QUANT_GEMM_EXPORTED))


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["cooperative", "split_k", "cluster4"])
def test_exported_gemm_runs_and_matches_reference(exported, exported_lib, which):
    from cutedsl_gemm.numerics import reference as R

    name, m, splits = {"cooperative": (ROW_BF16, M_TEST, 0), "split_k": (SMALL, M_SMALL, 3),
                       "cluster4": (CLUSTER4, M_TEST, 0)}[which]
    inst = instance(name)
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


@pytest.mark.gpu
def test_exported_block_scaled_gemm_equals_its_python_launch(exported, exported_lib):
    """A 2-D block-scaled GEMM through the registry (both scale views take two run-time strides) writes what the
    same instance launched from Python writes, bit for bit."""
    import cutedsl_gemm
    from cutedsl_gemm.numerics import scale_layouts
    from cutedsl_gemm.runtime import launch

    inst = instance(BLOCK2D_SHORT_K)
    m, n, k = 640, 1024, 1536
    torch.manual_seed(3)
    qa, sa = cutedsl_gemm.quantize_fp8(torch.randn(m, k, device="cuda") * 3, "128x128", scale_layout="padded")
    qw, sw = cutedsl_gemm.quantize_fp8(torch.randn(n, k, device="cuda"), "128x128", scale_layout="padded")
    va, vb = scale_layouts.kernel_views(inst.recipe, -(-k // 128), sa, sw.t())
    ref = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch.launch(inst, qa, qw.t(), va, vb, ref)
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)

    def view(t):
        return _view(t.data_ptr(), tuple(t.shape), tuple(t.stride()))

    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    args = Args(a=view(qa), b=view(qw.t()), d=view(out), scale_a=view(va), scale_b=view(vb))
    kern = lib.cutedsl_gemm_find_by_name(inst.name.encode())
    rc = lib.cutedsl_gemm_launch(kern, ctypes.byref(args), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert rc == 0, lib.cutedsl_gemm_last_error()
    torch.cuda.synchronize()
    assert not torch.isnan(ref).any()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["int4_decode_split_k", "int8_prefill"])
def test_exported_weight_only_runs_and_matches_reference(exported, exported_lib, which):
    from cutedsl_gemm.numerics import int_packing as IP
    from cutedsl_gemm.numerics import reference as R

    # M = 3: 9 weight tiles of 1040 rows on the H100's 132 SMs take 4 K splits; M = 1000: a partial token tile, unsplit
    name, m, group, bits, recipe, weights = {
        "int4_decode_split_k": (WEIGHT_ONLY_DECODE, 3, 128, 4, b"group128", b"int4"),
        "int8_prefill": (WEIGHT_ONLY_INT8, 1000, 0, 8, b"channel", b"int8")}[which]
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    n, k = 1040, 1024
    gen = torch.Generator().manual_seed(5)
    q, s, z = IP.quantize_weights(torch.randn(n, k, generator=gen), bits, group)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    packed, ks, _ = IP.pack_weights(q, s, z, group, bits=bits, dtype=torch.bfloat16)
    q2, s2, _ = IP.unpack_weights(packed, ks, None, k=k, group=group, bits=bits)  # the scales as the kernel reads them
    ref = R.reference_weight_only_mm(x, q2, s2, None, group)
    x, packed, ks = x.cuda(), packed.cuda(), ks.cuda()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # unwritten tiles stay NaN

    def view(t):
        return _view(t.data_ptr(), tuple(t.shape), tuple(t.stride()))

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = ctypes.c_int32(0)
    kern = lib.cutedsl_gemm_find_weight_only(b"sm_90a", recipe, b"bf16", weights, m, n, k, sms, ctypes.byref(splits))
    assert kern and kern.contents.name.decode() == name, lib.cutedsl_gemm_last_error()
    assert (splits.value > 1) == (which == "int4_decode_split_k"), splits.value
    # w_zeros (none) and max_clusters (0: the device's SM count) stay empty
    args = Args(a=view(x), packed_w=view(packed), w_scales=view(ks), d=view(out), splits=splits.value)
    if splits.value > 1:
        inst = instance(name)
        tiles = inst.output_tiles(m, n)
        workspace = torch.empty(tiles * splits.value * inst.tile_m * inst.tile_n, dtype=torch.float32, device="cuda")
        counters = torch.zeros(tiles, dtype=torch.int32, device="cuda")
        args.workspace, args.counters = view(workspace), view(counters)
    rc = lib.cutedsl_gemm_launch(kern, ctypes.byref(args), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert rc == 0, lib.cutedsl_gemm_last_error()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "some outputs were never written"
    err = R.rel_error(out.cpu(), ref)
    assert err < 8e-3, f"{name}: relative Frobenius error {err:.2e} >= 8e-3"
    if splits.value > 1:
        assert int(counters.abs().sum()) == 0  # the kernel hands the counters back zeroed


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["deepseek_split_k", "row_e4m3", "int8_128x32"])
def test_exported_quant_gemm_equals_quantize_scaled_mm(exported, exported_lib, which):
    """An exported kernel quantizing its activations, found and launched through the registry, writes what
    quantize_scaled_mm(..., in_kernel=True) writes, bit for bit: the same kernel, K splits and grid."""
    import cutedsl_gemm
    from cutedsl_gemm import problem as P
    from cutedsl_gemm.numerics import scale_layouts

    # M = 4 and 16: 64x16 tiles, 2 and 3 K splits on 132 SMs; M = 20: int8's 128x32 tile, 4 splits
    m, n, k, recipe, weights = {"deepseek_split_k": (4, 2048, 4096, "1x128_128x128", "e4m3"),
                                "row_e4m3": (16, 1040, 1024, "row", "e4m3"),
                                "int8_128x32": (20, 1040, 1024, "row", "int8")}[which]
    Args = _args_type(exported.arg_fields)
    lib = _open(exported_lib, Args)
    torch.manual_seed(11)
    w = torch.randn(n, k, device="cuda")
    if recipe == "row":
        qw, sw = (cutedsl_gemm.quantize_int8 if weights == "int8" else cutedsl_gemm.quantize_fp8)(w, "row")
        scale_b = sw.t()  # (1, N), strides (1, 1): the stride of its one row is never applied
    else:
        qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128")
        scale_b = sw.t().contiguous()  # scaled_mm's layout: (K blocks, N blocks)
    b = qw.t()
    x = (torch.randn(m, k, device="cuda") * 4).to(torch.bfloat16)
    x[0, :128] = 0.0  # an all-zero group
    ref = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # unwritten tiles stay NaN
    assert cutedsl_gemm.quantize_scaled_mm(x, b, scale_b, out=ref, in_kernel=True) is ref
    problem, _ = P.describe_quantize_scaled_mm(x, b, scale_b, None, x.dtype, None, None, None, x.device)
    inst, want_splits = dispatch.select(problem)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = ctypes.c_int32(0)
    kern = lib.cutedsl_gemm_find_quant_gemm(b"sm_90a", recipe.encode(), b"bf16", weights.encode(), b"bf16", None, m, n,
                                            k, sms, ctypes.byref(splits))
    assert kern, lib.cutedsl_gemm_last_error()
    assert (kern.contents.name.decode(), splits.value) == (inst.name, want_splits)

    def view(t):
        return _view(t.data_ptr(), tuple(t.shape), tuple(t.stride()))

    sb = scale_layouts.w_kernel_view(recipe, -(-k // 128), scale_b)  # W's scales as the kernel reads them
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    tiles = inst.output_tiles(m, n)
    workspace = torch.empty(tiles * splits.value * inst.tile_m * inst.tile_n, dtype=torch.float32, device="cuda")
    counters = torch.zeros(tiles, dtype=torch.int32, device="cuda")
    # scale_a (computed in the kernel), bias (none) and max_clusters (0: the device's SM count) stay empty
    args = Args(a=view(x), b=view(b), d=view(out), scale_b=view(sb), workspace=view(workspace),
                counters=view(counters), splits=splits.value)
    rc = lib.cutedsl_gemm_launch(kern, ctypes.byref(args), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert rc == 0, lib.cutedsl_gemm_last_error()
    torch.cuda.synchronize()
    assert not torch.isnan(ref).any() and int(counters.abs().sum()) == 0  # every tile written; counters handed back
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)

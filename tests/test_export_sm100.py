"""The AOT export of the sm_100a GEMMs (generators/export.py, generators/c_export.py): the same exporter and registry
as the Hopper kernels' (test_export.py, whose ctypes helpers this reuses), with the operands as byte views, block
scales and run-time format codes. Compiling tests keep to a few instances."""

import ctypes
import io
import json

import pytest
import torch
from table_picks import instance
from test_export import _args_type, _check_exported_objects, _open, _view, check_links, launch_refusal

from cutedsl_gemm.generators.runner import code_key
from cutedsl_gemm.selection import instances as M
from cutedsl_gemm.selection.dispatch import select_gemm

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
    insts = [instance(n) for n in SM100_EXPORTED]
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
        return launch_refusal(lib, kernel, args)

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
def test_sm100_library_links_with_every_symbol_resolved(exported_sm100_lib):
    check_links(exported_sm100_lib)

"""Tracing the kernels: fake (shape-symbolic) arguments and ``cute.compile`` for one instance of the table.

``compile_entry`` is the one place ``cute.compile`` runs, with the project's options (TVM-FFI calling
convention, target arch, kept PTX). ``compile_instance`` is the one compile path of every GEMM family: the JIT
cache, precompile, export and the catalog all go through it; the quantizers compile their kernels'
``*_entry`` through ``compile_entry`` (``ops/quantize.py``).
"""

from __future__ import annotations

import contextlib

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cutedsl_gemm.kernels.sm90.block_scales import BLOCK_RECIPES
from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm, Sm90GemmConfig, cutlass_dtype
from cutedsl_gemm.numerics.formats import float_format
from cutedsl_gemm.numerics.scale_layouts import SF_ATOM_BYTES
from cutedsl_gemm.selection.instances import GROUPED_GEMM, SM90_GEMM_OPS

COMPILE_OPTIONS = "--enable-tvm-ffi"
#: Base alignment the sm_100a GEMM assumes of its operand views (``problem`` checks it before every call): 16 bytes
#: for 8-bit rows (TMA), 32 for the sub-byte views that TMA unpacks (.b6x16_p32 / .b4x16_p64), 16 for block scales.
SM100_BYTE_ALIGN = 16
SM100_SUBBYTE_ALIGN = 32
SM100_SCALE_ALIGN = 16


@contextlib.contextmanager
def targeting(arch: str):
    """The DSL's target arch is ``arch`` inside: kernel constructors make ops that check it (the block-scaled
    kernel's Blackwell TMA op), which ``--gpu-arch`` alone does not set. So no GPU and no env var are needed."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    saved = envar.arch
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = saved


def compile_entry(entry, args, arch: str | None = None, ptx_dump_dir: str | None = None):
    """``cute.compile(entry, *args)`` for ``arch`` (default: the DSL's target arch, ``CUTE_DSL_ARCH`` or the
    current GPU's); with ``ptx_dump_dir`` (an existing directory) the PTX is kept on the result (``.__ptx__``).
    A kernel object whose constructor checks the arch must be built inside ``targeting(arch)`` too."""
    options = COMPILE_OPTIONS + ("" if arch is None else f" --gpu-arch {arch}")
    options += "" if ptx_dump_dir is None else f" --keep-ptx --dump-dir={ptx_dump_dir}"
    with targeting(arch) if arch is not None else contextlib.nullcontext():
        return cute.compile(entry, *args, options=options)


def _strided_scales(shape):
    """A fake fp32 scale view with two 32-bit run-time strides. Marked as such (``_use_32bit_stride``, which
    ``make_fake_tensor`` does not take), so that the DSL's exported C struct types its strides int32_t as the
    compiled code reads them, not int64_t."""
    t = make_fake_tensor(cutlass.Float32, shape, (cute.sym_int(), cute.sym_int()), assumed_align=4)
    t._use_32bit_stride = True
    return t


def fake_gemm_args(cfg: Sm90GemmConfig):
    """Fake tensors with symbolic M, N, K so one compilation serves every shape.

    K and N carry the divisibility TMA needs (16-byte aligned rows) so the kernel may assume it; the host
    validates it before every call.
    """
    m = cute.sym_int()
    n = cute.sym_int(divisibility=16)
    k = cute.sym_int(divisibility=16)
    # (A unquantized when the kernel quantizes it: ``a_input``)
    a = make_fake_compact_tensor(cutlass_dtype(cfg.a_input or cfg.a_dtype), (m, k), stride_order=(1, 0),
                                 assumed_align=16)
    # b follows torch._scaled_mm: (K, N) column-major (the transpose of a row-major (N, K) weight).
    b = make_fake_compact_tensor(cutlass_dtype(cfg.b_dtype), (k, n), stride_order=(0, 1), assumed_align=16)
    d = make_fake_compact_tensor(cutlass_dtype(cfg.out_dtype), (m, n), stride_order=(1, 0), assumed_align=16)
    if cfg.recipe == "tensor":
        sa = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
        sb = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    elif cfg.recipe == "row":
        sa = make_fake_compact_tensor(cutlass.Float32, (m, 1), stride_order=(1, 0), assumed_align=4)
        sb = make_fake_compact_tensor(cutlass.Float32, (1, n), stride_order=(1, 0), assumed_align=4)
    elif cfg.recipe in BLOCK_RECIPES:
        # (rows or row blocks, Kb) with run-time strides: torch's outer-dim-major and padded layouts and
        # plain row-major ones are all read in place. W's scales come transposed to (N or N blocks, Kb).
        kb = cute.sym_int()
        gran_a, gran_b = BLOCK_RECIPES[cfg.recipe]
        sa = _strided_scales((m if gran_a == "group" else cute.sym_int(), kb))
        sb = _strided_scales((n if gran_b == "group" else cute.sym_int(), kb))
    else:
        raise ValueError(f"unknown recipe {cfg.recipe!r}")
    if cfg.a_input:
        sa = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)  # computed in the kernel
    if cfg.bias_dtype:
        bias = make_fake_compact_tensor(cutlass_dtype(cfg.bias_dtype), (n,), assumed_align=4)
    else:
        bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    # Split-K workspace (fp32 partials) and per-tile counters: dummies of any size where unused.
    workspace = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=16)
    counters = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    return (a, b, d, sa, sb, bias, workspace, counters, cutlass.Int32(1), cutlass.Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def fake_fp8_out_args(cfg: Sm90GemmConfig):
    """Fake arguments of ``Sm90Fp8Gemm.call_fp8_out`` (``d_quant``): ``fake_gemm_args`` with the FP8 output (M, N)
    row-major in D's place, then its 1x128 scales (M, N / 128) M-major (quantize_fp8's "1x128" layout)."""
    a, b, d, *rest = fake_gemm_args(cfg)
    q = make_fake_compact_tensor(cutlass.Float8E4M3FN, d.shape, stride_order=(1, 0), assumed_align=16)
    scales = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride_order=(0, 1),
                                      assumed_align=4)
    return (a, b, q, scales, *rest)


def gemm_entry(cfg: Sm90GemmConfig):
    """(entry, fake arguments) of the Hopper GEMM of one configuration: its ``__call__``, or ``call_fp8_out`` for a
    kernel that emits FP8 (``d_quant``). Call inside ``targeting``: kernel constructors may check the arch."""
    kernel = Sm90Fp8Gemm(cfg)
    return (kernel.call_fp8_out, fake_fp8_out_args(cfg)) if cfg.d_quant else (kernel, fake_gemm_args(cfg))


def compile_gemm(cfg: Sm90GemmConfig, arch: str = "sm_90a"):
    """The Hopper GEMM of one configuration, compiled for ``arch``."""
    with targeting(arch):
        return compile_entry(*gemm_entry(cfg), arch)


def fake_sm100_args(inst):
    """Shape-symbolic arguments of the sm_100a GEMM (``Sm100F8F6F4Gemm.__call__``, or ``call_block_scaled`` for
    the block-scaled kinds): one compilation serves every M, N, K and every operand format of its kind.

    Each operand comes as three uint8 storage views (rows, row bytes), one per TMA descriptor; their row bytes
    divide by 16 (8-bit), 96 (128 x 6 bit) and 64 (128 x 4 bit). The block scales come after the operands as
    (row atoms, col atoms x 128) int32 words."""
    def operand(div, align):
        shape = (cute.sym_int(), cute.sym_int(divisibility=div))
        return make_fake_compact_tensor(cutlass.Uint8, shape, stride_order=(1, 0), assumed_align=align)

    def views():
        return [operand(16, SM100_BYTE_ALIGN), operand(96, SM100_SUBBYTE_ALIGN), operand(64, SM100_SUBBYTE_ALIGN)]

    def scale_words():
        shape = (cute.sym_int(), cute.sym_int(divisibility=SF_ATOM_BYTES // 4))
        return make_fake_compact_tensor(cutlass.Int32, shape, stride_order=(1, 0), assumed_align=SM100_SCALE_ALIGN)

    operands = (*views(), *views())
    out_t = float_format(inst.out_dtype).cutlass_dtype()
    c = make_fake_compact_tensor(
        out_t, (cute.sym_int(), cute.sym_int(divisibility=128 // out_t.width)), stride_order=(1, 0), assumed_align=16
    )
    sa = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    sb = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
    bias = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=4)
    i32 = cutlass.Int32
    rest = (c, sa, sb, bias, i32(0), i32(0), i32(0), i32(1), make_fake_stream(use_tvm_ffi_env_stream=True))
    if inst.mma_kind == "f8f6f4":
        return (*operands, *rest)
    return (*operands, scale_words(), scale_words(), *rest)


def sm100_entry(inst):
    """(entry, fake args) of an sm_100a instance: its kernel's ``__call__``, or ``call_block_scaled`` for the
    block-scaled kinds. Call inside ``targeting(inst.arch)``: the kernel's constructor checks the arch."""
    kernel = inst.sm100_kernel()
    return (kernel if kernel.scaling is None else kernel.call_block_scaled), fake_sm100_args(inst)


def fake_weight_only_args(cfg):
    """Shape-symbolic arguments of the weight-only GEMM (``Sm90WeightOnlyGemm.__call__``): one compilation serves
    every M, N, K. K and N carry the divisibility TMA needs of the activation and scale rows (16-byte strides); the
    packed weights are int32 (N atoms, K atoms, atom words) (``numerics/int_packing.py``)."""
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import ATOM_K, ATOM_ROWS

    act = cutlass_dtype(cfg.act_dtype)
    m, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    x = make_fake_compact_tensor(act, (m, k), stride_order=(1, 0), assumed_align=16)
    w = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), ATOM_ROWS * ATOM_K * cfg.bits // 32),
                                 stride_order=(2, 1, 0), assumed_align=16)
    if cfg.per_channel:
        s = make_fake_compact_tensor(cutlass.Float32, (1, n), stride_order=(1, 0), assumed_align=4)
    else:
        s = make_fake_compact_tensor(act, (cute.sym_int(), n), stride_order=(1, 0), assumed_align=16)
    # Zero points as the scales (a 1-element dummy without).
    z = make_fake_compact_tensor(act, s.shape, stride_order=(1, 0), assumed_align=16) if cfg.zeros else \
        make_fake_compact_tensor(act, (cute.sym_int(),), assumed_align=2)
    d = make_fake_compact_tensor(act, (m, n), stride_order=(1, 0), assumed_align=2)
    workspace = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=16)
    counters = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    return (x, w, s, z, d, workspace, counters, cutlass.Int32(1), cutlass.Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def instance_entry(inst):
    """(kernel entry, fake arguments) of an instance of the table, as it is traced: the Hopper GEMM's ``__call__``
    (op "gemm" or QUANT_GEMM) or ``call_fp8_out`` (GEMM_FP8_OUT), the weight-only GEMM's, the sm_100a GEMM's
    ``__call__`` / ``call_block_scaled``. Call inside ``targeting(inst.arch)``: kernel constructors may check the
    arch."""
    if inst.arch == "sm_90a" and inst.op in SM90_GEMM_OPS:
        return gemm_entry(inst.sm90_config())
    if (inst.arch, inst.op) == ("sm_90a", "weight_only"):
        from cutedsl_gemm.kernels.sm90.weight_only_gemm import Sm90WeightOnlyGemm
        from cutedsl_gemm.selection.instances import weight_only_config

        cfg = weight_only_config(inst)
        return Sm90WeightOnlyGemm(cfg), fake_weight_only_args(cfg)
    if (inst.arch, inst.op) == ("sm_100a", "gemm"):
        return sm100_entry(inst)
    if (inst.arch, inst.op) == ("sm_90a", GROUPED_GEMM):
        from cutedsl_gemm.families import sm90_grouped

        return sm90_grouped.entry(inst)
    raise ValueError(f"no compile path for {inst.name} (arch={inst.arch}, op={inst.op})")


def compile_instance(inst):
    """``cute.compile`` the kernel of an instance of the table for its arch: the one compile path that the JIT
    cache, precompile, export and the catalog share."""
    with targeting(inst.arch):
        return compile_entry(*instance_entry(inst), inst.arch)

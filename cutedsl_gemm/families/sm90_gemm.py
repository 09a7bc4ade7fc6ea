"""The Hopper FP8 / INT8 GEMM family (ops "gemm", ``QUANT_GEMM``, ``GEMM_FP8_OUT``; ``kernels/sm90/fp8_gemm.py``):
the kernel configuration of an instance, its checks, its compile entry (kernel object and shape-symbolic fake
arguments), its shared-memory plan and its launch plan (``LaunchPlan``, in the kernel's argument order).

The kernel modules are imported inside the functions: importing this module loads no DSL."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch

from cutedsl_gemm.families.keys import GEMM_FP8_OUT, QUANT_GEMM
from cutedsl_gemm.runtime import resources as R
from cutedsl_gemm.runtime.resources import split_k_buffers  # (a plain name in the launch path)

if TYPE_CHECKING:
    from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmConfig


def config(inst) -> Sm90GemmConfig:
    """The Hopper kernel's configuration of ``inst``: the fields it shares with the instance, plus what follows from
    them (``KernelInstance.sm90_config``, which a ``KernelVariant`` changes, is the way to read it)."""
    from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmConfig
    from cutedsl_gemm.numerics.formats import activation_format

    names = {f.name for f in dataclasses.fields(Sm90GemmConfig)}
    fields = {f.name: getattr(inst, f.name) for f in dataclasses.fields(inst) if f.name in names}
    if inst.op == QUANT_GEMM:  # activations in a_dtype, quantized in the kernel to the weight's kind
        fields.update(a_dtype=activation_format(inst.b_dtype).name, a_input=inst.a_dtype)
    if inst.op == GEMM_FP8_OUT:  # the epilogue quantizes the bf16 tile in 1x128 groups
        fields.update(d_quant="1x128")
    # Decode GEMMs run back to back (layer after layer) and are short: let each one's launch and set-up overlap the
    # previous kernel's tail (programmatic dependent launch).
    return Sm90GemmConfig(**fields, split_k=inst.can_split_k, pdl=inst.swap_ab)


# ------------------------------------------------------------------------------------------------
# fake arguments and the compile entry
# ------------------------------------------------------------------------------------------------
def _strided_scales(shape):
    """A fake fp32 scale view with two 32-bit run-time strides. Marked as such (``_use_32bit_stride``, which
    ``make_fake_tensor`` does not take), so that the DSL's exported C struct types its strides int32_t as the
    compiled code reads them, not int64_t."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    t = make_fake_tensor(cutlass.Float32, shape, (cute.sym_int(), cute.sym_int()), assumed_align=4)
    t._use_32bit_stride = True
    return t


def fake_gemm_args(cfg: Sm90GemmConfig):
    """Fake tensors with symbolic M, N, K so one compilation serves every shape.

    K and N carry the divisibility TMA needs (16-byte aligned rows) so the kernel may assume it; the host
    validates it before every call.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from cutedsl_gemm.kernels.sm90.block_scales import BLOCK_RECIPES
    from cutedsl_gemm.kernels.sm90.gemm_plan import cutlass_dtype

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
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    a, b, d, *rest = fake_gemm_args(cfg)
    q = make_fake_compact_tensor(cutlass.Float8E4M3FN, d.shape, stride_order=(1, 0), assumed_align=16)
    scales = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()), stride_order=(0, 1),
                                      assumed_align=4)
    return (a, b, q, scales, *rest)


def gemm_entry(cfg: Sm90GemmConfig):
    """(entry, fake arguments) of the Hopper GEMM of one configuration: its ``__call__``, or ``call_fp8_out`` for a
    kernel that emits FP8 (``d_quant``). Call inside ``targeting``: kernel constructors may check the arch."""
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm

    kernel = Sm90Fp8Gemm(cfg)
    return (kernel.call_fp8_out, fake_fp8_out_args(cfg)) if cfg.d_quant else (kernel, fake_gemm_args(cfg))


def compile_gemm(cfg: Sm90GemmConfig, arch: str = "sm_90a"):
    """The Hopper GEMM of one configuration (not necessarily a row of the table), compiled for ``arch``."""
    from cutedsl_gemm.runtime.compile import compile_entry, targeting

    with targeting(arch):
        return compile_entry(*gemm_entry(cfg), arch)


def entry(inst):
    """(entry, fake arguments) of an instance as it is traced: the kernel's ``__call__`` (op "gemm" or
    QUANT_GEMM) or ``call_fp8_out`` (GEMM_FP8_OUT). Call inside ``targeting(inst.arch)``."""
    return gemm_entry(inst.sm90_config())


# ------------------------------------------------------------------------------------------------
# checks and resources
# ------------------------------------------------------------------------------------------------
def check(inst) -> None:
    """Raise ValueError naming the broken rule if the kernel cannot build ``inst`` (MMA shape, cluster,
    shared-memory budget: ``Sm90GemmPlan.check_config``)."""
    from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmPlan

    Sm90GemmPlan.check_config(inst.sm90_config())


def resources(inst) -> tuple[int, int]:
    """(dynamic shared memory bytes, A/B mainloop stages) of the instance's kernel, as its plan sets them."""
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm

    kernel = Sm90Fp8Gemm(inst.sm90_config())
    return kernel.smem_bytes, kernel.ab_stages


# ------------------------------------------------------------------------------------------------
# the launch plan
# ------------------------------------------------------------------------------------------------
class LaunchPlan(NamedTuple):
    """Everything a launch of one Hopper instance on one problem size needs besides the tensors."""

    fn: object  # the compiled kernel
    max_clusters: int
    splits: int
    ws_need: tuple  # (fp32 partials, counters) the split-K workspace must hold
    device_index: int
    dummy_bias: torch.Tensor
    idle_ws: tuple  # stand-ins for the split-K buffers when splits == 1 (never read)

    def run(self, a, b, out, scale_a, scale_b, bias, global_a=None, global_b=None) -> torch.Tensor:
        """Launch on the current stream; ``scale_a``/``scale_b`` are the kernel's scale views (no global scales)."""
        partials, counters = split_k_buffers(self)
        self.fn(a, b, out, scale_a, scale_b, self.dummy_bias if bias is None else bias, partials, counters,
                self.splits, self.max_clusters)
        return out

    def run_fp8_out(self, a, b, q, q_scales, scale_a, scale_b, bias):
        """Launch an instance that emits FP8 in 1x128 groups (op GEMM_FP8_OUT, ``Sm90Fp8Gemm.call_fp8_out``) on the
        current stream: ``q`` (M, N) e4m3 and ``q_scales`` (M, N / 128) M-major as ``quantize_fp8`` returns them."""
        partials, counters = split_k_buffers(self)
        self.fn(a, b, q, q_scales, scale_a, scale_b, self.dummy_bias if bias is None else bias, partials, counters,
                self.splits, self.max_clusters)
        return q, q_scales


def launch_plan(inst, m: int, n: int, splits: int, device_index: int, **_formats) -> LaunchPlan:
    """Compile (once) and size a launch of ``inst`` for an M x N output with ``splits`` K splits
    (``resources.split_k_sizing``)."""
    clusters, need, idle = R.split_k_sizing(inst, m, n, splits, device_index)
    return LaunchPlan(R.compiled(inst), clusters, splits, need, device_index, R.dummy_bias(device_index), idle)

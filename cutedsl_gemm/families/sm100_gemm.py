"""The Blackwell tcgen05 GEMM family (sm_100a, op "gemm"; ``kernels/sm100``): the dense f8f6f4 kind and the
block-scaled MX / NVFP4 kinds. The kernel object of an instance, its checks, its compile entry (kernel object and
shape-symbolic fake arguments), its shared-memory plan and its launch plan (``Sm100LaunchPlan``).

The kernel modules are imported inside the functions: importing this module loads no DSL."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cutedsl_gemm.runtime import resources as R
from cutedsl_gemm.runtime.device import device_info
from cutedsl_gemm.selection.instances import SM100_KINDS

#: Base alignment the sm_100a GEMM assumes of its operand views (``problem`` checks it before every call): 16 bytes
#: for 8-bit rows (TMA), 32 for the sub-byte views that TMA unpacks (.b6x16_p32 / .b4x16_p64), 16 for block scales.
SM100_BYTE_ALIGN = 16
SM100_SUBBYTE_ALIGN = 32
SM100_SCALE_ALIGN = 16


def kernel(inst):
    """The Blackwell kernel object an instance compiles (``KernelInstance.sm100_kernel``): 2-CTA
    (``cta_group::2``) when its clusters are 2x1, block-scaled through ``BlockScaling`` for the MX / NVFP4 kinds.
    Build it inside ``targeting(inst.arch)``: its constructor checks the arch."""
    from cutedsl_gemm.kernels.sm100 import BlockScaling, Sm100F8F6F4Gemm
    from cutedsl_gemm.numerics.formats import float_format

    kind = inst.mma_kind
    return Sm100F8F6F4Gemm(float_format(inst.out_dtype).cutlass_dtype(), inst.cluster_m == 2, inst.tile_n,
                           inst.bias_dtype is not None, scaling=None if kind == "f8f6f4" else BlockScaling(kind))


# ------------------------------------------------------------------------------------------------
# fake arguments and the compile entry
# ------------------------------------------------------------------------------------------------
def fake_sm100_args(inst):
    """Shape-symbolic arguments of the sm_100a GEMM (``Sm100F8F6F4Gemm.__call__``, or ``call_block_scaled`` for
    the block-scaled kinds): one compilation serves every M, N, K and every operand format of its kind.

    Each operand comes as three uint8 storage views (rows, row bytes), one per TMA descriptor; their row bytes
    divide by 16 (8-bit), 96 (128 x 6 bit) and 64 (128 x 4 bit). The block scales come after the operands as
    (row atoms, col atoms x 128) int32 words."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from cutedsl_gemm.numerics.formats import float_format
    from cutedsl_gemm.numerics.scale_layouts import SF_ATOM_BYTES

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


def entry(inst):
    """(entry, fake args) of an sm_100a instance: its kernel's ``__call__``, or ``call_block_scaled`` for the
    block-scaled kinds. Call inside ``targeting(inst.arch)``: the kernel's constructor checks the arch."""
    k = inst.sm100_kernel()
    return (k if k.scaling is None else k.call_block_scaled), fake_sm100_args(inst)


# ------------------------------------------------------------------------------------------------
# checks and resources
# ------------------------------------------------------------------------------------------------
def check(inst) -> None:
    """Raise ValueError with the reason if ``inst`` is no sm_100a GEMM: the kernel takes its out dtype, bias, CTA
    mode and tile_n (and checks them); everything else is fixed by the kernel."""
    if inst.op != "gemm":
        raise ValueError(f"op must be 'gemm', got {inst.op!r}")
    if inst.mma_kind is None or inst.a_dtype != inst.b_dtype:
        raise ValueError(f"recipe {inst.recipe!r} with operands {inst.a_dtype} x {inst.b_dtype} is no tcgen05 kind; "
                         f"built: {', '.join(f'{r} with {a} x {a}' for r, a in SM100_KINDS)}")
    if (inst.schedule, inst.tile_m, inst.cluster_n) not in (("1sm", 128, 1), ("2sm", 128, 1)) \
            or inst.cluster_m != (2 if inst.schedule == "2sm" else 1):
        raise ValueError("a CTA tile is 128 rows: schedule '1sm' in 1x1 clusters, or '2sm' (one 256-row MMA over "
                         f"two CTAs) in 2x1; got {inst.schedule!r}, tile_m={inst.tile_m}, cluster "
                         f"{inst.cluster_m}x{inst.cluster_n}")
    if inst.bias_dtype not in (None, "fp32"):
        raise ValueError(f"the bias is read as fp32: bias_dtype must be None or 'fp32', got {inst.bias_dtype!r}")
    fixed = {"stages": 0, "accum": "fast", "swap_ab": False, "split_tail": False, "ctas_per_sm": 1, "epi_stages": 0}
    wrong = {k: getattr(inst, k) for k, v in fixed.items() if getattr(inst, k) != v}
    if wrong:
        raise ValueError(f"the sm_100a GEMM fixes {fixed}; got {wrong}")
    # The kernel's own checks, without building it (its TMA ops are arch-checked by the DSL at construction)
    from cutedsl_gemm.kernels.sm100 import ScaleGeometry, Sm100F8F6F4Gemm
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import TILE_K
    from cutedsl_gemm.numerics.formats import float_format

    use_2cta = inst.cluster_m == 2
    Sm100F8F6F4Gemm.check_config(float_format(inst.out_dtype).cutlass_dtype(), use_2cta, inst.tile_n)
    tile_k = TILE_K if inst.mma_kind == "f8f6f4" else ScaleGeometry(inst.mma_kind, inst.tile_n, use_2cta).tile_k
    if inst.tile_k != tile_k:
        raise ValueError(f"tile_k must be the kernel's K tile, {tile_k} elements (128 bytes a row); got {inst.tile_k}")


def resources(inst) -> tuple[int, int]:
    """(dynamic shared memory bytes, A/B mainloop stages) of the instance's kernel, as its host-side setup chooses
    them (traced; it builds the kernel, whose constructor checks the DSL's target arch)."""
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import describe_resources

    res = describe_resources(inst.sm100_kernel())
    return res["smem_bytes"], res["num_ab_stage"]


# ------------------------------------------------------------------------------------------------
# the launch plan
# ------------------------------------------------------------------------------------------------
class Sm100LaunchPlan(NamedTuple):
    """Everything a launch of one sm_100a instance on one problem needs besides the tensors. The operands come
    as (rows, row bytes) uint8 views; each goes into the storage view of its format (8-bit, 6-bit or 4-bit TMA
    unpacking; the packed FP4 kinds load bytes), dummies fill the other two."""

    fn: object
    max_clusters: int
    k: int
    code_a: int  # tcgen05 instruction-descriptor format codes
    code_b: int
    storage_a: int  # which of the three storage views each operand fills
    storage_b: int
    dummy_views: tuple
    dummy_bias: torch.Tensor
    unit: torch.Tensor  # 1.0: the global scales of recipes that have none
    block_scaled: bool

    def run(self, a, b, out, scale_a, scale_b, bias, global_a=None, global_b=None) -> torch.Tensor:
        """Launch on the current stream. ``scale_a``/``scale_b``: (1,) fp32 per-tensor scales, or for the
        block-scaled kinds the blocked scales as (row atoms, col atoms x 128) int32 words; ``global_a``/``global_b``:
        NVFP4's (1,) fp32 per-tensor scales (None: 1)."""
        a_views, b_views = list(self.dummy_views), list(self.dummy_views)
        a_views[self.storage_a] = a
        b_views[self.storage_b] = b
        tail = (self.dummy_bias if bias is None else bias, self.k, self.code_a, self.code_b, self.max_clusters)
        if self.block_scaled:
            self.fn(*a_views, *b_views, scale_a, scale_b, out, self.unit if global_a is None else global_a,
                    self.unit if global_b is None else global_b, *tail)
        else:
            self.fn(*a_views, *b_views, out, scale_a, scale_b, *tail)
        return out


@R.buffer_cache
def _stand_ins(index: int):
    """Valid, aligned operand views for the storage classes an operand does not use (never read), and 1.0."""
    dev = torch.device("cuda", index)
    buf, unit = R.persistent_buffer(index, lambda: (torch.zeros(128 * 128 + 256, dtype=torch.uint8, device=dev),
                                                  torch.ones(1, dtype=torch.float32, device=dev)))
    off = (-buf.data_ptr()) % 256
    flat = buf[off: off + 128 * 128]
    views = (flat.view(128, 128), flat[: 128 * 96].view(128, 96), flat[: 128 * 64].view(128, 64))
    return views, unit


def launch_plan(inst, m: int, n: int, splits: int, device_index: int, *, k: int = 0, fmt_a: Optional[str] = None,
                fmt_b: Optional[str] = None) -> Sm100LaunchPlan:
    """Compile (once) and size a launch of ``inst``: K and the operand formats too (the kernel reads both at run
    time); no split-K reduction."""
    if splits != 1:
        raise ValueError(f"{inst.name} is built without the split-K reduction; got splits={splits}")
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import MMA_FORMAT_CODE, STORAGE_8BIT, STORAGE_OF_CODE

    try:
        code_a, code_b = MMA_FORMAT_CODE[fmt_a], MMA_FORMAT_CODE[fmt_b]
    except KeyError:
        raise ValueError(f"{inst.name} takes operand formats {', '.join(MMA_FORMAT_CODE)}; got {fmt_a} x {fmt_b}") \
            from None
    packed = inst.a_dtype == "e2m1"  # the packed FP4 kinds read their operands' bytes through the 8-bit view
    storage_a = STORAGE_8BIT if packed else STORAGE_OF_CODE[code_a]
    storage_b = STORAGE_8BIT if packed else STORAGE_OF_CODE[code_b]
    views, unit = _stand_ins(device_index)
    clusters = device_info(device_index)[1] // inst.cluster_m  # a persistent grid of one CTA per SM
    return Sm100LaunchPlan(R.compiled(inst), clusters, k, code_a, code_b, storage_a, storage_b, views,
                           R.dummy_bias(device_index), unit, inst.mma_kind != "f8f6f4")

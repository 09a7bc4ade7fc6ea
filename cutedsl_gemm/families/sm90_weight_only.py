"""The Hopper weight-only GEMM family (op ``WEIGHT_ONLY``, ``kernels/sm90/weight_only_gemm.py``): bf16 / fp16
activations x packed int4 / int8 weights. The kernel configuration of an instance, its checks, its compile entry
(kernel object and shape-symbolic fake arguments), its shared-memory plan and its launch plan
(``WeightOnlyLaunchPlan``).

The recipes it runs with (``WEIGHT_ONLY_RECIPES``, ``WEIGHT_ONLY_FORMATS``) are table data and stay with the table
(``selection/instances.py``). The kernel modules are imported inside the functions: importing this module loads
no DSL."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from cutedsl_gemm.numerics.formats import float_format
from cutedsl_gemm.runtime import resources as R
from cutedsl_gemm.runtime.resources import split_k_buffers  # (a plain name in the launch path)
from cutedsl_gemm.selection.instances import WEIGHT_ONLY_FORMATS, WEIGHT_ONLY_RECIPES

if TYPE_CHECKING:
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import WeightOnlyConfig


def config(inst) -> WeightOnlyConfig:
    """The weight-only kernel's configuration of a weight-only instance (``selection.instances.weight_only_config``)."""
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import WeightOnlyConfig
    from cutedsl_gemm.numerics.formats import element_format

    group, zeros = WEIGHT_ONLY_RECIPES[inst.recipe]
    return WeightOnlyConfig(bits=element_format(inst.b_dtype).bits, group=group, zeros=zeros, act_dtype=inst.a_dtype,
                            tile_m=inst.tile_m, tile_n=inst.tile_n, stages=inst.stages)


def fake_weight_only_args(cfg: WeightOnlyConfig):
    """Shape-symbolic arguments of the weight-only GEMM (``Sm90WeightOnlyGemm.__call__``): one compilation serves
    every M, N, K. K and N carry the divisibility TMA needs of the activation and scale rows (16-byte strides); the
    packed weights are int32 (N atoms, K atoms, atom words) (``numerics/int_packing.py``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from cutedsl_gemm.kernels.sm90.gemm_plan import cutlass_dtype
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


def entry(inst):
    """(kernel object, fake arguments) of a weight-only instance: one compilation serves every M, N and K.
    Call inside ``targeting(inst.arch)``."""
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import Sm90WeightOnlyGemm

    cfg = config(inst)
    return Sm90WeightOnlyGemm(cfg), fake_weight_only_args(cfg)


# ------------------------------------------------------------------------------------------------
# checks and resources
# ------------------------------------------------------------------------------------------------
def check(inst) -> None:
    """Raise ValueError with the reason if the weight-only kernel cannot build ``inst``: the recipe its weight format
    runs with, the output in the activations' dtype without bias, the fields the kernel fixes, then the kernel's own
    plan (``WeightOnlyPlan.check_config``)."""
    if inst.recipe not in WEIGHT_ONLY_FORMATS.get(inst.b_dtype, ()):
        raise ValueError(f"{inst.b_dtype} weights run with recipes {WEIGHT_ONLY_FORMATS}, got {inst.recipe!r}")
    if inst.out_dtype != inst.a_dtype or inst.bias_dtype is not None:
        raise ValueError(f"the output is in the activations' dtype ({inst.a_dtype}), without bias; got "
                         f"out={inst.out_dtype} bias={inst.bias_dtype}")
    fixed = {"swap_ab": True, "tile_k": 128, "accum": "fast", "cluster_m": 1, "cluster_n": 1, "split_tail": False,
             "ctas_per_sm": 1, "epi_stages": 0}
    wrong = {k: getattr(inst, k) for k, v in fixed.items() if getattr(inst, k) != v}
    if wrong:
        raise ValueError(f"the weight-only GEMM fixes {fixed}; got {wrong}")
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import WeightOnlyPlan

    WeightOnlyPlan.check_config(config(inst))


def resources(inst) -> tuple[int, int]:
    """(dynamic shared memory bytes, mainloop stages) of the instance's kernel, as its plan sets them."""
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import Sm90WeightOnlyGemm

    kernel = Sm90WeightOnlyGemm(config(inst))
    return kernel.smem_bytes, kernel.stages


# ------------------------------------------------------------------------------------------------
# the launch plan
# ------------------------------------------------------------------------------------------------
class WeightOnlyLaunchPlan(NamedTuple):
    """A launch of one weight-only instance (``kernels/sm90/weight_only_gemm.py``) on one problem size."""

    fn: object
    max_clusters: int
    splits: int
    ws_need: tuple
    device_index: int
    idle_ws: tuple
    no_zeros: torch.Tensor  # stands in for the zero points of instances built without them (never read)

    def run(self, x, w, scales, zeros, out) -> torch.Tensor:
        """Launch on the current stream: activations, packed weights, scales and zero points in the kernel's
        layouts (``numerics.int_packing``), ``out`` (M, N)."""
        partials, counters = split_k_buffers(self)
        self.fn(x, w, scales, self.no_zeros if zeros is None else zeros, out, partials, counters, self.splits,
                self.max_clusters)
        return out


@R.buffer_cache
def _no_zeros(index: int, dtype: torch.dtype) -> torch.Tensor:
    return R.zeros(index, 8, dtype)


def launch_plan(inst, m: int, n: int, splits: int, device_index: int, **_formats) -> WeightOnlyLaunchPlan:
    """Compile (once) and size a launch of ``inst`` for an M x N output with ``splits`` K splits
    (``resources.split_k_sizing``)."""
    clusters, need, idle = R.split_k_sizing(inst, m, n, splits, device_index)
    no_zeros = _no_zeros(device_index, float_format(inst.a_dtype).torch_dtype)
    return WeightOnlyLaunchPlan(R.compiled(inst), clusters, splits, need, device_index, idle, no_zeros)

"""PTX fingerprints: the md5 of the PTX of a fixed sample of kernels, for sm_90a and sm_100a, compiled without a GPU.

``python -m cutedsl_gemm.tools.ptx_fingerprint [--write FILE] [--check FILE] [--jobs N] [--filter SUBSTR]``

The sample (``SAMPLE``) holds one instance of the table per kernel family (``generators.catalog.family_key``: every
op, schedule, scaling, integer format, swapped and two-CTA-per-SM form, last-wave split and accumulation of both
architectures, with every recipe and operand, output and bias type among them) and the quantizer kernels
(``QUANTIZERS``: FP8 and INT8 for sm_90a, MX and NVFP4 for sm_100a). Each compiles the runtime's way
(``runtime.compile``) and its PTX is read as ``ptx_inspect`` keeps it.

The PTX of a configuration is the same from run to run; the only lines left out are the compiler's banner at the
top (column-0 ``//`` comments: its build id and version), which change with the toolchain, not with the code.

``--write FILE`` records the fingerprints; ``--check FILE`` compares against a recorded file and exits 1 naming
each kernel whose PTX changed, that no longer compiles, or that either side lacks. A change that moves PTX on
purpose rewrites the reference (``tests/data/ptx_fingerprints.json``) and says why in its commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

from cutedsl_gemm.selection.instances import SM90, SM100, table

#: Instances of the table, one per kernel family (``generators.catalog.sample`` picked them; held fixed by name so
#: that the sample compared stays the same while the table grows).
SAMPLE = (
    "sm_90a_gemm_small_m_tensor_e4m3xe4m3_bf16_t128x16_c1x1_promoted_swapab",
    "sm_90a_gemm_small_m_row_e5m2xe5m2_fp16_biasfp16_t128x16_c1x1_fast_swapab",
    "sm_90a_gemm_small_m_1x128_128x128_e4m3xe4m3_fp32_biasfp32_t128x16_c1x1_promoted_swapab",
    "sm_90a_gemm_cooperative_tensor_e4m3xe4m3_bf16_t128x192_c2x1_promoted",
    "sm_90a_gemm_cooperative_row_e5m2xe5m2_fp16_biasfp16_t128x192_c2x1_fast",
    "sm_90a_gemm_cooperative_tensor_e4m3xe4m3_fp32_biasfp32_t64x192_c2x1_promoted_2persm",
    "sm_90a_gemm_cooperative_tensor_e4m3xe4m3_bf16_biasbf16_t64x192_c2x1_promoted_swapab_2persm",
    "sm_90a_gemm_cooperative_1x128_128x128_e4m3xe4m3_bf16_biasbf16_t128x128_c2x1_promoted",
    "sm_90a_gemm_cooperative_128x128_128x128_e4m3xe4m3_bf16_t64x192_c2x1_promoted_2persm",
    "sm_90a_gemm_cooperative_tensor_e4m3xe4m3_bf16_lastwave_t128x192_c2x1_promoted",
    "sm_90a_gemm_cooperative_1x128_1x128_e4m3xe4m3_bf16_lastwave_t128x128_c2x1_promoted",
    "sm_90a_gemm_small_m_tensor_int8xint8_bf16_t128x16_c1x1_fast_swapab",
    "sm_90a_gemm_cooperative_tensor_int8xint8_bf16_t128x256_c2x1_fast",
    "sm_90a_gemm_cooperative_tensor_int8xint8_bf16_t64x192_c2x1_fast_2persm",
    "sm_90a_gemm_cooperative_tensor_int8xint8_bf16_lastwave_t128x192_c2x1_fast",
    "sm_90a_quant_gemm_small_m_1x128_128x128_bf16xe4m3_bf16_t128x16_c1x1_promoted_swapab",
    "sm_90a_quant_gemm_small_m_row_fp16xe4m3_fp16_biasfp32_t128x16_c1x1_promoted_swapab",
    "sm_90a_quant_gemm_small_m_row_bf16xint8_bf16_t128x16_c1x1_fast_swapab",
    "sm_90a_gemm_fp8_out_cooperative_1x128_128x128_e4m3xe4m3_bf16_t128x128_c2x1_promoted",
    "sm_90a_gemm_fp8_out_cooperative_1x128_128x128_e4m3xe4m3_bf16_biasfp32_lastwave_t128x128_c2x1_promoted",
    "sm_90a_gemm_fp8_out_cooperative_tensor_e4m3xe4m3_bf16_t128x128_c2x1_promoted",
    "sm_90a_grouped_gemm_contiguous_row_e4m3xe4m3_bf16_t128x192_c1x1_promoted_earlyscales",
    "sm_90a_grouped_gemm_contiguous_row_e4m3xe4m3_bf16_t64x128_c1x1_promoted_earlyscales",
    # the wider tiles' code: two consumer warp groups along N (64x256), serial promotion (128x192)
    "sm_90a_grouped_gemm_masked_row_e4m3xe4m3_bf16_t64x256_c1x1_promoted_earlyscales",
    "sm_90a_grouped_gemm_contiguous_tensor_e4m3xe4m3_bf16_t128x192_c1x1_promoted",
    "sm_90a_grouped_gemm_contiguous_row_e4m3xe4m3_bf16_t128x192_c2x1_promoted_earlyscales",
    "sm_90a_grouped_gemm_masked_tensor_e4m3xe4m3_fp16_t128x192_c1x1_promoted",
    "sm_90a_grouped_gemm_contiguous_1x128_128x128_e4m3xe4m3_bf16_t128x128_c1x1_promoted",
    "sm_90a_grouped_gemm_masked_1x128_128x128_e4m3xe4m3_fp16_t128x128_c1x1_promoted",
    "sm_90a_weight_only_small_m_group32_bf16xint4_bf16_t128x16_c1x1_fast_swapab",
    "sm_90a_weight_only_small_m_group32_zeros_fp16xint4_fp16_t128x16_c1x1_fast_swapab",
    "sm_90a_weight_only_small_m_channel_bf16xint4_bf16_t128x16_c1x1_fast_swapab",
    "sm_90a_weight_only_small_m_channel_bf16xint8_bf16_t128x16_c1x1_fast_swapab",
    "sm_100a_gemm_1sm_tensor_f8f6f4xf8f6f4_bf16_t128x128_c1x1_fast",
    "sm_100a_gemm_1sm_mx_f8f6f4xf8f6f4_fp16_biasfp32_t128x128_c1x1_fast",
    "sm_100a_gemm_2sm_tensor_f8f6f4xf8f6f4_fp32_t128x128_c2x1_fast",
    "sm_100a_gemm_2sm_mx_f8f6f4xf8f6f4_bf16_t128x128_c2x1_fast",
    "sm_100a_gemm_1sm_mx_e2m1xe2m1_bf16_t128x128_c1x1_fast_k256",
    "sm_100a_gemm_1sm_nvfp4_e2m1xe2m1_bf16_t128x128_c1x1_fast_k256",
    "sm_100a_gemm_2sm_mx_e2m1xe2m1_bf16_t128x128_c2x1_fast_k256",
    "sm_100a_gemm_2sm_nvfp4_e2m1xe2m1_bf16_t128x128_c2x1_fast_k256",
)

#: The quantizer kernels, name -> (arch, kind, arguments): "fp8" kinds are ``ops.quantize``'s FP8 / INT8 kernels
#: (``fp8_quantizer_entry``'s kind, input, output and configuration), "block" the MX / NVFP4
#: quantizer (recipe, element format, input dtype, whether it computes the global scale), "moe_route" the MoE
#: routing quantizer (granularity, hidden, top-k, experts, masked, blocked; bf16 rows and weights, int64 ids, E4M3
#: codes), "moe_route_count" the blocked form's count (top-k, experts) and "pair_sum" the sum (dtype, top-k).
QUANTIZERS = {
    "sm_90a_quantize_group_bf16_e4m3_mn_major": (SM90, "fp8", ("group", "bf16", "e4m3", 128, "mn_major")),
    "sm_90a_quantize_group_fp32_e4m3_row_major": (SM90, "fp8", ("group", "fp32", "e4m3", 128, "row_major")),
    "sm_90a_quantize_block128_bf16_e4m3": (SM90, "fp8", ("block", "bf16", "e4m3", 128)),
    "sm_90a_quantize_block256_fp16_e5m2": (SM90, "fp8", ("block", "fp16", "e5m2", 256)),
    "sm_90a_quantize_row_block_bf16_e4m3_8192": (SM90, "fp8", ("row_block", "bf16", "e4m3", 256, 8192)),
    "sm_90a_quantize_row_fp32_e4m3": (SM90, "fp8", ("row", "fp32", "e4m3")),
    "sm_90a_quantize_tensor_amax_bf16": (SM90, "fp8", ("tensor_amax", "bf16", "e4m3")),
    "sm_90a_quantize_tensor_cast_bf16_e4m3": (SM90, "fp8", ("tensor_cast", "bf16", "e4m3")),
    "sm_90a_quantize_row_block_bf16_int8_4096": (SM90, "fp8", ("row_block", "bf16", "int8", 128, 4096)),
    "sm_90a_quantize_tensor_cast_fp16_int8": (SM90, "fp8", ("tensor_cast", "fp16", "int8")),
    "sm_90a_quantize_gated_row_bf16_e4m3_weighted": (SM90, "fp8", ("gated", "bf16", "e4m3", "row", 2048, True)),
    "sm_90a_quantize_gated_1x128_bf16_e4m3": (SM90, "fp8", ("gated", "bf16", "e4m3", "1x128", 128, False)),
    "sm_90a_moe_route_row_bf16_e4m3_h2048_k8_e128": (SM90, "moe_route", ("row", 2048, 8, 128, False, False)),
    "sm_90a_moe_route_1x128_masked_bf16_e4m3_h7168_k8_e256": (SM90, "moe_route",
                                                               ("1x128", 7168, 8, 256, True, False)),
    "sm_90a_moe_route_blocked_row_bf16_e4m3_h2048_k8_e128": (SM90, "moe_route", ("row", 2048, 8, 128, False, True)),
    "sm_90a_moe_route_tensor_bf16_e4m3_h4096_k2_e8": (SM90, "moe_route", ("tensor", 4096, 2, 8, False, False)),
    "sm_90a_moe_route_count_k8_e128": (SM90, "moe_route_count", (8, 128)),
    "sm_90a_moe_pair_sum_bf16_k8": (SM90, "pair_sum", ("bf16", 8)),
    "sm_100a_quantize_mx_bf16_e4m3": (SM100, "block", ("mx", "e4m3", "bf16", False)),
    "sm_100a_quantize_mx_fp32_e2m1": (SM100, "block", ("mx", "e2m1", "fp32", False)),
    "sm_100a_quantize_nvfp4_bf16_global": (SM100, "block", ("nvfp4", "e2m1", "bf16", True)),
}

REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "data" / "ptx_fingerprints.json"


def kernel_names() -> tuple[str, ...]:
    return (*SAMPLE, *QUANTIZERS)


def normalized(ptx: str) -> str:
    """The PTX without the compiler's banner (the column-0 ``//`` comment lines: build id, toolchain version)."""
    return "".join(line for line in ptx.splitlines(keepends=True) if not line.startswith("//"))


def fingerprint(ptx: str) -> str:
    return hashlib.md5(normalized(ptx).encode()).hexdigest()


def _instance(name: str):
    for inst in table():
        if inst.name == name and not inst.stages:
            return inst
    raise LookupError(f"{name} is no longer in the instance table: pick its family's replacement in SAMPLE")


def _quantizer_ptx(arch: str, kind: str, args: tuple) -> str:
    import tempfile

    import torch

    from cutedsl_gemm.numerics.formats import element_format, float_format

    if kind == "block":
        from cutedsl_gemm.ops.quantize import compile_quantizer

        recipe, fmt, src, compute_global = args
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[src]
        return compile_quantizer(recipe, fmt, dtype, compute_global, keep_ptx=True, arch=arch).__ptx__
    from cutedsl_gemm.ops.quantize import fp8_quantizer_entry
    from cutedsl_gemm.runtime.compile import compile_entry, targeting

    with targeting(arch), tempfile.TemporaryDirectory(prefix="cutedsl_gemm_ptx_") as tmp:
        if kind in ("moe_route", "moe_route_count", "pair_sum"):
            entry = _moe_route_entry(kind, args)
        else:
            fp8_kind, src, dst, *cfg = args
            entry = fp8_quantizer_entry(fp8_kind, float_format(src), element_format(dst), *cfg)
        return compile_entry(*entry, arch=arch, ptx_dump_dir=tmp).__ptx__


def _moe_route_entry(kind: str, args: tuple):
    import cutlass

    from cutedsl_gemm.kernels.sm90 import moe_route as K
    from cutedsl_gemm.numerics.formats import E4M3

    if kind == "pair_sum":
        return K.pair_sum_entry({"bf16": cutlass.BFloat16}[args[0]], args[1])
    if kind == "moe_route_count":
        return K.count_entry(*args, cutlass.Int64)
    gran, hidden, top_k, experts, masked, blocked = args
    return K.route_entry(cutlass.BFloat16, E4M3.cutlass_dtype(), E4M3.max_finite, gran, hidden=hidden, top_k=top_k,
                         experts=experts, masked=masked, id_dtype=cutlass.Int64, weight_dtype=cutlass.BFloat16,
                         blocked=blocked)


def kernel_ptx(name: str) -> str:
    """Compile the kernel ``name`` of the sample (no GPU) and return its PTX."""
    if name in QUANTIZERS:
        return _quantizer_ptx(*QUANTIZERS[name])
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    return inspect_instance(_instance(name)).ptx


def _fingerprint_of(name: str) -> str:  # (module level: the runner's workers take it by reference)
    ptx = kernel_ptx(name)
    if not ptx:
        raise RuntimeError("the compiler kept no PTX")
    return fingerprint(ptx)


@dataclass
class Fingerprints:
    dsl: str
    kernels: Dict[str, str]  # name -> md5 of the normalized PTX
    failed: Dict[str, str]  # name -> why it did not compile


def compute(names: Sequence[str] | None = None, jobs: int | None = None, stream=None) -> Fingerprints:
    """Fingerprints of ``names`` (default: the whole sample), compiled in ``jobs`` worker processes."""
    from cutedsl_gemm.generators.runner import run_parallel
    from cutedsl_gemm.runtime.jit import dsl_version

    names = list(kernel_names() if names is None else names)
    results = run_parallel(_fingerprint_of, names, jobs, "ptx", stream=stream)
    return Fingerprints(dsl_version(), {r.item: r.value for r in results if r.ok},
                        {r.item: r.error for r in results if not r.ok})


def write(path: Path, fps: Fingerprints) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"dsl": fps.dsl, "kernels": dict(sorted(fps.kernels.items()))}
    path.write_text(json.dumps(data, indent=1) + "\n")


def load(path: Path) -> tuple[str, Dict[str, str]]:
    data = json.loads(Path(path).read_text())
    return data.get("dsl", "?"), dict(data["kernels"])


def compare(recorded: Dict[str, str], fps: Fingerprints, names: Sequence[str]) -> List[str]:
    """One line per kernel of ``names`` that differs from ``recorded``: changed PTX, failed to compile, or absent
    from either side; [] when all agree."""
    lines = []
    for name in names:
        if name in fps.failed:
            lines.append(f"FAILED   {name}: {fps.failed[name]}")
        elif name not in recorded:
            lines.append(f"NEW      {name}: {fps.kernels[name]} (not in the reference)")
        elif fps.kernels[name] != recorded[name]:
            lines.append(f"CHANGED  {name}: {recorded[name]} -> {fps.kernels[name]}")
    lines += [f"MISSING  {name}: in the reference, not in the sample" for name in recorded if name not in names]
    return lines


def uncovered_families() -> List[tuple]:
    """Kernel families of the table that no instance of ``SAMPLE`` belongs to."""
    from cutedsl_gemm.generators.catalog import family_key

    have = {family_key(_instance(n)) for n in SAMPLE}
    return sorted({family_key(i) for i in table()} - have, key=str)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutedsl_gemm.tools.ptx_fingerprint", description=(
        "Compile a fixed sample of kernels (one instance per kernel family of sm_90a and sm_100a, and the "
        "quantizers; no GPU) and print the md5 of each kernel's PTX."))
    p.add_argument("--write", metavar="FILE", type=Path, help="record the fingerprints in FILE (JSON)")
    p.add_argument("--check", metavar="FILE", type=Path, nargs="?", const=REFERENCE,
                   help=f"compare against FILE (default {REFERENCE.relative_to(REFERENCE.parents[2])}); exit 1 "
                        "naming each kernel that differs")
    p.add_argument("--filter", action="append", metavar="SUBSTR",
                   help="only kernels whose name contains SUBSTR (repeatable: any of them)")
    p.add_argument("--jobs", type=int, metavar="N", help="parallel compile processes (default: CPU count)")
    args = p.parse_args(argv)
    names = [n for n in kernel_names() if not args.filter or any(f in n for f in args.filter)]
    if not names:
        p.error(f"no kernel name contains any of {args.filter}")
    recorded = None
    if args.check is not None:
        try:
            ref_dsl, recorded = load(args.check)
        except (OSError, ValueError, KeyError) as e:
            print(f"ptx_fingerprint: cannot read {args.check}: {e}", file=sys.stderr)
            return 2
    fps = compute(names, args.jobs)
    for name in names:
        print(f"{fps.kernels.get(name, 'FAILED' + ' ' * 26)}  {name}")
    for family in uncovered_families():
        print(f"note: no kernel of the sample is of the table's family {family}", file=sys.stderr)
    if args.write is not None:
        if fps.failed:
            print(f"ptx_fingerprint: {len(fps.failed)} kernel(s) failed to compile; {args.write} not written",
                  file=sys.stderr)
            return 1
        write(args.write, fps)
        print(f"wrote {len(fps.kernels)} fingerprints to {args.write}", file=sys.stderr)
    if recorded is None:
        return 1 if fps.failed else 0
    if args.filter:
        recorded = {k: v for k, v in recorded.items() if k in names}
    diff = compare(recorded, fps, names)
    if ref_dsl != fps.dsl:
        print(f"note: the reference was recorded with CuTe DSL {ref_dsl}, this is {fps.dsl}", file=sys.stderr)
    if diff:
        print(f"PTX differs from {args.check} for {len(diff)} kernel(s):\n  " + "\n  ".join(diff))
        return 1
    print(f"PTX of all {len(names)} kernels matches {args.check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

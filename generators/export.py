"""Ahead-of-time export: instances of the table as C object files + headers, a registry, a build file.

``cutedsl-gemm export --arch sm_90a|sm_100a --out DIR`` needs no GPU. Per instance it compiles the kernel for the
target arch and writes what the DSL's C export produces (``kernels/<key>.o`` holding host launch code and
the cubin, ``kernels/<key>.h`` declaring it), then renders with jinja2 (``templates/``):

* ``cutedsl_gemm_registry.h`` / ``.c``: one uniform C entry point per instance (DLPack-like tensor
  descriptors in, the instance's typed structs out), argument checks derived from the traced signature
  (ranks, static extents, divisibility, shared M/N/K, alignment), lazy per-instance module loading and
  lookups that follow ``cutedsl_gemm.selection.dispatch``: ``cutedsl_gemm_find`` by (op, arch, recipe, dtypes,
  accumulation, M, N, K) as ``select_gemm``, ``cutedsl_gemm_find_weight_only`` by (arch, recipe, activations,
  weights, M, N, K) with its K splits as ``select_weight_only``, ``cutedsl_gemm_find_quant_gemm`` by (arch, recipe,
  activations, weights, output, bias, M, N, K) with its K splits as ``dispatch.select`` for unquantized activations;
* ``cutedsl_gemm_kernels.cmake`` + ``CMakeLists.txt``: the static library ``cutedsl_gemm_kernels``;
* ``export.json``: what was exported, from which sources, and the files written (a later export into
  the same directory replaces them, once it is complete: ``swap_in``).

The scaled GEMMs (those quantizing their activations too) and the weight-only GEMMs share one argument struct,
whose fields follow the selected entries' signatures. Instances of an op the registry cannot describe
(``c_export.skip_reason``: one without an entry in ``c_export.ENTRIES``, or listed in ``c_export.NOT_EXPORTED``) are
skipped with a line saying so and listed under ``skipped`` in ``export.json``; a selection of nothing else is an
error.

Compiling and describing one instance is ``c_export.export_one``; this module renders and builds.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import jinja2

from cutedsl_gemm.generators.c_export import (
    ENTRIES,
    MAX_SYMS,
    TEMPLATES,
    ExportError,
    export_one,
    exportable,
    field_name,
    skip_reason,
)
from cutedsl_gemm.generators.runner import code_key, pick_ahead_of_time, run_parallel
from cutedsl_gemm.kernels.sm90.weight_only_gemm import ATOM_K, ATOM_ROWS
from cutedsl_gemm.numerics.formats import RECIPES
from cutedsl_gemm.selection.dispatch import (
    EPILOGUE_MILLI_K_BLOCKS,
    ESTIMATED_RATE_MARGIN,
    LONG_K,
    MAX_SPLITS,
    MIN_K_TILES_PER_SPLIT,
    STREAM_MILLI_AREA_PER_BYTE,
    STREAM_SHARE_CAP,
    SWAPPED_FULL_WAVE_K_TILES,
    UNHIDDEN_MILLI,
    has_estimated_rate,
    last_wave_variant,
    tile_rate,
)
from cutedsl_gemm.selection.instances import F8F6F4, QUANT_GEMM, WEIGHT_ONLY, KernelInstance

LIB_NAME = "cutedsl_gemm_kernels"
C_TYPES = {"int32": "int32_t", "int64": "int64_t"}
# What the registry header says about each field of cutedsl_gemm_args_t (others: "kernel argument <name>").
FIELD_DOCS = {
    "a": "(M, K) row-major (weight-only, quant_gemm: the bf16 / fp16 activations)",
    "b": "(K, N) column-major: w.t() of a row-major (N, K) weight",
    "d": "(M, N) row-major output (weight-only, quant_gemm: in a's dtype)",
    "scale_a": "fp32: (1,) | (M, 1) | block recipes (M or M/128 blocks, K/128); sm_100a: (1,) (NVFP4's global scale, "
               "else 1); quant_gemm: empty (data NULL), the kernel computes them",
    "scale_b": "fp32: (1,) | (1, N) | block recipes (N or N/128 blocks, K/128); sm_100a: (1,) (NVFP4's global scale, "
               "else 1)",
    "bias": "(N,); ignored by instances built without bias",
    "workspace": "split-K fp32 partials, >= tiles x splits x tile_m x tile_n; data NULL when splits <= 1",
    "counters": "split-K int32, one per output tile, zeroed before first use (launches leave them zero)",
    "splits": "K splits: <= 1 none; > 1 only on split_k instances (normalised: no empty split); weight-only: "
              "cutedsl_gemm_find_weight_only's choice",
    "packed_w": f"weight-only: int32 (ceil(N / {ATOM_ROWS}), ceil(K / {ATOM_K}), {ATOM_ROWS * ATOM_K // 32} x bits) "
                "packed weight atoms, as cutedsl_gemm.numerics.int_packing.pack_weights returns them",
    "w_scales": "weight-only: group-wise recipes (K / group, N) in a's dtype; channel (1, N) fp32",
    "w_zeros": "weight-only *_zeros recipes: integer zero points, laid out as w_scales; else empty (data NULL)",
    **{f"{x}{bits}": f"sm_100a: {x} as ({rows}, {what}) bytes if its format is {fmts}; else any aligned stand-in "
                     "(never read)"
       for x, rows in (("a", "M"), ("b", "N"))
       for bits, what, fmts in (("8", "K", "8-bit (e4m3, e5m2; the FP4 kinds' packed e2m1: K/2 bytes)"),
                                ("6", "K*3/4", "6-bit (e2m3, e3m2)"), ("4", "K/2", "4-bit (e2m1 of the f8f6f4 kind)"))},
    "sfa": "sm_100a block-scaled kinds: a's block scales, blocked as int32 words (row atoms, column atoms x 128)",
    "sfb": "sm_100a block-scaled kinds: b's block scales, blocked as int32 words (row atoms, column atoms x 128)",
    "k": "sm_100a: K in elements (the byte views do not give it)",
    "fmt_a": "sm_100a: a's format, as cutedsl_gemm.kernels.sm100.f8f6f4_gemm.MMA_FORMAT_CODE",
    "fmt_b": "sm_100a: b's format, as cutedsl_gemm.kernels.sm100.f8f6f4_gemm.MMA_FORMAT_CODE",
    "max_clusters": "persistent clusters to launch; <= 0: the clusters the current device holds at once (SM count / "
                    "cluster size; 10/11 of that for clusters of more than 2 CTAs, as dispatch.cluster_slots)",
}


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------
def template_env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["cstr"] = lambda v: "NULL" if v is None else json.dumps(str(v))  # ASCII JSON == C literal
    return env


def _c_plan(kernel: dict, inst: KernelInstance) -> dict:
    """Template inputs for one exported kernel: slot assignments, roles, scalars, the wrapper's arguments."""
    for ti, t in enumerate(kernel["tensors"]):
        lines = [f"{t['param']}.data = views[{ti}].data;"]
        for kind, src in (("dynamic_shapes", "shape"), ("dynamic_strides", "stride")):
            slot = 0
            for j, m in enumerate(t[src]):
                if not m["static"]:
                    lines.append(f"{t['param']}.{kind}[{slot}] = ({t[kind + '_type']})views[{ti}].{src}[{j}];")
                    slot += 1
        t["assign"] = lines
    idx = {t["role"]: i for i, t in enumerate(kernel["tensors"])}
    scalars = [{"name": n, "field": field_name(n), "ctype": C_TYPES[k]} for n, k in kernel["params"] if k in C_TYPES]
    var = {s["field"]: s["name"] for s in scalars}  # field of cutedsl_gemm_args_t -> the launch's local variable
    # M and N are the output's extents; K is a's (Hopper) or a scalar (sm_100a: its operands are byte views).
    if "d" not in idx or ("a" not in idx and "k" not in var):
        raise ExportError(f"{kernel['key']}: the entry needs a d tensor and an a tensor or a k scalar (the registry's "
                          f"M, N, K); it has {sorted(idx)} and scalars {sorted(var)}")
    call = [f"&{n}" if k == "tensor" else n for n, k in kernel["params"]]
    formats = _operand_formats(inst) if {"fmt_a", "fmt_b"} <= set(var) else []
    weight_only = _weight_only_plan(inst, idx)
    quant = _quant_gemm_plan(inst, idx)
    splits = "splits" in var and {"workspace", "counters"} <= set(idx)
    # Arguments a call may leave empty get a stand-in at d's address, rounded down to the strictest alignment
    # among them: never read, but checked like any other argument.
    stand_ins = ((["bias"] if "bias" in idx and inst.bias_dtype is None else [])
                 + (["w_zeros"] if weight_only and not weight_only["zeros"] else [])
                 + (["scale_a"] if quant else [])
                 + (["workspace", "counters"] if splits else []))
    return {**kernel, "formats": formats, "formats_text": ", ".join(f"{f['name']} {f['code']}" for f in formats),
            "operand_views": [[idx[f"{x}{bits}"] for bits in (8, 6, 4)] for x in "ab"] if formats else [],
            "idx": idx, "scalars": scalars, "scalar_names": set(var), "call_args": call,
            "k_extent": f"views[{idx['a']}].shape[1]" if "a" in idx else "(int64_t)args->k",
            "clusters_var": var.get("max_clusters"), "splits": splits, "max_splits": MAX_SPLITS,
            "stand_in_align": max((kernel["tensors"][idx[r]]["align"] for r in stand_ins), default=0),
            "has_bias": inst.bias_dtype is not None, "cluster_m": inst.cluster_m, "cluster_n": inst.cluster_n,
            "tile_m": inst.tile_m, "tile_n": inst.tile_n, "swap_ab": inst.swap_ab,
            "split_tail": inst.split_tail, "ctas_per_sm": inst.ctas_per_sm, "weight_only": weight_only,
            "quant_gemm": quant}


def _weight_only_plan(inst: KernelInstance, idx: dict) -> Optional[dict]:
    """What a weight-only launch checks beyond the traced signature (whose packed weights and scales have extents of
    their own): whole atoms over N and K, one scale row per group of K, and zero points only where compiled in."""
    if inst.op != WEIGHT_ONLY:
        return None
    from cutedsl_gemm.selection.instances import weight_only_config

    cfg = weight_only_config(inst)
    missing = {"packed_w", "w_scales", "w_zeros"} - set(idx)
    if missing:
        raise ExportError(f"{inst.name}: the weight-only entry has no {sorted(missing)} argument "
                          f"(c_export.KNOWN_FIELDS maps its arguments; it has {sorted(idx)})")
    return {"atom_rows": ATOM_ROWS, "atom_k": ATOM_K, "group": cfg.group, "zeros": cfg.zeros, "recipe": inst.recipe,
            "w": idx["packed_w"], "s": idx["w_scales"], "z": idx["w_zeros"]}


def _quant_gemm_plan(inst: KernelInstance, idx: dict) -> Optional[dict]:
    """What a launch of a GEMM quantizing its activations checks beyond the traced signature: no A scales (the
    kernel computes them; its argument is a stand-in) and, for the block recipes, W's scales in the kernel's view:
    (N blocks, K blocks), as ``scale_layouts.w_kernel_view`` cuts them (the signature leaves both extents free)."""
    if inst.op != QUANT_GEMM:
        return None
    if not inst.swap_ab and last_wave_variant(inst) is not None:
        raise ExportError(f"{inst.name}: cutedsl_gemm_find_quant_gemm splits K as dispatch.choose_splits does, without "
                          "dispatch.plan_splits' last-wave split variants, which this instance has")
    w = RECIPES[inst.recipe].b
    blocks = w.cols is not None  # the block recipes: (rows, cols) elements of W share a scale
    return {"scale_a": idx["scale_a"], "scale_b": idx["scale_b"], "blocks": blocks,
            "w_rows": w.rows if blocks else 0, "w_cols": w.cols if blocks else 0}


def _check_quant_gemm_accumulation(insts) -> None:
    """``cutedsl_gemm_find_quant_gemm`` takes no accumulation: ``quantize_scaled_mm``'s follows from the weights
    (int8: exact "fast"; FP8: "promoted"), so the exported rows serving one call must not differ in it."""
    seen: Dict[tuple, KernelInstance] = {}
    for i in insts:
        if i.op != QUANT_GEMM:
            continue
        other = seen.setdefault((i.arch, i.recipe, i.a_dtype, i.b_dtype, i.out_dtype, i.bias_dtype), i)
        if other.accum != i.accum:
            raise ExportError(f"{i.name} and {other.name} serve the same calls with different accumulation, which "
                              "cutedsl_gemm_find_quant_gemm does not take; export them separately (--filter)")


def merged_params(signatures) -> Tuple[Tuple[str, str], ...]:
    """One argument list for the selected entries (an sm_100a export holds entries with and without block
    scales): the longest entry's arguments, then any other's, each field once and of one kind."""
    merged: Dict[str, Tuple[str, str]] = {}
    for sig in sorted(signatures, key=lambda s: (-len(s), s)):
        for name, kind in sig:
            prev = merged.setdefault(field_name(name), (name, kind))
            if prev[1] != kind:
                raise ExportError(f"argument {name} is a {kind} in one selected entry and {prev[0]} a {prev[1]} in "
                                  f"another; export them separately (--filter)")
    return tuple(merged.values())


def _operand_formats(inst: KernelInstance) -> List[dict]:
    """The operand formats an sm_100a kernel takes at run time: code (``fmt_a`` / ``fmt_b``), the byte view
    its rows are read from (0, 1, 2: the 8-, 6-, 4-bit view) and its bits per element. The packed FP4 kinds
    take e2m1 only, read through the 8-bit view (as ``runtime.launch`` plans their calls)."""
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import MMA_FORMAT_CODE, STORAGE_8BIT, STORAGE_OF_CODE
    from cutedsl_gemm.numerics.formats import element_format

    if inst.a_dtype != F8F6F4:
        code = MMA_FORMAT_CODE[inst.a_dtype]
        return [{"code": code, "view": STORAGE_8BIT, "bits": element_format(inst.a_dtype).bits, "name": inst.a_dtype}]
    return [{"code": c, "view": STORAGE_OF_CODE[c], "bits": element_format(n).bits, "name": n}
            for n, c in MMA_FORMAT_CODE.items()]


def _arg_fields(params) -> List[dict]:
    out = []
    for name, kind in params:
        if kind == "stream":
            continue
        f = field_name(name)
        out.append({"field": f, "ctype": "cutedsl_gemm_tensor_t" if kind == "tensor" else C_TYPES[kind],
                    "doc": FIELD_DOCS.get(f, f"kernel argument {name}")})
    return out


def _fields(inst: KernelInstance) -> dict:
    return {k: getattr(inst, k) for k in inst.__dataclass_fields__}


def _entry(inst: KernelInstance, kernel: dict) -> dict:
    """A row of the registry's kernel table. Tile rates are the scaled GEMMs' (``cutedsl_gemm_find``'s and
    ``cutedsl_gemm_find_quant_gemm``'s wave cost); the weight-only lookup takes none (0)."""
    gemm = inst.op in ("gemm", QUANT_GEMM)
    return {"key": kernel["key"], "fields": _fields(inst), "name": inst.name, "rate": tile_rate(inst) if gemm else 0,
            "rate_long_k": tile_rate(inst, LONG_K) if gemm else 0, "estimated_rate": gemm and has_estimated_rate(inst),
            "split_k": kernel["split_k"]}


@dataclass
class ExportResult:
    out_dir: Path
    instances: Tuple[KernelInstance, ...]
    kernels: Dict[str, dict]  # code key -> export_one's result
    files: List[Path]
    arg_fields: List[dict]  # cutedsl_gemm_args_t, in order: {"field", "ctype", "doc"}
    skipped: Tuple[KernelInstance, ...] = ()  # selected, but of an op the C export skips (c_export.skip_reason)


RENDERED = (("registry.h.j2", "cutedsl_gemm_registry.h"), ("registry.c.j2", "cutedsl_gemm_registry.c"),
            ("kernels.cmake.j2", f"{LIB_NAME}.cmake"), ("CMakeLists.txt.j2", "CMakeLists.txt"))


EXPORT_RECORD = "export.json"  # what was exported, and every file this exporter wrote (removed by the next export)


def _relative_files(keys) -> list[str]:
    fixed = [name for _, name in RENDERED] + [EXPORT_RECORD, f"lib{LIB_NAME}.so"]
    return fixed + [f"kernels/{k}.{ext}" for k in keys for ext in ("o", "h")]


def remove_previous_export(out: Path) -> list[Path]:
    """Delete the files an earlier export into ``out`` listed in its record (and nothing else): a
    re-export must not leave another selection's objects beside the new build files."""
    try:
        listed = json.loads((out / EXPORT_RECORD).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return []
    removed = []
    for rel in listed:
        path = (out / rel).resolve()
        if path.parent not in (out, out / "kernels") or not path.is_file():
            continue  # only the exporter's own places: a hand-edited record cannot delete elsewhere
        path.unlink()
        removed.append(path)
    return removed


def _check_out_dir(out: Path) -> None:
    for p in (out, out / "kernels"):
        if p.exists() and not p.is_dir():
            raise ExportError(f"--out {out}: {p} is a file, not a directory")


# An export is built in a sibling of --out, ".<name>.partial-<pid>", and moved into place when it is complete; the
# export it replaces waits in ".<name>.previous-<pid>" for the moment of the swap.
PARTIAL, PREVIOUS = "partial", "previous"


def _sibling(out: Path, kind: str, pid: int) -> Path:
    return out.parent / f".{out.name}.{kind}-{pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_abandoned(out: Path) -> None:
    """Tidy what an export killed outright (no Python clean-up ran) left beside ``out``: its partial build is
    removed, and an export it had moved aside but not yet replaced goes back to ``out``."""
    for p in sorted(out.parent.glob(f".{glob_escape(out.name)}.*-*")):
        kind, _, pid = p.name[len(out.name) + 2:].rpartition("-")
        if kind not in (PARTIAL, PREVIOUS) or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == PREVIOUS and not out.exists():
            os.rename(p, out)
        else:
            shutil.rmtree(p, ignore_errors=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _only_export_files(out: Path) -> bool:
    """Whether everything in ``out`` is an earlier export's (the files its record lists, in out/ and out/kernels/)."""
    try:
        listed = set(json.loads((out / EXPORT_RECORD).read_text()).get("files", []))
    except (OSError, ValueError, AttributeError):
        listed = set()
    for p in out.rglob("*"):
        rel = p.relative_to(out).as_posix()
        if p.is_dir() and not p.is_symlink():
            if rel != "kernels":
                return False
        elif rel not in listed:
            return False
    return True


def swap_in(build: Path, out: Path) -> None:
    """Put the complete export in ``build`` at ``out``: by renames when ``out`` is absent or holds nothing but an
    earlier export; otherwise (``out`` holds other files too, which stay) the earlier export's files are removed
    and the new ones moved in."""
    if not out.exists():
        os.rename(build, out)
        return
    if _only_export_files(out):
        previous = _sibling(out, PREVIOUS, os.getpid())
        os.rename(out, previous)
        try:
            os.rename(build, out)
        except BaseException:
            os.rename(previous, out)
            raise
        shutil.rmtree(previous, ignore_errors=True)
        return
    remove_previous_export(out)
    (out / "kernels").mkdir(exist_ok=True)
    for src in sorted(build.rglob("*")):
        if src.is_file():
            os.replace(src, out / src.relative_to(build))
    shutil.rmtree(build, ignore_errors=True)


def export(arch: str, out_dir, filters: Sequence[str] = (), limit: int | None = None,
           jobs: int | None = None, stream=None, everything: bool = False) -> ExportResult:
    """Export the selected instances of ``arch`` into ``out_dir``; raise ExportError if any fails.

    The selection is ``runner.pick_ahead_of_time``'s (without ``filters``: the default set, or the whole
    table with ``everything``), less the instances of ops the C registry has no form for (``c_export.skip_reason``,
    named on ``stream``). The export is built beside ``out_dir`` and replaces an earlier one there only once it is
    complete (``swap_in``): a failed or interrupted export leaves the earlier one as it was.
    """
    stream = stream if stream is not None else sys.stderr
    selection = pick_ahead_of_time(arch, filters, limit, everything)
    why = {i: skip_reason(i) for i in selection.instances}
    skipped = tuple(i for i in selection.instances if why[i])
    insts = tuple(i for i in selection.instances if not why[i])
    for op in dict.fromkeys(i.op for i in skipped):
        mine = [i for i in skipped if i.op == op]
        print(f"export: skipping {len(mine)} {op} instance(s) (e.g. {mine[0].name}): {why[mine[0]]}", file=stream)
    if not insts:
        ops = " and ".join(dict.fromkeys(i.op for i in skipped))
        raise ExportError(f"nothing to export: the {len(skipped)} selected instance(s) are {ops} kernels, which the C "
                          f"export skips: {why[skipped[0]]}")
    refused = [i for i in insts if not exportable(i)]
    if refused:
        covered = ", ".join(f"{a} {op}" for a, op in ENTRIES)
        raise ExportError(f"no AOT exporter for {refused[0].arch} {refused[0].op} instances (the C export covers "
                          f"{covered}); selected e.g. {refused[0].name}")
    _check_quant_gemm_accumulation(insts)
    out = Path(out_dir).resolve()
    _check_out_dir(out)
    first: dict[str, KernelInstance] = {}
    for inst in insts:
        first.setdefault(code_key(inst), inst)  # instances differing only in M range share one object
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_abandoned(out)
    build = _sibling(out, PARTIAL, os.getpid())
    shutil.rmtree(build, ignore_errors=True)
    (build / "kernels").mkdir(parents=True)
    print(f"export: {len(insts)} instance(s) of {arch} ({selection.scope}): {len(first)} kernel(s) to compile",
          file=stream)
    try:
        results = run_parallel(export_one, [(i, str(build / "kernels")) for i in first.values()], jobs, "export",
                               describe=lambda job: job[0].name, stream=stream)
        failed = [r for r in results if not r.ok]
        if failed:
            raise ExportError(f"{len(failed)} of {len(results)} instances failed to export:\n" +
                              "\n".join(f"  {r.item[0].name}: {r.error}" for r in failed))
        kernels = {r.value["key"]: r.value for r in results}
        arg_fields = _render(build, arch, insts, first, kernels, {i.name: why[i] for i in skipped})
        swap_in(build, out)
    except BaseException:  # failed or interrupted: the earlier export stays as it was
        shutil.rmtree(build, ignore_errors=True)
        raise
    files = [out / name for _, name in RENDERED] + [out / EXPORT_RECORD]
    for k in first:
        files += [out / "kernels" / f"{k}.o", out / "kernels" / f"{k}.h"]
    return ExportResult(out, insts, kernels, files, arg_fields, skipped)


def _render(out: Path, arch: str, insts, first: Dict[str, KernelInstance], kernels: Dict[str, dict],
            skipped: Dict[str, str]) -> List[dict]:
    """Render the registry, the CMake files and the export record into ``out`` (its kernels/ holding the
    compiled ``kernels``); returns the argument struct's fields."""
    from cutedsl_gemm.runtime.jit import dsl_version, source_fingerprint

    signatures = {tuple(k["params"]) for k in kernels.values()}
    ctx = {
        "arch": arch,
        "lib": LIB_NAME,
        "dsl_version": dsl_version(),
        "epilogue_milli_k_blocks": EPILOGUE_MILLI_K_BLOCKS,
        "stream_milli_area_per_byte": STREAM_MILLI_AREA_PER_BYTE,
        "stream_share_cap": STREAM_SHARE_CAP,
        "unhidden_milli": UNHIDDEN_MILLI,
        "estimated_rate_margin": ESTIMATED_RATE_MARGIN,
        "long_k": LONG_K,
        "max_splits": MAX_SPLITS,
        "min_k_tiles_per_split": MIN_K_TILES_PER_SPLIT,
        "swapped_full_wave_k_tiles": SWAPPED_FULL_WAVE_K_TILES,
        "weight_only_op": WEIGHT_ONLY,
        "quant_gemm_op": QUANT_GEMM,
        "fingerprint": source_fingerprint(),
        "kernels": [_c_plan(kernels[k], inst) for k, inst in first.items()],
        "arg_fields": _arg_fields(merged_params(signatures)),
        "max_syms": MAX_SYMS,
        "entries": [_entry(i, kernels[code_key(i)]) for i in insts],
        "dsl_runtime": _dsl_runtime_library(),
    }
    env = template_env()
    for tmpl, name in RENDERED:
        (out / name).write_text(env.get_template(tmpl).render(**ctx))
    meta = {"arch": arch, "complete": True, "dsl_version": ctx["dsl_version"],
            "source_fingerprint": ctx["fingerprint"], "files": _relative_files(first),
            "instances": [{"name": e["name"], "key": e["key"], **e["fields"]} for e in ctx["entries"]],
            "skipped": skipped}
    (out / EXPORT_RECORD).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return ctx["arg_fields"]


# ------------------------------------------------------------------------------------------------
# Building the exported library with the system C compiler (tests, ``export --shared``)
# ------------------------------------------------------------------------------------------------
def _dsl_runtime_library() -> str:
    from cutlass.runtime import find_runtime_libraries

    libs = find_runtime_libraries(enable_tvm_ffi=False)
    if not libs:
        raise ExportError("libcute_dsl_runtime.so not found in the nvidia-cutlass-dsl installation")
    return libs[0]


def loaded_cudart() -> Optional[str]:
    """The libcudart this process has mapped (torch's), so an exported library shares it; else None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if re.search(r"/libcudart\.so[.\d]*$", path):
                    return path
    except OSError:
        pass
    return None


def find_cuda(cudart: Optional[str] = None) -> Tuple[str, str]:
    """(include dir with cuda_runtime.h and cuda_fp16.h, libcudart path) for compiling the registry.

    Looked up in $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and the pip ``nvidia-cuda-runtime`` wheel;
    ``cudart`` (or $CUTEDSL_GEMM_CUDART) overrides the library.
    """
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    try:
        import nvidia.cuda_runtime as ncr  # type: ignore

        roots += list(getattr(ncr, "__path__", []))
    except ImportError:
        pass
    roots = [Path(r) for r in roots if r]
    include = next((str(r / "include") for r in roots if (r / "include" / "cuda_runtime.h").exists()
                    and (r / "include" / "cuda_fp16.h").exists()), None)
    cudart = cudart or os.environ.get("CUTEDSL_GEMM_CUDART")
    if not cudart:
        for r in roots:
            for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
                hits = sorted((r / sub).glob("libcudart.so*")) if (r / sub).is_dir() else []
                if hits:
                    cudart = str(hits[0])
                    break
            if cudart:
                break
    if include is None or cudart is None:
        raise ExportError(f"CUDA runtime headers/library not found (include={include}, libcudart={cudart}); searched "
                          f"{[str(r) for r in roots]}: set CUDA_HOME (and CUTEDSL_GEMM_CUDART for the library)")
    return include, cudart


def c_compiler() -> str:
    """The C compiler that links an export: $CC, else the first of cc, gcc and clang on PATH; ExportError in one
    line when there is none."""
    cc = os.environ.get("CC")
    found = shutil.which(cc) if cc else next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)
    if found is None:
        where = f"$CC={cc!r} is not an executable" if cc else "none of cc, gcc, clang is on PATH"
        raise ExportError(f"a C compiler (cc, gcc or clang, or $CC) is required to build the export: {where}")
    return found


def build_shared(out_dir, output=None, cudart: Optional[str] = None, extra_flags: Sequence[str] = ()) -> Path:
    """Link the exported registry and objects into one shared library, every symbol resolved.

    ``-Wl,--no-undefined`` makes the link fail on any symbol that neither the objects, libcute_dsl_runtime
    nor libcudart define, so a successful build proves the exported entry points are complete.
    """
    out = Path(out_dir).resolve()
    cc = c_compiler()
    include, cudart = find_cuda(cudart)
    runtime = _dsl_runtime_library()
    so = Path(output) if output else out / f"lib{LIB_NAME}.so"
    objs = sorted(str(p) for p in (out / "kernels").glob("*.o"))
    if not objs:
        raise ExportError(f"{out}/kernels has no exported objects; run `cutedsl-gemm export` first")
    cmd = [cc, "-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *extra_flags,
           "-I", str(out), "-I", str(out / "kernels"), "-I", include,
           str(out / "cutedsl_gemm_registry.c"), *objs, "-o", str(so),
           runtime, cudart, "-lpthread", "-Wl,--no-undefined",
           f"-Wl,-rpath,{Path(runtime).parent}", f"-Wl,-rpath,{Path(cudart).parent}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise ExportError(f"building {so.name} failed ({' '.join(cmd[:3])} ...):\n{proc.stderr[-4000:]}")
    return so

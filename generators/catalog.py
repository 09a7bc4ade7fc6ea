"""The kernel catalog, rendered on demand: instances of the table and what each one compiles to.

``cutedsl-gemm catalog [--arch A] [--filter SUBSTR] [--sample] [--out DIR]`` compiles the selected instances
(no GPU needed) and writes ``DIR/kernels.md``, a table per tile configuration, and ``DIR/kernels.json``, the
facts: registers per thread and stack frame (read from the cubin), dynamic shared memory and mainloop stages
(the kernel's shared-memory plan) and the MMA instructions in the PTX. Facts already in ``DIR/kernels.json``
for the same configuration, DSL version and sources are reused, so a run stopped by Ctrl-C (which keeps what
finished) resumes where it stopped.

``sample`` picks one instance per kernel family (``family_key``), which covers every code path of the table
in about a minute of compiling on two cores; the CPU tests render it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cutedsl_gemm.generators.runner import Interrupted, SelectionError, code_key, pick, run_parallel
from cutedsl_gemm.numerics.formats import RECIPES
from cutedsl_gemm.selection.instances import (
    INSTANCES,
    SM90,
    SM90_GEMM_OPS,
    WEIGHT_ONLY,
    WEIGHT_ONLY_RECIPES,
    KernelInstance,
    weight_only_config,
)

DOC_NAME, FACTS_NAME = "kernels.md", "kernels.json"
FACTS_VERSION = 2
# Fields that only steer dispatch; everything else may change the generated code.
DISPATCH_ONLY = ("m_min", "m_max")


def code_config(inst: KernelInstance) -> dict:
    cfg = {k: getattr(inst, k) for k in inst.__dataclass_fields__ if k not in DISPATCH_ONLY}
    # What the table derives for the kernel class (e.g. split_k, the weight-only group) shapes the code too.
    if inst.arch == SM90 and inst.op in SM90_GEMM_OPS:
        cfg["kernel"] = dataclasses.asdict(inst.sm90_config())
    elif (inst.arch, inst.op) == (SM90, WEIGHT_ONLY):
        cfg["kernel"] = dataclasses.asdict(weight_only_config(inst))
    return cfg


# ------------------------------------------------------------------------------------------------
# Facts of one instance
# ------------------------------------------------------------------------------------------------
MMA_PREFIXES = ("wgmma.mma_async", "tcgen05.mma")


def facts_fingerprint() -> str:
    """The sources facts are read from: the kernels and host package (as the JIT cache keys them) and this
    module."""
    from cutedsl_gemm.runtime.jit import dsl_version, source_fingerprint

    mine = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]
    return f"{dsl_version()}-{source_fingerprint()}-{mine}"


def collect_facts(inst: KernelInstance) -> dict:
    """Compile one instance the runtime's way and read its facts (runs in a worker process)."""
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance, kernel_resources

    rep = inspect_instance(inst)
    smem_bytes, stages = kernel_resources(inst)
    mma = {k: v for k, v in sorted(rep.instructions.items()) if k.startswith(MMA_PREFIXES)}
    return {"fingerprint": facts_fingerprint(), "config": code_config(inst), "registers": rep.registers,
            "frame_bytes": rep.frame_bytes, "smem_bytes": smem_bytes, "stages": stages, "mma": mma}


# ------------------------------------------------------------------------------------------------
# Selection: the whole table, a filtered part, or one instance per kernel family
# ------------------------------------------------------------------------------------------------
def family_key(inst: KernelInstance) -> tuple:
    """The kind of code an instance compiles to: architecture, op, schedule, the MMA kind (sm_100a) or where the
    scales apply (sm_90a GEMMs: in the main loop, block-scaled, or in the epilogue; weight-only: per channel,
    group-wise, or group-wise with zero points), its integer operand format ("int8" for the W8A8 GEMMs' int32
    accumulator, the weights' for weight-only, else ""), swapped operands, CTAs per SM, last-wave split and
    accumulation. Tiles, recipes of one kind (a weight-only group size) and types vary within a family as
    parameters of the same code."""
    if inst.op == WEIGHT_ONLY:
        group, zeros = WEIGHT_ONLY_RECIPES[inst.recipe]
        scaling = "per-channel" if group == 0 else "group-wise with zero points" if zeros else "group-wise"
        integer = inst.b_dtype
    else:
        scaling = inst.mma_kind or ("block-scaled" if RECIPES[inst.recipe].in_mainloop else "epilogue-scaled")
        integer = "int8" if inst.a_dtype == "int8" else ""  # (QUANT_GEMM: its op tells it apart)
    return (inst.arch, inst.op, inst.schedule, scaling, integer, inst.swap_ab, inst.ctas_per_sm, inst.split_tail,
            inst.accum)


def sample(insts: Sequence[KernelInstance]) -> tuple[KernelInstance, ...]:
    """One instance per kernel family, families in table order. Each comes from its family's first tile
    configuration, with the recipe and types (``SAMPLE_AXES``) that add the most values not yet in the
    sample (the first such in table order), so the sample also holds every recipe, operand, output and bias
    type; separately per arch and op, and for swapped and unswapped kernels (operands and scales on the other
    sides)."""
    families: dict[tuple, list[KernelInstance]] = {}
    for inst in dict.fromkeys(insts):
        families.setdefault(family_key(inst), []).append(inst)
    covered: set[tuple] = set()
    out = []
    for members in families.values():
        tile = _without_sample_axes(members[0])
        candidates = [i for i in members if _without_sample_axes(i) == tile]
        best = max(candidates, key=lambda i: len(_axis_values(i) - covered))  # max keeps the first of equals
        covered |= _axis_values(best)
        out.append(best)
    return tuple(out)


SAMPLE_AXES = ("recipe", "a_dtype", "b_dtype", "out_dtype", "bias_dtype")


def _axis_values(inst: KernelInstance) -> set[tuple]:
    return {(inst.arch, inst.op, inst.swap_ab, a, getattr(inst, a)) for a in SAMPLE_AXES}


def _without_sample_axes(inst: KernelInstance) -> KernelInstance:
    return dataclasses.replace(inst, **dict.fromkeys(SAMPLE_AXES))


def select(arch: str | None = None, filters: Sequence[str] = (), limit: int | None = None,
           sampled: bool = False) -> tuple[KernelInstance, ...]:
    """The instances to catalog, in table order: of ``arch`` (every arch when None), whose name contains any
    of ``filters`` (all when none), one per family with ``sampled``, at most ``limit``. SelectionError when
    nothing matches."""
    archs = [arch] if arch else list(dict.fromkeys(i.arch for i in INSTANCES))
    insts: list[KernelInstance] = []
    for a in archs:
        try:
            insts += pick(a, filters)
        except SelectionError:
            if arch:
                raise
    if not insts:
        raise SelectionError(f"no instance name contains any of {list(filters)}")
    if sampled:
        insts = list(sample(insts))
    if limit is not None:
        if limit < 1:
            raise SelectionError(f"--limit must be >= 1, got {limit}")
        insts = insts[:limit]
    return tuple(insts)


# ------------------------------------------------------------------------------------------------
# Facts file and page
# ------------------------------------------------------------------------------------------------
def load_facts(out_dir: Path) -> dict[str, dict]:
    """Facts of an earlier run in ``out_dir`` that still hold (same layout and sources); {} otherwise."""
    path = Path(out_dir) / FACTS_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != FACTS_VERSION:
        return {}  # an older layout is recomputed rather than misread
    fingerprint = facts_fingerprint()
    return {k: v for k, v in data.get("entries", {}).items() if v.get("fingerprint") == fingerprint}


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader (or a second Ctrl-C) never sees half a file


def _group_title(inst: KernelInstance) -> str:
    m_max = "2^31" if inst.m_max == 1 << 31 else str(inst.m_max)
    stages = f", {inst.stages} stages" if inst.stages else ""
    return (f"{inst.arch} {inst.op}, {inst.schedule}, tile {inst.tile_m}x{inst.tile_n}, cluster "
            f"{inst.cluster_m}x{inst.cluster_n}, {inst.accum} accumulation{stages}, M {inst.m_min}..{m_max}")


def render(insts: Sequence[KernelInstance], entries: dict[str, dict], missing: dict[str, str],
           scope: str) -> str:
    """The page: ``entries`` by code key; ``missing`` says why an instance has no facts."""
    from cutedsl_gemm.generators.export import template_env

    groups: dict[str, list[dict]] = {}
    for inst in insts:
        key = code_key(inst)
        facts = entries.get(key)
        if facts is not None and facts.get("config") != code_config(inst):
            facts = None
        why = missing.get(key, "not compiled")
        groups.setdefault(_group_title(inst), []).append({"inst": inst, "key": key, "facts": facts, "why": why})
    from cutedsl_gemm.runtime.jit import dsl_version

    return template_env().get_template("kernels.md.j2").render(
        groups=groups, total=len(insts), distinct=len({code_key(i) for i in insts}), scope=scope,
        dsl=dsl_version(), sidecar=FACTS_NAME,
    )


@dataclass
class CatalogReport:
    selected: int
    compiled: int
    reused: int
    failed: list[tuple[str, str]]
    doc: Path
    facts: Path


def write_catalog(out_dir, insts: Sequence[KernelInstance], jobs: int | None = None, scope: str = "",
                  stream=None) -> CatalogReport:
    """Compile what ``out_dir`` has no facts for and write the page and the facts file.

    On Ctrl-C (``Interrupted`` from the runner) both files are written with what finished before the
    exception goes on.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    stream = stream if stream is not None else sys.stderr
    insts = tuple(dict.fromkeys(insts))  # identical rows of the expanded table appear once
    entries = load_facts(out)
    todo: dict[str, KernelInstance] = {}
    for inst in insts:
        key = code_key(inst)
        known = entries.get(key)
        if known is None or known.get("config") != code_config(inst):
            todo.setdefault(key, inst)
    print(f"catalog: {len(insts)} instance(s) ({scope or 'as selected'}): {len(todo)} to compile, "
          f"{len(insts) - len(todo)} with facts already in {out / FACTS_NAME}", file=stream)
    missing: dict[str, str] = {}
    interrupted = None
    try:
        results = run_parallel(collect_facts, list(todo.values()), jobs, "catalog", describe=lambda i: i.name,
                               stream=stream)
    except Interrupted as e:
        results, interrupted = e.results, e
        missing = {k: "not compiled: interrupted" for k in todo}
    for r in results:
        key = code_key(r.item)
        if r.ok:
            entries[key] = r.value
            missing.pop(key, None)
        else:
            missing[key] = f"failed: {r.error}"
    doc, facts = out / DOC_NAME, out / FACTS_NAME
    _write(facts, json.dumps({"version": FACTS_VERSION, "instances": {i.name: code_key(i) for i in insts},
                              "entries": entries}, indent=1, sort_keys=True) + "\n")
    _write(doc, render(insts, entries, missing, scope))
    if interrupted is not None:
        raise interrupted
    failed = [(r.item.name, r.error) for r in results if not r.ok]
    compiled = sum(r.ok for r in results)
    print(f"catalog: {compiled} compiled, {len(failed)} failed; wrote {doc} and {facts}", file=stream)
    reused = sum(1 for i in insts if code_key(i) not in todo)
    return CatalogReport(len(insts), compiled, reused, failed, doc, facts)

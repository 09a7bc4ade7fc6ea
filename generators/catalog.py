"""The kernel catalog: ``docs/kernels.md``, every manifest instance and what it compiles to.

Compiling every instance takes minutes on a small machine, so the compiled facts (registers, stack frame,
shared memory, stages, MMA instructions in the PTX) live in a committed sidecar, ``docs/kernels.json``,
keyed by ``runner.code_key`` and stamped with a fingerprint of the sources that shape the instance's code
(the import closure of its compile path within this package, plus the DSL version). ``cutedsl-gemm
catalog`` compiles only instances that are missing or stamped with an older fingerprint, then renders the
page from the manifest and the sidecar alone, so rendering is cheap and deterministic.

``check`` compiles nothing. Its problems come in two kinds: ``manifest`` (an instance without facts, facts
for a different configuration, or a page that differs from what the manifest renders to) and ``sources``
(facts taken from older kernel sources; the numbers may have moved). The CPU test fails on the first kind
and warns on the second, so kernel edits are not blocked on a full recompile.
"""

from __future__ import annotations

import dataclasses

import ast
import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from cutedsl_gemm.selection.instances import INSTANCES, KernelInstance
from cutedsl_gemm.generators.runner import code_key, run_parallel

DOCS_DIR = Path(__file__).resolve().parent.parent / "docs"
DOC_NAME, SIDECAR_NAME = "kernels.md", "kernels.json"
SIDECAR_VERSION = 1
REGENERATE = "cutedsl-gemm catalog"
# Fields that only steer dispatch; everything else may change the generated code.
DISPATCH_ONLY = ("m_min", "m_max")


def code_config(inst: KernelInstance) -> dict:
    cfg = {k: getattr(inst, k) for k in inst.__dataclass_fields__ if k not in DISPATCH_ONLY}
    if (inst.arch, inst.op) == ("sm_90a", "gemm"):
        # What the manifest derives for the kernel class (e.g. split_k) shapes the code too.
        cfg["kernel"] = dataclasses.asdict(inst.sm90_config())
    return cfg


# ------------------------------------------------------------------------------------------------
# Kernel families: the modules a family's code comes from and how its facts are read
# ------------------------------------------------------------------------------------------------
def _sm90_gemm_facts(inst: KernelInstance) -> dict:
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm

    rep = inspect_instance(inst)
    mma = {k: v for k, v in sorted(rep.instructions.items()) if k.startswith(("wgmma.mma_async", "tcgen05.mma"))}
    return {
        "registers": rep.registers,
        "frame_bytes": rep.frame_bytes,
        "smem_bytes": rep.smem_bytes,
        "stages": Sm90Fp8Gemm(inst.sm90_config()).ab_stages,
        "mma": mma,
    }


@dataclass(frozen=True)
class Family:
    roots: Tuple[str, ...]  # modules whose import closure shapes the code (and the facts read from it)
    facts: Callable[[KernelInstance], dict]


FAMILIES: Dict[Tuple[str, str], Family] = {
    ("sm_90a", "gemm"): Family(("cutedsl_gemm.runtime.compile", "cutedsl_gemm.tools.ptx_inspect"), _sm90_gemm_facts),
}


def family(inst: KernelInstance) -> Optional[Family]:
    return FAMILIES.get((inst.arch, inst.op))


def module_closure(roots: Sequence[str], package: str = "cutedsl_gemm") -> Dict[str, Path]:
    """Module name -> source file for ``roots`` and every ``package`` module they import, transitively.

    Read from the sources (ast), not from sys.modules, so the answer does not depend on what this process
    happened to import; imports inside functions count too.
    """
    found: Dict[str, Path] = {}
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in found:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        found[name] = Path(spec.origin)
        pkg = name if spec.submodule_search_locations else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(found[name].read_text(), filename=spec.origin)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), pkg) if node.level else node.module
                names = [base] + [f"{base}.{a.name}" for a in node.names]  # "from pkg import module"
            else:
                continue
            stack += [n for n in names if n and (n == package or n.startswith(package + "."))]
    return found


_FINGERPRINTS: Dict[Tuple[str, ...], str] = {}


def facts_fingerprint(inst: KernelInstance) -> Optional[str]:
    fam = family(inst)
    if fam is None:
        return None
    fp = _FINGERPRINTS.get(fam.roots)
    if fp is None:
        from cutedsl_gemm.runtime.jit import dsl_version

        h = hashlib.sha256(f"dsl {dsl_version()}\n".encode())
        for name, path in sorted(module_closure(fam.roots).items()):
            h.update(f"{name}\n".encode())
            h.update(path.read_bytes())
        fp = _FINGERPRINTS[fam.roots] = h.hexdigest()[:16]
    return fp


def collect_facts(inst: KernelInstance) -> dict:
    """Compile one instance and read its facts (runs in a worker process)."""
    fam = family(inst)
    if fam is None:
        raise ValueError(f"{inst.name}: no inspector for arch={inst.arch} op={inst.op}")
    from cutedsl_gemm.runtime.jit import dsl_version

    return {"fingerprint": facts_fingerprint(inst), "dsl": dsl_version(), "config": code_config(inst), **fam.facts(inst)}


# ------------------------------------------------------------------------------------------------
# Sidecar, rendering, check, refresh
# ------------------------------------------------------------------------------------------------
def instances() -> Tuple[KernelInstance, ...]:
    return tuple(dict.fromkeys(INSTANCES))  # identical rows of the expanded table appear once


def load_sidecar(docs_dir: Path) -> Dict[str, dict]:
    path = Path(docs_dir) / SIDECAR_NAME
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if data.get("version") != SIDECAR_VERSION:
        return {}  # an older layout is recomputed rather than misread
    return data["entries"]


def sidecar_text(entries: Dict[str, dict]) -> str:
    return json.dumps({"version": SIDECAR_VERSION, "entries": entries}, indent=1, sort_keys=True) + "\n"


def _group_title(inst: KernelInstance) -> str:
    m_max = "2^31" if inst.m_max == 1 << 31 else str(inst.m_max)
    stages = f", {inst.stages} stages" if inst.stages else ""
    return (f"{inst.arch} {inst.op}, {inst.schedule}, tile {inst.tile_m}x{inst.tile_n}, cluster "
            f"{inst.cluster_m}x{inst.cluster_n}, {inst.accum} accumulation{stages}, M {inst.m_min}..{m_max}")


def render(insts: Sequence[KernelInstance], entries: Dict[str, dict]) -> str:
    from cutedsl_gemm.generators.export import template_env

    groups: Dict[str, List[dict]] = {}
    for inst in insts:
        key = code_key(inst)
        facts = entries.get(key) if family(inst) is not None else None
        if facts is not None and facts.get("config") != code_config(inst):
            facts = None
        groups.setdefault(_group_title(inst), []).append({"inst": inst, "key": key, "facts": facts,
                                                           "supported": family(inst) is not None})
    used = [r["facts"] for rows in groups.values() for r in rows if r["facts"] is not None]
    stamps = sorted({f"CuTe DSL {f.get('dsl', '?')}, kernel sources {f['fingerprint']}" for f in used})
    return template_env().get_template("kernels.md.j2").render(
        groups=groups, total=len(insts), distinct=len({code_key(i) for i in insts}), stamps=stamps,
        regenerate=REGENERATE, sidecar=SIDECAR_NAME,
    )


@dataclass(frozen=True)
class Problem:
    kind: str  # "manifest" | "sources"
    text: str


def check(docs_dir: Path = DOCS_DIR) -> List[Problem]:
    """What is stale about the committed catalog (nothing is compiled)."""
    docs_dir = Path(docs_dir)
    entries = load_sidecar(docs_dir)
    problems: List[Problem] = []
    insts = instances()
    moved: Dict[Tuple[str, str], List[str]] = {}
    for inst in insts:
        if family(inst) is None:
            continue  # rendered as "no inspector"; nothing to refresh
        e = entries.get(code_key(inst))
        if e is None:
            problems.append(Problem("manifest", f"{inst.name}: no compiled facts in {SIDECAR_NAME}"))
        elif e.get("config") != code_config(inst):
            problems.append(Problem("manifest", f"{inst.name}: facts in {SIDECAR_NAME} are for another configuration"))
        elif e.get("fingerprint") != facts_fingerprint(inst):
            moved.setdefault((str(e.get("fingerprint")), str(facts_fingerprint(inst))), []).append(inst.name)
    for (old, new), names in sorted(moved.items()):
        problems.append(Problem("sources", f"{len(names)} instance(s) catalogued from kernel sources {old}, now {new} "
                                           f"(e.g. {names[0]})"))
    doc = docs_dir / DOC_NAME
    if not doc.exists() or doc.read_text() != render(insts, entries):
        problems.append(Problem("manifest", f"{doc} differs from what the manifest and {SIDECAR_NAME} render to"))
    return problems


def stale(docs_dir: Path = DOCS_DIR) -> List[KernelInstance]:
    """Instances whose facts are missing, for another configuration, or from older sources (one per code key)."""
    entries = load_sidecar(docs_dir)
    out: Dict[str, KernelInstance] = {}
    for inst in instances():
        key = code_key(inst)
        e = entries.get(key)
        if family(inst) is not None and (e is None or e.get("config") != code_config(inst)
                                         or e.get("fingerprint") != facts_fingerprint(inst)):
            out.setdefault(key, inst)
    return list(out.values())


@dataclass
class RefreshReport:
    compiled: int
    failed: List[Tuple[str, str]]
    doc: Path
    sidecar: Path


def refresh(docs_dir: Path = DOCS_DIR, jobs: Optional[int] = None, stream=None) -> RefreshReport:
    """Compile what is stale, prune facts no instance uses, rewrite the sidecar and the page."""
    docs_dir = Path(docs_dir)
    if not docs_dir.parent.is_dir():
        raise FileNotFoundError(f"{docs_dir.parent} does not exist: pass --docs DIR (the repository's docs/)")
    docs_dir.mkdir(exist_ok=True)
    todo = stale(docs_dir)
    entries = load_sidecar(docs_dir)
    results = run_parallel(collect_facts, todo, jobs, "catalog", describe=lambda i: i.name, stream=stream)
    for r in results:
        if r.ok:
            entries[code_key(r.item)] = r.value
    insts = instances()
    used = {code_key(i) for i in insts}
    entries = {k: v for k, v in entries.items() if k in used}
    sidecar, doc = docs_dir / SIDECAR_NAME, docs_dir / DOC_NAME
    sidecar.write_text(sidecar_text(entries))
    doc.write_text(render(insts, entries))
    failed = [(r.item.name, r.error) for r in results if not r.ok]
    print(f"catalog: {len(insts)} instances, {sum(r.ok for r in results)} (re)compiled, {len(failed)} failed; "
          f"wrote {doc} and {sidecar}", file=stream if stream is not None else sys.stderr)
    return RefreshReport(sum(r.ok for r in results), failed, doc, sidecar)

"""Ahead-of-time export: every manifest instance as a C object file + header, a registry, a build file.

``cutedsl-gemm export --arch sm_90a --out DIR`` needs no GPU. Per instance it compiles the kernel for the
target arch and writes what the DSL's C export produces (``kernels/<key>.o`` holding host launch code and
the cubin, ``kernels/<key>.h`` declaring it), then renders with jinja2 (``templates/``):

* ``cutedsl_gemm_registry.h`` / ``.c``: one uniform C entry point per instance (DLPack-like tensor
  descriptors in, the instance's typed structs out), argument checks derived from the traced signature
  (ranks, static extents, divisibility, shared M/N/K, alignment), lazy per-instance module loading and a
  lookup by (op, arch, recipe, dtypes, accumulation, M) that follows ``cutedsl_gemm.dispatch``;
* ``cutedsl_gemm_kernels.cmake`` + ``CMakeLists.txt``: the static library ``cutedsl_gemm_kernels``;
* ``export.json``: what was exported, from which sources.

Export compiles without ``--enable-tvm-ffi``: the DSL's C export (header + object) exists only for the
plain calling convention; a TVM-FFI compile exports a bare object with a packed-function symbol and no
header (that is what ``cutedsl_gemm.jit`` links for its disk cache).
"""

import ctypes
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import jinja2
from cutlass import Int32

from cutedsl_gemm.generators.manifest import KernelInstance
from cutedsl_gemm.generators.runner import code_key, pick, run_parallel

TEMPLATES = Path(__file__).resolve().parent / "templates"
LIB_NAME = "cutedsl_gemm_kernels"
MAX_RANK = 4  # cutedsl_gemm_tensor_t holds up to this many modes
MAX_SYMS = 16  # CDG_MAX_SYMS in registry.c.j2: distinct run-time extents per kernel

# Kernel argument -> field of cutedsl_gemm_args_t (the GEMM host entry's tensors, in call order).
GEMM_TENSOR_ROLES = (("mA", "a"), ("mB", "b"), ("mD", "d"), ("mSA", "scale_a"), ("mSB", "scale_b"), ("mBias", "bias"))


class ExportError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------
# Compiling one instance for the C export
# ------------------------------------------------------------------------------------------------
class GemmCEntry:
    """C-exportable host entry around a GEMM kernel object.

    The DSL's C header generator needs every argument annotated, and the kernel's own ``stream`` is not;
    this wrapper takes the same arguments with ``stream: cuda.CUstream`` and inlines the kernel's entry.
    (No ``from __future__ import annotations`` in this module: the DSL reads these annotations as types.)
    """

    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, mSA: cute.Tensor, mSB: cute.Tensor,
                 mBias: cute.Tensor, max_clusters: Int32, stream: cuda.CUstream):
        self.kernel(mA, mB, mD, mSA, mSB, mBias, max_clusters, stream)


def _gemm_compile_args(inst: KernelInstance):
    """(entry, fake args) for an sm_90a GEMM instance: the runtime's fake tensors, a plain fake stream."""
    from cutlass.cute.runtime import make_fake_stream

    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm
    from cutedsl_gemm.sm90_compile import fake_gemm_args

    cfg = inst.sm90_config()
    args = list(fake_gemm_args(cfg))
    if len(args) != 2 + len(GEMM_TENSOR_ROLES):
        raise ExportError(f"{inst.name}: fake_gemm_args returned {len(args)} arguments, the C entry takes "
                          f"{len(GEMM_TENSOR_ROLES)} tensors, max_clusters and a stream; update export.py")
    args[-1] = make_fake_stream()  # the C caller passes its stream; there is no TVM-FFI environment stream
    return GemmCEntry(Sm90Fp8Gemm(cfg)), args


_RUNTIME_LOADED = False


def _load_runtime_globally():
    # The DSL's object dump JIT-links the host module first, which must resolve the CUDA shims
    # (_cudaLaunchKernelEx, ...) defined in libcute_dsl_runtime; TVM-FFI compiles load it, plain ones not.
    global _RUNTIME_LOADED
    if not _RUNTIME_LOADED:
        from cutlass.runtime import find_runtime_libraries

        for path in find_runtime_libraries(enable_tvm_ffi=False):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _RUNTIME_LOADED = True


def _mode(value, syms: Dict[int, int]) -> dict:
    if isinstance(value, int):
        return {"static": True, "value": value, "sym": -1, "div": 1, "width": 64}
    if not hasattr(value, "divisibility"):
        raise ExportError(f"unsupported shape/stride entry {value!r} (nested layouts are not exportable)")
    # Identity, not equality: the same SymInt object in two tensors is one run-time extent (M, N or K).
    sym = syms.setdefault(id(value), len(syms))
    return {"static": False, "value": 0, "sym": sym, "div": int(value.divisibility), "width": int(value.width)}


def _tensor_specs(args) -> List[dict]:
    syms: Dict[int, int] = {}
    specs = []
    for (param, role), t in zip(GEMM_TENSOR_ROLES, args):
        shape, stride = tuple(t.shape), tuple(t.stride)
        if len(shape) > MAX_RANK or len(stride) != len(shape):
            raise ExportError(f"{param}: rank {len(shape)} tensor (shape {shape}, stride {stride}) does not fit the "
                              f"{MAX_RANK}-mode C descriptor")
        stride_modes = []
        for v in stride:
            m = _mode(v, {})
            m["sym"] = -1  # strides are independent run-time values (padded leading dimensions)
            stride_modes.append(m)
        specs.append({
            "param": param,
            "role": role,
            "rank": len(shape),
            "align": int(t._assumed_align),
            "shape": [_mode(v, syms) for v in shape],
            "stride": stride_modes,
        })
    return specs


_WRAPPER_RE = re.compile(r"static inline (\w+) (cute_dsl_\w+_wrapper)\(([^)]*)\)")
_STRUCT_RE = re.compile(r"typedef struct \{([^}]*)\} (\w+)_Tensor_(\w+)_t;")
_FIELD_RE = re.compile(r"(int32_t|int64_t) (dynamic_shapes|dynamic_strides)\[(\d+)\];")


def _read_header(header: str, prefix: str, specs: List[dict]) -> dict:
    """Cross-check the DSL header against the traced signature; return the wrapper and slot types."""
    m = _WRAPPER_RE.search(header)
    if not m:
        raise ExportError(f"{prefix}.h: no cute_dsl_*_wrapper declaration (DSL header format changed?)")
    ret_type, wrapper, params = m.groups()
    names = [p.strip().split()[-1].lstrip("*") for p in params.split(",")]
    expected = ["module"] + [s["param"] for s in specs] + ["max_clusters", "stream"]
    if names != expected:
        raise ExportError(f"{prefix}.h: wrapper parameters {names}, expected {expected}")
    structs = {}
    for body, pfx, arg in _STRUCT_RE.findall(header):
        if pfx == prefix:
            structs[arg] = {kind: (ctype, int(n)) for ctype, kind, n in _FIELD_RE.findall(body)}
    for s in specs:
        fields = structs.get(s["param"])
        if fields is None:
            raise ExportError(f"{prefix}.h: no descriptor struct for {s['param']}")
        for kind, modes in (("dynamic_shapes", s["shape"]), ("dynamic_strides", s["stride"])):
            n_dyn = sum(not md["static"] for md in modes)
            ctype, n = fields.get(kind, ("int32_t", 0))
            if n != n_dyn:
                raise ExportError(f"{prefix}.h: {s['param']}.{kind} has {n} slots, the traced tensor {n_dyn}")
            s[kind + "_type"] = ctype
    return {"wrapper": wrapper, "return_type": ret_type}


def export_one(job: Tuple[KernelInstance, str]) -> dict:
    """Compile one instance and write ``<key>.o`` and ``<key>.h`` into ``job[1]`` (runs in a worker)."""
    inst, kernels_dir = job
    if not (inst.arch == "sm_90a" and inst.op == "gemm"):
        raise ExportError(f"{inst.name}: no AOT exporter for arch={inst.arch} op={inst.op}")
    entry, args = _gemm_compile_args(inst)
    specs = _tensor_specs(args)
    compiled = cute.compile(entry, *args, options=f"--gpu-arch {inst.arch}")
    _load_runtime_globally()
    key = code_key(inst)
    compiled.export_to_c(kernels_dir, key, function_prefix=key)
    header = Path(kernels_dir, key + ".h").read_text()
    info = _read_header(header, key, specs)
    num_syms = 1 + max((md["sym"] for s in specs for md in s["shape"]), default=-1)
    if num_syms > MAX_SYMS:
        raise ExportError(f"{inst.name}: {num_syms} run-time extents, the registry tracks at most {MAX_SYMS}")
    return {"key": key, "tensors": specs, "num_syms": num_syms, **info}


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
    """Template inputs for one exported kernel: which descriptor slots take which extents/strides."""
    for ti, t in enumerate(kernel["tensors"]):
        lines = [f"{t['param']}.data = views[{ti}].data;"]
        for kind, src in (("dynamic_shapes", "shape"), ("dynamic_strides", "stride")):
            slot = 0
            for j, m in enumerate(t[src]):
                if not m["static"]:
                    lines.append(f"{t['param']}.{kind}[{slot}] = ({t[kind + '_type']})views[{ti}].{src}[{j}];")
                    slot += 1
        t["assign"] = lines
    roles = [t["role"] for t in kernel["tensors"]]
    return {**kernel, "has_bias": inst.bias_dtype is not None, "bias_index": roles.index("bias"),
            "cluster_m": inst.cluster_m, "cluster_n": inst.cluster_n}


def _fields(inst: KernelInstance) -> dict:
    return {k: getattr(inst, k) for k in inst.__dataclass_fields__}


@dataclass
class ExportResult:
    out_dir: Path
    instances: Tuple[KernelInstance, ...]
    kernels: Dict[str, dict]  # code key -> export_one's result
    files: List[Path]


def export(arch: str, out_dir, filters: Sequence[str] = (), limit: Optional[int] = None,
           jobs: Optional[int] = None, stream=None) -> ExportResult:
    """Export the selected instances of ``arch`` into ``out_dir``; raise ExportError if any fails."""
    from cutedsl_gemm.jit import dsl_version, source_fingerprint

    insts = pick(arch, filters, limit)
    out = Path(out_dir).resolve()
    kdir = out / "kernels"
    kdir.mkdir(parents=True, exist_ok=True)
    first: Dict[str, KernelInstance] = {}
    for inst in insts:
        first.setdefault(code_key(inst), inst)  # instances differing only in M range share one object
    results = run_parallel(export_one, [(i, str(kdir)) for i in first.values()], jobs, "export",
                           describe=lambda job: job[0].name, stream=stream)
    failed = [r for r in results if not r.ok]
    if failed:
        raise ExportError(f"{len(failed)} of {len(results)} instances failed to export:\n" +
                          "\n".join(f"  {r.item[0].name}: {r.error}" for r in failed))
    kernels = {r.value["key"]: r.value for r in results}
    ctx = {
        "arch": arch,
        "lib": LIB_NAME,
        "dsl_version": dsl_version(),
        "fingerprint": source_fingerprint(),
        "kernels": [_c_plan(kernels[k], inst) for k, inst in first.items()],
        "entries": [{"key": code_key(i), "fields": _fields(i), "name": i.name} for i in insts],
        "dsl_runtime": _dsl_runtime_library(),
    }
    env = template_env()
    files = []
    for tmpl, name in (("registry.h.j2", "cutedsl_gemm_registry.h"), ("registry.c.j2", "cutedsl_gemm_registry.c"),
                       ("kernels.cmake.j2", f"{LIB_NAME}.cmake"), ("CMakeLists.txt.j2", "CMakeLists.txt")):
        path = out / name
        path.write_text(env.get_template(tmpl).render(**ctx))
        files.append(path)
    meta = {"arch": arch, "dsl_version": ctx["dsl_version"], "source_fingerprint": ctx["fingerprint"],
            "instances": [{"name": e["name"], "key": e["key"], **e["fields"]} for e in ctx["entries"]]}
    (out / "export.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    files.append(out / "export.json")
    for k in first:
        files += [kdir / f"{k}.o", kdir / f"{k}.h"]
    return ExportResult(out, insts, kernels, files)


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


def build_shared(out_dir, output=None, cudart: Optional[str] = None, extra_flags: Sequence[str] = ()) -> Path:
    """Link the exported registry and objects into one shared library, every symbol resolved.

    ``-Wl,--no-undefined`` makes the link fail on any symbol that neither the objects, libcute_dsl_runtime
    nor libcudart define, so a successful build proves the exported entry points are complete.
    """
    out = Path(out_dir).resolve()
    include, cudart = find_cuda(cudart)
    runtime = _dsl_runtime_library()
    so = Path(output) if output else out / f"lib{LIB_NAME}.so"
    objs = sorted(str(p) for p in (out / "kernels").glob("*.o"))
    if not objs:
        raise ExportError(f"{out}/kernels has no exported objects; run `cutedsl-gemm export` first")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ExportError("no C compiler: set CC")
    cmd = [cc, "-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *extra_flags,
           "-I", str(out), "-I", str(out / "kernels"), "-I", include,
           str(out / "cutedsl_gemm_registry.c"), *objs, "-o", str(so),
           runtime, cudart, "-lpthread", "-Wl,--no-undefined",
           f"-Wl,-rpath,{Path(runtime).parent}", f"-Wl,-rpath,{Path(cudart).parent}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise ExportError(f"building {so.name} failed ({' '.join(cmd[:3])} ...):\n{proc.stderr[-4000:]}")
    return so

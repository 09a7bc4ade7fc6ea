"""One instance of the table through the DSL's C export: compile for the target arch, write ``<key>.o`` and
``<key>.h``, and describe the entry point for the registry templates.

The kernel's entry and fake arguments are the runtime's (``cutedsl_gemm.runtime.compile``: the Hopper GEMM's
``__call__``, of quantized activations or of bf16 / fp16 ones it quantizes itself, the sm_100a GEMM's ``__call__``
or ``call_block_scaled``, the Hopper weight-only GEMM's ``__call__``: ``instance_entry``), for the (arch, op) pairs
in ``ENTRIES``. The entry's arguments are read from its signature,
so a kernel that gains an argument (e.g. split-K buffers) is exported without editing this file.
Each tensor argument is described mode by mode from the fake tensor it was traced with: a fixed extent/stride,
or a run-time value with its divisibility, and for extents which other tensor modes hold the same value (the
same ``SymInt`` object: M, N, K). The registry turns that into argument checks.

Compiles without ``--enable-tvm-ffi``: the DSL's C export (header + object) exists only for the plain
calling convention; a TVM-FFI compile exports a bare object with a packed-function symbol and no header
(that is what ``cutedsl_gemm.runtime.jit`` links for its disk cache).
"""

import ctypes
import hashlib
import inspect
import linecache
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import jinja2
from cutlass import Int32, Int64

from cutedsl_gemm.generators.runner import code_key
from cutedsl_gemm.selection.instances import (
    GEMM_FP8_OUT,
    GROUPED_GEMM,
    QUANT_GEMM,
    SM90,
    SM100,
    WEIGHT_ONLY,
    KernelInstance,
)

TEMPLATES = Path(__file__).resolve().parent / "templates"
MAX_RANK = 4  # cutedsl_gemm_tensor_t holds up to this many modes
MAX_SYMS = 32  # CDG_MAX_SYMS in registry.c.j2: distinct run-time extents per kernel (sm_100a: 19)
#: Ops of the table that the C registry does not describe, with the reason: an export skips their instances by name
#: and records them (docs/design.md, section 5). An op with no entry in ``ENTRIES`` is skipped too (``skip_reason``).
NOT_EXPORTED: Dict[str, str] = {
    GEMM_FP8_OUT: f"the {GEMM_FP8_OUT} entry (call_fp8_out: the e4m3 output and its 1x128 scales in the output's "
                  "place) has no form in cutedsl_gemm_args_t, and its choice is the twin of scaled_mm's own pick with "
                  "its K splits and last-wave variants (dispatch.select_fp8_out), which the registry does not make; "
                  "scaled_mm_fp8_out runs them through the JIT cache (precompile fills it)",
    GROUPED_GEMM: f"the {GROUPED_GEMM} entry (E groups whose sizes stay on the device, 3-D weights) has no form in "
                  "cutedsl_gemm_args_t, which describes one M x N x K product; grouped_scaled_mm runs them through "
                  "the JIT cache (precompile fills it)",
}

# Kernel argument -> field of cutedsl_gemm_args_t; others: the name without its "m" prefix, snake_case. Every
# family's output is d and its persistent grid size max_clusters; the weight-only GEMM's activations are a (M, K).
KNOWN_FIELDS = {"mA": "a", "mB": "b", "mD": "d", "mSA": "scale_a", "mSB": "scale_b", "mBias": "bias",
                "mWorkspace": "workspace", "mCounters": "counters", "c": "d", "max_active_clusters": "max_clusters",
                "mX": "a", "mW": "packed_w", "mS": "w_scales", "mZ": "w_zeros"}


class ExportError(RuntimeError):
    pass


def field_name(param: str) -> str:
    if param in KNOWN_FIELDS:
        return KNOWN_FIELDS[param]
    base = re.sub(r"^m(?=[A-Z])", "", param)
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", base).lower()


def _entry_name(entry) -> str:
    owner = getattr(entry, "__self__", entry)
    owner = owner if isinstance(owner, type) else type(owner)
    return f"{owner.__name__}.{getattr(entry, '__name__', '__call__')}"


def entry_params(entry) -> Tuple[Tuple[str, str], ...]:
    """(name, kind) of a kernel entry's arguments (a kernel class: its ``__call__``; a kernel object or a bound
    entry method: that call); kind: tensor | int32 | int64 | stream."""
    if isinstance(entry, type):
        params = list(inspect.signature(entry.__call__).parameters.values())[1:]  # drop self
    else:
        params = list(inspect.signature(entry).parameters.values())
    out = []
    for p in params:
        ann = p.annotation
        text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
        if p.name == "stream" and (ann is inspect.Parameter.empty or "CUstream" in text):
            kind = "stream"
        elif text.endswith("Tensor"):
            kind = "tensor"
        elif text.endswith("Int32"):
            kind = "int32"
        elif text.endswith("Int64"):
            kind = "int64"
        else:
            raise ExportError(f"{_entry_name(entry)}: cannot export argument {p.name}: {text!r}")
        out.append((p.name, kind))
    if [k for _, k in out].count("stream") != 1 or out[-1][1] != "stream":
        raise ExportError(f"{_entry_name(entry)} must end with one stream argument, got {out}")
    return tuple(out)


_ANNOTATIONS = {"tensor": "cute.Tensor", "int32": "Int32", "int64": "Int64", "stream": "cuda.CUstream"}
_ENTRIES: Dict[Tuple, type] = {}


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def entry_class(kernel_cls, params, method: str = "__call__") -> type:
    """A ``@cute.jit`` class with the arguments of the kernel's entry ``method``, typed for the C header
    (generated once per signature and method)."""
    cls = _ENTRIES.get((params, method))
    if cls is None:
        src = _env().get_template("c_entry.py.j2").render(
            kernel=kernel_cls.__name__, method=method,
            params=[{"name": n, "annotation": _ANNOTATIONS[k]} for n, k in params])
        fname = f"<cutedsl_gemm C entry {hashlib.sha256(src.encode()).hexdigest()[:12]}>"
        # The DSL compiles from the source of what it traces; linecache serves it for generated code.
        linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
        ns = {"cute": cute, "cuda": cuda, "Int32": Int32, "Int64": Int64}
        exec(compile(src, fname, "exec"), ns)
        cls = _ENTRIES[(params, method)] = ns["GemmCEntry"]
    return cls


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


def tensor_specs(params, args) -> List[dict]:
    syms: Dict[int, int] = {}
    specs = []
    for (name, kind), t in zip(params, args):
        if kind != "tensor":
            continue
        shape, stride = tuple(t.shape), tuple(t.stride)
        if len(shape) > MAX_RANK or len(stride) != len(shape):
            raise ExportError(f"{name}: rank {len(shape)} tensor (shape {shape}, stride {stride}) does not fit the "
                              f"{MAX_RANK}-mode C descriptor")
        strides = []
        for v in stride:
            m = _mode(v, {})
            m["sym"] = -1  # strides are independent run-time values (padded leading dimensions)
            strides.append(m)
        specs.append({"param": name, "role": field_name(name), "rank": len(shape), "align": int(t._assumed_align),
                      "shape": [_mode(v, syms) for v in shape], "stride": strides})
    return specs


_WRAPPER_RE = re.compile(r"static inline (\w+) (cute_dsl_\w+_wrapper)\(([^)]*)\)")
_STRUCT_RE = re.compile(r"typedef struct \{([^}]*)\} (\w+)_Tensor_(\w+)_t;")
C_WIDTHS = {"int32_t": 32, "int64_t": 64}
_FIELD_RE = re.compile(r"(int32_t|int64_t) (dynamic_shapes|dynamic_strides)\[(\d+)\];")


def read_header(header: str, prefix: str, params, specs: List[dict]) -> dict:
    """Cross-check the DSL header against the traced signature; return the wrapper and slot types."""
    m = _WRAPPER_RE.search(header)
    if not m:
        raise ExportError(f"{prefix}.h: no cute_dsl_*_wrapper declaration (DSL header format changed?)")
    ret_type, wrapper, decl = m.groups()
    names = [p.strip().split()[-1].lstrip("*") for p in decl.split(",")]
    expected = ["module"] + [n for n, _ in params]
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
            # The header types a tensor's strides by one flag, not by each value's width: a 32-bit symbolic
            # stride under an int64_t slot would be read as two halves by the compiled code.
            widths = sorted({md["width"] for md in modes if not md["static"]})
            if n and widths != [C_WIDTHS[ctype]]:
                raise ExportError(f"{prefix}.h: {s['param']}.{kind} are {ctype}, the traced tensor's are {widths}-bit "
                                  f"(declare its symbolic {kind.split('_')[1]} cute.sym_int{C_WIDTHS[ctype]}())")
            s[kind + "_type"] = ctype
    return {"wrapper": wrapper, "return_type": ret_type}


#: (arch, op) of the kernel families the C export covers (their entries are ``runtime.compile.instance_entry``'s).
ENTRIES = ((SM90, "gemm"), (SM100, "gemm"), (SM90, WEIGHT_ONLY), (SM90, QUANT_GEMM))


def traced_entry(inst: KernelInstance):
    """(kernel object, entry method name, fake args) as the runtime traces them, with a plain fake stream for
    the C caller. Call inside ``targeting(inst.arch)``."""
    from cutlass.cute.runtime import make_fake_stream

    from cutedsl_gemm.runtime.compile import instance_entry

    entry, args = instance_entry(inst)
    kernel = getattr(entry, "__self__", entry)
    args = list(args)
    args[-1] = make_fake_stream()  # the C caller passes its stream; there is no TVM-FFI environment stream
    return kernel, getattr(entry, "__name__", "__call__"), args


def exportable(inst: KernelInstance) -> bool:
    """Whether the C export covers the instance's kernel family (``ENTRIES``)."""
    return (inst.arch, inst.op) in ENTRIES


def skip_reason(inst: KernelInstance) -> Optional[str]:
    """Why an export skips ``inst`` (its op has no form in the C registry), or None. An op the exporter knows on
    another arch is not skipped: that is an arch without an exporter, which ``export`` refuses."""
    if inst.op in NOT_EXPORTED:
        return NOT_EXPORTED[inst.op]
    ops = dict.fromkeys(op for _, op in ENTRIES)
    if inst.op not in ops:
        return f"the C registry has no form for op {inst.op!r} (it describes {', '.join(ops)} kernels)"
    return None


def export_one(job: Tuple[KernelInstance, str]) -> dict:
    """Compile one instance and write ``<key>.o`` and ``<key>.h`` into ``job[1]`` (runs in a worker)."""
    inst, kernels_dir = job
    why = skip_reason(inst)
    if why or not exportable(inst):
        raise ExportError(f"{inst.name}: no AOT exporter for arch={inst.arch} op={inst.op}"
                          + (f": {why}" if why else ""))
    from cutedsl_gemm.runtime.compile import targeting

    with targeting(inst.arch):
        kernel, method, args = traced_entry(inst)
        params = entry_params(getattr(kernel, method) if method != "__call__" else kernel)
        if len(args) != len(params):
            raise ExportError(f"{inst.name}: the traced arguments ({len(args)}) do not match "
                              f"{type(kernel).__name__}.{method} ({[n for n, _ in params]})")
        specs = tensor_specs(params, args)
        entry = entry_class(type(kernel), params, method)(kernel)
        compiled = cute.compile(entry, *args, options=f"--gpu-arch {inst.arch}")
    _load_runtime_globally()
    key = code_key(inst)
    compiled.export_to_c(kernels_dir, key, function_prefix=key)
    info = read_header(Path(kernels_dir, key + ".h").read_text(), key, params, specs)
    num_syms = 1 + max((md["sym"] for s in specs for md in s["shape"]), default=-1)
    if num_syms > MAX_SYMS:
        raise ExportError(f"{inst.name}: {num_syms} run-time extents, the registry tracks at most {MAX_SYMS}")
    return {"key": key, "params": params, "tensors": specs, "num_syms": num_syms,
            "tile_k": inst.tile_k, "split_k": inst.can_split_k, **info}

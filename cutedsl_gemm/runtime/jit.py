"""JIT compilation cache: one compilation per kernel configuration, in process and on disk.

A configuration is a hashable key (arch, dtypes, recipe, tile, cluster, ...). The compiled kernel is a
TVM-FFI function (``--enable-tvm-ffi``): it takes torch tensors directly and launches on the current
torch stream, which keeps the host cost per call at a few microseconds.

On disk an entry is a shared library: the DSL's ``export_to_c`` object file linked with the system C
compiler. Entries are keyed by the configuration, the target arch, the DSL version and a fingerprint of
this package's kernel sources, so editing a kernel or upgrading the DSL never loads a stale binary.
Several processes may compile the same entry at once: a per-entry ``flock`` serialises them and the
library is written under a temporary name and ``os.replace``-d into place. An entry that fails to load
(truncated, corrupt) is deleted and rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Hashable

_PKG_ROOT = Path(__file__).resolve().parent.parent  # the cutedsl_gemm package


def cache_dir() -> Path:
    """$CUTEDSL_GEMM_CACHE_DIR, else $XDG_CACHE_HOME/cutedsl_gemm, else ~/.cache/cutedsl_gemm."""
    env = os.environ.get("CUTEDSL_GEMM_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cutedsl_gemm"


def disk_cache_enabled() -> bool:
    return os.environ.get("CUTEDSL_GEMM_DISABLE_DISK_CACHE", "0") in ("", "0", "false", "False")


_FINGERPRINT: str | None = None


def source_fingerprint() -> str:
    """sha256 over every kernel and runtime source that shapes generated code."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        import cutedsl_gemm.kernels as kpkg

        h = hashlib.sha256()
        roots = [Path(kpkg.__file__).resolve().parent, _PKG_ROOT]
        for root in roots:
            for p in sorted(root.rglob("*.py")):
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
        _FINGERPRINT = h.hexdigest()[:16]
    return _FINGERPRINT


def dsl_version() -> str:
    import cutlass

    return str(getattr(cutlass, "__version__", "unknown"))


#: The archs this library's kernels compile for (Hopper, Blackwell), the values CUTE_DSL_ARCH may take.
ARCHS = ("sm_90a", "sm_100a")


class ArchError(ValueError):
    """CUTE_DSL_ARCH names an arch the kernels do not compile for."""


def env_arch() -> str | None:
    """CUTE_DSL_ARCH, checked against ``ARCHS`` (ArchError, in one line, when it is none of them); None if unset."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch and arch not in ARCHS:
        raise ArchError(f"CUTE_DSL_ARCH={arch!r} is not an arch these kernels compile for: use "
                        f"{' or '.join(ARCHS)} (Hopper or Blackwell), or unset it to compile for this GPU")
    return arch or None


def target_arch() -> str:
    """The arch kernels are compiled for: CUTE_DSL_ARCH if set (one of ``ARCHS``), else the current GPU's."""
    arch = env_arch()
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
    raise RuntimeError("no CUDA GPU and CUTE_DSL_ARCH is not set: cannot tell which arch to compile for")


@dataclass
class CacheStats:
    compiles: int = 0
    disk_hits: int = 0
    memory_hits: int = 0
    corrupt_entries: int = 0
    by_key: Dict[str, int] = field(default_factory=dict)


class KernelCache:
    """Maps configuration keys to callables; ``build()`` returns a ``cute.compile`` result."""

    def __init__(self):
        self._mem: Dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def entry_name(self, key: Hashable, arch: str) -> str:
        text = repr((key, arch, dsl_version(), source_fingerprint()))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def entry_path(self, key: Hashable, arch: str) -> Path:
        return cache_dir() / f"dsl-{dsl_version()}" / arch / f"{self.entry_name(key, arch)}.so"

    def get(self, key: Hashable, build: Callable[[], Any], *, arch: str | None = None, load: bool = True):
        """Return the compiled function for ``key``, compiling at most once per process and entry.

        ``load=False`` fills the disk cache without loading the library (used where no GPU driver is
        present, e.g. precompiling on a CPU-only machine); it returns the entry's path.
        """
        arch = arch or target_arch()
        mkey = (key, arch)
        fn = self._mem.get(mkey)
        if fn is not None:
            self.stats.memory_hits += 1
            return fn
        with self._lock:
            fn = self._mem.get(mkey)
            if fn is not None:
                return fn
            if not disk_cache_enabled():
                fn = self._compile(key, build)
            else:
                fn = self._get_from_disk(key, build, arch, load)
            if load:
                self._mem[mkey] = fn
            return fn

    def _compile(self, key, build):
        self.stats.compiles += 1
        self.stats.by_key[repr(key)] = self.stats.by_key.get(repr(key), 0) + 1
        return build()

    def _get_from_disk(self, key, build, arch, load):
        path = self.entry_path(key, arch)
        path.parent.mkdir(parents=True, exist_ok=True)
        fn_name = "entry_" + path.stem
        with open(str(path) + ".lock", "w") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            try:
                if path.exists():
                    if not load:
                        self.stats.disk_hits += 1
                        return path
                    try:
                        fn = _load_entry(path, fn_name)
                        self.stats.disk_hits += 1
                        return fn
                    except Exception:
                        # Half-written or damaged library: drop it and rebuild below.
                        self.stats.corrupt_entries += 1
                        path.unlink(missing_ok=True)
                compiled = self._compile(key, build)
                _export_entry(compiled, path, fn_name)
                return compiled if load else path
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)

    def clear_memory(self):
        self._mem.clear()


def _export_entry(compiled, path: Path, fn_name: str) -> None:
    """export_to_c -> object file -> shared library, written atomically."""
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj = os.path.join(tmp, "k.o")
        compiled.export_to_c(obj, function_name=fn_name)
        so_tmp = os.path.join(tmp, "k.so")
        libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-shared", "-o", so_tmp, obj, *libs], check=True, capture_output=True)
        os.replace(so_tmp, path)


def _load_entry(path: Path, fn_name: str):
    import cutlass.cute as cute

    mod = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return getattr(mod, fn_name)


#: The process-wide cache every kernel family uses.
KERNEL_CACHE = KernelCache()

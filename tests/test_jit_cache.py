"""The JIT cache: one compilation per configuration, disk entries that survive processes, corrupt entries
rebuilt, concurrent compilers serialised. Uses a tiny kernel so the tier stays fast."""

import multiprocessing as mp
import os

import pytest

pytestmark = pytest.mark.compile


def _build_tiny(scale: float):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    @cute.kernel
    def k(a: cute.Tensor, b: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        b[tidx] = a[tidx] * cutlass.Float32(scale)

    @cute.jit
    def host(a: cute.Tensor, b: cute.Tensor, stream):
        k(a, b).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    n = cute.sym_int()
    fa = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    fb = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    return cute.compile(host, fa, fb, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--enable-tvm-ffi --gpu-arch sm_90a")


def test_memory_and_disk_hits(tmp_path, monkeypatch):
    from cutedsl_gemm.runtime.jit import KernelCache

    monkeypatch.setenv("CUTEDSL_GEMM_CACHE_DIR", str(tmp_path))
    c = KernelCache()
    f1 = c.get(("tiny", 2.0), lambda: _build_tiny(2.0), arch="sm_90a")
    f2 = c.get(("tiny", 2.0), lambda: _build_tiny(2.0), arch="sm_90a")
    assert f1 is f2 and c.stats.compiles == 1 and c.stats.memory_hits == 1
    path = c.entry_path(("tiny", 2.0), "sm_90a")
    assert path.exists() and path.stat().st_size > 0
    # A new process (a fresh cache object) loads from disk without compiling.
    c2 = KernelCache()
    c2.get(("tiny", 2.0), lambda: pytest.fail("must not compile"), arch="sm_90a")
    assert c2.stats.compiles == 0 and c2.stats.disk_hits == 1
    # Another configuration is another entry.
    c2.get(("tiny", 3.0), lambda: _build_tiny(3.0), arch="sm_90a")
    assert c2.stats.compiles == 1 and c2.entry_path(("tiny", 3.0), "sm_90a") != path


def test_corrupt_entry_is_rebuilt(tmp_path, monkeypatch):
    from cutedsl_gemm.runtime.jit import KernelCache

    monkeypatch.setenv("CUTEDSL_GEMM_CACHE_DIR", str(tmp_path))
    c = KernelCache()
    c.get(("tiny", 2.0), lambda: _build_tiny(2.0), arch="sm_90a")
    path = c.entry_path(("tiny", 2.0), "sm_90a")
    path.write_bytes(b"\x7fELF truncated")
    c2 = KernelCache()
    fn = c2.get(("tiny", 2.0), lambda: _build_tiny(2.0), arch="sm_90a")
    assert fn is not None and c2.stats.corrupt_entries == 1 and c2.stats.compiles == 1
    assert path.stat().st_size > 100


def test_key_includes_dsl_version_and_sources(tmp_path, monkeypatch):
    from cutedsl_gemm.runtime import jit

    monkeypatch.setenv("CUTEDSL_GEMM_CACHE_DIR", str(tmp_path))
    c = jit.KernelCache()
    a = c.entry_name(("k",), "sm_90a")
    monkeypatch.setattr(jit, "_FINGERPRINT", "0" * 16)
    assert c.entry_name(("k",), "sm_90a") != a
    monkeypatch.setattr(jit, "dsl_version", lambda: "0.0")
    assert "dsl-0.0" in str(c.entry_path(("k",), "sm_90a"))


def _worker(cache_dir, q):
    os.environ["CUTEDSL_GEMM_CACHE_DIR"] = cache_dir
    from cutedsl_gemm.runtime.jit import KernelCache

    c = KernelCache()
    c.get(("tiny", 5.0), lambda: _build_tiny(5.0), arch="sm_90a", load=False)
    q.put(c.stats.compiles)


def test_concurrent_compilers_build_once(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    compiles = sorted(q.get(timeout=5) for _ in procs)
    assert compiles == [0, 0, 1]  # the lock makes the others find the finished entry
    entries = list(tmp_path.rglob("*.so"))
    assert len(entries) == 1 and not list(tmp_path.rglob("*.tmp*"))


def test_prepared_calls_are_one_bounded_cache():
    from cutedsl_gemm.runtime.plans import PreparedCalls

    calls = PreparedCalls(limit=3)
    calls.keep("a", (1,), "x")
    calls.keep("b", (1,), "y")
    calls.keep("a", (1,), "x2")  # the same key: replaced, not counted twice
    assert (calls.get("a", (1,)), calls.get("b", (1,)), calls.get("c", (1,)), len(calls)) == ("x2", "y", None, 2)
    calls.keep("a", (2,), "z")
    assert len(calls) == 3 and calls.count("a") == 2
    calls.keep("c", (3,), "w")  # past the bound: starts over, then keeps it
    assert len(calls) == 1 and calls.get("a", (1,)) is None and calls.get("c", (3,)) == "w"
    with pytest.raises(TypeError):
        calls.get("c", (["unhashable"],))

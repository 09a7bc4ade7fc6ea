"""Test tiers: plain tests and `compile` tests run anywhere (CPU CI included); `gpu` tests need a Hopper
GPU and `blackwell` tests an sm_100 GPU; each is skipped where its hardware is missing."""

import os
import warnings

import pytest
import torch


def _capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_collection_modifyitems(config, items):
    cap = _capability()
    skip_gpu = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    skip_bw = pytest.mark.skip(reason="needs a Blackwell (sm_100) GPU")
    for item in items:
        if "gpu" in item.keywords and (cap is None or cap[0] != 9):
            item.add_marker(skip_gpu)
        if "blackwell" in item.keywords and (cap is None or cap[0] != 10):
            item.add_marker(skip_bw)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tests never touch the user's kernel cache unless CUTEDSL_GEMM_CACHE_DIR says so."""
    if "CUTEDSL_GEMM_CACHE_DIR" not in os.environ:
        os.environ["CUTEDSL_GEMM_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernel_cache"))
    yield


@pytest.fixture
def deprecations():
    """``deprecations(build, ...)``: the DeprecationWarnings raised while the builds run, each as
    "file:line: message", for tests that keep kernels off names the DSL deprecates."""

    def collect(*builds):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for build in builds:
                build()
        return sorted({f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                       if issubclass(w.category, DeprecationWarning)})

    return collect

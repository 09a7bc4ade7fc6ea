"""The checkout's top-level kernels/ is installed as cutedsl_gemm.kernels and never stands in for the installed
package of the same top-level name (Hugging Face's ``kernels``, which transformers imports) when the checkout's
root is on sys.path, as under ``python -m`` there."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_code_is_cutedsl_gemm_kernels():
    import cutedsl_gemm.kernels as k

    assert Path(k.__file__).resolve() == ROOT / "kernels" / "__init__.py"


def test_top_level_kernels_from_the_checkout_root_is_the_installed_package():
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    run = subprocess.run([sys.executable, "-c", "import kernels, os; print(os.path.realpath(kernels.__file__))"],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    found = Path(run.stdout.strip())
    if installed:
        assert not found.is_relative_to(ROOT / "kernels"), found
    else:  # (the checkout's empty package: no version, so transformers reads the package as missing)
        assert found == ROOT / "kernels" / "__init__.py", found

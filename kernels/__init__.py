"""cutedsl_gemm's device code, installed as ``cutedsl_gemm.kernels``.

With a checkout's root on ``sys.path`` (``python -m ...`` run there), this directory would shadow the installed
package of the same top-level name (Hugging Face's ``kernels``, which transformers imports when it is installed).
Imported under that name, it loads the installed package in its own place; where none is installed it stays this
empty package, with no version (what transformers' availability check reads as "not installed")."""

import sys

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # (the import statement returns what sys.modules holds once this runs)
        _spec.loader.exec_module(_module)

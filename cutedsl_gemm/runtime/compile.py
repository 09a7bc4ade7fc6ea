"""Tracing the kernels: ``cute.compile`` of one instance of the table, on its family's entry and fake arguments.

``compile_entry`` is the one place ``cute.compile`` runs, with the project's options (TVM-FFI calling
convention, target arch, kept PTX). ``compile_instance`` is the one compile path of every GEMM family: the JIT
cache, precompile, export and the catalog all go through it; what it traces (the kernel entry and its
shape-symbolic fake arguments) is the instance's kernel family's (``cutedsl_gemm/families/``, looked up in
``families/registry.py``). The quantizers compile their kernels' ``*_entry`` through ``compile_entry``
(``ops/quantize.py``).
"""

from __future__ import annotations

import contextlib

import cutlass.cute as cute

from cutedsl_gemm.families.registry import family

COMPILE_OPTIONS = "--enable-tvm-ffi"


@contextlib.contextmanager
def targeting(arch: str):
    """The DSL's target arch is ``arch`` inside: kernel constructors make ops that check it (the block-scaled
    kernel's Blackwell TMA op), which ``--gpu-arch`` alone does not set. So no GPU and no env var are needed."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    saved = envar.arch
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = saved


def compile_entry(entry, args, arch: str | None = None, ptx_dump_dir: str | None = None):
    """``cute.compile(entry, *args)`` for ``arch`` (default: the DSL's target arch, ``CUTE_DSL_ARCH`` or the
    current GPU's); with ``ptx_dump_dir`` (an existing directory) the PTX is kept on the result (``.__ptx__``).
    A kernel object whose constructor checks the arch must be built inside ``targeting(arch)`` too."""
    options = COMPILE_OPTIONS + ("" if arch is None else f" --gpu-arch {arch}")
    options += "" if ptx_dump_dir is None else f" --keep-ptx --dump-dir={ptx_dump_dir}"
    with targeting(arch) if arch is not None else contextlib.nullcontext():
        return cute.compile(entry, *args, options=options)


def instance_entry(inst):
    """(kernel entry, fake arguments) of an instance of the table, as it is traced: its kernel family's ``entry``
    (``families/registry.py``; UnknownFamilyError, a ValueError, names the registered (arch, op) pairs if it has
    none). Call inside ``targeting(inst.arch)``: kernel constructors may check the arch."""
    return family(inst).entry(inst)


def compile_instance(inst):
    """``cute.compile`` the kernel of an instance of the table for its arch: the one compile path that the JIT
    cache, precompile, export and the catalog share."""
    with targeting(inst.arch):
        return compile_entry(*instance_entry(inst), inst.arch)

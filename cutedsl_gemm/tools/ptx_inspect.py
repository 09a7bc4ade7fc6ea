"""Compile-and-inspect: what a kernel instance turns into, without a GPU.

``inspect_compiled`` reads the PTX (the MMA, copy and register-reallocation instructions present) and the
cubin (registers per thread and stack frame from the ELF ``.nv.info`` attributes), so the compile-only test
tier and ``cutedsl-gemm demo`` can check that the instructions we meant are there.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

# PTX instruction families worth reporting, most specific first.
_PTX_PATTERNS = (
    r"wgmma\.mma_async[\w.:]*",
    r"tcgen05\.mma[\w.:]*",
    r"cp\.async\.bulk\.tensor[\w.:]*",
    r"setmaxnreg[\w.]*",
    r"stmatrix[\w.:]*",
    r"tcgen05\.(?:alloc|dealloc|ld|st|cp|commit)[\w.:]*",
)

#: The int8 GEMMs' tensor-core MMA: s8 x s8 operands, s32 accumulator (the DSL adds .satfinite).
WGMMA_S8 = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32(?:\.satfinite)?\.s32\.s8\.s8"
#: The weight-only GEMMs' tensor-core MMA: A (the converted weights) from four registers, B (the activations) from a
#: shared-memory descriptor.
WGMMA_RS = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(?:bf16|f16)\.(?:bf16|f16)\s+\{[^}]*\},\s*" \
           r"\{%r\d+, %r\d+, %r\d+, %r\d+\},\s*%rd\d+"
#: Their in-register integer-to-float conversion, step -> instruction: lop3 selects the integer bits into floats of
#: a magic-number exponent, and one packed FMA subtracts that bias (and the zero point) and applies the scale.
WEIGHT_CONVERSION = {"magic-number conversion": r"lop3\.b32", "scale FMA": r"fma\.rn\.(?:bf16|f16)x2"}
#: The activation quantization of the GEMMs that quantize their activations (op QUANT_GEMM), step -> instruction: the
#: group's amax on packed 16-bit pairs, the e4m3 conversion, and the 16-byte stores of the quantized tile.
ACTIVATION_QUANTIZATION = {"amax": r"max\.(?:bf16|f16)x2", "e4m3 conversion": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
                           "16-byte shared stores": r"st\.shared\.v4\.b32"}
# ... per token (int8 W8A8): the pass over each token's row for its scale, the integer rounding
PER_TOKEN_QUANTIZATION = {"row reads (16 bytes)": r"ld\.global(?:\.nc)?\.v4\.b32", "amax": r"max\.(?:bf16|f16)x2",
                          "int8 rounding": r"cvt\.rni\.s32\.f32", "16-byte shared stores": r"st\.shared\.v4\.b32"}
# The epilogue emitting FP8 in 1x128 groups: the staged bf16 tile read back, quantized, stored to global memory.
FP8_OUTPUT = {"16-byte shared reads": r"ld\.shared\.v4\.b32", "e4m3 conversion": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
              "16-byte global stores": r"st\.global\.v4\.b32"}

# ELF .nv.info attribute ids (EIATTR_*) we read.
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIFMT_SVAL = 0x04


@dataclass
class KernelReport:
    name: str
    instructions: Dict[str, int] = field(default_factory=dict)
    registers: int = -1
    frame_bytes: int = -1
    smem_bytes: int = -1
    ptx: str = ""

    def has(self, pattern: str) -> bool:
        return re.search(pattern, self.ptx) is not None

    def summary_lines(self) -> List[str]:
        lines = [f"{self.name}: {self.registers} registers/thread, {self.frame_bytes} B stack frame, "
                 f"{self.smem_bytes} B shared memory"]
        for ins, n in sorted(self.instructions.items()):
            lines.append(f"    {n:4d} x {ins}")
        return lines


def ptx_instructions(ptx: str) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for pat in _PTX_PATTERNS:
        for m in re.findall(pat, ptx):
            counts[m] = counts.get(m, 0) + 1
    return counts


def cubin_resources(cubin: bytes) -> Dict[str, int]:
    """Registers and stack frame of the (single) kernel in a cubin, from its .nv.info sections."""
    if not cubin or cubin[:4] != b"\x7fELF":
        return {}
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = []
    for i in range(shnum):
        name, _typ, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        sections.append((name, offset, size))
    str_off = sections[shstrndx][1]

    def sec_name(n):
        return cubin[str_off + n : cubin.index(b"\0", str_off + n)].decode()

    out: Dict[str, int] = {}
    for name, offset, size in sections:
        if not sec_name(name).startswith(".nv.info"):
            continue
        p, end = offset, offset + size
        while p + 2 <= end:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == _EIFMT_SVAL:
                length = struct.unpack_from("<H", cubin, p + 2)[0]
                payload = cubin[p + 4 : p + 4 + length]
                if attr == _EIATTR_REGCOUNT and length >= 8:
                    out["registers"] = max(out.get("registers", 0), struct.unpack_from("<II", payload)[1])
                elif attr == _EIATTR_FRAME_SIZE and length >= 8:
                    out["frame_bytes"] = max(out.get("frame_bytes", 0), struct.unpack_from("<II", payload)[1])
                p += 4 + length
            elif fmt in (0x02, 0x03):  # 2-byte value / 2-byte header + value
                p += 4
            else:
                p += 2
    return out


@contextlib.contextmanager
def keep_artifacts(arch: str):
    """Ask the DSL to keep PTX and cubin of what is compiled inside, for ``arch``."""
    from cutlass.base_dsl.env_manager import _parse_keep_tokens  # noqa: F401  (fails loudly if the DSL moved it)
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    saved = {k: getattr(envar, k) for k in ("keep_ptx", "keep_cubin", "dump_dir")}
    envar.keep_ptx, envar.keep_cubin = True, True
    # The DSL also writes what it keeps to dump_dir (default: the working directory); keep that out of trees.
    envar.dump_dir = tempfile.mkdtemp(prefix="cutedsl_gemm_dump_")
    try:
        yield
    finally:
        shutil.rmtree(envar.dump_dir, ignore_errors=True)  # the compiled object already holds PTX and cubin
        for k, v in saved.items():
            setattr(envar, k, v)


def find_ptxas():
    """The CUDA toolkit's ptxas (PATH, $CUDA_HOME, /usr/local/cuda*), or None."""
    found = shutil.which("ptxas")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    return next((p for p in (os.path.join(r, "bin", "ptxas") for r in roots if r) if os.access(p, os.X_OK)), None)


def ptxas_report(ptx: str, arch: str, ptxas: str) -> str:
    """What the toolkit's ``ptxas -v`` prints for a kernel's PTX text (registers, spills, performance notes);
    RuntimeError if it fails."""
    with tempfile.TemporaryDirectory(prefix="cutedsl_gemm_ptxas_") as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed on the kernel's PTX: {run.stderr.strip()[:500]}")
    return run.stdout + run.stderr


def ptxas_registers_and_spills(report: str) -> Tuple[int, int]:
    """(registers per thread, spilled bytes stored + loaded) from a one-kernel ``ptxas_report``."""
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", report)
    if regs is None or len(spills) != 2:
        raise ValueError(f"no register/spill line in the ptxas report: {report[:300]}")
    return int(regs[1]), sum(map(int, spills))


def ptxas_performance_notes(ptx: str, arch: str, ptxas: str) -> List[str]:
    """ptxas's "Potential Performance Loss" notes for a kernel's PTX (e.g. C7514: WGMMAs serialized because
    other instructions touch in-flight accumulators). The DSL's own PTX compiler stays silent about these."""
    return [line for line in ptxas_report(ptx, arch, ptxas).splitlines() if "Performance Loss" in line]


def inspect_compiled(name: str, compiled, smem_bytes: int = -1) -> KernelReport:
    ptx = compiled.__ptx__ or ""
    cubin = compiled.__cubin__
    if isinstance(cubin, str):
        cubin = cubin.encode("latin1")
    res = cubin_resources(cubin or b"")
    return KernelReport(
        name=name,
        instructions=ptx_instructions(ptx),
        registers=res.get("registers", -1),
        frame_bytes=res.get("frame_bytes", -1),
        smem_bytes=smem_bytes,
        ptx=ptx,
    )


def kernel_resources(inst) -> tuple[int, int]:
    """(dynamic shared memory bytes, A/B mainloop stages) of an instance's kernel, as its plan sets them: its kernel
    family's ``resources`` (``families/registry.py``; UnknownFamilyError, a ValueError, names the registered
    (arch, op) pairs if it has none)."""
    from cutedsl_gemm.families.registry import family

    return family(inst).resources(inst)


def inspect_instance(inst) -> KernelReport:
    """Compile an instance of the table for its arch (no GPU needed), the runtime's way, and report on it."""
    from cutedsl_gemm.runtime.compile import compile_instance

    with keep_artifacts(inst.arch):
        compiled = compile_instance(inst)
    return inspect_compiled(inst.name, compiled, kernel_resources(inst)[0])

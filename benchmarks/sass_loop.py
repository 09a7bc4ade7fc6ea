"""SASS of the Hopper GEMM's K loop: instructions and static stall cycles per loop trip, for chosen instances.

The promoted main loops are paced by how fast the consumer warps issue their instructions (BENCHMARKS.md
sessions 11-12), so the count per trip (two K tiles for the two-fragment loop) is the figure to watch when
changing them. Compiles each instance for sm_90a (no GPU needed), disassembles the cubin with ``cuobjdump``
(the CUDA toolkit's; the lent H100 has it, this machine may not), finds the loops holding the WGMMAs (the
K loop, then the persistent tile loop around it) and prints, per loop, the instruction count, the sum of the
control codes' stall counts and the instruction mix; ``--listing`` prints the loop with its control codes (stall, yield, barriers, reuse).

    python -m benchmarks.sass_loop --recipes tensor,1x128_128x128 --shape 4096x4096x4096
    python -m benchmarks.sass_loop --cubins DIR          # disassemble cubins compiled elsewhere (*.cubin)
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import tempfile

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/")
_HIGH = re.compile(r"/\* (0x[0-9a-f]+) \*/")


def decode(sass_text: str):
    """[(address, control codes, instruction)] from ``cuobjdump -sass`` text. The control bits sit in the
    high word of each 128-bit instruction: stall (4 bits), yield, write / read barrier, wait mask, reuse.
    "yield" is bit 45 clear: inferred, not documented (instructions with it never carry a reuse flag, which
    is what a yield would require)."""
    lines, out, i = sass_text.splitlines(), [], 0
    while i < len(lines):
        m = _LINE.match(lines[i])
        if m and i + 1 < len(lines) and _HIGH.search(lines[i + 1]):
            h = int(_HIGH.search(lines[i + 1]).group(1), 16)
            ctl = {"stall": (h >> 41) & 0xF, "yield": not (h >> 45) & 1, "wbar": (h >> 46) & 7,
                   "rbar": (h >> 49) & 7, "wait": (h >> 52) & 0x3F, "reuse": (h >> 58) & 0xF}
            out.append((int(m.group(1), 16), ctl, m.group(2).strip()))
            i += 2
        else:
            i += 1
    return out


def mma_loops(instrs):
    """The backward branches whose body holds WGMMAs: (start, end, body). Branches back from the out-of-line
    barrier-retry blocks at the end of the kernel (bodies reaching its EXIT) are not loops of interest."""
    loops = []
    for addr, _, ins in instrs:
        m = re.search(r"BRA 0x([0-9a-f]+)", ins)
        if not m or int(m.group(1), 16) >= addr:
            continue
        start = int(m.group(1), 16)
        body = [x for x in instrs if start <= x[0] <= addr]
        if any("GMMA" in x[2] for x in body) and not any(x[2].split()[-1] == "EXIT" or x[2] == "EXIT" for x in body):
            loops.append((start, addr, body))
    return loops


def _opcode(ins: str) -> str:
    words = ins.split()
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def report(name: str, sass_text: str, listing: bool) -> None:
    instrs = decode(sass_text)
    for start, end, body in mma_loops(instrs):
        mix = collections.Counter(_opcode(x[2]) for x in body)
        gmma = sum(n for op, n in mix.items() if "GMMA" in op)
        print(f"{name}: loop {start:#x}-{end:#x}: {len(body)} instructions, {gmma} WGMMAs, "
              f"stall cycles {sum(x[1]['stall'] for x in body)}")
        print("    " + ", ".join(f"{op} {n}" for op, n in mix.most_common()))
        if listing:
            for addr, c, ins in body:
                print(f"    {addr:05x} S{c['stall']:02d} {'Y' if c['yield'] else '-'} "
                      f"w{c['wait']:06b} u{c['reuse']:04b}  {ins}")


def compile_cubins(recipes, shape, out_dir):
    from cutedsl_gemm.selection import dispatch
    from cutedsl_gemm.tools.ptx_inspect import keep_artifacts
    from cutedsl_gemm.runtime.compile import compile_gemm

    m, n, k = shape
    for recipe in recipes:
        inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
        with keep_artifacts("sm_90a"):
            compiled = compile_gemm(inst.sm90_config())
        cubin = compiled.__cubin__
        if isinstance(cubin, str):
            cubin = cubin.encode("latin1")
        with open(os.path.join(out_dir, f"{inst.name}.cubin"), "wb") as f:
            f.write(cubin)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="tensor,1x128_128x128")
    p.add_argument("--shape", default="4096x4096x4096", help="MxNxK that dispatch picks the instance for")
    p.add_argument("--cubins", help="disassemble the *.cubin files in this directory instead of compiling")
    p.add_argument("--listing", action="store_true")
    args = p.parse_args()
    tool = shutil.which("cuobjdump") or next(iter(glob.glob("/usr/local/cuda*/bin/cuobjdump")), None)
    if tool is None:
        raise SystemExit("cuobjdump not found (CUDA toolkit); compile here and pass --cubins on a machine with it")
    with tempfile.TemporaryDirectory(prefix="sass_loop_") as tmp:
        src = args.cubins
        if not src:
            compile_cubins(args.recipes.split(","), tuple(int(x) for x in args.shape.split("x")), tmp)
            src = tmp
        for path in sorted(glob.glob(os.path.join(src, "*.cubin"))):
            text = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
            report(os.path.basename(path)[:-6], text, args.listing)


if __name__ == "__main__":
    main()

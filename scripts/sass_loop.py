"""The instruction mix of the tensor-core kernels' main loops, read from SASS
(no GPU): for each ``*_mma_kernel`` in the objects, the smallest loop that
holds all of its HMMA instructions (the key-tile loop of the forward, the
column loop of the backward) and what it is made of. Static counts: both
sides of every branch are counted once.

    bash scripts/compile_cuda.sh --keep build/sass       # objects for sm_80 and sm_90
    python3 scripts/sass_loop.py build/sass/block_forward.o build/sass/block_backward.o

``cuobjdump`` comes from the CUDA toolkit (PATH, /usr/local/cuda/bin, or
``CUOBJDUMP``); where the toolkit lacks it, the PyPI wheel
``nvidia-cuda-cuobjdump`` holds one (``nvidia/cu13/bin/cuobjdump``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess

SHOWN = ("HMMA", "LDSM", "LDGSTS", "LDG", "LDS", "MUFU", "FMUL", "BSSY", "BRA", "BAR")
_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)")


def cuobjdump() -> str:
    for path in (
        os.environ.get("CUOBJDUMP"),
        shutil.which("cuobjdump"),
        "/usr/local/cuda/bin/cuobjdump",
    ):
        if path and os.path.exists(path):
            return path
    raise SystemExit("sass_loop: no cuobjdump (set CUOBJDUMP; see the module docstring)")


def functions(obj: str, arch: str) -> dict[str, list[tuple[int, str]]]:
    text = subprocess.run(
        [cuobjdump(), "-sass", "-arch", arch, obj], capture_output=True, text=True, check=True
    ).stdout
    parts = re.split(r"\n\s+Function : (\S+)\n", text)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        out[name] = [(int(a, 16), t.strip()) for a, t in _INSTR.findall(body)]
    return out


def opcode(instr: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0].split(".")[0]


def main_loop(ins: list[tuple[int, str]]) -> list[str] | None:
    """The instructions of the smallest backward branch's span that holds
    every HMMA, or None."""
    hmma = [a for a, t in ins if "HMMA" in t]
    if not hmma:
        return None
    spans = []
    for a, t in ins:
        m = _BRANCH.search(t)
        if m and int(m.group(1), 16) <= hmma[0] and a >= hmma[-1]:
            spans.append((int(m.group(1), 16), a))
    if not spans:
        return None
    lo, hi = min(spans, key=lambda s: s[1] - s[0])
    return [t for x, t in ins if lo <= x <= hi]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("objects", nargs="+")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--dtype", default="BFloat16", help="the kernels' element type (mangled name)")
    a = p.parse_args()
    print(f"| kernel ({a.arch}, {a.dtype}) | instructions | loop | " + " | ".join(SHOWN) + " |")
    print("|---|---:|---:|" + "---:|" * len(SHOWN))
    for obj in a.objects:
        for name, ins in functions(obj, a.arch).items():
            m = re.search(r"(fwd|bwd)_mma_kernelIN3c10\d+(\w+?)E(\w+?)EEvNS0", name)
            if not m or m.group(2) != a.dtype:
                continue
            loop = main_loop(ins)
            if loop is None:
                continue
            c = collections.Counter(opcode(t) for t in loop)
            # template arguments: Li<int>E, Lb1E (dk/dv) or Lb0E (dq), the
            # KeyMap LNS0_6KeyMapE0E (strided) or ...E1E (mapped)
            targs = re.sub(r"LNS0_6KeyMapE(\d)", r"Lk\1", m.group(3))
            names = {"Lb1": "dkdv", "Lb0": "dq", "Lk0": "strided", "Lk1": "mapped"}
            args = ", ".join(names.get(x, x[2:]) for x in targs.split("E") if x)
            counts = " | ".join(str(c[k]) for k in SHOWN)
            print(f"| {m.group(1)} {args} | {len(ins)} | {len(loop)} | {counts} |")


if __name__ == "__main__":
    main()

"""The register spills in ptxas resource reports (nvcc --ptxas-options=-v).

    python scripts/ptxas_spills.py LOG [LOG ...]            # exit 1 if any function spills
    python scripts/ptxas_spills.py --allow REGEX LOG ...    # ... other than those REGEX matches
    python scripts/ptxas_spills.py --table LOG [LOG ...]    # every function's figures

ptxas prints, for each function it compiles, a "Function properties for
NAME" line followed by "N bytes stack frame, S bytes spill stores, L bytes
spill loads", and for each kernel "Compiling entry function 'NAME' for
'sm_XX'" and "Used R registers". scripts/compile_cuda.sh fails a source whose
report shows any function with S or L above 0 (the fix the tensor-core
forward needed is in csrc/cuda/README.md), except the functions whose
(demangled) names its --allow matches, which are listed as allowed. Names
are demangled with c++filt where it is installed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
FIGURES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


@dataclass
class Function:
    """One function of a report: its figures (registers only for kernels)."""

    name: str
    arch: str = "?"
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    registers: int | None = None

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse(text: str) -> list[Function]:
    """The functions of one report, in its order."""
    functions: list[Function] = []
    arch: dict[str, str] = {}  # a kernel's architecture, from its entry line
    current: Function | None = None  # the function whose figures come next
    last: Function | None = None  # the function a "Used" line belongs to
    for line in text.splitlines():
        if m := ENTRY.search(line):
            arch[m.group(1)] = m.group(2)
        elif m := PROPERTIES.search(line):
            current = Function(m.group(1), arch.get(m.group(1), "?"))
        elif (m := FIGURES.search(line)) and current is not None:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
            functions.append(current)
            last, current = current, None
        elif (m := REGISTERS.search(line)) and last is not None and last.registers is None:
            last.registers = int(m.group(1))
    return functions


def demangle(names: list[str]) -> list[str]:
    """c++filt's names, or the names as they are without it."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    lines = out.splitlines()
    return lines if len(lines) == len(names) else names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="compiler output with ptxas' -v report")
    parser.add_argument("--table", action="store_true", help="print every function's figures")
    parser.add_argument(
        "--allow", metavar="REGEX", help="functions whose names this matches may spill (listed)"
    )
    args = parser.parse_args(argv)
    allowed = re.compile(args.allow) if args.allow else None
    functions = [f for path in args.logs for f in parse(open(path, encoding="utf-8").read())]
    names = demangle([f.name for f in functions])
    spilled = 0
    for f, name in zip(functions, names, strict=True):
        if args.table:
            regs = "-" if f.registers is None else f.registers
            spill = f"{f.spill_stores}/{f.spill_loads}"
            print(f"{f.arch} regs {regs} stack {f.stack} spill {spill} {name}")
            continue
        if not f.spills:
            continue
        allow = allowed is not None and allowed.search(name) is not None
        print(
            f"{'allowed: ' if allow else ''}{name} ({f.arch}): {f.spill_stores} bytes spill "
            f"stores, {f.spill_loads} bytes spill loads"
        )
        spilled += not allow
    if spilled:
        print(f"{spilled} of {len(functions)} functions spill registers to local memory")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())

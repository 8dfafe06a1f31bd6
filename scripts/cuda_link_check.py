"""Check that the CUDA build's objects link with the CPU sources: every
project symbol (``ring_attention::...``) an object of csrc/cuda/ uses is
defined by one of them or by the CPU extension (the same csrc/*.cpp and
csrc/cpu/*.cpp the CUDA extension compiles; its symbol table, not only its
exports). Symbols of torch, the CUDA runtime and the C++ runtime are left
to the real link, which needs a CUDA build of torch.

    python scripts/cuda_link_check.py OBJECT.o ... --cpu-extension ring_attention/_C*.so

Needs ``nm`` (binutils). Exits 1 and names the symbols if any is missing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

PROJECT = "ring_attention::"


def _symbols(path: str) -> tuple[set[str], set[str]]:
    """(defined, undefined) project symbols of ``path``, demangled."""
    lines = subprocess.run(
        ["nm", "-C", path], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    defined, undefined = set(), set()
    for line in lines:
        kind, name = line[17:18], line[19:]
        if not name.startswith(PROJECT) and f" {PROJECT}" not in name:
            continue
        name = name.removesuffix(" [clone .cold]")
        (undefined if kind == "U" else defined).add(name)
    return defined, undefined


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("objects", nargs="+", help="the CUDA build's objects (csrc/cuda/*)")
    parser.add_argument("--cpu-extension", required=True, help="the built CPU extension (.so)")
    args = parser.parse_args(argv)
    defined, _ = _symbols(args.cpu_extension)
    used: dict[str, list[str]] = {}
    for obj in args.objects:
        mine, wanted = _symbols(obj)
        defined |= mine
        for name in wanted:
            used.setdefault(name, []).append(obj)
    missing = sorted(set(used) - defined)
    for name in missing:
        print(f"cuda_link_check: {name} (used by {', '.join(used[name])}) is defined nowhere")
    print(
        f"cuda_link_check: {len(used)} project symbols used across objects, {len(missing)} missing"
    )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())

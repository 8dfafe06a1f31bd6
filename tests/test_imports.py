"""Modules are found by their package, never by editing the module path: no
file of the tree edits ``sys.path`` (tests, scripts, benchmarks and examples
import ``ring_attention``, ``benchmarks.<name>`` or, in tests/, their
neighbours), and the one file that loads a module from a path is
benchmarks/bench.py, which imports its own package when run as a file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYS_PATH_EDIT = re.compile(
    r"sys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\b|\[[^\]]*\]\s*=|\+?=[^=])"
    r"|site\.addsitedir|spec_from_file_location"
)
LOADS_BY_PATH = {"benchmarks/bench.py"}


def edits(text: str) -> list[str]:
    return [m.group(0) for m in SYS_PATH_EDIT.finditer(text)]


def test_the_pattern_finds_every_kind_of_edit() -> None:
    for line in ("sys.path.insert(0, d)", "sys.path[:0] = [d]", "sys.path.append(d)",
                 "sys.path = [d]", "sys.path += [d]", "site.addsitedir(d)",
                 "importlib.util.spec_from_file_location('m', p)"):  # fmt: skip
        assert edits(line), line
    for line in ("children get the parent's ``sys.path``", "if d in sys.path:", "x == sys.path"):
        assert not edits(line), line


def test_no_file_edits_the_module_path() -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.sh"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout.split()  # fmt: skip
    assert "tests/conftest.py" in files and "benchmarks/cli.py" in files
    found = {}
    for name in files:
        path = ROOT / name
        if name == "tests/test_imports.py" or name in LOADS_BY_PATH or not path.exists():
            continue
        if hits := edits(path.read_text(errors="replace")):
            found[name] = hits
    assert not found, f"edits of sys.path (import the package instead): {found}"
    (bench,) = LOADS_BY_PATH
    assert edits((ROOT / bench).read_text()) == ["spec_from_file_location"]


_IMPORT_SCRIPT = """
import sys
import ring_attention
from ring_attention.parallel.ring_spec import _registered_spec
assert "torch._dynamo" not in sys.modules, "import ring_attention imported torch._dynamo"
import torch

def plain():
    pass

marks = vars(torch.compiler.assume_constant_result(plain))
assert marks, "torch.compiler.assume_constant_result sets no mark any more"
assert {k: getattr(_registered_spec, k, None) for k in marks} == marks, marks
print("ok")
"""


def test_import_skips_dynamo_and_ring_call_spec_is_marked_constant() -> None:
    """``import ring_attention`` leaves ``torch._dynamo`` unimported (seconds
    per process: every subprocess of the tests pays it otherwise), and
    ``ring_call_spec``'s registration carries exactly the mark that
    ``torch.compiler.assume_constant_result`` sets (tests/test_compile_ring.py
    checks what the mark does under ``torch.compile``)."""
    res = subprocess.run(
        [sys.executable, "-c", _IMPORT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr

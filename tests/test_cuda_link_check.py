"""scripts/cuda_link_check.py on tiny objects: a project symbol used and
defined nowhere fails it, one defined by another object or by the CPU
extension passes."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "cuda_link_check.py")

USER = (
    "namespace ring_attention { void launch(int); }\n"
    "int use() { ring_attention::launch(1); return 0; }\n"
)
DEFINER = "namespace ring_attention { void launch(int) {} }\n"
OTHER = "namespace ring_attention { int unrelated() { return 2; } }\n"


def _compile(tmp_path, name: str, code: str, shared: bool = False) -> str:
    src, out = tmp_path / f"{name}.cpp", tmp_path / (f"{name}.so" if shared else f"{name}.o")
    src.write_text(code)
    flags = ["-shared", "-fPIC", "-fvisibility=hidden"] if shared else ["-c", "-fPIC"]
    subprocess.run(["c++", *flags, str(src), "-o", str(out)], check=True)
    return str(out)


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def test_link_check_finds_a_missing_project_symbol(tmp_path) -> None:
    user = _compile(tmp_path, "user", USER)
    other = _compile(tmp_path, "other", OTHER, shared=True)
    res = _check(user, "--cpu-extension", other)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "ring_attention::launch(int) (used by" in res.stdout and "1 missing" in res.stdout
    # defined by another object, or by the CPU extension (a hidden symbol)
    assert (
        _check(user, _compile(tmp_path, "definer", DEFINER), "--cpu-extension", other).returncode
        == 0
    )
    assert (
        _check(user, "--cpu-extension", _compile(tmp_path, "cpu", DEFINER, shared=True)).returncode
        == 0
    )

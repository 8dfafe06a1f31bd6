"""Every command and snippet of README.md runs as written from a fresh clone.

Each ```python block runs in its own subprocess with this checkout's package
(distributed ones, tagged ``<!-- readme-test: torchrun -->`` above the block,
under ``torch.distributed.run`` with 2 gloo processes). A block that cannot
run alone says so with a tag the test checks: ``fragment FILE`` (part of the
runnable program FILE, which a test runs) or ``hub REASON`` (needs the Hugging
Face hub; it must compile, and an untagged block beside it runs the same
without the hub). Every shell command (```bash blocks and inline ``python``,
``bash``, ``torchrun`` commands) names files and modules that exist.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import with_path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TESTS = Path(__file__).resolve().parent
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<tag>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```", re.S | re.M
)
TAGS = ("torchrun", "fragment", "hub")


def blocks(lang: str) -> list[tuple[int, str, str]]:
    """(line, tag, code) of the README's ``lang`` blocks."""
    text = README.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m["tag"] or "", m["code"])
        for m in BLOCK.finditer(text)
        if m["lang"] == lang
    ]


PYTHON = blocks("python")


def run_block(code: str, tmp_path: Path, torchrun: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_block.py"
    script.write_text(code)
    env = {**with_path(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*(launch if torchrun else [sys.executable]), str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def test_the_readme_has_its_examples() -> None:
    tags = [tag.split()[0] for _, tag, _ in PYTHON if tag]
    assert len(PYTHON) >= 8 and tags.count("torchrun") == 1, PYTHON
    assert set(tags) <= set(TAGS), tags


@pytest.mark.parametrize("line,tag,code", PYTHON, ids=[f"line{b[0]}" for b in PYTHON])
def test_python_block_runs(line: int, tag: str, code: str, tmp_path: Path) -> None:
    kind, _, rest = tag.partition(" ")
    compile(code, f"README.md:{line}", "exec")  # every block is valid Python
    if kind == "fragment":  # part of a runnable example that a test runs
        example = rest.strip()
        assert (ROOT / example).is_file(), f"README.md:{line} names {example}, which is missing"
        name = Path(example).name
        runners = [p.name for p in TESTS.glob("test_*.py") if name in p.read_text()]
        assert [r for r in runners if r != "test_readme.py"], f"no test runs {example}"
        return
    if kind == "hub":  # needs the hub; the block after it runs the same locally
        following = [b for b in PYTHON if b[0] > line]
        assert following and not following[0][1], f"README.md:{line}: no local block beside it"
        return
    assert kind in ("", "torchrun"), f"README.md:{line}: unknown tag {tag!r}"
    proc = run_block(code, tmp_path, torchrun=kind == "torchrun")
    assert proc.returncode == 0, f"README.md:{line}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    if kind == "torchrun":  # the ring example prints its check once: a small error
        found = re.findall(r"max \|ring - one process\| = (\S+)", proc.stdout)
        assert len(found) == 1 and float(found[0]) < 1e-5, proc.stdout


# ---------------------------------------------------------------- commands
LAUNCHERS = ("python", "python3", "bash", "torchrun", ".venv/bin/python")
FILE = re.compile(r"^[\w./-]+\.(py|sh|md|toml|png)$")


def commands() -> list[str]:
    """Every shell command of the README: the lines of ```bash blocks and the
    inline code spans that start with a launcher."""
    text = README.read_text()
    out = []
    for _, _, code in blocks("bash"):
        joined = code.replace("\\\n", " ")
        out += [line.split("#")[0].strip() for line in joined.splitlines()]
    prose = BLOCK.sub("", text)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if span.split(" ")[0] in LAUNCHERS:
            out.append(span)
    return [c for c in out if c]


def saved_as() -> set[str]:
    """Files the README tells the reader to write (``save it as `x.py```)."""
    return set(re.findall(r"save (?:it|the block) as `([^`]+)`", README.read_text()))


def missing(command: str) -> list[str]:
    """The files and modules ``command`` names that do not exist."""
    words = shlex.split(command)
    bad = []
    for i, word in enumerate(words):
        if word.startswith(".venv/") or word in saved_as():
            continue  # made by scripts/setup.sh, or by the reader
        if FILE.match(word) and not (ROOT / word).exists():
            bad.append(word)
        if word == "-m" and i + 1 < len(words):
            name = words[i + 1]
            if (ROOT / name.split(".")[0]).is_dir():  # this checkout's: a file of it
                local = ROOT / name.replace(".", "/")
                if not (local.with_suffix(".py").is_file() or (local / "__main__.py").is_file()):
                    bad.append(name)
            elif importlib.util.find_spec(name) is None:  # an installed one (torch's)
                bad.append(name)
    return bad


def test_commands_name_files_that_exist() -> None:
    found = commands()
    assert any(c.startswith("bash scripts/test.sh") for c in found), found
    assert any("-m ring_attention.planner" in c for c in found), found
    assert any("examples/sequence_parallel.py" in c for c in found), found
    bad = {c: missing(c) for c in found if missing(c)}
    assert not bad, f"README commands name what does not exist: {bad}"


def test_missing_names_are_found() -> None:
    """The check itself: a missing script or module is reported."""
    assert missing("python examples/no_such_example.py --x 1") == ["examples/no_such_example.py"]
    assert missing("python -m ring_attention.no_such_tool") == ["ring_attention.no_such_tool"]
    assert missing("bash scripts/test.sh -x") == []

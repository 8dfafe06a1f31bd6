"""Every command and snippet of README.md and of the user pages under docs/
runs as written from a fresh clone.

Each ```python block runs in its own subprocess with this checkout's package
(distributed ones, tagged ``<!-- readme-test: torchrun -->`` above the block,
under ``torch.distributed.run`` with 2 gloo processes). A block that cannot
run alone says so with a tag the test checks: ``fragment FILE`` (part of the
runnable program FILE, which a test runs) or ``hub REASON`` (needs the Hugging
Face hub; it must compile, and an untagged block after it runs the same
without the hub). Every shell command (```bash blocks and inline ``python``,
``bash``, ``torchrun`` commands) names files and modules that exist. The
README stays short (at most 250 lines), does not repeat docs/design.md's
module layout, and its figures are rows of benchmarks/RESULTS.md's tables.
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

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: The pages a user reads (docs/design.md is the specification: its blocks are signatures).
PAGES = [README] + [
    ROOT / "docs" / f"{name}.md"
    for name in ("modules", "parallel", "transformers", "performance", "development")
]
TESTS = Path(__file__).resolve().parent
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<tag>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```", re.S | re.M
)
TAGS = ("torchrun", "fragment", "hub")


def blocks(lang: str, page: Path = README) -> list[tuple[int, str, str]]:
    """(line, tag, code) of a page's ``lang`` blocks."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start("code")) + 1, m["tag"] or "", m["code"])
        for m in BLOCK.finditer(text)
        if m["lang"] == lang
    ]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


PYTHON = [(page, *b) for page in PAGES for b in blocks("python", page)]


def run_block(code: str, tmp_path: Path, torchrun: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_block.py"
    script.write_text(code)
    env = {**with_path(ROOT), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*(launch if torchrun else [sys.executable]), str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def test_the_readme_has_its_examples() -> None:
    """One example per mode: one process, the ring (run under torchrun),
    Ulysses and the hybrid (fragments), the MHA drop-in, transformers."""
    readme = blocks("python")
    tags = [tag.split()[0] for _, tag, _ in readme if tag]
    assert len(readme) >= 6 and tags.count("torchrun") == 1, readme
    assert tags.count("fragment") >= 2, tags
    assert set(tags) <= set(TAGS), tags
    code = "\n".join(c for _, _, c in readme)
    for call in ("ra.dilated_attention(", "ulysses_group=", "mesh=mesh", "register_transformers("):
        assert call in code, call
    assert "MultiheadDilatedAttention(" in code


def test_the_readme_is_short_and_links_its_pages() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "arxiv.org/abs/2307.02486" in text  # the LongNet paper
    for page in PAGES[1:]:
        assert f"({_name(page)})" in text, f"the README does not link {_name(page)}"
    for target in ("benchmarks/RESULTS.md", "docs/design.md", "LICENSE"):
        assert f"({target})" in text, target
    # docs/design.md §8 owns the module layout: no line of the README lists a module file
    assert not re.search(r"^\s*`?ring_attention/\w+\.py", text, re.M)


def test_the_readme_figures_are_rows_of_results() -> None:
    """Each row of the README's figures table is a row of RESULTS.md's
    generated tables: the same n, shape, pass and times."""
    text = README.read_text()
    row = r"^\| [^|]+ \| (\d+) \| (\d+x\d+) \| (fwd(?:\+bwd)?) \| ([\d.]+) \| ([\d.]+) \|"
    rows = re.findall(row, text, re.M)
    assert len(rows) >= 2, "the README has no figures table"
    table = report.generate().splitlines()
    for n, shape, pass_, ours, ref in rows:
        found = [
            line
            for line in table
            if line.startswith(f"| {n} | {shape} |")
            and f"| {pass_} |" in line
            and f"| {ours} |" in line
            and f"| {ref}" in line
        ]
        assert found, f"README figures row {n} {shape} {pass_} {ours} {ref} is not in RESULTS"


@pytest.mark.parametrize(
    "page,line,tag,code", PYTHON, ids=[f"{b[0].stem}-line{b[1]}" for b in PYTHON]
)
def test_python_block_runs(page: Path, line: int, tag: str, code: str, tmp_path: Path) -> None:
    where = f"{_name(page)}:{line}"
    kind, _, rest = tag.partition(" ")
    compile(code, where, "exec")  # every block is valid Python
    if kind == "fragment":  # part of a runnable example that a test runs
        example = rest.strip()
        assert (ROOT / example).is_file(), f"{where} names {example}, which is missing"
        name = Path(example).name
        runners = [p.name for p in TESTS.glob("test_*.py") if name in p.read_text()]
        assert [r for r in runners if r != "test_readme.py"], f"no test runs {example}"
        return
    if kind == "hub":  # needs the hub; the block after it runs the same locally
        following = [b for b in PYTHON if b[0] == page and b[1] > line]
        assert following and not following[0][2], f"{where}: no local block beside it"
        return
    assert kind in ("", "torchrun"), f"{where}: unknown tag {tag!r}"
    proc = run_block(code, tmp_path, torchrun=kind == "torchrun")
    assert proc.returncode == 0, f"{where}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    if kind == "torchrun":  # the ring example prints its check once: a small error
        found = re.findall(r"max \|ring - one process\| = (\S+)", proc.stdout)
        assert len(found) == 1 and float(found[0]) < 1e-5, proc.stdout


# ---------------------------------------------------------------- commands
LAUNCHERS = ("python", "python3", "bash", "torchrun", ".venv/bin/python")
FILE = re.compile(r"^[\w./-]+\.(py|sh|md|toml|png)$")


def commands(page: Path = README) -> list[str]:
    """Every shell command of a page: the lines of ```bash blocks and the
    inline code spans that start with a launcher."""
    text = page.read_text()
    out = []
    for _, _, code in blocks("bash", page):
        joined = code.replace("\\\n", " ")
        out += [line.split("#")[0].strip() for line in joined.splitlines()]
    prose = BLOCK.sub("", text)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if span.split(" ")[0] in LAUNCHERS:
            out.append(span)
    return [c for c in out if c]


def saved_as() -> set[str]:
    """Files the pages tell the reader to write (``save it as `x.py```)."""
    text = "\n".join(p.read_text() for p in PAGES)
    return set(re.findall(r"save (?:it|the block) as `([^`]+)`", text))


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
    assert any(c.startswith("bash scripts/run_ring.sh") for c in found), found
    assert any("-m ring_attention.planner" in c for c in found), found
    assert any("examples/sequence_parallel.py" in c for c in found), found
    assert any(c.startswith("pip install --no-build-isolation") for c in found), found
    for page in PAGES:
        bad = {c: missing(c) for c in commands(page) if missing(c)}
        assert not bad, f"{_name(page)}: commands name what does not exist: {bad}"


def test_missing_names_are_found() -> None:
    """The check itself: a missing script or module is reported."""
    assert missing("python examples/no_such_example.py --x 1") == ["examples/no_such_example.py"]
    assert missing("python -m ring_attention.no_such_tool") == ["ring_attention.no_such_tool"]
    assert missing("bash scripts/test.sh -x") == []

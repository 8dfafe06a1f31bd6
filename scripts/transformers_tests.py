"""transformers' own model tests as the judge of the ``"ring_dilated"`` backend.

Runs transformers' model tests of the installed release (its common mixins)
with ``"ring_dilated"`` as the default attention (the pytest plugin
tests/transformers_suite/ring_dilated_default.py), then the tests that did
not pass there once more as they are: with the model's own attention, the
reference (``"sdpa"``; ``"eager"`` for gpt-oss, which has no ``"sdpa"``).
Prints both runs' passed / failed / skipped counts and the tests that pass
with the reference and not with ``"ring_dilated"``, and exits 1 if there are
any but the expected ones (``EXPECTED`` below and ``--allow NAME=REASON``,
each printed with its reason). A test that passes with ``"ring_dilated"``
needs no second run: the judge costs one run of the files plus the few that
did not pass.

    python scripts/transformers_tests.py --sdist [TARBALL] [--models llama,gpt_oss] [-- ARGS]
    python scripts/transformers_tests.py --source DIR [--models llama] [-- PYTEST ARGS]

``--sdist`` (what CI runs) needs only the installed release's sdist from
PyPI (downloaded with pip into build/transformers_tests/ unless TARBALL is
given): its ``tests/`` common files, with ``GenerationTesterMixin`` and
``ExportTesterMixin`` stood in by empty classes (the sdist lacks both), judge
the project's own tiny testers of Llama, Mistral, Qwen2, gpt-oss, Gemma 3
(text), Llama 4 (text), Cohere 2 and OLMo 3 (tests/transformers_suite/common_models.py,
every family by default): every test of the release's ``ModelTesterMixin``.
The generation tests are not among them (the project's
tests/test_hf_generate.py covers generation against ``"sdpa"``).

``--source`` runs the models' own test files, generation mixin included
(for Llama, Mistral and Qwen2: the plugin reroutes ``"sdpa"``, so a model
whose default is ``"eager"``, gpt-oss, would not attend through it there).
DIR is a transformers source tree at the installed version (its
``src/transformers/__init__.py`` names it). A checkout of the repository at
tag ``v<version>`` is one. The release's sdist is another once completed:
it carries ``src/`` and the top-level common files of ``tests/``
(``test_modeling_common.py``, ``test_configuration_common.py``,
``test_pipeline_mixin.py``, ...) but not these, which come from the
repository (``tests/<path>`` at the tag):

- ``causal_lm_tester.py`` and ``models/<model>/test_modeling_<model>.py``;
- ``generation/test_utils.py`` (``GenerationTesterMixin``),
  ``exporters/test_export.py`` (``ExportTesterMixin``),
  ``utils/test_configuration_utils.py`` (``config_common_kwargs``) and
  ``utils/tiny_model_summary.json`` (the pipeline tests' tiny models);
- an empty ``__init__.py`` in ``tests/`` and in each of those folders.

The tree of the journal's latest run (``benchmarks/journal/``) was the
5.24.0 sdist with these files of the repository at commit
``decba1d2ea4ed3cbf0495d1828abad4b2dba1846`` (``5.16.0.dev0``, the newest
transformers 5 commit that could be had; its generation mixin is the one
with static caches, continuation from ``past_key_values``, the custom 4-D
mask test and compiled decoding): ``causal_lm_tester.py``,
``generation/test_utils.py``, ``exporters/test_export.py``,
``models/{llama,mistral,qwen2}/test_modeling_*.py`` and
``utils/tiny_model_summary.json`` as they are; adapted to the release:
``causal_lm_tester.py`` defining ``_TEXT_MODEL_TESTER_DEFAULTS`` itself
(the commit's ``testing_utils`` dict; the release does not export it),
``utils/test_configuration_utils.py`` reduced to its
``config_common_kwargs`` (the rest imports ``httpx``), and the sdist's
``test_fsdp_mixin.py`` / ``test_tensor_parallel_mixin.py`` replaced by
empty mixins (they import ``tests/distributed_testing_utils.py``, which
the sdist lacks).

``parameterized`` must be importable (``pip install --target DEPS
parameterized`` and DEPS on ``PYTHONPATH``). Where no version of one of
those files that fits the release can be had, an older one with its imports
adapted to the release's names, or a stand-in that keeps the others
importable (an empty mixin class; ``{}`` for the JSON, so the pipeline tests
skip), takes its place: say which with the counts. Nothing of transformers
is copied into this repository.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = ROOT / "tests" / "transformers_suite"
OUTCOMES = ("passed", "failed", "skipped")
SDIST_DIR = ROOT / "build" / "transformers_tests"
#: the sdist's tests/ imports these; it does not carry them
STAND_INS = {
    "generation/test_utils.py": "GenerationTesterMixin",
    "exporters/test_export.py": "ExportTesterMixin",
}
MODEL_CLASSES = {
    "llama": "LlamaCommonTest",
    "mistral": "MistralCommonTest",
    "qwen2": "Qwen2CommonTest",
    "gpt_oss": "GptOssCommonTest",
    "gemma3": "Gemma3CommonTest",
    "gemma4": "Gemma4CommonTest",
    "llama4": "Llama4CommonTest",
    "cohere2": "Cohere2CommonTest",
    "olmo3": "Olmo3CommonTest",
}

#: tests that fail with ``"ring_dilated"`` by design (``--allow`` adds
#: more): fnmatch patterns of test ids, each with its reason
EXPECTED = {
    "*GptOssCommonTest::test_retain_grad_hidden_states_attentions": (
        "the harness names ring_dilated in gpt-oss's config (no sdpa to reroute); transformers' "
        "config refuses output_attentions=True under any attention but eager before the test "
        "switches to eager: no attention runs"
    ),
}


def _source_version(source: Path) -> str | None:
    init = source / "src" / "transformers" / "__init__.py"
    if not init.exists():
        return None
    found = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M)
    return found.group(1) if found else None


def _outcomes(junit: Path) -> dict[str, str]:
    """test id (``classname::name``) -> passed / failed / skipped, from a
    JUnit XML report."""
    out = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = (
            "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
            else "passed"
        )  # fmt: skip
    return out


def _node_id(source: Path, test: str) -> str | None:
    """pytest's node id of a JUnit test id (``a.b.test_m.Class::test_x`` ->
    ``a/b/test_m.py::Class::test_x``), None when no file of ``source`` is
    its module (a collection error)."""
    classname, name = test.split("::", 1)
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        if (source / Path(*parts[:i])).with_suffix(".py").is_file():
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return None


def _sdist_tree(tarball: Path | None, version: str, tree: Path) -> Path:
    """A tests/ tree in ``tree`` from the release's sdist (cached in
    build/transformers_tests/), the stand-ins and the project's testers."""
    if tarball is None:
        name = f"transformers-{version}.tar.gz"
        tarball = SDIST_DIR / name
        if not tarball.exists():
            SDIST_DIR.mkdir(parents=True, exist_ok=True)
            pip = [sys.executable, "-m", "pip", "download", "--no-input", "--no-deps"]
            cmd = [*pip, "--no-binary", ":all:", "-d", str(SDIST_DIR), f"transformers=={version}"]
            subprocess.run(cmd, check=True)
    if not tarball.name.startswith(f"transformers-{version}."):
        raise SystemExit(f"{tarball} is not the installed release's sdist (transformers {version})")
    prefix = f"transformers-{version}/tests/"
    with tarfile.open(tarball) as tar:
        files = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)]
        tops = [m for m in files if "/" not in m.name[len(prefix) :]]
        tree.mkdir(parents=True)
        if not any(m.name.endswith("/test_modeling_common.py") for m in tops):
            raise SystemExit(f"{tarball} has no tests/test_modeling_common.py")
        for m in tops:
            out = tree / "tests" / m.name[len(prefix) :]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(m).read())
    tests = tree / "tests"
    (tests / "__init__.py").write_text("")
    for rel, cls in STAND_INS.items():
        (tests / rel).parent.mkdir(exist_ok=True)
        (tests / rel).parent.joinpath("__init__.py").write_text("")
        (tests / rel).write_text(f'class {cls}:\n    """Stand-in: not in the sdist."""\n')
    (tests / "ring_dilated").mkdir()
    (tests / "ring_dilated" / "__init__.py").write_text("")
    shutil.copy(PLUGIN_DIR / "common_models.py", tests / "ring_dilated" / "test_common_models.py")
    return tree


def _calls(path: Path) -> int:
    return sum(int(x) for x in path.read_text().split()) if path.exists() else 0


def _run(source: Path, files: list[str], plugin: bool, junit: Path, extra: list[str]) -> None:
    env = dict(os.environ)
    paths = [str(ROOT), str(PLUGIN_DIR)] + [p for p in [env.get("PYTHONPATH")] if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if plugin:
        cmd += ["-p", "ring_dilated_default"]
        env["RING_DILATED_CALLS"] = str(junit.with_suffix(".calls"))
    subprocess.run([*cmd, *files, *extra], cwd=source, env=env, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", type=Path, help="transformers source tree")
    where.add_argument("--sdist", type=Path, nargs="?", const=Path(), metavar="TARBALL",
                       help="the release's sdist (downloaded if not given)")  # fmt: skip
    parser.add_argument("--models", default=",".join(MODEL_CLASSES),
                        help="tests/models folders, a,b")  # fmt: skip
    parser.add_argument("--allow", action="append", default=[],
                        help="NAME=reason: an expected failure (a substring or an fnmatch "
                             "pattern of the test id)")  # fmt: skip
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return _judge(parser, args, Path(tmp))


def _judge(parser: argparse.ArgumentParser, args: argparse.Namespace, tmp: Path) -> int:
    import transformers

    models = args.models.split(",")
    if args.sdist is not None:
        unknown = [m for m in models if m not in MODEL_CLASSES]
        if unknown:
            parser.error(f"--models with --sdist: one of {sorted(MODEL_CLASSES)}, got {unknown}")
        tarball = None if args.sdist == Path() else args.sdist
        source = _sdist_tree(tarball, transformers.__version__, tmp / "tree")
        files = ["tests/ring_dilated/test_common_models.py"]
        args.pytest_args += ["-k", " or ".join(MODEL_CLASSES[m] for m in models)]
    else:
        source = args.source
        version = _source_version(source)
        if version != transformers.__version__:
            parser.error(
                f"--source holds transformers {version}, the installed release is "
                f"{transformers.__version__}: check out tag v{transformers.__version__}"
            )
        files = [f"tests/models/{m}/test_modeling_{m}.py" for m in models]
        missing = [f for f in files if not (source / f).exists()]
        if missing:
            parser.error(f"not in --source: {missing}")
    allowed = {**EXPECTED, **dict(a.split("=", 1) for a in args.allow)}
    junit = tmp / "ring_dilated.xml"
    _run(source, files, True, junit, args.pytest_args)
    ours = _outcomes(junit)
    calls = _calls(junit.with_suffix(".calls"))
    # the reference judges only what did not pass with ring_dilated; a test id that
    # names no file (a collection error) counts as regressed.
    not_passed = sorted(t for t, r in ours.items() if r != "passed")
    nodes = {t: _node_id(source, t) for t in not_passed}
    theirs = {}
    if any(nodes.values()):
        rerun = sorted({n for n in nodes.values() if n})
        _run(source, rerun, False, tmp / "reference.xml", args.pytest_args)
        theirs = _outcomes(tmp / "reference.xml")
    regressed = sorted(
        t
        for t in not_passed
        if (nodes[t] is None and ours[t] == "failed") or theirs.get(t, "passed") == "passed"
    )
    print(f"ring_dilated served {calls} attention calls")
    if not ours:
        print("FAILED: the ring_dilated run reported no test")
        return 1
    if calls == 0:
        print("FAILED: no test attended through ring_dilated")
        return 1
    rest = f"reference (the {len(not_passed)} that did not pass)"
    for name, results in (("ring_dilated", ours), (rest, theirs)):
        tally = {k: sum(r == k for r in results.values()) for k in OUTCOMES}
        print(f"{name}: " + ", ".join(f"{n} {k}" for k, n in tally.items()))
    unexpected = []
    for test in regressed:
        reason = next((r for name, r in allowed.items() if fnmatch.fnmatchcase(test, f"*{name}*")),
                      None)  # fmt: skip
        print(
            f"{'expected' if reason else 'REGRESSED'}: {test}" + (f" ({reason})" if reason else "")
        )
        if reason is None:
            unexpected.append(test)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())

"""transformers' own model tests as the judge of the ``"ring_dilated"`` backend.

Runs ``tests/models/{llama,mistral,qwen2}/test_modeling_*.py`` of the
installed transformers release (with the release's common mixins) twice:
as they are (``"sdpa"``), then with ``"ring_dilated"`` as the default
attention (the pytest plugin tests/transformers_suite/ring_dilated_default.py).
Prints each run's passed / failed / skipped counts and the tests that pass
with ``"sdpa"`` and fail with ``"ring_dilated"``, and exits 1 if there are
any (``--allow NAME=REASON`` lists expected ones, each with its reason in the
output).

    python scripts/transformers_tests.py --source DIR [--models llama] [-- PYTEST ARGS]

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
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_DIR = ROOT / "tests" / "transformers_suite"
OUTCOMES = ("passed", "failed", "skipped")


def _source_version(source: Path) -> str | None:
    init = source / "src" / "transformers" / "__init__.py"
    if not init.exists():
        return None
    found = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M)
    return found.group(1) if found else None


def _outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from a JUnit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = (
            "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
            else "passed"
        )  # fmt: skip
    return out


def _run(source: Path, files: list[str], plugin: bool, junit: Path, extra: list[str]) -> None:
    env = dict(os.environ)
    paths = [str(ROOT), str(PLUGIN_DIR)] + [p for p in [env.get("PYTHONPATH")] if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if plugin:
        cmd += ["-p", "ring_dilated_default"]
    subprocess.run([*cmd, *files, *extra], cwd=source, env=env, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="transformers source tree")
    parser.add_argument("--models", default="llama,mistral,qwen2", help="tests/models folders, a,b")
    parser.add_argument("--allow", action="append", default=[], help="NAME=reason, expected")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    import transformers

    version = _source_version(args.source)
    if version != transformers.__version__:
        parser.error(
            f"--source holds transformers {version}, the installed release is "
            f"{transformers.__version__}: check out tag v{transformers.__version__}"
        )
    files = [f"tests/models/{m}/test_modeling_{m}.py" for m in args.models.split(",")]
    missing = [f for f in files if not (args.source / f).exists()]
    if missing:
        parser.error(f"not in --source: {missing}")
    allowed = dict(a.split("=", 1) for a in args.allow)
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for plugin in (False, True):
            junit = Path(tmp) / f"{plugin}.xml"
            _run(args.source, files, plugin, junit, args.pytest_args)
            results[plugin] = _outcomes(junit)
    regressed = sorted(
        t for t, r in results[False].items() if r == "passed" and results[True].get(t) != "passed"
    )
    counts = {k: sum(r == "passed" for r in v.values()) for k, v in results.items()}
    print(f"passed: sdpa {counts[False]}, ring_dilated {counts[True]} of {len(results[False])}")
    for plugin, name in ((False, "sdpa"), (True, "ring_dilated")):
        tally = {k: sum(r == k for r in results[plugin].values()) for k in OUTCOMES}
        print(f"{name}: " + ", ".join(f"{n} {k}" for k, n in tally.items()))
    unexpected = []
    for test in regressed:
        reason = next((r for name, r in allowed.items() if name in test), None)
        print(
            f"{'expected' if reason else 'REGRESSED'}: {test}" + (f" ({reason})" if reason else "")
        )
        if reason is None:
            unexpected.append(test)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())

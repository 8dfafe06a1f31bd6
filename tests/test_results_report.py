"""benchmarks/RESULTS.md's current tables are those the checked-in records give.

`benchmarks/report.py` builds them from `benchmarks/results/`; a stale block
(a record added or changed without `python benchmarks/report.py --write`)
fails here. The planner's default CUDA rates are checked against the record
the report names for them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parent.parent


def test_results_md_block_is_up_to_date():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    assert report.current_block(text) == report.generate()
    assert report.main(["--check"]) == 0


def test_check_fails_on_a_stale_block(tmp_path, monkeypatch):
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    stale = tmp_path / "RESULTS.md"
    stale.write_text(text.replace(" | A |", " | Z |", 1), encoding="utf-8")
    monkeypatch.setattr(report, "RESULTS_MD", stale)
    assert report.main(["--check"]) == 1
    assert report.main(["--write"]) == 0
    assert report.main(["--check"]) == 0


def test_every_table_row_comes_from_a_record():
    """Each row's ours ms, date and commit are those of a point in its folder."""
    block = report.generate()
    for machine in report.MACHINES:
        for i, run in enumerate(machine.runs):
            header, points = report.load(run.folder, run.file)
            if machine.columns:  # views runs: the first run's dense points are ours
                if i:
                    continue
                ours = [p for p in points if p.get("stage") == "bench" and p["status"] == "ok"
                        and p["method"] == "dense"]  # fmt: skip
                rows = [f"| {p['n']} | {p['config']} |" for p in ours]
            else:
                ours = [p for p in points if p["method"] == "ours" and p["status"] == "ok"]
                rows = [f"| {p['n']} | {p['heads']}x{p['head_dim']} |" for p in ours]
            assert ours, run.folder
            for p, row in zip(ours, rows, strict=True):
                cell = f" | {p['ms']:.1f} | "
                lines = [ln for ln in block.splitlines() if ln.startswith(row) and cell in ln]
                assert any(header["date"][:10] in ln and header["commit"] in ln for ln in lines)


def test_views_columns_come_from_their_runs():
    """A views table's other columns are the named runs' points, and the
    ratio is the first column over ours."""
    block = report.generate()
    for machine in (m for m in report.MACHINES if m.columns):
        _, ours, _, _ = report._views_points(machine.runs[0])
        beside = [report._views_points(machine.runs[i])[1] for _, i, _ in machine.columns]
        for (method, n, config, pass_), p in ours.items():
            if method != "dense":
                continue
            cells = [f"{p['ms']:.1f}"]
            cells += [f"{b[(m, n, config, pass_)]['ms']:.1f}"
                      if (m, n, config, pass_) in b else ""
                      for b, (_, _, m) in zip(beside, machine.columns, strict=True)]  # fmt: skip
            ref = beside[0].get((machine.columns[0][2], n, config, pass_))
            cells.append(f"{ref['ms'] / p['ms']:.2f}" if ref else "")
            label = "fwd+bwd" if pass_ == "fwdbwd" else "fwd"
            row = f"| {n} | {config} | {label} | " + " | ".join(cells) + " |"
            assert row in block, row


def test_results_files_are_json_lines():
    for machine in report.MACHINES:
        for run in machine.runs:
            path = report.RESULTS_DIR / run.folder / run.file
            first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
            assert first["kind"] == "run" and first["date"] and first["commit"]


def test_planner_defaults_come_from_the_named_record():
    throughput = pytest.importorskip("ring_attention.planner.throughput")
    fwd, fwdbwd = report.planner_rates()
    rates = throughput.assumed_rates("cuda", "bfloat16")
    assert rates.forward == pytest.approx(fwd, rel=0.01)
    assert rates.forward_backward == pytest.approx(fwdbwd, rel=0.01)
    assert report.PLANNER_RECORD["folder"] in throughput.assumed_rates.__doc__


@pytest.mark.parametrize("index", ["benchmarks/journal/README.md", "benchmarks/RESULTS.md"])
def test_every_journal_note_is_indexed(index):
    """Both indexes of the journal list every note in it, and only notes that exist."""
    journal = ROOT / "benchmarks" / "journal"
    notes = {p.name for p in journal.glob("*.md")} - {"README.md"}
    text = (ROOT / index).read_text(encoding="utf-8")
    prefix = "" if index.endswith("README.md") else "journal/"
    linked = {name for name in notes if f"]({prefix}{name})" in text}
    assert notes - linked == set(), f"{index} does not index {sorted(notes - linked)}"
    named = set(re.findall(rf"\]\({prefix}(\d{{4}}-[^)/]+\.md)\)", text))
    assert named - notes == set(), f"{index} links notes that do not exist: {sorted(named - notes)}"

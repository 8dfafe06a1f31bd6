"""benchmarks/RESULTS.md's current tables are those the checked-in records give.

`benchmarks/report.py` builds them from `benchmarks/results/`, with the list
of what is not measured yet (from every record there) and the journal's index
(from `benchmarks/journal/README.md`); a stale block (a record added or
changed without `python benchmarks/report.py --write`) fails here. The
planner's default CUDA rates are checked against the record the report names
for them.
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
    assert report.current_block(text, report.JOURNAL_BEGIN, report.JOURNAL_END)
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


def test_the_journal_index_of_results_is_the_journals():
    """RESULTS.md's journal index is generated from journal/README.md."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    block = report.current_block(text, report.JOURNAL_BEGIN, report.JOURNAL_END)
    assert block == report.journal_index()
    readme = (ROOT / "benchmarks" / "journal" / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("| [")]
    assert len(rows) == block.count("](journal/2") > 40


def test_check_fails_on_a_stale_journal_index(tmp_path, monkeypatch):
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    stale = tmp_path / "RESULTS.md"
    row = next(line for line in text.splitlines() if line.startswith("| [2026-"))
    stale.write_text(text.replace(row + "\n", "", 1), encoding="utf-8")  # a note dropped
    monkeypatch.setattr(report, "RESULTS_MD", stale)
    assert report.main(["--check"]) == 1
    assert report.main(["--write"]) == 0
    assert stale.read_text(encoding="utf-8") == text


def test_what_is_not_measured_is_generated():
    """The list of what is not measured yet sits in the generated block (no
    hand-written list beside it) and names each entry no record measures."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    block = report.current_block(text)
    outside = text.replace(block, "")
    assert not re.search(r"not measured( yet)?\s*:|#+ not measured", outside, re.I)
    listed = block.split("### Not measured yet", 1)[1]
    for w in report.WANTED:
        assert (w.what in listed) == (w in report.not_measured()), w.what


GPU = {"kind": "run", "cuda": "13.0", "date": "2027-01-01T00:00:00+00:00"}
H100 = {**GPU, "device_name": "NVIDIA H100 80GB HBM3 (cc 9.0, 79 GiB)"}
H200 = {**GPU, "device_name": "NVIDIA H200 (cc 9.0, 140 GiB)"}
VIEWS = {"stage": "bench", "n": 131072, "config": "16x128", "pass": "fwd", "ms": 1.0}
MEASURES = {  # a start of each entry's text: the files of a run that measures it
    "the per-branch dense path": {"views.jsonl": [H100, {**VIEWS, "method": "dense"}]},
    "causal LongNet points": {
        "views.jsonl": [H200, {**VIEWS, "method": "dense", "causal": True, "status": "ok"}]
    },
    "gather + SDPA, gather + flash-attn-4 and FlexAttention": {
        "views.jsonl": [H200, {**VIEWS, "method": "flex", "status": "ok"}]
    },
    "the ring's dense blocks": {
        "ring_dense_rank0.jsonl": [
            {
                "stage": "time",
                "method": "ring_dense",
                "pass": "fwd",
                "median_s": 0.1,
                "device": "cuda:0",
                "gpu": "NVIDIA H200",
            }
        ]
    },
    "the ring's dilated blocks": {
        "ring_dense_rank0.jsonl": [
            {
                "stage": "dilated",
                "method": "dense",
                "pass": "fwd",
                "ms": 1.0,
                "ratio": 0.5,
                "device": "cuda:0",
                "gpu": "NVIDIA H100 80GB HBM3",
            }
        ]
    },
    "the ring across several GPUs": {
        "ring_run.json": [
            {
                "world": 4,
                "device": "cuda",
                "env": {"device_name": H200["device_name"]},
                "ranks": [{"rank": r, "fwd_ms": 1.0} for r in range(4)],
            }
        ]
    },
    "our CUDA backward kernel": {
        "local.jsonl": [
            H100,
            {
                "method": "ours",
                "pass": "fwdbwd",
                "ms": 1.0,
                "status": "ok",
                "paths": {"forward": "dense", "backward": "kernel"},
            },
        ]
    },
    "a GPU other than compute capability 9.0": {
        "local.jsonl": [
            {**GPU, "device_name": "NVIDIA A100-SXM4-80GB (cc 8.0, 79 GiB)"},
            {"method": "ours", "pass": "fwd", "ms": 1.0, "status": "ok"},
        ]
    },
}


def test_every_entry_has_a_run_that_measures_it():
    assert sorted(MEASURES) == sorted(
        next(k for k in MEASURES if w.what.startswith(k)) for w in report.WANTED
    )


@pytest.mark.parametrize("start", sorted(MEASURES))
def test_a_run_takes_its_entry_off_the_list(start, tmp_path):
    """With the files of a run that measures an entry, that entry, and only
    it, leaves the list; without them every entry is listed."""
    assert report.not_measured(tmp_path) == list(report.WANTED)
    for name, recs in MEASURES[start].items():
        path = tmp_path / "gpu_run" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    left = report.not_measured(tmp_path)
    assert [w.what for w in report.WANTED if w not in left] == [
        w.what for w in report.WANTED if w.what.startswith(start)
    ]


def test_a_failed_or_old_run_measures_nothing(tmp_path):
    """Failed points, and our CUDA backward before the 1 GiB chunks, measure nothing."""
    failed = {**VIEWS, "method": "dense", "status": "error: oom"}
    old = {"method": "ours", "pass": "fwdbwd", "ms": 1.0, "paths": {"backward": "kernel"}}
    for folder, recs in {
        "a": [H100, failed],
        "b": [{**H100, "date": "2026-11-26T16:50:32+00:00"}, old],
    }.items():
        (tmp_path / folder).mkdir()
        name = "views.jsonl" if folder == "a" else "local.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in recs)
        (tmp_path / folder / name).write_text(text, encoding="utf-8")
    assert report.not_measured(tmp_path) == list(report.WANTED)

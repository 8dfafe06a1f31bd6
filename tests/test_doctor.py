"""``python -m ring_attention.doctor`` on real gloo ranks: a clean step passes on 2 ranks (a tiny
Llama) and on 3 (a tiny gpt-oss from a config directory: sinks, a sliding and a full layer, run
as the command); each fault its ``--inject`` hook plants (a label shifted at the shard edge, the
document boundaries dropped, the positions restarted at the edges, a loss scaled by each rank's
own tokens) is caught by the check that names its cause, the checks before it passing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ring_attention import doctor

FAULTS = ("labels", "documents", "positions", "loss")
#: the verdict of each fault: the first failing check (where) and its likely cause
CAUGHT = {
    "labels": ("MISMATCH in labels (shard 0, token 19)", "labels shifted at shard edge"),
    "documents": (
        "MISMATCH in documents (shard 0; first failing layer 0)",
        "document boundary dropped",
    ),
    "positions": (
        "MISMATCH in positions (shard 0, token 11)",
        "position ids restart at shard edge",
    ),
    "loss": ("MISMATCH in loss (", "loss not scaled by tokens across ranks"),
}


@pytest.fixture(scope="module")
def reports() -> dict:
    """The clean step and each fault on 2 ranks, in one launch."""
    out = doctor.diagnose("llama", 2, "ring", faults=(None, *FAULTS))
    return dict(zip((None, *FAULTS), out, strict=True))


def _fits(lines: list[str]) -> None:
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)


def test_a_clean_step_passes_every_check(reports: dict) -> None:
    status, lines = reports[None]
    _fits(lines)
    assert status == 0, "\n".join(lines)
    assert lines[-1] == "doctor: OK, 2 ranks equal one process"
    assert sum(line.endswith(" ok") for line in lines) == 2 + 2 + 3  # ranks, layers, parities
    assert "MISMATCH" not in "\n".join(lines)
    assert "bytes each rank sends (attention, forward and backward): " in "\n".join(lines)


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_caught_and_named(reports: dict, fault: str) -> None:
    status, lines = reports[fault]
    _fits(lines)
    text = "\n".join(lines)
    where, cause = CAUGHT[fault]
    assert status == 1, text
    assert lines[-2].startswith(f"doctor: {where}"), text
    assert lines[-1].startswith(f"likely cause: {cause}"), text


def test_three_ranks_of_a_config_directory_from_the_command_line(tmp_path) -> None:
    """gpt-oss (sinks, sliding and full layers) saved as a config directory, 3 ranks."""
    import transformers as tr

    config = tr.AutoConfig.for_model("gpt_oss", **doctor.TINY, **doctor.EXTRA["gpt_oss"])
    config.save_pretrained(tmp_path)
    cmd = [sys.executable, "-m", "ring_attention.doctor", "--model", str(tmp_path), "--world", "3"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    _fits(lines)
    assert "window 8" in run.stdout and "full" in run.stdout
    assert lines[-1] == "doctor: OK, 3 ranks equal one process"


def test_arguments_it_cannot_run_exit_2(capsys) -> None:
    assert doctor.main(["--mode", "hybrid", "--world", "2"]) == 2
    assert "mode='hybrid' takes world=4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="faults must be None or in"):
        doctor.diagnose(faults=("labelz",))

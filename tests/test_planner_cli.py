"""The planner's command line (and info's): ``--help`` names one default per
option (every default there is); the fewest-ranks search shows its progress
on stderr to a terminal (to a pipe only once it runs long, never with
``--quiet``); bad options are refused naming them; searches stay bounded."""

from __future__ import annotations

import argparse
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import with_path

from ring_attention import info
from ring_attention.planner import cli
from ring_attention.planner.cli import main
from ring_attention.planner.cli_args import build_parser

ROOT = Path(__file__).resolve().parent.parent
SEARCH = ["--seq-len", "300000", "--gpu-memory", "1GB", "--heads", "4", "--head-dim", "64"]


def option_blocks(text: str) -> dict[str, str]:
    """``--option`` -> its lines of ``--help``."""
    blocks: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if m := re.match(r"  (-\w, )?(--[\w-]+)", line):
            name = m.group(2)
            blocks[name] = line
        elif name and line.startswith(" " * 6):
            blocks[name] += " " + line.strip()
        else:
            name = None
    return blocks


def test_help_names_one_default_per_option() -> None:
    parser = build_parser()
    blocks = option_blocks(parser.format_help())
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(blocks) == len(options) + 1 > 40  # + --help
    for action in options:
        text = blocks[action.option_strings[-1]]
        assert len(re.findall(r"\bdefault", text)) <= 1, text
        if action.default not in (None, argparse.SUPPRESS):
            assert "default" in text, text
    assert "(default: 1)" in blocks["--batch"] and "(default: off)" in blocks["--causal"]
    assert "(default: longnet)" in blocks["--pattern"]
    assert blocks["--gpu-memory"].count("80GB") == 1 and "None" not in parser.format_help()


def run(args: list[str], tty: bool) -> tuple[int, str, str]:
    """The planner's exit status, stdout and stderr (a terminal when ``tty``)."""
    env = with_path(ROOT)
    cmd = [sys.executable, "-m", "ring_attention.planner", *args]
    if not tty:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        return proc.returncode, proc.stdout, proc.stderr
    main, side = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=side, text=True, env=env)
    os.close(side)
    err = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    os.close(main)
    out = proc.stdout.read()
    return proc.wait(timeout=300), out, err.decode()


def test_fewest_ranks_search_shows_progress_on_a_terminal_only() -> None:
    rc, out, err = run(SEARCH, tty=True)
    assert rc == 0 and "Fewest ranks for 300,000 tokens" in out, out + err
    steps = re.findall(r"\rplanner: fewest ranks for 300,000 tokens: (\d+) tried", err)
    assert len(steps) >= 3 and steps == [str(i) for i in range(1, len(steps) + 1)], err
    assert err.endswith("\r\x1b[K"), repr(err[-80:])  # the line is cleared at the end
    assert "fits on" in err and "not on" in err, err
    rc, out2, err = run([*SEARCH, "--quiet"], tty=True)
    assert rc == 0 and err == "" and out2 == out
    rc, out3, err = run(SEARCH, tty=False)
    assert rc == 0 and err == "" and out3 == out


# --------------------------------------------------------------------------- #
# Bad options: refused once, at the top, naming the option (issue 46, item 10)
# --------------------------------------------------------------------------- #

BASE = ["--gpus", "4", "--seq-len", "64K", "--heads", "4", "--head-dim", "64"]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--gpus", "4", "--heads", "0"], "--heads"),  # was: 16 heads planned
        (["--gpus", "4", "--head-dim", "0"], "--head-dim"),  # was: 128
        (["--gpus", "4", "--kv-heads", "0"], "--kv-heads"),  # was: --heads
        (["--gpus", "4", "--gpu-memory", "0"], "--gpu-memory"),  # was: 80GB
        ([*BASE, "--link-gbps", "0"], "--link-gbps"),  # was: 400
        ([*BASE, "--ffn", "0", "--layers", "2", "--hidden", "256"], "--ffn"),  # was: 4 x hidden
        (["--gpus", "4", "--seq-len", "0"], "--seq-len"),  # was: ZeroDivisionError
        (["--gpus", "0"], "--gpus"),
        (["--processes", "-2", "--device", "cpu"], "--processes"),
        ([*BASE, "--batch", "-1"], "--batch"),
        ([*BASE, "--link-gbps", "nan"], "--link-gbps"),  # was: "cannot convert float NaN"
        ([*BASE, "--link-gbps", "-5"], "--link-gbps"),  # was: negative times printed
        ([*BASE, "--link-latency-us", "-1"], "--link-latency-us"),
        ([*BASE, "--message-us", "inf"], "--message-us"),
        ([*BASE, "--tflops", "nan"], "--tflops"),
        ([*BASE, "--tflops", "100,-1"], "--tflops"),
        ([*BASE, "--matmul-tflops", "-inf"], "--matmul-tflops"),
        ([*BASE, "--reserve", "nan%"], "--reserve"),
        ([*BASE, "--reserve", "100%"], "--reserve"),  # leaves nothing
        ([*BASE, "--gpu-memory", "1e400"], "--gpu-memory"),  # was: OverflowError
        ([*BASE, "--document-length", "0"], "--document-length"),  # was: no documents
        ([*BASE, "--segments", "0", "--dilations", "1"], "--segments"),
        ([*BASE, "--dilations", "1"], "--dilations"),
        ([*BASE, "--dtype", "int8"], "--dtype"),
        ([*BASE, "--bench-json", "/nonexistent.json"], "--bench-json"),  # was: a traceback
        (["--gpus", "4", "--model", "llama2-7b", "--vocab", "5"], "--vocab"),  # was: ignored
        ([*BASE, "--mode", "compare", "--intra-gbps", "nan"], "--intra-gbps"),  # was: "nan ms"
        ([*BASE, "--mode", "hybrid", "--gpus-per-node", "0"], "--gpus-per-node"),
        ([*BASE, "--mode", "hybrid", "--ulysses", "-4"], "--ulysses"),
    ],
)  # fmt: skip
def test_planner_refuses_bad_options_naming_them(capsys, argv, option) -> None:
    """Zero and negative sizes, NaN, infinite and negative rates: argparse's
    error naming the option and what it expects, exit 2, nothing planned
    (before: 0 became the default, NaN printed "nan ms", 0 tokens raised
    ZeroDivisionError)."""
    assert main(argv) == 2
    done = capsys.readouterr()
    assert done.out == "", done.out
    error = done.err.strip().splitlines()[-1]
    assert error.startswith(f"python -m ring_attention.planner: error: argument {option}"), error


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--seq-len", "4096", "--heads", "0"], "--heads"),  # was: ZeroDivisionError
        (["--seq-len", "0"], "--seq-len"),  # was: a route printed
        (["--seq-len", "-4096"], "--seq-len"),
        (["--seq-len", "4096", "--head-dim", "0"], "--head-dim"),
        (["--seq-len", "4096", "--head-dim", "-64"], "--head-dim"),
        (["--seq-len", "4096", "--kv-heads", "0"], "--kv-heads"),  # was: --heads
        (["--seq-len", "4096", "--kv-heads", "3"], "--kv-heads"),
        (["--seq-len", "4096", "--segments", "0", "--dilations", "1"], "--segments"),
        (["--seq-len", "4096", "--segments", "8", "--dilations", "9"], "--segments/--dilations"),
        (["--seq-len", "4096", "--cu-seqlens", "0", "5000"], "--cu-seqlens"),
        (["--seq-len", "4096", "--device", "tpu"], "--device"),  # was: a traceback
        (["--seq-len", "4096", "--device", "cuda", "--capability", "nine"], "--capability"),
    ],
)  # fmt: skip
def test_info_refuses_bad_options_naming_them(capsys, argv, option) -> None:
    assert info.main([*argv, "--device", "cpu"] if "--device" not in argv else argv) == 2
    done = capsys.readouterr()
    assert done.out == "", done.out
    error = done.err.strip().splitlines()[-1]
    assert error.startswith(f"python -m ring_attention.info: error: argument {option}"), error


def test_valid_options_still_answer(capsys) -> None:
    """The bounds refuse nothing a plan needs: the extremes that are valid answer."""
    assert main([*BASE, "--reserve", "0%", "--link-latency-us", "0", "--message-us", "0",
                 "--vocab", "0", "--threads", "4096", "--tflops", "1e-6,1e9"]) == 0  # fmt: skip
    assert "Does 64,000 fit on 4 ranks?" in capsys.readouterr().out
    assert info.main(["--seq-len", "1", "--heads", "1", "--head-dim", "1", "--device", "cpu"]) == 0
    assert "local op, n = 1, 1 query / 1 K/V heads, head_dim 1" in capsys.readouterr().out


# --------------------------------------------------------------------------- #
# Runaway searches: bounded, with an answer or a reason (issue 46, item 11)
# --------------------------------------------------------------------------- #

_CAPPED = """
import resource, sys, time
import torch
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, hard))
from ring_attention.planner.cli import main
start = time.monotonic()
code = main(sys.argv[1:])
print(f"exit {code} after {time.monotonic() - start:.1f} s")
"""


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--seq-len", "1e12", "--gpu-memory", "80GB"],
         "need more than 4,096 ranks .* at least 798,223 ranks would be needed"),
        (["--seq-len", "2e10", "--gpu-memory", "80GB"],
         "need more than 4,096 ranks .* at least 15,965 ranks would be needed"),
        (["--seq-len", "1e9", "--gpu-memory", "1KB"],
         "57.47 kB with one token per rank: no number of ranks holds them"),
        (["--seq-len", "1e15", "--gpu-memory", "80GB", "--model", "llama3-8b"],
         "need more than 4,096 ranks .*the model"),
        (["--gpus", "8", "--seq-len", "4e18"], "tokens do not fit on 8 ranks: their inputs"),
    ],
)  # fmt: skip
def test_runaway_searches_answer_within_bounds(argv, reason) -> None:
    """Under an address-space cap of 1 GiB above what torch takes and a
    wall-clock bound, the planner refuses what needs more ranks than it
    models, from the closed-form floor of the peak per rank, at once (before:
    ``1e12`` tokens allocated a 137 GB table of rank pairs, ``2e10`` gave no
    answer in 300 s)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CAPPED, *argv, "--quiet"],
        capture_output=True, text=True, timeout=120, env=with_path(ROOT),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert out[-1].startswith("exit 2 after"), proc.stdout
    assert out[-2].startswith("Not possible: ") and re.search(reason, out[-2]), out[-2]


def test_searches_stop_at_the_time_limit(capsys, monkeypatch) -> None:
    """``--time-limit``: a search stops after the evaluation under way and
    says what it found; its progress goes to a stderr that is not a terminal
    as lines once it has run ``_QUIET_SECONDS``."""
    monkeypatch.setattr(cli, "_QUIET_SECONDS", 0.0)
    assert main([*SEARCH, "--time-limit", "1e-6"]) == 2
    done = capsys.readouterr()
    assert "Not possible: the search for the fewest ranks for 300,000 tokens stopped after" in (
        done.out)  # fmt: skip
    assert "(--time-limit 1e-06): 1 tried (1 last), no fit yet, not on 1 ranks" in done.out
    assert done.err.startswith("planner: fewest ranks for 300,000 tokens: 1 tried"), done.err
    longest = ["--gpus", "4", "--gpu-memory", "1GB", "--heads", "4", "--head-dim", "64"]
    assert main([*longest, "--time-limit", "1e-6"]) == 2
    done = capsys.readouterr()
    assert "the search for the longest sequence on 4 ranks (inference) stopped" in done.out
    assert main([*longest, "--quiet"]) == 0
    done = capsys.readouterr()
    assert "Longest sequence that fits" in done.out and done.err == ""

"""The planner's command line: ``--help`` names one default per option (every
default there is), and the fewest-ranks search shows its progress on stderr
to a terminal only (not to a pipe, not with ``--quiet``)."""

from __future__ import annotations

import argparse
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

from child_env import with_path

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

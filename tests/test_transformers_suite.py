"""The harness that runs transformers' own model tests with "ring_dilated" as
the default attention (scripts/transformers_tests.py and the pytest plugin
tests/transformers_suite/ring_dilated_default.py). transformers' test files
are not here (see the script's docstring); these tests check the plugin and
the harness on a stand-in source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
import transformers
from test_hf import VOCAB, build, tiny_config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers_suite import ring_dilated_default

from ring_attention import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plugin_routes_sdpa_to_ring_dilated(monkeypatch) -> None:
    cfg = tiny_config(kv_heads=2)
    sdpa = build(cfg, "sdpa")
    ids = torch.randint(1, VOCAB, (2, 13), generator=torch.Generator().manual_seed(41))
    with torch.no_grad():
        want = sdpa(ids).logits
    calls = []
    attend = hf.attention.attend
    monkeypatch.setattr(hf.attention, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ring_dilated_default.install()
    try:
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is hf.dilated_attention_forward
        model = build(cfg, "sdpa", state=sdpa.state_dict())  # the name stays "sdpa"
        with torch.no_grad():
            got = model(ids).logits
    finally:
        ring_dilated_default.uninstall()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    assert len(calls) == cfg.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


STAND_IN_TESTS = """
import torch
from transformers import AutoModelForCausalLM, MistralConfig


def config(**extra):
    return MistralConfig(vocab_size=17, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         **extra)


def test_dense():
    model = AutoModelForCausalLM.from_config(config(sliding_window=None))
    model(torch.randint(0, 17, (1, 9)))


def test_sliding_window_dropout():
    model = AutoModelForCausalLM.from_config(config(sliding_window=4, attention_dropout=0.5))
    model.train()
    model(torch.randint(0, 17, (1, 9)))
"""


def test_harness_reports_what_regresses(tmp_path) -> None:
    """A stand-in source tree (the installed version, one test file): the
    test of attention dropout on a sliding layer in training passes with sdpa
    and fails with ring_dilated (which refuses it rather than drop the
    window)."""
    init = tmp_path / "src" / "transformers" / "__init__.py"
    init.parent.mkdir(parents=True)
    init.write_text(f'__version__ = "{transformers.__version__}"\n')
    test_file = tmp_path / "tests" / "models" / "mistral" / "test_modeling_mistral.py"
    test_file.parent.mkdir(parents=True)
    test_file.write_text(textwrap.dedent(STAND_IN_TESTS))
    script = os.path.join(ROOT, "scripts", "transformers_tests.py")
    cmd = [sys.executable, script, "--source", str(tmp_path), "--models", "mistral"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "passed: sdpa 2, ring_dilated 1 of 2" in res.stdout, res.stdout
    assert "sdpa: 2 passed, 0 failed, 0 skipped" in res.stdout, res.stdout
    assert "ring_dilated: 1 passed, 1 failed, 0 skipped" in res.stdout, res.stdout
    assert "REGRESSED: tests.models.mistral.test_modeling_mistral::test_sliding_window_dropout" in (
        res.stdout
    ), res.stdout
    allow = ["--allow", "test_sliding_window_dropout=no dropout on sliding layers"]
    res = subprocess.run(cmd + allow, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "expected: " in res.stdout and "(no dropout on sliding" in res.stdout, res.stdout
    # the version must match the installed release
    init.write_text('__version__ = "0.0.1"\n')
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2 and f"tag v{transformers.__version__}" in res.stderr, res.stderr

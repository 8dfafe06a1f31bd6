"""The harness that runs transformers' own model tests with "ring_dilated" as
the default attention (scripts/transformers_tests.py and the pytest plugin
tests/transformers_suite/ring_dilated_default.py). transformers' test files
are not here (see the script's docstring); these tests check the plugin and
the harness on a stand-in source tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
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
    attend = hf.attention.engine.attend
    monkeypatch.setattr(
        hf.attention.engine, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k)
    )
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ring_dilated_default.attention("eager") == "eager"
    ring_dilated_default.install()
    try:
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is hf.dilated_attention_forward
        # a model without "sdpa" (gpt-oss) names its attention in its tester's config
        assert ring_dilated_default.attention("eager") == "ring_dilated"
        model = build(cfg, "sdpa", state=sdpa.state_dict())  # the name stays "sdpa"
        with torch.no_grad():
            got = model(ids).logits
    finally:
        ring_dilated_default.uninstall()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
    assert ALL_ATTENTION_FUNCTIONS["ring_dilated"] is hf.dilated_attention_forward
    assert ring_dilated_default.attention("eager") == "eager"
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
    assert "reference (the 1 that did not pass): 1 passed, 0 failed, 0 skipped" in res.stdout
    assert "ring_dilated: 1 passed, 1 failed, 0 skipped" in res.stdout, res.stdout
    assert "REGRESSED: tests.models.mistral.test_modeling_mistral::test_sliding_window_dropout" in (
        res.stdout
    ), res.stdout
    allow = ["--allow", "mistral::test_sliding_*_dropout=no dropout on sliding layers"]
    res = subprocess.run(cmd + allow, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "expected: " in res.stdout and "(no dropout on sliding" in res.stdout, res.stdout
    # the version must match the installed release
    init.write_text('__version__ = "0.0.1"\n')
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2 and f"tag v{transformers.__version__}" in res.stderr, res.stderr


STAND_IN_COMMON = """
import torch

from .generation.test_utils import GenerationTesterMixin  # the harness's stand-ins
from .exporters.test_export import ExportTesterMixin


def ids_tensor(shape, vocab_size):
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(5))


def random_attention_mask(shape):
    mask = ids_tensor(shape, 2)
    mask[:, 0] = 1
    return mask


class ModelTesterMixin(ExportTesterMixin):
    def test_forward(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for cls in self.all_model_classes[:2]:
            cls(config).eval()(**inputs)

    def test_attention_dropout_in_training(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.attention_dropout = 0.5
        if config.model_type == "mistral":
            config.sliding_window = 3
        self.all_model_classes[0](config).train()(**inputs)
"""


def test_sdist_harness_judges_the_project_testers(tmp_path) -> None:
    """``--sdist`` on a stand-in of the release's sdist: the tree gets the
    stand-in mixins and the project's testers, the ``-k`` of ``--models``,
    the count of attention calls, and a test that passes with sdpa and not
    with ring_dilated (Mistral's dropout on a sliding layer) is reported."""
    top = f"transformers-{transformers.__version__}"
    (tmp_path / top / "tests").mkdir(parents=True)
    (tmp_path / top / "tests" / "test_modeling_common.py").write_text(STAND_IN_COMMON)
    tarball = tmp_path / f"{top}.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tmp_path / top, arcname=top)
    script = os.path.join(ROOT, "scripts", "transformers_tests.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, script, "--sdist", str(tarball), "--models", "mistral,llama"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    served = re.search(r"ring_dilated served (\d+) attention calls", res.stdout)
    assert served and int(served.group(1)) > 0, res.stdout
    assert "reference (the 1 that did not pass): 1 passed, 0 failed, 0 skipped" in res.stdout
    assert "ring_dilated: 3 passed, 1 failed, 0 skipped" in res.stdout, res.stdout
    assert "REGRESSED: tests.ring_dilated.test_common_models.MistralCommonTest::" in res.stdout
    res = subprocess.run(cmd[:-1] + ["qwen3"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "--models with --sdist" in res.stderr, res.stderr

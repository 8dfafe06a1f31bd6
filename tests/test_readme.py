"""The README's single-process usage example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_usage_example_runs() -> None:
    blocks = python_blocks()
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    out, lse = namespace["out"], namespace["lse"]
    assert out.shape == (2, 1000, 6, 32)
    assert lse.shape == (2, 6, 1000)
    assert namespace["q"].grad is not None


def test_readme_ring_example_runs_under_torchrun(tmp_path) -> None:
    """The README's ring example, launched as it says (torchrun, gloo), runs
    as written and prints its check once: a max error that is small."""
    import os
    import subprocess
    import sys

    blocks = python_blocks()
    assert len(blocks) >= 2, "README has no ring example"
    script = tmp_path / "ring_example.py"
    script.write_text(blocks[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = re.findall(r"max \|ring - one process\| = (\S+)", proc.stdout)
    assert len(found) == 1, proc.stdout
    assert float(found[0]) < 1e-5, proc.stdout


def test_readme_llm_features_example_runs() -> None:
    """The README's grouped-K/V, packed-documents and lse example runs as
    written (after the first block, which imports torch and ring_attention)."""
    blocks = python_blocks()
    (block,) = [b for b in blocks if "cu_seqlens = torch.tensor" in b]
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"].shape == (1, 4096, 32, 64)
    assert namespace["lse"].shape == (1, 32, 4096)
    assert namespace["k"].grad.shape == (1, 4096, 8, 64)

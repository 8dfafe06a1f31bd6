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

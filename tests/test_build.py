"""The build's defaults (setup.py)."""

from __future__ import annotations

import ast
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_function(name: str):
    """One function of setup.py, without running setup() (setup.py calls it at import)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch}
    exec(compile(ast.Module([fn], []), "setup.py", "exec"), namespace)
    return namespace[name]


def test_cuda_arch_list_without_a_visible_gpu_covers_ampere_and_hopper(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    archs = _setup_function("_default_arch_list")().split(";")
    assert archs == ["8.0", "9.0+PTX"]


def test_cuda_arch_list_with_a_gpu_is_its_architecture(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 6))
    assert _setup_function("_default_arch_list")() == "8.6"

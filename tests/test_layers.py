"""The package's layers (docs/design.md §8): a module imports only from its
own layer and the layers below, nothing imports back (no cycle), imports
inside functions are only the few listed below with their reason, and the
import graph stays as shallow as it is. Read from the source (ast), no import
executed."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ring_attention"
PKG = "ring_attention"

#: layer -> the layers it may import (besides its own)
ALLOWED = {
    "core": set(),
    "planner": {"core"},
    "local": {"core"},
    "parallel": {"core", "local", "planner"},
    "nn": {"core", "local", "parallel"},
    "hf": {"core", "local", "parallel", "nn"},
}
#: root modules -> the layers they may import
ROOT_MODULES = {
    PKG: set(ALLOWED),  # the package's __init__: the public names
    f"{PKG}.info": {"core", "local", "planner"},
    f"{PKG}.doctor": {"core", "parallel", "hf"},  # python -m ring_attention.doctor
}
#: imports across the rules above: (importing module, imported module) -> why
ACROSS: dict[tuple[str, str], str] = {}  # none
#: imports inside functions: (importing module, imported module) -> why
LAZY = {
    (PKG, f"{PKG}.hf.attention"): "register_transformers on first use: hf imports torch._dynamo",
    (f"{PKG}.hf", f"{PKG}.hf.trainer"): "SequenceParallelTrainer imports transformers",
    (f"{PKG}.hf", f"{PKG}.hf.sharded_cache"): "ShardedCache imports transformers",
    (f"{PKG}.parallel.ulysses", f"{PKG}.parallel.ulysses_eager"): "torch.compiler.disable imports "
    "torch._dynamo: only while compiling",
}
#: the longest chain of imports (modules, the package's __init__ included)
MAX_LEVELS = 7


@cache
def modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _targets(cur: str, node: ast.AST) -> set[str]:
    mods = modules()
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = cur.split(".")
            pkg = parts if mods[cur].name == "__init__.py" else parts[:-1]
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    found = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != cur and name != PKG:
            found.add(name)
    return found


@cache
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(imports at module level, imports inside functions) per module."""
    top: dict[str, set[str]] = {}
    lazy: dict[str, set[str]] = {}
    for mod, path in modules().items():
        tree = ast.parse(path.read_text())
        top[mod], lazy[mod] = set(), set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                top[mod] |= _targets(mod, node)
            elif isinstance(node, (ast.If, ast.Try)):  # try: import _C / TYPE_CHECKING
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        top[mod] |= _targets(mod, sub)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                lazy[mod] |= _targets(mod, node) - top[mod]
    return top, lazy


def _layer(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_import_goes_down_the_layers() -> None:
    top, lazy = graph()
    wrong = []
    for mod in modules():
        layer = _layer(mod)
        allowed = ROOT_MODULES.get(mod) if layer is None else ALLOWED[layer] | {layer}
        if allowed is None:
            wrong.append(f"{mod}: a root module not in ROOT_MODULES")
            continue
        for target in top[mod] | lazy[mod]:
            if (mod, target) in LAZY or (mod, target) in ACROSS:
                continue
            t_layer = _layer(target)
            if t_layer is None and target not in ROOT_MODULES:
                continue
            if t_layer is not None and t_layer not in allowed:
                wrong.append(f"{mod} imports {target}")
            elif t_layer is None and mod != PKG:
                wrong.append(f"{mod} imports the root module {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_inside_a_function_but_the_listed_ones() -> None:
    _, lazy = graph()
    found = {(mod, t) for mod, targets in lazy.items() for t in targets}
    assert found <= set(LAZY), sorted(found - set(LAZY))
    assert set(LAZY) <= found, f"listed but gone: {sorted(set(LAZY) - found)}"


def test_no_cycle_and_the_graph_is_shallow() -> None:
    top, lazy = graph()
    edges = {m: top[m] | lazy[m] for m in modules()}
    levels: dict[str, int] = {}

    def level(mod: str, path: tuple[str, ...]) -> int:
        assert mod not in path, "import cycle: " + " -> ".join((*path, mod))
        if mod not in levels:
            levels[mod] = 1 + max((level(t, (*path, mod)) for t in edges[mod]), default=0)
        return levels[mod]

    deepest = max(modules(), key=lambda m: level(m, ()))
    assert levels[deepest] <= MAX_LEVELS, (deepest, levels[deepest])


def test_only_local_calls_the_operators_and_defines_attention_autograd() -> None:
    callers, autograd = set(), set()
    for mod, path in modules().items():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "ring_attention"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "ops"
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "torch"
            ):
                callers.add(mod)
        if "autograd.Function)" in text or "register_autograd(" in text:
            autograd.add(mod)
    assert callers == {f"{PKG}.local.ops"}, callers
    communication = {f"{PKG}.parallel.ulysses", f"{PKG}.parallel.sharding"}
    assert autograd - communication == {f"{PKG}.local.ops"}, autograd

"""The package's import graph: no circle (lazy imports included), ``config.py`` at the bottom, and
a function-local import only where it keeps a heavy dependency off a path that does not need it.

The rule: a function may import a module lazily only if importing it at the top would load a
heavy package (``HEAVY``: torch, transformers, safetensors, numpy; or an optional extra,
``OPTIONAL``: Ray, vLLM, peft, datasets, math-verify, the trackers, matplotlib, the GGUF reader,
reasoning-gym, rich) that the importing module does not load already. That keeps ``mutualrl --help``,
argument and config errors, ``mutualrl plan`` and the exchange free of torch, and every extra
optional. Anything else (the standard library, a light internal module, a module whose heavy
packages the importer loads anyway) is imported at the top.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mutualrl"

OPTIONAL = {"ray", "vllm", "peft", "datasets", "math_verify", "matplotlib", "wandb", "trackio", "tensorboard",
            "gguf", "pyarrow", "msgpack", "reasoning_gym", "rich", "accelerate", "tiktoken", "psutil"}
"""Extras, or packages used on one path only."""
HEAVY = {"torch", "transformers", "safetensors", "numpy"}
"""Core dependencies that cost a second or more to import."""


@functools.cache
def _modules() -> dict[str, ast.Module]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join(parts)] = ast.parse(f.read_text(encoding="utf-8"))
    return out


def _imports(tree: ast.Module, name: str, is_pkg: bool) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function, line) for every import outside ``if TYPE_CHECKING``."""
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for n in ast.walk(node))
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in local, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ("mutualrl." + name).split(".")
                base = base if is_pkg else base[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, id(node) in local, node.lineno))
            if mod == "mutualrl" or (mod.startswith("mutualrl.") and not node.module):
                out += [(f"{mod}.{a.name}", id(node) in local, node.lineno) for a in node.names]
    return out


def _internal(mod: str, known: set[str]) -> str | None:
    if mod != "mutualrl" and not mod.startswith("mutualrl."):
        return None
    name = mod.removeprefix("mutualrl").removeprefix(".")
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name if name in known else None


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, bool, int]]]:
    mods = _modules()
    pkgs = {n for n in mods if (PACKAGE / n.replace(".", "/") / "__init__.py").is_file() or n == ""}
    edges: dict[str, set[str]] = {n: set() for n in mods}
    every = []
    for name, tree in mods.items():
        for mod, lazy, line in _imports(tree, name, name in pkgs):
            every.append((name, mod, lazy, line))
            target = _internal(mod, set(mods))
            if target is not None and target != name and not name.startswith(target + ".") and target != "":
                edges[name].add(target)
    return edges, every


def test_no_import_circle_lazy_imports_included():
    edges, _ = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)


def test_config_imports_nothing_above_it():
    edges, _ = _graph()
    assert edges["config"] <= {"errors", "config.schema", "config.legacy", "config.task"}, edges["config"]
    assert edges["config.task"] <= {"errors", "config.schema"}, edges["config.task"]  # the task section, below config
    assert edges["config.legacy"] <= {"errors"}, edges["config.legacy"]  # the deprecated names' move, below config too


def _heavy_closure() -> dict[str, set[str]]:
    """Per module: the heavy and optional packages importing it loads (module-level imports, transitively)."""
    mods = _modules()
    pkgs = {n for n in mods if (PACKAGE / n.replace(".", "/") / "__init__.py").is_file()}
    direct: dict[str, set[str]] = {}
    deps: dict[str, set[str]] = {}
    for name, tree in mods.items():
        direct[name], deps[name] = set(), set()
        for mod, lazy, _ in _imports(tree, name, name in pkgs):
            if lazy:
                continue
            top = mod.split(".")[0]
            if top in HEAVY or top in OPTIONAL:
                direct[name].add(top)
            target = _internal(mod, set(mods))
            if target is not None and target != name:
                deps[name].add(target)
        parent = name.rpartition(".")[0] if "." in name else ""
        if name and parent in mods:  # importing a.b runs a/__init__ first
            deps[name].add(parent)
    closure = {n: set(direct[n]) for n in mods}
    changed = True
    while changed:  # a fixpoint: package __init__ files and their submodules reach each other
        changed = False
        for n in mods:
            grown = closure[n].union(*(closure[d] for d in deps[n]))
            if grown != closure[n]:
                closure[n], changed = grown, True
    return closure


def test_function_local_imports_only_where_they_keep_a_heavy_dependency_away():
    _, every = _graph()
    closure = _heavy_closure()
    known = set(closure)
    bad = []
    for name, mod, lazy, line in every:
        if not lazy:
            continue
        top = mod.split(".")[0]
        if top in HEAVY or top in OPTIONAL:
            loads = {top}
        else:
            target = _internal(mod, known)
            loads = closure[target] if target is not None else set()
        if loads - closure[name]:
            continue  # it keeps a heavy package away from this module's importers
        bad.append(f"mutualrl/{name.replace('.', '/')}.py:{line} imports {mod} inside a function "
                   f"(it loads nothing heavy that the module does not: import it at the top)")
    assert not bad, "\n".join(bad)


def test_the_modules_of_release_0_1_still_import_under_their_old_names_with_a_warning():
    """A user's ``from mutualrl.trainer import MutualTrainer`` keeps working until release 0.3.0: the
    same module object as the new name (one class, not a copy), with a FutureWarning naming the
    new place."""
    import importlib
    import sys
    import warnings

    import mutualrl

    assert set(mutualrl.MOVED) and all((PACKAGE / new.replace(".", "/")).with_suffix(".py").is_file()
                                       or (PACKAGE / new.replace(".", "/")).is_dir() for new in mutualrl.MOVED.values())
    for old, new in (("resolve", "config.resolve"), ("engines.head", "rollout.engines.head")):
        sys.modules.pop(f"mutualrl.{old}", None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            moved = importlib.import_module(f"mutualrl.{old}")
        assert moved is importlib.import_module(f"mutualrl.{new}")
        assert moved.__spec__.name == f"mutualrl.{new}"
        assert any(issubclass(w.category, FutureWarning) and f"mutualrl.{new}" in str(w.message)
                   and "0.3.0" in str(w.message) for w in seen)

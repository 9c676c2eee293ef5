"""The folders show the data path: capture, config < parser < updater < control < tools.

An AST walk over every source (lazy imports inside functions included) finds each import of a
``mirrorckpt`` module; none may reach a stage above its own, the two leaves (capture, config) do
not import each other, and only tools, benchmarks and tests import the generator or the test rigs.
Inside the parser, the transport-neutral core (``parser/*``) and the gloo transport
(``parser/gloo``) never import the RoCE/NCCL room (``parser/roce``), nor the core gloo.
"""

from __future__ import annotations

import ast
import re

from common import REPO

LAYER = {"capture": 0, "config": 0, "parser": 1, "updater": 2, "control": 3, "tools": 4}
RIGS = ("tools.generator", "tools.testbed")


def _resolve(module: str, level: int, here: tuple[str, ...]) -> str:
    if not level:
        return module.removeprefix("mirrorckpt.") if module.startswith("mirrorckpt") else ""
    base = list(here[:len(here) - (level - 1)])
    return ".".join(base + ([module] if module else []))


def imports(path) -> list[tuple[int, str]]:
    """(line, module inside mirrorckpt without its prefix) for every import in ``path``."""
    rel = path.relative_to(REPO)
    here = rel.parts[:-1]
    text = path.read_text()
    if path.suffix == ".pyx":  # Cython: its Python-level imports, by pattern
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            m = re.match(r"\s*(?:from\s+(\S+)\s+c?import|c?import\s+(\S+))", line)
            if m and (m.group(1) or m.group(2) or "").startswith(("mirrorckpt", ".")):
                mod = m.group(1) or m.group(2)
                level = len(mod) - len(mod.lstrip("."))
                out.append((n, _resolve(mod.lstrip("."), level, here)))
        return out
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node.module or "", node.level, here)
            if mod and mod.split(".")[0] in LAYER:
                # `from mirrorckpt.tools import generator` names a subpackage
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names] if mod in ("tools",) else \
                    [(node.lineno, mod)]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.removeprefix("mirrorckpt."))
                    for a in node.names if a.name.startswith("mirrorckpt.")]
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(REPO.rglob("*.py*")):
        rel = path.relative_to(REPO)
        if path.suffix not in (".py", ".pyx") or rel.parts[0] not in LAYER:
            continue
        own = rel.parts[0]
        rig = ".".join(rel.parts[:2]) in RIGS
        for line, mod in imports(path):
            top = mod.split(".")[0]
            if top not in LAYER or top == own:
                continue
            if LAYER[top] > LAYER[own] or (LAYER[top] == LAYER[own] == 0):
                bad.append(f"{rel}:{line} imports {mod} (layer {top} is not below {own})")
        for line, mod in imports(path):
            if mod.startswith(RIGS) and own != "tools" and not rig:
                bad.append(f"{rel}:{line} imports the test rig or generator {mod}")
    return bad


def test_no_import_against_the_layer_order():
    assert violations() == []


def room(rel) -> str | None:
    """The parser room of a source: "core", "roce" or "gloo" (None outside the parser)."""
    if rel.parts[0] != "parser":
        return None
    return rel.parts[1] if len(rel.parts) > 2 and rel.parts[1] in ("roce", "gloo") else "core"


def room_violations() -> list[str]:
    bad = []
    for path in sorted((REPO / "parser").rglob("*.py*")):
        if path.suffix not in (".py", ".pyx"):
            continue
        rel = path.relative_to(REPO)
        own = room(rel)
        for line, mod in imports(path):
            if not mod.startswith("parser"):
                continue
            parts = mod.split(".")
            target = parts[1] if len(parts) > 1 and parts[1] in ("roce", "gloo") else "core"
            if own in ("core", "gloo") and target == "roce" or own == "core" and target == "gloo":
                bad.append(f"{rel}:{line} ({own}) imports {mod} ({target})")
    return bad


def test_the_parsers_core_and_gloo_never_import_roce():
    assert (REPO / "parser" / "roce").is_dir() and (REPO / "parser" / "gloo").is_dir()
    assert room_violations() == []


def test_the_room_check_can_fail():
    p = REPO / "parser" / "_room_probe.py"
    p.write_text("def f():\n    from mirrorckpt.parser.roce import nccl\n")
    try:
        got = room_violations()
    finally:
        p.unlink()
    assert got == ["parser/_room_probe.py:2 (core) imports parser.roce (roce)"], got


def test_the_walk_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The check itself can fail: an import inside a function and a relative import are found."""
    src = "def f():\n    from ..tools.appliance import X\n    import mirrorckpt.control.trainer\n"
    p = REPO / "parser" / "_layer_probe.py"
    p.write_text(src)
    try:
        got = violations()
    finally:
        p.unlink()
    assert any("_layer_probe.py:2 imports tools.appliance" in v for v in got), got
    assert any("_layer_probe.py:3 imports control.trainer" in v for v in got), got


def test_one_import_style():
    """Every import of the package names it in full (``from mirrorckpt.parser import ...``)."""
    relative = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] not in LAYER and rel.parts[0] != "benchmarks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                relative.append(f"{rel}:{node.lineno}")
    assert relative == []


def wiring_problems(path) -> list[str]:
    """What keeps a module from being wiring only: over 400 lines, a function over 60, or a reach
    into another object's private fields (``x._name`` where x is not self or cls)."""
    src = path.read_text()
    out = [f"{len(src.splitlines())} lines"] if len(src.splitlines()) > 400 else []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
            out.append(f"{node.name}: {node.end_lineno - node.lineno + 1} lines")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.append(f"line {node.lineno}: .{node.attr}")
    return out


def test_the_daemon_module_is_wiring():
    assert wiring_problems(REPO / "tools" / "serve.py") == []


def test_the_wiring_check_can_fail(tmp_path):
    p = tmp_path / "w.py"
    p.write_text("def f(x):\n    return x._queue\n" + "\n" * 400 + "def g():\n" + "    pass\n" * 61)
    assert wiring_problems(p) == ["464 lines", "g: 62 lines", "line 2: ._queue"]

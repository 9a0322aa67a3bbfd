"""kvcache.engine.parts: the engine's parts form a tree, built in constructors, that never points back up.

Read with `ast` from the sources: every import between the engine's modules counts, a type-only one (under
`if TYPE_CHECKING:`) and one inside a function included, and the graph they make has no cycle. A part is an
engine class `parts` builds, directly or from a table; no part sets an attribute of another part, and
none takes a part anywhere but in its constructor (no `wire(...)`, no attribute declared and left unset until
someone assigns it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[3] / "kvcache" / "engine"
PACKAGE = "kvcache.engine"


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(), str(path)) for path in sorted(ENGINE.glob("*.py"))
            if path.stem != "__init__"}


def _engine_imports(name: str, tree: ast.Module) -> set[str]:
    """The engine modules `name` imports, wherever the import statement is."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x
                targets = [node.module] if node.module else [a.name for a in node.names]
            elif node.level == 2 and node.module and node.module.startswith("engine"):
                targets = [node.module.removeprefix("engine").lstrip(".") or None] if "." in node.module else \
                    [a.name for a in node.names]
            elif node.level == 0 and node.module and node.module.startswith(PACKAGE + "."):
                targets = [node.module.removeprefix(PACKAGE + ".")]
            elif node.level == 0 and node.module == PACKAGE:
                targets = [a.name for a in node.names]
            else:
                continue
            out.update(t.split(".")[0] for t in targets if t)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix(PACKAGE + ".").split(".")[0] for a in node.names
                       if a.name.startswith(PACKAGE + "."))
    out.discard(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_engine_modules_import_each_other_without_a_cycle():
    modules = _modules()
    graph = {name: _engine_imports(name, tree) & set(modules) for name, tree in modules.items()}
    assert _cycle(graph) is None, f"engine import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_cycle_through_a_type_only_import():
    # what the test above would say about the circle this redesign removed (copies <-> writes, type-only one way)
    source = {"copies": "from .writes import Writes\n",
              "writes": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .copies import Copies\n"}
    graph = {name: _engine_imports(name, ast.parse(text)) for name, text in source.items()}
    assert _cycle(graph) == ["copies", "writes", "copies"]


def _init_part_params(cls: ast.ClassDef, part_names: set[str]) -> dict[str, str]:
    """self attribute -> part class, for the constructor parameters typed as a part and kept on self."""
    init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return {}
    typed = {a.arg: _part_of(a.annotation, part_names) for a in init.args.args + init.args.kwonlyargs}
    kept: dict[str, str] = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for t, v in _pairs(target, node.value):
                    if (_is_self_attr(t) and isinstance(v, ast.Name) and typed.get(v.id)):
                        kept[t.attr] = typed[v.id]  # type: ignore[union-attr, assignment]
    return kept


def _part_of(annotation: ast.expr | None, part_names: set[str]) -> str | None:
    if annotation is None:
        return None
    names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
    names |= {n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    found = names & part_names
    return min(found) if found else None


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) pairs of an assignment, tuples unpacked element by element."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return [p for t, v in zip(target.elts, value.elts, strict=True) for p in _pairs(t, v)]
    if isinstance(target, ast.Tuple):
        return [(t, value) for t in target.elts]
    return [(target, value)]


def _is_self_attr(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _part_classes(modules: dict[str, ast.Module]) -> dict[str, ast.ClassDef]:
    """The engine's parts: the classes `parts` (their builder) imports, those a table of classes names (a part
    picked per host mode), and their subclasses. (Operations and records are not parts: their movers keep their
    fields.)"""
    classes = {c.name: c for tree in modules.values() for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
    named: set[str] = set()
    for n in ast.walk(modules["parts"]):
        if isinstance(n, ast.ImportFrom) and n.level == 1:
            named |= {a.name for a in n.names}
    for tree in modules.values():
        for n in tree.body:
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Dict):
                named |= {v.id for v in n.value.values if isinstance(v, ast.Name) and v.id in classes}
    parts = {name for name in named if name in classes}
    parts |= {c.name for c in classes.values() if any(isinstance(b, ast.Name) and b.id in parts for b in c.bases)}
    return {name: classes[name] for name in parts}


def _wiring(modules: dict[str, ast.Module]) -> list[str]:
    """Every place a part is wired after construction: an attribute of a part assigned by another part (directly
    or through a local alias), a part taken outside a constructor, an attribute declared and left unset."""
    parts = _part_classes(modules)
    found: list[str] = []
    for mod, tree in modules.items():
        for cls in [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]:
            held = _init_part_params(cls, set(parts))
            for f in [f for f in cls.body if isinstance(f, ast.FunctionDef)]:
                typed = {a.arg for a in f.args.args if _part_of(a.annotation, set(parts))}
                aliases = {t.id for n in ast.walk(f) if isinstance(n, ast.Assign) for tg in n.targets
                           for t, v in _pairs(tg, n.value) if isinstance(t, ast.Name) and _is_self_attr(v)
                           and v.attr in held}  # type: ignore[union-attr]
                for n in ast.walk(f):
                    targets = n.targets if isinstance(n, ast.Assign) else \
                        [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
                    for tg in targets:
                        for t in (tg.elts if isinstance(tg, ast.Tuple) else [tg]):
                            if not isinstance(t, ast.Attribute):
                                continue
                            base = t.value
                            if (_is_self_attr(base) and base.attr in held) or \
                                    (isinstance(base, ast.Name) and (base.id in aliases or base.id in typed)):
                                found.append(f"{mod}.py:{t.lineno} {cls.name}.{f.name} sets {ast.unparse(t)}")
                    if f.name != "__init__" and isinstance(n, ast.Assign):
                        for tg in n.targets:
                            for t, v in _pairs(tg, n.value):
                                if _is_self_attr(t) and isinstance(v, ast.Name) and v.id in typed:
                                    found.append(f"{mod}.py:{t.lineno} {cls.name}.{f.name} takes part {v.id} "
                                                 f"after construction")
                    if f.name == "__init__" and isinstance(n, ast.AnnAssign) and n.value is None and \
                            _is_self_attr(n.target):
                        found.append(f"{mod}.py:{n.lineno} {cls.name} declares {ast.unparse(n.target)} unset")
    # the module that builds them: every attribute it sets is its own
    builder = modules["parts"]
    for n in ast.walk(builder):
        for tg in (n.targets if isinstance(n, ast.Assign) else []):
            for t in (tg.elts if isinstance(tg, ast.Tuple) else [tg]):
                if isinstance(t, ast.Attribute) and not _is_self_attr(t):
                    found.append(f"parts.py:{t.lineno} sets {ast.unparse(t)}")
    return found


def test_no_part_is_wired_after_construction():
    assert _wiring(_modules()) == []


@pytest.mark.parametrize("wiring, says", [
    ("class Writes:\n    def __init__(self, holders: Holders) -> None:\n        self.holders = holders\n"
     "class Copies:\n    def __init__(self, writes: Writes) -> None:\n        self.writes = writes\n"
     "    def go(self) -> None:\n        self.writes.copies = self\n", "sets self.writes.copies"),
    ("class Writes:\n    def __init__(self) -> None:\n        self.copies: Copies\n"
     "class Copies:\n    def __init__(self, writes: Writes) -> None:\n        self.writes = writes\n",
     "declares self.copies unset"),
    ("class Room:\n    def __init__(self) -> None:\n        pass\n"
     "    def wire(self, copies: Copies, writes: Writes) -> None:\n        self.copies, self.w = copies, writes\n"
     "class Copies:\n    def __init__(self, room: Room) -> None:\n        self.room = room\n",
     "takes part copies after construction"),
])
def test_the_wiring_check_finds_each_kind_of_wiring(wiring, says):
    found = _wiring({"engine": ast.parse(wiring), "parts": ast.parse("from .engine import Copies, Room, Writes\n")})
    assert any(says in line for line in found), found


def test_the_builder_check_finds_an_attribute_set_on_a_built_part():
    found = _wiring({"parts": ast.parse("def build(copies, room):\n    copies.room = room\n")})
    assert found == ["parts.py:2 sets copies.room"]

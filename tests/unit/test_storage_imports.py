"""The storage layer's imports run one way (DESIGN §2): `kvcache.storage` builds on the values only (never the
tree, the pools, the cache, live mode or the workload tools), its modules import each other without a cycle, and a
plugin imports only the storage kit (base and the modules built on base alone), never the rest of the core.
Read with `ast`, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VALUES = {"kvcache.errors", "kvcache.keys", "kvcache.layout", "kvcache.namespace"}
KIT = {"kvcache.storage.base", "kvcache.storage.codec", "kvcache.storage.handle", "kvcache.storage.verify"}


def imports(path: Path, package: str) -> set[str]:
    """Every kvcache module `path` imports (`package`: its own dotted package, for relative imports)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names]
            out.add(base)
            out.update(n for n in names if (ROOT / (n.replace(".", "/") + ".py")).exists())
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "kvcache" or m.startswith("kvcache.")}


def storage_modules() -> dict[str, set[str]]:
    return {f"kvcache.storage.{p.stem}": imports(p, "kvcache.storage")
            for p in sorted((ROOT / "kvcache" / "storage").glob("*.py")) if p.stem != "__init__"}


def test_storage_imports_only_the_values_and_itself():
    for module, deps in storage_modules().items():
        outside = {d for d in deps if not d.startswith("kvcache.storage") and d not in VALUES}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_storage_modules_import_each_other_without_a_cycle():
    graph = {m: {d for d in deps if d.startswith("kvcache.storage.")} for m, deps in storage_modules().items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])


def test_the_kit_plugins_use_builds_on_base_and_the_values_alone():
    for module in KIT - {"kvcache.storage.base"}:
        deps = storage_modules()[module]
        assert deps <= KIT | VALUES, f"{module} imports {sorted(deps - KIT - VALUES)}"


def test_plugins_import_only_the_storage_kit():
    found = 0
    for path in sorted((ROOT / "plugins").glob("*/*/*.py")):
        deps = imports(path, path.parent.name)
        found += 1
        assert deps <= KIT, f"{path.relative_to(ROOT)} imports {sorted(deps - KIT)}"
    assert found  # the plugins are there to check

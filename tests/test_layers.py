"""The layer contract: imports run one way, cli -> live -> ops -> workload -> engine -> diagnostics -> tree | ledger
-> storage -> types, and no module imports itself back through others (no cycle). A plugin builds on the storage
kit alone, and the kit on the storage modules and the values alone. The engine adapters (`kvcache.engines`) sit
under the CLI and build on the store and the values alone; an inference engine (SGLang) is imported by them only,
inside functions, and by nothing else of kvc.

Read with `ast` from the sources, so a function-level import counts like a top-level one; an import under
`if TYPE_CHECKING:` is a type annotation only and does not. The layers are a table (`LAYERS`): a module belongs to
the first layer with a prefix of its name, and may import its own layer and any layer below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Top to bottom. `kvcache` alone is the package facade (its public names load lazily from the layers below).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("kvc",)),
    # engine adapters (SGLang's L3 backend): loaded by the engine, built on the store and the values; the CLI
    # alone may import them
    ("engines", ("kvcache.engines",)),
    ("api", ("kvcache",)),
    ("live", ("kvcache.live",)),
    ("ops", ("kvcache.ops",)),
    ("workload", ("kvcache.workload",)),
    ("engine", ("kvcache.engine",)),
    ("diagnostics", ("kvcache.diagnostics",)),
    # the radix tree and the slot pools with their ledger: neither imports the other
    ("tree | ledger", ("kvcache.tree", "kvcache.ledger")),
    ("storage", ("kvcache.storage", "kvcache_redis")),
    # values only: what names a page, configuration, results, the typed errors
    ("types", ("kvcache.types", "kvcache.errors")),
]
# What a backend outside the core imports (plugins/README.md): the storage kit, one module. What it loads, all the
# way down, is storage modules outside the LMDB backend and the values: a plugin never pulls in the rest of the core.
STORAGE_KIT = "kvcache.storage.kit"
KIT_BASIS = ("kvcache.storage", "kvcache.types", "kvcache.errors")
KIT_NEVER = ("kvcache.storage.lmdb",)
PLUGINS = ("kvcache_redis",)
SOURCES = {"kvcache": ROOT / "kvcache", "kvc": ROOT / "cli" / "kvc",
           "kvcache_redis": ROOT / "plugins" / "kvcache_redis" / "kvcache_redis"}


class Import(msgspec.Struct, frozen=True):
    """One module importing another, where."""

    importer: str
    imported: str
    line: int


def modules(sources: dict[str, Path]) -> dict[str, Path]:
    """Every module under each package's source folder, by dotted name."""
    found = {}
    for package, folder in sources.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    return {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test)
            for n in ast.walk(block) if isinstance(n, (ast.Import, ast.ImportFrom))}


def imports(known: dict[str, Path]) -> list[Import]:
    """Every import between known modules."""
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from a import b`: the module a.b where b is one, else a (for its attribute b)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            out += [Import(name, t, node.lineno) for t in targets if t in known and t != name]
    return out


def _within(module: str, prefix: str) -> bool:
    # the facade `kvcache` is the package module alone; any other prefix covers its submodules too
    return module == prefix or (prefix != "kvcache" and module.startswith(prefix + "."))


def layer_of(module: str) -> int:
    """Index in LAYERS of the module's layer (an unlisted module fails)."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(_within(module, p) for p in prefixes):
            return i
    raise LookupError(f"{module} is in no layer of tests/test_layers.py: add it to LAYERS")


def upward(edges: list[Import]) -> list[str]:
    """Imports of a higher layer from a lower one."""
    return [f"{e.importer} (layer {LAYERS[layer_of(e.importer)][0]}) imports {e.imported} (layer "
            f"{LAYERS[layer_of(e.imported)][0]}) at line {e.line}"
            for e in edges if layer_of(e.imported) < layer_of(e.importer)]


def cycles(edges: list[Import]) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    for name in modules(SOURCES):
        layer_of(name)


def test_no_import_runs_up_a_layer():
    assert upward(imports(modules(SOURCES))) == []


def test_no_import_cycle():
    assert cycles(imports(modules(SOURCES))) == []


def test_the_cache_and_the_tiers_never_import_live_mode_or_the_workload_tools():
    below_cache = {e.imported for e in imports(modules(SOURCES))
                   if layer_of(e.importer) >= layer_of("kvcache.engine")}
    assert not {m for m in below_cache if m.startswith(("kvcache.live", "kvcache.workload", "kvc."))}


def loaded_by(module: str, edges: list[Import]) -> set[str]:
    """Every known module that importing `module` loads, itself included (the transitive closure of its imports)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
    seen, todo = {module}, [module]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_plugins_build_on_the_storage_kit_alone():
    edges = imports(modules(SOURCES))
    plugin = {e.imported for e in edges if e.importer.startswith(PLUGINS) and not e.imported.startswith(PLUGINS)}
    assert plugin == {STORAGE_KIT}
    outside = {m for m in loaded_by(STORAGE_KIT, edges)
               if not any(_within(m, p) for p in KIT_BASIS) or any(_within(m, p) for p in KIT_NEVER)}
    assert outside == set()


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return modules({"kvcache": tmp_path})


def test_the_checks_catch_an_upward_import_a_function_level_cycle_and_skip_type_only_imports(tmp_path):
    known = _package(tmp_path, {
        "__init__.py": "",
        "tree.py": "def f():\n    from .engine import TieredCache\n",  # upward, inside a function
        "engine.py": "from . import tree\n",
        "storage/__init__.py": "",
        "storage/api.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..tree import RadixTree\n",
    })
    edges = imports(known)
    assert {(e.importer, e.imported) for e in edges} == {("kvcache.tree", "kvcache.engine"),
                                                         ("kvcache.engine", "kvcache.tree")}
    assert upward(edges) == ["kvcache.tree (layer tree | ledger) imports kvcache.engine (layer engine) at line 2"]
    assert cycles(edges) == [["kvcache.engine", "kvcache.tree"]]


def test_a_module_in_no_layer_is_named():
    with pytest.raises(LookupError, match="kvcache.newthing is in no layer"):
        layer_of("kvcache.newthing")


# --- the tree keeps its own invariants -----------------------------------------------------------------------

# What a tree node counts and holds: written by kvcache/tree/ alone (a caller that bumps `pins` and forgets to
# re-offer the node leaves it silently unevictable). Callers use the tree's methods (pin/unpin, lock, hold, ...).
NODE_STATE = {"lock_ref", "device_holds", "host_holds", "pins", "host_pins", "stored", "hits", "last_access",
              "children_on_device", "children_on_host", "device", "host", "page_hashes", "share"}


def node_state_writes(known: dict[str, Path]) -> list[str]:
    """Assignments to a node-state attribute of another object, in modules outside kvcache.tree that can see tree
    nodes (they import kvcache.tree, for types too)."""
    out = []
    for name, path in known.items():
        if _within(name, "kvcache.tree"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        sees_nodes = any(isinstance(n, ast.ImportFrom) and n.module is not None
                         and (n.module == "tree" or n.module.startswith("tree.") or n.module.endswith(".tree")
                              or ".tree." in n.module or n.module == "kvcache.tree")
                         for n in ast.walk(tree))
        if not sees_nodes:
            continue
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for a in ast.walk(t):
                    if (isinstance(a, ast.Attribute) and a.attr in NODE_STATE
                            and not (isinstance(a.value, ast.Name) and a.value.id == "self")):
                        out.append(f"{name}:{node.lineno} writes .{a.attr}")
    return out


def test_no_code_outside_the_tree_writes_a_nodes_counters():
    assert node_state_writes(modules(SOURCES)) == []


def test_the_node_state_rule_catches_a_pin_written_from_outside(tmp_path):
    known = _package(tmp_path, {
        "__init__.py": "",
        "tree.py": "class TreeNode:\n    pins = 0\n",
        "engine.py": "from .tree import TreeNode\ndef f(n):\n    n.pins += 1\n    n.other = 2\n",
        "storage.py": "def g(d):\n    d.hits += 1\n",  # sees no tree node: another object's hits
    })
    assert node_state_writes(known) == ["kvcache.engine:3 writes .pins"]


# --- no raw namespace id in what users see ---------------------------------------------------------------------

# The modules whose structs reach users: results and reports, the admin protocol, the request handlers, the CLI.
USER_FACING = ("kvcache.types.results", "kvcache.types.reports", "kvcache.types.stats", "kvcache.types.events",
               "kvcache.live", "kvcache.ops", "kvc")


def raw_namespace_ids() -> list[str]:
    """Fields of user-facing structs typed as a raw `NamespaceId`, or named namespace_id and not a `DisplayId`.
    Read from the annotations as written (many name types imported for type checking only)."""
    import importlib
    out = []
    for name in sorted(modules(SOURCES)):
        if not any(_within(name, p) for p in USER_FACING) or name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if not (isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == name):
                continue
            hints: dict[str, object] = {}
            for klass in reversed(obj.__mro__):
                hints.update(getattr(klass, "__annotations__", {}))
            for field, hint in hints.items():
                text = hint if isinstance(hint, str) else repr(hint)
                if "NamespaceId" in text or (field == "namespace_id" and "DisplayId" not in text):
                    out.append(f"{name}.{obj.__name__}.{field}: {text}")
    return out


def test_no_user_facing_struct_carries_a_raw_namespace_id():
    assert raw_namespace_ids() == []


# --- engine adapters: on the store and the values; an engine imported lazily, by them alone ---------------------

ENGINES = "kvcache.engines"
ENGINES_BASIS = ("kvcache.engines", "kvcache.storage", "kvcache.types", "kvcache.errors")
FOREIGN_ENGINES = ("sglang", "vllm")  # inference engines kvc adapts to and never depends on


def test_engine_adapters_build_on_the_store_and_the_values_alone():
    edges = imports(modules(SOURCES))
    assert {e.importer for e in edges if _within(e.imported, ENGINES) and not _within(e.importer, ENGINES)} <= {
        m for m in modules(SOURCES) if m.startswith("kvc.")}
    outside = {e.imported for e in edges if _within(e.importer, ENGINES)
               and not any(_within(e.imported, p) for p in ENGINES_BASIS)}
    assert outside == set()


def engine_imports(known: dict[str, Path]) -> list[str]:
    """Imports of a foreign engine (FOREIGN_ENGINES) that break the rule: any outside kvcache.engines, and any in it
    that runs at import time (at module or class level). One under `if TYPE_CHECKING:` never runs."""
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_only(tree)
        in_function: set[int] = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                                 for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: one of kvc's own modules
            foreign = [t for t in targets if t.split(".")[0] in FOREIGN_ENGINES]
            if not foreign:
                continue
            if not _within(name, ENGINES):
                out.append(f"{name}:{node.lineno} imports {foreign[0]} (only kvcache.engines may)")
            elif id(node) not in in_function:
                out.append(f"{name}:{node.lineno} imports {foreign[0]} at import time (import it inside a function)")
    return out


def test_no_module_outside_the_engine_adapters_imports_an_engine_and_they_import_it_lazily():
    assert engine_imports(modules(SOURCES)) == []


def test_the_engine_import_rule_catches_an_eager_import_and_one_outside_the_adapters(tmp_path):
    known = _package(tmp_path, {
        "__init__.py": "",
        "engines/__init__.py": "",
        "engines/lazy.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sglang\n"
                           "def f():\n    from sglang.srt import x\n",
        "engines/eager.py": "import sglang.srt.mem_cache\nclass A:\n    from sglang import y\n",
        "storage.py": "def g():\n    import sglang\n",
    })
    assert sorted(engine_imports(known)) == [
        "kvcache.engines.eager:1 imports sglang.srt.mem_cache at import time (import it inside a function)",
        "kvcache.engines.eager:3 imports sglang at import time (import it inside a function)",
        "kvcache.storage:2 imports sglang (only kvcache.engines may)",
    ]

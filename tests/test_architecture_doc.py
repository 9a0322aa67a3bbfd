"""docs/architecture.md names every module there is and no module there is not, and README's layout names every
package folder there is and none there is not: a module added, moved or removed without its line fails here.
Every other file the document names (a path in backquotes, a module of the engine's table) must exist too.

What is read (the document states it at the top of its "Files"): in docs/architecture.md's `## Files` section, a
heading ``### `FOLDER/` `` opens a folder (a path from the repository root) and each line ``- `NAME.py`: ...``
under it names the module `FOLDER/NAME.py`; a heading of any other form closes the folder. In README.md's
`## Layout` code block, a line whose first word ends in `/` and is followed by two spaces or more (the column of
descriptions) or by nothing names a folder, nested under the nearest folder above it that is indented less.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
# The source folders whose every module the document lists (setuptools packages: kvcache, kvc, kvcache_redis).
SOURCES = ("kvcache", "cli/kvc", "plugins/kvcache_redis/kvcache_redis")
# The package folders README's layout names, all of them.
LAYOUT_PACKAGES = ("kvcache", "cli/kvc")

FOLDER_HEADING = re.compile(r"^### `([^`]+/)`\s*$")
MODULE_LINE = re.compile(r"^- `([^`/]+\.py)`: \S")


def section(text: str, heading: str) -> str:
    """The body of a markdown file's `## heading` section (up to the next `## `)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    found = [parts[i + 1] for i in range(1, len(parts), 2) if parts[i].strip() == heading]
    assert len(found) == 1, f"one '## {heading}' section expected, found {len(found)}"
    return found[0]


def documented_modules(text: str) -> tuple[list[str], list[str]]:
    """(modules named by the "Files" section, in order, as paths from the repository root; lines that look like a
    module's but stand under no folder heading or are malformed)."""
    modules: list[str] = []
    stray: list[str] = []
    folder: str | None = None
    for line in section(text, "Files").splitlines():
        if line.startswith("#"):
            match = FOLDER_HEADING.match(line)
            folder = match.group(1) if match else None
            continue
        if not line.startswith("- `"):
            continue
        match = MODULE_LINE.match(line)
        if match is None or folder is None:
            stray.append(line)
        else:
            modules.append(folder + match.group(1))
    return modules, stray


def modules_on_disk() -> set[str]:
    """Every Python module of the source folders, as a path from the repository root."""
    return {path.relative_to(ROOT).as_posix() for source in SOURCES for path in (ROOT / source).rglob("*.py")
            if "__pycache__" not in path.parts}


def compare(named: list[str], on_disk: set[str], what: str) -> list[str]:
    """What differs between the names a document gives and what is on disk, one line each."""
    problems = [f"on disk, not in {what}: {name}" for name in sorted(on_disk - set(named))]
    problems += [f"in {what}, not on disk: {name}" for name in sorted(set(named) - on_disk)]
    problems += [f"named twice in {what}: {name}" for name in sorted({n for n in named if named.count(n) > 1})]
    return problems


def test_architecture_doc_names_every_module_and_only_those():
    named, stray = documented_modules(ARCHITECTURE.read_text())
    assert not stray, "docs/architecture.md: module lines outside a folder heading or malformed:\n" + "\n".join(stray)
    problems = compare(named, modules_on_disk(), "docs/architecture.md")
    assert not problems, "docs/architecture.md's Files section and the modules differ:\n" + "\n".join(problems)


def named_elsewhere(text: str) -> list[str]:
    """The Python files the rest of the document names, each as written: a path in backquotes (`engine/parts.py`,
    `tests/test_layers.py`: from the repository root or from kvcache/) and a module in the first column of the
    engine's table (`Holders` (`holders.py`): in kvcache/engine/)."""
    rest = text.replace(section(text, "Files"), "")
    paths = re.findall(r"`([\w./]+/\w+\.py)`", rest)
    rows = re.findall(r"^\| ([^|]+) \|", section(text, "The engine: one facade over a tree of parts"), re.M)
    table = [f"engine/{name}" for row in rows for name in re.findall(r"`(\w+\.py)`", row)]
    return paths + table


def test_every_file_the_rest_of_the_document_names_exists():
    text = ARCHITECTURE.read_text()
    named = named_elsewhere(text)
    assert "engine/holders.py" in named and "tests/test_layers.py" in named  # the reading finds what is there
    missing = [name for name in named if not (ROOT / name).is_file() and not (ROOT / "kvcache" / name).is_file()]
    assert not missing, "docs/architecture.md names files that are not there:\n" + "\n".join(missing)


def layout_folders(text: str) -> list[str]:
    """The folders README's layout names, as paths from the repository root (without the trailing `/`)."""
    block = re.search(r"^```\n(.*?)^```", section(text, "Layout"), flags=re.S | re.M)
    assert block, "README.md's Layout section has no code block"
    stack: list[tuple[int, str]] = []  # (indent, path) of the enclosing folders
    folders = []
    for line in block.group(1).splitlines():
        match = re.match(r"^( *)(\S+/)(?: {2,}|$)", line)
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2).rstrip("/")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = f"{stack[-1][1]}/{name}" if stack else name
        stack.append((indent, path))
        folders.append(path)
    return folders


def packages_on_disk() -> set[str]:
    """Every package folder (one with an __init__.py) of the layout's packages, from the repository root."""
    return {init.parent.relative_to(ROOT).as_posix() for top in LAYOUT_PACKAGES
            for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts}


def test_readme_layout_names_every_package_and_only_those():
    folders = layout_folders(README.read_text())
    inside = [f for f in folders if any(f == top or f.startswith(top + "/") for top in LAYOUT_PACKAGES)]
    problems = compare(inside, packages_on_disk(), "README.md's Layout")
    problems += [f"in README.md's Layout, not on disk: {f}" for f in folders
                 if f not in inside and not (ROOT / f).is_dir()]
    assert not problems, "README.md's Layout and the package folders differ:\n" + "\n".join(problems)


# --- the checks themselves ---------------------------------------------------------------------------------------


DOC = """# A

## Files

Prose naming `kvcache/old.py` does not count.

### `kvcache/`

- `__init__.py`: the package
- `a.py`: a module
  - `nested.py`: not at the start of a line, not read

### `kvcache/sub/`

- `b.py`: another

### Around the code

- `c.py`: under no folder

## Next

- `d.py`: another section, not read
"""


def test_the_module_list_is_read_as_the_document_says():
    named, stray = documented_modules(DOC)
    assert named == ["kvcache/__init__.py", "kvcache/a.py", "kvcache/sub/b.py"]
    assert stray == ["- `c.py`: under no folder"]


def test_a_difference_names_the_module_either_way():
    assert compare(["kvcache/a.py", "kvcache/gone.py", "kvcache/a.py"], {"kvcache/a.py", "kvcache/new.py"}, "D") == [
        "on disk, not in D: kvcache/new.py",
        "in D, not on disk: kvcache/gone.py",
        "named twice in D: kvcache/a.py",
    ]


def test_the_layout_nests_folders_by_indent():
    readme = """## Layout

```
kvcache/            core
                    continued/ a description's word, not a folder
  types/            values
  storage/          L3
    lmdb/           backend
  engine/           the cache
cli/kvc/            the CLI
  commands/         commands
docs/               docs
```
"""
    assert layout_folders(readme) == ["kvcache", "kvcache/types", "kvcache/storage", "kvcache/storage/lmdb",
                                      "kvcache/engine", "cli/kvc", "cli/kvc/commands", "docs"]

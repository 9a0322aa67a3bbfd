"""The distribution ships every package of the source tree: pyproject.toml's `packages` list names each folder
with an `__init__.py` under the mapped package roots (`package-dir`), and nothing else. The tests import from the
source tree (PYTHONPATH), so a package left out of the list would pass them and be missing from an install."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the check needs no more than one interpreter to run it

ROOT = Path(__file__).resolve().parent.parent


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_packages(package_dir: dict[str, str]) -> set[str]:
    """Every package under each mapped root, by dotted name: the root and each folder below it holding an
    `__init__.py` (a folder without one is not a package: setuptools would not ship it either)."""
    found = set()
    for name, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            found.add(".".join((name, *init.parent.relative_to(base).parts)))
    return found


def test_every_source_package_is_listed_and_every_listed_one_exists():
    config = _setuptools()
    listed = set(config["packages"])
    on_disk = source_packages(config["package-dir"])
    assert sorted(on_disk - listed) == [], "packages in the source tree that pyproject.toml does not ship"
    assert sorted(listed - on_disk) == [], "packages pyproject.toml lists that have no __init__.py"


def test_the_cli_is_mapped_from_its_folder():
    config = _setuptools()
    assert config["package-dir"]["kvc"] == "cli/kvc"
    assert {"kvc", "kvc.commands", "kvc.render"} <= set(config["packages"])

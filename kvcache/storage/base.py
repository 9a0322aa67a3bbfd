"""The storage kit under its former name, kept for plugins written against `kvcache.storage.base`.

`base` once held the L3 store interface, its records, the argument checks and the backend registry; they now live
in `api`, `checks` and `registry`, and a backend imports them all from `kvcache.storage.kit`. This module re-exports
exactly the kit's names, so outside code that imports `kvcache.storage.base` keeps working. Code in this project
imports the real modules (the core) or the kit (plugins), never this one.
"""

from __future__ import annotations

from . import kit
from .kit import *  # noqa: F403  (the kit's names, as listed in kit.__all__)

__all__ = kit.__all__

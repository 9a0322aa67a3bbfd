"""The pool tiers that the tree, holds and reports name: L1 (device) and L2 (host).

A value only: the tree keeps one book per tier (`kvcache.tree.books`), the cache holds a prefetch's pages on one
tier, the KV-event log reports a copy that came or went in one. L3 (the store) is not a `Tier`: nothing in the tree
holds, locks or counts its pages.
"""

from __future__ import annotations

import enum


class Tier(str, enum.Enum):
    """A pool tier, as holds and reports name it."""

    DEVICE = "device"  # L1
    HOST = "host"  # L2

"""The shares a cache applies to its tiers (`kvcache.types.shares`), kept in step with the store's registry.

Shares live with the store, so every cache on it applies them: read at open and every
`CacheConfig.shares_refresh_s`; `set` writes them there and applies them here at once.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import msgspec

from ..errors import StoreError
from ..types.ids import NamespaceId
from ..types.namespace import Namespace
from ..types.shares import NamespaceShares, Shares

if TYPE_CHECKING:
    from ..storage.api import PageStore
    from ..tree import RadixTree
    from ..types.config import CacheConfig
    from ..types.stats import CacheCounters

log = logging.getLogger("kvcache")


class AppliedShares:
    """The shares one cache applies, by namespace id."""

    def __init__(self, config: CacheConfig, store: PageStore | None, tree: RadixTree, counters: CacheCounters) -> None:
        self.config = config
        self.store = store
        self.tree = tree
        self.counters = counters
        self.records: dict[NamespaceId, NamespaceShares] = {}  # namespace id -> its shares, as applied to the tree
        self.due = math.inf  # time.monotonic() of the next refresh from the store

    def set(self, namespace: Namespace, shares: Shares) -> None:
        """Write `namespace`'s shares to the store (when there is one) and apply them now."""
        if self.store is not None:
            self.store.set_shares(namespace, shares)
        info = self.tree.fingerprints.info(namespace)  # the cache's key: its store's, as its registry shows it
        self._apply(NamespaceShares(namespace.id_hex, info.extra_key, info.salt_fingerprint, shares, time.time()))

    def refresh(self) -> int:
        """Read every namespace's shares from the store and apply what changed (shares cleared there are cleared
        here). Returns how many namespaces changed."""
        if self.store is None:
            return 0
        self.due = (time.monotonic() + self.config.shares_refresh_s if self.config.shares_refresh_s > 0
                    else math.inf)
        stored = {r.ns_id_hex: r for r in self.store.shares()}
        changed = 0
        for ns_id, rec in list(self.records.items()):
            if ns_id.hex() not in stored:
                self._apply(msgspec.structs.replace(rec, shares=Shares()))
                changed += 1
        for rec in stored.values():
            now = self.records.get(NamespaceId(bytes.fromhex(rec.ns_id_hex)))
            if now is None or now.shares != rec.shares:
                self._apply(rec)
                changed += 1
        return changed

    def refresh_quietly(self) -> None:
        """`refresh`, keeping the shares applied when the store cannot answer (counted, logged)."""
        try:
            self.refresh()
        except StoreError as exc:  # a store away now: the shares applied stay, the next refresh tries again
            self.counters.share_refresh_errors += 1
            log.warning("refreshing namespace shares from the store failed: %s", exc)

    def _apply(self, record: NamespaceShares) -> None:
        ns_id = NamespaceId(bytes.fromhex(record.ns_id_hex))
        if record.shares.empty:
            self.records.pop(ns_id, None)
            self.tree.set_share(ns_id, None, None)
        else:
            self.records[ns_id] = record
            label = f"{record.extra_key or '-'}/{record.salt_fingerprint or '-'}"
            self.tree.set_share(ns_id, *record.shares.pages(self.tree.page_size), label)

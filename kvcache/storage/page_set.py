"""A page store that remembers which pages it holds and nothing else: no bytes, no capacity, no registry.

What it is for: a capacity sweep (`kvcache.workload.sweep`) at a size whose L3 is unlimited. Such a store never
evicts, so what it holds after any sequence of puts and drops is exactly the set of pages written and not dropped,
and whether a page is held is all a cache's hit accounting reads of it (`exists_prefix`, and how many pages
`get_into` serves). Keeping that set in a dict answers those questions as a real store would, without the
transactions, checksums and copies that a byte-free replay on LMDB spends much of its time in.

It keeps the real store's refusals that depend on what is held (a token page whose parent is neither its
namespace's root nor a held page of its namespace refuses the batch, InvalidInput), so a cache that broke that
contract would fail here as it fails on LMDB. It does not check that hashes match their origins (the cache made
them) and cannot serve bytes: `get_into` writes nothing into the views it is given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidConfig, InvalidInput
from ..types.fingerprint_key import new_fingerprint_key
from ..types.ids import NamespaceId, PageHash
from ..types.keys import hash_root, new_chain_key
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from ..types.removals import RemovalReason
from ..types.shares import NamespaceShares, Shares
from .api import DeleteResult, PageOrigin, PageOutcome, PutResult


class PageSet:
    """An unlimited, byte-free `PageStore` under one layout: page hash -> the namespace id it was written under."""

    def __init__(self, layout: KVLayout, chain_key: bytes | None = None, location: str = "page-set:",
                 fingerprint_key: bytes | None = None) -> None:
        """`chain_key`: the key of the store this one stands for (its page hashes chain alike); a new one when
        None. `fingerprint_key`: that store's fingerprint key (its namespaces are shown alike); when None, env
        KVC_FINGERPRINT_KEY, else a new one."""
        self.location = location
        self.layout: KVLayout | None = layout
        self.readonly = False
        self.chain_key: bytes | None = chain_key if chain_key is not None else new_chain_key()
        self.fingerprint_key: bytes = fingerprint_key if fingerprint_key is not None else new_fingerprint_key()
        self._held: dict[bytes, bytes] = {}  # page hash -> Namespace.id (16 bytes) it was written under
        self._roots: dict[NamespaceId, PageHash] = {}  # Namespace.id -> its root under the layout (computed once)
        self._shares: dict[bytes, NamespaceShares] = {}  # Namespace.id -> its L1/L2 shares (set_shares)

    def __len__(self) -> int:
        """Pages held."""
        return len(self._held)

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        """How many pages from the start of `hashes` are held."""
        held = self._held
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def get_into(self, hashes: Sequence[PageHash], out_views: Sequence[Any]) -> int:
        """How many pages from the start of `hashes` a store holding these pages would serve; nothing is copied
        (the views keep their bytes)."""
        return self.exists_prefix(hashes[:len(out_views)])

    def put(self, hashes: Sequence[PageHash], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """Hold the batch's new pages (each WRITTEN once, EXISTING when held already or repeated). A token page
        whose parent is neither its namespace's root nor a held page of its namespace (one earlier in the batch
        counts) refuses the whole batch, as the LMDB store's put does."""
        if not (len(hashes) == len(pages) == len(origins)):
            raise InvalidInput(f"put needs as many pages and origins as hashes: {len(hashes)} hashes, "
                               f"{len(pages)} pages, {len(origins)} origins")
        held = self._held
        outcomes = bytearray(len(hashes))  # PageOutcome.WRITTEN (0) unless found held
        new: dict[bytes, bytes] = {}
        for i, (h, origin) in enumerate(zip(hashes, origins, strict=True)):
            if h in held or h in new:
                outcomes[i] = PageOutcome.EXISTING
                continue
            ns_id = origin.namespace.id
            if not origin.key and origin.parent != self._root(origin.namespace):
                up = new.get(origin.parent) or held.get(origin.parent)
                if up != ns_id:
                    raise InvalidInput(f"page {h.hex()}: its parent is not a held page of namespace "
                                       f"{origin.namespace.label} nor its root")
            new[h] = ns_id
        held.update(new)
        assert self.layout is not None
        return PutResult(len(new), len(hashes) - len(new), 0, 0, len(new) * self.layout.bytes_per_page,
                         outcomes=bytes(outcomes))

    def _root(self, namespace: Namespace) -> PageHash:
        root = self._roots.get(namespace.id)
        if root is None:
            assert self.layout is not None and self.chain_key is not None
            root = self._roots[namespace.id] = hash_root(self.layout.layout_id, namespace, self.chain_key)
        return root

    def delete_namespace(self, ns_id: NamespaceId, reason: RemovalReason = RemovalReason.DROP) -> DeleteResult:
        """Forget every page of one namespace (`reason` is not recorded: there is no removal log)."""
        gone = [h for h, ns in self._held.items() if ns == ns_id]
        for h in gone:
            del self._held[h]
        assert self.layout is not None
        return DeleteResult(len(gone), len(gone) * self.layout.bytes_per_page, 1)

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Record `namespace`'s L1 and L2 shares (`Shares()` clears them), which a cache reads back; an L3 share
        is a limit this store has none of, and is refused (InvalidConfig)."""
        if shares.store_bytes:
            raise InvalidConfig("a page set holds every page written: it cannot enforce an L3 share")
        if shares.empty:
            self._shares.pop(namespace.id, None)
        else:  # a salt fingerprint under the key of the store this one stands for, as its registry would show it
            info = namespace.info(self.fingerprint_key)
            self._shares[namespace.id] = NamespaceShares(namespace.id_hex, info.extra_key, info.salt_fingerprint,
                                                         shares, time.time())

    def shares(self) -> list[NamespaceShares]:
        """Every namespace's recorded shares."""
        return list(self._shares.values())

    def flush(self) -> None:
        """Nothing is pending."""

    def close(self) -> None:
        """Nothing to release."""

"""The chain key of a store, and the chain roots an audit checks pages against.

A store's page-hash chain roots are keyed (kvcache.types.keys): by a key derived from an LMDB store's key file,
by a random secret in a shared store's format record (Redis), by nothing in a format-1 store (UNKEYED_CHAIN).
`chain_key_of` says which from the format record and the store's secret.

An audit must tell a namespace's root from a missing parent page. With the chain key it recomputes each
(layout, namespace) root; without it (a monitoring user who may read the store but not its key file) it uses
the roots each namespace record keeps (`NamespaceRecord.roots`, written with the first page under each root).
A recorded root says nothing about its salt to anyone without the key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..types.ids import NamespaceId
from ..types.keys import UNKEYED_CHAIN, derive_chain_key, hash_root_of_id
from .api import NamespaceRecord
from .codec import StoreFormat


def chain_key_of(fmt: StoreFormat, secret: bytes | None) -> bytes | None:
    """The chain key of a store with format record `fmt` and secret `secret` (an LMDB store's key file; None
    when this user may not read it): UNKEYED_CHAIN for a format-1 store, the format record's own key where it
    keeps one (a shared store), else derived from `secret`; None when it cannot be known here."""
    if not fmt.keyed_roots:
        return UNKEYED_CHAIN
    if fmt.chain_key:
        return bytes.fromhex(fmt.chain_key)
    if secret is None:
        return None
    return derive_chain_key(secret)


class ChainRoots:
    """Which namespace (and, with the chain key, which layout) each chain root of a store belongs to."""

    __slots__ = ("keyed", "owners")

    def __init__(self, chain_key: bytes | None, pairs: Iterable[tuple[bytes, bytes]],
                 registry: Mapping[bytes, NamespaceRecord]) -> None:
        """`pairs`: the (layout id, namespace id) pairs the pages and records name; `registry`: the namespace
        records that decode. With `chain_key` every pair's root is recomputed; without it the recorded roots
        are taken (their layout unknown: None)."""
        self.keyed = chain_key is not None
        self.owners: dict[bytes, tuple[bytes | None, bytes]] = {}
        if chain_key is not None:
            # the ids as the store's keys and records name them: one NamespaceId per (layout, namespace) pair
            self.owners = {hash_root_of_id(lay, NamespaceId(ns), chain_key): (lay, ns) for lay, ns in pairs}
            return
        for ns_id, record in registry.items():
            for root in record.roots:
                try:
                    self.owners[bytes.fromhex(root)] = (None, ns_id)
                except ValueError:
                    continue  # a damaged entry names no root; the pages under it show as orphans

    def owner(self, root: bytes) -> tuple[bytes | None, bytes] | None:
        """(layout id or None where unknown, namespace id) of the root `root`; None when it is no known root."""
        return self.owners.get(root)

    def belongs(self, root: bytes, layout_id: bytes, ns_id: bytes) -> bool:
        """Whether `root` is the root of namespace `ns_id` under `layout_id` (as far as this view can tell)."""
        found = self.owners.get(root)
        return found is not None and found[1] == ns_id and found[0] in (None, layout_id)

"""A buffer-mode staged record (`StagedPrefetch`): a completed fetch parked until its request is admitted.

It records the request it was fetched for — id, key tokens, **namespace**, where the span starts, its host pages and
page hashes — owns those host pages in the ledger (owner `Staged(id)`), and keeps the prefetch's hold on its
anchor's path. `kvcache.engine.staging` parks, splices and drops it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..diagnostics.ownership import HolderState, encode_pages
from ..types.ids import PageHash
from ..types.keys import RadixKey
from ..types.owners import OwnerKind, owner_code
from ..types.results import StagedView
from ..types.tier import Tier
from .operation import anchor_holds

if TYPE_CHECKING:
    from ..tree import TreeNode
    from ..types.fingerprint_key import FingerprintKey


class StagedPrefetch:
    """A parked fetch, owning its host pages until it is spliced or dropped."""

    __slots__ = ("id", "owner", "rid", "key", "page_size", "start_page", "pages", "hashes", "op_id", "anchor",
                 "hold")

    def __init__(self, ident: int, rid: str, key: RadixKey, page_size: int, start_page: int, pages: np.ndarray,
                 hashes: list[PageHash], op_id: int, anchor: TreeNode | None, hold: Tier | None) -> None:
        self.id = ident
        self.owner = owner_code(OwnerKind.STAGED, ident)
        self.rid = rid
        self.key = key  # tokens + the namespace of the request the fetch was made for
        self.page_size = page_size
        self.start_page = start_page
        self.pages = pages  # host pages holding key pages [start_page, start_page + len(pages))
        self.hashes = hashes  # their page hashes (the request's chain)
        self.op_id = op_id  # the prefetch operation that fetched them
        self.anchor = anchor  # ends the prefix [0, start_page) on the device; None when the span starts at page 0
        self.hold = hold  # the anchor's path is held on this tier until the record is consumed or dropped

    @property
    def issued_by(self) -> int:
        """The prefetch that took the hold: holds are cancelled youngest first."""
        return self.op_id

    def holder_state(self, device_pool: str, host_pool: str) -> HolderState:
        """The host pages it owns, and its anchor's hold."""
        return HolderState("staged", self.id, self.owner, host_pool, encode_pages(self.pages), rid=self.rid,
                           device_holds=anchor_holds(self, Tier.DEVICE), host_holds=anchor_holds(self, Tier.HOST))

    def view(self, fingerprints: FingerprintKey) -> StagedView:
        """Printable fields, the namespace shown under `fingerprints` (the cache's key)."""
        ns = self.key.namespace
        return StagedView(self.id, self.rid, fingerprints.info(ns), fingerprints.display_id(ns.id), len(self.key),
                          self.start_page * self.page_size, len(self.pages) * self.page_size, self.op_id,
                          [h.hex() for h in self.hashes])

    def __repr__(self) -> str:
        return f"StagedPrefetch(#{self.id} {self.rid} {self.key.namespace.label} {len(self.pages)} pages)"

"""Buffer-mode staged prefetches: a completed fetch parked until its request is admitted.

A `StagedPrefetch` records the request it was fetched for — id, key tokens, **namespace**, where the span starts,
its host pages and page hashes — and owns those host pages in the ledger (owner `Staged(id)`). Consuming it
checks it against the admitted request: a record of another namespace, or whose key is not a prefix of the
request's tokens (a reused request id), is dropped (pages freed, counted, logged with both fingerprints) and never
spliced; a match splices it into the tree under a key rebuilt from the record's own namespace. Its pages count
against the prefetch host budget until then.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ..types.keys import RadixKey
from ..types.namespace import NamespaceInfo
from ..types.owners import OwnerKind, owner_code
from ..tree import Tier, TreeNode
from ..types.results import StagedView


class StagedPrefetch:
    """A parked fetch, owning its host pages until it is spliced or dropped."""

    __slots__ = ("id", "owner", "rid", "key", "page_size", "start_page", "pages", "hashes", "op_id", "anchor",
                 "hold")

    def __init__(self, ident: int, rid: str, key: RadixKey, page_size: int, start_page: int, pages: np.ndarray,
                 hashes: list[bytes], op_id: int, anchor: TreeNode | None, hold: Tier | None) -> None:
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

    def view(self) -> StagedView:
        """Printable fields."""
        ns = self.key.namespace
        return StagedView(self.id, self.rid, ns.info(), ns.display_id, len(self.key), self.start_page * self.page_size,
                          len(self.pages) * self.page_size, self.op_id, [h.hex() for h in self.hashes])

    def __repr__(self) -> str:
        return f"StagedPrefetch(#{self.id} {self.rid} {self.key.namespace.label} {len(self.pages)} pages)"

"""Buffer-mode staged prefetches: a completed fetch parked until its request is admitted.

A `StagedPrefetch` records the request it was fetched for — id, key tokens, **namespace**, where the span starts,
its host pages and page hashes — and owns those host pages in the ledger (owner `Staged(id)`). Consuming it
checks its namespace against the admitted request's: a mismatch drops it (pages freed, counted, logged with both
fingerprints) and never splices; a match splices it into the tree under a key rebuilt from the record's own
namespace.
"""

from __future__ import annotations

import msgspec
import numpy as np

from .keys import RadixKey
from .namespace import NamespaceInfo
from .owners import OwnerKind, owner_code
from .tree import TreeNode


class StagedView(msgspec.Struct):
    """The printable face of a staged record (CLI, snapshots)."""

    id: int
    rid: str
    namespace: NamespaceInfo
    namespace_id: str  # the namespace's display_id (keyed: a raw id would let a short salt be brute-forced)
    key_tokens: int
    start_tokens: int  # tokens the tree held when the fetch started; the staged pages follow them
    staged_tokens: int
    op_id: int
    page_hashes: list[str]  # hex


class StagedPrefetch:
    """A parked fetch, owning its host pages until it is spliced or dropped."""

    __slots__ = ("id", "owner", "rid", "key", "page_size", "start_page", "pages", "hashes", "op_id", "anchor")

    def __init__(self, ident: int, rid: str, key: RadixKey, page_size: int, start_page: int, pages: np.ndarray,
                 hashes: list[bytes], op_id: int, anchor: TreeNode) -> None:
        self.id = ident
        self.owner = owner_code(OwnerKind.STAGED, ident)
        self.rid = rid
        self.key = key  # tokens + the namespace of the request the fetch was made for
        self.page_size = page_size
        self.start_page = start_page
        self.pages = pages  # host pages holding key pages [start_page, start_page + len(pages))
        self.hashes = hashes  # their page hashes (the request's chain)
        self.op_id = op_id  # the prefetch operation that fetched them
        self.anchor = anchor  # locked: keeps the prefix [0, start_page) in the tree until consumed or dropped

    def view(self) -> StagedView:
        """Printable fields."""
        ns = self.key.namespace
        return StagedView(self.id, self.rid, ns.info(), ns.display_id, len(self.key), self.start_page * self.page_size,
                          len(self.pages) * self.page_size, self.op_id, [h.hex() for h in self.hashes])

    def __repr__(self) -> str:
        return f"StagedPrefetch(#{self.id} {self.rid} {self.key.namespace.label} {len(self.pages)} pages)"

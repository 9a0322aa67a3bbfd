"""What a page costs on disk in an LMDB store, against its payload: what to provision for a payload capacity.

A store's limits (`CapacityPolicy.capacity_bytes`, namespace quotas and store shares) count payload, the bytes
the engine hands over: that is what eviction can keep exact page by page. The data file is larger, by a part that
depends on the layout, and this module says by how much (`page_disk`); `docs/capacity.md` tabulates it and
`kvc init` prints it for the layout it registers.

Where the bytes go, per page (LMDB's page is the OS page, 4 KiB here):

- the value, ``[u64 checksum][payload]`` (`codec`). A value over LMDB's node limit (~2 KiB at 4 KiB pages) is
  kept in its own run of overflow pages behind a 16-byte page header, so it takes
  ceil((8 + payload + 16) / 4096) whole pages: a 16 KiB page takes 5 (20 KiB) and a 4 KiB page 2 (8 KiB);
  a smaller one sits in a leaf of the `pages` B-tree;
- its metadata (`PageMeta`: ~90 bytes plus the page's token ids, 4 bytes each) in the `meta` B-tree, its entry
  in the `children` index, and the `pages` B-tree's own entry for an overflow value;
- B-tree leaves are filled to ~62-69% by inserts in hash order (random), and a write transaction copies every
  leaf it touches (copy-on-write): once a store has been written over a few transactions its file keeps about
  one spare copy of the trees' leaves, freed pages that later writes reuse (a store written in one transaction
  has none yet: the estimate is the upper figure).

At a capacity the file holds the estimate times the capacity plus about two write batches: a batch's new pages
are written before the pages it evicts are freed, and LMDB reuses a page one transaction frees two transactions
later. The estimate is checked against real stores written in ~4 MiB batches by
tests/unit/storage/lmdb/test_footprint.py (within 10% from 512-byte to 256 KiB pages).
"""

from __future__ import annotations

from ...types.ids import NamespaceId, PageHash
from ...types.keys import PAGE_HASH_BYTES, TOKEN_BYTES
from ...types.layout import KVLayout
from ..api import PageMeta
from ..codec import HEADER, encoder
from ..maintenance import PageDisk

LMDB_PAGE = 4096  # LMDB's page: the OS page size on the machines kvc runs on (LMDB takes it from the OS)
PAGE_HEADER = 16  # LMDB's header at the head of a page, an overflow run's first page included
NODE_HEADER = 8  # LMDB's header of one key/value node in a leaf
SLOT = 2  # a leaf's pointer to each of its nodes
# The largest node a leaf holds inline (LMDB's me_nodemax at 4 KiB pages): a bigger value goes to overflow pages.
NODE_MAX = (((LMDB_PAGE - PAGE_HEADER) // 2) & -2) - SLOT
OVERFLOW_REF = 8  # what a leaf node holds of an overflow value: its first page number
LEAF_FILL = 0.62  # B-tree leaves filled by inserts in random key order (measured 0.62-0.69; the low end)
COW_SPARE = 1.0  # spare copies of the leaves a store keeps from copy-on-write (measured 0.8-1.0)
CHILD_ENTRY = 2 * PAGE_HASH_BYTES  # the children index's dupsort entry: parent hash -> child hash


def overflow_pages(value_bytes: int) -> int:
    """LMDB pages taken by a value of `value_bytes` kept in overflow pages (its 16-byte header included)."""
    return -(-(value_bytes + PAGE_HEADER) // LMDB_PAGE)


def _node(key_bytes: int, value_bytes: int) -> tuple[int, int]:
    """(overflow pages, bytes in a leaf) of one key/value record."""
    if NODE_HEADER + key_bytes + value_bytes > NODE_MAX:
        return overflow_pages(value_bytes), NODE_HEADER + key_bytes + OVERFLOW_REF + SLOT
    return 0, NODE_HEADER + key_bytes + value_bytes + SLOT


def page_disk(layout: KVLayout) -> PageDisk:
    """The data file one page of `layout` takes, by part (see the module docstring)."""
    payload = layout.bytes_per_page
    # A token page's metadata as written (the largest kind: an engine page keeps a key of at most 64 bytes
    # instead of its tokens), times at their full width.
    meta = len(encoder.encode(PageMeta(NamespaceId(b"\0" * 16), b"\0" * 16, PageHash(b"\0" * PAGE_HASH_BYTES),
                                       b"\0" * (TOKEN_BYTES * layout.page_size), payload, 2**64 - 1,
                                       1.7e9, 1.7e9, 2**32)))
    value_pages, value_leaf = _node(PAGE_HASH_BYTES, HEADER + payload)
    meta_pages, meta_leaf = _node(PAGE_HASH_BYTES, meta)
    child_leaf = NODE_HEADER + CHILD_ENTRY + SLOT
    leaves = (value_leaf + meta_leaf + child_leaf) / LEAF_FILL
    value = value_pages * LMDB_PAGE if value_pages else 0
    records = round(leaves) + meta_pages * LMDB_PAGE
    if not value_pages:  # an inline value's share of its leaf counts as the value's
        value = round(value_leaf / LEAF_FILL)
        records -= value
    spare = round(leaves * COW_SPARE)
    return PageDisk(payload, value_pages, value, records, spare)

"""kvcache.tree: the namespace-rooted radix tree over cached token pages; the tree alone writes its nodes.

Modules, each one idea:

- `node`: `TreeNode` and the values the tree hands back (`TreeMatch`, `TreeInsert`, `HostInsert`, `Evicted`,
  `NamespacePages`, `HeldRun`);
- `books`: a tier's books (`TierBook`): its pages per class (protected / held / evictable) and its lazy LRU heap;
- `shares`: a namespace's share of each tier (`ShareState`) and the order eviction takes namespaces over theirs;
- `keeper`: `BookKeeper`, every write of a node's counters (locks, holds, pins, copies, the L3 flag) and the books;
- `radix`: `RadixTree`, keys and structure on top of it: lookup, insert, split, delete, eviction's entry points,
  and the read-only queries diagnostics and operators ask (what each namespace holds, how far a chain is held);
- `evict`: eviction's loop, for either tier; `check`: `RadixTree.check`'s recount.

Names starting with `_` on the tree (`_set_copy`, `_delete`, `_books`, ...) are the package's own: `evict` and
`check` use them, nothing outside the package does.
"""

from ..types.tier import Tier
from .books import TierBook
from .node import Evicted, HeldRun, HostInsert, NamespacePages, TreeInsert, TreeMatch, TreeNode
from .radix import RadixTree
from .shares import ShareState, ShareTier

__all__ = ["Evicted", "HeldRun", "HostInsert", "NamespacePages", "RadixTree", "ShareState", "ShareTier", "Tier", "TierBook", "TreeInsert",
           "TreeMatch", "TreeNode"]

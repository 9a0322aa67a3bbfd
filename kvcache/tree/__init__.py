"""kvcache.tree: the namespace-rooted radix tree over cached token pages (see `radix`)."""

from .radix import Evicted, HostInsert, RadixTree, ShareState, Tier, TreeInsert, TreeMatch, TreeNode

__all__ = ["Evicted", "HostInsert", "RadixTree", "ShareState", "Tier", "TreeInsert", "TreeMatch", "TreeNode"]

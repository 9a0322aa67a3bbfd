"""Byte-exact re-reads of a store after a fault (importable as `storecheck`): every page a namespace holds, found
by walking its prefix tree from the root, must read back as the synthetic KV of its page hash (what the replay
driver and `kvc put` write)."""

from __future__ import annotations

import numpy as np

from kvcache.storage.registry import open_store
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from kvcache.workload.kvdata import SyntheticKV


class Reread:
    """What a re-read found: pages walked, pages read back, pages whose bytes differ (a loss: never allowed)."""

    def __init__(self) -> None:
        self.pages = self.read = self.wrong = 0


def reread(path: str, layout: KVLayout, namespaces: list[Namespace]) -> Reread:
    """Walk every namespace's tree in the store at `path` and compare every page with its synthetic KV."""
    out = Reread()
    kv = SyntheticKV(layout)
    with open_store(path, readonly=True) as store:
        for ns in namespaces:
            level = [store.root(ns, layout)]
            while level:
                hashes = [c.page_hash for h in level for c in store.children(h)]
                if not hashes:
                    break
                buf = np.zeros((len(hashes), layout.bytes_per_page), np.uint8)
                for i, h in enumerate(hashes):  # one page a call: a miss must not hide the pages after it
                    if store.get_into([h], [buf[i]]) == 1:
                        out.read += 1
                        out.wrong += not np.array_equal(buf[i], kv.pages([h]).numpy()[0])
                out.pages += len(hashes)
                level = hashes
    return out

"""kvcache.storage.lmdb."""

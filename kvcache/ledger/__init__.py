"""kvcache.ledger: the slot pools of L1 and L2 (`pools.SlotPool`: a page allocator and the ownership ledger every
move is checked against, over the pages' bytes in `kv.KVPages`: kvc's own tensor or an engine's per-layer tensors) and
the copies of whole pages between them (`copy.Copier`)."""

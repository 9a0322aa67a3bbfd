"""kvcache.ledger: the slot pools of L1 and L2 (`pools.SlotPool`: tensor storage, a page allocator and the ownership
ledger every move is checked against) and the copies of whole pages between them (`copy.copy_pages`)."""

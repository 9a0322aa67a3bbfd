"""kvcache.ledger."""

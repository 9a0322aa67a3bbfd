"""kvcache.engine."""

"""kvcache.ops."""

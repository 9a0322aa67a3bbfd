"""kvcache.types."""

"""Builders shared by the tests: small layouts and caches on the CPU (importable as `factories`)."""

from __future__ import annotations

from kvcache import CacheConfig, KVLayout, TieredCache


def make_layout(page_size: int = 1, model: str = "test-model@r1") -> KVLayout:
    """A tiny layout: 16 bytes per token."""
    return KVLayout(model, layers=1, kv_heads=1, head_dim=4, dtype="float16", page_size=page_size)


def make_cache(page_size: int = 1, device_tokens: int = 64, host_tokens: int = 128, **kw) -> TieredCache:
    """A CPU cache with small pools."""
    return TieredCache(CacheConfig(make_layout(page_size), device_tokens=device_tokens, host_tokens=host_tokens,
                                   device="cpu", **kw))

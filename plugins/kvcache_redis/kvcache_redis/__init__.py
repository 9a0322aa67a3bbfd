"""kvc's L3 page store on Redis / Valkey: `RedisStore`, registered in ``kvcache.storage`` for ``redis://``,
``rediss://``, ``redis+cluster://`` and ``rediss+cluster://`` URLs (see README.md for the key schema)."""

from .store import RedisStore
from .url import DEFAULT_PREFIX

__all__ = ["DEFAULT_PREFIX", "RedisStore"]

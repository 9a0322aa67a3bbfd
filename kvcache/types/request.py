"""Request: what a serving engine schedules — an id, tokens, the namespace they belong to."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ..errors import InvalidInput
from .keys import RadixKey
from .namespace import DEFAULT_NAMESPACE, Namespace


class Request:
    """One request. Immutable; its `key` is built (validated, packed) once, here.

    The namespace is the request's own and is what every key derived from this request carries.
    """

    __slots__ = ("rid", "key", "output_len", "ttl_s")

    rid: str  # unique among live requests of one cache
    key: RadixKey  # tokens + the request's namespace
    output_len: int | None  # tokens the request will generate (workloads); not used for caching
    ttl_s: float | None  # the namespace's time to live this request asks for (clamped to the cache's TTLPolicy
    # max_ttl_s); None: the namespace keeps the one it has (the policy's default at first). Ignored without a policy

    def __init__(self, rid: str, tokens: Iterable[int] | np.ndarray | bytes,
                 namespace: Namespace = DEFAULT_NAMESPACE, output_len: int | None = None,
                 ttl_s: float | None = None) -> None:
        if not isinstance(rid, str) or not rid:
            raise InvalidInput(f"rid must be a non-empty string, got {rid!r}")
        if not isinstance(namespace, Namespace):
            raise InvalidInput(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if output_len is not None and (not isinstance(output_len, int) or output_len < 0):
            raise InvalidInput(f"output_len must be a non-negative integer, got {output_len!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                                  or not 0 < ttl_s < math.inf):
            raise InvalidInput(f"ttl_s must be a number of seconds > 0 and finite, got {ttl_s!r}")
        object.__setattr__(self, "rid", rid)
        object.__setattr__(self, "key", RadixKey.of(tokens, namespace))
        object.__setattr__(self, "output_len", output_len)
        object.__setattr__(self, "ttl_s", ttl_s)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Request is immutable")

    @property
    def namespace(self) -> Namespace:
        """The request's namespace."""
        return self.key.namespace

    @property
    def tokens(self) -> list[int]:
        """Token ids as Python ints."""
        return self.key.tokens

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"Request({self.rid!r}, {len(self)} tokens, {self.namespace!r})"

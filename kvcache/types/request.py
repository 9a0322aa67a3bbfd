"""Request: what a serving engine schedules — an id, tokens, the namespace they belong to."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import InvalidInput
from .keys import TOKEN_BYTES, RadixKey
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
        # Packed bytes (what an engine that keeps its keys hands over) need only their length checked: the rest of
        # pack_tokens is a chain of type tests that costs as much as building the key.
        key = (RadixKey(tokens, namespace) if type(tokens) is bytes and not len(tokens) % TOKEN_BYTES
               else RadixKey.of(tokens, namespace))
        # The slots' own setters: past the __setattr__ that refuses, without object.__setattr__'s lookup by name.
        _SET_RID(self, rid)
        _SET_KEY(self, key)
        _SET_OUTPUT_LEN(self, output_len)
        _SET_TTL_S(self, ttl_s)

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


# Request's slot setters (member descriptors' __set__), looked up once: __init__ fills the slots through them.
_SET_RID: Any = Request.__dict__["rid"].__set__
_SET_KEY: Any = Request.__dict__["key"].__set__
_SET_OUTPUT_LEN: Any = Request.__dict__["output_len"].__set__
_SET_TTL_S: Any = Request.__dict__["ttl_s"].__set__

"""FingerprintKey: the secret that keys every salt fingerprint and display id an output shows, as a value.

A namespace is shown by its extra_key and a *salt fingerprint* (12 hex digits), and named by a *display id* (16 hex
digits) — digests keyed by a per-deployment secret kept with the store (a 0600 key file beside an LMDB store, the
format record of a shared store; `kvcache.storage.keyfile`), so a value seen in a metric or a log cannot be turned
back into a short salt by anyone without the key. The store's registry records fingerprints under that key, so an
output matches `kvc ns ls` only when it is keyed by the same store's key.

The key is context, and context travels with the object that owns it: a store has its key, a cache takes its
store's (`TieredCache.fingerprints`), and whatever renders a fingerprint for the cache is handed the cache's key in
its constructor. There is no key of the process: two stores with different keys in one process each show their
own fingerprints.

Where a key comes from: a store's key file or format record (`FingerprintKey(secret)`); else env
`KVC_FINGERPRINT_KEY` (hex: one key for a whole deployment); else, for a cache without a store, a random key of its
own (`FingerprintKey.of(None)`: its fingerprints match nothing outside it, which is safe but useless for
correlation). A context that must never show a value keyed by a random key (the kvc CLI: one key per store for
every message) holds a *withheld* key instead (`FingerprintKey.withheld(where, why)`): deriving anything from it
raises KeyFileError naming `where` and `why`.
"""

from __future__ import annotations

import hmac
import os

from ..errors import InvalidInput, KeyFileError
from .ids import DisplayId, NamespaceId
from .namespace import Namespace, NamespaceInfo, display_id

FINGERPRINT_KEY_ENV = "KVC_FINGERPRINT_KEY"
FINGERPRINT_KEY_BYTES = 32  # of a key drawn here; one given may be 16..64 bytes (blake2b's key limit)
_KEY_RANGE = (16, 64)


def parse_fingerprint_key(text: str, source: str = FINGERPRINT_KEY_ENV) -> bytes:
    """A fingerprint key from its hex form (32 to 128 hex digits); InvalidInput naming `source` otherwise (never
    echoing the text: it is a secret)."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if not _KEY_RANGE[0] <= len(key) <= _KEY_RANGE[1]:
        raise InvalidInput(f"{source}: a fingerprint key is {2 * _KEY_RANGE[0]} to {2 * _KEY_RANGE[1]} hex digits "
                           f"(this one is not: its length and text are not echoed, it is a secret)")
    return key


def env_fingerprint_key() -> bytes | None:
    """The key in env KVC_FINGERPRINT_KEY, or None when it is unset or empty."""
    text = os.environ.get(FINGERPRINT_KEY_ENV, "")
    return parse_fingerprint_key(text) if text.strip() else None


def new_fingerprint_key() -> bytes:
    """The key a new store records: env KVC_FINGERPRINT_KEY when set (one key for a whole deployment), else
    FINGERPRINT_KEY_BYTES random bytes."""
    return env_fingerprint_key() or os.urandom(FINGERPRINT_KEY_BYTES)


class FingerprintKey:
    """A fingerprint key, or the reason none is at hand (withheld). Immutable; its repr never shows the secret.

    A plain class rather than a msgspec Struct on purpose: it must never be encoded into an output or a file.
    """

    __slots__ = ("_secret", "_withheld")

    _secret: bytes
    _withheld: tuple[str, str] | None  # (where, why) of a withheld key; None when the secret is at hand

    def __init__(self, secret: bytes) -> None:
        """The key `secret` (16 to 64 bytes: a store's `fingerprint_key`); InvalidInput otherwise."""
        if not isinstance(secret, bytes) or not _KEY_RANGE[0] <= len(secret) <= _KEY_RANGE[1]:
            size = len(secret) if isinstance(secret, bytes) else type(secret).__name__
            raise InvalidInput(f"a fingerprint key is {_KEY_RANGE[0]} to {_KEY_RANGE[1]} bytes, got {size}")
        object.__setattr__(self, "_secret", secret)
        object.__setattr__(self, "_withheld", None)

    @classmethod
    def withheld(cls, where: str, why: str) -> FingerprintKey:
        """No key: every fingerprint or display id asked of it raises KeyFileError(`where`, `why`)."""
        key = cls.__new__(cls)
        object.__setattr__(key, "_secret", b"")
        object.__setattr__(key, "_withheld", (where, why))
        return key

    @classmethod
    def of(cls, secret: bytes | None) -> FingerprintKey:
        """`secret` when given (a store's key), else env KVC_FINGERPRINT_KEY, else a random key of this value's own
        (what a cache without a store's key shows its fingerprints under)."""
        if secret is not None:
            return cls(secret)
        return cls(env_fingerprint_key() or os.urandom(FINGERPRINT_KEY_BYTES))

    @classmethod
    def or_withheld(cls, secret: bytes | None, where: str, why: str) -> FingerprintKey:
        """`secret` when given, else env KVC_FINGERPRINT_KEY, else withheld (`where`, `why`): never a random key."""
        if secret is None:
            secret = env_fingerprint_key()
        return cls(secret) if secret is not None else cls.withheld(where, why)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("FingerprintKey is immutable")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FingerprintKey) and other._withheld == self._withheld
                and hmac.compare_digest(other._secret, self._secret))

    def __hash__(self) -> int:
        return hash((self._secret, self._withheld))

    def __repr__(self) -> str:
        return f"FingerprintKey(withheld: {self._withheld[0]})" if self._withheld else "FingerprintKey(<secret>)"

    def __reduce__(self) -> tuple[object, ...]:
        # a copy for a worker process of the same program (a sweep's); never into a file format of ours
        if self._withheld is not None:
            return (FingerprintKey.withheld, self._withheld)
        return (FingerprintKey, (self._secret,))

    @property
    def is_withheld(self) -> bool:
        """True when no key is at hand: anything derived from this one raises KeyFileError."""
        return self._withheld is not None

    @property
    def secret(self) -> bytes:
        """The key's bytes (to hand to a store-level call that takes them); KeyFileError when withheld."""
        if self._withheld is not None:
            raise KeyFileError(*self._withheld)
        return self._secret

    @property
    def known(self) -> bytes | None:
        """The key's bytes, or None when withheld: for an output that shows a keyed value when it can and goes
        without it otherwise (a monitoring user who may not read the store's key)."""
        return None if self._withheld is not None else self._secret

    def fingerprint(self, namespace: Namespace) -> str | None:
        """`namespace`'s salt fingerprint under this key (None without a salt); KeyFileError when withheld."""
        return namespace.fingerprint(self.secret)

    def display_id(self, ns_id: NamespaceId) -> DisplayId:
        """How the namespace id `ns_id` is shown (16 hex digits) under this key; KeyFileError when withheld."""
        return display_id(ns_id, self.secret)

    def info(self, namespace: Namespace) -> NamespaceInfo:
        """`namespace`'s printable fields, its fingerprint under this key; KeyFileError when withheld."""
        return namespace.info(self.secret)

    def label(self, namespace: Namespace) -> str:
        """``extra_key/salt_fingerprint`` under this key, ``-`` for an absent part: a namespace in a message."""
        fingerprint = self.fingerprint(namespace)
        return f"{namespace.extra_key if namespace.extra_key is not None else '-'}/{fingerprint or '-'}"

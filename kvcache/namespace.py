"""Namespace: the (extra_key, cache_salt) a request carries, as one canonical value.

Two requests share cached KV only when tokens *and* namespace match. Everything keyed by tokens in kvcache
(tree keys, page hashes, staged records) carries a Namespace, and it is always the namespace of the request that
caused the key — never one read off a tree node.

The salt is a secret that makes prefix sharing opt-in. It is held only to derive `id` and `salt_fingerprint` and
never leaves this object: not in repr/str, not in msgspec encoding (a Namespace cannot be encoded at all; encode
`info()` instead), not on disk.
"""

from __future__ import annotations

import hashlib

import msgspec

from .errors import InvalidNamespace

# Keys of the two digests. Fixed, so ids and fingerprints agree across processes and machines (the L3 store
# and the CLI compare them); distinct, so a namespace id never equals a salt fingerprint.
_ID_KEY = b"kvc.namespace.id.v1"
_FINGERPRINT_KEY = b"kvc.salt.fingerprint.v1"


def _field(value: str | None) -> bytes:
    # Length-prefixed so ("ab", "c") and ("a", "bc") never collide; None encodes apart from every string.
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def _canonical(value: object, name: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidNamespace(f"{name} must be a string or None, got {type(value).__name__}")
    return value


class NamespaceInfo(msgspec.Struct, frozen=True):
    """The printable face of a Namespace: what CLI output, JSON and the store's registry show."""

    extra_key: str | None
    salt_fingerprint: str | None


class Namespace:
    """A frozen, hashable (extra_key, cache_salt) pair; ``""`` and ``None`` are the same default namespace.

    Normalised here and nowhere else. Equality and hashing go through `id`, a 16-byte digest of both fields.
    """

    __slots__ = ("extra_key", "_salt", "id", "salt_fingerprint", "_hash")

    extra_key: str | None
    id: bytes  # 16-byte blake2b of both fields; the L3 root seed and the store registry key
    salt_fingerprint: str | None  # 12 hex chars of a keyed digest of the salt; None without a salt

    def __init__(self, extra_key: str | None = None, cache_salt: str | None = None) -> None:
        extra_key = _canonical(extra_key, "extra_key")
        salt = _canonical(cache_salt, "cache_salt")
        ident = hashlib.blake2b(_field(extra_key) + _field(salt), digest_size=16, key=_ID_KEY).digest()
        fingerprint = (
            None if salt is None
            else hashlib.blake2b(salt.encode("utf-8"), digest_size=6, key=_FINGERPRINT_KEY).hexdigest()
        )
        set_ = object.__setattr__
        set_(self, "extra_key", extra_key)
        set_(self, "_salt", salt)
        set_(self, "id", ident)
        set_(self, "salt_fingerprint", fingerprint)
        set_(self, "_hash", hash(ident))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Namespace is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Namespace({self.label})"

    __str__ = __repr__

    def __reduce__(self):
        # Pickling (multiprocessing) must reproduce the value; the salt crosses only into a process of the same
        # program, never into a file format of ours.
        return (Namespace, (self.extra_key, self._salt))

    @property
    def has_salt(self) -> bool:
        """True when the namespace carries a cache_salt."""
        return self._salt is not None

    @property
    def is_default(self) -> bool:
        """True for the namespace of requests with neither extra_key nor cache_salt."""
        return self.extra_key is None and self._salt is None

    @property
    def id_hex(self) -> str:
        """`id` as 32 hex characters."""
        return self.id.hex()

    @property
    def label(self) -> str:
        """A short human label: ``extra_key/salt_fingerprint`` with ``-`` for an absent part. Safe to log."""
        return f"{self.extra_key if self.extra_key is not None else '-'}/{self.salt_fingerprint or '-'}"

    def info(self) -> NamespaceInfo:
        """The public, printable fields (never the salt)."""
        return NamespaceInfo(self.extra_key, self.salt_fingerprint)


DEFAULT_NAMESPACE = Namespace()

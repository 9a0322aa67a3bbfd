"""Namespace: the (extra_key, cache_salt) a request carries, as one canonical value.

Two requests share cached KV only when tokens *and* namespace match. Everything keyed by tokens in kvcache
(tree keys, page hashes, staged records) carries a Namespace, and it is always the namespace of the request that
caused the key — never one read off a tree node.

The salt is a secret that makes prefix sharing opt-in. It is held only to derive `id` and `salt_fingerprint` and
never leaves this object: not in repr/str, not in msgspec encoding (a Namespace cannot be encoded at all; encode
`info()` instead), not on disk.

Two digests, two keys:

- `id` seeds the page-hash chain of the namespace in L3 (`kvcache.types.keys.hash_root`), so every process and every
  machine sharing a store must derive the same id from the same (extra_key, salt). Its key is fixed (`_ID_KEY`).
  Because an id and its extra_key would let anyone brute-force a short salt offline, an id is never shown as is:
  outputs show `display_id`, a digest of the id under the fingerprint key.
- `salt_fingerprint` is what outputs, metrics and the store's registry show in place of the salt. It is keyed by
  a per-deployment secret, the *fingerprint key*, kept with the store (a 0600 key file beside an LMDB store, the
  format record of a shared store; `kvcache.storage.keyfile`), never a constant in the code, so a fingerprint
  seen in a metric or a log cannot be turned back into a short salt by anyone without the key.

The fingerprint key is context, not a property of the namespace: every keyed value here takes the key as an
argument, and the key travels with the object that owns it (`kvcache.types.fingerprint_key.FingerprintKey`: a
store's, a cache's). Without one, `label` and `info(None)` show a salted namespace's fingerprint as unknown (`?`).
"""

from __future__ import annotations

import hashlib

import msgspec

from ..errors import InvalidNamespace
from .ids import DisplayId, NamespaceId

# The key of `id`: fixed, so ids agree across processes and machines (they seed the L3 page hashes). Not a
# secret: ids are never printed (see `display_id`).
_ID_KEY = b"kvc.namespace.id.v1"
# Personalisation of the keyed digests, so a fingerprint and a display id never coincide for one input.
_FINGERPRINT_PERSON = b"kvc.salt.fp.v2"
_DISPLAY_PERSON = b"kvc.ns.shown.v1"

# What a store's registry records as the salt fingerprint of a salted namespace registered under an earlier key
# (`kvc init --rekey`): the salt is never stored, so its fingerprint under the new key is unknown until the
# namespace's next write records it. Never a valid fingerprint (those are 12 hex digits).
UNKNOWN_FINGERPRINT = "?"


def display_id(ns_id: NamespaceId, key: bytes) -> DisplayId:
    """How a namespace id is shown (16 hex digits): a digest of the id under the fingerprint key `key`. An id
    shown as is, next to its extra_key, would let a short salt be brute-forced offline."""
    return DisplayId(hashlib.blake2b(ns_id, digest_size=8, key=key, person=_DISPLAY_PERSON).hexdigest())


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
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate: Python's stand-in for bytes that were not UTF-8 (e.g. on a command line). It has no
        # digest and no JSON form. The value is not echoed: it may be the salt; nor is where the undecodable byte
        # sits (a position measured in a salt says something of it).
        raise InvalidNamespace(f"{name} is not valid UTF-8 text (it holds an undecodable byte)") from None
    return value


class NamespaceInfo(msgspec.Struct, frozen=True):
    """The printable face of a Namespace: what CLI output, JSON and the store's registry show."""

    extra_key: str | None
    salt_fingerprint: str | None


class Namespace:
    """A frozen, hashable (extra_key, cache_salt) pair; ``""`` and ``None`` are the same default namespace.

    Normalised here and nowhere else. Equality and hashing go through `id`, a 16-byte digest of both fields.
    """

    __slots__ = ("extra_key", "_salt", "id", "_hash", "_fingerprint")

    extra_key: str | None
    _salt: str | None  # the secret: never printed, logged or stored; only digests of it leave this object
    _hash: int  # hash(id), once
    _fingerprint: tuple[bytes, str | None]  # (key, fingerprint under it): the last one computed
    id: NamespaceId  # 16-byte blake2b of both fields; the L3 root seed and the store registry key (never printed)

    def __init__(self, extra_key: str | None = None, cache_salt: str | None = None) -> None:
        extra_key = _canonical(extra_key, "extra_key")
        salt = _canonical(cache_salt, "cache_salt")
        ident = NamespaceId(hashlib.blake2b(_field(extra_key) + _field(salt), digest_size=16, key=_ID_KEY).digest())
        set_ = object.__setattr__
        set_(self, "extra_key", extra_key)
        set_(self, "_salt", salt)
        set_(self, "id", ident)
        set_(self, "_hash", hash(ident))
        set_(self, "_fingerprint", (b"", None))  # (key, fingerprint under it): the last one computed

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Namespace is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Namespace({self.label})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[type[Namespace], tuple[str | None, str | None]]:
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
        """`id` as 32 hex characters (internal: the store's registry key; outputs show `display_id`)."""
        return self.id.hex()

    def fingerprint(self, key: bytes) -> str | None:
        """The salt fingerprint under `key` (a store's fingerprint key); None without a salt."""
        if self._salt is None:
            return None
        last_key, last = self._fingerprint
        if last_key == key:
            return last
        fingerprint = hashlib.blake2b(self._salt.encode("utf-8"), digest_size=6, key=key,
                                      person=_FINGERPRINT_PERSON).hexdigest()
        object.__setattr__(self, "_fingerprint", (key, fingerprint))
        return fingerprint

    @property
    def label(self) -> str:
        """A short human label keyed by nothing: ``extra_key/?`` for a salted namespace (which salt is not said),
        ``extra_key/-`` without one, ``-`` for an absent extra_key. Safe to log anywhere; where a fingerprint key
        is at hand, `FingerprintKey.label` names the salt by its fingerprint."""
        salt = UNKNOWN_FINGERPRINT if self.has_salt else "-"
        return f"{self.extra_key if self.extra_key is not None else '-'}/{salt}"

    def info(self, key: bytes | None) -> NamespaceInfo:
        """The public, printable fields (never the salt), the fingerprint under `key` (a store's fingerprint key);
        without a key a salted namespace's fingerprint is unknown (UNKNOWN_FINGERPRINT, as a registry records it)."""
        if key is None:
            return NamespaceInfo(self.extra_key, UNKNOWN_FINGERPRINT if self.has_salt else None)
        return NamespaceInfo(self.extra_key, self.fingerprint(key))


DEFAULT_NAMESPACE = Namespace()

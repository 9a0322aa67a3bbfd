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

The fingerprint key of this process: the one given to `use_fingerprint_key` (the kvc CLI passes its store's,
and so should an engine that shows fingerprints: `use_fingerprint_key(store.fingerprint_key)`), else env
`KVC_FINGERPRINT_KEY` (hex), else a random key drawn once per process (fingerprints then match nothing outside
the process, which is safe but useless for correlation). A store records fingerprints under its own key.

A process that must never show a value keyed by a random key (the kvc CLI: one key per store for every message)
calls `withhold_fingerprint_key(where, why)` instead: until a key is given, deriving a fingerprint or display id
raises KeyFileError naming `where` and `why`, and `known_fingerprint_key()` says whether one is at hand.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import threading
from collections.abc import Iterator

import msgspec

from ..errors import InvalidInput, InvalidNamespace, KeyFileError
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

FINGERPRINT_KEY_ENV = "KVC_FINGERPRINT_KEY"
FINGERPRINT_KEY_BYTES = 32  # of a key drawn here; one given may be 16..64 bytes (blake2b's key limit)
_KEY_RANGE = (16, 64)

_key_lock = threading.Lock()
_process_key: bytes | None = None  # given by use_fingerprint_key
_drawn_key: bytes | None = None  # the random key of this process, drawn on first need; never "known"
# (where, why) while a random key is refused in this context (`withhold_fingerprint_key`): a context variable, so a
# CLI command run inside a host process (an in-process server thread, a test) withholds it from itself only
_withheld: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("kvc_withheld_key", default=None)


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


def fingerprint_key() -> bytes:
    """The fingerprint key of this process (see the module docstring for where it comes from). KeyFileError
    while the key is withheld (`withhold_fingerprint_key`) and none is at hand."""
    global _drawn_key
    with _key_lock:
        if _process_key is not None:
            return _process_key
    env = env_fingerprint_key()
    if env is not None:
        return env
    withheld = _withheld.get()
    if withheld is not None:
        raise KeyFileError(*withheld)
    with _key_lock:
        if _drawn_key is None:
            _drawn_key = os.urandom(FINGERPRINT_KEY_BYTES)
        return _drawn_key


def known_fingerprint_key() -> bytes | None:
    """The key given to this process or in env KVC_FINGERPRINT_KEY; None when neither (never draws a random one):
    what a message may key a fingerprint by when it must match what the store shows."""
    with _key_lock:
        if _process_key is not None:
            return _process_key
    return env_fingerprint_key()


def use_fingerprint_key(key: bytes | None) -> None:
    """Make `key` the fingerprint key of this process (None: back to env KVC_FINGERPRINT_KEY or a random key)."""
    global _process_key
    if key is not None and not _KEY_RANGE[0] <= len(key) <= _KEY_RANGE[1]:
        raise InvalidInput(f"a fingerprint key is {_KEY_RANGE[0]} to {_KEY_RANGE[1]} bytes, got {len(key)}")
    with _key_lock:
        _process_key = key


def withhold_fingerprint_key(where: str, why: str) -> None:
    """Never key by a random key in this context (this thread, and what runs in it): until `use_fingerprint_key`
    gives one, a fingerprint or display id derived here raises KeyFileError(`where`, `why`) (env
    KVC_FINGERPRINT_KEY, and a key given before, still count)."""
    _withheld.set((where, why))


@contextlib.contextmanager
def fingerprint_key_scope() -> Iterator[None]:
    """Whatever `use_fingerprint_key` or `withhold_fingerprint_key` is called with inside, the process's key is
    restored on leaving (a CLI command run inside a test or a host process must not re-key the host's
    namespaces)."""
    global _process_key
    with _key_lock:
        saved = _process_key
    token = _withheld.set(_withheld.get())
    try:
        yield
    finally:
        with _key_lock:
            _process_key = saved
        _withheld.reset(token)


def display_id(ns_id: NamespaceId, key: bytes | None = None) -> DisplayId:
    """How a namespace id is shown (16 hex digits): a digest of the id under the fingerprint key (default: this
    process's). An id shown as is, next to its extra_key, would let a short salt be brute-forced offline."""
    return DisplayId(hashlib.blake2b(ns_id, digest_size=8, key=key if key is not None else fingerprint_key(),
                                     person=_DISPLAY_PERSON).hexdigest())


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

    @property
    def display_id(self) -> DisplayId:
        """The id as outputs show it: keyed by this process's fingerprint key (see `display_id()`)."""
        return display_id(self.id)

    @property
    def salt_fingerprint(self) -> str | None:
        """12 hex digits of a digest of the salt keyed by this process's fingerprint key; None without a salt."""
        return self.fingerprint(fingerprint_key())

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
        """A short human label: ``extra_key/salt_fingerprint`` with ``-`` for an absent part. Safe to log."""
        return f"{self.extra_key if self.extra_key is not None else '-'}/{self.salt_fingerprint or '-'}"

    def info(self, key: bytes | None = None) -> NamespaceInfo:
        """The public, printable fields (never the salt); the fingerprint under `key` (default: this process's
        fingerprint key)."""
        return NamespaceInfo(self.extra_key, self.fingerprint(key) if key is not None else self.salt_fingerprint)


DEFAULT_NAMESPACE = Namespace()

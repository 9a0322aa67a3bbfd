"""The exception hierarchy of kvcache.

Expected outcomes (a miss, a full pool, a declined prefetch) are values, never exceptions. What is raised is
either bad input from the caller, a broken invariant, or a storage fault the caller must see::

    KVCacheError                      every error kvcache raises
    ├── InvalidInput (ValueError)     the caller passed something unusable; nothing was changed
    │   ├── InvalidNamespace          extra_key / cache_salt of the wrong type
    │   ├── InvalidTokens             a token outside 0 <= t < 2**32, or not an integer
    │   ├── InvalidLayout             a KVLayout field out of range, an unknown dtype
    │   ├── InvalidConfig             a CacheConfig that cannot be built (pool sizes, policy)
    │   ├── UnknownRequest            a request id that is not live (commit/release), or live twice (admit)
    │   │   └── RequestIdInUse        ... that already holds a prefetch, staged record or admission for another
    │   │                             request (other tokens or namespace): refused before anything moves
    │   ├── CacheClosed               a call on a TieredCache after its close()
    │   ├── InvalidTrace              a workload trace line that is not a valid request (names the line)
    │   ├── EventEndpointError        a KV-event endpoint that cannot be bound or connected to (names it)
    │   └── EngineUnsupported         an engine's interface, pool layout or setting the kvc adapter does not
    │                                 support (names the engine and what it asked for)
    ├── InvariantViolation            kvcache's own bookkeeping is broken: fail loudly, never continue silently
    │   ├── OwnershipError            a ledger move whose source owner is not the slot's current owner
    │   │   └── DoubleFree            ... because the slot is already FREE
    │   ├── LockUnderflow             unlock of a node path that is not locked
    │   └── NamespaceMismatch         a key, anchor or staged record of another namespace than its request
    └── StoreError                    the L3 store cannot be used as asked (each names the path)
        ├── NotAStore                 a path that is not a kvc store (a regular file, a foreign LMDB)
        ├── StoreReadOnly             writing to a store opened read-only or at a read-only location
        ├── StoreAccessDenied         the OS refuses to let this user read the store's files (permissions)
        ├── StoreChanged              a lock-free read that writers overtook (its pages may have been reused)
        ├── StoreClosed               a call on a store handle after its close (or racing it); nothing was read or
        │                             written
        ├── StoreFull                 the disk (not the store's own capacity limit) has no room left
        ├── RepairRefused             a repair that would replace a file that is not LMDB, or keep no page
        ├── StoreDamaged              the data file is damaged where no read may go (empty, cut short, LMDB's page
        │                             map): refused before LMDB maps it
        ├── KeyFileError              the store's fingerprint key is missing, not a key, or not readable here
        │   └── KeyMismatch           a valid key, but not the one the store's pages were written under
        ├── LayoutMismatch            the KVLayout asked for is not one the store holds
        ├── StoreUnsupported          a kvc store this install cannot open (newer format, missing checksum)
        └── UnknownBackend            a URL scheme no installed L3 backend is registered for
    └── AdminError                    a live cache's admin socket cannot answer as asked (each names the socket)
        ├── AdminUnavailable          no server on the socket (no file, a stale socket, the connection dropped)
        ├── AdminUntrusted            the server on the socket runs as a uid the client does not trust
        ├── AdminShuttingDown         the server stopped a running request between two steps (it is closing)
        ├── AdminSocketInUse          serving on a socket path where a live server answers, or that is no socket
        ├── AdminProtocolMismatch     the two ends speak different protocol versions (names both)
        ├── AdminTimeout              no answer within the client's timeout
        ├── AdminBadFrame             a frame that is not a valid request or response (size, framing, types)
        └── AdminRemoteError          the server ran the request and it failed there (carries the remote kind)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .types.ids import NodeId


class KVCacheError(Exception):
    """Base of every exception raised by kvcache."""


class InvalidInput(KVCacheError, ValueError):
    """The caller passed something unusable; no state was changed."""


class InvalidNamespace(InvalidInput):
    """An extra_key or cache_salt that is not a string or None."""


class InvalidTokens(InvalidInput):
    """Token ids that are not integers in 0 <= t < 2**32."""


class InvalidLayout(InvalidInput):
    """A KVLayout field out of range or an unknown dtype."""


class InvalidConfig(InvalidInput):
    """A CacheConfig that cannot be built."""


class UnknownRequest(InvalidInput):
    """A request id that is not live where a live one is needed, or already live at admit."""

    def __init__(self, rid: str, why: str) -> None:
        self.rid = rid
        super().__init__(f"request {rid!r}: {why}")


class RequestIdInUse(UnknownRequest):
    """A request id that already holds something (a prefetch, a staged record, an admission) for another
    request: other tokens or another namespace. Refused before anything moves, so a reused id can never be
    handed KV that was fetched or computed for someone else."""


class CacheClosed(InvalidInput):
    """A call on a TieredCache after `close()`: its I/O worker is stopped and its holds are given back."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what}: the cache is closed")


class InvalidTrace(InvalidInput):
    """A line of a JSONL workload trace that is not a valid request: carries the source and the line number."""

    def __init__(self, source: str, line: int, why: str) -> None:
        self.source = source
        self.line = line
        super().__init__(f"{source}:{line}: {why}")


class EventEndpointError(InvalidInput):
    """A ZeroMQ endpoint of the KV-event feed that cannot be bound (publisher) or connected to (subscriber): a
    malformed address, a port in use, a missing directory. Names the endpoint."""

    def __init__(self, endpoint: str, why: str) -> None:
        self.endpoint = endpoint
        super().__init__(f"KV-event endpoint {endpoint!r}: {why}")


class EngineUnsupported(InvalidInput):
    """An engine adapter (`kvcache.engines`) was asked for an interface, a host-pool layout or a setting it does
    not support, e.g. SGLang's hybrid-model v2 pools. Raised at construction or registration, never from an I/O
    call. Names the engine and what it asked for."""

    def __init__(self, engine: str, what: str) -> None:
        self.engine = engine
        self.what = what
        super().__init__(f"{engine}: {what} is not supported by kvc's adapter")


class InvariantViolation(KVCacheError):
    """kvcache's own bookkeeping is broken. Never caught to continue silently."""


class OwnershipError(InvariantViolation):
    """A ledger move found a slot whose current owner is not the one the move expected.

    Raised before anything changed: a ledger operation is all-or-nothing. Carries the first offending page, its
    slot range, the owner the move expected and the owner the ledger holds, and how many pages disagreed.
    """

    def __init__(self, pool: str, op: str, page: int, slots: tuple[int, int], expected: str, actual: str,
                 mismatched: int) -> None:
        self.pool, self.op, self.page, self.slots = pool, op, page, slots
        self.expected, self.actual, self.mismatched = expected, actual, mismatched
        super().__init__(
            f"{pool} {op}: page {page} (slots {slots[0]}..{slots[1]}) is owned by {actual}, expected {expected}"
            + (f" ({mismatched} pages disagree)" if mismatched > 1 else "")
        )


class DoubleFree(OwnershipError):
    """A free or transfer of a slot that is already FREE."""


class LockUnderflow(InvariantViolation):
    """An unlock (or a hold's release) of a node whose count (or the count of an ancestor) is already zero."""

    def __init__(self, node_id: NodeId, namespace: str, what: str = "lock") -> None:
        self.node_id, self.namespace, self.what = node_id, namespace, what
        super().__init__(f"{what} underflow at node {node_id} (namespace {namespace})")


class NamespaceMismatch(InvariantViolation):
    """A key, anchor or staged record whose namespace is not its request's. Names both by fingerprint only."""

    def __init__(self, rid: str, expected: str, actual: str, where: str) -> None:
        self.rid, self.expected, self.actual, self.where = rid, expected, actual, where
        super().__init__(f"request {rid!r}: {where} is in namespace {actual}, request is in {expected}")


class StoreError(KVCacheError):
    """The L3 store cannot be used as asked."""

    def __init__(self, path: str, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{path}: {message}")


class NotAStore(StoreError):
    """A path that is not a kvc store."""


class StoreReadOnly(StoreError):
    """A write to a store opened read-only or at a read-only location."""


class StoreAccessDenied(StoreError):
    """The OS refuses this user access to the store's files (EACCES/EPERM on a read): a permission problem, never
    damage. Names the path and what was refused."""


class StoreChanged(StoreError):
    """A read of a store opened lock-free (LMDB without its lock file: read-only monitoring) that writers
    overtook: more than one transaction committed while it ran, so a writer may have reused pages it read, and
    its result cannot be trusted. Nothing is damaged; the read can be run again."""


class StoreFull(StoreError):
    """The disk under the store is full."""


class LayoutMismatch(StoreError):
    """The KVLayout asked for is not one the store holds. Names the one asked for and every one held."""

    def __init__(self, path: str, requested: str, held: list[str]) -> None:
        self.requested, self.held = requested, list(held)
        listing = "; ".join(self.held) if self.held else "none"
        super().__init__(path, f"layout {requested} is not in this store (it holds: {listing})")


class StoreUnsupported(StoreError):
    """A kvc store written by a newer format version, or with a checksum this install does not have."""


class UnknownBackend(StoreError):
    """A store URL whose scheme no backend in the entry-point group `kvcache.storage` is registered for."""


class AdminError(KVCacheError):
    """The admin socket of a live cache cannot answer as asked. Names the socket."""

    def __init__(self, path: str, message: str) -> None:
        self.path = str(path)
        super().__init__(f"{path}: {message}" if path else message)


class AdminUnavailable(AdminError):
    """No server answers on the socket: no such file, a stale socket file, or the server went away mid-request."""


class AdminUntrusted(AdminError):
    """The process serving the socket runs as a uid the client does not trust: nothing was sent to it."""


class AdminShuttingDown(AdminError):
    """Raised on a server's owner thread between two steps of a running request (a replay) once the server is
    closing: the request stops there, releases what it held, and its client is answered `shutting_down`."""


class AdminSocketInUse(AdminError):
    """A server was asked to listen on a path where a live server answers (or that is not a socket)."""


class AdminProtocolMismatch(AdminError):
    """The client and the server speak different admin protocol versions. Names both."""

    def __init__(self, path: str, client: int, server: int) -> None:
        self.client, self.server = client, server
        super().__init__(path, f"admin protocol mismatch: the client speaks version {client}, the server speaks "
                               f"version {server} (use a kvc of the server's version)")


class AdminTimeout(AdminError):
    """No answer came within the client's timeout (the request may still run on the server)."""

    def __init__(self, path: str, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(path, f"no answer within {seconds:g} s (raise --timeout; the request may still run)")


class AdminBadFrame(AdminError):
    """A frame that is not a valid admin request or response: oversized, truncated, not msgpack, wrong types."""


class AdminRemoteError(AdminError):
    """The server received the request and it failed there. `kind` is the server's error kind (the kvcache error
    class raised, or bad_frame / bad_request / protocol_version / busy / shutting_down / internal)."""

    def __init__(self, path: str, kind: str, message: str) -> None:
        self.kind, self.remote_message = kind, message
        super().__init__(path, message)


class RepairRefused(StoreError):
    """A repair that would destroy more than it saves: it would keep nothing, or the file is not LMDB (its owner
    may force it). The store is left as it was."""


class KeyFileError(StoreError):
    """The store's fingerprint key (an LMDB store's ``fingerprint.key``) is missing, empty, not a key, or not
    readable by this user where the command needs it: the store's fingerprints and display ids cannot be derived.
    Names the file and the way out (restore it, or `kvc init --rekey`)."""


class StoreClosed(StoreError):
    """A call on a store handle after its close(), or one that raced the close on another thread: nothing was read
    or written (a store handle's close waits for the reads and writes already in flight)."""

    def __init__(self, path: str, message: str = "the store handle is closed") -> None:
        super().__init__(path, message)


class StoreDamaged(StoreError):
    """The store's data file is damaged where no read may go (empty, cut short, LMDB's own page map broken): it is
    refused before LMDB maps it (a read past a cut end is a SIGBUS no caller can catch). Names what is wrong and
    the way out (`kvc audit` says what is lost, `kvc audit --repair` rebuilds from what is left)."""


class KeyMismatch(KeyFileError):
    """The store's key file holds a valid key, but not the one its pages were written under: the chain roots its
    registry recorded are none of the roots this key gives (a wrong backup restored, a tool that wrote a fresh
    key). Refused before anything is written or removed under it; names the way out (restore the right key)."""

"""The store's key schema under its prefix (`Keys`) and its format record (`read_format`): what a store already
written holds, so both stay byte-identical from one kvc to the next.

Key schema (P is the key prefix, default ``kvc:``; several deployments share one Redis under distinct prefixes)::

    P format             string  StoreFormat (msgpack): magic, version, checksum algorithm, created,
                                 fingerprint key (hex)
    P layouts            hash    layout id hex -> LayoutRecord (msgpack)
    P nsidx              set     namespace id hex of every registered namespace
    P shares             hash    <ns id hex> -> NamespaceShares (msgpack); b:<ns id hex> -> its store share in
                                 bytes (only when > 0: what the put script reads). Outlives the namespace's pages
    P ns:<ns id hex>     hash    the namespace record (identity, never the salt; counters; roots)
    P p:<page hash hex>  hash    one page: checksum + payload, PageMeta, namespace, parent, hits, last access
    P c:<hash hex>       set     raw 16-byte hashes of the stored children of a page or of a namespace root
    P serves             hash    token -> ServeRecord (msgpack): the live caches serving the store, their sockets
    P dropseq            string  the number of the last drop recorded (INCR)
    P drops              zset    DropRecord (msgpack) scored by its number; the last DROPS_KEPT are kept
    P rm                 hash    the removal log (kvcache.storage.removals): why and when pages (and namespaces
                                 removed whole) went, a ring of the last REMOVALS_KEPT (scripts.RECORD_LOG)

Hashes are hex in key names: a raw hash could contain ``{``...``}`` and make a cluster hash tag. The fields of a
page record and of a namespace record are described in `scripts`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvcache.storage.kit import (
    CHECKSUMS,
    FORMAT_MAGIC,
    FORMAT_VERSION,
    KEYED_ROOTS_VERSION,
    NotAStore,
    StoreError,
    StoreFormat,
    StoreUnsupported,
    decode_format,
    encoder,
    new_chain_key,
    new_fingerprint_key,
)

from .connection import FAULTS, said
from .url import StoreUrl

CHECKSUM = "xxh3_64"  # codec.CHECKSUMS: the same algorithm, under the same name, as the LMDB backend's default
XXH3 = CHECKSUMS[CHECKSUM]  # a page's `d` field is a codec page value: [u64 checksum][payload]


def glob_escape(text: str) -> str:
    """`text` as a literal in a Redis MATCH pattern (a prefix may hold glob characters)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class Keys(msgspec.Struct, frozen=True):
    """The names of a store's keys under its prefix (the schema in the module docstring)."""

    prefix: str
    format: bytes
    layouts: bytes
    nsidx: bytes
    shares: bytes
    serves: bytes
    dropseq: bytes
    drops: bytes
    removals: bytes
    page_prefix: bytes  # + page hash hex: a page record
    children_prefix: bytes  # + page hash (or namespace root) hex: a children set
    ns_prefix: bytes  # + namespace id hex: a namespace record

    @classmethod
    def under(cls, prefix: str) -> Keys:
        """The keys of the store under `prefix`."""
        p = prefix.encode()
        return cls(prefix, p + b"format", p + b"layouts", p + b"nsidx", p + b"shares", p + b"serves",
                   p + b"dropseq", p + b"drops", p + b"rm", p + b"p:", p + b"c:", p + b"ns:")

    def page(self, page_hash: bytes) -> bytes:
        """The key of a page record."""
        return self.page_prefix + page_hash.hex().encode()

    def children(self, page_hash: bytes) -> bytes:
        """The key of the children set of a page or of a namespace root."""
        return self.children_prefix + page_hash.hex().encode()

    def namespace(self, ns_hex: str) -> bytes:
        """The key of a namespace record."""
        return self.ns_prefix + ns_hex.encode()

    def pattern(self, kind: str) -> str:
        """The SCAN pattern of every key of a kind (``"p:"`` page records, ``"c:"`` children sets)."""
        return glob_escape(self.prefix) + kind + "*"


def read_format(client: Any, url: StoreUrl, create: bool) -> StoreFormat:
    """The store's format record, made now when the prefix holds none and `create` (two creators race: one record
    wins, both read it). NotAStore, StoreUnsupported (a format this backend cannot serve) or StoreError (no
    server)."""
    key = url.options.prefix.encode() + b"format"
    try:
        raw = client.get(key)
        if raw is None:
            if not create:
                raise NotAStore(url.shown, f"no kvc store under prefix {url.options.prefix!r} (create=True "
                                           f"makes one)")
            fresh = StoreFormat(FORMAT_MAGIC, FORMAT_VERSION, CHECKSUM, time.time(),
                                new_fingerprint_key().hex(), new_chain_key().hex())
            client.set(key, encoder.encode(fresh), nx=True)  # two creators race: one record wins, both read it
            raw = client.get(key)
    except FAULTS as exc:
        raise StoreError(url.shown, f"cannot reach the server: {said(exc)}") from None
    fmt: StoreFormat | None
    try:
        fmt = decode_format(raw)
    except msgspec.DecodeError:
        fmt = None
    if fmt is None or fmt.magic != FORMAT_MAGIC:
        raise NotAStore(url.shown, f"the key {key.decode()!r} is not a kvc store record")
    if fmt.version > FORMAT_VERSION:
        raise StoreUnsupported(url.shown, f"store format {fmt.version} is newer than this kvc "
                                          f"({FORMAT_VERSION})")
    if fmt.checksum != CHECKSUM:
        raise StoreUnsupported(url.shown, f"store checksums use {fmt.checksum!r}, this backend {CHECKSUM!r}")
    if fmt.version < KEYED_ROOTS_VERSION or not fmt.chain_key:
        # Its page hashes are rooted under no key, so a salt could be tested against them; `kvc migrate`
        # rewrites LMDB stores only (a swap by one rename), and a Redis store is a cache that refills.
        raise StoreUnsupported(url.shown, f"store format {fmt.version} predates keyed page-hash roots and "
                                          f"kvc migrate upgrades LMDB stores only: delete the keys under prefix "
                                          f"{url.options.prefix!r} and let the cache refill")
    return fmt

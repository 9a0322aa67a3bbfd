"""Prometheus metrics of a store and of a live cache, through `prometheus_client`.

Everything here reads values (`StoreStats`, the registry's `NamespaceRecord`s, a live cache's `LiveStats` and
`NamespaceList`), never a cache: a scrape must not touch a cache outside its owner thread. `kvc stats --prom`
prints `exposition(...)`; `kvc serve --metrics-port` serves the same families over HTTP, reading them through
the admin socket, so the figures are read between two scheduler steps (`metrics_endpoint` serves them, with its
bounds; `kvc serve --metrics-socket` serves them on a Unix socket, with the admin socket's uid allow-list).

Values are exact: counts are integers, written in Prometheus' float syntax by prometheus_client (62275584 may
print as 6.2275584e+07: every digit is kept). Label values a user or a tenant chose (extra_key, the store
location) go through `label_value` first: prometheus_client escapes only backslash, double quote and newline, so
an ESC, a carriage return or a bidi override would reach the exposition raw (and a scraper's terminal or log);
they are written as `\\x1b`, `\\r`, `\\u202e` instead, as kvc's terminal output writes them. A store location is
printed with its credentials redacted. Offline, only what the store keeps is exported (totals, and per-namespace
pages, bytes and served pages from its registry); the counters of one store handle (reads, misses, checksum
failures) mean something only for a long-lived handle, so they come with a live cache's figures.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

if TYPE_CHECKING:
    from ..storage.api import NamespaceRecord, StoreStats
    from .protocol import LiveStats, NamespaceList

NS_LABELS = ["extra_key", "salt_fingerprint"]
TIERS = ("device", "host", "storage")

# StoreCounters field -> (metric name without _total, help): the counters of a long-lived store handle
HANDLE_COUNTERS: dict[str, tuple[str, str]] = {
    "pages_read": ("kvc_store_pages_read", "Pages the store handle served."),
    "misses": ("kvc_store_read_misses", "Reads that stopped short of their batch."),
    "checksum_failures": ("kvc_store_checksum_failures", "Pages that failed their checksum on read."),
    "read_errors": ("kvc_store_read_errors", "I/O faults on read (served as misses)."),
    "write_errors": ("kvc_store_write_errors", "Faults on write (the batch failed)."),
    "pages_written": ("kvc_store_pages_written", "Pages newly written."),
    "pages_rejected": ("kvc_store_pages_rejected", "Pages refused for capacity or quota."),
    "pages_evicted": ("kvc_store_pages_evicted", "Pages evicted to make room."),
}


# C0/C1 controls but newline (prometheus_client escapes it as \n, and parsers read it back), soft hyphen, bidi and
# zero-width format characters, BOM, lone surrogates (undecodable bytes, which UTF-8 cannot even encode)
_UNSAFE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
                     r"\ud800-\udfff]")


def label_value(text: str) -> str:
    """`text` as a label value: control and invisible format characters written as escapes (`\\x1b`, `\\u202e`),
    so none reaches the exposition raw; prometheus_client then escapes backslash, double quote and newline."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def _ns(extra_key: str | None, fingerprint: str | None) -> list[str]:
    return [label_value(extra_key or ""), label_value(fingerprint or "")]


def store_families(stats: "StoreStats", location: str, namespaces: Iterable["NamespaceRecord"] = (),
                   handle_counters: bool = False) -> Iterator[Metric]:
    """A store's totals (labelled backend and store), its registry per namespace, and with `handle_counters`
    the counters of the handle that read them."""
    labels = ["backend", "store"]
    values = [label_value(stats.backend), label_value(location)]
    info = GaugeMetricFamily("kvc_store_info", "The store: backend, location, format version, checksum (value 1).",
                             labels=[*labels, "format_version", "checksum"])
    info.add_metric([*values, str(stats.format_version), label_value(stats.checksum)], 1)
    yield info
    for name, help_text, value in (
            ("kvc_store_pages", "Pages stored.", stats.pages),
            ("kvc_store_bytes", "Payload bytes stored.", stats.bytes),
            ("kvc_store_footprint_bytes", "Bytes the store occupies in its medium.", stats.footprint_bytes),
            ("kvc_store_capacity_bytes", "Payload limit in bytes; 0 = unlimited.", stats.capacity_bytes),
            ("kvc_store_namespaces", "Namespaces in the registry.", stats.namespaces),
            ("kvc_store_layouts", "KV layouts the store holds.", stats.layouts)):
        family = GaugeMetricFamily(name, help_text, labels=labels)
        family.add_metric(values, value)
        yield family
    records = list(namespaces)
    pages = GaugeMetricFamily("kvc_store_namespace_pages", "Pages a namespace has in the store.", labels=NS_LABELS)
    nbytes = GaugeMetricFamily("kvc_store_namespace_bytes", "Payload bytes a namespace has in the store.",
                               labels=NS_LABELS)
    served = CounterMetricFamily("kvc_store_namespace_served_pages",
                                 "Pages the store served from a namespace (its registry, as of the last flush).",
                                 labels=NS_LABELS)
    for r in records:
        key = _ns(r.extra_key, r.salt_fingerprint)
        pages.add_metric(key, r.pages)
        nbytes.add_metric(key, r.bytes)
        served.add_metric(key, r.hits)
    yield from (pages, nbytes, served)
    if handle_counters:
        for field, (name, help_text) in HANDLE_COUNTERS.items():
            counter = CounterMetricFamily(name, help_text, labels=labels)
            counter.add_metric(values, getattr(stats.counters, field))
            yield counter


def cache_families(live: "LiveStats", namespaces: "NamespaceList | None" = None) -> Iterator[Metric]:
    """A live cache's pools, in-flight work, hits per namespace and tier, prefetch and backup counters, and (with
    `namespaces`) what each namespace holds in each tier; then its store's figures."""
    pool_tokens = GaugeMetricFamily("kvc_cache_pool_tokens", "Pool capacity in tokens.", labels=["tier"])
    used = GaugeMetricFamily("kvc_cache_pool_used_tokens", "Tokens held in the pool.", labels=["tier"])
    for tier, pool in (("device", live.device), ("host", live.host)):
        if pool is not None:
            pool_tokens.add_metric([tier], pool.tokens)
            used.add_metric([tier], pool.used_tokens)
    yield from (pool_tokens, used)
    inflight = GaugeMetricFamily("kvc_cache_inflight", "Work in flight now.", labels=["what"])
    for what in ("live_requests", "inflight_copies", "prefetches", "staged", "storage_writes"):
        inflight.add_metric([what], getattr(live, what))
    yield inflight
    hits = CounterMetricFamily("kvc_cache_hit_tokens", "Tokens admitted requests found cached, by tier and "
                               "namespace.", labels=["tier", *NS_LABELS])
    for h in live.cache.hits:
        for tier in TIERS:
            hits.add_metric([tier, *_ns(h.namespace.extra_key, h.namespace.salt_fingerprint)], getattr(h, tier))
    yield hits
    c, p, b = live.cache.counters, live.cache.prefetch, live.cache.backup
    yield _counter("kvc_cache_match_tokens", "Tokens asked for by matches.", c.match_tokens)
    yield _labelled("kvc_cache_requests", "Requests by outcome.", "outcome",
                    {"admitted": c.admitted, "refused": c.refused, "committed": c.committed,
                     "released": c.released})
    yield _labelled("kvc_cache_evicted_pages", "Pages evicted, by tier.", "tier",
                    {"device": c.device_pages_evicted, "host": c.host_pages_evicted})
    yield _labelled("kvc_cache_prefetch_pages", "L3 prefetch pages: hit in the store, fetched into L2, used.",
                    "stage", {"hit": p.hit_pages, "fetched": p.fetched_pages, "used": p.used_pages})
    yield _labelled("kvc_cache_prefetches", "Prefetch attempts by outcome.", "outcome",
                    {"issued": p.issued, **{f"declined_{k}": v for k, v in p.declined.items()}})
    yield _counter("kvc_cache_prefetch_read_errors", "Prefetch jobs that failed on an L3 fault.", p.read_errors)
    yield _labelled("kvc_cache_backup_pages", "Pages backed up, by destination tier.", "tier",
                    {"host": b.host_pages, "storage": b.storage_pages})
    yield _labelled("kvc_cache_storage_write_pages", "L3 write outcomes that were not a success: failed, L3 writes "
                    "that failed (the store unreachable); rejected, pages refused (capacity, quota, share).",
                    "outcome", {"failed": b.storage_failed, "rejected": b.storage_rejected})
    if namespaces is not None:
        tokens = GaugeMetricFamily("kvc_cache_namespace_tokens", "Tokens a namespace holds, by tier.",
                                   labels=["tier", *NS_LABELS])
        for row in namespaces.namespaces:
            for tier in TIERS:
                tokens.add_metric([tier, *_ns(row.extra_key, row.salt_fingerprint)], getattr(row, tier).tokens)
        yield tokens
        shared = [(row, row.shares) for row in namespaces.namespaces if row.shares is not None]
        if shared:  # namespaces with shares (kvcache.types.shares): each share beside the use above
            share_tokens = GaugeMetricFamily("kvc_cache_namespace_share_tokens",
                                             "A namespace's share of a tier in tokens (0: none).",
                                             labels=["tier", *NS_LABELS])
            share_bytes = GaugeMetricFamily("kvc_cache_namespace_share_bytes",
                                            "A namespace's share of the store in payload bytes (0: none).",
                                            labels=NS_LABELS)
            for row, shares in shared:
                labels = _ns(row.extra_key, row.salt_fingerprint)
                share_tokens.add_metric(["device", *labels], shares.device_tokens)
                share_tokens.add_metric(["host", *labels], shares.host_tokens)
                share_bytes.add_metric(labels, shares.store_bytes)
            yield share_tokens
            yield share_bytes
    if live.store is not None:
        yield from store_families(live.store, live.store.location, handle_counters=True)


def _counter(name: str, help_text: str, value: int) -> Metric:
    family = CounterMetricFamily(name, help_text)
    family.add_metric([], value)
    return family


def _labelled(name: str, help_text: str, label: str, values: dict[str, int]) -> Metric:
    family = CounterMetricFamily(name, help_text, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class _Families:
    """A collector over families computed by a function at each collection."""

    def __init__(self, produce: Callable[[], Iterable[Metric]]) -> None:
        self.produce = produce

    def collect(self) -> Iterator[Metric]:
        yield from self.produce()


def registry_of(produce: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A registry whose one collector yields `produce()` at every scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(produce))
    return registry


def exposition(families: Iterable[Metric]) -> str:
    """The Prometheus text exposition of `families`."""
    from prometheus_client.exposition import generate_latest

    items = list(families)
    return generate_latest(registry_of(lambda: items)).decode()

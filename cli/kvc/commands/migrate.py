"""`kvc migrate`: rewrite a store of an older format to the current one, through its backend's maintenance
(`kvcache.storage.registry.maintenance_of`; LMDB's rewrite is kvcache.storage.lmdb.migrate).

Format 2 keys the page-hash chain roots by the store's secret, so a format-1 store's page hashes could be used to
brute-force a short salt. Such a store is still read and written as before (kvc says so in one line on stderr
when it opens one for writing, and `kvc audit` does too); `kvc migrate` rewrites it: every page hash changes. It
needs the store to itself (stop the engines and `kvc serve` on it) and a clean audit.
"""

from __future__ import annotations

import msgspec

from ..context import require_store
from ..errors import UsageError
from ..options import DEFAULT_STORE, DebugOpt, JsonOpt, StoreOpt
from ..render.output import emit_json, say
from ..reporting import command


@command
def migrate(
    store: StoreOpt = DEFAULT_STORE,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Rewrite an LMDB store of an older format to the current one, crash-safe: the new store is built beside
    the old in the store's directory, verified, and swapped in with one rename (a migration killed part-way
    leaves the store as it was). Every page hash changes (format 2 keys the chain roots by the store's key
    file). A current store is left alone. Needs the store to itself and a clean `kvc audit`."""
    from kvcache.storage.registry import maintenance_of

    require_store(store)
    maintenance = maintenance_of(store.url)
    if maintenance is None:
        raise UsageError(f"{store}: kvc migrate rewrites LMDB stores only (a Redis store of an older format is "
                         f"refused when opened: delete its keys and let the cache refill)")
    report = maintenance.migrate(store.url)
    if json:  # the location as shown (an LMDB URL's ?token= removed), as everywhere else
        emit_json(msgspec.structs.replace(report, location=store.redact(report.location)))
    elif report.migrated:
        say(f"{store}: migrated from format {report.from_version} to {report.to_version}: {report.pages} page(s) "
            f"under new hashes, {report.namespaces} namespace record(s)")
    else:
        say(f"{store}: already format {report.to_version}; nothing to do")


"""The default L3 backend, one embedded LMDB environment per store directory (`store.LMDBStore`, registered as
``lmdb``): `env` (the environment per process), `bookkeeping` (the namespace records, totals, limits and eviction
inside write transactions), `put` (the write path), `access` (logged reads and quarantined pages), `tree` (a
page's children), `delete` (a namespace's offboarding), `integrity` (its side of the shared audit), `salvage` (the
audit and rebuild of a damaged store), `pagefile`, `pagemap` and `recover` (the data file read and checked without
LMDB, what a rebuild recovers from its leaf pages), `removals` (the bounded log of pages removed and why),
`serve_records` (its serving and drop records), `migrate` (`kvc migrate`), `rekey` (`kvc init --rekey`) and
`footprint` (what a page costs on disk: what to provision for a payload capacity)."""

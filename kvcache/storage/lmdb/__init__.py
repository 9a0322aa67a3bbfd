"""The default L3 backend, one embedded LMDB environment per store directory (`store.LMDBStore`, registered as
``lmdb``): `env` (the environment per process), `registry` (bookkeeping inside write transactions), `put` (the
write path), `access` (logged reads and quarantined pages), `tree` (a page's children), `delete` (a namespace's
offboarding), `verify` (its side of the shared audit), `salvage` (the audit and rebuild of a damaged store) and
`footprint` (what a page costs on disk: what to provision for a payload capacity)."""

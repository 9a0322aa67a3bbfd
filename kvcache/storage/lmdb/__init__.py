"""The default L3 backend, one embedded LMDB environment per store directory (`store.LMDBStore`, registered as
``lmdb``): `env` (the environment per process), `registry` (bookkeeping inside write transactions), `verify` (its
side of the shared audit) and `salvage` (the audit and rebuild of a damaged store)."""

"""L3: the persistent page store interface (`base`), what every backend shares (`codec`, `handle`, `verify`),
and the default backend (`lmdb_store`, over `lmdb_env`, `lmdb_registry`, `lmdb_verify`, `lmdb_salvage`)."""

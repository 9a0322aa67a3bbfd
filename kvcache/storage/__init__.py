"""L3: the persistent page store interface (`base`) and its default backend (`lmdb_store`)."""

"""L3: the persistent page store interface (`api`), the argument checks (`checks`) and what else every backend
shares (`codec`, `handle`, `verify`), the backend registry (`registry`: `open_store`), the one module a plugin
imports (`kit`; `base` is its former name), and the default backend (`lmdb/`)."""

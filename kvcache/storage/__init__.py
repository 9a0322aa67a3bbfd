"""L3: the store contracts (`api`: `PageStore`, what a cache asks, and `L3Store`, with the administration), a
byte-free page set of unlimited size for sweeps (`page_set`), the argument checks (`checks`) and what else every
backend shares (`codec`, `handle`, `verify`), the backend registry (`registry`: `open_store`), the one module a
plugin imports (`kit`; `base` is its former name), and the default backend (`lmdb/`)."""

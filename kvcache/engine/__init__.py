"""kvcache.engine: `TieredCache` (`cache`), the facade an engine's scheduler calls, over a tree of parts built bottom
up in `parts`, each calling only the parts below it. On top: `admission` (admit, commit, release, load-backs),
`settlement` (a request's prefetch started and settled) and `pressure` (admission's order when short of room);
below them `expiry` and `ttl` (namespace time to live), `offboard`, `completion` (poll and flush), `prefetch`
(L3 -> L2) and `staging` (buffer-mode records), `room` (allocation and eviction per tier), `backups` and `landing`
(when a backup runs and what it becomes, per host mode), `copies` (L1 <-> L2), `writes` (L2 -> L3); at the bottom
`holders` (every slot holder, one id mint), the in-flight operations (`operation`: their protocols; `transfer`,
`write_job`, `prefetch_op`, `staged`), `host_mode` (the rules of cache and buffer mode), `shares`, `event_log` (the
KV-event feed), `io_worker` (the L3 I/O thread), `recent` (the bounded records of what each tier removed and how
prefetches ended) and `explain` (why a request misses, tier by tier, read from them).
docs/architecture.md draws the tree and tells which part alone changes which state."""

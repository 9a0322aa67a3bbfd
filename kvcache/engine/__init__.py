"""kvcache.engine: `TieredCache` (`cache`), the facade an engine's scheduler calls, and the state machines it runs,
one module each, built in `parts`: `admission` (admit, commit, release), `holders` (every slot holder, one id
mint), `host_mode` (the rules of cache and buffer mode), `room` (allocation, eviction, admission's order), `copies`
(L1 <-> L2), `writes` (L2 -> L3), `prefetch` (L3 -> L2), `staging` (buffer-mode records), `completion` (poll and
flush), `offboard`, `expiry` and `ttl` (namespace time to live), `shares`, `event_log` (the KV-event feed),
`io_worker` (the L3 I/O thread), `recent` (the bounded records of what each tier removed and how prefetches ended)
and `explain` (why a request misses, tier by tier, read from them).
docs/architecture.md tells which module alone changes which state."""

"""Live mode (DESIGN §7): the admin socket of a running cache, above the cache and driving it.

- `protocol`: the wire format — frames, requests, answers and their bounds;
- `server`: `AdminServer(cache, path)`, which queues requests on its threads and runs them when the engine calls
  `server.poll()` between scheduler steps (or on its own owner loop, for `kvc serve`);
- `transport`: the socket's threads, which only move bytes and queue requests for the owner thread;
- `kvcache.ops` (below live mode, shared with the offline CLI): what each request does to the cache it is given;
- `client`: `AdminClient`, the other end, which imports neither torch nor the cache;
- `metrics`: Prometheus families of a live cache's figures and of a store's;
- `metrics_endpoint`: `MetricsEndpoint`, which serves them over HTTP (TCP or a Unix socket with the uid
  allow-list), with bounds on threads, connections and reads of the cache;
- `credentials`: who is at the other end of an admin socket (SO_PEERCRED), checked by both sides;
- `serves`: the live caches serving a store, from the store's serving records;
- `feed`: the KV-event feed's framing over ZeroMQ and its endpoints, shared by its two ends;
- `events`: `KVEventPublisher`, the feed's publisher around a cache (`kvc serve --events`);
- `subscriber`: `FeedSubscriber`, the other end, for any engine's feed (`kvc events`);
- `replay_client`: the subscriber's conversation with a publisher's replay socket;
- `event_records`: the events of a received batch as flat, printable records;
- `holdings`: what a consumer of KV events holds per tier and namespace, rebuilt from the events (`kvc events`,
  `kvc ns dump`).

Nothing here is imported by the cache: the engine (or `kvc serve`) hands a cache to a server.
"""

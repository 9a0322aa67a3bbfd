"""`kvc serve`: a standalone live cache on a store, with an admin socket (DESIGN §7).

The process builds one `TieredCache` on the store (sizes and policies as `kvc replay` takes them), opens its
admin socket and runs the owner loop: queued admin requests, then the cache's finished copies and L3 jobs, again
and again. SIGTERM or SIGINT stops it cleanly: a running replay stops at its next step and releases what it held,
the socket stops accepting and its file is removed, what is queued is answered, L3 writes are flushed, exit 0. A
socket path where a live server answers is refused (exit 2); a stale socket file left by a dead server is taken
over.

While it runs the process is recorded in the store (pid, host, socket: `kvc ns drop` finds it there and refuses
an offline drop of a namespace it holds), and it follows the store's drop records: a namespace dropped offline or
through another `kvc serve` of the same store is dropped from this cache too and never written back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Annotated

import typer

from kvcache.errors import InvalidConfig
from kvcache.types.config import HostMode, PrefetchPolicy, TTLMode, TTLPolicy, WritePolicy
from kvcache.types.events import MediumNames

from .. import live
from ..context import offline_cache, open_for_cache
from ..errors import UsageError
from ..inputs import endpoint, octal_mode
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    DeviceOpt,
    HostOpt,
    JsonOpt,
    ModeOpt,
    PrefetchPolicyOpt,
    SocketOpt,
    StoreOpt,
    WritePolicyOpt,
)
from ..render.output import console, emit_json
from ..reporting import command

MAX_IDLE_S = 3600.0  # the longest a connection may stay silent (admin socket and metrics alike)
MAX_TTL_S = 10 * 365 * 86400.0  # ten years: the longest time to live a namespace can be given
MAX_UID = 2**32 - 2  # uid_t, less (uid_t)-1, which no process runs as

ModeBits = Annotated[str, typer.Option(
    "--socket-mode", metavar="MODE", parser=octal_mode,
    help="Permissions of the socket file, octal (owner only by default). Whoever can connect must also be on the "
    "allow-list (--allow-uid).")]
AllowUids = Annotated[list[int] | None, typer.Option(
    "--allow-uid", min=0, max=MAX_UID, show_default=False, metavar="UID",
    help="A uid whose processes may use the socket (checked with SO_PEERCRED on every connection); repeat for "
    "several. Default: only the uid running kvc serve.")]
MaxConnections = Annotated[int, typer.Option(
    "--max-connections", min=1, max=4096,
    help="Connections served at once; one more is answered 'busy' (clients retry).")]
IdleTimeout = Annotated[float, typer.Option(
    "--idle-timeout", min=0.0, max=MAX_IDLE_S,
    help="Seconds a connection may stay silent, or take to send one request, before the server closes it.")]
MetricsPortOpt = Annotated[int | None, typer.Option(
    "--metrics-port", min=0, max=65535, show_default=False,
    help="Serve Prometheus metrics of the live cache over HTTP on this TCP port (0: any free port; the ready line "
    "names it): tiers, hits per namespace and tier, prefetch and backup counters, the store's figures. Off unless "
    "asked for. Anyone who reaches the port can scrape (there is no uid check over TCP), and the labels name "
    "tenants: it listens on 127.0.0.1 unless --metrics-addr says otherwise; --metrics-socket serves it to "
    "allowed uids only.")]
MetricsAddrOpt = Annotated[str | None, typer.Option(
    "--metrics-addr", show_default=False, metavar="ADDRESS",
    help="Address the --metrics-port endpoint listens on. Default: 127.0.0.1 (loopback). A wildcard (0.0.0.0, ::) "
    "opens it to every interface, with a warning.")]
MetricsSocketOpt = Annotated[str | None, typer.Option(
    "--metrics-socket", show_default=False, metavar="PATH",
    help="Serve the metrics over HTTP on this Unix socket instead of a TCP port (`curl --unix-socket PATH "
    "http://localhost/metrics`): only the uids of the admin socket's allow-list (--allow-uid, checked with "
    "SO_PEERCRED) get figures, any other is answered 403.")]
MetricsModeOpt = Annotated[str, typer.Option(
    "--metrics-socket-mode", metavar="MODE", parser=octal_mode,
    help="Permissions of the --metrics-socket file, octal (owner only by default); whoever connects must also be "
    "on the allow-list.")]
MetricsConnectionsOpt = Annotated[int, typer.Option(
    "--metrics-max-connections", min=1, max=4096,
    help="Metrics connections open at once; one more closes the one idle the longest. Connections hold no thread "
    "(one event loop serves them all).")]
MetricsIdleOpt = Annotated[float, typer.Option(
    "--metrics-idle-timeout", metavar="SECONDS", min=0.0, max=MAX_IDLE_S,
    help="Seconds a metrics connection may stay silent, or take to send one request, before it is closed.")]
MetricsRefreshOpt = Annotated[float, typer.Option(
    "--metrics-refresh-s", metavar="SECONDS", min=0.0, max=3600.0,
    help="Read the cache's figures at most once per this many seconds, whatever the number of scrapers; scrapes "
    "in between get the same exposition (0: a read per scrape, still one at a time).")]
# The --ttl-* options declare their upper bounds; their lower ones are the TTL policy's own checks (`_ttl_policy`),
# said in its words.
TTLDefaultOpt = Annotated[float | None, typer.Option(
    "--ttl-default-s", show_default=False, metavar="SECONDS", max=MAX_TTL_S,
    help="Turn namespace expiry on: a namespace's time to live, in seconds, when its requests ask for none. At "
    "its deadline it is dropped from L1, L2 and the store (nothing written back); while requests of it run, "
    "the expiry waits for the last one, and a new request of it cancels the wait. Off by default.")]
TTLModeOpt = Annotated[TTLMode, typer.Option(
    "--ttl-mode", case_sensitive=False,
    help="sliding: the deadline runs from the namespace's last use (admit or prefetch); absolute: from its first.")]
TTLMaxOpt = Annotated[float | None, typer.Option(
    "--ttl-max-s", show_default=False, metavar="SECONDS", max=MAX_TTL_S,
    help="The longest time to live a request may ask for (its ttl_s is clamped to this). Default: --ttl-default-s.")]
TTLNamespacesOpt = Annotated[int, typer.Option(
    "--ttl-max-namespaces", min=1, max=10_000_000,
    help="Namespaces tracked at once; a new one beyond this expires those closest to their deadline first.")]
TTLSweepOpt = Annotated[float, typer.Option(
    "--ttl-sweep-s", metavar="SECONDS", max=86400.0,
    help="How often the owner loop looks for expired namespaces (a use past the deadline expires it at once).")]
EventsOpt = Annotated[str | None, typer.Option(
    "--events", show_default=False, metavar="ENDPOINT", parser=endpoint,
    help="Publish KV events (BlockStored / BlockRemoved / AllBlocksCleared, the batches vLLM and SGLang publish) "
    "on a ZeroMQ PUB socket bound here: a port alone (5557, or * for any free port: the ready line names it) "
    "binds loopback, 127.0.0.1; any other address is bound as written, e.g. tcp://10.0.0.5:5557 or "
    "ipc:///run/kvc/events. The feed has no authentication and names tenants and page hashes: a wildcard host "
    "(tcp://*:5557, 0.0.0.0, ::) binds every interface and is warned about. One batch per step that changed "
    "the cache; salts never, only their fingerprints. Follow it with `kvc events --follow`.")]
EventsReplayOpt = Annotated[str | None, typer.Option(
    "--events-replay", show_default=False, metavar="ENDPOINT", parser=endpoint,
    help="Also bind a ROUTER socket here (same forms as --events) that re-sends the batches a subscriber missed, "
    "from the sequence number it asks for (the last --events-buffer batches are kept). Answers are bounded: "
    "--events-max-replays run at once (one more is answered busy: the client asks again), each leaves as fast "
    "as its client reads, and one whose client stops reading is abandoned.")]
EventsMaxReplaysOpt = Annotated[int, typer.Option(
    "--events-max-replays", min=1, max=1024,
    help="Replay answers sent at once; a request beyond them is answered busy (the client asks again later).")]
EventsTopicOpt = Annotated[str, typer.Option(
    "--events-topic", help="The topic frame of every KV-event message (subscribers filter on its prefix).")]
EventsBufferOpt = Annotated[int, typer.Option(
    "--events-buffer", min=1, max=10_000_000, help="Batches kept for --events-replay.")]
EventsMediaOpt = Annotated[MediumNames, typer.Option(
    "--events-medium-names", case_sensitive=False,
    help="The words of the events' `medium` field: kvc (device / host / storage) or sglang (GPU / CPU_PINNED / "
    "DISK, what routers that read SGLang's events map to tiers).")]


@command
def serve(
    store: StoreOpt = DEFAULT_STORE,
    socket: SocketOpt = None,
    device_tokens: DeviceOpt = 16384,
    host_tokens: HostOpt = 65536,
    prefetch_policy: PrefetchPolicyOpt = PrefetchPolicy.BEST_EFFORT,
    write_policy: WritePolicyOpt = WritePolicy.WRITE_THROUGH,
    mode: ModeOpt = HostMode.CACHE,
    socket_mode: ModeBits = "600",
    metrics_port: MetricsPortOpt = None,
    metrics_addr: MetricsAddrOpt = None,
    metrics_socket: MetricsSocketOpt = None,
    metrics_socket_mode: MetricsModeOpt = "600",
    metrics_max_connections: MetricsConnectionsOpt = 64,
    metrics_idle_timeout: MetricsIdleOpt = 10.0,
    metrics_refresh_s: MetricsRefreshOpt = 1.0,
    allow_uid: AllowUids = None,
    max_connections: MaxConnections = 64,
    idle_timeout: IdleTimeout = 10.0,
    ttl_default_s: TTLDefaultOpt = None,
    ttl_mode: TTLModeOpt = TTLMode.SLIDING,
    ttl_max_s: TTLMaxOpt = None,
    ttl_max_namespaces: TTLNamespacesOpt = 100_000,
    ttl_sweep_s: TTLSweepOpt = 1.0,
    events: EventsOpt = None,
    events_replay: EventsReplayOpt = None,
    events_topic: EventsTopicOpt = "",
    events_buffer: EventsBufferOpt = 10_000,
    events_max_replays: EventsMaxReplaysOpt = 8,
    events_medium_names: EventsMediaOpt = MediumNames.KVC,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run a live cache on the store with an admin socket, until SIGTERM or SIGINT. Other kvc commands act on it
    with --socket; `--metrics-port` or `--metrics-socket` adds a Prometheus endpoint. Prints "serving on SOCKET" on
    stderr when ready (with --json, a ready object on stdout)."""
    path = live.socket_path(socket)
    if path is None:
        raise UsageError("kvc serve needs --socket PATH (or KVC_SOCKET)")
    bits = int(socket_mode.lower().replace("o", ""), 8)  # octal digits: checked by its parser (inputs.octal_mode)
    if not idle_timeout > 0:  # the declared range takes 0: a connection must be given some time
        raise UsageError(f"--idle-timeout {idle_timeout:g}: must be > 0 and at most {MAX_IDLE_S:g} seconds")
    allowed = {os.geteuid(), *allow_uid} if allow_uid else None
    metrics = _metrics_endpoint(metrics_port, metrics_addr, metrics_socket, metrics_socket_mode,
                                metrics_max_connections, metrics_idle_timeout, metrics_refresh_s, allowed,
                                os.path.abspath(path))
    ttl = _ttl_policy(ttl_default_s, ttl_mode, ttl_max_s, ttl_max_namespaces, ttl_sweep_s)
    stop = threading.Event()
    with contextlib.closing(open_for_cache(store)) as handle:
        from kvcache.storage.serving import DropWatch, FencedStore

        # the cache follows the store's drop records, and the server records itself in the store (serving)
        fenced = FencedStore(handle, DropWatch(handle, by=path))
        cache = offline_cache(fenced, handle.layout, device_tokens, host_tokens, prefetch_policy=prefetch_policy,
                              write_policy=write_policy, host_mode=mode, ttl=ttl)
        from kvcache.live.server import AdminServer  # imports the cache's ops (and torch): only where one runs

        if events_replay is not None and events is None:
            cache.close()
            raise UsageError("--events-replay needs --events (the feed whose batches it re-sends)")
        publisher = _events_publisher(cache, events, events_replay, events_topic, events_buffer, events_max_replays,
                                      events_medium_names)
        # the server closes first (socket file removed, queued requests answered), then the cache flushes L3 (and
        # publishes AllBlocksCleared), then the event feed closes
        with _closing(publisher), contextlib.closing(cache), AdminServer(
                cache, path, mode=bits, allow_uids=allowed, max_connections=max_connections,
                idle_timeout=idle_timeout) as server:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            if metrics is not None:
                _start_metrics(metrics)
            where = f", metrics on {metrics.url}" if metrics is not None else ""
            if ttl is not None:
                where += (f", TTL {ttl.mode.value} {ttl.default_ttl_s:g} s (max {ttl.max_ttl_s:g} s, "
                          f"{ttl.max_namespaces} namespaces)")
            if publisher is not None:
                where += f", KV events on {publisher.endpoint}"
                if publisher.replay_endpoint is not None:
                    where += f" (replay {publisher.replay_endpoint})"
                if publisher.every_interface:
                    where += ", on every interface"
            log = console(stderr=True)
            if publisher is not None and publisher.every_interface:
                log.print("kvc serve: warning: the KV-event feed is bound on every interface and has no "
                          "authentication: whoever reaches this host reads its tenants and page hashes (give "
                          "--events a port alone for loopback)", markup=False)
            log.print(f"kvc serve: serving on {server.path} (store {store}, L1 {device_tokens} tokens, "
                      f"L2 {host_tokens} tokens, {mode.value} mode, pid {os.getpid()}{where})", markup=False)
            if json:
                emit_json({"event": "ready", "socket": server.path, "pid": os.getpid(), "store": str(store),
                           "metrics": metrics.url if metrics is not None else None,
                           "metrics_every_interface": metrics is not None and metrics.wildcard, "ttl": ttl,
                           "events": publisher.endpoint if publisher is not None else None,
                           "events_replay": publisher.replay_endpoint if publisher is not None else None,
                           "events_every_interface": publisher is not None and publisher.every_interface})
            try:
                server.serve_forever(stop)
            finally:
                if metrics is not None:
                    metrics.close()
            served = server.served
    console(stderr=True).print(f"kvc serve: stopped after {served} requests; socket removed, L3 writes flushed",
                               markup=False)


def _ttl_policy(default_s: float | None, mode: TTLMode, max_s: float | None, namespaces: int,
                sweep_s: float) -> TTLPolicy | None:
    """The TTL policy the --ttl-* options describe; None (no expiry) without --ttl-default-s."""
    if default_s is None:
        if max_s is not None:
            raise UsageError("--ttl-max-s needs --ttl-default-s (which turns namespace expiry on)")
        return None
    try:
        return TTLPolicy(mode, default_s, default_s if max_s is None else max_s, namespaces, sweep_s)
    except InvalidConfig as exc:  # the policy's own checks, named by their options
        for field, option in (("default_ttl_s", "--ttl-default-s"), ("max_ttl_s", "--ttl-max-s"),
                              ("sweep_interval_s", "--ttl-sweep-s")):
            if str(exc).startswith(f"ttl {field}="):
                raise UsageError(f"{option}: {exc}") from None
        raise UsageError(str(exc)) from None


def _events_publisher(cache, endpoint: str | None, replay: str | None, topic: str, buffer: int, max_replays: int,
                      medium_names: MediumNames):
    """The KV-event feed of `cache` (None without --events); the cache is closed when it cannot be bound. A port
    alone binds loopback."""
    if endpoint is None:
        return None
    from kvcache.live.events import KVEventPublisher
    from kvcache.live.feed import endpoint_of

    try:
        return KVEventPublisher(cache, endpoint_of(endpoint),
                                replay_endpoint=endpoint_of(replay) if replay is not None else None, topic=topic,
                                buffer_batches=buffer, max_replays=max_replays, medium_names=medium_names)
    except BaseException:
        cache.close()
        raise


def _closing(thing):
    return contextlib.closing(thing) if thing is not None else contextlib.nullcontext()


def _metrics_endpoint(port: int | None, addr: str | None, path: str | None, mode: str, max_connections: int,
                      idle_timeout: float, refresh_s: float, allowed: set[int] | None, admin_socket: str):
    """The metrics endpoint the --metrics-* options ask for, checked and not yet started; None for none (the
    default). Each read of its figures asks this cache's own admin socket, so they are read on the owner thread
    between two steps, at most once per --metrics-refresh-s."""
    if addr is not None and port is None:
        raise UsageError("--metrics-addr needs --metrics-port (the TCP endpoint it is the address of)")
    if port is not None and path is not None:
        raise UsageError("--metrics-port and --metrics-socket: give one (the metrics endpoint listens on one)")
    if not idle_timeout > 0:  # the declared range takes 0: a connection must be given some time
        raise UsageError(f"--metrics-idle-timeout {idle_timeout:g}: must be > 0 and at most {MAX_IDLE_S:g} "
                         f"seconds")
    bits = int(mode.lower().replace("o", ""), 8)  # octal digits: checked by its parser (inputs.octal_mode)
    if port is None and path is None:
        return None
    from kvcache.live.metrics import cache_families
    from kvcache.live.metrics_endpoint import MetricsEndpoint
    from kvcache.live.protocol import LiveStats, NamespaceList, NamespacesRequest, StatsRequest

    def families():
        return cache_families(live.call(admin_socket, StatsRequest(), LiveStats),
                              live.call(admin_socket, NamespacesRequest(), NamespaceList))

    if path is not None:
        return MetricsEndpoint(families, path=path, mode=bits, allow_uids=allowed, max_connections=max_connections,
                               idle_timeout=idle_timeout, refresh_s=refresh_s)
    return MetricsEndpoint(families, addr="127.0.0.1" if addr is None else addr, port=port,
                           max_connections=max_connections, idle_timeout=idle_timeout, refresh_s=refresh_s)


def _start_metrics(endpoint):
    """Start `endpoint` (bind, then serve on its own threads); a TCP address or port that cannot be bound is one
    line (a Unix socket's refusals are typed errors already)."""
    try:
        return endpoint.start()
    except OSError as exc:
        endpoint.close()
        raise UsageError(f"--metrics-port {endpoint.port} on {endpoint.addr}: {exc.strerror or exc}") from None

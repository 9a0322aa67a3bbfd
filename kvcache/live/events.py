"""The publisher end of the KV-event feed over ZeroMQ: a publisher wrapped around a cache (DESIGN §7b).

`KVEventPublisher(cache, endpoint)` attaches to a cache (`TieredCache.attach_events`) and publishes each batch the
cache hands it — one per scheduler step that changed something (`kvcache.engine.event_log`) — the way vLLM's and
SGLang's publishers do, so KV-aware routers read it unchanged: a PUB socket bound to `endpoint`, and optionally a
replay ROUTER socket bound to `replay_endpoint`, in the framing of `kvcache.live.feed` (the subscriber end is
`kvcache.live.subscriber`).

Loopback is the default address: a feed names tenants and page hashes and has no authentication, so it reaches
other hosts only when an address is written out (a wildcard host is flagged). The engine never waits for a
subscriber, and no client can grow it: sends are non-blocking; a PUB socket drops a message for a subscriber whose
queue is at the high-water mark (ZeroMQ does not tell the publisher: the subscriber sees the gap and replays). The
replay socket is served by a helper thread, which only reads the buffer; each batch is encoded once into frames
that the feed, the buffer and every answer share by reference, an answer leaves only as fast as its client takes
it (at most `replay_hwm` messages queued per client), answers run a few at a time, and one whose client stops
reading is abandoned (counted) — nobody else loses anything. A request is 8 bytes: anything much larger is refused
by ZeroMQ before it is read. Batches are encoded and sent on the cache's owner thread, at the end of its `poll`,
so their order is the cache's.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import zmq

from ..errors import EventEndpointError, InvalidInput
from ..types.events import EventBatch, MediumNames, encode_batch
from .feed import DEFAULT_ENDPOINT, END_OF_REPLAY, REPLAY_BUSY, binds_every_interface, open_socket

if TYPE_CHECKING:
    from ..engine.cache import TieredCache

_LINGER_MS = 500  # on close, queued messages get this long to leave (the last batch is AllBlocksCleared)
_REQUEST_MAX_BYTES = 64  # ZMQ_MAXMSGSIZE of the replay socket: a request is an empty frame and 8 bytes
_SUBSCRIPTION_MAX_BYTES = 4096  # ZMQ_MAXMSGSIZE of the PUB socket: what it receives are topic subscriptions
_REPLAY_SNDBUF = 256 * 1024  # the kernel's send buffer per replay client (not grown by autotuning for one that
# does not read)
_REQUESTS_QUEUED = 16  # RCVHWM of the replay socket: requests a peer may have waiting (it sends one at a time)
_RETRY_S = 0.01  # while an answer waits on a full queue, how often the replay thread tries it again
_REMEMBERED_STALLS = 4096  # peers whose queue was full when their answer was abandoned (bounded: oldest forgotten)


class PublisherStats(msgspec.Struct):
    """What a publisher did since it started."""

    endpoint: str  # where the PUB socket is bound (the port chosen when the endpoint asked for any)
    replay_endpoint: str | None
    every_interface: bool = False  # a socket is bound on every interface (a wildcard host), not one address
    batches: int = 0  # published
    events: int = 0
    bytes: int = 0  # payload bytes published
    send_failures: int = 0  # batches ZeroMQ refused to queue (kept in the replay buffer all the same)
    replay_requests: int = 0  # answered (begun)
    replayed_batches: int = 0
    replay_malformed: int = 0  # requests that were not [empty frame, 8-byte sequence]: ignored
    replay_busy: int = 0  # requests answered "busy" (REPLAY_BUSY): max_replays answers were running
    replay_cut_short: int = 0  # answers abandoned: the client's queue stayed full (it did not read) or it left
    replay_active: int = 0  # answers running now (at most max_replays)
    buffered: int = 0  # batches in the replay buffer now
    next_seq: int = 0  # the sequence number of the next batch


class _Answer:
    """A replay answer in progress: the next sequence number to send its peer, and since when its queue is full."""

    __slots__ = ("peer", "cursor", "stalled_since")

    def __init__(self, peer: bytes, cursor: int) -> None:
        self.peer = peer
        self.cursor = cursor
        self.stalled_since: float | None = None


class KVEventPublisher:
    """Publish `cache`'s KV events on a ZeroMQ PUB socket bound to `endpoint` (``tcp://127.0.0.1:*``, loopback on
    any free port, by default; ``tcp://host:port``, ``ipc:///path``; a wildcard host such as ``tcp://*:5557`` binds
    every interface and is flagged in `stats().every_interface`), with a replay ROUTER socket on `replay_endpoint`
    when given. `buffer_batches` bounds the replay buffer. Every door is bounded, whatever clients do:

    - `hwm`: messages the PUB socket queues per subscriber (a slower one misses batches and replays them);
    - `replay_hwm`: replay messages queued per client; an answer goes out as the client takes it, and one whose
      client takes nothing for `replay_stall_s` seconds is abandoned (counted in `replay_cut_short`);
    - `max_replays`: answers running at once; a request beyond them is answered `REPLAY_BUSY` (ask again later);
    - a request is tiny: a larger message (``ZMQ_MAXMSGSIZE``) disconnects its client before it is read.

    Batches are encoded once into ZeroMQ frames that the feed, the buffer and every answer share: an answer copies
    nothing. Creating it attaches to the cache, whose first batch (clear, then what it holds) goes out at once;
    `close()` detaches. Create and close it on the cache's owner thread (between steps), like `AdminServer`. A
    context manager."""

    def __init__(self, cache: "TieredCache", endpoint: str = DEFAULT_ENDPOINT, *,
                 replay_endpoint: str | None = None, topic: str = "", buffer_batches: int = 10_000,
                 hwm: int = 1_000, replay_hwm: int = 64, max_replays: int = 8, replay_stall_s: float = 1.0,
                 data_parallel_rank: int = 0, medium_names: MediumNames = MediumNames.KVC) -> None:
        if buffer_batches < 1:
            raise InvalidInput(f"buffer_batches={buffer_batches} must be >= 1")
        for name, value in (("hwm", hwm), ("replay_hwm", replay_hwm), ("max_replays", max_replays)):
            if value < 1:  # 0 is ZeroMQ's "no limit": the door this bounds would be open
                raise InvalidInput(f"{name}={value} must be >= 1")
        if not 0 < replay_stall_s <= 3600:  # also refuses nan and inf
            raise InvalidInput(f"replay_stall_s={replay_stall_s} must be > 0 and at most 3600 seconds")
        self.cache = cache
        self._topic = zmq.Frame(topic.encode("utf-8"))
        self._max_replays = max_replays
        self._stall_s = replay_stall_s
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        try:
            self._pub, bound = _bind(self._ctx, zmq.PUB, endpoint, {
                zmq.SNDHWM: hwm, zmq.MAXMSGSIZE: _SUBSCRIPTION_MAX_BYTES})
            replay_bound = None
            if replay_endpoint is not None:
                self._router, replay_bound = _bind(self._ctx, zmq.ROUTER, replay_endpoint, {
                    zmq.SNDHWM: replay_hwm, zmq.MAXMSGSIZE: _REQUEST_MAX_BYTES, zmq.RCVHWM: _REQUESTS_QUEUED,
                    zmq.SNDBUF: _REPLAY_SNDBUF,
                    zmq.ROUTER_MANDATORY: 1})  # a full or gone client raises: its answer waits, or ends
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        wide = binds_every_interface(endpoint) or (replay_endpoint is not None
                                                   and binds_every_interface(replay_endpoint))
        self._stats = PublisherStats(bound, replay_bound, wide)
        # (seq, seq frame, payload frame): frames built once, sent by reference (ZeroMQ counts the references)
        self._buffer: deque[tuple[int, zmq.Frame, zmq.Frame]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()  # the buffer: appended by the owner thread, read by the replay thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._router is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kvc-events-replay", daemon=True)
            self._thread.start()
        self._closed = False
        try:
            cache.attach_events(self._publish, data_parallel_rank, medium_names)
        except BaseException:
            self._shutdown()
            raise

    @property
    def endpoint(self) -> str:
        """The PUB socket's bound address (with the port chosen when `endpoint` asked for any)."""
        return self._stats.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay socket's bound address, or None without one."""
        return self._stats.replay_endpoint

    @property
    def every_interface(self) -> bool:
        """Whether the feed or its replay socket is bound on every interface (a wildcard host)."""
        return self._stats.every_interface

    def stats(self) -> PublisherStats:
        """A copy of the publisher's counters."""
        with self._lock:
            buffered = len(self._buffer)
        return msgspec.structs.replace(self._stats, buffered=buffered)

    def _publish(self, batch: EventBatch) -> None:
        """The cache's sink: runs on its owner thread at the end of a poll."""
        st = self._stats
        payload = encode_batch(batch)
        seq = st.next_seq
        st.next_seq += 1
        item = (seq, zmq.Frame(seq.to_bytes(8, "big")), zmq.Frame(payload))
        with self._lock:
            self._buffer.append(item)
        try:
            self._pub.send_multipart((self._topic, item[1], item[2]), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # the batch stays in the replay buffer: a subscriber fetches it from there
            st.send_failures += 1
        st.batches += 1
        st.events += len(batch.events)
        st.bytes += len(payload)

    def _serve_replay(self) -> None:
        """The replay thread: reads requests, and sends the answers running a little at a time, each as far as its
        client's queue takes it, so no client can hold the thread or more than `replay_hwm` messages."""
        router = self._router
        assert router is not None
        answers: dict[bytes, _Answer] = {}  # by peer, in the order they began
        stalled_peers: dict[bytes, None] = {}  # peers abandoned on a full queue (insertion-ordered, bounded)
        while not self._stop.is_set():
            ready = any(a.stalled_since is None for a in answers.values())
            try:
                wait = 0 if ready else int(_RETRY_S * 1000) if answers else 100
                if router.poll(wait):
                    for _ in range(_REQUESTS_QUEUED):  # a bounded bite, so running answers keep moving
                        self._take_request(router, router.recv_multipart(zmq.NOBLOCK), answers, stalled_peers)
                        if not router.poll(0):
                            break
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
            now = time.monotonic()
            for answer in list(answers.values()):
                if self._advance(router, answer, now, stalled_peers):
                    del answers[answer.peer]
            self._stats.replay_active = len(answers)

    def _take_request(self, router: zmq.Socket[bytes], frames: list[bytes], answers: dict[bytes, _Answer],
                      stalled_peers: dict[bytes, None]) -> None:
        """Begin the answer to a request, or answer busy when `max_replays` are running."""
        st = self._stats
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            st.replay_malformed += 1
            return
        peer, start = frames[0], int.from_bytes(frames[2], "big")
        if peer in answers:  # the client asks again (it gave up waiting): the new request replaces the old one
            answers[peer].cursor = start
            return
        if len(answers) >= self._max_replays:
            st.replay_busy += 1
            with contextlib.suppress(zmq.ZMQError):  # a client whose queue is full misses the busy answer too
                router.send_multipart((peer, b"", REPLAY_BUSY, b""), zmq.NOBLOCK)
            return
        st.replay_requests += 1
        answer = _Answer(peer, start)
        if peer in stalled_peers:  # its queue was full last time: one more full queue ends this answer at once
            answer.stalled_since = time.monotonic() - self._stall_s
        answers[peer] = answer

    def _advance(self, router: zmq.Socket[bytes], answer: _Answer, now: float,
                 stalled_peers: dict[bytes, None]) -> bool:
        """Send `answer`'s next batches until its client's queue is full; True when it is done or abandoned."""
        st = self._stats
        try:
            for _ in range(256):  # a bounded bite: the other answers, and new requests, get their turn
                with self._lock:
                    first = self._buffer[0][0] if self._buffer else st.next_seq
                    # a batch that left the buffer meanwhile is skipped: the client sees the gap
                    at = max(answer.cursor, first) - first
                    item = self._buffer[at] if at < len(self._buffer) else None
                if item is None:
                    router.send_multipart((answer.peer, b"", END_OF_REPLAY, b""), zmq.NOBLOCK)
                    stalled_peers.pop(answer.peer, None)
                    return True
                router.send_multipart((answer.peer, b"", item[1], item[2]), zmq.NOBLOCK, copy=False)
                answer.cursor = item[0] + 1
                answer.stalled_since = None
                st.replayed_batches += 1
            return False
        except zmq.Again:  # the client's queue is full: wait for it to read, up to replay_stall_s
            if answer.stalled_since is None:
                answer.stalled_since = now
            elif now - answer.stalled_since >= self._stall_s:
                st.replay_cut_short += 1
                stalled_peers[answer.peer] = None
                while len(stalled_peers) > _REMEMBERED_STALLS:
                    del stalled_peers[next(iter(stalled_peers))]
                return True
            return False
        except zmq.ZMQError:  # the client left (EHOSTUNREACH): nobody to answer
            st.replay_cut_short += 1
            return True

    def close(self) -> None:
        """Hand the cache's pending events out, detach from it, stop the replay thread and close the sockets
        (queued messages get a moment to leave). The cache stays open. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.cache.detach_events()
        self._shutdown()

    def _shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._router is not None:
            self._router.close(linger=0)
        self._pub.close(linger=_LINGER_MS)
        self._ctx.term()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, endpoint: str,
          options: dict[int, int]) -> tuple[zmq.Socket[bytes], str]:
    """A socket of `kind` bound to `endpoint`, `options` set before the bind (ZeroMQ gives a bound socket's
    connections the options it had when it was bound). MAXMSGSIZE: a larger inbound message disconnects its
    sender before it is read."""
    _refuse_to_replace(endpoint)
    sock = open_socket(ctx, kind, endpoint, options, bind=True)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _refuse_to_replace(endpoint: str) -> None:
    """EventEndpointError when an ipc:// endpoint names something that is not a socket: ZeroMQ unlinks whatever
    is at the path before it binds, so a regular file, a link or a FIFO there would be replaced by the socket."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):  # @: Linux's abstract namespace
        return
    path = endpoint[len("ipc://"):]
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # nothing there (or nothing this user may look at: the bind says why)
    if not stat.S_ISSOCK(mode):
        raise EventEndpointError(endpoint, "the path exists and is not a socket; refusing to replace it")

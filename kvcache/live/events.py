"""The KV-event feed over ZeroMQ: a publisher wrapped around a cache, and a subscriber (DESIGN §7b).

`KVEventPublisher(cache, endpoint)` attaches to a cache (`TieredCache.attach_events`) and publishes each batch the
cache hands it — one per scheduler step that changed something (`kvcache.engine.event_log`) — the way vLLM's and
SGLang's publishers do, so KV-aware routers read it unchanged:

- a PUB socket bound to `endpoint`; each batch is one message of three frames: the topic, an 8-byte big-endian
  sequence number (from 0, one per batch), the msgpack `EventBatch` (`kvcache.types.events`);
- optionally a ROUTER socket bound to `replay_endpoint`: a client sends ``[b"", start]`` (start: 8 bytes, big
  endian) and gets back ``[b"", seq, payload]`` for every batch still in the bounded replay buffer from `start` on,
  then ``[b"", -1 as 8 signed bytes, b""]``; or, when the publisher already runs its maximum of answers, the one
  message ``[b"", -2 as 8 signed bytes, b""]`` (busy: ask again later). A subscriber that sees a gap in the
  sequence fetches what it missed.

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

`KVEventSubscriber` is the other end (what `kvc events` uses): a SUB socket, gap detection by sequence number, and
replay of the missed batches when the publisher has a replay socket — a publisher restarted on its endpoint (its
numbering from 0 again) or whose numbering jumps is followed and counted, never silently dropped, and a replay
answer is handed over a bounded chunk at a time as it arrives, never gathered whole, whatever the replay socket
sends. `FeedSubscriber` is the same for any engine's
feed in this framing, with the payload decoder it is given: SGLang's own publisher (`--kv-events-config`) frames
its feed alike, its replay answers with the topic frame in front of the sequence (``[b"", topic, seq, payload]``,
accepted too), and its batches decode with `kvcache.engines.sglang_events`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec
import zmq

from ..errors import EventEndpointError, InvalidInput
from ..types.events import AllBlocksCleared, BlockStored, EventBatch, MediumNames, decode_batch, encode_batch

if TYPE_CHECKING:
    from ..engine.cache import TieredCache

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the sequence frame that ends a replay answer
REPLAY_BUSY = (-2).to_bytes(8, "big", signed=True)  # the answer when --max-replays answers are running: ask again
DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"  # loopback, any free port: the feed reaches this host only unless asked
_LINGER_MS = 500  # on close, queued messages get this long to leave (the last batch is AllBlocksCleared)
_REQUEST_MAX_BYTES = 64  # ZMQ_MAXMSGSIZE of the replay socket: a request is an empty frame and 8 bytes
_SUBSCRIPTION_MAX_BYTES = 4096  # ZMQ_MAXMSGSIZE of the PUB socket: what it receives are topic subscriptions
_REPLAY_SNDBUF = 256 * 1024  # the kernel's send buffer per replay client (not grown by autotuning for one that
# does not read)
_REQUESTS_QUEUED = 16  # RCVHWM of the replay socket: requests a peer may have waiting (it sends one at a time)
_RETRY_S = 0.01  # while an answer waits on a full queue, how often the replay thread tries it again
_REMEMBERED_STALLS = 4096  # peers whose queue was full when their answer was abandoned (bounded: oldest forgotten)
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def endpoint_of(text: str) -> str:
    """A ZeroMQ endpoint from what a user typed: a full endpoint as is; a bare port (``5557``) or ``*`` (any free
    port) means TCP on loopback, ``tcp://127.0.0.1:PORT``. An address other than loopback is only ever bound when
    it is written out."""
    text = text.strip()
    if text == "*" or text.isdigit():
        return f"tcp://127.0.0.1:{text}"
    return text


def binds_every_interface(endpoint: str) -> bool:
    """Whether a TCP `endpoint` binds every interface (``tcp://*:P``, ``tcp://0.0.0.0:P``, ``tcp://[::]:P``):
    anyone who can reach the host can read, and ask, what is published there."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host in _WILDCARD_HOSTS


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
        self._router: zmq.Socket | None = None
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

    def _take_request(self, router: zmq.Socket, frames: list[bytes], answers: dict[bytes, _Answer],
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

    def _advance(self, router: zmq.Socket, answer: _Answer, now: float, stalled_peers: dict[bytes, None]) -> bool:
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


def _bind(ctx: zmq.Context, kind: int, endpoint: str, options: dict[int, int]) -> tuple[zmq.Socket, str]:
    """A socket of `kind` bound to `endpoint`, `options` set before the bind (ZeroMQ gives a bound socket's
    connections the options it had when it was bound). MAXMSGSIZE: a larger inbound message disconnects its
    sender before it is read."""
    _refuse_to_replace(endpoint)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options.items():
        sock.setsockopt(option, value)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise EventEndpointError(endpoint, f"cannot bind: {exc.strerror}") from None
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


# --- the subscriber ------------------------------------------------------------------------------------------


B = TypeVar("B")  # a decoded batch: EventBatch on kvc's feed, what the subscriber's decoder returns on another


class ReceivedBatch(msgspec.Struct, Generic[B], gc=False):
    """A batch as a subscriber got it."""

    seq: int
    batch: B
    replayed: bool  # fetched from the replay socket (missed on the feed), not received live


class EventRecord(msgspec.Struct, omit_defaults=True):
    """One event, flat and printable (`kvc events --json` prints one per line): hashes as hex."""

    seq: int  # of its batch
    ts: float  # of its batch
    type: str  # BlockStored, BlockRemoved, AllBlocksCleared
    medium: str | None = None
    extra_key: str | None = None
    salt_fingerprint: str | None = None
    block_hashes: list[str] = []
    parent_block_hash: str | None = None
    token_ids: list[int] = []
    block_size: int | None = None
    data_parallel_rank: int | None = None
    replayed: bool = False


def records(received: ReceivedBatch[EventBatch]) -> list[EventRecord]:
    """The events of a received batch as records."""
    out = []
    b = received.batch
    for ev in b.events:
        rec = EventRecord(received.seq, b.ts, type(ev).__name__, data_parallel_rank=b.data_parallel_rank,
                          replayed=received.replayed)
        if not isinstance(ev, AllBlocksCleared):
            rec.medium, rec.extra_key, rec.salt_fingerprint = ev.medium, ev.extra_key, ev.salt_fingerprint
            rec.block_hashes = [h.hex() for h in ev.block_hashes]
        if isinstance(ev, BlockStored):
            rec.parent_block_hash = ev.parent_block_hash.hex() if ev.parent_block_hash is not None else None
            rec.token_ids, rec.block_size = ev.token_ids, ev.block_size
        out.append(rec)
    return out


class MalformedMessage(msgspec.Struct, frozen=True):
    """A message on the feed (or in a replay answer) that is not a KV-event batch: skipped and counted."""

    seq: int | None  # its sequence number, when its sequence frame was one
    replayed: bool  # it came in a replay answer
    reason: str


class Discontinuity(msgspec.Struct, frozen=True):
    """The publisher's numbering broke, and the subscriber follows the new one from `seq` on.

    `restarted`: it went back (`seq` below the next one expected, and not a copy of a batch already replayed) — an
    engine or `kvc serve` started again on the endpoint, numbering from 0. `jumped`: it leapt forward by more than
    the subscriber's `max_gap` — more than any replay buffer holds, so no batches a reader could have missed."""

    kind: str  # "restarted" or "jumped"
    after: int  # the last sequence number of the old numbering (the highest received)
    seq: int  # the first one of the new


MAX_GAP = 10_000_000  # a forward step larger than this is a jump of the numbering: kvc serve keeps at most this
# many batches to replay (--events-buffer), vLLM and SGLang 10,000 by default
REPLAY_CHUNK_BATCHES = 256  # a replay answer is handed over at most this many batches at a time ...
REPLAY_CHUNK_BYTES = 8 << 20  # ... and this many payload bytes (a larger batch goes alone): what a reader holds
REPLAY_MESSAGE_MAX_BYTES = 16 << 20  # ZMQ_MAXMSGSIZE of the replay socket: a larger message drops the peer unread
REPLAY_QUEUE = 4  # RCVHWM of the replay socket: messages ZeroMQ reads ahead of the subscriber
REPLAY_MAX_BATCHES = 10_000_000  # messages one answer may send: past it (more than any buffer holds) it is cut
_REMEMBERED_REPLAYS = 65_536  # digests of replayed batches kept to know the live feed's copies of them


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class _Reading:
    """A replay answer being read: the batches [start, stop) asked for (stop None: to the end of the buffer), the
    last sequence number taken, and the live message that revealed the gap (handed over once the answer ends), or
    whether it is the catch-up of a subscriber's `start` (the batches the buffer no longer had are missed)."""

    __slots__ = ("start", "stop", "live", "catch_up", "last", "read", "taken", "skipped", "deadline")

    def __init__(self, start: int, stop: int | None, live: tuple[int, bytes] | None, timeout: float,
                 catch_up: bool = False) -> None:
        self.start, self.stop, self.live, self.catch_up = start, stop, live, catch_up
        self.last: int | None = None  # the last sequence number taken from the answer, decoded or not
        self.read = 0  # messages of the answer read (in the range or not)
        self.taken = 0  # batches handed over
        self.skipped = 0  # malformed batches in the range: not missed, skipped
        self.deadline = time.monotonic() + timeout  # silence past it ends the answer


class FeedSubscriber(Generic[B]):
    """Subscribe to a KV-event feed at `endpoint` (the publisher's PUB address), `topic` being a prefix of the
    topics wanted (default: all), each payload turned into a batch by `decode` (which raises msgspec's
    DecodeError or ValidationError on one that is not). With `replay_endpoint`, a gap in the sequence is filled
    from the publisher's replay buffer; `start` (a sequence number) also fetches the batches before the first one
    received, from that one on — `start=0` gives a late subscriber the whole feed still buffered. A context
    manager.

    Nothing a publisher sends can end the reading, blind it or make it hold more than a bounded amount:

    - a message that is not a KV-event batch (wrong frames, a payload that does not decode, an impossible field)
      is skipped, counted in `malformed` and handed to `on_malformed`; a batch whose payload was bad is not fetched
      again (its sequence number is passed);
    - a publisher whose numbering goes back (restarted on the endpoint) or leaps forward by more than `max_gap`
      is followed from its new number on, counted in `restarts` / `jumps` and handed to `on_discontinuity` as a
      `Discontinuity`; a restarted publisher numbers from 0, so the batches of its new run before the first one
      received are fetched from the replay socket (or counted missed) like any gap. The live feed's copies of
      batches a replay already gave are recognised by their bytes and dropped (`duplicates`);
    - a replay answer is handed over as it arrives, at most `REPLAY_CHUNK_BATCHES` batches and
      `REPLAY_CHUNK_BYTES` payload bytes at a time (`receive` and `replay` return one such chunk per step), read
      `REPLAY_QUEUE` messages ahead at most, each at most `replay_max_message_bytes` (a larger one drops the replay
      connection unread). An answer ends at its end marker; one that goes silent for `replay_timeout` seconds,
      sends a message that is not a replay message or more than `replay_max_batches` of them is cut short
      (`replays_cut_short`; in a gap, what it did not give is counted `missed`) and its socket replaced, so
      nothing of it reaches a later answer."""

    def __init__(self, endpoint: str, decode: Callable[[bytes], B], *, replay_endpoint: str | None = None,
                 topic: str = "", start: int | None = None, replay_timeout: float = 5.0,
                 on_malformed: Callable[[MalformedMessage], None] | None = None,
                 on_discontinuity: Callable[[Discontinuity], None] | None = None, max_gap: int = MAX_GAP,
                 replay_max_batches: int = REPLAY_MAX_BATCHES,
                 replay_max_message_bytes: int = REPLAY_MESSAGE_MAX_BYTES) -> None:
        if not 0 < replay_timeout <= 3600:  # also refuses nan and inf
            raise InvalidInput(f"replay_timeout={replay_timeout} must be > 0 and at most 3600 seconds")
        for name, value in (("max_gap", max_gap), ("replay_max_batches", replay_max_batches),
                            ("replay_max_message_bytes", replay_max_message_bytes)):
            if value < 1:
                raise InvalidInput(f"{name}={value} must be >= 1")
        self._decoder = decode
        self.replay_endpoint = replay_endpoint
        self.replay_timeout = replay_timeout
        self.max_gap = max_gap
        self.replay_max_batches = replay_max_batches
        self._message_max = replay_max_message_bytes
        self._ctx = zmq.Context()
        try:  # a subscriber that fails to start returns nothing to close: its context goes here
            self._sub = self._connect(zmq.SUB, endpoint)
            self._sub.setsockopt(zmq.RCVHWM, 0)  # a reader that falls behind queues, it does not drop
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._replay = self._replay_socket() if replay_endpoint is not None else None
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.next_seq = start  # the sequence number expected next; None until the first batch (no start)
        self._catch_up = start is not None and replay_endpoint is not None  # fetch from `start` at once
        self._begun = False  # a batch came (live or replayed): before one, a live batch below `start` is passed
        self._live_last: int | None = None  # the last sequence number received live (a PUB feed is in order)
        self._replayed: OrderedDict[int, bytes] = OrderedDict()  # seq -> digest of batches replayed past it
        self._reading: _Reading | None = None  # the replay answer `receive` is handing over
        self._answer_open = False  # a request was sent whose answer has not ended at its end marker
        self.missed = 0  # batches known missing that no replay could give back
        self.replayed = 0
        self.malformed = 0  # messages skipped: not a KV-event batch
        self.restarts = 0  # the numbering went back: followed from there
        self.jumps = 0  # the numbering leapt forward by more than max_gap: followed from there
        self.duplicates = 0  # live batches dropped as copies of ones a replay gave already
        self.replays_cut_short = 0  # answers that ended without their end marker
        self.on_malformed = on_malformed
        self.on_discontinuity = on_discontinuity

    def _connect(self, kind: int, endpoint: str, options: dict[int, int] | None = None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():  # before the connect: ZeroMQ gives a connection these
            sock.setsockopt(option, value)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise EventEndpointError(endpoint, f"cannot connect: {exc.strerror}") from None
        return sock

    def _replay_socket(self) -> zmq.Socket:
        """A DEALER on the replay endpoint that reads at most REPLAY_QUEUE messages ahead, none larger than the
        cap (a larger one disconnects the peer before it is read)."""
        assert self.replay_endpoint is not None
        return self._connect(zmq.DEALER, self.replay_endpoint, {zmq.RCVHWM: REPLAY_QUEUE,
                                                                zmq.MAXMSGSIZE: self._message_max})

    @property
    def reading(self) -> bool:
        """Whether `receive` is in the middle of a replay answer (it hands over the rest on the next calls)."""
        return self._reading is not None or self._catch_up

    def receive(self, timeout: float | None = None) -> list[ReceivedBatch[B]]:
        """Wait up to `timeout` seconds (None: for ever) for the next batch; return it, preceded by the batches
        missed before it that the replay buffer still had (the first call with a `start` returns what the buffer
        holds from there on at once). [] when nothing came in time. While a replay answer is being read, each call
        returns its next chunk (at most REPLAY_CHUNK_BATCHES batches, REPLAY_CHUNK_BYTES payload bytes; maybe none
        while it reads batches it passes), the live batch that revealed the gap after the last one (`reading`)."""
        if self._catch_up:
            self._catch_up = False
            assert self.next_seq is not None, "a catch-up is asked for with a start only"
            self._reading = self._ask(self.next_seq, None, None, catch_up=True)
        if self._reading is not None:
            return self._read_on()
        if not self._sub.poll(None if timeout is None else max(0, int(timeout * 1000))):
            return []
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            self._skip(None, False, f"a message of {len(frames)} frames ({sum(map(len, frames))} bytes), not "
                                    f"[topic, 8-byte sequence, batch]")
            return []
        return self._on_live(int.from_bytes(frames[1], "big"), frames[2])

    def _on_live(self, seq: int, payload: bytes) -> list[ReceivedBatch[B]]:
        """A batch from the feed: taken, or the gap before it filled first, or a copy dropped, or a broken
        numbering followed."""
        expected = self.next_seq
        if expected is None or seq == expected:
            return self._take_live(seq, payload)
        if seq > expected:
            if self._begun and seq - expected > self.max_gap:
                self._broke("jumped", expected - 1, seq)
                return self._take_live(seq, payload)
            return self._fill(expected, seq, payload)
        if not self._begun:  # before the first batch: one below the `start` asked for is not wanted
            return []
        if (self._live_last is None or seq > self._live_last) and self._replayed.get(seq) == _digest(payload):
            self.duplicates += 1  # a replay gave it already: the feed's own copy, queued meanwhile
            self._passed_live(seq)
            return []
        self._broke("restarted", expected - 1, seq)
        self._replayed.clear()  # digests of the old numbering name no batch of the new one
        self._live_last = None
        if 0 < seq <= self.max_gap:  # a restarted publisher numbers from 0: the new run's batches before this one
            return self._fill(0, seq, payload)
        return self._take_live(seq, payload)

    def _fill(self, start: int, seq: int, payload: bytes) -> list[ReceivedBatch[B]]:
        """The gap [start, seq) before live batch `seq`: asked of the replay socket (the live batch is handed over
        after the answer), else counted missed."""
        if self._replay is None:
            self.missed += seq - start
            return self._take_live(seq, payload)
        self.next_seq = start
        self._reading = self._ask(start, seq, (seq, payload))
        return self._read_on()

    def _take_live(self, seq: int, payload: bytes) -> list[ReceivedBatch[B]]:
        self._begun = True
        self.next_seq = seq + 1
        self._passed_live(seq)
        batch = self._decode(seq, payload, False)
        return [ReceivedBatch(seq, batch, False)] if batch is not None else []

    def _passed_live(self, seq: int) -> None:
        """The feed is at `seq`: no later live batch can be a copy of a replayed one at or below it."""
        self._live_last = seq
        while self._replayed and next(iter(self._replayed)) <= seq:
            self._replayed.popitem(last=False)

    def _broke(self, kind: str, after: int, seq: int) -> None:
        if kind == "restarted":
            self.restarts += 1
        else:
            self.jumps += 1
        if self.on_discontinuity is not None:
            self.on_discontinuity(Discontinuity(kind, after, seq))

    def _read_on(self) -> list[ReceivedBatch[B]]:
        """The next chunk of the answer `receive` is reading; once it ended, the gap's accounting and the live
        batch that revealed it."""
        reading = self._reading
        assert reading is not None
        out, ended = self._read_chunk(reading)
        if reading.catch_up and reading.last is not None:  # the feed goes on from the catch-up's last batch
            self.next_seq = max(self.next_seq or 0, reading.last + 1)
        if not ended:
            return out
        self._reading = None
        if reading.live is None:
            return out
        seq, payload = reading.live
        self.missed += max(0, seq - reading.start - reading.taken - reading.skipped)
        return out + self._take_live(seq, payload)

    def replay(self, start: int, stop: int | None = None) -> Iterator[list[ReceivedBatch[B]]]:
        """The batches [start, stop) (stop None: all) still in the publisher's replay buffer, in order, streamed:
        chunks of at most REPLAY_CHUNK_BATCHES batches and REPLAY_CHUNK_BYTES payload bytes, each read from the
        socket once the one before was taken. Nothing without a replay socket, or when none answers within
        `replay_timeout`. A publisher busy with other answers says so (`REPLAY_BUSY`): the request is sent again,
        less and less often, until `replay_timeout`. Not while `receive` is reading an answer (`reading`)."""
        if self._replay is None:
            return
        reading = self._ask(start, stop, None)
        while True:
            out, ended = self._read_chunk(reading)
            if out:
                yield out
            if ended:
                return

    def fetch(self, start: int, stop: int | None = None) -> list[ReceivedBatch[B]]:
        """`replay`'s batches as one list: it holds the whole answer (up to `replay_max_batches`), so a reader of a
        buffer it does not know the size of streams with `replay` instead."""
        return [b for chunk in self.replay(start, stop) for b in chunk]

    def _ask(self, start: int, stop: int | None, live: tuple[int, bytes] | None, catch_up: bool = False) -> _Reading:
        """Send a replay request; the reading of its answer. An earlier answer that did not end at its end marker
        may still be arriving: its socket is replaced, so none of it is read as this one's."""
        assert self._replay is not None
        if self._answer_open:
            self._replay.close(linger=0)
            self._replay = self._replay_socket()
        self._replay.send_multipart((b"", start.to_bytes(8, "big")))
        self._answer_open = True
        return _Reading(start, stop, live, self.replay_timeout, catch_up)

    def _read_chunk(self, reading: _Reading) -> tuple[list[ReceivedBatch[B]], bool]:
        """The next batches of `reading`'s answer — at most REPLAY_CHUNK_BATCHES messages read, REPLAY_CHUNK_BYTES
        payload bytes taken — and whether the answer ended."""
        out: list[ReceivedBatch[B]] = []
        size = 0
        for _ in range(REPLAY_CHUNK_BATCHES):
            frames = self._answer_message(reading)
            if frames is None:
                self.replayed += len(out)
                return out, True
            if len(frames[1]) != 8:
                self._skip(None, True, f"a replay message whose sequence frame is {len(frames[1])} bytes, not 8")
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq < reading.start or (reading.stop is not None and seq >= reading.stop) or \
                    (reading.last is not None and seq <= reading.last):
                continue  # outside what was asked, or not after the last one: not this answer's to give
            if reading.last is None and reading.catch_up:  # what the buffer no longer had
                self.missed += seq - reading.start
            reading.last = seq
            self._begun = True
            self._remember(seq, frames[2])
            batch = self._decode(seq, frames[2], True)
            if batch is None:
                reading.skipped += 1
                continue
            out.append(ReceivedBatch(seq, batch, True))
            reading.taken += 1
            size += len(frames[2])
            if size >= REPLAY_CHUNK_BYTES:
                break
        self.replayed += len(out)
        return out, False

    def _answer_message(self, reading: _Reading) -> list[bytes] | None:
        """The next message of an answer as [b"", seq, payload]; None once it ended: at its end marker, or cut
        short (counted) — silent past its deadline, a message that is not a replay message, or more than
        replay_max_batches."""
        assert self._replay is not None
        backoff = 0.02
        while reading.read < self.replay_max_batches:
            left = reading.deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(max(1, int(left * 1000))):
                break
            frames = self._replay.recv_multipart()
            if len(frames) == 4:  # SGLang's answers carry the topic before the sequence: [b"", topic, seq, payload]
                del frames[1]
            if len(frames) != 3:
                break
            if frames[1] == END_OF_REPLAY:
                self._answer_open = False
                return None
            if frames[1] == REPLAY_BUSY:  # ask again once the publisher's running answers had time to go
                time.sleep(min(backoff, max(0.0, reading.deadline - time.monotonic())))
                backoff = min(backoff * 2, 0.5)
                self._replay.send_multipart((b"", reading.start.to_bytes(8, "big")))
                continue
            reading.read += 1
            reading.deadline = time.monotonic() + self.replay_timeout
            return frames
        self.replays_cut_short += 1  # the socket is replaced before the next request (_ask)
        return None

    def _remember(self, seq: int, payload: bytes) -> None:
        """Keep a replayed batch's digest while the live feed may still bring its copy (it is past the feed)."""
        if self._live_last is not None and seq <= self._live_last:
            return
        self._replayed[seq] = _digest(payload)
        if len(self._replayed) > _REMEMBERED_REPLAYS:
            self._replayed.popitem(last=False)

    def _decode(self, seq: int, payload: bytes, replayed: bool) -> B | None:
        """The batch of a message; None (skipped, counted) when its payload is not one."""
        try:
            return self._decoder(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._skip(seq, replayed, f"a payload of {len(payload)} bytes that is not a KV-event batch ({exc})")
            return None

    def _skip(self, seq: int | None, replayed: bool, reason: str) -> None:
        self.malformed += 1
        if self.on_malformed is not None:
            self.on_malformed(MalformedMessage(seq, replayed, reason))

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        self._ctx.destroy(linger=0)

    def __enter__(self) -> "FeedSubscriber[B]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVEventSubscriber(FeedSubscriber[EventBatch]):
    """A subscriber to kvc's own feed (`KVEventPublisher`, `kvc serve --events`): `FeedSubscriber` with kvc's
    batch decoder."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 start: int | None = None, replay_timeout: float = 5.0,
                 on_malformed: Callable[[MalformedMessage], None] | None = None,
                 on_discontinuity: Callable[[Discontinuity], None] | None = None, max_gap: int = MAX_GAP,
                 replay_max_batches: int = REPLAY_MAX_BATCHES,
                 replay_max_message_bytes: int = REPLAY_MESSAGE_MAX_BYTES) -> None:
        super().__init__(endpoint, decode_batch, replay_endpoint=replay_endpoint, topic=topic, start=start,
                         replay_timeout=replay_timeout, on_malformed=on_malformed,
                         on_discontinuity=on_discontinuity, max_gap=max_gap, replay_max_batches=replay_max_batches,
                         replay_max_message_bytes=replay_max_message_bytes)

    def __enter__(self) -> "KVEventSubscriber":
        return self

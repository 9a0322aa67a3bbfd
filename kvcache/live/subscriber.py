"""The subscriber end of a KV-event feed (what `kvc events` and `kvc ns dump` read with; DESIGN §7b).

`FeedSubscriber` reads any engine's feed in the framing of `kvcache.live.feed`, with the payload decoder it is
given: a SUB socket, gap detection by sequence number, and replay of the missed batches when the publisher has a
replay socket. A publisher restarted on its endpoint (its numbering from 0 again) or whose numbering jumps is
followed and counted, never silently dropped, and a replay answer is handed over a bounded chunk at a time as it
arrives, never gathered whole, whatever the replay socket sends. SGLang's own publisher (`--kv-events-config`)
frames its feed alike (its replay answers with the topic frame in front of the sequence, accepted too), and its
batches decode with `kvcache.engines.sglang_events`; vLLM's with `kvcache.engines.vllm_events`.
`KVEventSubscriber` is the subscriber to kvc's own feed (`KVEventPublisher`, `kvc serve --events`). The
conversation with the replay socket (requests, busy publishers, answers cut short) is `replay_client.ReplayClient`'s;
what the batches mean (gaps, restarts, copies, decoding) is the subscriber's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import msgspec
import zmq

from ..errors import InvalidInput
from ..types.events import EventBatch, decode_batch
from .replay_client import Reading, ReplayClient, connect

B = TypeVar("B")  # a decoded batch: EventBatch on kvc's feed, what the subscriber's decoder returns on another


class ReceivedBatch(msgspec.Struct, Generic[B], gc=False):
    """A batch as a subscriber got it."""

    seq: int
    batch: B
    replayed: bool  # fetched from the replay socket (missed on the feed), not received live


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
REPLAY_MAX_BATCHES = 10_000_000  # messages one answer may send: past it (more than any buffer holds) it is cut
_REMEMBERED_REPLAYS = 65_536  # digests of replayed batches kept to know the live feed's copies of them


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


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
        self._ctx = zmq.Context()
        try:  # a subscriber that fails to start returns nothing to close: its context goes here
            self._sub = connect(self._ctx, zmq.SUB, endpoint)
            self._sub.setsockopt(zmq.RCVHWM, 0)  # a reader that falls behind queues, it does not drop
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._replay = None if replay_endpoint is None else ReplayClient(
                self._ctx, replay_endpoint, replay_timeout, replay_max_batches, replay_max_message_bytes)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.next_seq = start  # the sequence number expected next; None until the first batch (no start)
        self._catch_up = start is not None and replay_endpoint is not None  # fetch from `start` at once
        self._begun = False  # a batch came (live or replayed): before one, a live batch below `start` is passed
        self._live_last: int | None = None  # the last sequence number received live (a PUB feed is in order)
        self._replayed: OrderedDict[int, bytes] = OrderedDict()  # seq -> digest of batches replayed past it
        self._reading: Reading | None = None  # the replay answer `receive` is handing over
        self.missed = 0  # batches known missing that no replay could give back
        self.replayed = 0
        self.malformed = 0  # messages skipped: not a KV-event batch
        self.restarts = 0  # the numbering went back: followed from there
        self.jumps = 0  # the numbering leapt forward by more than max_gap: followed from there
        self.duplicates = 0  # live batches dropped as copies of ones a replay gave already
        self.on_malformed = on_malformed
        self.on_discontinuity = on_discontinuity

    @property
    def replays_cut_short(self) -> int:
        """Replay answers that ended without their end marker."""
        return self._replay.cut_short if self._replay is not None else 0

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
            assert self._replay is not None, "a catch-up is asked for with a replay endpoint only"
            self._reading = self._replay.ask(self.next_seq, None, None, catch_up=True)
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
        self._reading = self._replay.ask(start, seq, (seq, payload))
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
        reading = self._replay.ask(start, stop, None)
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

    def _read_chunk(self, reading: Reading) -> tuple[list[ReceivedBatch[B]], bool]:
        """The next batches of `reading`'s answer — at most REPLAY_CHUNK_BATCHES messages read, REPLAY_CHUNK_BYTES
        payload bytes taken — and whether the answer ended."""
        replay = self._replay
        assert replay is not None
        out: list[ReceivedBatch[B]] = []
        size = 0
        for _ in range(REPLAY_CHUNK_BATCHES):
            frames = replay.message(reading)
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

"""A subscriber's conversation with a publisher's replay socket (`ReplayClient`): one request at a time, its answer
read a message at a time (`Reading`), in the framing of `kvcache.live.feed`.

Nothing the replay socket sends can hold the reader or make it hold more than a bounded amount: the DEALER reads at
most REPLAY_QUEUE messages ahead, none larger than its cap (a larger one drops the connection unread). An answer
ends at its end marker; a publisher busy with other answers (`REPLAY_BUSY`) is asked again, less and less often,
until the answer's deadline; an answer that goes silent past its deadline, sends a message that is not a replay
message, or more than its maximum of messages, is cut short (counted in `cut_short`), and its socket is replaced
before the next request, so nothing of it is read as a later answer's. What the answer's batches mean (gaps, copies,
decoding) is the subscriber's (`kvcache.live.subscriber`).
"""

from __future__ import annotations

import time

import zmq

from .feed import END_OF_REPLAY, REPLAY_BUSY, open_socket

REPLAY_QUEUE = 4  # RCVHWM of the replay socket: messages ZeroMQ reads ahead of the subscriber


def connect(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, endpoint: str,
            options: dict[int, int] | None = None) -> zmq.Socket[bytes]:
    """A socket of `kind` connected to `endpoint`, `options` set before the connect; EventEndpointError when it
    cannot connect."""
    return open_socket(ctx, kind, endpoint, options or {}, bind=False)


class Reading:
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


class ReplayClient:
    """The DEALER on a publisher's replay socket at `endpoint`, on the subscriber's context `ctx` (see the module
    docstring): `ask` sends a request, `message` reads its answer. `timeout`: seconds of silence that end an answer;
    `max_batches`: messages one answer may send; `message_max`: bytes one message may have."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, timeout: float, max_batches: int,
                 message_max: int) -> None:
        self._ctx = ctx
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_batches = max_batches
        self._message_max = message_max
        self._sock = self._socket()
        self._open = False  # a request was sent whose answer has not ended at its end marker
        self.cut_short = 0  # answers that ended without their end marker

    def _socket(self) -> zmq.Socket[bytes]:
        """A DEALER on the replay endpoint that reads at most REPLAY_QUEUE messages ahead, none larger than the
        cap (a larger one disconnects the peer before it is read)."""
        return connect(self._ctx, zmq.DEALER, self.endpoint, {zmq.RCVHWM: REPLAY_QUEUE,
                                                              zmq.MAXMSGSIZE: self._message_max})

    def ask(self, start: int, stop: int | None, live: tuple[int, bytes] | None, catch_up: bool = False) -> Reading:
        """Send a replay request; the reading of its answer. An earlier answer that did not end at its end marker
        may still be arriving: its socket is replaced, so none of it is read as this one's."""
        if self._open:
            self._sock.close(linger=0)
            self._sock = self._socket()
        self._sock.send_multipart((b"", start.to_bytes(8, "big")))
        self._open = True
        return Reading(start, stop, live, self.timeout, catch_up)

    def message(self, reading: Reading) -> list[bytes] | None:
        """The next message of an answer as [b"", seq, payload]; None once it ended: at its end marker, or cut
        short (counted) — silent past its deadline, a message that is not a replay message, or more than
        `max_batches`."""
        backoff = 0.02
        while reading.read < self.max_batches:
            left = reading.deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                break
            frames = self._sock.recv_multipart()
            if len(frames) == 4:  # SGLang's answers carry the topic before the sequence: [b"", topic, seq, payload]
                del frames[1]
            if len(frames) != 3:
                break
            if frames[1] == END_OF_REPLAY:
                self._open = False
                return None
            if frames[1] == REPLAY_BUSY:  # ask again once the publisher's running answers had time to go
                time.sleep(min(backoff, max(0.0, reading.deadline - time.monotonic())))
                backoff = min(backoff * 2, 0.5)
                self._sock.send_multipart((b"", reading.start.to_bytes(8, "big")))
                continue
            reading.read += 1
            reading.deadline = time.monotonic() + self.timeout
            return frames
        self.cut_short += 1  # the socket is replaced before the next request (ask)
        return None

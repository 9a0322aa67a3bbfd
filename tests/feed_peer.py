"""A KV-event publisher a test scripts, on real ZeroMQ sockets on loopback: the feed (XPUB) and its replay socket
(ROUTER), speaking the framing of kvc's, SGLang's and vLLM's publishers (`kvcache.live.feed`), answering as the
test says — a well-behaved publisher, a restarted or jumping one, or a hostile one that floods, never ends, or sends
what no publisher would."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import zmq

from kvcache.live.feed import END_OF_REPLAY


def seq_frame(n: int) -> bytes:
    """A sequence number as the wire has it: 8 bytes, big-endian."""
    return n.to_bytes(8, "big")


class ReplayPeer:
    """A publisher a test scripts, on real sockets on loopback: an XPUB feed (it sees the subscription, so a test
    publishes once its subscriber is there) and a ROUTER replay socket whose n-th request (from `start`) is answered
    with the [seq frame, payload] pairs `answers(n, start)` yields — then END_OF_REPLAY when the iterator ends —
    every running answer a message at a time, each sent when its peer's queue takes it (ROUTER_MANDATORY)."""

    def __init__(self, answers: Callable[[int, int], Iterable[tuple[bytes, ...]]] = lambda n, start: (),
                 endpoint: str = "tcp://127.0.0.1:*") -> None:
        self._ctx = zmq.Context()
        self.pub = self._feed(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[int] = []
        self._answers = answers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _feed(self, endpoint: str) -> zmq.Socket:
        """An XPUB bound to `endpoint`; the bind is tried again while the port is still held by the feed closed
        just before (ZeroMQ closes a listener in its I/O thread, after close() returned)."""
        deadline = time.monotonic() + 60
        while True:
            sock = self._ctx.socket(zmq.XPUB)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(endpoint)
                return sock
            except zmq.ZMQError:
                sock.close(0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def restart_feed(self) -> None:
        """Close the feed and bind a new one on the same endpoint: a publisher restarted (its subscribers
        reconnect by themselves)."""
        self.pub.close(0)
        self.pub = self._feed(self.endpoint)

    def subscribed(self, timeout_s: float = 60) -> None:
        """Block until a subscription to everything reaches the feed."""
        assert self.pub.poll(int(timeout_s * 1000)) and self.pub.recv() == b"\x01", "no subscriber came"

    def publish(self, seq: int, payload: bytes) -> None:
        """One batch on the feed: [topic "", seq, payload]."""
        self.pub.send_multipart([b"", seq_frame(seq), payload])

    def _serve(self) -> None:
        running: dict[bytes, tuple] = {}  # peer -> (its answer, the frames waiting for room in its queue)
        while not self._stop.is_set():
            if self.router.poll(0 if running else 20):
                peer, _, start = self.router.recv_multipart()
                self.requests.append(int.from_bytes(start, "big"))
                running[peer] = (iter(self._answers(len(self.requests) - 1, self.requests[-1])), None)
            for peer, (answer, waiting) in list(running.items()):
                frames = waiting if waiting is not None else next(answer, None)
                message = [peer, b"", *(frames if frames is not None else (END_OF_REPLAY, b""))]
                try:
                    self.router.send_multipart(message, zmq.NOBLOCK)
                except zmq.Again:  # its queue is full: the same frames again on the next round
                    running[peer] = (answer, frames)
                    continue
                except zmq.ZMQError:  # the peer left: its answer goes nowhere
                    del running[peer]
                    continue
                if frames is None:
                    del running[peer]
                else:
                    running[peer] = (answer, None)

    def close(self) -> None:
        """Stop answering and close the sockets."""
        self._stop.set()
        self._thread.join(timeout=60)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> "ReplayPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

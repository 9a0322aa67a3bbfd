"""SGLang's KV-event feed published again from the messages its own publisher sent
(tests/goldens/sglang/sglang_events.json, written by tests/goldens/sglang/make_sglang_events.py), on real ZeroMQ
sockets on loopback, without SGLang.

`GoldenFeed` binds an XPUB socket (a PUB that also hands the publisher each subscription, so a test publishes once
its subscriber is there: no sleep) and a ROUTER replay socket answering as SGLang's `ZmqEventPublisher` does:
``[b"", topic, seq, payload]`` per buffered batch from the asked sequence number, then
``[b"", b"", -1, b""]`` — the framing captured in the golden file.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import zmq

GOLDEN = json.loads((Path(__file__).resolve().parent / "goldens" / "sglang" / "sglang_events.json").read_text())
MESSAGES: list[list[bytes]] = [[bytes.fromhex(f) for f in m] for m in GOLDEN["messages"]]  # [topic, seq, payload]
REPLAY_END: list[bytes] = [bytes.fromhex(f) for f in GOLDEN["replay_end"]]  # [b"", b"", -1, b""]
SALTS = sorted({r["cache_salt"] for r in GOLDEN["requests"] if r["cache_salt"]})


class GoldenFeed:
    """The golden messages behind a PUB (XPUB) and a replay (ROUTER) socket on loopback; a context manager."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self.pub = self._ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def wait_for_subscriber(self, timeout_s: float = 60, reader: subprocess.Popen | None = None) -> bytes:
        """Block until a subscription reaches the publisher (ZeroMQ hands XPUB ``\\x01`` + the topic); return it.
        AssertionError when none came within `timeout_s`, or as soon as the `reader` process (the subscriber to
        be) has exited."""
        deadline = time.monotonic() + timeout_s
        while not self.pub.poll(100):
            assert reader is None or reader.poll() is None, f"the reader exited ({reader.returncode}) unsubscribed"
            assert time.monotonic() < deadline, "no subscriber came"
        return self.pub.recv()

    def publish(self, *seqs: int) -> None:
        """Send the golden messages with these sequence numbers, as SGLang's PUB socket sent them."""
        for seq in seqs:
            self.pub.send_multipart(MESSAGES[seq])

    def _serve_replay(self) -> None:
        """SGLang's `_service_replay`: every buffered batch from the asked sequence number on, then the end."""
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            peer, empty, start = self._router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            for topic, seq, payload in MESSAGES:
                if int.from_bytes(seq, "big") >= int.from_bytes(start, "big"):
                    self._router.send_multipart([peer, empty, topic, seq, payload])
            self._router.send_multipart([peer, *REPLAY_END])

    def close(self) -> None:
        """Stop the replay thread and close the sockets."""
        self._stop.set()
        self._thread.join()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> "GoldenFeed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The ZeroMQ KV-event publisher and subscriber: sequence numbers, replay of missed batches from a bounded buffer,
an engine that never waits for a subscriber."""

from __future__ import annotations

import time

import pytest
import zmq

from factories import make_cache
from kvcache import InvalidInput, KVEventPublisher, KVEventSubscriber, Namespace, Request
from kvcache.types.events import AllBlocksCleared, BlockStored, decode_batch
from kvcache.live.events import END_OF_REPLAY, records


def _step(cache, i: int, tokens: int = 8) -> None:
    """One scheduler step that changes the cache: a request of its own pages, committed, then the poll."""
    cache.admit(Request(f"r{i}", list(range(1000 * i, 1000 * i + tokens)), Namespace("t", "s")))
    cache.commit(f"r{i}")
    cache.poll()


def _ask(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """A raw replay request, as vLLM's protocol has it: [b"", start] -> [b"", seq, payload]... [b"", -1, b""]."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while dealer.poll(5000):
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_OF_REPLAY:
            assert payload == b""
            break
        out.append((int.from_bytes(seq, "big"), payload))
    dealer.close(0)
    return out


def test_missed_batches_are_sent_again_from_the_replay_buffer_and_the_buffer_is_bounded():
    cache = make_cache(page_size=2, device_tokens=256, host_tokens=0)
    with KVEventPublisher(cache, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                          buffer_batches=4) as pub:
        for i in range(6):
            _step(cache, i)
        assert pub.stats().next_seq == 7  # the announcement, then one batch per step
        got = _ask(pub.replay_endpoint, 2)
        assert [seq for seq, _ in got] == [3, 4, 5, 6]  # 2 left the 4-batch buffer
        first = decode_batch(got[0][1])
        assert [type(ev) for ev in first.events] == [BlockStored]
        assert first.events[0].token_ids == list(range(2000, 2008))
        assert _ask(pub.replay_endpoint, 7) == []  # nothing from the future; the end marker still comes
        st = pub.stats()
        assert (st.replay_requests, st.replayed_batches, st.buffered) == (2, 4, 4)
    cache.close()


def test_a_late_subscriber_gets_what_it_missed_and_then_the_live_feed():
    cache = make_cache(page_size=2, device_tokens=256, host_tokens=0)
    with KVEventPublisher(cache, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv") as pub:
        _step(cache, 0)
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="kv", start=0) as sub:
            got = sub.receive(timeout=5)  # what it missed, from the buffer, at once
            time.sleep(0.2)
            _step(cache, 1)
            got += sub.receive(timeout=5)
            _step(cache, 2)
            got += sub.receive(timeout=5)
            assert sub.missed == 0 and sub.replayed == 2
        assert [(b.seq, b.replayed) for b in got] == [(0, True), (1, True), (2, False), (3, False)]
        assert isinstance(got[0].batch.events[0], AllBlocksCleared)
        recs = [r for b in got for r in records(b)]
        assert recs[0].type == "AllBlocksCleared" and recs[0].replayed
        assert recs[-1].type == "BlockStored" and recs[-1].token_ids == list(range(2000, 2008))
        assert recs[-1].extra_key == "t" and recs[-1].salt_fingerprint == Namespace("t", "s").salt_fingerprint
        assert len(recs[-1].block_hashes[0]) == 32  # hex of a 16-byte page hash
    cache.close()


def test_a_subscriber_that_never_reads_does_not_hold_the_engine():
    cache = make_cache(page_size=2, device_tokens=8192, host_tokens=0)
    with KVEventPublisher(cache, "tcp://127.0.0.1:*", hwm=2) as pub:
        ctx = zmq.Context()
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(pub.endpoint)
        time.sleep(0.2)
        start = time.monotonic()
        for i in range(300):  # ~2 MB of events: more than the socket buffers of a reader that never reads
            _step(cache, i, tokens=512)
        assert time.monotonic() - start < 30  # it finished: nothing blocked on the stuck subscriber
        assert pub.stats().batches == 301
        stuck.close(0)
        ctx.term()
    cache.close()


def test_options_are_checked_and_a_connect_error_names_the_endpoint():
    cache = make_cache()
    with pytest.raises(InvalidInput, match="buffer_batches"):
        KVEventPublisher(cache, "tcp://127.0.0.1:*", buffer_batches=0)
    from kvcache import EventEndpointError

    with pytest.raises(EventEndpointError, match="'tcp://nowhere'.*cannot connect"):
        KVEventSubscriber("tcp://nowhere")
    pub = KVEventPublisher(cache, "tcp://127.0.0.1:*")
    with pytest.raises(EventEndpointError, match="cannot bind"):  # the same address twice
        KVEventPublisher(make_cache(), pub.endpoint)
    pub.close()
    pub.close()  # idempotent
    assert cache.tree.on_copy is None


def test_a_subscriber_that_fails_to_start_keeps_no_socket_or_context():
    import gc
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with pytest.raises(UnicodeEncodeError):  # a topic from argv bytes that are not UTF-8
            KVEventSubscriber("tcp://127.0.0.1:5557", topic="\udcff")
        gc.collect()  # a socket or context left open by the failed start would warn here


def test_a_malformed_message_is_skipped_and_counted_and_the_reading_goes_on():
    """Issue 26 #7: the subscriber raised InvalidInput on the first message that was not a KV-event batch, so
    `kvc events --follow` (and a router) stopped there. Now it is skipped, counted and handed to on_malformed, on
    the feed and in a replay answer alike; the good batches around it all arrive, none counted missed."""
    import threading

    from kvcache.live.events import MalformedMessage
    from kvcache.types.events import EventBatch, encode_batch

    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.XPUB)  # a hostile publisher: it sees the subscription, so it sends after it
        pub.bind("tcp://127.0.0.1:*")
        router = ctx.socket(zmq.ROUTER)
        router.bind("tcp://127.0.0.1:*")
        good = encode_batch(EventBatch(1.0, [AllBlocksCleared()]))
        seq = [i.to_bytes(8, "big") for i in range(5)]

        def replay_answers_junk():  # the replay of batch 2 is no batch either
            who, empty, start = router.recv_multipart()
            assert int.from_bytes(start, "big") == 2
            router.send_multipart([who, b"", seq[2], b"\xc1junk"])
            router.send_multipart([who, b"", END_OF_REPLAY, b""])

        server = threading.Thread(target=replay_answers_junk, daemon=True)
        server.start()
        notes: list[MalformedMessage] = []
        sub = KVEventSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT),
                                replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT),
                                on_malformed=notes.append)
        with sub:
            assert pub.poll(60_000) and pub.recv() == b"\x01"  # subscribed to everything
            for frames in ([b"", seq[0], good], [b"", b"not a sequence"], [b"", seq[1], b"\x92garbage"],
                           [b"", seq[3], good], [b"", seq[4], good]):
                pub.send_multipart(frames)
            got = []
            for _ in range(50):  # each receive returns at least one message's worth; bounded, never timed
                got += sub.receive(timeout=60)
                if [b.seq for b in got] == [0, 3, 4]:
                    break
            assert [b.seq for b in got] == [0, 3, 4] and not any(b.replayed for b in got)
            assert sub.malformed == 3 and sub.missed == 0
            assert [(n.seq, n.replayed) for n in notes] == [(None, False), (1, False), (2, True)]
            assert "2 frames" in notes[0].reason and "not a KV-event batch" in notes[1].reason
        server.join(timeout=60)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("kind", ["file", "link", "fifo"])
def test_an_ipc_endpoint_never_replaces_what_is_at_its_path(tmp_path, kind):
    """Issue 26 #6: ZeroMQ unlinks whatever is at an ipc:// path before binding, so `kvc serve --events
    ipc:///path` turned a file, a link or a FIFO there into its socket. Now it is refused, naming the endpoint;
    a stale socket is still taken over."""
    import os
    import socket
    import stat

    from kvcache import EventEndpointError

    path = tmp_path / "feed"
    victim = tmp_path / "victim"
    victim.write_text("kept\n")
    {"file": lambda: path.write_text("kept\n"), "link": lambda: path.symlink_to(victim),
     "fifo": lambda: os.mkfifo(path)}[kind]()
    before = os.lstat(path)
    cache = make_cache()
    try:
        bound = KVEventPublisher(cache, f"ipc://{path}")
    except EventEndpointError as exc:
        assert "exists and is not a socket; refusing to replace it" in str(exc)
    else:  # close it, or its threads keep the test process alive
        bound.close()
        pytest.fail(f"bound over the {kind} at {path}")
    after = os.lstat(path)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))
    assert victim.read_text() == "kept\n" and cache.tree.on_copy is None
    stale = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX) as s:  # bound, then closed: a socket file nobody serves
        s.bind(str(stale))
    with KVEventPublisher(cache, f"ipc://{stale}") as publisher:
        assert publisher.stats().endpoint == f"ipc://{stale}"


# --- bounded doors (issue 26 #4) -------------------------------------------------------------------------------

@pytest.mark.parametrize("typed, endpoint", [
    ("5557", "tcp://127.0.0.1:5557"), ("*", "tcp://127.0.0.1:*"), (" 0 ", "tcp://127.0.0.1:0"),
    ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5557"), ("ipc:///run/kvc/events", "ipc:///run/kvc/events"),
])
def test_a_port_alone_means_loopback(typed, endpoint):
    from kvcache.live.events import endpoint_of

    assert endpoint_of(typed) == endpoint


@pytest.mark.parametrize("endpoint, wide", [
    ("tcp://*:5557", True), ("tcp://0.0.0.0:5557", True), ("tcp://[::]:5557", True), ("tcp://:::5557", True),
    ("tcp://*:*", True), ("tcp://127.0.0.1:5557", False), ("tcp://10.1.2.3:*", False), ("tcp://[::1]:5557", False),
    ("ipc:///tmp/feed", False), ("inproc://feed", False),
])
def test_a_wildcard_host_is_recognised_as_every_interface(endpoint, wide):
    from kvcache.live.events import binds_every_interface

    assert binds_every_interface(endpoint) is wide


def test_the_publisher_binds_loopback_unless_an_address_is_given_and_flags_a_wildcard():
    cache = make_cache()
    with KVEventPublisher(cache, replay_endpoint="tcp://127.0.0.1:*") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.every_interface
        assert not pub.stats().every_interface
    with KVEventPublisher(cache, "tcp://127.0.0.1:*", replay_endpoint="tcp://*:*") as pub:
        assert pub.every_interface and pub.stats().every_interface  # the replay socket is a door too
    for bad in ({"hwm": 0}, {"replay_hwm": 0}, {"max_replays": 0}, {"replay_stall_s": float("nan")}):
        with pytest.raises(InvalidInput, match=next(iter(bad))):  # 0 is ZeroMQ's "no limit": refused
            KVEventPublisher(cache, **bad)
    cache.close()


# A publisher in a process of its own, so its memory is measured alone: a buffer of BATCHES batches of about 47 KB
# (one BlockStored of 1024 pages, and what the eviction removes), then a line of stats per line read on stdin.
PUBLISHER = """
import json, sys
from kvcache import CacheConfig, KVEventPublisher, KVLayout, Namespace, Request, TieredCache

def memory():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

batches, tokens = int(sys.argv[1]), int(sys.argv[2])
layout = KVLayout("feed-flood@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=2)
cache = TieredCache(CacheConfig(layout, device_tokens=4 * tokens, host_tokens=0, device="cpu"))
pub = KVEventPublisher(cache, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_batches=batches + 1)
for i in range(batches):
    cache.admit(Request(f"r{i}", list(range(tokens * i, tokens * (i + 1))), Namespace("t", "s")))
    cache.commit(f"r{i}")
    cache.poll()
for line in sys.stdin:
    print(json.dumps({**json.loads(__import__("msgspec").json.encode(pub.stats())), **memory()}), flush=True)
pub.close()
cache.close()
"""


class _Child:
    """The publisher process: its endpoints, and its stats and memory on demand."""

    def __init__(self, batches: int, tokens: int) -> None:
        import subprocess
        import sys
        from pathlib import Path

        import kvcache

        # run where this kvcache lies: `python -c` looks in its working directory first
        self.proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(batches), str(tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=Path(kvcache.__file__).resolve().parents[1])
        first = self.stats()
        self.endpoint, self.replay_endpoint = first["endpoint"], first["replay_endpoint"]

    def stats(self) -> dict:
        import json

        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the publisher process died"
        return json.loads(line)

    def until(self, ready, what: str) -> dict:
        """Ask for stats until `ready(stats)` (each answer is an event: no sleeping), within a minute."""
        deadline = time.monotonic() + 60
        while not ready(st := self.stats()):
            assert time.monotonic() < deadline, f"{what}: {st}"
        return st

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0
        self.proc.stdout.close()


def _hostile(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A replay client that will never read: the smallest queues and buffers it can have, so what the publisher
    sends it piles up on the publisher's side."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


MiB = 1 << 20


def test_64_clients_that_ask_for_a_replay_and_never_read_leave_the_publishers_memory_flat():
    """Issue 26 #4: each request queued a copy of the whole buffer (64 non-reading clients: +4.4 GiB). Now the
    answers share the buffer's frames and leave as their clients read; 8 run at once, the rest are told busy."""
    batches = 400
    child = _Child(batches, tokens=2048)
    ctx = zmq.Context()
    try:
        before = child.stats()
        assert before["buffered"] == batches + 1 and before["bytes"] > 400 * 8000  # the buffer: > 3 MB
        flooders = [_hostile(ctx, child.replay_endpoint) for _ in range(64)]
        for sock in flooders:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
        child.until(lambda st: st["replay_requests"] + st.get("replay_busy", 0) >= 64, "64 requests read")
        with KVEventSubscriber(child.endpoint, replay_endpoint=child.replay_endpoint, replay_timeout=60) as good:
            got = good.fetch(0)  # a client that reads gets its whole answer, flooders or not
        assert [b.seq for b in got] == list(range(batches + 1))
        after = child.until(lambda st: st.get("replay_active", 0) == 0, "the flooders' answers abandoned")
        grown = after["VmHWM"] - before["VmRSS"]  # the peak, not the moment: nothing grew and went away
        assert grown < 64 * MiB, f"the publisher grew {grown / MiB:.0f} MiB (a copy per request: > 1 GiB)"
        assert after["replay_busy"] >= 1  # the cap on answers running at once held
        assert after["replay_cut_short"] >= 8  # the non-reading clients' answers were abandoned, and counted
        assert after["replay_requests"] + after["replay_busy"] >= 65
        for sock in flooders:
            sock.close(0)
    finally:
        ctx.destroy(linger=0)
        child.close()


def test_a_huge_message_to_the_replay_socket_is_refused_unread():
    """Issue 26 #4: one 512 MiB frame sent to the replay socket added 637 MiB. Now a message larger than a request
    disconnects its sender before it is read (64 MiB sent here)."""
    from zmq.utils.monitor import recv_monitor_message

    child = _Child(4, tokens=64)
    ctx = zmq.Context()
    try:
        before = child.stats()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(child.replay_endpoint)
        assert monitor.poll(60_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        sock.send_multipart([b"", bytes(64 * MiB)])
        # the publisher hangs up on it (on main it read the 64 MiB and counted a malformed request)
        assert monitor.poll(60_000), "the publisher kept the connection of a 64 MiB request"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        sock.disconnect(child.replay_endpoint)  # no reconnection: it would send the rest of its queue again
        after = child.stats()
        assert after["replay_malformed"] == 0 and after["replay_requests"] == 0  # never read
        grown = after["VmHWM"] - before["VmRSS"]
        assert grown < 16 * MiB, f"the publisher grew {grown / MiB:.0f} MiB for a request it refused"
        assert [seq for seq, _ in _ask(child.replay_endpoint, 0)] == [0, 1, 2, 3, 4]  # it still answers others
        monitor.close(0)
        sock.close(0)
    finally:
        ctx.destroy(linger=0)
        child.close()


def test_a_subscription_larger_than_any_topic_disconnects_its_subscriber():
    """The feed's socket reads subscriptions; one of 64 KiB (no topic is that long) is refused unread."""
    from zmq.utils.monitor import recv_monitor_message

    cache = make_cache()
    ctx = zmq.Context()
    with KVEventPublisher(cache, "tcp://127.0.0.1:*") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.setsockopt(zmq.SUBSCRIBE, b"x" * 65536)
        sub.connect(pub.endpoint)
        assert monitor.poll(60_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert monitor.poll(60_000), "the publisher kept a subscriber that sent a 64 KiB subscription"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        monitor.close(0)
        sub.close(0)
    ctx.term()
    cache.close()

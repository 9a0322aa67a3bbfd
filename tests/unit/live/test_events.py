"""The ZeroMQ KV-event publisher and subscriber: sequence numbers, replay of missed batches from a bounded buffer,
an engine that never waits for a subscriber."""

from __future__ import annotations

import time

import pytest
import zmq

from factories import make_cache
from feed_peer import ReplayPeer
from feed_peer import seq_frame as _seq
from kvcache import InvalidInput, KVEventPublisher, KVEventSubscriber, Namespace, Request
from kvcache.live.event_records import records
from kvcache.live.feed import END_OF_REPLAY
from kvcache.types.events import AllBlocksCleared, BlockStored, decode_batch


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
        assert recs[-1].extra_key == "t" and recs[-1].salt_fingerprint == cache.fingerprints.fingerprint(Namespace("t", "s"))
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

    from kvcache.live.subscriber import MalformedMessage
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
    from kvcache.live.feed import endpoint_of

    assert endpoint_of(typed) == endpoint


@pytest.mark.parametrize("endpoint, wide", [
    ("tcp://*:5557", True), ("tcp://0.0.0.0:5557", True), ("tcp://[::]:5557", True), ("tcp://:::5557", True),
    ("tcp://*:*", True), ("tcp://127.0.0.1:5557", False), ("tcp://10.1.2.3:*", False), ("tcp://[::1]:5557", False),
    ("ipc:///tmp/feed", False), ("inproc://feed", False),
])
def test_a_wildcard_host_is_recognised_as_every_interface(endpoint, wide):
    from kvcache.live.feed import binds_every_interface

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
    """The publisher process (forked from a server that imported kvc and torch once: `forkrun`): its endpoints, and
    its stats and memory on demand."""

    def __init__(self, forks, batches: int, tokens: int) -> None:
        self.proc = forks.piped(["-c", str(batches), str(tokens)], script=PUBLISHER, stdin=True)
        first = self.stats()
        self.endpoint, self.replay_endpoint = first["endpoint"], first["replay_endpoint"]

    def stats(self) -> dict:
        import json

        self.proc.write("\n")
        line = self.proc.readline()
        assert line, f"the publisher process died: {self.proc.stderr}"
        return json.loads(line)

    def until(self, ready, what: str) -> dict:
        """Ask for stats until `ready(stats)` (each answer is an event: no sleeping), within a minute."""
        deadline = time.monotonic() + 60
        while not ready(st := self.stats()):
            assert time.monotonic() < deadline, f"{what}: {st}"
        return st

    def close(self) -> None:
        self.proc.close_stdin()
        code = self.proc.wait(timeout=60)
        self.proc.close()
        assert code == 0


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


def test_64_clients_that_ask_for_a_replay_and_never_read_leave_the_publishers_memory_flat(engine_forks):
    """Issue 26 #4: each request queued a copy of the whole buffer (64 non-reading clients: +4.4 GiB). Now the
    answers share the buffer's frames and leave as their clients read; 8 run at once, the rest are told busy."""
    batches = 400
    child = _Child(engine_forks, batches, tokens=2048)
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


def test_a_huge_message_to_the_replay_socket_is_refused_unread(engine_forks):
    """Issue 26 #4: one 512 MiB frame sent to the replay socket added 637 MiB. Now a message larger than a request
    disconnects its sender before it is read (64 MiB sent here)."""
    from zmq.utils.monitor import recv_monitor_message

    child = _Child(engine_forks, 4, tokens=64)
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


# --- a reader that cannot be blinded or flooded (issue 36 #4) ----------------------------------------------------

def _kvc_batch(ts: float = 1_700_000_000.0, tokens: int = 2) -> bytes:
    """A kvc batch: one BlockStored of `tokens` tokens (payload ~3 bytes a token)."""
    from kvcache.types.events import EventBatch, encode_batch

    stored = BlockStored([b"h" * 16], None, list(range(60_000, 60_000 + tokens)), tokens, None, "host", None)
    return encode_batch(EventBatch(ts, [stored], 0))


def _gather(sub, enough, step=None, rounds: int = 60) -> list:
    """receive() until `enough(got)`, a step of the publisher before each call when given; each call waits for a
    batch (a second at most), so the bound is the number of rounds, never a sleep."""
    got: list = []
    for i in range(rounds):
        if step is not None:
            step(i)
        got += sub.receive(timeout=1)
        if enough(got):
            return got
    raise AssertionError(f"not enough in {rounds} rounds: {[b.seq for b in got]}")


def test_a_publisher_restarted_on_the_same_endpoint_is_followed_from_its_new_numbering():
    """Issue 36 #4: once `kvc serve` (or an engine) restarted on the same endpoint, numbering from 0 again, the
    subscriber dropped every batch below the highest sequence number it had seen — silently, with no count: the
    reader went blind. Now the restart is handed to on_discontinuity and counted, and the new run is followed from
    its batch 0 (the ones before the first received live fetched from the new publisher's replay socket)."""
    from kvcache.live.subscriber import Discontinuity

    breaks: list[Discontinuity] = []
    first = make_cache(page_size=2, device_tokens=512, host_tokens=0)
    pub = KVEventPublisher(first, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    endpoint, replay_endpoint = pub.endpoint, pub.replay_endpoint
    with KVEventSubscriber(endpoint, replay_endpoint=replay_endpoint, start=0, on_discontinuity=breaks.append,
                           replay_timeout=60) as sub:
        old = _gather(sub, lambda got: got and got[-1].seq == 20, step=lambda i: i < 20 and _step(first, i))
        assert [b.seq for b in old] == list(range(21)) and breaks == []
        pub.close()
        first.close()
        second = make_cache(page_size=2, device_tokens=512, host_tokens=0)
        with KVEventPublisher(second, endpoint, replay_endpoint=replay_endpoint) as again:  # its batch 0 goes now
            new = _gather(sub, lambda got: len(got) >= 3, step=lambda i: _step(second, 100 + i))
            assert again.stats().next_seq >= 3
        second.close()
    assert [b.seq for b in new[:3]] == [0, 1, 2]  # the new run, from its first batch
    assert isinstance(new[0].batch.events[0], AllBlocksCleared)  # ... which clears what the old one announced
    assert sub.restarts == 1 and sub.jumps == 0 and sub.missed == 0
    assert len(breaks) == 1 and (breaks[0].kind, breaks[0].after) == ("restarted", 20)
    assert new[breaks[0].seq].replayed is False and all(b.replayed for b in new[:breaks[0].seq])


def test_a_numbering_that_jumps_forward_or_back_is_followed_said_and_counted():
    """Issue 36 #4: a jump of the numbering (10**12 ahead) counted 10**12 batches "missed", and every batch after
    a jump back was dropped. Now a leap past max_gap is a jump, a step back a restart: both followed and counted;
    a restarted publisher numbers from 0, so the new run's batches before the first one seen are missed."""
    from kvcache.live.subscriber import MAX_GAP, Discontinuity

    far = 10**12
    breaks: list[Discontinuity] = []
    with ReplayPeer() as feed, KVEventSubscriber(feed.endpoint, on_discontinuity=breaks.append) as sub:
        feed.subscribed()
        for seq in (0, 1, 2, far, far + 1, 3, 4, 6):
            feed.publish(seq, _kvc_batch())
        got = _gather(sub, lambda got: len(got) == 8)
    assert [b.seq for b in got] == [0, 1, 2, far, far + 1, 3, 4, 6]
    assert [(b.kind, b.after, b.seq) for b in breaks] == [("jumped", 2, far), ("restarted", far + 1, 3)]
    assert (sub.jumps, sub.restarts) == (1, 1)
    assert sub.missed == 3 + 1  # the new run's 0..2, and 5 (an ordinary gap, nothing to replay it)
    assert far - 2 > MAX_GAP


def test_a_gap_up_to_max_gap_is_a_gap_and_past_it_a_jump():
    with ReplayPeer() as feed, KVEventSubscriber(feed.endpoint, max_gap=10) as sub:
        feed.subscribed()
        for seq in (0, 11, 23):  # 10 missing (a gap of max_gap), then 11 (a jump)
            feed.publish(seq, _kvc_batch())
        got = _gather(sub, lambda got: len(got) == 3)
    assert [b.seq for b in got] == [0, 11, 23] and (sub.missed, sub.jumps, sub.restarts) == (10, 1, 0)


def test_the_feeds_copies_of_replayed_batches_are_dropped_and_a_restart_after_a_catch_up_is_not():
    """A late subscriber's catch-up and the live feed overlap: the feed's copies of what the replay gave are
    dropped (known by their bytes, counted as duplicates), and a batch below the expected one that is not such a
    copy is a restart, followed."""
    payloads = [_kvc_batch(1_700_000_000.0 + i) for i in range(5)]
    with ReplayPeer(lambda n, start: [(_seq(i), payloads[i]) for i in range(start, 5)]) as feed:
        with KVEventSubscriber(feed.endpoint, replay_endpoint=feed.replay_endpoint, start=0) as sub:
            feed.subscribed()
            for i in range(5):  # queued at the subscriber while it reads the catch-up
                feed.publish(i, payloads[i])
            feed.publish(5, _kvc_batch(1_700_000_005.0))
            feed.publish(0, _kvc_batch(1_800_000_000.0))  # another publisher's batch 0: a restart
            got = _gather(sub, lambda got: len(got) == 7)
    assert [(b.seq, b.replayed) for b in got] == [(i, True) for i in range(5)] + [(5, False), (0, False)]
    assert got[-1].batch.ts == 1_800_000_000.0
    assert (sub.duplicates, sub.restarts, sub.missed, sub.replayed) == (5, 1, 0, 5)
    assert feed.requests == [0]


@pytest.mark.parametrize("how", ["replay", "follow"])
def test_a_replay_answer_is_handed_over_in_bounded_chunks_as_it_arrives(how):
    """Issue 36 #4: `kvc events --replay` kept everything a replay socket sent until the answer's end (308 MiB held
    for 431 MiB sent). Now an answer is handed over as it arrives: the peer here sends no batch more than two
    chunks ahead of what the subscriber handed over, and the answer — 4,000 batches, ~12 MB, far more than a chunk
    of either cap — still arrives whole, every chunk within both caps. What is held is counted, not timed."""
    import threading

    from kvcache.live.subscriber import REPLAY_CHUNK_BATCHES, REPLAY_CHUNK_BYTES
    from kvcache.types.events import encode_batch

    total, ahead = 4_000, 2 * REPLAY_CHUNK_BATCHES
    payloads = [_kvc_batch(tokens=1_000) for _ in range(total)]
    handed = threading.Condition()
    taken = [0]

    def gated(n, start):
        for i in range(start, total):
            with handed:  # the peer sends batch i only once the subscriber handed over all but `ahead` before it
                assert handed.wait_for(lambda i=i: i - taken[0] <= ahead, timeout=60), "the subscriber held on"
            yield _seq(i), payloads[i]

    chunks = []

    def take(chunk):
        chunks.append((len(chunk), sum(len(encode_batch(b.batch)) for b in chunk)))
        with handed:
            taken[0] += sum(1 for b in chunk if b.replayed)
            handed.notify_all()

    with ReplayPeer(gated) as feed:
        with KVEventSubscriber(feed.endpoint, replay_endpoint=feed.replay_endpoint, replay_timeout=60) as sub:
            if how == "replay":
                for chunk in sub.replay(0):
                    take(chunk)
                got = taken[0]
            else:  # the live feed's batch `total` reveals the gap [1, total): filled a chunk per receive()
                feed.subscribed()
                feed.publish(0, _kvc_batch())
                feed.publish(total, _kvc_batch())
                seqs: list[int] = []
                while not seqs or seqs[-1] != total:
                    chunk = sub.receive(timeout=60)
                    assert chunk or sub.reading, "nothing came"
                    take(chunk)
                    seqs += [b.seq for b in chunk]
                assert seqs == list(range(total + 1)) and sub.missed == 0
                got = taken[0] + 1  # batch 0's replay is not asked for: it came live
    assert got == total
    assert sum(n for n, _ in chunks) >= total and len(chunks) > total // REPLAY_CHUNK_BATCHES
    assert max(n for n, _ in chunks) <= REPLAY_CHUNK_BATCHES + (how == "follow")  # + the live batch after a gap
    assert max(size for _, size in chunks) <= REPLAY_CHUNK_BYTES + len(payloads[0])
    assert sub.replays_cut_short == 0 and sum(size for _, size in chunks) > REPLAY_CHUNK_BYTES


def test_an_answer_that_never_ends_is_cut_at_its_cap_and_the_next_one_reads_clean():
    """A replay socket that streams for ever is read up to replay_max_batches and no further: the answer is cut
    short (counted) and its socket replaced, so nothing of it reaches the next answer."""
    import itertools

    def answers(n, start):
        if n == 0:
            return ((_seq(i), _kvc_batch()) for i in itertools.count(start))  # never ends
        return [(_seq(7), _kvc_batch()), (_seq(8), _kvc_batch())]

    with ReplayPeer(answers) as feed:
        with KVEventSubscriber(feed.endpoint, replay_endpoint=feed.replay_endpoint, replay_timeout=60,
                               replay_max_batches=1_000) as sub:
            held = [len(chunk) for chunk in sub.replay(0)]
            assert sum(held) == 1_000 and sub.replays_cut_short == 1
            assert [b.seq for b in sub.fetch(7)] == [7, 8] and sub.replays_cut_short == 1
    assert feed.requests == [0, 7]


def test_a_replay_message_over_the_size_cap_is_refused_unread():
    """A message larger than replay_max_message_bytes drops the replay connection before it is read (ZeroMQ's
    MAXMSGSIZE): the batches before it are handed over, the answer is cut short, the next one reads clean."""
    from zmq.utils.monitor import recv_monitor_message

    def answers(n, start):
        if n == 0:
            return [(_seq(0), _kvc_batch()), (_seq(1), b"\x00" * (1 << 20)), (_seq(2), _kvc_batch())]
        return [(_seq(start), _kvc_batch())]

    with ReplayPeer(answers) as feed:
        monitor = feed.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        with KVEventSubscriber(feed.endpoint, replay_endpoint=feed.replay_endpoint, replay_timeout=1,
                               replay_max_message_bytes=64 << 10) as sub:
            assert [b.seq for b in sub.fetch(0)] == [0]  # 2 went to a connection that is gone
            assert sub.replays_cut_short == 1 and sub.malformed == 0
            assert monitor.poll(60_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert [b.seq for b in sub.fetch(5)] == [5]
        monitor.close(0)


def test_a_subscriber_refuses_limits_that_would_open_a_door():
    for bad in ({"replay_timeout": float("nan")}, {"replay_timeout": 0}, {"max_gap": 0}, {"replay_max_batches": 0},
                {"replay_max_message_bytes": 0}):
        with pytest.raises(InvalidInput, match=next(iter(bad))):
            KVEventSubscriber("tcp://127.0.0.1:5557", **bad)

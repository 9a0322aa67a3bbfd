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

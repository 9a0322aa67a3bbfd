"""The KV-event feed as a router reads it: a plain pyzmq SUB socket and a msgspec schema written here from the
published format (an array batch ``[ts, events, data_parallel_rank]``, events as maps tagged by ``type``), nothing
of kvc's own decoding. A trace is replayed through L1 + L2 + L3 (LMDB) under pressure; the (namespace, page hash,
tier) set rebuilt from the events alone must be exactly what the cache's snapshot and its store hold at the end,
and no frame may carry a salt.

`kvc serve --events` and `kvc events --follow` run as processes of their own (sockets served and followed while
the test talks to them, stopped by signals), forked from a server that imported kvc and torch once (`forkrun`, the
`engine_forks` fixture).
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from factories import l3_cache, make_layout, make_store, store_holdings
from kvcache import KVEventPublisher, RadixKey, WorkloadSpec, generate, replay
from kvcache.types.keys import page_hashes

SPEC = WorkloadSpec(requests=60, tenants=3, shared_prefix_tokens=16, system_prompt_tokens=64, documents=4,
                    document_tokens=48, user_tokens=12, output_tokens=8, seed=17)
SALTS = [SPEC.tenant(i)[1].encode() for i in range(SPEC.tenants)]


# --- the schema, from the published format -------------------------------------------------------------------

class Event(msgspec.Struct, tag=True):  # a map whose "type" names the event
    pass


class BlockStored(Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    extra_key: str | None = None
    salt_fingerprint: str | None = None


class BlockRemoved(Event):
    block_hashes: list[bytes]
    medium: str | None
    extra_key: str | None = None
    salt_fingerprint: str | None = None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None


DECODE = msgspec.msgpack.Decoder(Batch)


def rebuild(batches: dict[int, Batch]) -> set[tuple]:
    held: set[tuple] = set()
    for seq in sorted(batches):
        for ev in batches[seq].events:
            if isinstance(ev, AllBlocksCleared):
                held.clear()
                continue
            keys = {((ev.extra_key, ev.salt_fingerprint), h, ev.medium) for h in ev.block_hashes}
            if isinstance(ev, BlockStored):
                held |= keys
            else:
                held -= keys
    return held


def expected(cache, snapshot) -> set[tuple]:
    """What the snapshot says the tiers hold (node by node, hashes recomputed from the node's path tokens), plus
    every page of the store walked from each namespace's root."""
    names = {ns.id: (ns.info.extra_key, ns.info.salt_fingerprint) for ns in snapshot.namespaces}
    by_id = {n.id: n for n in cache.tree.nodes()}
    out = set()
    ps = cache.page_size
    for rec in snapshot.state.nodes:
        if rec.namespace_root or (rec.device is None and rec.host is None):
            continue
        node = by_id[rec.id]
        chain = page_hashes(cache.layout.layout_id, RadixKey.of(cache.tree.path_key(node), node.namespace), ps,
                            cache.chain_key)
        mine = chain[len(chain) - rec.tokens // ps:]
        for tier, copy in (("device", rec.device), ("host", rec.host)):
            if copy is not None:
                out |= {(names[rec.namespace], h, tier) for h in mine}
    return out | store_holdings(cache.store)


def test_a_router_rebuilds_exactly_what_the_cache_holds_from_the_feed_alone(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    ctx = zmq.Context()
    # the cache's feed keys its fingerprints by its store's key: the registry's are the feed's
    cache = l3_cache(store, page_size=4, device_tokens=256, host_tokens=512)
    publisher = KVEventPublisher(cache, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    time.sleep(0.2)  # the subscription reaches the publisher (what it misses meanwhile is replayed below)

    frames_seen: list[bytes] = []
    batches: dict[int, Batch] = {}

    def take(frames: list[bytes], live: bool) -> None:
        frames_seen.extend(frames)
        seq = int.from_bytes(frames[-2], "big")
        batches[seq] = DECODE.decode(frames[-1])
        if live:
            live_seqs.append(seq)

    live_seqs: list[int] = []

    def drain() -> None:
        while sub.poll(0):
            take(sub.recv_multipart(), True)

    report = replay(cache, generate(SPEC), on_admit=lambda *_: drain())
    assert report.audit.ok and report.refused == 0
    assert cache.counters.device_pages_evicted > 0 and cache.counters.host_pages_evicted > 0  # pressure
    assert report.backup.storage_pages > 0
    last = publisher.stats().next_seq - 1
    deadline = time.monotonic() + 5
    while (not batches or max(batches) < last) and time.monotonic() < deadline:
        if sub.poll(100):
            take(sub.recv_multipart(), True)
    # what the subscription missed (at least the first batches, sent before it reached the publisher): asked
    # of the replay socket, as a router does on a gap
    missing = sorted(set(range(last + 1)) - set(batches))
    if missing:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", missing[0].to_bytes(8, "big")])
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if int.from_bytes(frames[1], "big", signed=True) == -1:
                break
            seq = int.from_bytes(frames[1], "big")
            if seq not in batches:
                take(frames, False)
        dealer.close(0)
    assert sorted(batches) == list(range(last + 1)), "every batch, live or replayed"
    assert len(live_seqs) > len(batches) // 2  # most came live
    assert all(batch.data_parallel_rank == 0 for batch in batches.values())

    snap = cache.snapshot()
    held = expected(cache, snap)
    assert {tier for _, _, tier in held} == {"device", "host", "storage"}
    assert rebuild(batches) == held
    for frame in frames_seen:
        assert not any(salt in frame for salt in SALTS), "a salt on the wire"

    publisher_stats = publisher.stats()
    cache.close()  # the last batch: everything is gone
    deadline = time.monotonic() + 5
    while max(batches) < publisher.stats().next_seq - 1 and time.monotonic() < deadline:
        if sub.poll(100):
            take(sub.recv_multipart(), True)
    assert rebuild(batches) == set()
    publisher.close()
    sub.close(0)
    ctx.term()
    store.close()
    assert publisher_stats.events > 100 and publisher_stats.send_failures == 0


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:notaport", "nonsense", "ipc:///no/such/dir/feed"])
def test_a_bad_endpoint_is_a_clear_error_naming_it(endpoint):
    from factories import make_cache
    from kvcache import EventEndpointError

    cache = make_cache()
    with pytest.raises(EventEndpointError, match="cannot bind") as info:
        KVEventPublisher(cache, endpoint)
    assert endpoint in str(info.value)
    assert cache.tree.on_copy is None  # nothing half-attached


# --- kvc serve --events and kvc events ------------------------------------------------------------------------

CLI_SALT = "events-salt-zq81"


def _invoke(*args):
    """kvc in this process (what needs no process of its own: no torch start-up per call)."""
    from typer.testing import CliRunner

    from kvc.main import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert CLI_SALT not in result.stdout + result.stderr
    return result


def test_kvc_events_prints_what_kvc_serve_published(tmp_path, engine_forks):
    import json
    import signal

    from kvcache import Namespace
    from kvcache.storage.keyfile import read_key

    store, sock = tmp_path / "store", tmp_path / "s.sock"
    assert _invoke("init", "--store", store, "--page-size", 4).exit_code == 0
    for key, salt in (("t1", CLI_SALT), ("t2", None)):
        assert _invoke("put", "--store", store, "--extra-key", key, *(("--salt", salt) if salt else ()),
                       "--tokens", ",".join(map(str, range(32)))).exit_code == 0
    server = engine_forks.piped(["serve", "--store", str(store), "--socket", str(sock), "--json",
                                 "--device-tokens", "1024", "--host-tokens", "2048",
                                 "--events", "tcp://127.0.0.1:*", "--events-replay", "*",  # *: loopback
                                 "--events-medium-names", "sglang"], stderr=str(tmp_path / "serve.err"))
    try:
        ready = json.loads(server.readline() or "{}")
        assert ready.get("events", "").startswith("tcp://127.0.0.1:"), (tmp_path / "serve.err").read_text()
        assert ready["events_replay"].startswith("tcp://127.0.0.1:") and ready["events_every_interface"] is False
        assert "warning" not in (tmp_path / "serve.err").read_text()
        feed = ["--endpoint", ready["events"], "--replay", ready["events_replay"]]
        assert _invoke("--socket", sock, "prefetch", "--extra-key", "t1", "--salt", CLI_SALT).exit_code == 0
        # a late follower: what it missed comes from the replay buffer at once, then the feed goes on live
        follower = engine_forks.piped(["events", *feed, "--follow", "--from", "0", "--json", "--count", "3",
                                       "--idle-timeout", "20"])
        with follower:  # its end removes the follower's FIFO and stderr file
            lines = [json.loads(follower.readline())]  # it is up and subscribed
            time.sleep(0.3)
            assert _invoke("--socket", sock, "prefetch", "--extra-key", "t2").exit_code == 0  # L3 -> L2 again
            out = follower.read()  # up to its end: after the readline's, through the same buffer
            assert follower.wait(timeout=60) == 0, follower.stderr
            errs = follower.stderr
        assert CLI_SALT not in out + errs
        lines += [json.loads(x) for x in out.splitlines()]
        assert lines[0]["type"] == "AllBlocksCleared" and lines[0]["seq"] == 0 and lines[0]["replayed"]
        stored = [x for x in lines if x["type"] == "BlockStored"]
        fingerprint = Namespace("t1", CLI_SALT).fingerprint(read_key(str(store)))
        assert [(x["extra_key"], x.get("salt_fingerprint"), x["medium"], len(x["block_hashes"])) for x in stored] \
            == [("t1", fingerprint, "CPU_PINNED", 8), ("t2", None, "CPU_PINNED", 8)]
        assert stored[-1]["seq"] == 2 and not stored[-1].get("replayed")  # the last one came live
        assert stored[0]["token_ids"] == list(range(32)) and stored[0]["block_size"] == 4
        # without --follow: the replay buffer, as a table
        table = _invoke("events", *feed)
        assert table.exit_code == 0 and table.stderr == ""
        rows = table.stdout.splitlines()
        assert rows[0].split()[:3] == ["seq", "time", "event"] and len(rows) == 4
        assert "BlockStored *" in rows[2] and "CPU_PINNED" in rows[2] and f"t1/{fingerprint}" in rows[2]
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        server.close()  # read up to its ready line only
        assert code == 0


def test_kvc_serve_binds_events_on_loopback_for_a_port_alone_and_warns_of_a_wildcard(tmp_path, engine_forks):
    """Issue 26 #4: `--events tcp://*:PORT` bound every interface without a word. A port alone is loopback; a
    wildcard host is one warning line on stderr and a field of the ready object."""
    import json
    import signal
    import socket

    store = tmp_path / "store"
    assert _invoke("init", "--store", store, "--page-size", 4).exit_code == 0
    with socket.socket() as probe:  # a port number alone (0 is no port: issue 36 refuses it), free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    for n, (events, replay_at, wide) in enumerate([("*", "tcp://*:*", True), (port, None, False)]):
        sock = tmp_path / f"s{n}.sock"
        server = engine_forks.piped(["serve", "--store", str(store), "--socket", str(sock), "--json",
                                     "--device-tokens", "64", "--host-tokens", "64", "--events", events,
                                     *(("--events-replay", replay_at) if replay_at else ())],
                                    stderr=str(tmp_path / "serve.err"))
        try:
            ready = json.loads(server.readline() or "{}")
            errors = (tmp_path / "serve.err").read_text()
            assert ready.get("events", "").startswith("tcp://127.0.0.1:"), errors  # a port alone: loopback
            assert ready["events_every_interface"] is wide
            warnings = [line for line in errors.splitlines() if "warning" in line]
            if wide:
                assert ready["events_replay"].startswith("tcp://0.0.0.0:")
                assert len(warnings) == 1 and "every interface" in warnings[0] and "authentication" in warnings[0]
                assert "on every interface" in errors.splitlines()[-1]  # the serving line says it too
            else:
                assert ready["events_replay"] is None and warnings == []
        finally:
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=60)
            server.close()
            assert code == 0


@pytest.mark.parametrize("args, says", [
    (["--endpoint", "nonsense", "--follow"], "'nonsense'"),
    (["--follow"], "needs --endpoint"),
    (["--endpoint", "tcp://127.0.0.1:5557"], "give --replay"),
])
def test_kvc_events_refuses_bad_input_in_one_line(args, says):
    result = _invoke("events", *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr


def test_kvc_serve_refuses_an_events_endpoint_it_cannot_bind(tmp_path):
    assert _invoke("init", "--store", tmp_path / "store", "--page-size", 4).exit_code == 0
    result = _invoke("serve", "--store", tmp_path / "store", "--socket", tmp_path / "s.sock", "--events", "tcp://nope")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "'tcp://nope'" in result.stderr
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("follow", [True, False])
def test_kvc_events_where_nothing_publishes_fails_within_its_timeout_in_one_line(follow):
    """Issue 25 #10: `kvc events --endpoint tcp://127.0.0.1:1` printed its header and exited 0 (with --follow it
    waited for ever): ZeroMQ connects in the background. Now nothing there within --timeout is one line, exit 2."""
    import socket

    with socket.socket() as closed:  # a port bound here and never listened on: refused, and nobody else's
        closed.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        args = ["--follow", "--idle-timeout", "5"] if follow else ["--replay", address]
        # nothing can answer on a closed port: the run waits out its whole --timeout, kept short
        result = _invoke("--timeout", "0.3", "events", "--endpoint", address, *args)
        as_json = _invoke("--timeout", "0.3", "events", "--endpoint", address, *args, "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "nothing answered within 0.3 s" in result.stderr
    assert as_json.exit_code == 2 and msgspec.json.decode(as_json.stdout)["error"]["kind"] == "event_endpoint_error"


@pytest.mark.parametrize("json_out", [True, False])
def test_kvc_events_follow_survives_malformed_messages_and_counts_them(json_out, engine_forks):
    """Issue 26 #7: `kvc events --follow` exited 2 on the first malformed payload. Now each is skipped and said
    on stderr — one line for each of the first 10, then one at each power of ten — counted in the summary line
    and (with --json) in the summary object, and the good batch after 150 bad messages is printed."""
    import json

    import zmq

    from kvcache.types.events import EventBatch, encode_batch

    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.XPUB)  # the test is the publisher: it sends once kvc's subscription arrived
        pub.bind("tcp://127.0.0.1:*")
        endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        args = ["events", "--endpoint", endpoint, "--follow", "--count", "1", *(["--json"] if json_out else [])]
        with engine_forks.piped(args) as follower:
            assert pub.poll(60_000) and pub.recv() == b"\x01"
            for i in range(150):
                pub.send_multipart([b"", i.to_bytes(8, "big"), b"\x1b[31m not msgpack"] if i % 2 else [b"junk"])
            pub.send_multipart([b"", (150).to_bytes(8, "big"), encode_batch(EventBatch(1.0, [AllBlocksCleared()]))])
            out = follower.read(timeout=120)
            assert follower.wait(timeout=120) == 0, follower.stderr
            err = follower.stderr
    finally:
        ctx.destroy(linger=0)
    said = err.splitlines()
    skipped = [x for x in said if x.startswith("kvc events: skipped")]
    assert len(skipped) == 11 and "(100 so far)" in skipped[-1] and "further ones are counted" in skipped[9]
    assert "skipped a message: a message of 1 frames" in skipped[0] and "skipped batch 1:" in skipped[1]
    assert "\x1b" not in err  # a hostile payload's bytes are escaped, never sent to the terminal
    assert said[-2:] == ["kvc events: 74 batches missed and no longer in the replay buffer",  # 0, 2, ... 148
                         "kvc events: 150 malformed messages skipped (not KV-event batches)"]
    lines = out.splitlines()
    if json_out:
        assert json.loads(lines[0])["type"] == "AllBlocksCleared" and json.loads(lines[0])["seq"] == 150
        assert json.loads(lines[-1]) == {"type": "Summary", "batches": 1, "events": 1, "replayed": 0, "missed": 74,
                                         "malformed": 150, "restarts": 0, "jumps": 0, "replays_cut_short": 0,
                                         "blocks": {}}
    else:
        assert lines[0].split()[:3] == ["seq", "time", "event"] and "AllBlocksCleared" in lines[1]

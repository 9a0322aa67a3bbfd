"""The admin socket in one process: framing, the server's queue and owner-thread execution, every request kind
on a cache over a real LMDB store, bad frames, protocol versions, socket claiming and the client's errors."""

import os
import random
import socket
import stat
import struct
import threading

import msgspec
import pytest

from factories import forward, l3_cache, make_layout, make_store
from kvcache import (
    AdminBadFrame,
    AdminClient,
    AdminProtocolMismatch,
    AdminRemoteError,
    AdminServer,
    AdminSocketInUse,
    AdminTimeout,
    AdminUnavailable,
    Namespace,
    Request,
)
from kvcache.diagnostics.audit import audit_snapshot
from kvcache.diagnostics.snapshot import decode_snapshot
from kvcache.errors import AdminError
from kvcache.live import client as client_module
from kvcache.live.protocol import (
    PROTOCOL_VERSION,
    AuditRequest,
    Envelope,
    EvictOutcome,
    EvictRequest,
    FrameTooLarge,
    LiveStats,
    LoadBackRequest,
    NamespaceList,
    NamespacesRequest,
    PingRequest,
    PrefetchRequest,
    ReplayOutcome,
    RequestResult,
    Response,
    ServerInfo,
    SnapshotData,
    SnapshotRequest,
    StageRequest,
    StatsRequest,
    Truncated,
    decode_response,
    frame,
    read_frame,
)
from kvcache.live.transport import AdminTransport
from kvcache.types.reports import AuditReport
from kvcache.workload.traces import TraceRequest, write_trace

SALT = "admin-unit-salt-zxcvbn"
T1 = Namespace("t1", SALT)
PROMPT = list(range(40))


def _fill(cache, n=3, ns=T1):
    """Commit n requests sharing a 40-token prefix, flush them to L3, then empty L1 and L2."""
    for i in range(n):
        req = Request(f"fill{i}", PROMPT + [i] * 8, ns)
        forward(cache, req, cache.admit(req))
        cache.commit(req.rid)
    cache.flush()
    cache.evict(device_tokens=10**6, host_tokens=10**6)


@pytest.fixture
def cache(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    c = l3_cache(store, device_tokens=512, host_tokens=512, io_thread=True)
    _fill(c)
    yield c
    c.close()
    store.close()


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "admin.sock")


@pytest.fixture
def serve(cache):
    """Opens admin servers on the test's cache (`standalone`: with an owner thread) and closes them before it."""
    servers = []

    def open_server(path, standalone=False, **options):
        server = AdminServer(cache, path, **options)
        servers.append(server)
        return server.start_owner_thread() if standalone else server

    yield open_server
    for server in servers:
        server.close()


@pytest.fixture
def live(cache, sock_path, serve):
    """The cache serving its socket with a helper owner thread; a connected client."""
    serve(sock_path, standalone=True)
    with AdminClient(sock_path, timeout=30) as client:
        yield cache, client


# --- framing -------------------------------------------------------------------------------------------------


def test_frames_round_trip_and_end_cleanly_between_frames():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame(Envelope(PROTOCOL_VERSION, 7, PingRequest())) * 2)
        a.shutdown(socket.SHUT_WR)
        first, second = read_frame(b, 1 << 20), read_frame(b, 1 << 20)
        assert first == second and msgspec.msgpack.decode(first)["id"] == 7
        assert read_frame(b, 1 << 20) is None


def test_a_length_over_the_limit_is_refused_before_its_body_and_a_cut_frame_is_truncated():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 5000) + b"x" * 10)
        with pytest.raises(FrameTooLarge):
            read_frame(b, 4096)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 100) + b"x" * 10)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(Truncated):
            read_frame(b, 4096)


# --- the socket file -----------------------------------------------------------------------------------------


def test_socket_is_owner_only_and_removed_at_close(cache, sock_path, serve):
    server = serve(sock_path)
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    server.close()
    assert not os.path.exists(sock_path)


def test_a_live_socket_is_refused_a_stale_one_taken_over_a_file_left_alone(cache, sock_path, tmp_path, serve):
    server = AdminTransport(sock_path, lambda r: None).start()
    with pytest.raises(AdminSocketInUse, match="already listening"):
        serve(sock_path)
    server.close()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)  # bound, never listening, then abandoned: what a killed server leaves
    stale.close()
    assert os.path.exists(sock_path)
    serve(sock_path, standalone=True)
    with AdminClient(sock_path) as c:
        assert c.call(PingRequest(), ServerInfo).pid == os.getpid()
    regular = tmp_path / "not-a-socket"
    regular.write_text("keep me")
    with pytest.raises(AdminSocketInUse, match="not a socket"):
        AdminTransport(str(regular), lambda r: None).start()
    assert regular.read_text() == "keep me"


def test_the_server_wraps_a_cache_that_knows_nothing_of_it(cache, sock_path):
    assert not any("admin" in name for name in dir(cache))  # no socket, method or attribute in the core
    with AdminServer(cache, sock_path) as server:
        assert server.path == sock_path and os.path.exists(sock_path)
    assert not os.path.exists(sock_path)
    req = Request("after", PROMPT + [9] * 8, T1)  # closing the server leaves the cache open and whole
    forward(cache, req, cache.admit(req))
    cache.commit(req.rid)
    assert cache.audit().ok


def test_a_signal_during_polls_never_leaves_poll_waiting(sock_path):
    """SIGTERM reaches `kvc serve` while its loop waits in poll(): a signal landing in that wait must not turn it
    into a wait forever (CPython 3.11's SimpleQueue.get(timeout) does, within about a second of this)."""
    import signal
    import time

    transport = AdminTransport(sock_path, lambda request: {"pong": True}).start()
    done, rescued = threading.Event(), threading.Event()

    def watchdog():  # the polls take 3 s: still polling after 10 s means one never returned; a request wakes it
        if not done.wait(10):
            rescued.set()
            with AdminClient(sock_path, timeout=5) as c:
                c.call(PingRequest(), msgspec.Raw)

    old = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0.0037, 0.0037)  # a signal every 3.7 ms
    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            transport.poll(0.01)
    finally:
        done.set()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        transport.close()
    guard.join(15)
    assert not rescued.is_set(), "poll() waited past its timeout: a signal left it waiting forever"


# --- the owner thread ----------------------------------------------------------------------------------------


def test_requests_run_only_when_the_owner_polls(cache, sock_path, serve):
    server = serve(sock_path)
    answers = []

    def ask():
        with AdminClient(sock_path) as c:
            answers.append(c.call(AuditRequest(), AuditReport))

    client = threading.Thread(target=ask)
    client.start()
    while server.pending == 0:
        threading.Event().wait(0.001)
    assert answers == [] and server.served == 0  # queued, not run: nobody polled
    assert server.poll() == 1
    client.join()
    assert answers[0].ok and server.served == 1


def test_an_audit_sent_during_a_replay_runs_between_its_steps(cache, sock_path, tmp_path, serve):
    server = serve(sock_path)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [TraceRequest(f"q{i}", PROMPT + [i % 5] * 12, "t1", SALT) for i in range(40)])
    done = []

    def replay():
        with AdminClient(sock_path) as c:
            done.append(("replay", c.replay(trace, ReplayOutcome, batch=2).replay_report()))

    def audit():
        with AdminClient(sock_path) as c:
            done.append(("audit", c.call(AuditRequest(), AuditReport)))

    threads = [threading.Thread(target=replay)]
    threads[0].start()
    while server.pending < 1:
        threading.Event().wait(0.001)
    threads.append(threading.Thread(target=audit))
    threads[1].start()
    while server.pending < 2:
        threading.Event().wait(0.001)
    server.poll()  # runs the replay, which serves the audit after its first step
    for t in threads:
        t.join()
    assert [kind for kind, _ in done] == ["audit", "replay"]
    assert done[0][1].ok and done[1][1].ok and done[1][1].requests == 40


# --- the commands ----------------------------------------------------------------------------------------------


def _tiers(client, cache, ns=T1):
    rows = {r.id: r for r in client.call(NamespacesRequest(), NamespaceList).namespaces}
    return rows[cache.fingerprints.display_id(ns.id)]  # ids as the cache shows them: under its store's key


def test_namespace_prefetch_warms_l2_then_evict_empties_it(live):
    cache, client = live
    before = _tiers(client, cache)
    assert (before.device.pages, before.host.pages, before.storage.pages) == (0, 0, 16)
    result = client.call(PrefetchRequest("t1", SALT, max_pages=100), RequestResult)
    assert result.command == "prefetch" and result.pages == 16 and result.hit_tokens == 64
    assert result.tiers.host.pages == 16 and result.namespace.salt_fingerprint == cache.fingerprints.fingerprint(T1)
    assert _tiers(client, cache).host.tokens == 64
    freed = client.call(EvictRequest("t1", SALT), EvictOutcome)
    assert freed.host_pages == 16 and freed.tiers.host.pages == 0 and freed.tiers.storage.pages == 16
    assert client.call(AuditRequest(), AuditReport).ok


def test_the_budget_bounds_a_namespace_prefetch(live):
    cache, client = live
    result = client.call(PrefetchRequest("t1", SALT, max_pages=5), RequestResult)
    assert result.pages == 5 and _tiers(client, cache).host.pages == 5


def test_one_request_prefetch_and_load_back_verify_against_the_store(live):
    cache, client = live
    tokens = PROMPT + [1] * 8
    pre = client.call(PrefetchRequest("t1", SALT, tokens=tokens), RequestResult)
    assert (pre.requested_tokens, pre.hit_tokens) == (48, 48)
    back = client.call(LoadBackRequest(tokens, "t1", SALT), RequestResult)
    assert back.hit_tokens == 48 and back.loaded_back_tokens == 48 and back.verify_mismatches == 0
    assert back.tiers.device.pages == 12 and back.declined == "nothing_to_fetch"
    stats = client.call(StatsRequest(), LiveStats)
    assert stats.live_requests == 0 and stats.device.used_pages == 12 and stats.store.pages == 16
    assert client.call(AuditRequest(), AuditReport).ok


def test_stage_needs_buffer_mode_and_gives_its_record_back(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    cache = l3_cache(store, host_mode="buffer", io_thread=True)
    try:
        _fill(cache)
        server = AdminServer(cache, str(tmp_path / "s")).start_owner_thread()
        with server, AdminClient(str(tmp_path / "s")) as client:
            out = client.call(StageRequest(PROMPT + [2] * 8, "t1", SALT), RequestResult)
            assert out.staged.staged_tokens == 48 and out.staged.namespace_id == cache.fingerprints.display_id(T1.id)
            assert client.call(StatsRequest(), LiveStats).staged == 0
            with pytest.raises(AdminRemoteError, match="cache mode") as err:
                client.call(PrefetchRequest("t1", SALT), RequestResult)
            assert err.value.kind == "InvalidInput"
            assert client.call(AuditRequest(), AuditReport).ok
    finally:
        cache.close()
        store.close()


def test_snapshot_of_the_live_cache_audits_offline_the_same(live, sock_path, tmp_path):
    _, client = live
    client.call(PrefetchRequest("t1", SALT), RequestResult)
    sent = client.call(SnapshotRequest(), SnapshotData)  # bytes back: the server writes no file
    assert sent.nodes >= 2 and not list(tmp_path.glob("*.snap"))
    offline = audit_snapshot(decode_snapshot(sent.data))
    assert offline.ok and offline.checked == client.call(AuditRequest(), AuditReport).checked
    old_kind = _raw(sock_path, _body({"v": PROTOCOL_VERSION, "id": 1,
                                      "request": {"type": "snapshot", "path": str(tmp_path / "x.snap")}}))
    assert old_kind[0].error.kind == "bad_request" and not (tmp_path / "x.snap").exists()


def test_replay_in_chunks_and_a_bad_trace_changes_nothing(live, tmp_path, monkeypatch):
    cache, client = live
    monkeypatch.setattr(client_module, "TRACE_CHUNK_BYTES", 300)  # force many chunks
    # Tokens of their own: `_fill` wrote the PROMPT pages with factories' content, not the synthetic KV a
    # replay's --verify expects, so a prefetch of them that lands in time would count as a mismatch.
    data = b"".join(msgspec.json.encode(TraceRequest(f"c{i}", [7000 + t for t in range(40)] + [i] * 8, "t1",
                                                     SALT)) + b"\n" for i in range(6))
    outcome = client.replay(data, ReplayOutcome, verify=True, snapshot=True)
    report = outcome.replay_report()
    assert report.requests == 6 and report.ok and report.verified_tokens > 0
    assert audit_snapshot(decode_snapshot(outcome.snapshot.data)).ok
    assert report.hit_tokens.total > 0
    bad = data + b'{"rid": "x", "tokens": [1], "surprise": 1}\n'
    with pytest.raises(AdminRemoteError, match="trace:7") as err:
        client.replay(bad, ReplayOutcome)
    assert err.value.kind == "InvalidTrace"
    assert client.call(StatsRequest(), LiveStats).cache.counters.committed == report.requests + 3


# --- bad input never ends the server -------------------------------------------------------------------------


def _raw(path, data: bytes, timeout=10.0) -> list[Response]:
    """Send raw bytes on a fresh connection, then read every response frame until the server closes it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    out = []
    with s:
        while (body := read_frame(s, 1 << 26)) is not None:
            out.append(decode_response(body))
    return out


def _body(obj) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


def test_malformed_frames_are_answered_and_the_server_goes_on(live, sock_path):
    cache, client = live
    cases = {
        "not msgpack": struct.pack(">I", 3) + b"\xc1\xc1\xc1",
        "a list": _body([1, 2, 3]),
        "unknown tag": _body({"v": PROTOCOL_VERSION, "id": 3, "request": {"type": "rm-rf"}}),
        "wrong type": _body({"v": PROTOCOL_VERSION, "id": 4, "request": {"type": "prefetch", "max_pages": "x"}}),
        "token too big": _body({"v": PROTOCOL_VERSION, "id": 5, "request": {"type": "load_back",
                                                                            "tokens": [2**40]}}),
        "unknown field": _body({"v": PROTOCOL_VERSION, "id": 6, "request": {"type": "audit", "x": 1}}),
    }
    for name, data in cases.items():
        answers = _raw(sock_path, data)
        assert len(answers) == 1 and answers[0].error is not None, name
        assert answers[0].error.kind in ("bad_frame", "bad_request"), name
    huge = _raw(sock_path, struct.pack(">I", 0xFFFFFFF0) + b"junk" + _body({"v": 1}))
    assert len(huge) == 1 and huge[0].error.kind == "bad_frame" and "limit" in huge[0].error.message
    assert _raw(sock_path, struct.pack(">I", 50) + b"abc") == []  # cut short: closed without an answer
    assert client.call(PingRequest(), ServerInfo).version == PROTOCOL_VERSION
    assert client.call(AuditRequest(), AuditReport).ok


def test_seeded_random_frames_leave_the_server_alive_and_the_cache_clean(live, sock_path):
    cache, client = live
    rng = random.Random(1234)
    kinds = ["ping", "prefetch", "stage", "load_back", "ns_ls", "audit", "snapshot", "stats", "evict", "replay",
             "bogus"]
    junk = [None, True, -1, 2**33, 1.5, "x", b"\x00", [1, "a"], {"k": 1}]
    for _ in range(120):
        roll = rng.random()
        if roll < 0.3:
            data = rng.randbytes(rng.randrange(0, 64))
        elif roll < 0.5:
            body = rng.randbytes(rng.randrange(1, 64))
            data = struct.pack(">I", len(body) + rng.choice([0, 5, -1])) + body if len(body) > 1 else body
        else:
            request = {"type": rng.choice(kinds)}
            for key in rng.sample(["tokens", "extra_key", "cache_salt", "max_pages", "path", "chunk", "more",
                                   "device", "policy"], rng.randrange(0, 4)):
                request[key] = rng.choice(junk)
            data = _body({"v": rng.choice([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 9]), "id": 1,
                          "request": request})
        try:
            _raw(sock_path, data, timeout=30)
        except (Truncated, ConnectionError):
            pass  # the server closed a connection it could not frame: allowed
    assert client.call(PingRequest(), ServerInfo).pid == os.getpid()
    assert client.call(AuditRequest(), AuditReport).ok


def test_the_salt_never_leaves_the_server(live, sock_path, tmp_path):
    cache, client = live
    requests = [PrefetchRequest("t1", SALT), LoadBackRequest(PROMPT + [0] * 8, "t1", SALT),
                EvictRequest("t1", SALT), NamespacesRequest(), StatsRequest(),
                SnapshotRequest(),
                PrefetchRequest("t1", SALT, max_pages="bad")]  # type: ignore[arg-type]  # an error echo
    for i, req in enumerate(requests):
        for answer in _raw(sock_path, frame(Envelope(PROTOCOL_VERSION, i, req))):
            assert SALT.encode() not in msgspec.msgpack.encode(answer)  # the snapshot's bytes included


# --- versions and the client's errors --------------------------------------------------------------------------


def test_another_protocol_version_is_named_on_both_ends(live, sock_path, tmp_path):
    answers = _raw(sock_path, _body({"v": PROTOCOL_VERSION + 1, "id": 9, "request": {"type": "ping"}}))
    assert answers[0].error.kind == "protocol_version" and answers[0].id == 9
    assert f"version {PROTOCOL_VERSION + 1}" in answers[0].error.message
    assert f"version {PROTOCOL_VERSION}" in answers[0].error.message
    # a server of the next version answering this client
    future = str(tmp_path / "future.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(future)
    listener.listen(1)

    def answer_as_v2():
        conn, _ = listener.accept()
        with conn:
            read_frame(conn, 1 << 20)
            conn.sendall(_body({"v": PROTOCOL_VERSION + 1, "id": 1, "error": None}))

    t = threading.Thread(target=answer_as_v2)
    t.start()
    with pytest.raises(AdminProtocolMismatch, match=f"client speaks version {PROTOCOL_VERSION}, the server "
                                                    f"speaks version {PROTOCOL_VERSION + 1}"), AdminClient(future) as c:
        c.call(PingRequest(), ServerInfo)
    t.join()
    listener.close()


def test_client_errors_name_the_socket(tmp_path, cache, serve):
    missing = str(tmp_path / "nobody.sock")
    with pytest.raises(AdminUnavailable, match="does not exist"), AdminClient(missing) as c:
        c.call(PingRequest(), ServerInfo)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    with pytest.raises(AdminUnavailable, match="nothing is listening"), AdminClient(str(tmp_path / "stale.sock")) as c:
        c.call(PingRequest(), ServerInfo)
    path = str(tmp_path / "slow.sock")
    serve(path)  # nobody polls: the request waits in the queue
    with pytest.raises(AdminTimeout, match="no answer within 0.2 s"), AdminClient(path, timeout=0.2) as c:
        c.call(PingRequest(), ServerInfo)
    with pytest.raises(AdminBadFrame, match="over the admin socket's limit"), AdminClient(path) as c:
        c.call(LoadBackRequest([2**31] * 300_000), RequestResult)


def test_an_interrupted_call_drops_its_connection_and_the_next_call_reconnects(cache, sock_path, serve, monkeypatch):
    serve(sock_path, standalone=True)

    def interrupted(*args, **kwargs):  # Ctrl-C while the client waits for its answer
        raise KeyboardInterrupt

    with AdminClient(sock_path) as c:
        assert c.call(PingRequest(), ServerInfo).pid == os.getpid()
        with monkeypatch.context() as m:
            m.setattr(client_module, "read_frame", interrupted)
            with pytest.raises(KeyboardInterrupt):
                c.call(PingRequest(), ServerInfo)
        assert c._sock is None  # closed: the answer still on its way would otherwise meet the next call
        assert c.call(StatsRequest(), LiveStats).live_requests == 0


def test_a_client_that_cannot_connect_keeps_no_socket(cache, sock_path, serve):
    import gc
    import warnings

    serve(sock_path, standalone=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with pytest.raises(ValueError), AdminClient(sock_path, timeout=-1) as c:  # refused by settimeout
            c.call(PingRequest(), ServerInfo)
        gc.collect()  # a socket left open by the failed connect would warn here


def test_close_answers_what_is_queued_and_a_closed_server_is_unavailable(cache, sock_path, serve):
    server = serve(sock_path)
    errors = []

    def ask():
        try:
            with AdminClient(sock_path) as c:
                c.call(StatsRequest(), LiveStats)
        except AdminRemoteError as exc:
            errors.append(exc.kind)

    t = threading.Thread(target=ask)
    t.start()
    while server.pending == 0:
        threading.Event().wait(0.001)
    server.close()
    t.join()
    assert errors == ["shutting_down"] and not os.path.exists(sock_path)
    with pytest.raises(AdminUnavailable), AdminClient(sock_path) as c:
        c.call(PingRequest(), ServerInfo)


# --- trust and bounds (issue 14) -----------------------------------------------------------------------------


def test_a_peer_off_the_allow_list_is_answered_forbidden_and_runs_nothing(cache, sock_path, serve):
    server = serve(sock_path, standalone=True, allow_uids=set())  # not even this process's uid
    with pytest.raises(AdminRemoteError) as err, AdminClient(sock_path) as c:
        c.call(AuditRequest(), AuditReport)
    assert err.value.kind == "forbidden" and server.refused == 1 and server.served == 0


def test_the_client_checks_the_servers_uid_before_sending_anything(tmp_path):
    from kvcache import AdminUntrusted

    path = str(tmp_path / "other.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    got = []

    def record():
        conn, _ = listener.accept()
        conn.settimeout(2)
        with conn:
            try:
                got.append(conn.recv(1 << 16))
            except OSError:
                got.append(b"")

    t = threading.Thread(target=record)
    t.start()
    with (pytest.raises(AdminUntrusted, match=f"uid {os.geteuid()}"),  # a client that trusts no uid at all
          AdminClient(path, trusted_uids=set()) as c):
        c.call(PrefetchRequest("t1", SALT), RequestResult)
    t.join()
    listener.close()
    assert got == [b""]  # connected, then closed: not one byte sent


def test_a_start_that_fails_leaves_no_socket_and_no_socket_file(sock_path, monkeypatch):
    import gc
    import warnings

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", no_thread)
            with pytest.raises(RuntimeError, match="new thread"):
                AdminTransport(sock_path, lambda r: None).start()
        gc.collect()  # the listening socket left open by the failed start would warn here
    assert not os.path.exists(sock_path)  # and the path is free for the next server


def test_a_connection_that_gets_no_thread_is_answered_busy_and_the_server_goes_on(cache, sock_path, serve,
                                                                                   monkeypatch):
    server = serve(sock_path, standalone=True)
    start = threading.Thread.start

    def no_connection_thread(self):
        if self.name == "kvc-admin-conn":
            raise RuntimeError("can't start new thread")
        start(self)

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", no_connection_thread)
        with pytest.raises(AdminRemoteError) as err, AdminClient(sock_path, timeout=0.2) as c:
            c.call(PingRequest(), ServerInfo)
    assert err.value.kind == "busy" and server.busy >= 1
    with AdminClient(sock_path) as c:  # the accept thread lives on
        assert c.call(PingRequest(), ServerInfo).pid == os.getpid()


def test_a_directory_other_users_can_write_is_refused_unless_sticky(cache, tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(AdminError, match="sticky"):
        AdminTransport(str(loose / "s.sock"), lambda r: None).start()
    os.chmod(loose, 0o1777)
    AdminTransport(str(loose / "s.sock"), lambda r: None).start().close()


def test_busy_is_answered_and_retried_within_the_timeout(cache, sock_path, serve):
    server = serve(sock_path, standalone=True, max_connections=1, idle_timeout=0.5)
    hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hog.connect(sock_path)  # silent: holds the only connection until the idle timeout
    threading.Event().wait(0.1)
    with pytest.raises(AdminRemoteError) as err, AdminClient(sock_path, timeout=0.1) as c:
        c.call(PingRequest(), ServerInfo)
    assert err.value.kind == "busy"
    with AdminClient(sock_path, timeout=10) as c:
        assert c.call(PingRequest(), ServerInfo).pid == os.getpid()
    assert server.busy >= 1
    hog.close()


@pytest.mark.parametrize("field, value", [("timeout_ms", float("inf")), ("timeout_ms", float("nan")),
                                          ("timeout_ms", 9.3e12), ("max_pages", 2**62), ("max_bytes", 2**62)])
def test_numbers_out_of_range_are_bad_requests_and_hold_nothing(live, sock_path, field, value):
    cache, client = live
    answers = _raw(sock_path, _body({"v": PROTOCOL_VERSION, "id": 2,
                                     "request": {"type": "prefetch", "extra_key": "t1", field: value}}))
    assert answers[0].error.kind == "bad_request" and field in answers[0].error.message
    stats = client.call(StatsRequest(), LiveStats)
    assert stats.prefetches == 0 and client.call(AuditRequest(), AuditReport).ok


def test_a_deeply_nested_frame_is_answered(live, sock_path):
    _, client = live
    deep = b"\x91" * 200_000 + b"\x01"
    for body in (b"\x83\xa7request" + deep + b"\xa1v\x01\xa2id\x01", deep):
        answers = _raw(sock_path, struct.pack(">I", len(body)) + body)
        assert len(answers) == 1 and answers[0].error.kind == "bad_frame"
    assert client.call(PingRequest(), ServerInfo).pid == os.getpid()


def test_closing_the_server_stops_a_running_replay_at_its_next_step(cache, sock_path, tmp_path, monkeypatch, serve):
    from kvcache.workload.replay import Replayer

    forward = Replayer._forward

    def slow_forward(self, *args):  # 3000 requests of 7 distinct sequences replay in 0.3 s: keep it running
        threading.Event().wait(0.002)
        return forward(self, *args)

    monkeypatch.setattr(Replayer, "_forward", slow_forward)
    server = serve(sock_path, standalone=True)
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [TraceRequest(f"z{i}", PROMPT + [i % 7] * 12, "t1", SALT) for i in range(3000)])
    answer = []
    t = threading.Thread(target=lambda: answer.append(_replay_outcome(sock_path, trace)))
    t.start()
    with AdminClient(sock_path) as c:
        while c.call(StatsRequest(), LiveStats).cache.counters.committed < 100:
            threading.Event().wait(0.01)
    server.close()
    t.join(30)
    assert isinstance(answer[0], AdminRemoteError) and answer[0].kind == "shutting_down"
    assert cache.counters.committed < 3000 + 3  # stopped well before the end
    assert not cache.live_requests() and not cache.prefetch_ops() and cache.audit().ok


def _replay_outcome(sock_path, trace):
    try:
        with AdminClient(sock_path, timeout=60) as c:
            return c.replay(trace, ReplayOutcome, timeout=60)
    except AdminRemoteError as exc:
        return exc


# --- a serving cache of a shared store: its record in the store, the drops it follows -----------------------------


def _write_back_cache(store):
    from kvcache.storage.serving import DropWatch, FencedStore
    from kvcache.types.config import WritePolicy

    return l3_cache(FencedStore(store, DropWatch(store, by="")), device_tokens=512, host_tokens=512,
                    write_policy=WritePolicy.WRITE_BACK)


def test_a_serving_cache_is_recorded_in_its_store_until_it_closes(tmp_path, sock_path):
    store = make_store(tmp_path / "store", make_layout(4))
    cache = _write_back_cache(store)
    try:
        with AdminServer(cache, sock_path) as server:
            [record] = store.serves()
            assert (record.pid, record.socket) == (os.getpid(), server.path) and server.watch.by == server.path
        assert store.serves() == []
    finally:
        cache.close()
        store.close()


def test_a_drop_recorded_elsewhere_is_followed_before_the_next_request_and_nothing_is_written_back(tmp_path,
                                                                                                   sock_path):
    from kvcache.storage.serving import recorded_drop

    store = make_store(tmp_path / "store", make_layout(4))
    cache = _write_back_cache(store)
    try:
        req = Request("w", PROMPT + [1] * 8, T1)
        forward(cache, req, cache.admit(req))
        cache.commit(req.rid)
        cache.flush()
        assert store.namespaces() == []  # write-back: nothing in L3 before an eviction
        with AdminServer(cache, sock_path) as server, AdminClient(server.path) as client:
            recorded_drop(store, T1.id, by="another")  # an offline drop, or another live cache's
            result = {}
            asker = threading.Thread(target=lambda: result.update(
                out=client.call(EvictRequest("t1", SALT, True, True), EvictOutcome)))
            asker.start()
            while "out" not in result:
                server.poll(0.05)
            asker.join()
            assert result["out"].device_pages == result["out"].host_pages == 0  # dropped before the evict ran
            cache.evict(device_tokens=10**6, host_tokens=10**6)
            cache.flush()
        assert store.namespaces() == [] and server.watch.pending() == []
    finally:
        cache.close()
        store.close()

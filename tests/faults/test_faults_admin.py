"""The admin socket under hostile and careless peers (issue 14, item 3): another local user, an impostor who
bound the path first, silent and trickling clients, a burst of connects past the limit, oversized uploads,
nested frames, infinite timeouts, SIGTERM during a live replay. The server stays up, its audit stays clean,
nothing leaks, and no salt or file goes where it should not.

The second-user trials create a throwaway user when run as root (skipped otherwise, failed under CI=true)."""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
import time

import msgspec
import pytest

import faultkit
from kvcache import WorkloadSpec, generate, write_trace
from kvcache.errors import AdminRemoteError, AdminUntrusted
from kvcache.live.client import AdminClient
from kvcache.live.protocol import (
    PROTOCOL_VERSION,
    TRACE_CHUNK_BYTES,
    AuditRequest,
    LiveStats,
    LoadBackRequest,
    PingRequest,
    PrefetchRequest,
    ReplayAck,
    ReplayOutcome,
    ReplayRequest,
    Response,
    ServerInfo,
    SnapshotData,
    SnapshotRequest,
    StageRequest,
    StatsRequest,
    decode_response,
    read_frame,
)
from kvcache.live.transport import AdminTransport
from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from kvcache.types.reports import AuditReport
from kvcache.workload.kvdata import SyntheticKV

LAYOUT = KVLayout("admin-fault@r1", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=4)
SALT = "admin-fault-salt-7d1f"
T1 = Namespace("t1", SALT)
PROMPT = list(range(64))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("admin-faults") / "store")
    kv = SyntheticKV(LAYOUT)
    with open_store(path, LAYOUT, create=True, durability="none") as s:
        hashes, origins = page_origins(LAYOUT, pack_tokens(PROMPT), T1, s.chain_key)
        s.put(hashes, list(kv.pages(hashes).numpy()), origins)
    return path


@pytest.fixture
def shared_dir():
    """A socket directory another local user can reach (0755, root's): not writable by others."""
    path = tempfile.mkdtemp(prefix="kvcf-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def _frame(obj) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


def _raw(path: str, data: bytes, timeout: float = 10.0) -> list[Response]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    with s:
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = []
        while (body := read_frame(s, 1 << 26)) is not None:
            out.append(decode_response(body))
        return out


def _live_clean(sock: str) -> bool:
    """The server answers, its audit is clean and nothing is held (no request, prefetch, staged record)."""
    with AdminClient(sock, timeout=30) as c:
        stats = c.call(StatsRequest(), LiveStats)
        return (c.call(AuditRequest(), AuditReport).ok and stats.live_requests == 0 and stats.prefetches == 0
                and stats.staged == 0)


# --- another local user ------------------------------------------------------------------------------------


def _as_user_forbidden(sock: str) -> None:
    with pytest.raises(AdminRemoteError) as err, AdminClient(sock, timeout=10) as c:
        c.call(SnapshotRequest(), SnapshotData)
    assert err.value.kind == "forbidden", err.value


def _as_user_allowed(sock: str, victim: str, mine: str) -> None:
    with AdminClient(sock, timeout=10) as c:
        assert c.call(PingRequest(), ServerInfo).version == PROTOCOL_VERSION
        snap = c.call(SnapshotRequest(), SnapshotData)
    with open(mine, "wb") as f:  # the client writes its snapshot itself, as itself
        f.write(snap.data)
    # an old-style request naming a path for the server to write is refused as a bad request
    answers = _raw(sock, _frame({"v": PROTOCOL_VERSION, "id": 1, "request": {"type": "snapshot", "path": victim}}))
    assert answers[0].error is not None and answers[0].error.kind == "bad_request"


def test_another_local_user_is_refused_and_an_allowed_one_writes_no_server_side_file(store, shared_dir,
                                                                                     engine_forks):
    survived = trials = 0
    with faultkit.second_user() as user:
        sock = os.path.join(shared_dir, "kvc.sock")
        victim = os.path.join(shared_dir, "root-owned.txt")
        with open(victim, "w") as f:
            f.write("root's file\n")
        server = faultkit.Serve(store, sock, "--socket-mode", "666", forks=engine_forks)
        try:
            trials += 1
            assert faultkit.run_as(user, _as_user_forbidden, sock) == 0
            survived += _live_clean(sock)
        finally:
            assert server.stop() == 0
        assert "refused a connection from" in server.stderr  # one line in the server's log
        server = faultkit.Serve(store, sock, "--socket-mode", "666", "--allow-uid", user.pw_uid,
                                forks=engine_forks)
        mine = os.path.join(shared_dir, "mine.snap")
        open(mine, "w").close()
        os.chown(mine, user.pw_uid, user.pw_gid)
        try:
            trials += 1
            assert faultkit.run_as(user, _as_user_allowed, sock, victim, mine) == 0
            with open(victim) as f:
                assert f.read() == "root's file\n"
            with open(mine, "rb") as f:
                assert os.stat(mine).st_size > 0 and SALT.encode() not in f.read()
            survived += _live_clean(sock)
        finally:
            assert server.stop() == 0
    faultkit.record("another local user on the admin socket", trials, survived, 0,
                    "refused (forbidden) off the allow-list; allowed: snapshot bytes back, no server-side path")
    assert survived == trials


def _impostor(sock: str, report_fd: int, ready_fd: int) -> None:
    """As the other user: bind the path first and record every byte a client sends."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    os.chmod(sock, 0o777)
    listener.listen(8)
    os.write(ready_fd, b"r")
    while True:
        conn, _ = listener.accept()
        conn.settimeout(2)
        try:
            while data := conn.recv(65536):
                os.write(report_fd, data)
        except OSError:
            pass
        conn.close()


def test_an_impostor_who_bound_the_path_first_gets_no_salt_and_serve_refuses(store, forks, engine_forks):
    sticky = tempfile.mkdtemp(prefix="kvcf-sticky-", dir="/tmp")
    os.chmod(sticky, 0o1777)  # like /tmp: everyone may create, only owners may remove
    sock = os.path.join(sticky, "kvc.sock")
    with faultkit.second_user() as user:
        report_r, report_w = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(report_r)
                os.close(ready_r)
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
                _impostor(sock, report_w, ready_w)
            finally:
                os._exit(0)
        os.close(report_w)
        os.close(ready_w)
        try:
            assert os.read(ready_r, 1) == b"r"
            with pytest.raises(AdminUntrusted, match=f"uid {user.pw_uid}"), AdminClient(sock, timeout=5) as c:
                c.call(PrefetchRequest("t1", SALT), object)
            cli = forks.run(["--socket", sock, "prefetch", "--extra-key", "t1", "--json"],
                            env={**os.environ, "KVC_SALT": SALT})
            assert cli.returncode == 2 and cli.stderr.count("\n") == 1 and "does not trust" in cli.stderr
            serve = engine_forks.run(["serve", "--store", store, "--socket", sock], timeout=60)
            assert serve.returncode == 2 and serve.stderr.count("\n") == 1
            assert f"uid {user.pw_uid}" in serve.stderr and "already listening" in serve.stderr
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.set_blocking(report_r, False)
        try:
            captured = os.read(report_r, 1 << 20)
        except BlockingIOError:
            captured = b""
        os.close(report_r)
    os.unlink(sock)
    os.rmdir(sticky)
    faultkit.record("an impostor bound the socket path first", 3, 3 if not captured else 0, len(captured),
                    "bytes the impostor received (the salt above all): clients refuse before sending; "
                    "kvc serve refuses to start and names the impostor's uid")
    assert captured == b""


def test_a_directory_others_can_write_is_refused(store, tmp_path, engine_forks):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    out = engine_forks.run(["serve", "--store", store, "--socket", loose / "kvc.sock"], timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "sticky" in out.stderr
    faultkit.record("kvc serve in a directory others can write (no sticky bit)", 1, 1, 0, "refused, one line")


# --- slow, silent and greedy clients -------------------------------------------------------------------------


def test_silent_and_trickling_clients_cost_seconds_and_a_busy_answer(store, tmp_path, engine_forks):
    sock = str(tmp_path / "s.sock")
    server = faultkit.Serve(store, sock, "--max-connections", 8, "--idle-timeout", 1, forks=engine_forks)
    silent = []
    try:
        for _ in range(8):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock)
            silent.append(s)
        time.sleep(0.2)  # the server has accepted them all
        with pytest.raises(AdminRemoteError) as busy, AdminClient(sock, timeout=0.3) as c:
            c.call(PingRequest(), ServerInfo)
        assert busy.value.kind == "busy"  # an answer, not a broken pipe
        start = time.monotonic()
        with AdminClient(sock, timeout=20) as c:
            assert c.call(PingRequest(), ServerInfo).pid == server.proc.pid
        waited = time.monotonic() - start  # the silent ones were closed after the idle timeout
        # a client trickling one byte every 0.3 s never completes a frame: closed within the frame deadline
        trickle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        trickle.connect(sock)
        data = _frame({"v": PROTOCOL_VERSION, "id": 1, "request": {"type": "ping"}})
        closed = False
        for byte in data:
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.3)
        trickle.settimeout(5)
        try:
            closed = closed or trickle.recv(1) == b""
        except OSError:
            closed = True
        trickle.close()
        assert closed, "a trickled frame was served"
        assert _live_clean(sock)
    finally:
        for s in silent:
            s.close()
        assert server.stop() == 0
    faultkit.record("8 silent clients at a limit of 8, then a trickling one", 2, 2, 0,
                    f"a short client was answered 'busy'; a patient one got in after {waited:.1f} s "
                    f"(idle timeout 1 s); the trickled frame was cut off")


def test_a_burst_of_connects_past_the_limit_is_answered_not_refused(store, tmp_path, engine_forks):
    sock = str(tmp_path / "s.sock")
    server = faultkit.Serve(store, sock, forks=engine_forks)  # the defaults: 64 connections
    n = faultkit.trials(300)
    conns, failed = [], 0
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(sock)
                conns.append(s)
            except BlockingIOError:
                failed += 1  # the backlog was full: what the limit must prevent
                s.close()
        answered = busy = 0
        ping = _frame({"v": PROTOCOL_VERSION, "id": 1, "request": {"type": "ping"}})
        for s in conns:
            s.setblocking(True)
            s.settimeout(20)
            try:
                s.sendall(ping)
            except OSError:
                pass  # answered busy and closed already: the answer is still there to read
            body = read_frame(s, 1 << 20)
            response = decode_response(body)
            answered += 1
            busy += response.error is not None and response.error.kind == "busy"
            s.close()
        assert failed == 0 and answered == n
        assert _live_clean(sock)
    finally:
        for s in conns:
            s.close()
        assert server.stop() == 0
    faultkit.record(f"{n} simultaneous connects, limit 64", n, answered, failed,
                    f"connects refused by a full backlog: {failed}; {busy} answered 'busy'")


def test_uploads_are_spooled_to_disk_and_capped(store, tmp_path, engine_forks):
    sock = str(tmp_path / "s.sock")
    server = faultkit.Serve(store, sock, forks=engine_forks)
    mib = int(os.environ.get("KVC_UPLOAD_MIB", "0")) or (96 if faultkit.trials(1) > 1 else 32)
    chunk = b"x" * TRACE_CHUNK_BYTES
    clients = [AdminClient(sock, timeout=60) for _ in range(3)]
    try:
        before = server.rss_kib()
        for c in clients:
            for _ in range(mib * (1 << 20) // TRACE_CHUNK_BYTES):
                c.call(ReplayRequest(chunk, more=True), ReplayAck)
        grew_mib = (server.rss_kib() - before) / 1024
        for c in clients:
            c.close()  # the uploads in progress are dropped with their connections
        # What stays is a frame buffer per connection thread and the allocator's arenas: about 18 MiB here for
        # 3 x 16, 32 or 64 MiB (buffered in memory, the uploads would add 3 x their size).
        assert grew_mib < 24, f"3 uploads of {mib} MiB raised the server's RSS by {grew_mib:.0f} MiB"
        assert _live_clean(sock)
    finally:
        assert server.stop() == 0
    # caps, on a server of this process: one trace over the per-trace cap, three at once over the total
    capped = AdminTransport(str(tmp_path / "c.sock"), lambda request: None, max_trace_bytes=3 * TRACE_CHUNK_BYTES,
                            max_upload_bytes=4 * TRACE_CHUNK_BYTES).start()
    try:
        with AdminClient(capped.path) as big:
            for _ in range(3):
                big.call(ReplayRequest(chunk, more=True), ReplayAck)
            with pytest.raises(AdminRemoteError, match="over the limit"):
                big.call(ReplayRequest(chunk, more=True), ReplayAck)
        a, b = AdminClient(capped.path), AdminClient(capped.path)
        for _ in range(2):
            a.call(ReplayRequest(chunk, more=True), ReplayAck)
        b.call(ReplayRequest(chunk, more=True), ReplayAck)
        b.call(ReplayRequest(chunk, more=True), ReplayAck)
        with pytest.raises(AdminRemoteError) as full, AdminClient(capped.path, timeout=0.2) as c:
            c.call(ReplayRequest(chunk, more=True), ReplayAck)
        assert full.value.kind == "busy"
        a.close()
        b.close()
        deadline = time.monotonic() + 10
        while capped.uploaded_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert capped.uploaded_bytes == 0  # dropped uploads give their room back
    finally:
        capped.close()
    faultkit.record(f"3 concurrent {mib} MiB replay uploads", 3, 3, 0,
                    f"server RSS grew {grew_mib:.1f} MiB (spooled to temp files); per-trace and total caps answered")


def test_nested_frames_and_infinite_timeouts_leave_nothing_held(store, tmp_path, engine_forks):
    sock = str(tmp_path / "s.sock")
    server = faultkit.Serve(store, sock, "--mode", "cache", forks=engine_forks)
    deep = b"\x91" * 100_000 + b"\x01"
    envelope = b"\x83\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa2id\x01\xa7request"
    nested = [b"\x83\xa7request" + deep + b"\xa1v\x02\xa2id\x01",  # before the head
              envelope + b"\x82\xa4type\xa8prefetch\xa6tokens" + deep,  # in a typed field
              envelope + b"\x82\xa4type\xa8prefetch\xa3zzz" + deep,  # in an unknown field
              deep]
    bad_numbers = [float("inf"), 1e300, float("nan"), -1.0, 9.3e12]
    requests = []
    for t in bad_numbers:
        tokens = PROMPT + [5] * 8
        requests += [PrefetchRequest("t1", SALT, timeout_ms=t), PrefetchRequest("t1", SALT, tokens, timeout_ms=t),
                     LoadBackRequest(tokens, "t1", SALT, timeout_ms=t), StageRequest(tokens, "t1", SALT, timeout_ms=t)]
    requests += [PrefetchRequest("t1", SALT, max_pages=2**62), PrefetchRequest("t1", SALT, max_bytes=2**62)]
    answered = 0
    try:
        with AdminClient(sock) as c:
            host_before = c.call(StatsRequest(), LiveStats).host.used_pages
        for body in nested:
            answers = _raw(sock, struct.pack(">I", len(body)) + body)
            answered += len(answers) == 1 and answers[0].error.kind in ("bad_frame", "bad_request")
        for r in requests:
            with pytest.raises(AdminRemoteError) as err, AdminClient(sock) as c:
                c.call(r, object)
            answered += err.value.kind == "bad_request"
        with AdminClient(sock) as c:
            stats = c.call(StatsRequest(), LiveStats)
        assert stats.host.used_pages == host_before and _live_clean(sock)
    finally:
        assert server.stop() == 0
    total = len(nested) + len(requests)
    faultkit.record("nested frames and infinite / huge / nan timeouts", total, answered, 0,
                    "each answered bad_frame or bad_request; nothing held afterwards, audit clean")
    assert answered == total


def test_sigterm_stops_a_live_replay_within_a_step(store, tmp_path, forks, engine_forks):
    sock = str(tmp_path / "s.sock")
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(WorkloadSpec(requests=20000, tenants=2, documents=3, seed=3)))
    server = faultkit.Serve(store, sock, "--device-tokens", 4096, "--host-tokens", 8192, forks=engine_forks)
    outcome: list[BaseException | ReplayOutcome] = []

    def replay() -> None:
        try:
            with AdminClient(sock, timeout=120) as c:
                outcome.append(c.replay(trace, ReplayOutcome, timeout=120))
        except BaseException as exc:
            outcome.append(exc)

    client = threading.Thread(target=replay)
    client.start()
    with AdminClient(sock) as c:  # the replay answers stats between its steps: wait until it is well under way
        while c.call(StatsRequest(), LiveStats).cache.counters.committed < 200:
            time.sleep(0.05)
    start = time.monotonic()
    code = server.stop()
    stopped_in = time.monotonic() - start
    client.join(60)
    assert code == 0
    assert isinstance(outcome[0], AdminRemoteError) and outcome[0].kind == "shutting_down", outcome
    audit = forks.run(["audit", "--store", store, "--json"])
    assert audit.returncode == 0 and json.loads(audit.stdout)["ok"]
    faultkit.record("SIGTERM to kvc serve during a 20k-request live replay", 1, 1, 0,
                    f"stopped in {stopped_in:.2f} s (between two steps); the client was answered shutting_down; "
                    f"store audit clean")

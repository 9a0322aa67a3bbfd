"""A real redis-server for the tests of the Redis L3 backend (importable as `redis_server`).

Each server listens on 127.0.0.1 at a free port, keeps its files in a temp dir, and is stopped afterwards. Where
redis-server is not installed, tests that need one skip locally and fail under CI (env CI=true): `.ci/run`
installs it, so a missing server there is a broken CI, never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

SERVER_BINARIES = ("redis-server", "valkey-server")
START_TIMEOUT_S = 10.0


def server_binary() -> str | None:
    """The path of redis-server (or valkey-server), or None when neither is installed."""
    for name in SERVER_BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def require_server() -> str:
    """The server binary; skips the test when it is missing, fails it under CI=true."""
    path = server_binary()
    if path is None:
        message = "redis-server is not installed (.ci/run installs it: apt-get install redis-server)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; CI=true makes this a failure, not a skip")
        pytest.skip(message)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process: start, kill (SIGKILL, as a crash), restart on the same port and dir, stop."""

    def __init__(self, binary: str, workdir: Path, persistent: bool = False, cluster: bool = False) -> None:
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.persistent = persistent  # AOF fsynced on every write: a killed server loses no acknowledged write
        self.cluster = cluster  # a one-node Redis Cluster owning every slot
        self.port = free_port()
        self.bus_port = free_port() if cluster else 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The base URL of this server (cluster: redis+cluster://)."""
        scheme = "redis+cluster" if self.cluster else "redis"
        return f"{scheme}://127.0.0.1:{self.port}" + ("" if self.cluster else "/0")

    def store_url(self, prefix: str | None = None) -> str:
        """A store URL under a fresh key prefix (one per test: tests share the server, never the keys)."""
        return f"{self.url}?prefix={prefix or 'kvct-' + uuid.uuid4().hex[:12] + ':'}"

    def start(self) -> "RedisServer":
        """Start the server and wait until it answers PING."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
                "--logfile", str(self.workdir / "redis.log")]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.cluster:
            # The bus port defaults to port + 10000, which a high free port overflows: name a free one.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf"),
                     "--cluster-port", str(self.bus_port)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        if self.cluster:
            self._claim_slots()
        return self

    def _client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.workdir / "redis.log")
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{log.read_text()[-2000:] if log.exists() else ''}")
            try:
                with self._client() as c:
                    if c.ping():
                        # An AOF being loaded answers PING with LOADING errors: wait for a usable server.
                        c.dbsize()
                        return
            except Exception:  # not up yet: connection refused, LOADING
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def _claim_slots(self) -> None:
        with self._client() as c:
            if int(c.execute_command("CLUSTER", "INFO").decode().split("cluster_slots_assigned:")[1].split()[0]) == 0:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + START_TIMEOUT_S
            while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise RuntimeError("one-node cluster did not reach cluster_state:ok")
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown save) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        """Start again on the same port and dir (after `kill`)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop the server (terminate, then kill if it lingers)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


_SHARED: dict[str, RedisServer] = {}


def shared_server(tmp_root: Path, cluster: bool = False) -> RedisServer:
    """The session's shared server (standalone or one-node cluster), started on first use; `stop_shared` stops
    it. Tests on it keep apart by key prefix."""
    kind = "cluster" if cluster else "standalone"
    server = _SHARED.get(kind)
    if server is None:
        binary = require_server()
        server = _SHARED[kind] = RedisServer(binary, tmp_root / f"redis-{kind}", cluster=cluster).start()
    return server


def stop_shared() -> None:
    """Stop the servers `shared_server` started."""
    for server in _SHARED.values():
        server.stop()
    _SHARED.clear()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """The session's shared standalone redis-server (skips locally / fails under CI=true when not installed)."""
    server = shared_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
    _SHARED.pop("standalone", None)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):
    """The session's shared one-node Redis Cluster (every slot on one node: the cluster code path, for real)."""
    server = shared_server(tmp_path_factory.mktemp("redis-cluster"), cluster=True)
    yield server
    server.stop()
    _SHARED.pop("cluster", None)


@pytest.fixture
def own_redis(tmp_path: Path):
    """A server of this test's own, persistent (AOF, fsync always) so it can be killed and restarted."""
    server = RedisServer(require_server(), tmp_path / "redis", persistent=True).start()
    yield server
    server.stop()

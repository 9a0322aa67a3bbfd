"""`kvc version` and `kvc ping --socket S`, as a user runs them: `kvc version` as a subprocess of the installed kvc
(what the console script prints and imports), `kvc ping` in this process against a real `kvc serve` in its own
(forked from a server that imported kvc and torch once: `forkrun`, the `engine_forks` fixture), on an LMDB store
made by `kvc init` (ready once its --json ready line is read: no sleeps), and a socket that accepts and never
answers (a hung server) for the timeout."""

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import clirun
import forkrun
from kvcache.diagnostics.snapshot import SNAPSHOT_VERSION
from kvcache.ops.requests import PROTOCOL_VERSION
from kvcache.storage.codec import FORMAT_VERSION

KVC = clirun.KVC


ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}  # a KVC_SOCKET of the caller would answer


def kvc(*args, timeout=120):
    """The installed kvc as a subprocess, without the caller's KVC_* settings."""
    return subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV)


def here(*args):
    """kvc in this process (a client of the server: what it prints and its exit code), without KVC_* settings."""
    return clirun.in_process(*args, env=ENV)


# --- kvc version ----------------------------------------------------------------------------------------------


def test_version_names_kvc_python_libraries_and_formats():
    out = kvc("version")
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    lines = out.stdout.splitlines()
    assert lines[0] == kvc("--version").stdout.strip()  # the same first line as `kvc --version`
    assert lines[1].startswith(f"python {sys.version_info.major}.{sys.version_info.minor}.")
    assert f"msgspec {msgspec.__version__}" in lines[2]
    assert f"store {FORMAT_VERSION}, snapshot {SNAPSHOT_VERSION}, admin protocol {PROTOCOL_VERSION}" in lines[3]
    assert lines[4].startswith("backends: ") and "lmdb (kvc " in lines[4]


def test_version_json_is_one_object_with_the_installed_versions():
    out = kvc("version", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert list(doc) == ["kvc", "python", "implementation", "platform", "libraries", "formats", "backends"]
    assert doc["kvc"] == importlib.metadata.version("kvc")
    assert doc["python"] == ".".join(map(str, sys.version_info[:3]))
    assert doc["libraries"]["msgspec"] == msgspec.__version__
    assert doc["libraries"]["torch"] == importlib.metadata.version("torch")
    assert doc["formats"] == {"store": FORMAT_VERSION, "snapshot": SNAPSHOT_VERSION,
                              "admin_protocol": PROTOCOL_VERSION}
    assert {"scheme": "lmdb", "distribution": "kvc", "version": doc["kvc"]} in doc["backends"]


def test_version_does_not_import_torch():
    code = ("import sys; from kvc.main import app\n"
            "try:\n    app(['version', '--json'], prog_name='kvc')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "False"


# --- kvc ping -------------------------------------------------------------------------------------------------


class Server:
    """A `kvc serve` process forked from `forks`; ready once its --json ready line is on stdout."""

    def __init__(self, forks: forkrun.Forks, store: Path, sock: Path) -> None:
        self.sock = str(sock)
        self.err_path = sock.with_suffix(".err")
        self.proc = forks.piped(["serve", "--store", str(store), "--socket", self.sock, "--json", "--device-tokens",
                                 "256", "--host-tokens", "512"], stderr=str(self.err_path))
        line = self.proc.readline()
        if not line:
            self.proc.close()
        assert line, f"kvc serve did not start: {self.err_path.read_text()}"
        self.ready = json.loads(line)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.close()


def _serving(forks: forkrun.Forks, folder: Path) -> Server:
    store = folder / "store"
    made = here("init", "--store", store, "--page-size", 4, "--layers", 1, "--kv-heads", 1, "--head-dim", 8)
    assert made.returncode == 0, made.stderr
    return Server(forks, store, folder / "s.sock")


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_forks):
    """A `kvc serve` the tests that only ask it share."""
    srv = _serving(engine_forks, tmp_path_factory.mktemp("serve"))
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def own_server(tmp_path, engine_forks):
    """A `kvc serve` of a test's own (it stops it)."""
    srv = _serving(engine_forks, tmp_path)
    yield srv
    if srv.proc.poll() is None:
        assert srv.stop() == 0


def test_ping_a_live_serve_answers_with_its_pid_in_one_line(server):
    out = here("ping", "--socket", server.sock)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert len(out.stdout.splitlines()) == 1
    assert f"by pid {server.proc.pid} " in out.stdout and " ms " in out.stdout
    before = here("--socket", server.sock, "ping")  # the global --socket (and KVC_SOCKET) works too
    assert before.returncode == 0 and f"pid {server.proc.pid}" in before.stdout


def test_ping_json_carries_the_servers_answer(server):
    out = here("ping", "--socket", server.sock, "--timeout", 60, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert list(doc) == ["socket", "rtt_ms", "server"]
    assert doc["socket"] == server.sock and doc["rtt_ms"] > 0
    assert doc["server"]["pid"] == server.proc.pid == server.ready["pid"]
    assert doc["server"]["version"] == PROTOCOL_VERSION
    assert doc["server"]["store"] == server.ready["store"]
    assert doc["server"]["device_tokens"] == 256 and doc["server"]["host_tokens"] == 512


def test_ping_after_the_server_stopped_is_one_line_and_exit_2(own_server):
    server = own_server
    assert server.stop() == 0
    out = here("ping", "--socket", server.sock)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvc: error: ")
    as_json = here("ping", "--socket", server.sock, "--json")
    assert as_json.returncode == 2
    assert json.loads(as_json.stdout)["error"]["kind"] == "admin_unavailable"


def test_ping_of_a_server_that_never_answers_times_out_with_exit_2(tmp_path):
    path = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(path))
        hung.listen(8)  # connections queue in the backlog and are never read: a server stuck in a step
        out = here("ping", "--socket", path, "--timeout", 0.2, "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["error"]["kind"] == "admin_timeout"
    assert out.stderr.count("\n") == 1 and "no answer within 0.2 s" in out.stderr


def test_ping_without_a_socket_or_with_a_bad_timeout_is_usage(tmp_path):
    none = here("ping")
    assert none.returncode == 2 and "give --socket" in none.stderr
    bad = here("ping", "--socket", tmp_path / "s.sock", "--timeout", 0)
    assert bad.returncode == 2 and "--timeout" in bad.stderr

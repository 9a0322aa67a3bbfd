"""No output of any command gives a secret away (issue 36, item 5), checked differentially: every command of
`kvc --help`, offline and live, is run once per secret of a group of secrets of one length, the secret being at
once the salt (KVC_SALT, --salt-file, --salt -, --salt, and the trace's cache_salt), a Redis store's password and
the `?token=` of an LMDB store's location. After masking what may differ between runs (fingerprints, ids and
page hashes: keyed digests; timings; ephemeral ports; the run's own directory), every run must print exactly the
same text, byte for byte, with the same exit codes. A secret that reached any stdout, stderr, --json, log line,
metrics scrape or ready line in any form (as itself, or as the *** a substring scrubber leaves where it was: the
issue's `cre***te` for salt `a`, `***27.0.0.***` for password `1`) makes two runs differ, even for a secret of one
character, where looking for the secret's text would find it everywhere. Also: no `***` anywhere but in a
location's credential.

On ebaf189 the named group (`a`, `e`, `1`, `/`, `.`) fails at its first command (`kvc init` prints the key file's
path with every `a` of it as ***: `test_the_n***med_secrets_le***ve_n0`), and so does every drawn pair tried.

Size: the named group offline and live, and `KVC_SECRET_EXAMPLES` drawn pairs of random secrets (1 by default:
seconds of `make test` each), e.g. `KVC_SECRET_EXAMPLES=25` for a larger run.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import signal
import string
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import msgspec
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import clirun
from kvcache import WorkloadSpec, generate, write_trace
from kvcache.storage.location import StoreLocation
from kvcache_redis.url import parse_url
from redis_server import RedisServer, require_server

KVC = clirun.KVC
NAMED = ["a", "e", "1", "/", "."]
EXAMPLES = int(os.environ.get("KVC_SECRET_EXAMPLES", "1"))
TOKENS = ",".join(str(t) for t in range(1, 33))  # 8 pages of 4
TINY = ["--page-size", "4", "--layers", "1", "--kv-heads", "1", "--head-dim", "16"]
REPLAY = ["--prefetch-policy", "wait_complete"]  # what a replay hits does not hang on the I/O thread's timing
# kvc's group, built once (clirun.KVC_GROUP: typer's runner builds it again on every call, a third of a run's time
# here). The group's `main` is the console script's; it keeps nothing of a call but the commands it built.
KVC_GROUP = clirun.KVC_GROUP
runner = CliRunner()

# What differs between two runs whatever the secret: keyed digests (fingerprints, display ids, page hashes, layout
# ids, under each store's own random key), numbers with a fraction (timings, rates, ratios), dates.
_MASKS = [
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:?\d\d)?"), "<TIME>"),
    (re.compile(r"(?<![\d.])\d+\.\d+(e[+-]?\d+)?(?![\d.])"), "<F>"),
    (re.compile(r"(<F>|\b[\d,]+) ?\w+/s\b"), "<RATE>"),  # req/s, tokens/s, MiB/s
    (re.compile(r"\b[0-9a-f]{12,64}\b"), "<HEX>"),
    (re.compile(r"\b1[6-9]\d{8}\b"), "<UNIX>"),  # unix seconds
    (re.compile(r"kvc-admin:\d+"), "kvc-admin:<N>"),  # the request ids a process mints
    (re.compile(r"(\bpid\W+)\d+"), r"\1<PID>"),
    (re.compile(r"(footprint\w*\W+)[\d,.]+( \w?i?B)?"), r"\1<N>"),  # Redis' own memory figures
    # access-time flushes run on a clock (AccessPolicy.flush_interval_s) as well as on a count: how many ran, and
    # what waits for the next, depend on timing, never on a secret
    # (and the hit counts a store shows are as of its last flush)
    (re.compile(r"(\bflushes\W+|\bpending_access\W+|\bflush_errors\W+|\"hits\":)\d+"), r"\1<N>"),
]


# Outputs known to still print a secret (command label -> why), none today. Checked strictly: each must still
# differ, so that its fix shows here and it is taken out.
KNOWN_LEAKS: dict[str, str] = {}


@dataclass
class Run:
    """One secret's run: where it lives, and every output it printed, in order."""

    secret: str
    root: Path
    redis: RedisServer
    outputs: list[tuple[str, str]] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    @property
    def token(self) -> str:
        return quote(self.secret, safe="")

    @property
    def lmdb(self) -> str:
        """An LMDB store whose location carries the secret as its ?token= (the directory's name holds it)."""
        return f"lmdb://{self.root}/store?token={self.token}"

    @property
    def redis_url(self) -> str:
        """A Redis store whose URL carries the secret as its password."""
        return f"redis://:{self.token}@127.0.0.1:{self.redis.port}/0?prefix=kvcsec:"

    def env(self) -> dict[str, str | None]:
        return {"KVC_SALT": self.secret, "KVC_STORE": None, "KVC_SOCKET": None, "KVC_FINGERPRINT_KEY": None,
                "KVC_DEBUG": None}

    def cli(self, label: str, *args: object, stdin: str | None = None) -> None:
        """Run kvc in this process and keep what it printed."""
        result = runner.invoke(KVC_GROUP, [str(a) for a in args], input=stdin, env=self.env())
        self.keep(label, f"exit {result.exit_code}\n{result.stdout}\n--stderr--\n{result.stderr}")

    def dump(self, label: str, *args: object) -> None:
        """`kvc ns dump`: its summary with --out, the file's events as records, and its events on stdout as JSON
        lines (labelled "events": their order follows keyed page hashes, so their lines are compared sorted)."""
        out = self.root / "dump.kvev"
        self.cli(label, "ns", "dump", *args, "--out", out)
        if out.exists():
            from kvcache.live.event_records import records
            from kvcache.live.holdings import read_batches
            from kvcache.live.subscriber import ReceivedBatch

            recs = [r for i, b in enumerate(read_batches(out.read_bytes()))
                    for r in records(ReceivedBatch(i, b, False))]
            self.keep(f"{label} file events", "\n".join(msgspec.json.encode(r).decode() for r in recs))
            out.unlink()
        self.cli(f"{label} events json", "ns", "dump", *args, "--json")

    def keep(self, label: str, text: str) -> None:
        self.outputs.append((label, text))

    def normalised(self) -> list[tuple[str, str]]:
        out = []
        for label, text in self.outputs:
            text = text.replace(str(self.root), "<RUN>")
            for port in self.ports:
                text = re.sub(rf"(?<=:){port}\b", "<PORT>", text)
            for pattern, mask in _MASKS:
                text = pattern.sub(mask, text)
            # Sorted: Prometheus series come in the order of keyed digests; a live feed's events within one batch in
            # the order the cache's I/O thread finished them (the same events, another order: no trace of a secret).
            if "prom" in label or "metrics" in label or "events" in label:
                text = "\n".join(sorted(text.splitlines()))
            out.append((label, text))
        return out


def offline(run: Run) -> None:
    """Every command that can run without a live cache, on both stores, in each output form."""
    trace = run.root / "trace.jsonl"
    spec = WorkloadSpec(requests=12, tenants=2, documents=2, document_tokens=16, seed=3)
    write_trace(str(trace), generate(spec))
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    for line in lines:  # tenant-0's salt is the secret too
        line["cache_salt"] = run.secret if line["extra_key"] == "tenant-0" else None
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    secret_rid = next(line["rid"] for line in lines if line["extra_key"] == "tenant-0")  # `kvc explain --trace`
    salt_file = run.root / "t1.salt"
    salt_file.write_text(run.secret + "\n")
    salt_file.chmod(0o600)
    for store, name in ((run.lmdb, "lmdb"), (run.redis_url, "redis")):
        s = ("--store", store)
        for form in ([], ["--json"]):
            f = " ".join(form)
            run.cli(f"{name} init {f}", "init", *s, *TINY, *form)
            run.cli(f"{name} put {f}", "put", *s, "--extra-key", "t1", "--tokens", TOKENS, *form)
            run.cli(f"{name} prefetch {f}", "prefetch", *s, "--extra-key", "t1", "--tokens", TOKENS, *form)
            run.cli(f"{name} prefetch ns {f}", "prefetch", *s, "--extra-key", "t1", *form)
            run.cli(f"{name} stage {f}", "stage", *s, "--extra-key", "t1", "--tokens", TOKENS, *form)
            run.cli(f"{name} load-back {f}", "load-back", *s, "--extra-key", "t1", "--tokens", TOKENS, *form)
            run.cli(f"{name} ns show {f}", "ns", "show", "t1", *s, *form)
            run.cli(f"{name} ns probe {f}", "ns", "probe", "--engine", "sglang", "--extra-key", "t1", "--tokens",
                    TOKENS, *s, *form)
            run.cli(f"{name} ns probe tiers {f}", "ns", "probe", "--extra-key", "t1", "--tokens", TOKENS, *s, *form)
            run.dump(f"{name} ns dump {f}", *s, *form)
            run.cli(f"{name} stats {f}", "stats", *s, *form)
            run.cli(f"{name} audit {f}", "audit", *s, *form)
            run.cli(f"{name} audit repair dry {f}", "audit", "--repair", "--dry-run", *s, *form)
            run.cli(f"{name} replay {f}", "replay", trace, *s, *REPLAY, *form)
            run.cli(f"{name} explain {f}", "explain", *s, "--extra-key", "t1", "--tokens", TOKENS, *form)
            run.cli(f"{name} explain trace {f}", "explain", *s, "--trace", trace, "--rid", secret_rid, *form)
            lines_out = run.root / "requests.jsonl"
            run.cli(f"{name} replay requests-out {f}", "replay", trace, *s, *REPLAY, "--requests-out", lines_out,
                    *form)
            run.keep(f"{name} requests-out file {f}", lines_out.read_text() if lines_out.exists() else "<none>")
            plot = run.root / "sweep.svg"
            run.cli(f"{name} sweep {f}", "sweep", trace, *s, "--device-tokens", "512,1024", "--host-tokens", 512,
                    "--workers", 1, "--plot", plot, "--force", *form)
            run.keep(f"{name} sweep plot {f}", plot.read_text() if plot.exists() else "<none>")
            run.cli(f"{name} ns drop refused {f}", "ns", "drop", "t9", *s, *form)
            run.cli(f"{name} ns drop absent {f}", "ns", "drop", "t9", "--yes", *s, *form)
            run.cli(f"{name} ns drop dry {f}", "ns", "drop", "t1", "--dry-run", *s, *form)
            run.cli(f"{name} quota set {f}", "ns", "quota", "set", "--extra-key", "t1", "--store-bytes", 1 << 20,
                    *s, *form)
            run.cli(f"{name} quota clear {f}", "ns", "quota", "clear", "--extra-key", "t1", *s, *form)
            run.cli(f"{name} migrate {f}", "migrate", *s, *form)
        for form in ("table", "tsv", "json"):
            run.cli(f"{name} ns ls -o {form}", "ns", "ls", *s, "-o", form)
            run.cli(f"{name} quota show -o {form}", "ns", "quota", "show", *s, "-o", form)
        run.cli(f"{name} stats prom", "stats", "--prom", *s)
        # the four ways to give the salt, and the namespace dropped for good at the end
        put = ("put", *s, "--extra-key", "t3", "--tokens", TOKENS)
        run.cli(f"{name} put salt-file", *put, "--salt-file", salt_file)
        run.cli(f"{name} audit repair", "audit", "--repair", *s)
        run.cli(f"{name} put salt stdin", *put, "--salt", "-", stdin=run.secret + "\n")
        run.cli(f"{name} put salt value", *put, f"--salt={run.secret}")
        run.cli(f"{name} ns drop", "ns", "drop", "t1", "--yes", *s, "--json")
        # failures: a salt file that is a directory or absent, a store that is not there, debug tracebacks
        run.cli(f"{name} salt-file dir", "ns", "show", "t1", *s, "--salt-file", run.root)
        run.cli(f"{name} salt-file missing", "ns", "show", "t1", *s, "--salt-file", run.root / "none")
        run.cli(f"{name} debug drop", "--debug", "ns", "drop", "t9", "--yes", *s)
    run.cli("lmdb rekey", "init", "--rekey", "--yes", "--store", run.lmdb)
    missing = f"lmdb://{run.root}/none?token={run.token}"
    for form in ([], ["--json"]):
        run.cli(f"no store {form}", "ns", "ls", "--store", missing, *form)
        run.cli(f"debug no store {form}", "--debug", "put", "--store", missing, "--extra-key", "t1", "--tokens",
                TOKENS, *form)
    port = _closed_port()
    run.ports.append(port)
    for i, url in enumerate((run.redis_url.replace(f":{run.redis.port}/", f":{port}/"),  # nobody listens
                             f"redis://:{run.token}x@127.0.0.1:{run.redis.port}/0?prefix=kvcsec:",  # wrong password
                             f"redis://:{run.token}@127.0.0.1:notaport/0", f"redis://:{run.token}@127.0.0.1:1:2/0")):
        for form in ([], ["--json"]):
            run.cli(f"bad url {i} {form}", "stats", "--store", url, *form)
        run.cli(f"debug bad url {i}", "--debug", "ns", "ls", "--store", url)
    run.cli("version", "version", "--json")
    run.cli("generate", "generate", run.root / "g.jsonl", "--requests", 5)
    run.cli("demo", "demo", "--requests", 12, "--tenants", 2, "--store", run.root / "demo")  # a directory, not a URL
    run.cli("bench", "bench", "--only", "no_such_bench", "--dir", run.root)
    for label, command in (("events", ["events"]), ("top", ["top", "--count", "1"]),
                           ("snapshot", ["snapshot", run.root / "snap.bin"]), ("ping", ["ping"]),
                           ("evict", ["ns", "evict", "t1"]), ("expire", ["ns", "expire", "t1"])):
        run.cli(f"no socket {label}", *command)  # each needs a live cache (or an endpoint): one line each


def live(run: Run) -> None:
    """`kvc serve` on the Redis store (metrics and KV events on), and every command that acts on it."""
    sock = run.root / "s.sock"
    env = {k: v for k, v in os.environ.items() if k not in ("KVC_STORE", "KVC_SOCKET", "KVC_FINGERPRINT_KEY")}
    env["KVC_SALT"] = run.secret
    serve = subprocess.Popen([str(KVC), "serve", "--store", run.redis_url, "--socket", str(sock), "--json",
                              "--device-tokens", "4096", "--host-tokens", "8192", "--metrics-port", "0", *REPLAY,
                              "--events", "*", "--events-replay", "*"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = serve.stdout.readline()
        assert line, serve.stderr.read()
        ready = json.loads(line)
        run.ports += [int(m) for m in re.findall(r":(\d+)\b", " ".join(str(ready[k]) for k in
                                                                         ("metrics", "events", "events_replay")))]
        run.keep("serve ready", json.dumps(ready, sort_keys=True))
        s = ("--socket", sock)
        for form in ([], ["--json"]):
            run.cli(f"live ping {form}", "ping", *s, *form)
            run.cli(f"live prefetch {form}", "prefetch", *s, "--extra-key", "t3", "--tokens", TOKENS, *form)
            run.cli(f"live prefetch ns {form}", "prefetch", *s, "--extra-key", "t3", *form)
            run.cli(f"live stage {form}", "stage", *s, "--extra-key", "t3", "--tokens", TOKENS, *form)
            run.cli(f"live load-back {form}", "load-back", *s, "--extra-key", "t3", "--tokens", TOKENS, *form)
            run.cli(f"live ns ls {form}", "ns", "ls", *s, *form)
            run.cli(f"live audit {form}", "audit", *s, *form)
            run.cli(f"live ns evict {form}", "ns", "evict", "t3", *s, *form)
            run.cli(f"live quota set {form}", "ns", "quota", "set", "--extra-key", "t3", "--store-bytes", 1 << 20,
                    *s, *form)
            run.cli(f"live quota show {form}", "ns", "quota", "show", *s, *form)
            run.cli(f"live ns expire refused {form}", "ns", "expire", "t3", *s, *form)
            run.cli(f"live ns drop refused {form}", "ns", "drop", "t9", *s, *form)
            run.cli(f"live ns drop dry {form}", "ns", "drop", "t3", "--dry-run", *s, *form)
            run.cli(f"live replay {form}", "replay", run.root / "trace.jsonl", *s, *REPLAY, *form)
            run.cli(f"live explain {form}", "explain", *s, "--extra-key", "t3", "--tokens", TOKENS, *form)
            lines_out = run.root / "live-requests.jsonl"
            run.cli(f"live replay requests-out {form}", "replay", run.root / "trace.jsonl", *s, *REPLAY,
                    "--requests-out", lines_out, *form)
            run.keep(f"live requests-out file {form}", lines_out.read_text() if lines_out.exists() else "<none>")
            run.cli(f"live ns probe {form}", "ns", "probe", *s, "--extra-key", "t3", "--tokens", TOKENS, *form)
            run.dump(f"live ns dump {form}", *s, *form)
        run.cli("live stats json", "stats", *s, "--json")
        run.cli("live stats prom", "stats", "--prom", *s)
        run.cli("live snapshot", "snapshot", run.root / "snap.bin", *s, "--json")
        run.cli("live audit snapshot", "audit", "--snapshot", run.root / "snap.bin", "--json")
        run.cli("live top", "top", "--count", "1", "--interval", "0.1", *s, "--json")
        run.cli("live events", "events", "--endpoint", ready["events"], "--replay", ready["events_replay"], "--json")
        run.cli("live debug", "--debug", "ns", "drop", "t9", "--yes", *s)
        with urllib.request.urlopen(ready["metrics"], timeout=30) as scrape:
            run.keep("live metrics", scrape.read().decode())
        run.cli("live ns drop", "ns", "drop", "t3", "--yes", *s, "--json")
    finally:
        serve.send_signal(signal.SIGTERM)
        out, err = serve.communicate(timeout=60)
    run.keep("serve exit", f"exit {serve.returncode}\n{out}\n--stderr--\n{err}")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port nobody listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _password(server: RedisServer, password: str) -> Iterator[None]:
    """The server requires `password` (and holds no key) for the length of a run."""
    import redis

    with redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5) as c:
        c.flushall()
        c.config_set("requirepass", password)
    try:
        yield
    finally:
        with redis.Redis(host="127.0.0.1", port=server.port, password=password, socket_timeout=5) as c:
            c.flushall()
            c.config_set("requirepass", "")


def sweep(secrets: list[str], base: Path, server: RedisServer, with_live: bool) -> list[Run]:
    """One run per secret, each in a directory of the same length (so masked paths line up)."""
    runs = []
    for i, secret in enumerate(secrets):
        root = base / f"run{i:02d}"
        root.mkdir()
        run = Run(secret, root, server)
        with _password(server, secret):
            offline(run)
            if with_live:
                live(run)
        runs.append(run)
    return runs


def assert_no_trace(runs: list[Run]) -> None:
    """Every run printed the same text once masked, and no *** but in a location's credential (an LMDB location's
    ?token=, a Redis URL's password)."""
    first = runs[0].normalised()
    for run in runs:
        for label, text in run.outputs:
            rest = re.sub(r"\?token=\*\*\*|//:\*\*\*@127\.0\.0\.1:", "", text)
            assert "***" not in rest, (run.secret, label, text)
        other = run.normalised()
        assert [label for label, _ in other] == [label for label, _ in first]
        for (label, a), (_, b) in zip(first, other, strict=True):
            if label in KNOWN_LEAKS:
                assert a != b or runs[0].secret == run.secret, f"{label!r} is fixed: take it out of KNOWN_LEAKS"
            elif a != b:
                diff = "\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=1))
                raise AssertionError(f"{label!r} prints differently for secret {runs[0].secret!r} and "
                                     f"{run.secret!r}:\n{diff}")


@pytest.fixture(scope="module")
def redis_for_secrets(tmp_path_factory):
    """A redis-server of this module's own: its password changes run by run."""
    server = RedisServer(require_server(), tmp_path_factory.mktemp("redis-secrets")).start()
    yield server
    server.stop()


def test_the_named_secrets_leave_no_trace_offline_or_live(redis_for_secrets, tmp_path):
    assert_no_trace(sweep(NAMED, tmp_path, redis_for_secrets, with_live=True))


_SECRET_CHARS = string.ascii_letters + string.digits + string.punctuation


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 6).flatmap(lambda n: st.lists(st.text(_SECRET_CHARS, min_size=n, max_size=n)
                                                    .filter(lambda s: s != "-"),  # `--salt -` reads stdin
                                                    min_size=2, max_size=2, unique=True)))
def test_drawn_secrets_leave_no_trace(redis_for_secrets, tmp_path_factory, pair):
    assert_no_trace(sweep(pair, tmp_path_factory.mktemp("pair"), redis_for_secrets, with_live=False))


@given(st.text(min_size=1, max_size=8))
def test_the_redis_backend_shows_a_url_as_the_cli_does(password):
    """The backend's own messages name its URL by the same structure as `StoreLocation` (ebaf189: the backend kept
    a query's ?password= as given, and the CLI scrubbed its text wherever it was)."""
    spelled = quote(password, safe="")
    url = f"redis://:{spelled}@127.0.0.1:6379/0?prefix=a.1:&password={spelled}"
    shown = "redis://:***@127.0.0.1:6379/0?prefix=a.1:&password=***"
    assert parse_url(url, {}).shown == str(StoreLocation(url)) == shown

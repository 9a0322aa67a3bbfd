"""Secrets stay secret (issue 13): a store password never reaches any output of any command, the salt never
reaches a command line with the safe forms, fingerprints are keyed per store.

Each test reproduces a report first: on 0f180b0 `kvc stats`, `init`, `ns ls --json` and `audit --json` printed
the password, `--salt-file` / `--salt -` / KVC_SALT did not exist, and every store showed the same fingerprint
for a salt (the README's `wrong` -> c39589a45512)."""

import json
import os
import signal
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

import clirun
from kvc.main import app
from kvcache import Namespace, WorkloadSpec, generate, write_trace
from redis_server import RedisServer, require_server

KVC = clirun.KVC
PASSWORD = "pw-Zq8xV3-redis-secret"
SALT = "salt-Hk2mW9-tenant-secret"
TOKENS = ",".join(str(t) for t in range(1, 101))
runner = CliRunner()


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("KVC_SALT", "KVC_STORE", "KVC_FINGERPRINT_KEY")}
    return {**env, **extra}


def kvc(*args, env=None, stdin=None):
    """kvc in this process (what it prints and its exit code are what these tests check), with `env` as its whole
    environment (a process's own, less any salt, store or key setting, when None). A test that reads a kvc's
    process list, or serves a socket, starts a process itself."""
    return clirun.in_process(*args, env=env or _env(), stdin=stdin)


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    """A redis-server that requires a password."""
    server = RedisServer(require_server(), tmp_path_factory.mktemp("redis-auth")).start()
    with server._client() as c:
        c.config_set("requirepass", PASSWORD)
    yield server
    server.stop()


def _no_password(*texts):
    for text in texts:
        assert PASSWORD not in text
        assert PASSWORD.replace("-", "%2D") not in text


def test_no_command_prints_a_store_password(locked_redis, tmp_path):
    url = f"redis://:{PASSWORD}@127.0.0.1:{locked_redis.port}/0?prefix=sec-{os.getpid()}:"
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate(WorkloadSpec(requests=40, tenants=2, seed=1)))
    env = {"KVC_SALT": SALT, "KVC_STORE": url}
    seen = []

    def run(*args, code=0):
        result = runner.invoke(app, [str(a) for a in args], env=env)
        seen.append((args, result.stdout, result.stderr))
        _no_password(result.stdout, result.stderr)
        assert result.exit_code == code, (args, result.stderr)
        return result

    for fmt in ([], ["--json"]):
        run("init", "--page-size", 4, *fmt)
        run("put", "--extra-key", "t1", "--tokens", TOKENS, *fmt)
        run("prefetch", "--extra-key", "t1", "--tokens", TOKENS, *fmt)
        run("prefetch", "--extra-key", "t1", *fmt)
        run("stage", "--extra-key", "t1", "--tokens", TOKENS, *fmt)
        run("load-back", "--extra-key", "t1", "--tokens", TOKENS, *fmt)
        run("ns", "show", "t1", *fmt)
        run("stats", *fmt)
        run("audit", *fmt)
        run("audit", "--repair", "--dry-run", *fmt)
        run("replay", trace, *fmt)
    for fmt in ("table", "tsv", "json", "jsonl"):
        run("ns", "ls", "-o", fmt)
        run("stats", "-o", fmt)
    run("stats", "--prom")
    assert any(str(url).replace(PASSWORD, "***").split("?")[0] in s[1] for s in seen)  # the location is shown
    # errors quoting the URL: a bad password, a bad port, an unreachable server, a scheme nobody serves
    for bad in (url.replace(PASSWORD, PASSWORD + "x"), f"redis://:{PASSWORD}@127.0.0.1:notaport/0",
                f"redis://:{PASSWORD}@127.0.0.1:1/0", f"nosuch://:{PASSWORD}@host/0"):
        for fmt in ([], ["--json"]):
            result = runner.invoke(app, ["ns", "ls", "--store", bad, *fmt])
            assert result.exit_code == 2
            _no_password(result.stdout, result.stderr)
    ns_id = json.loads(run("ns", "ls", "--json").stdout)["namespaces"][0]["id"]
    run("ns", "drop", "--id", ns_id, "--yes", "--json")


def test_a_live_server_and_its_metrics_never_print_the_password(locked_redis, tmp_path):
    url = f"redis://:{PASSWORD}@127.0.0.1:{locked_redis.port}/0?prefix=live-{os.getpid()}:"
    env = _env(KVC_STORE=url, KVC_SALT=SALT)
    assert kvc("init", "--page-size", 4, env=env).returncode == 0
    assert kvc("put", "--extra-key", "t1", "--tokens", TOKENS, env=env).returncode == 0
    sock = tmp_path / "s.sock"
    serve = subprocess.Popen([str(KVC), "serve", "--socket", str(sock), "--metrics-port", "0", "--json",
                              "--device-tokens", "1024", "--host-tokens", "4096"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = json.loads(serve.stdout.readline())
        _no_password(json.dumps(ready))
        # the clients run in this process; the server it talks to in its own
        outputs = [kvc("--socket", sock, *args, env=env) for args in
                   (["stats"], ["stats", "--json"], ["stats", "--prom"], ["ns", "ls", "--json"], ["audit"],
                    ["prefetch", "--extra-key", "t1", "--json"], ["top", "--count", "1", "--interval", "0.1"])]
        for out in outputs:
            assert out.returncode == 0, out.stderr
            _no_password(out.stdout, out.stderr)
        scrape = urllib.request.urlopen(ready["metrics"], timeout=10).read().decode()
        _no_password(scrape)
        assert "kvc_store_info{" in scrape and "redis://:***@127.0.0.1" in scrape
    finally:
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=30)
    assert serve.returncode == 0
    _no_password(err)


def _watch_cmdline(args, env, stdin=None):
    """Run kvc and read its /proc/PID/cmdline for as long as it runs; (exit code, stdout, stderr, every cmdline
    seen)."""
    seen = set()
    with subprocess.Popen([str(KVC), *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as proc:  # its exit closes the pipes
        if stdin is not None:
            proc.stdin.write(stdin)
        proc.stdin.close()
        while proc.poll() is None:
            try:
                seen.add(Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass  # between exit and reaping
            time.sleep(0.002)
        return proc.returncode, proc.stdout.read(), proc.stderr.read(), seen


@pytest.fixture
def lmdb_store(tmp_path):
    path = tmp_path / "store"
    _invoke("init", "--store", path)
    _invoke("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS, KVC_SALT=SALT)
    return path


def test_the_salt_never_reaches_the_process_list_with_the_safe_forms(lmdb_store, tmp_path):
    salt_file = tmp_path / "t1.salt"
    salt_file.write_text(SALT + "\n")
    salt_file.chmod(0o600)
    # a command that reads a salt and opens no cache: its process lives long enough to be read, and starts fast
    base = ["ns", "show", "t1", "--store", lmdb_store, "--json"]
    fingerprints = set()
    for extra, env, stdin in ((["--salt-file", salt_file], _env(), None), (["--salt", "-"], _env(), SALT + "\n"),
                              ([], _env(KVC_SALT=SALT), None)):
        code, out, err, cmdlines = _watch_cmdline(base + extra, env, stdin)
        assert code == 0, err
        assert cmdlines and all(SALT not in c for c in cmdlines)
        assert "visible to every local user" not in err
        fingerprints.add(json.loads(out)["namespace"]["salt_fingerprint"])
    # the unsafe form still works, is seen in the process list (the check above can fail), and warns once
    code, out, err, cmdlines = _watch_cmdline(base + ["--salt", SALT], _env())
    assert code == 0 and any(SALT in c for c in cmdlines)
    assert err.count("visible to every local user") == 1
    hit = json.loads(out)
    assert hit["pages"] == 6 and fingerprints == {hit["namespace"]["salt_fingerprint"]}  # the same namespace


def test_salt_sources_conflict_or_missing_are_usage_errors(lmdb_store, tmp_path):
    base = ["ns", "show", "t1", "--store", lmdb_store]
    both = kvc(*base, "--salt", "x", "--salt-file", tmp_path / "f")
    assert both.returncode == 2 and "not both" in both.stderr
    missing = kvc(*base, "--salt-file", tmp_path / "missing.salt")
    assert missing.returncode == 2 and missing.stderr.startswith("kvc: error: --salt-file")
    empty = kvc(*base, "--salt", "-", stdin="")
    assert empty.returncode == 2 and "no salt" in empty.stderr
    none = kvc(*base, "--salt", "", env=_env(KVC_SALT=SALT))  # '' overrides KVC_SALT: the unsalted t1
    assert none.returncode == 2 and "no namespace t1/-" in none.stderr
    for out in (both, missing, empty, none):
        assert len(out.stderr.strip().splitlines()) == 1 and SALT not in out.stdout + out.stderr


def _invoke(*args, **env):
    result = runner.invoke(app, [str(a) for a in args], env={"KVC_FINGERPRINT_KEY": None, **env})
    assert result.exit_code == 0, result.stderr
    return result


def _first_row(path):
    return json.loads(_invoke("ns", "ls", "--store", path, "--json").stdout)["namespaces"][0]


def test_fingerprints_are_keyed_by_each_store(tmp_path):
    rows = {}
    for name in ("a", "b"):
        path = tmp_path / name
        init = json.loads(_invoke("init", "--store", path, "--json").stdout)
        key_file = Path(init["fingerprint_key"])
        assert key_file.parent == path and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        _invoke("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS, KVC_SALT="wrong")
        rows[name] = _first_row(path)
    assert rows["a"]["salt_fingerprint"] != rows["b"]["salt_fingerprint"]
    assert rows["a"]["id"] != rows["b"]["id"]  # display ids are keyed too
    # 0f180b0 printed c39589a45512 for the salt `wrong` in every store (a constant key in the code)
    assert "c39589a45512" not in (rows["a"]["salt_fingerprint"], rows["b"]["salt_fingerprint"])
    assert Namespace("t1", "wrong").id_hex not in (rows["a"]["id"], rows["b"]["id"])
    # one key for a deployment: KVC_FINGERPRINT_KEY seeds every store created with it
    for name in ("c", "d"):
        _invoke("init", "--store", tmp_path / name, KVC_FINGERPRINT_KEY="ab" * 32)
        _invoke("put", "--store", tmp_path / name, "--extra-key", "t1", "--tokens", TOKENS, KVC_SALT="wrong")
    c, d = (_first_row(tmp_path / n) for n in "cd")
    assert c["salt_fingerprint"] == d["salt_fingerprint"] == Namespace("t1", "wrong").fingerprint(b"\xab" * 32)


def test_init_of_an_lmdb_url_names_the_key_file_it_wrote(tmp_path):
    # an lmdb:// location is a directory like a plain path: its key is in its key file, not a "format record"
    path = tmp_path / "s"
    init = json.loads(_invoke("init", "--store", f"lmdb://{path}", "--json").stdout)
    key_file = Path(init["fingerprint_key"])
    assert key_file == path / "fingerprint.key" and stat.S_IMODE(key_file.stat().st_mode) == 0o600


# --- issue 36, item 5: no message can give a secret away ----------------------------------------------------------
# On ebaf189 every error line had each secret of the invocation replaced by *** wherever its text occurred, which
# says where the secret's text is: salt `prod` printed /srv/***/kvc-store, salt `a` printed cre***te, password `1`
# printed ***27.0.0.***. Each test below fails there.

def _error_line(result, says):
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and says in lines[0], result.stderr
    return lines[0]


@pytest.mark.parametrize("salt", ["prod", "a", "e", "1", "/", ".", "no store here"])
def test_a_salt_never_edits_a_message(tmp_path, salt):
    store = tmp_path / "srv" / "prod" / "kvc-store"
    put = ["put", "--store", str(store), "--extra-key", "t1", "--tokens", TOKENS]
    expected = f"kvc: error: {store}: no store here (create one with `kvc init`, or pass --store / KVC_STORE)"
    for args in (put, put + ["--json"]):
        result = runner.invoke(app, args, env={"KVC_SALT": salt})
        assert _error_line(result, "no store here") == expected
    # the --debug traceback too: the same bytes as without a salt
    debug = [runner.invoke(app, ["--debug", *put], env={"KVC_SALT": s}) for s in ("", salt)]
    assert "Traceback (most recent call last)" in debug[0].stderr and "***" not in debug[1].stderr
    assert debug[0].stderr == debug[1].stderr


@pytest.mark.parametrize("password", ["1", "2", ".", "0.0"])
def test_a_short_password_leaves_the_address_whole(password):
    with __import__("socket").socket() as closed:  # bound, never listened on: refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        url = f"redis://:{password}@127.0.0.1:{port}/0"
        for fmt in ([], ["--json"]):
            result = runner.invoke(app, ["stats", "--store", url, *fmt], env={"KVC_SALT": password})
            line = _error_line(result, "cannot reach the server")
            assert line == (f"kvc: error: redis://:***@127.0.0.1:{port}/0: cannot reach the server: cannot connect "
                            f"(ECONNREFUSED: Connection refused)")
            if fmt:
                assert json.loads(result.stdout)["error"]["message"] == line.removeprefix("kvc: error: ")


def test_a_wrong_password_is_said_in_kvcs_words(locked_redis):
    for wrong in ("1", PASSWORD[:-1]):
        url = f"redis://:{wrong}@127.0.0.1:{locked_redis.port}/0"
        line = _error_line(runner.invoke(app, ["ns", "ls", "--store", url]), "refused the credentials")
        assert line == (f"kvc: error: redis://:***@127.0.0.1:{locked_redis.port}/0: cannot reach the server: the "
                        f"server refused the credentials (a wrong or missing password or user)")


def test_a_password_in_the_query_is_shown_by_structure(locked_redis):
    url = f"redis://127.0.0.1:{locked_redis.port}/0?password=1&prefix=p1.1:"
    result = runner.invoke(app, ["ns", "ls", "--store", url])  # no store under that prefix
    assert result.exit_code == 2 and "?password=***&prefix=p1.1:" in result.stderr, result.stderr
    assert result.stderr.count("***") == 1


def test_a_salt_file_that_is_a_directory_is_one_line_naming_the_option(lmdb_store, tmp_path):
    # ebaf189: "kvc: error: 3: Is a directory" (the open file's descriptor taken for a file name)
    for fmt in ([], ["--json"]):
        result = runner.invoke(app, ["ns", "show", "t1", "--store", str(lmdb_store), "--salt-file", str(tmp_path),
                                     *fmt])
        line = _error_line(result, f"--salt-file {tmp_path}: a directory")
        if fmt:
            assert json.loads(result.stdout)["error"] == {"kind": "usage", "message": line[len("kvc: error: "):]}


def test_what_is_wrong_with_a_salt_says_nothing_measured_from_it(lmdb_store, tmp_path):
    """A salt that is not UTF-8, or a salt file too large: the same line whatever the bytes (ebaf189 said which
    character of the salt was not UTF-8, and the file's size)."""
    said = set()
    for content in (b"ab\xffcd\n", b"\xfe\n", b"salt\xc3"):
        path = tmp_path / "bad.salt"
        path.write_bytes(content)
        path.chmod(0o600)
        said.add(_error_line(runner.invoke(app, ["ns", "show", "t1", "--store", str(lmdb_store), "--salt-file",
                                                 str(path)]), "not UTF-8"))
    assert len(said) == 1 and "character" not in said.pop()
    big = set()
    for size in (5000, 6001):
        path = tmp_path / "big.salt"
        path.write_bytes(b"s" * size)
        path.chmod(0o600)
        big.add(_error_line(runner.invoke(app, ["ns", "show", "t1", "--store", str(lmdb_store), "--salt-file",
                                                str(path)]), "more than 4096 bytes"))
    assert len(big) == 1


def test_an_error_kvc_did_not_raise_is_named_not_quoted():
    """A library's error text may quote what it was handed (a URL, a salt): its type and place are printed, never
    its text; kvc's own errors and code-shaped ones (TypeError, AttributeError) as raised."""
    from kvc import reporting
    from kvcache.errors import StoreError

    def fail():
        try:
            raise UnicodeEncodeError("utf-8", SALT, 3, 4, "surrogates not allowed")
        except UnicodeEncodeError as exc:
            raise StoreError("/srv/kvc", "cannot read the registry") from exc

    with pytest.raises(StoreError) as info:
        fail()
    message = reporting.message_of(info.value.__cause__)
    assert SALT not in message and "'t'" not in message and "position" not in message
    assert message.startswith("internal error: UnicodeEncodeError: (text withheld") and "raised at" in message
    assert reporting.message_of(info.value) == "/srv/kvc: cannot read the registry"
    assert reporting.message_of(TypeError("'int' object is not iterable")).endswith(
        "TypeError: 'int' object is not iterable (run with --debug for the traceback)")
    trace = reporting.traceback_of(info.value)
    assert SALT not in trace and trace.count("Traceback (most recent call last):") == 2
    assert "The above exception was the direct cause of the following exception:" in trace
    assert trace.rstrip().endswith("kvcache.errors.StoreError: /srv/kvc: cannot read the registry")
    assert "UnicodeEncodeError: (text withheld" in trace and 'raise StoreError("/srv/kvc"' in trace


def test_the_guard_fails_loudly_where_a_message_would_carry_a_secret(lmdb_store):
    """With KVC_SECRET_GUARD=1 (tests), a line that holds a secret of this invocation is an error of kvc's, raised,
    never scrubbed. Here the extra_key is spelled like the salt, so the refusal names it: the guard cannot tell,
    and says so loudly rather than mangling the line."""
    from kvc.errors import SecretInOutput

    twin = "tenant-twin-secret"
    args = ["ns", "drop", twin, "--yes", "--store", str(lmdb_store)]
    result = runner.invoke(app, args, env={"KVC_SALT": twin, "KVC_SECRET_GUARD": "1"})
    assert isinstance(result.exception, SecretInOutput), (result.exit_code, result.stderr)
    assert "an error or warning line" in str(result.exception) and twin not in str(result.exception)
    off = runner.invoke(app, args, env={"KVC_SALT": twin, "KVC_SECRET_GUARD": None})
    assert off.exit_code == 2 and f"no namespace {twin}/" in off.stderr  # without the guard: printed as built
    short = runner.invoke(app, ["ns", "drop", "t1", "--yes", "--store", str(lmdb_store)],
                          env={"KVC_SALT": "t1", "KVC_SECRET_GUARD": "1"})
    assert short.exit_code == 2 and "no namespace t1/" in short.stderr  # this short, a secret is structure's alone


def test_a_live_cache_on_an_lmdb_location_with_a_token_never_shows_it(tmp_path):
    location = f"lmdb://{tmp_path}/s?token={PASSWORD}"
    env = _env(KVC_SALT=SALT)
    assert kvc("init", "--store", location, "--page-size", 4, env=env).returncode == 0
    assert kvc("put", "--store", location, "--extra-key", "t1", "--tokens", TOKENS, env=env).returncode == 0
    sock = tmp_path / "s.sock"
    serve = subprocess.Popen([str(KVC), "serve", "--store", location, "--socket", str(sock), "--metrics-port", "0",
                              "--json", "--device-tokens", "1024", "--host-tokens", "4096"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = json.loads(serve.stdout.readline())
        outputs = [json.dumps(ready), urllib.request.urlopen(ready["metrics"], timeout=30).read().decode()]
        for args in (["stats", "--json"], ["ping", "--json"], ["ns", "ls", "--json"], ["stats", "--prom"]):
            out = kvc("--socket", sock, *args, env=env)
            assert out.returncode == 0, out.stderr
            outputs += [out.stdout, out.stderr]
    finally:
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    _no_password(*outputs, err)

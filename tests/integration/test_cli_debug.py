"""A `--debug` traceback never prints a secret (issue 26, item 8): a store location's `?token=` and a Redis URL's
password stay out of stdout and stderr whatever fails — opening the store, or the command after it opened.

On fbee4ed one call redacted the traceback (`kvc.reporting.report`) and no test covered it: with it removed the
whole suite passed while `kvc --debug ns ls --store 'lmdb:///x?token=SECRET'` printed the token. The LMDB cases
here fail with that call removed (an LMDB store's path is its location, and the store's errors name it); the
Redis cases guard the same contract for a backend whose own messages show its URL redacted already."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import clirun
import lmdb_surgery
from kvc.main import app
from redis_server import RedisServer, require_server

TOKEN = "tok-Qm4Zr8-debug-secret"
PASSWORD = "pw-Lx7Nc2-debug-secret"
TOKENS = ",".join(str(t) for t in range(1, 33))
runner = CliRunner()


def _spellings(secret):
    from urllib.parse import quote

    return {secret, quote(secret, safe="")}


def run(*args, secret, code=2):
    """kvc --debug in this process; nothing it prints may hold `secret`; the traceback must be there."""
    result = runner.invoke(app, ["--debug", *map(str, args)], env={"KVC_SALT": "", "KVC_STORE": None})
    for text in (result.stdout, result.stderr):
        for spelling in _spellings(secret):
            assert spelling not in text, (args, text)
    assert result.exit_code == code, result.stdout + result.stderr
    assert "Traceback (most recent call last)" in result.stderr  # the traceback was printed, redacted
    assert result.stderr.rstrip().splitlines()[-1].startswith("kvc: error: ")
    return result


@pytest.fixture
def token_store(tmp_path):
    """An LMDB store whose location carries ?token=: its directory's name holds the token."""
    location = f"lmdb://{tmp_path}/s?token={TOKEN}"
    for args in (["init", "--page-size", 4, "--layers", 1, "--kv-heads", 1, "--head-dim", 16],
                 ["put", "--extra-key", "t1", "--tokens", TOKENS]):
        result = runner.invoke(app, [*map(str, args), "--store", location], env={"KVC_SALT": ""})
        assert result.exit_code == 0 and TOKEN not in result.stdout + result.stderr, result.stderr
    return location, tmp_path / f"s?token={TOKEN}"


def test_debug_on_a_failed_open_never_prints_the_token(tmp_path):
    location = f"lmdb://{tmp_path}/none?token={TOKEN}"
    for json_out in ([], ["--json"]):
        result = run("ns", "ls", "--store", location, *json_out, secret=TOKEN)
        assert "no kvc store here" in result.stderr
    run("stats", "--store", location, secret=TOKEN)
    run("replay", Path(__file__), "--store", location, secret=TOKEN)  # the trace is read first: it fails there


@pytest.mark.parametrize("args", [["ns", "ls"], ["ns", "ls", "-o", "json"], ["ns", "drop", "t1", "--yes"],
                                  ["prefetch", "--extra-key", "t1", "--tokens", TOKENS]])
def test_debug_on_a_failure_inside_a_command_never_prints_the_token(token_store, args):
    """The store opens; the command then meets a damaged registry record, and the store's error names its path."""
    location, path = token_store
    with lmdb_surgery.raw(str(path), recount=False) as r:
        key = next(iter(r.txn.cursor(db=r.db["namespaces"])))[0]
        r.txn.put(key, b"\xc1 not a record", db=r.db["namespaces"])
    result = run(*args, "--store", location, secret=TOKEN)
    assert "a damaged record in the store" in result.stderr
    if "-o" in args:
        assert json.loads(result.stdout)["error"]["kind"] == "store_error"


# --- Redis: redis://:PASSWORD@host ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    server = RedisServer(require_server(), tmp_path_factory.mktemp("redis-debug")).start()
    with server._client() as c:
        c.config_set("requirepass", PASSWORD)
    yield server
    server.stop()


def _redis_client(server):
    import redis

    return redis.Redis(host="127.0.0.1", port=server.port, password=PASSWORD, socket_timeout=5)


def test_debug_on_a_redis_store_never_prints_the_password(locked_redis, tmp_path):
    prefix = f"dbg-{os.getpid()}:"
    url = f"redis://:{PASSWORD}@127.0.0.1:{locked_redis.port}/0?prefix={prefix}"
    for args in (["init", "--page-size", 4, "--layers", 1, "--kv-heads", 1, "--head-dim", 16],
                 ["put", "--extra-key", "t1", "--tokens", TOKENS]):
        result = runner.invoke(app, [*map(str, args), "--store", url], env={"KVC_SALT": ""})
        assert result.exit_code == 0 and PASSWORD not in result.stdout + result.stderr, result.stderr
    # opening fails: a wrong password, no server, no store under the prefix
    run("ns", "ls", "--store", url.replace(PASSWORD, PASSWORD[::-1]), secret=PASSWORD[::-1])
    with __import__("socket").socket() as closed:  # a port bound here and never listened on: refused
        closed.bind(("127.0.0.1", 0))
        run("stats", "--store", f"redis://:{PASSWORD}@127.0.0.1:{closed.getsockname()[1]}/0", secret=PASSWORD)
    run("ns", "ls", "--json", "--store", url.replace(prefix, "nothing-here:"), secret=PASSWORD)
    # inside a command: refused after the store opened, then a damaged registry record
    run("ns", "drop", "t9", "--yes", "--store", url, secret=PASSWORD)
    with _redis_client(locked_redis) as c:
        damaged = [k for k in c.scan_iter(match=f"{prefix}*") if c.type(k) == b"hash" and c.hexists(k, "info")]
        assert damaged
        c.hset(damaged[0], "info", b"\xc1 not a record")
    run("ns", "ls", "--store", url, secret=PASSWORD)
    run("prefetch", "--extra-key", "t1", "--tokens", TOKENS, "--store", url, secret=PASSWORD)


def test_the_traceback_of_a_subprocess_is_redacted_too(tmp_path):
    """The console script, as a user runs it (KVC_DEBUG=1 instead of --debug)."""
    import subprocess

    kvc = clirun.KVC
    env = {**{k: v for k, v in os.environ.items() if k != "KVC_STORE"}, "KVC_DEBUG": "1"}
    result = subprocess.run([str(kvc), "ns", "ls", "--store", f"lmdb://{tmp_path}/x?token={TOKEN}"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" in result.stderr
    assert TOKEN not in result.stdout + result.stderr

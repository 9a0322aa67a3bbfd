"""`kvc audit --workers / --since`, through the installed `kvc` as a real subprocess: the scope of the audit in its
output, the store's record of its last clean audit, progress lines, and bad input."""

import json
import os
import subprocess

import msgspec
import pytest

from clirun import KVC, in_process
from kvcache.storage.api import PageMeta
from lmdb_surgery import raw

TOKENS = ",".join(map(str, range(400)))


def kvc(*args, code=0, **env):
    """kvc in this process; in a process of its own when `env` passes it a progress descriptor to report on
    while the test acts on the store."""
    if env:
        done = subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env}, pass_fds=[int(env["KVC_PROGRESS_FD"])])
    else:
        done = in_process(*args)
    assert done.returncode == code, done.stdout + done.stderr
    return done


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "s"
    kvc("init", "--store", path, "--page-size", "4")
    kvc("put", "--store", path, "--extra-key", "t1", "--salt", "", "--tokens", TOKENS)
    return path


def flip_newest(path) -> str:
    """Flip a payload byte of the page written last; its hash (hex)."""
    with raw(str(path)) as r:
        metas = [(msgspec.msgpack.decode(v, type=PageMeta).created, bytes(k)) for k, v in r.txn.cursor(db=r.db["meta"])]
        _, newest = max(metas)
        value = bytearray(r.txn.get(newest, db=r.db["pages"]))
        value[-1] ^= 0xFF
        r.txn.put(newest, bytes(value), db=r.db["pages"])
    return newest.hex()


def test_json_says_the_scope_and_since_last_checks_what_changed_after_the_last_clean_audit(store):
    full = json.loads(kvc("audit", "--store", store, "--workers", 2, "--json").stdout)
    assert full["ok"] and full["scope"] == "full" and full["workers"] == 2 and full["recorded"]
    assert full["since"] is None and full["not_checked"] == [] and full["checked"]["pages"] == 100
    kvc("put", "--store", store, "--extra-key", "t2", "--salt", "", "--tokens", "1,2,3,4,5,6,7,8")
    bad = flip_newest(store)
    inc = json.loads(kvc("audit", "--store", store, "--since", "last", "--json", code=1).stdout)
    assert inc["scope"] == "incremental" and inc["since"] is not None and inc["checked"]["pages"] == 2
    assert "counters" in inc["not_checked"] and inc["workers"] >= 1
    assert [(v["kind"], v["page_hash"]) for v in inc["violations"]] == [("checksum_mismatch", bad)]
    # the failed audit did not move the record: the same time, the same finding
    again = json.loads(kvc("audit", "--store", store, "--since", "last", "--workers", 1, "--json", code=1).stdout)
    assert again["since"] == inc["since"] and again["violations"] == inc["violations"]
    table = kvc("audit", "--store", store, "--since", "last", "-o", "table", code=1).stdout
    assert "incremental: the pages written or read back since" in table
    assert "registry counters and store totals against the pages stored" in table  # what it did not check
    assert json.loads(kvc("audit", "--store", store, "--since", "0", "--json", code=1).stdout)["checked"]["pages"] \
        == 102


def test_progress_goes_to_kvc_progress_fd_as_lines_and_never_to_a_pipe(store):
    read, write = os.pipe()
    with os.fdopen(read) as lines:
        try:
            done = kvc("audit", "--store", store, "--workers", 2, "--json", KVC_PROGRESS_FD=str(write))
        finally:
            os.close(write)
        seen = lines.read().splitlines()
    assert json.loads(done.stdout)["ok"] and done.stderr == ""  # no bar: stderr is not a terminal
    assert seen[0] == "audit pages 0/?" and all(line.startswith("audit pages ") for line in seen)
    counts = [int(line.split()[-1].split("/")[0]) for line in seen]
    assert max(counts) <= 100


@pytest.mark.parametrize(("args", "says"), [
    (("--since", "soon"), "kvc: error: --since 'soon': expected 'last', unix seconds or an ISO 8601 time"),
    (("--since", "2026-12-03T20:00:00"), "kvc: error: --since '2026-12-03T20:00:00': give the time zone "
                                         "(2026-12-03T20:00:00+00:00, or ...Z)"),
    (("--since", "last", "--repair"), "kvc: error: --since cannot go with --repair (a repair needs a full audit)"),
    (("--workers", "0"), "kvc: error: Invalid value for '--workers': 0 is not in the range 1<=x<="),
])
def test_bad_scope_is_one_line_and_exit_2(store, args, says):
    done = kvc("audit", "--store", store, *args, code=2)
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(says) and done.stdout == ""


def test_a_read_only_audit_is_not_recorded_and_since_last_then_audits_in_full(store):
    ro = json.loads(kvc("audit", "--store", store, "--read-only", "--json").stdout)
    assert ro["ok"] and not ro["recorded"]
    first = json.loads(kvc("audit", "--store", store, "--since", "last", "--json").stdout)
    assert first["scope"] == "full" and first["checked"]["pages"] == 100 and first["recorded"]

"""`kvc audit --repair` never destroys (issue 25, item 1), through the installed `kvc` as a real subprocess: the
report's reproduction (meta pages zeroed, then audit, then repair) and a data file that is not LMDB.

Each test damages a copy of one healthy store made once, in this process; every command on a damaged data file (or
on what a repair left of it) runs in a process of its own: a SIGBUS on a torn file would take pytest down with it.
A store whose data file is whole (another key in its key file) is answered in this process."""

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from clirun import KVC, in_process


def kvc(*args):
    return subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=300)


KEY = "e7" * 32  # a fixed key: where each record lies in the file, so what a cut keeps, is the same every run


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    """A healthy store of 50 pages (one chain of 200 tokens in pages of 4, unsalted, under KEY), made once in this
    process; each test damages a copy of its own (`_stored`)."""
    path = tmp_path_factory.mktemp("healthy") / "d"
    env = dict(os.environ, KVC_FINGERPRINT_KEY=KEY, KVC_SALT="")
    for argv in (("init", "--store", path, "--page-size", "4"),
                 ("put", "--store", path, "--extra-key", "t1", "--tokens", ",".join(map(str, range(200))))):
        done = in_process(*argv, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    return path


def _stored(healthy: Path, tmp_path: Path) -> Path:
    """A copy of the healthy store, for a test to damage."""
    return Path(shutil.copytree(healthy, tmp_path / "d"))


@pytest.fixture
def store(healthy, tmp_path):
    return _stored(healthy, tmp_path)


def pages(path, *, damaged=True) -> int:
    """The pages `kvc stats` counts in the store at `path`: in a process of its own once the store was `damaged`
    (or repaired), else in this one."""
    done = kvc("stats", "--store", path, "--json") if damaged else in_process("stats", "--store", path, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["pages"]


def test_repair_of_zeroed_meta_pages_keeps_the_pages_and_the_original_file(store):
    before = pages(store, damaged=False)
    assert before == 50
    with open(store / "data.mdb", "r+b") as f:
        f.write(b"\0" * 8192)  # the report's reproduction
    damaged = (store / "data.mdb").read_bytes()
    audit = kvc("audit", "--store", store)
    assert audit.returncode == 1 and "meta pages are unreadable" in audit.stdout, audit.stdout
    repair = kvc("audit", "--store", store, "--repair", "--json")
    assert repair.returncode == 1, repair.stdout + repair.stderr  # violations were found (and repaired)
    report = json.loads(repair.stdout)
    assert report["salvage"]["kept"] == before and report["salvage"]["lost"] == 0
    assert report["salvage"]["pages_before"] == before
    kept = glob.glob(str(store / "data.mdb.orig-*"))
    assert kept == [report["original_kept"]] and Path(kept[0]).read_bytes() == damaged
    assert pages(store) == before
    assert kvc("audit", "--store", store).returncode == 0


def test_a_data_file_that_is_not_lmdb_is_refused_without_force(store):
    junk = os.urandom(100_000)
    (store / "data.mdb").write_bytes(junk)
    audit = kvc("audit", "--store", store)
    assert audit.returncode == 1 and "not an LMDB file" in audit.stdout and "rebuilds" not in audit.stdout
    repair = kvc("audit", "--store", store, "--repair")
    assert repair.returncode == 2, repair.stdout + repair.stderr
    assert repair.stdout == "" and len(repair.stderr.strip().splitlines()) == 1  # one line, nothing half-done
    assert "--force" in repair.stderr
    assert (store / "data.mdb").read_bytes() == junk and not glob.glob(str(store / "data.mdb.orig-*"))
    forced = kvc("audit", "--store", store, "--repair", "--force", "--json")
    assert forced.returncode == 1, forced.stdout + forced.stderr
    report = json.loads(forced.stdout)
    assert Path(report["original_kept"]).read_bytes() == junk and report["salvage"]["kept"] == 0
    assert kvc("audit", "--store", store).returncode == 0 and pages(store) == 0


def test_force_goes_with_repair(store):
    done = in_process("audit", "--store", store, "--force")  # a healthy store: this process
    assert done.returncode == 2 and "--force goes with --repair" in done.stderr


# --- issue 36: a damaged store answered in one line by every command, repairs that know what they lose ----------


def _one_line(done, *words):
    assert done.returncode == 2 and done.returncode > 0, (done.returncode, done.stderr)  # never a signal
    (line,) = [x for x in done.stderr.splitlines() if not x.startswith(("kvc: note:", "kvc: warning:"))]
    assert line.startswith("kvc: error: ") and "internal error" not in line, line
    assert all(w in line for w in words), line


def test_a_data_file_cut_to_half_is_one_line_everywhere_never_a_sigbus(healthy, tmp_path):
    # ebaf189: every command, `kvc audit` included, died of SIGBUS (exit 135 from a shell) and printed nothing
    path = _stored(healthy, tmp_path)
    data = path / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    audit = kvc("audit", "--store", path, "--json")
    assert audit.returncode == 1, (audit.returncode, audit.stderr)
    (finding,) = json.loads(audit.stdout)["violations"]
    assert finding["kind"] == "structure_corrupt" and "data.mdb is cut short" in finding["detail"]
    for argv in (("stats",), ("ns", "ls"), ("put", "--extra-key", "t2", "--tokens", "1,2,3,4"), ("migrate",)):
        _one_line(kvc(*argv, "--store", path), "cut short", "`kvc audit --repair`")
    # what the cut left holds no page whose records survive: the repair says so and changes nothing
    before = data.read_bytes()
    _one_line(kvc("audit", "--store", path, "--repair"), "would keep nothing", "--force")
    assert data.read_bytes() == before
    forced = kvc("audit", "--store", path, "--repair", "--force", "--json")
    assert forced.returncode == 1, forced.stderr
    salvage = json.loads(forced.stdout)["salvage"]
    assert salvage["kept"] == 0 and not (salvage["lost"] == 0 and salvage["lost_exact"])  # never "0 lost"
    assert kvc("audit", "--store", path).returncode == 0 and pages(path) == 0


def test_an_empty_data_file_is_a_finding_and_force_replaces_it(healthy, tmp_path):
    # ebaf189: `not_a_store` (exit 2, no finding), and `--repair --force` refused though the docs say it replaces
    path = _stored(healthy, tmp_path)
    os.truncate(path / "data.mdb", 0)
    audit = kvc("audit", "--store", path, "--json")
    assert audit.returncode == 1, audit.stderr
    (finding,) = json.loads(audit.stdout)["violations"]
    assert "data.mdb is empty" in finding["detail"] and "--force" in finding["detail"]
    _one_line(kvc("stats", "--store", path), "data.mdb is empty")
    _one_line(kvc("audit", "--store", path, "--repair"), "data.mdb is empty", "--force")
    assert (path / "data.mdb").stat().st_size == 0  # nothing wrote into it
    forced = kvc("audit", "--store", path, "--repair", "--force", "--json")
    assert forced.returncode == 1, forced.stderr
    assert Path(json.loads(forced.stdout)["original_kept"]).stat().st_size == 0
    assert kvc("audit", "--store", path).returncode == 0 and pages(path) == 0


def test_another_valid_key_is_named_exits_4_and_the_repair_deletes_nothing(healthy, tmp_path):
    # ebaf189: every namespace's first page an `orphan`, no word of the key, and `--repair` deleted every page.
    # The data file is whole (only the key file differs): every command runs in this process
    path = _stored(healthy, tmp_path)
    (path / "fingerprint.key").write_text("5e" * 32 + "\n")
    audit = in_process("audit", "--store", path, "--json")
    assert audit.returncode == 4, (audit.returncode, audit.stdout)
    (finding,) = json.loads(audit.stdout)["violations"]
    assert finding["kind"] == "key_mismatch"
    assert "this store's key file is not the key its pages were written under" in finding["detail"]
    _one_line(in_process("audit", "--store", path, "--repair"), "not the key its pages were written under",
              "nothing was changed")
    for argv in (("stats",), ("ns", "ls"), ("put", "--extra-key", "t2", "--tokens", "1,2,3,4")):
        _one_line(in_process(*argv, "--store", path), "not the key its pages were written under", "restore")
    (path / "fingerprint.key").write_text(KEY + "\n")  # the right key restored: everything is there
    assert in_process("audit", "--store", path).returncode == 0 and pages(path, damaged=False) == 50

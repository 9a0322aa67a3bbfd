"""`kvc audit --repair` never destroys (issue 25, item 1), through the installed `kvc` as a real subprocess: the
report's reproduction (meta pages zeroed, then audit, then repair) and a data file that is not LMDB."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KVC = Path(sys.executable).with_name("kvc")


def kvc(*args):
    return subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "s"
    for argv in (("init", "--store", path, "--page-size", "4"),
                 ("put", "--store", path, "--extra-key", "t1", "--salt", "", "--tokens", ",".join(map(str, range(200))))):
        done = kvc(*argv)
        assert done.returncode == 0, done.stdout + done.stderr
    return path


def pages(path) -> int:
    done = kvc("stats", "--store", path, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["pages"]


def test_repair_of_zeroed_meta_pages_keeps_the_pages_and_the_original_file(store):
    before = pages(store)
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
    done = kvc("audit", "--store", store, "--force")
    assert done.returncode == 2 and "--force goes with --repair" in done.stderr

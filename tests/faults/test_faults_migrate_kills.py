"""`kvc migrate` killed with SIGKILL part-way (issue 26, item 1): the format-1 store or the migrated one is always
whole, and a later `kvc migrate` finishes the job.

The kill points are events, never times: the migration stops itself (SIGSTOP) at a named step when
KVC_TEST_REPAIR_STOP names it (`rewrite.step`, which the migration shares), optionally once its progress passes a
page count; the test sees the stop through waitpid(WUNTRACED), then kills the process with SIGKILL.
"""

from __future__ import annotations

import os
import shutil

import pytest

import faultkit
from kvcache.storage.codec import FORMAT_VERSION
from kvcache.storage.lmdb.migrate import MIGRATE_BATCH_PAGES, format_version_of
from kvcache.storage.lmdb.rewrite import STOP_ENV
from unit.storage.lmdb.test_migrate import build_format_1, contents

# (step, progress): the first and a later batch of the page copy, the rewritten and verified store, the swap
KILL_POINTS = [("copied_pages", 1), ("copied_pages", 2 * MIGRATE_BATCH_PAGES), ("rewritten", 0), ("verified", 0),
               ("swapped", 0)]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("migrate-kills") / "template")
    build_format_1(path, docs=160)  # 1,282 pages: several copy batches
    return path, contents(path), _data(path)


@pytest.mark.parametrize("step,at", KILL_POINTS, ids=[f"{s}@{a}" for s, a in KILL_POINTS])
def test_a_migration_killed_at_any_step_leaves_the_old_or_the_new_store_whole(
        template, forks, tmp_path, step, at):
    source, held, original = template
    store = str(tmp_path / "s")
    shutil.copytree(source, store)
    faultkit.stop_then_kill(["migrate", "--store", store], STOP_ENV, f"{step}@{at}", str(tmp_path / "migrate.log"),
                            forks)
    # Either the format-1 data file is untouched, byte for byte, or the migrated one is in place, whole.
    if _data(store) == original:
        assert step != "swapped", "killed after the swap, the data file is still the old one"
        assert format_version_of(store) == 1
    else:
        assert step == "swapped", f"the data file changed before the swap (killed at {step}@{at})"
        assert format_version_of(store) == FORMAT_VERSION
    audit = forks.run(["audit", "--store", store])
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert contents(store) == held
    # A later migration finishes (or finds nothing to do), and cleans up what the killed one left.
    again = forks.run(["migrate", "--store", store, "--json"])
    assert again.returncode == 0, again.stdout + again.stderr
    assert format_version_of(store) == FORMAT_VERSION
    after = forks.run(["audit", "--store", store])
    assert after.returncode == 0 and "kvc migrate" not in after.stderr, after.stdout + after.stderr
    assert contents(store) == held
    assert [n for n in os.listdir(store) if n.startswith(".")] == []
    faultkit.record(f"migrate killed at {step}@{at}", 1, 1, len(held) - len(contents(store)))


def _data(path: str) -> bytes:
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        return f.read()

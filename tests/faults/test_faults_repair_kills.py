"""`kvc audit --repair` killed with SIGKILL part-way (issue 25, item 1): the original or the result is always
intact, and a later repair or audit recovers.

The kill points are events, never times: the repair stops itself (SIGSTOP) at a named step when
KVC_TEST_REPAIR_STOP names it (`rewrite.step`), optionally once its progress passes a byte offset; the test sees
the stop through waitpid(WUNTRACED), then kills the process with SIGKILL. The store is one whose LMDB meta pages are
zeroed (the report's case), so every run goes through the whole rebuild: probe, copies, keeping the original,
the swap, the lock file.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest

import faultkit
from kvcache.diagnostics.audit import audit_store
from kvcache.storage.lmdb.rewrite import ORIGINAL_PREFIX, STOP_ENV
from unit.storage.lmdb.test_salvage import build, data_of, stored, zero_meta_pages

# (step, progress): every named step of the rebuild, and the copy of the original at three byte offsets
KILL_POINTS = [("probed", 0), ("copied_layouts", 0), ("copied_pages", 0), ("rebuilt", 0),
               ("keeping_original", 1), ("keeping_original", 512 << 10), ("keeping_original", 1 << 20),
               ("original_kept", 0), ("swapped", 0)]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("repair-kills") / "template")
    written = build(path, docs=40)  # 800 pages of 4 KiB: a data file of a few MB, several copy chunks
    return path, written, zero_meta_pages(path)


@pytest.mark.parametrize("step,at", KILL_POINTS, ids=[f"{s}@{a}" for s, a in KILL_POINTS])
def test_a_repair_killed_at_any_step_leaves_the_original_or_the_result_intact(
        template, forks, tmp_path, step, at):
    source, written, damaged = template
    store = str(tmp_path / "s")
    shutil.copytree(source, store)
    faultkit.stop_then_kill(["audit", "--store", store, "--repair"], STOP_ENV, f"{step}@{at}",
                            str(tmp_path / "repair.log"), forks)
    # Either the damaged original is still the store's data file, byte for byte, or the rebuilt store is, whole.
    if data_of(store) != damaged:
        assert step == "swapped", f"the data file changed before the swap (killed at {step}@{at})"
        assert audit_store(store).ok and stored(store) == written
    # A kept original is always whole: the copy only appears under its name once complete.
    for kept in glob.glob(os.path.join(store, ORIGINAL_PREFIX + "*")):
        assert data_of_file(kept) == damaged
    # A later repair recovers, and cleans up what the killed one left.
    again = forks.run(["audit", "--store", store, "--repair", "--json"])
    assert again.returncode in (0, 1), again.stdout + again.stderr
    after = forks.run(["audit", "--store", store])
    assert after.returncode == 0, after.stdout + after.stderr
    assert stored(store) == written
    assert [n for n in os.listdir(store) if n.startswith(".")] == []
    kept = glob.glob(os.path.join(store, ORIGINAL_PREFIX + "*"))
    assert kept and all(data_of_file(k) == damaged for k in kept)
    faultkit.record(f"repair killed at {step}@{at}", 1, 1, len(written) - len(stored(store)))


def data_of_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()

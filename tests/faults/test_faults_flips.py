"""Seeded byte flips in a real LMDB store (issue 14, item 2): data, leaf, branch and header pages.

Each trial copies a template store, XORs one byte of a live page (found by walking the B-trees, `lmdbpages`):
the payload of a stored page (`data`), a used byte of a leaf or branch page, or a page header. Then:

- every page is read back in a child process (a damaged tree may abort a reader): no byte served may differ
  from what was written (a miss is allowed, a wrong byte never);
- `audit_store` (what `kvc audit` runs; in a process of its own, forked from one that imported kvc once, `forkrun`)
  must finish -- never a signal, never a traceback -- and when the flip is visible (it changed something LMDB or
  kvc reads) report it;
- with findings, `--repair` and a second audit must leave the store clean, and every page still there must read
  back exact. The pages the repair had to drop are the `lost` column.

A flip can be invisible: in a page's unused header bits, in a branch separator that still orders the same, in an
access time. Those trials count as survived (nothing was read wrong) and are counted in the note.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from unittest import mock

import numpy as np
import pytest

import faultkit
import lmdbpages
from kvcache.diagnostics.audit import audit_store
from kvcache.storage.api import page_origins
from kvcache.storage.isolated import run_isolated
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from kvcache.workload.kvdata import SyntheticKV

LAYOUT = KVLayout("flip-model@r1", layers=2, kv_heads=2, head_dim=64, dtype="float16", page_size=4)  # 4 KiB pages
KINDS = ("data", "leaf", "branch", "header")
PER_KIND = 5  # trials of each kind in the CI run


class Template:
    def __init__(self, path: str) -> None:
        self.path = path
        self.kv = SyntheticKV(LAYOUT)
        self.hashes: list[bytes] = []
        # A fixed key: the chain roots (so the page hashes, so where records lie in the file, so which byte each
        # seeded flip hits) are then the same every run.
        with mock.patch.dict(os.environ, {"KVC_FINGERPRINT_KEY": "f1" * 32}), \
                open_store(path, LAYOUT, create=True, durability="none") as store:
            for t in range(2):
                ns = Namespace(f"tenant-{t}", f"salt-{t}")
                for doc in range(12):
                    tokens = [t * 1000 + doc * 10] * 4 + list(range(doc * 100, doc * 100 + 36))
                    hashes, origins = page_origins(LAYOUT, pack_tokens(tokens), ns, store.chain_key)
                    store.put(hashes, list(self.kv.pages(hashes).numpy()), origins)
                    self.hashes += hashes
        self.pages = lmdbpages.live_pages(path)
        with open(os.path.join(path, "data.mdb"), "rb") as f:
            self.page_size = lmdbpages.page_size(f.read(64))

    def target(self, kind: str, rng: random.Random) -> int:
        """A byte offset in data.mdb of a live page of `kind`."""
        if kind == "header":
            page = rng.choice([p for p in self.pages if p.kind in ("leaf", "branch", "data")])
            return page.pgno * self.page_size + rng.randrange(lmdbpages.HEADER)
        page = rng.choice([p for p in self.pages if p.kind == kind])
        start, end = rng.choice([r for r in page.used if r[1] > r[0]])
        return page.pgno * self.page_size + rng.randrange(start, end)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return Template(str(tmp_path_factory.mktemp("flips") / "template"))


def read_back(path: str, template: Template) -> tuple[int, int, bool]:
    """(pages served, pages served wrong, whether the reader died) -- read in a child, one page a call."""
    def reader(_):
        served = wrong = 0
        out = np.zeros((1, LAYOUT.bytes_per_page), np.uint8)
        with open_store(path, readonly=True) as store:
            for h in template.hashes:
                if store.get_into([h], list(out)) == 1:
                    served += 1
                    wrong += not np.array_equal(out[0], template.kv.pages([h]).numpy()[0])
        return [served, wrong]

    result, died = run_isolated(reader, result_type=list[int])
    return (0, 0, True) if died is not None else (result[0], result[1], False)


def flip(template: Template, path: str, kind: str, rng: random.Random) -> None:
    shutil.copytree(template.path, path)
    at = template.target(kind, rng)
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ rng.randrange(1, 256)]))


# One trial's audit, repair and second audit, in a process forked from one without torch (`forks`): the repair
# forks a child per read of a damaged run of pages, and a fork copies the page tables of its parent's whole address
# space. Prints {"found": the audit reported the flip, "after": the findings after the repair (null: none was
# needed), "error": an exception of any of them}.
AUDIT_AND_REPAIR = """
import json, sys
from kvcache.diagnostics.audit import audit_store
path = sys.argv[1]
out = {"found": False, "after": None, "error": None}
try:
    if not audit_store(path).ok:
        out["found"] = True
        audit_store(path, repair=True)
        after = audit_store(path)
        out["after"] = [] if after.ok else [f.kind for f in after.findings] or ["not ok"]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_bytes_are_found_repaired_and_never_served(template, forks, tmp_path, kind):
    trials = faultkit.trials(PER_KIND)
    rng = random.Random(f"flips-{kind}")
    survived = lost = found = reader_died = 0
    problems: list[str] = []
    for trial in range(trials):
        path = str(tmp_path / f"t{trial}")
        flip(template, path, kind, rng)
        served, wrong, died = read_back(path, template)
        reader_died += died
        ok = wrong == 0
        audited = forks.run(["audit", path], script=AUDIT_AND_REPAIR, timeout=600)
        if audited.returncode != 0:  # the audit must finish: a signal or a traceback is a failed trial
            ok = False
            problems.append(f"trial {trial}: the audit's process ended {audited.returncode}: {audited.stderr[-800:]}")
        else:
            doc = json.loads(audited.stdout.splitlines()[-1])
            found += doc["found"]
            if doc["error"] is not None:  # the audit must finish: any exception is a failed trial
                ok = False
                problems.append(f"trial {trial}: {doc['error']}")
            elif doc["after"] is not None:
                ok = ok and doc["after"] == []
                if doc["after"]:
                    problems.append(f"trial {trial}: after repair {doc['after']}")
        served_after, wrong_after, died_after = read_back(path, template)
        ok = ok and wrong_after == 0 and not died_after
        lost += len(template.hashes) - served_after
        survived += ok
        if wrong or wrong_after or died_after:
            problems.append(f"trial {trial}: {wrong}+{wrong_after} pages served wrong, reader died after: "
                            f"{died_after}")
        shutil.rmtree(path)
    faultkit.record(f"byte flip in a {kind} page", trials, survived, lost,
                    f"pages lost to repair over all trials; {found} flips found by the audit, "
                    f"{trials - found} invisible; a reader of the damaged store died in {reader_died}")
    assert not problems, problems


def test_kvc_audit_reports_a_broken_btree_as_json_exit_1_and_repair_cleans_it(template, forks, tmp_path):
    """The CLI on a store whose branch page is damaged: JSON findings and exit 1 (no signal, no traceback),
    then --repair (exit 1: it found violations; none remain) and a clean audit."""
    rng = random.Random("cli-branch")
    for attempt in range(20):  # the first branch flip that the walk trips over
        path = str(tmp_path / f"cli{attempt}")
        flip(template, path, "branch", rng)
        if not audit_store(path).ok:
            break
        shutil.rmtree(path)
    else:
        pytest.fail("no branch flip was visible in 20 tries")
    first = forks.run(["audit", "--store", path, "--json"])  # a process of its own: a damaged tree may kill it
    assert first.returncode == 1, first.stderr
    assert "Traceback" not in first.stderr and first.stderr.count("\n") <= 1
    doc = json.loads(first.stdout)
    assert doc["ok"] is False and doc["violations"]
    repair = forks.run(["audit", "--store", path, "--repair", "--json"])
    assert repair.returncode == 1, repair.stderr  # violations were found (and repaired): a cron job hears of it
    fixed = json.loads(repair.stdout)
    assert fixed["repair"] == "done" and fixed["repaired"] >= 1 and fixed["remaining"] == []
    assert forks.run(["audit", "--store", path]).returncode == 0
    served, wrong, died = read_back(path, template)
    assert wrong == 0 and not died and served + sum(r["what"] == "page" for r in fixed["removals"]) >= served

"""The damage matrix (issue 36, item 1): every region of an LMDB store x every way its key file can differ x every
command that opens a store, each a process of its own on a damaged copy of one template (`matrix`: the regions come
from the template's own page map, the cases from a seed; the processes are forked from conftest's `forks` server,
which imported kvc once: `forkrun`). Every case ends in an exit code and, on a failure, one line naming what is
wrong and what to do -- never a signal, never a traceback; a repair keeps every page that was intact and never says
"0 lost" when a page went.

Size: the CI run (`make test`) is `matrix.cases(..., "ci")`, about 90 cases in 4 shards (xdist runs them side by
side); env KVC_DAMAGE_MATRIX=full, or the fault suite's --long / KVC_FAULTS, runs the whole product (about 1,400
cases). `python tests/faults/matrix.py [--full]` prints the table region x key state x command -> outcome, and env
KVC_DAMAGE_TABLE=FILE makes this test append its rows there (JSON lines).
"""

from __future__ import annotations

import os

import msgspec
import pytest

import faultkit
import matrix

SHARDS = 4
SIZE = "full" if os.environ.get("KVC_DAMAGE_MATRIX") == "full" or faultkit.trials(1) > 1 else "ci"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return matrix.Template(str(tmp_path_factory.mktemp("matrix") / "template"))


def test_the_template_has_every_kind_of_region(template):
    """The page map gives what the matrix promises: each meta page, branch and leaf pages of the large trees,
    overflow pages, the small trees' leaves, the catalogue and the free list, the cuts, an empty and a random file."""
    names = {r.name for r in template.regions()}
    for db in ("pages", "meta", "children"):
        assert {f"{db} branch", f"{db} leaf"} <= names
    assert {"meta page 0", "meta page 1", "pages overflow", "namespaces leaf", "layouts leaf", "store leaf",
            "catalogue leaf", "free list leaf", "0-byte file", "random bytes"} <= names
    assert sum(r.kind == "cut" for r in template.regions()) == 4


@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_damaged_store_is_answered_in_one_line(template, forks, tmp_path, shard):
    cases = matrix.cases(template, SIZE)[shard::SHARDS]
    outcomes = [matrix.run_case(template, region, key, command, str(tmp_path), forks)
                for region, key, command in cases]
    table = os.environ.get("KVC_DAMAGE_TABLE")
    if table:
        with open(table, "ab") as f:
            f.writelines(msgspec.json.encode(o) + b"\n" for o in outcomes)
    broken = [o for o in outcomes if o.problems]
    signals = sum(o.code < 0 for o in outcomes)
    lost = sum(int(p.split()[0]) for o in outcomes for p in o.problems if "intact page(s) lost" in p)
    faultkit.record(f"damage matrix ({SIZE}) shard {shard}", len(outcomes), len(outcomes) - len(broken), lost,
                    f"{signals} signals; {sum(o.command in ('repair', 'repair_force') for o in outcomes)} repairs")
    assert not broken, "\n".join(f"{o.region} / {o.key} / {o.command}: {o.cell()} {o.line[:200]} {o.problems}"
                                 for o in broken)

"""`kvc put` exits 1 when the store took none of the pages it was given (issue 25, item 5): on f3c3857 a put whose
every page was refused (a store share of 1 byte, a store at its capacity) printed "0 written ... N rejected" and
exited 0, so a script went on as if the pages were there."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvc.main import app

TOKENS = ",".join(str(t) for t in range(1, 41))  # 10 pages of 4 tokens
runner = CliRunner()


def invoke(*args, **env):
    return runner.invoke(app, [str(a) for a in args], env=env or None)


def _init(path, *extra):
    assert invoke("init", "--store", path, "--page-size", 4, "--layers", 1, "--kv-heads", 1, "--head-dim", 16,
                  *extra).exit_code == 0


def test_a_put_the_store_refuses_whole_exits_1_with_one_line_and_its_counts(tmp_path):
    path = tmp_path / "store"
    _init(path)
    assert invoke("ns", "quota", "set", "--store", path, "--extra-key", "t1", "--store-bytes", 1).exit_code == 0
    result = invoke("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS, "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)  # the same struct as ever: the counts say what happened
    assert doc["pages"] == 10 and doc["written"] == 0 and doc["existing"] == 0 and doc["rejected"] == 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvc: error: the store took none of the 10 pages")
    plain = invoke("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS)
    assert plain.exit_code == 1 and "0 written" in plain.stdout


def test_a_put_that_stores_pages_or_finds_them_stored_exits_0(tmp_path):
    path = tmp_path / "store"
    _init(path)
    first = invoke("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS, "--json")
    assert first.exit_code == 0 and json.loads(first.stdout)["written"] == 10
    again = invoke("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["existing"] == 10  # already there: stored
    # a share that takes part of the chain: some stored, the tail refused -> not "nothing stored"
    assert invoke("ns", "quota", "set", "--store", path, "--extra-key", "t2", "--store-bytes",
                  3 * 4 * 16 * 2 * 2).exit_code == 0
    part = invoke("put", "--store", path, "--extra-key", "t2", "--tokens", TOKENS, "--json")
    doc = json.loads(part.stdout)
    assert part.exit_code == 0 and 0 < doc["written"] < 10 and doc["rejected"] == 10 - doc["written"]

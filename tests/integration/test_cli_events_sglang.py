"""`kvc events --engine sglang`: an SGLang engine's own KV-event feed, published again from the messages SGLang
0.5.23's publisher sent (tests/goldens/sglang/sglang_events.json) on real ZeroMQ sockets, read by `kvc events` in a
process of its own. The salts SGLang sends in clear never reach stdout or stderr: a keyed fingerprint stands in."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import clirun
from kvcache.types.namespace import Namespace
from sglang_feed import MESSAGES, SALTS, GoldenFeed

KVC = str(clirun.KVC)


def _follow(feed: GoldenFeed, *args: str, live: tuple[int, ...] = tuple(range(len(MESSAGES))),
            env: dict[str, str] | None = None):
    """Run `kvc events --engine sglang --follow` on `feed`, publish the messages `live` once it subscribed, and
    return (stdout, stderr); the salts are in neither."""
    environ = {k: v for k, v in os.environ.items() if k != "KVC_FINGERPRINT_KEY"}
    proc = subprocess.Popen([KVC, "events", "--engine", "sglang", "--endpoint", feed.endpoint, "--follow",
                             "--idle-timeout", "60", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**environ, **(env or {})})
    with proc:
        feed.wait_for_subscriber(reader=proc)
        feed.publish(*live)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert all(s not in out + err for s in SALTS)
    return out, err


def test_the_table_shows_blocks_per_medium_and_fingerprints_never_salts():
    with GoldenFeed() as feed:
        out, err = _follow(feed, "--count", str(len(MESSAGES)))
    rows = out.splitlines()
    assert rows[0].split() == ["seq", "time", "event", "medium", "salt", "pages", "held", "first", "block", "parent"]
    assert len(rows) == 1 + len(MESSAGES) and err == ""
    assert "AllBlocksCleared" in rows[1]
    stored = [r.split() for r in rows if "BlockStored" in r]
    # seq, hh:mm:ss.mmm, event, medium, (tier), salt fingerprint, pages, held after, first block, parent
    assert [(r[3], r[4], r[6], r[7]) for r in stored] == [("GPU", "(L1)", "3", "3"), ("GPU", "(L1)", "1", "4"),
                                                          ("GPU", "(L1)", "2", "6"), ("GPU", "(L1)", "4", "10"),
                                                          ("CPU_PINNED", "(L2)", "2", "2")]
    fingerprints = [r[5] for r in stored]
    assert fingerprints[0] == fingerprints[1] == fingerprints[4] != fingerprints[2] and fingerprints[3] == "-"
    removed = next(r.split() for r in rows if "BlockRemoved" in r)
    assert removed[3:7] == ["GPU", "(L1)", "10", "0"]  # every GPU block evicted; the host copies stay


def test_json_prints_kvcs_records_and_the_held_blocks_per_medium(tmp_path):
    from typer.testing import CliRunner

    from kvc.main import app
    from kvcache.storage.keyfile import read_key

    store = tmp_path / "store"
    assert CliRunner().invoke(app, ["init", "--store", str(store), "--page-size", "4"]).exit_code == 0
    with GoldenFeed() as feed:
        out, err = _follow(feed, "--count", str(len(MESSAGES)), "--json", "--store", str(store))
    lines = [json.loads(x) for x in out.splitlines()]
    assert err == "" and len(lines) == len(MESSAGES) + 1
    key = read_key(str(store))
    stored = [x for x in lines if x["type"] == "BlockStored"]
    assert stored[0]["salt_fingerprint"] == Namespace(None, "golden-salt-A7q").fingerprint(key)  # `kvc ns ls`'s
    assert stored[0]["medium"] == "GPU" and stored[0]["tier"] == "L1" and len(stored[0]["block_hashes"][0]) == 16
    assert "cache_salt" not in out
    assert lines[-1] == {"type": "Summary", "batches": 7, "events": 7, "replayed": 0, "missed": 0, "malformed": 0,
                         "restarts": 0, "jumps": 0, "replays_cut_short": 0, "blocks": {"CPU_PINNED": 2}}


def test_without_a_store_the_key_is_the_deployments_or_one_drawn_per_run():
    key = "ab" * 32
    fingerprints = []
    for env in ({"KVC_FINGERPRINT_KEY": key}, None, None):
        with GoldenFeed() as feed:
            out, _ = _follow(feed, "--count", "2", "--json", env=env)
        fingerprints.append(json.loads(out.splitlines()[1])["salt_fingerprint"])
    assert fingerprints[0] == Namespace(None, "golden-salt-A7q").fingerprint(bytes.fromhex(key))
    assert len(set(fingerprints)) == 3  # each run without a key draws its own


def test_a_gap_is_filled_from_the_engines_replay_socket():
    with GoldenFeed() as feed:
        out, err = _follow(feed, "--replay", feed.replay_endpoint, "--json", "--count", "7", live=(0, 6))
    lines = [json.loads(x) for x in out.splitlines()]
    assert [(x["seq"], x.get("replayed", False)) for x in lines[:-1]] == \
        [(0, False), (1, True), (2, True), (3, True), (4, True), (5, True), (6, False)]
    assert lines[-1]["replayed"] == 5 and lines[-1]["missed"] == 0 and feed.replay_requests == [1]


@pytest.mark.parametrize("args, says", [
    (["--engine", "trtllm", "--endpoint", "tcp://127.0.0.1:1", "--follow"], "'trtllm'"),
    (["--store", "/nonexistent", "--endpoint", "tcp://127.0.0.1:1", "--follow"], "--engine sglang"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    from typer.testing import CliRunner

    from kvc.main import app

    result = CliRunner().invoke(app, ["events", *args])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr

"""`kvc events --engine vllm`: a vLLM engine's own KV-event feed, published again from the messages vLLM 0.34.0's
publisher sent (tests/goldens/vllm/vllm_events.json) on real ZeroMQ sockets, read by `kvc events` in a process of
its own. The salts vLLM sends in clear among the blocks' extra keys never reach stdout or stderr: a keyed
fingerprint stands in."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import msgspec
import pytest

import clirun
from kvcache.types.namespace import Namespace
from sglang_feed import GoldenFeed

KVC = str(clirun.KVC)
GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "goldens" / "vllm" / "vllm_events.json").read_text())
MESSAGES: list[list[bytes]] = [[bytes.fromhex(f) for f in m] for m in GOLDEN["messages"]]  # [topic, seq, payload]
BYTES_MESSAGES: list[list[bytes]] = [[bytes.fromhex(f) for f in m] for m in GOLDEN["bytes_messages"]]
REPLAY_END: list[bytes] = [bytes.fromhex(f) for f in GOLDEN["replay_end"]]  # [b"", b"", -1, b""]
SALTS = sorted({r["cache_salt"] for r in GOLDEN["requests"] if r["cache_salt"]})
DIGESTS = {r["rid"]: r["block_hashes"] for r in GOLDEN["requests"]}  # vLLM's sha256 block hashes, hex


class VLLMFeed(GoldenFeed):
    """vLLM's golden messages behind a PUB (XPUB) and a replay (ROUTER) socket on loopback: tests/sglang_feed.py's
    feed, whose replay socket answers as vLLM's `ZmqEventPublisher._service_replay` does (SGLang's copy of it):
    ``[b"", topic, seq, payload]`` per buffered batch from the asked sequence number, then vLLM's end frames."""

    def __init__(self, messages: list[list[bytes]] = MESSAGES) -> None:
        self.messages = messages  # before the base starts the replay thread
        super().__init__()

    def publish(self, *seqs: int) -> None:
        """Send the golden messages with these sequence numbers, as vLLM's PUB socket sent them."""
        for seq in seqs:
            self.pub.send_multipart(self.messages[seq])

    def _serve_replay(self) -> None:
        """vLLM's `_service_replay`: every buffered batch from the asked sequence number on, then the end."""
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            peer, empty, start = self._router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            for topic, seq, payload in self.messages:
                if int.from_bytes(seq, "big") >= int.from_bytes(start, "big"):
                    self._router.send_multipart([peer, empty, topic, seq, payload])
            self._router.send_multipart([peer, *REPLAY_END])


def _follow(feed: VLLMFeed, *args: str, live: tuple[int, ...] | None = None, extra: tuple[list[bytes], ...] = (),
            env: dict[str, str] | None = None):
    """Run `kvc events --engine vllm --follow` on `feed`, publish the messages `live` (all by default) and then
    `extra` ones once it subscribed, and return (stdout, stderr); the salts are in neither."""
    environ = {k: v for k, v in os.environ.items() if k != "KVC_FINGERPRINT_KEY"}
    proc = subprocess.Popen([KVC, "events", "--engine", "vllm", "--endpoint", feed.endpoint, "--follow",
                             "--idle-timeout", "60", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**environ, **(env or {})})
    with proc:
        feed.wait_for_subscriber(reader=proc)
        feed.publish(*(range(len(feed.messages)) if live is None else live))
        for frames in extra:
            feed.pub.send_multipart(frames)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert all(s not in out + err for s in SALTS)
    return out, err


def test_the_table_shows_blocks_per_medium_owner_and_group_and_fingerprints_never_salts():
    with VLLMFeed() as feed:
        out, err = _follow(feed, "--count", str(len(MESSAGES)))
    rows = out.splitlines()
    assert rows[0].split() == ["seq", "time", "event", "medium", "owner", "locality", "group", "salt", "blocks",
                               "held", "first", "block", "parent"]
    assert len(rows) == 1 + 24 and err == ""  # 24 events in 9 batches
    assert "AllBlocksCleared" in rows[1] and "AllBlocksCleared" in rows[-1]
    stored = [r.split() for r in rows if "BlockStored" in r]
    # seq, hh:mm:ss.mmm, event, medium, (tier), owner, locality, group, salt fingerprint, blocks, held after,
    # first block, parent
    assert [(r[0], *r[3:8], *r[9:11]) for r in stored] == [
        ("1", "GPU", "(L1)", "-", "-", "0", "3", "3"),  # a
        ("2", "CPU", "(L2)", "-", "-", "0", "2", "2"),  # a's first chunk offloaded to the CPU tier,
        ("2", "STORAGE", "(L3)", "kvcr", "-", "0", "2", "2"),  # on to KVCR's storage: held apart from
        ("2", "STORAGE", "(L3)", "-", "LOCAL", "0", "2", "2"),  # the primary storage tier's
        ("3", "GPU", "(L1)", "-", "-", "0", "2", "3"),  # b's reused blocks, reported again: held already
        ("3", "GPU", "(L1)", "-", "-", "0", "1", "4"),
        ("4", "GPU", "(L1)", "-", "-", "0", "3", "7"),
        ("5", "GPU", "(L1)", "-", "-", "0", "2", "9"),
        ("6", "GPU", "(L1)", "-", "-", "0", "2", "10"),  # after one eviction
        ("7", "GPU", "(L1)", "-", "-", "0", "10", "10"),  # after the other nine
    ]
    fingerprints = [r[8] for r in stored]
    assert fingerprints[0] == fingerprints[4] != fingerprints[6] and len(fingerprints[0]) == 12
    assert {fingerprints[i] for i in (1, 2, 3, 5, 7, 8, 9)} == {"-"}
    assert [r[11] for r in stored[:2]] == [DIGESTS["a"][0][-16:]] * 2 and stored[0][12] == "-"
    assert stored[5][11:] == [DIGESTS["b"][2][-16:], DIGESTS["a"][1][-16:]]  # b's new block, after a's second
    removed = [r.split() for r in rows if "BlockRemoved" in r]
    # f's eviction, then e's of the other ten: one event per block, as vLLM sends them
    assert [r[3:9] for r in removed[:-1]] == [["GPU", "(L1)", "-", "-", "0", "1"]] * 11
    assert [r[9] for r in removed[:-1]] == ["8", "9", "8", "7", "6", "5", "4", "3", "2", "1", "0"]
    assert removed[-1][3:10] == ["STORAGE", "(L3)", "kvcr", "-", "0", "2", "0"]  # the primary's copy stays


def test_a_bytes_hash_engine_prints_the_lines_an_int_hash_one_does():
    """vLLM's int block hash is its digest's last 8 bytes: a line shows a bytes hash's last 16 hex digits, so the
    two configurations of one engine read alike (under one fingerprint key)."""
    key = {"KVC_FINGERPRINT_KEY": "cd" * 32}
    tables = []
    for messages in (MESSAGES, BYTES_MESSAGES):
        with VLLMFeed(messages) as feed:
            out, _ = _follow(feed, "--count", str(len(messages)), env=key)
        tables.append([row[:6] + row[20:] for row in out.splitlines()])  # all but the time
    assert tables[0] == tables[1] and len(tables[0]) == 25


def test_json_prints_kvcs_records_and_the_held_blocks_per_residency(tmp_path):
    from typer.testing import CliRunner

    from kvc.main import app
    from kvcache.storage.keyfile import read_key

    store = tmp_path / "store"
    assert CliRunner().invoke(app, ["init", "--store", str(store), "--page-size", "4"]).exit_code == 0
    with VLLMFeed() as feed:
        out, err = _follow(feed, "--count", "8", "--json", "--store", str(store), live=tuple(range(8)))
    lines = [json.loads(x) for x in out.splitlines()]
    assert err == "" and len(lines) == 23 + 1
    key = read_key(str(store))
    salted = Namespace(None, "golden-salt-A7q").fingerprint(key)  # what `kvc ns ls` shows for that salt
    first = lines[1]
    assert first == {"seq": 1, "ts": first["ts"], "type": "BlockStored", "medium": "GPU", "tier": "L1", "group_idx": 0,
                     "block_hashes": [h[-16:] for h in DIGESTS["a"]], "token_ids": list(range(100, 112)),
                     "block_size": 4, "salt_fingerprint": salted, "extra_keys": [[f"salt:{salted}"], None, None],
                     "kv_cache_spec_kind": "full_attention", "data_parallel_rank": 0}
    lora = next(x for x in lines if x.get("lora_name"))
    assert lora["salt_fingerprint"] == Namespace(None, "golden-salt-B3x").fingerprint(key)
    assert lora["extra_keys"][0] == ["lora", f"salt:{lora['salt_fingerprint']}"] and lora["session_id"] == "sess-42"
    kvcr = [x for x in lines if x.get("ownership") == "kvcr"]
    assert [(x["type"], x["medium"], x["tier"]) for x in kvcr] == [("BlockStored", "STORAGE", "L3"),
                                                                  ("BlockRemoved", "STORAGE", "L3")]
    assert next(x for x in lines if x.get("locality"))["locality"] == "LOCAL"
    assert "cache_salt" not in out
    assert lines[-1] == {"type": "Summary", "batches": 8, "events": 23, "replayed": 0, "missed": 0, "malformed": 0,
                         "restarts": 0, "jumps": 0, "replays_cut_short": 0, "blocks": {"CPU": 2, "GPU": 10, "STORAGE": 2}}


def test_without_a_store_the_key_is_the_deployments_or_one_drawn_per_run():
    key = "ab" * 32
    fingerprints = []
    for env in ({"KVC_FINGERPRINT_KEY": key}, None, None):
        with VLLMFeed() as feed:
            out, _ = _follow(feed, "--count", "2", "--json", live=(0, 1), env=env)
        fingerprints.append(json.loads(out.splitlines()[1])["salt_fingerprint"])
    assert fingerprints[0] == Namespace(None, "golden-salt-A7q").fingerprint(bytes.fromhex(key))
    assert len(set(fingerprints)) == 3  # each run without a key draws its own


def test_a_gap_is_filled_from_the_engines_replay_socket():
    last = len(MESSAGES) - 1
    with VLLMFeed() as feed:
        out, err = _follow(feed, "--replay", feed.replay_endpoint, "--json", "--count", str(len(MESSAGES)),
                           live=(0, last))
    lines = [json.loads(x) for x in out.splitlines()]
    batches = sorted({(x["seq"], x.get("replayed", False)) for x in lines[:-1]})
    assert batches == [(0, False)] + [(seq, True) for seq in range(1, last)] + [(last, False)]
    assert lines[-1]["replayed"] == last - 1 and lines[-1]["missed"] == 0 and feed.replay_requests == [1]
    assert err == ""


def test_without_follow_it_prints_the_engines_replay_buffer():
    with VLLMFeed() as feed:
        proc = subprocess.run([KVC, "events", "--engine", "vllm", "--endpoint", feed.endpoint, "--replay",
                               feed.replay_endpoint, "--from", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    rows = proc.stdout.splitlines()
    assert rows[0].split()[:4] == ["seq", "time", "event", "medium"] and feed.replay_requests == [3]
    assert [r.split()[0] for r in rows[1:]] == ["3", "3", "4", "5", "6", "6"] + ["7"] * 12 + ["8"]
    assert all(r.split()[2:4] in (["BlockStored", "*"], ["BlockRemoved", "*"], ["AllBlocksCleared", "*"])
               for r in rows[1:])
    assert all(s not in proc.stdout for s in SALTS)


def test_a_malformed_message_with_a_salt_in_it_is_skipped_and_the_salt_not_said():
    bad = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": "four",
                                         "extra_keys": [["golden-salt-A7q"]]}], 0])
    with VLLMFeed() as feed:
        out, err = _follow(feed, "--json", "--count", "2", live=(1,),
                           extra=([GOLDEN["topic"].encode(), (2).to_bytes(8, "big"), bad], MESSAGES[3]))
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["seq"] for x in lines[:-1]] == [1, 3, 3] and lines[-1]["malformed"] == 1
    assert "skipped batch 2" in err and "block_size" in err


@pytest.mark.parametrize("args, says", [
    (["--engine", "kvc", "--store", "/nonexistent", "--endpoint", "tcp://127.0.0.1:1", "--follow"],
     "--engine vllm"),
    (["--engine", "vllm", "--follow"], "needs --endpoint"),
    (["--engine", "vllm", "--endpoint", "tcp://127.0.0.1:1"], "give --replay"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    from typer.testing import CliRunner

    from kvc.main import app

    result = CliRunner().invoke(app, ["events", *args])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr

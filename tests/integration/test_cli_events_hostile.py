"""`kvc events` against publishers that break the rules (issue 36 #4): one restarted on its endpoint, one whose
numbering jumps, batches with impossible fields, a replay socket that floods. Every publisher here is real ZeroMQ
on loopback (`tests/feed_peer.py`); `kvc events` runs in a process of its own where its output is read as it comes,
in this one (CliRunner) where only its end matters."""

from __future__ import annotations

import json
import subprocess
import threading

import msgspec
import pytest

import clirun
from feed_peer import ReplayPeer, seq_frame
from kvc.commands.events import FEEDS as CLI_FEEDS
from kvcache.live.subscriber import REPLAY_CHUNK_BATCHES
from kvcache.types.events import BlockStored, EventBatch, encode_batch

KVC = str(clirun.KVC)


def _stored(tokens: int = 4, ts: float = 1_700_000_000.0) -> bytes:
    """A kvc batch of one BlockStored of `tokens` tokens (one page)."""
    return encode_batch(EventBatch(ts, [BlockStored([bytes([tokens % 256]) * 16], None, list(range(tokens)), tokens,
                                                    None, "host", None)], 0))


def _cleared(ts: object) -> bytes:
    """A batch of one AllBlocksCleared, as kvc, SGLang and vLLM all frame it: [ts, [{"type": ...}], rank] — with a
    `ts` of the test's choosing, NaN and inf included (msgpack carries them)."""
    return msgspec.msgpack.encode([ts, [{"type": "AllBlocksCleared"}], 0])


class Lines:
    """A process's stdout read line by line on a thread of its own; `wait_for(n)` blocks until n lines came."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.done = True
            self._cond.notify_all()

    done = False

    def wait_for(self, n: int, timeout: float = 60) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.lines) >= n or self.done, timeout=timeout), \
                f"{len(self.lines)} lines, not {n}"
            assert len(self.lines) >= n, f"the process ended after {len(self.lines)} lines, not {n}: {self.lines}"

    def count(self) -> int:
        with self._cond:
            return len(self.lines)

    def join(self) -> list[str]:
        self._thread.join(timeout=120)
        return self.lines


@pytest.mark.parametrize("json_out", [True, False])
def test_follow_goes_on_across_a_jump_and_a_restart_saying_each_in_one_line(json_out):
    """Issue 36 #4: `kvc events --follow` went blind, silently, once the publisher restarted on its endpoint
    (numbering from 0 again): every later batch below the highest seq seen was dropped, no line, no count. Now a
    jump of the numbering and a restart are each one line on stderr and a count in the summary, and the feed is
    followed on: the new run's batches are printed, and the blocks held are counted afresh."""
    far = 10**12
    with ReplayPeer() as feed:
        proc = subprocess.Popen([KVC, "events", "--endpoint", feed.endpoint, "--follow", "--count", "7",
                                 "--idle-timeout", "60", *(["--json"] if json_out else [])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with proc:
            out = Lines(proc)
            feed.subscribed()
            for seq, tokens in ((0, 4), (1, 8), (2, 12), (far, 16), (far + 1, 20)):
                feed.publish(seq, _stored(tokens))
            out.wait_for(5 + (not json_out))  # all of the first run printed (and the header)
            feed.restart_feed()  # the publisher restarted on its endpoint: kvc events reconnects by itself
            feed.subscribed()
            for seq, tokens in ((0, 24), (1, 28)):
                feed.publish(seq, _stored(tokens))
            err = proc.stderr.read()
            assert proc.wait(timeout=60) == 0, err
        lines = out.join()
    said = err.splitlines()
    assert said[0] == (f"kvc events: the feed jumped from batch 2 to batch {far} (more than 10,000,000 ahead, past "
                       "any replay buffer: its numbering jumped; not counted missed): following it from there")
    assert said[1] == (f"kvc events: the feed started again at batch 0 after batch {far + 1} (its publisher "
                       "restarted, or its numbering went back): following it from there, blocks held counted afresh")
    assert len(said) == 2  # nothing missed, nothing malformed
    if json_out:
        events = [json.loads(x) for x in lines]
        assert [e["seq"] for e in events[:-1]] == [0, 1, 2, far, far + 1, 0, 1]
        assert events[-1] == {"type": "Summary", "batches": 7, "events": 7, "replayed": 0, "missed": 0,
                              "malformed": 0, "restarts": 1, "jumps": 1, "replays_cut_short": 0,
                              "blocks": {"host": 2}}  # the new run's two pages: the old run's were forgotten
    else:
        rows = [r.split() for r in lines[1:]]
        assert [r[0] for r in rows] == ["0", "1", "2", str(far), str(far + 1), "0", "1"]
        assert [r[-3] for r in rows] == ["1", "2", "3", "4", "5", "1", "2"]  # held: afresh after the restart


FEEDS = [engine.value for engine in CLI_FEEDS]  # every feed `kvc events` reads: a new one is covered by its row
IMPOSSIBLE_TS = [float("nan"), float("inf"), 1e300]


def _run(feed: ReplayPeer, engine: str, follow: bool, json_out: bool):
    """`kvc events --engine ENGINE` on `feed`, in this process: with --follow while a thread publishes three
    batches of impossible ts and a good one once it subscribed, else reading the replay buffer."""
    from typer.testing import CliRunner

    from kvc.main import app

    args = ["events", "--engine", engine, "--endpoint", feed.endpoint, *(["--json"] if json_out else [])]
    publisher = None
    if follow:
        def publish() -> None:
            feed.subscribed()
            for seq, ts in enumerate([*IMPOSSIBLE_TS, 1_700_000_000.5]):
                feed.publish(seq, _cleared(ts))

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        args += ["--follow", "--count", "1", "--idle-timeout", "60"]
    else:
        args += ["--replay", feed.replay_endpoint]
    result = CliRunner().invoke(app, args)
    if publisher is not None:
        publisher.join(timeout=60)
    return result


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "text"])
@pytest.mark.parametrize("follow", [True, False], ids=["follow", "replay"])
@pytest.mark.parametrize("engine", FEEDS)
def test_an_impossible_ts_is_skipped_and_counted_in_every_output_mode(engine, follow, json_out):
    """Issue 36 #4: a batch whose ts is NaN, inf or 1e300 ended `kvc events --follow` (text) with "internal
    error: ValueError", and --json printed it (NaN as null). Now every feed's decoder refuses it: skipped, said on
    stderr and counted, in every output mode — the good batch after it is printed."""
    batches = [(seq_frame(seq), _cleared(ts)) for seq, ts in enumerate([*IMPOSSIBLE_TS, 1_700_000_000.5])]
    with ReplayPeer(lambda n, start: batches[start:]) as feed:
        result = _run(feed, engine, follow, json_out)
    assert result.exit_code == 0, result.stderr
    said = result.stderr.splitlines()
    how = "" if follow else " (from the replay socket)"
    for i, line in enumerate(said[:3]):  # the field refused is the batch's first: its ts
        assert line.startswith(f"kvc events: skipped batch {i}{how}: a payload of ") and "at `$[0]`" in line, line
    assert said[3:] == ["kvc events: 3 malformed messages skipped (not KV-event batches)"]
    out = result.stdout.splitlines()
    if json_out:
        first, summary = json.loads(out[0]), json.loads(out[-1])
        assert (first["seq"], first["ts"], first["type"], len(out)) == (3, 1_700_000_000.5, "AllBlocksCleared", 2)
        assert (summary["batches"], summary["malformed"], summary["missed"]) == (1, 3, 0)
    else:
        assert out[0].split()[:2] == ["seq", "time"] and len(out) == 2
        assert out[1].split()[0] == "3" and "AllBlocksCleared" in out[1]


def test_a_replay_is_printed_as_it_comes_and_never_gathered_whole():
    """Issue 36 #4: `kvc events --replay` kept everything a replay socket sent until the answer ended before it
    printed a line (308 MiB held for 431 MiB sent). Now it prints a bounded chunk at a time. The replay socket
    here sends no batch more than two chunks ahead of the lines kvc has printed — so a reader that gathered the
    answer would wait for ever (and print only the first two chunks once its replay timeout ends it) — and the
    whole answer, 3,000 batches of ~3 KB, far more than a chunk, is printed."""
    total, ahead = 3_000, 2 * REPLAY_CHUNK_BATCHES
    payloads = [_stored(1_000) for _ in range(total)]
    out: list[Lines] = []
    started = threading.Event()

    def gated(n, start):
        assert started.wait(60)
        for i in range(start, total):
            while i - out[0].count() > ahead:  # each line printed is one batch: wait for kvc to print
                out[0].wait_for(i - ahead)
            yield seq_frame(i), payloads[i]

    with ReplayPeer(gated) as feed:
        proc = subprocess.Popen([KVC, "events", "--endpoint", feed.endpoint, "--replay", feed.replay_endpoint,
                                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with proc:
            out.append(Lines(proc))
            started.set()
            err = proc.stderr.read()
            assert proc.wait(timeout=120) == 0, err
        lines = out[0].join()
    assert err == ""
    assert len(lines) == total + 1, f"{len(lines) - 1} batches printed of {total}"
    assert [json.loads(x)["seq"] for x in lines[:-1]] == list(range(total))
    summary = json.loads(lines[-1])
    assert (summary["batches"], summary["replayed"], summary["replays_cut_short"]) == (total, total, 0)


def test_a_replay_answer_that_stops_short_is_said_and_counted():
    """A replay socket that sends something no publisher sends mid-answer (here a 2-frame message) ends the answer
    there: what came before is printed, the answer is counted cut short, on stderr and in the summary."""
    from typer.testing import CliRunner

    from kvc.main import app

    with ReplayPeer(lambda n, start: [(seq_frame(0), _stored()), (b"not a sequence",)]) as feed:
        result = CliRunner().invoke(app, ["events", "--endpoint", feed.endpoint, "--replay", feed.replay_endpoint,
                                          "--json"])
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert [x.get("seq") for x in lines[:-1]] == [0]
    assert lines[-1]["replays_cut_short"] == 1 and lines[-1]["batches"] == 1
    assert result.stderr.splitlines() == ["kvc events: 1 replay answers cut short (silent for 5 s, a message over "
                                          "16 MiB, or more batches than any buffer holds)"]

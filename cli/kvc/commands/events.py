"""`kvc events`: read a live cache's KV-event feed (`kvc serve --events`), or an SGLang or vLLM engine's own
(`--engine sglang` / `--engine vllm`: its `--kv-events-config` publisher), as a router would.

With --follow it subscribes to the feed and prints each event as it comes — one line per event, or one JSON
object per line with --json — until Ctrl-C, --count batches or --idle-timeout seconds without one. A gap in the
sequence numbers (the subscriber fell behind, or joined late with --from) is filled from the publisher's replay
socket when --replay names it; events fetched that way are marked. Without --follow it prints what the replay
buffer holds from --from on, and exits. kvc's feed carries salt fingerprints, never salts. SGLang's sends each
request's cache_salt in clear, and vLLM's among each block's extra keys: it is fingerprinted as it is read
(`kvcache.engines.sglang_events`, `kvcache.engines.vllm_events`), under the fingerprint key of --store when one is
given (then it is what `kvc ns ls` shows for that salt), else the deployment's key in env KVC_FINGERPRINT_KEY when
set, else a key drawn at random for this run (fingerprints then compare within the run only), and never printed.

Each line says how many blocks the event's medium holds after it, as the events read so far tell (from the last
AllBlocksCleared, or from the start of the reading: a late reader counts only what it saw); --json gives the same
per medium in the summary (`blocks`). vLLM's offloading tiers hold blocks per medium and owner (its secondary
tier: ``STORAGE/kvcr``), and a block per KV-cache group, as vLLM counts them.

A message that is not a KV-event batch never ends the reading (a router's feed must survive one bad message): it is
skipped, said in one line on stderr (the first MALFORMED_SHOWN of them, then one line at each power of ten), and
counted in the summary at the end — on stderr, and with --json as the last object on stdout (`EventsSummary`). A
batch with an impossible field (a `ts` that is not a finite unix time of this era, a negative or absurd page size,
token id or rank) is such a message: its feed's decoder refuses it, in every output mode.

Nor can a publisher blind or flood the reader. One whose numbering goes back (an engine or `kvc serve` restarted on
the endpoint) or leaps forward past any replay buffer is followed from its new number on, said in one line on
stderr (rate-limited alike) and counted (`restarts`, `jumps`); after a restart the blocks held are counted afresh.
A replay answer is printed as it arrives, a bounded chunk at a time (`kvcache.live.subscriber.REPLAY_CHUNK_BATCHES`,
`REPLAY_CHUNK_BYTES`), never gathered whole; one that stops short of its end marker (silent for the replay timeout,
a message over `REPLAY_MESSAGE_MAX_BYTES`, more than `REPLAY_MAX_BATCHES`) is counted (`replays_cut_short`).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import typer
import zmq

from kvcache.engines import sglang_events, vllm_events
from kvcache.errors import EventEndpointError
from kvcache.live.event_records import EventRecord, records
from kvcache.live.holdings import Holdings
from kvcache.live.subscriber import (
    REPLAY_MESSAGE_MAX_BYTES,
    Discontinuity,
    FeedSubscriber,
    MalformedMessage,
    ReceivedBatch,
)
from kvcache.storage.location import StoreLocation
from kvcache.types.events import decode_batch
from kvcache.types.fingerprint_key import FINGERPRINT_KEY_BYTES, env_fingerprint_key

from .. import live
from ..errors import UsageError
from ..inputs import endpoint
from ..options import DebugOpt
from ..render.text import escape_controls, shown
from ..reporting import command
from ..secrets import store_location

EndpointOpt = Annotated[str | None, typer.Option(
    "--endpoint", envvar="KVC_EVENTS", show_default=False, metavar="ENDPOINT", parser=endpoint,
    help="The feed's PUB address, as `kvc serve --events` bound it but with a host to connect to (e.g. "
    "tcp://127.0.0.1:5557, ipc:///run/kvc/events). Env: KVC_EVENTS.")]
ReplayOpt = Annotated[str | None, typer.Option(
    "--replay", envvar="KVC_EVENTS_REPLAY", show_default=False, metavar="ENDPOINT", parser=endpoint,
    help="The feed's replay address (`kvc serve --events-replay`): missed batches are fetched from it. "
    "Env: KVC_EVENTS_REPLAY.")]


class Engine(str, enum.Enum):
    """Whose feed `kvc events` reads: the wire is the same, the batches and what they carry are not."""

    KVC = "kvc"  # `kvc serve --events` (kvcache.types.events)
    SGLANG = "sglang"  # an SGLang engine's --kv-events-config publisher (kvcache.engines.sglang_events)
    VLLM = "vllm"  # a vLLM engine's --kv-events-config publisher (kvcache.engines.vllm_events)


EngineOpt = Annotated[Engine, typer.Option(
    "--engine", case_sensitive=False,
    help="Whose feed it is: kvc (`kvc serve --events`), sglang (an SGLang engine started with "
    "--kv-events-config '{\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", \"bind\": true}': "
    "--endpoint tcp://127.0.0.1:5557, and --replay its replay_endpoint) or vllm (a vLLM engine started with "
    "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
    "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}': --endpoint tcp://HOST:5557 --replay "
    "tcp://HOST:5558; its offloading tiers' events included). Both engines send each request's cache_salt in clear: "
    "kvc prints a keyed fingerprint instead, never the salt (see --store).")]
FingerprintStoreOpt = Annotated[StoreLocation | None, typer.Option(
    "--store", parser=store_location, show_default=False, metavar="PATH|URL",
    help="--engine sglang or vllm: fingerprint salts under this store's fingerprint key, so they match what "
    "`kvc ns ls` shows for the same salt. Without it, env KVC_FINGERPRINT_KEY when set, else a key drawn at random "
    "for this run: fingerprints then compare within the run only. Not read from KVC_STORE: the feed opens no store "
    "unless asked.")]

MALFORMED_SHOWN = 10  # malformed messages (and breaks in the numbering) said one line each; after them, one line
# at 100, 1000, 10000, ...


class EventsSummary(msgspec.Struct, tag="Summary", tag_field="type"):
    """How a `kvc events` reading went: `--json` prints it last, as {"type": "Summary", ...}."""

    batches: int = 0  # printed
    events: int = 0  # printed
    replayed: int = 0  # batches fetched from the replay socket
    missed: int = 0  # batches known missing that no replay gave back
    malformed: int = 0  # messages that were not KV-event batches (or had an impossible field): skipped
    restarts: int = 0  # the publisher's numbering went back (it restarted): followed from there
    jumps: int = 0  # the numbering leapt forward past any replay buffer: followed from there
    replays_cut_short: int = 0  # replay answers that stopped short of their end marker
    blocks: dict[str, int] = {}  # blocks each medium holds after the events printed (from the last
    # AllBlocksCleared, else from the start of the reading); media without any left out


def _later(count: int) -> str | None:
    """What the `count`-th line of a kind adds (the rate limit's word), or None when it is not one to say: each of
    the first MALFORMED_SHOWN, then one at each power of ten."""
    if count > MALFORMED_SHOWN and 10 ** len(str(count - 1)) != count:
        return None
    return "" if count < MALFORMED_SHOWN else (
        " (further ones are counted; one line at each power of ten)" if count == MALFORMED_SHOWN else
        f" ({count} so far)")


def _malformed_line(count: int, bad: MalformedMessage) -> str | None:
    """The stderr line for the `count`-th malformed message, or None when it is not one to say (rate limit)."""
    later = _later(count)
    if later is None:
        return None
    where = f"batch {bad.seq}" if bad.seq is not None else "a message"
    how = " (from the replay socket)" if bad.replayed else ""
    return escape_controls(f"kvc events: skipped {where}{how}: {bad.reason}{later}"[:400])


def _discontinuity_line(count: int, broke: Discontinuity, max_gap: int) -> str | None:
    """The stderr line for the `count`-th break in the publisher's numbering, or None (rate limit)."""
    later = _later(count)
    if later is None:
        return None
    if broke.kind == "restarted":
        return (f"kvc events: the feed started again at batch {broke.seq} after batch {broke.after} (its publisher "
                f"restarted, or its numbering went back): following it from there, blocks held counted afresh{later}")
    return (f"kvc events: the feed jumped from batch {broke.after} to batch {broke.seq} (more than {max_gap:,} ahead, "
            f"past any replay buffer: its numbering jumped; not counted missed): following it from there{later}")


HEADER = f"{'seq':>6}  {'time':<12}  {'event':<18}  {'medium':<10}  {'namespace':<24}  {'pages':>5}  " \
         f"{'held':>6}  {'first page':<12}  parent"
SGLANG_HEADER = f"{'seq':>6}  {'time':<12}  {'event':<18}  {'medium':<15}  {'salt':<12}  {'pages':>5}  " \
                f"{'held':>6}  {'first block':<16}  parent"
VLLM_HEADER = f"{'seq':>6}  {'time':<12}  {'event':<18}  {'medium':<12}  {'owner':<8}  {'locality':<8}  " \
              f"{'group':>5}  {'salt':<12}  {'blocks':>6}  {'held':>6}  {'first block':<16}  parent"


def by_medium(rec: Any) -> tuple[str, list[str]]:
    """Where a kvc or SGLang event's blocks are held, and the blocks: its medium, its hashes."""
    return rec.medium or "-", rec.block_hashes


def by_residency(rec: vllm_events.VLLMEventRecord) -> tuple[str, list[str]]:
    """Where a vLLM event's blocks are held, and the blocks, as vLLM's offloading tracker counts residencies: per
    medium and owner (``STORAGE/kvcr``: a secondary tier beside the primary's ``STORAGE``), a block per KV-cache
    group (one hash in two groups is two blocks)."""
    where = (rec.medium or "-") + (f"/{escape_controls(rec.ownership)}" if rec.ownership is not None else "")
    return where, [f"{rec.group_idx}:{h}" for h in rec.block_hashes]


class MediumTally:
    """The blocks each medium holds, as the events read tell it (`kvcache.live.holdings.Holdings`, the consumer kvc's
    checks of a dump use too): a BlockStored adds its blocks to its medium, a BlockRemoved takes them away,
    AllBlocksCleared forgets all. `where` says an event's medium and blocks (`by_medium`, `by_residency`)."""

    def __init__(self, where: Callable[[Any], tuple[str, list[str]]] = by_medium) -> None:
        self._held = Holdings()
        self._where = where

    def forget(self) -> None:
        """Forget every block: the publisher restarted, and what it held went with it."""
        self._held.clear()

    def apply(self, rec: Any) -> int:
        """Count event `rec` (a record with type, and what `where` reads); the blocks its medium holds after it."""
        if rec.type == "AllBlocksCleared":
            self.forget()
            return 0
        medium, blocks = self._where(rec)
        if rec.type == "BlockStored":
            self._held.stored(medium, blocks, (getattr(rec, "extra_key", None), getattr(rec, "salt_fingerprint", None)))
        else:
            self._held.removed(medium, blocks)
        return self._held.held(medium)

    def counts(self) -> dict[str, int]:
        """Blocks per medium, media holding none left out."""
        return self._held.counts()


def _at(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"


def line(rec: EventRecord, held: int) -> str:
    """A kvc event as one plain line (hashes shortened to 12 hex digits); `held`: blocks its medium holds after
    it."""
    kind = rec.type + (" *" if rec.replayed else "")
    if rec.type == "AllBlocksCleared":
        return f"{rec.seq:>6}  {_at(rec.ts):<12}  {kind:<18}  all"
    ns = f"{shown(rec.extra_key)}/{rec.salt_fingerprint or '-'}"
    first = rec.block_hashes[0][:12] if rec.block_hashes else "-"
    parent = (rec.parent_block_hash or "-")[:12] if rec.type == "BlockStored" else ""
    return (f"{rec.seq:>6}  {_at(rec.ts):<12}  {kind:<18}  {rec.medium or '-':<10}  {ns:<24}  "
            f"{len(rec.block_hashes):>5}  {held:>6}  {first:<12}  {parent}").rstrip()


def sglang_line(rec: sglang_events.SGLangEventRecord, held: int) -> str:
    """An SGLang event as one plain line: the medium as SGLang names it with kvc's tier beside it, the salt as its
    keyed fingerprint, block hashes as 16 hex digits (for a page without namespace seed, its storage key's
    first 16)."""
    kind = rec.type + (" *" if rec.replayed else "")
    if rec.type == "AllBlocksCleared":
        return f"{rec.seq:>6}  {_at(rec.ts):<12}  {kind:<18}  all"
    medium = shown(rec.medium) + (f" ({rec.tier})" if rec.tier else "")
    first = rec.block_hashes[0] if rec.block_hashes else "-"
    parent = (rec.parent_block_hash or "-") if rec.type == "BlockStored" else ""
    salt = (rec.salt_fingerprint or "-") if rec.type == "BlockStored" else ""
    return (f"{rec.seq:>6}  {_at(rec.ts):<12}  {kind:<18}  {medium:<15}  {salt:<12}  {len(rec.block_hashes):>5}  "
            f"{held:>6}  {first:<16}  {parent}").rstrip()


def vllm_line(rec: vllm_events.VLLMEventRecord, held: int) -> str:
    """A vLLM event as one plain line: the medium as vLLM names it with kvc's tier beside it, the offloading tier
    that owns it and its locality, the KV-cache group, the salt as its keyed fingerprint (of a salted prompt's first
    block: later blocks carry it through the hash chain), block hashes as 16 hex digits (an int hash is 16; a bytes
    one, its last 16: the digits vLLM's int form of the same hash has)."""
    kind = rec.type + (" *" if rec.replayed else "")
    if rec.type == "AllBlocksCleared":
        return f"{rec.seq:>6}  {_at(rec.ts):<12}  {kind:<18}  all"
    medium = shown(rec.medium) + (f" ({rec.tier})" if rec.tier else "")
    group = "-" if rec.group_idx is None else str(rec.group_idx)
    first = rec.block_hashes[0][-16:] if rec.block_hashes else "-"
    parent = (rec.parent_block_hash or "-")[-16:] if rec.type == "BlockStored" else ""
    salt = (rec.salt_fingerprint or "-") if rec.type == "BlockStored" else ""
    return (f"{rec.seq:>6}  {_at(rec.ts):<12}  {kind:<18}  {medium:<12}  {shown(rec.ownership):<8}  "
            f"{shown(rec.locality):<8}  {group:>5}  {salt:<12}  {len(rec.block_hashes):>6}  {held:>6}  {first:<16}  "
            f"{parent}").rstrip()


class FeedKind(msgspec.Struct, frozen=True):
    """How `kvc events` reads one engine's feed (a row of FEEDS): the wire is the same, the batches are not."""

    decode: Callable[[bytes], Any]  # a payload frame -> its batch (msgspec's errors when it is not one)
    records: Callable[[ReceivedBatch[Any], bytes], list[Any]]  # a batch -> printable records (salts keyed by the key)
    line: Callable[[Any, int], str]  # a record and the blocks its medium holds after it -> one plain line
    header: str
    who: str  # what publishes it, for the message when nothing answers
    replay_who: str
    where: Callable[[Any], tuple[str, list[str]]] = by_medium  # a record -> the medium holding its blocks, and them


FEEDS: dict[Engine, FeedKind] = {
    Engine.KVC: FeedKind(decode_batch, lambda b, _key: records(b), line, HEADER, "`kvc serve --events`",
                         "`kvc serve --events-replay`"),
    Engine.SGLANG: FeedKind(sglang_events.decode_batch,
                            lambda b, key: sglang_events.event_records(b.seq, b.batch, b.replayed, key),
                            sglang_line, SGLANG_HEADER, "an SGLang engine's KV-event publisher (--kv-events-config)",
                            "an SGLang engine's replay socket (replay_endpoint)"),
    Engine.VLLM: FeedKind(vllm_events.decode_batch,
                          lambda b, key: vllm_events.event_records(b.seq, b.batch, b.replayed, key),
                          vllm_line, VLLM_HEADER, "a vLLM engine's KV-event publisher (--kv-events-config)",
                          "a vLLM engine's replay socket (replay_endpoint)", by_residency),
}


def _fingerprint_key(engine: Engine, store: StoreLocation | None) -> bytes:
    """The key an engine's salts are fingerprinted under: --store's fingerprint key, else the deployment's
    (KVC_FINGERPRINT_KEY), else a random one of this run."""
    if store is None:
        return env_fingerprint_key() or os.urandom(FINGERPRINT_KEY_BYTES)
    if engine is Engine.KVC:
        raise UsageError("--store keys the fingerprints of an engine feed's salts: it goes with --engine sglang or "
                         "--engine vllm (kvc's feed carries fingerprints under its store's key already)")
    from ..context import open_inspect  # the store's modules load only when a store is asked for

    st = open_inspect(store)
    try:
        key = getattr(st, "fingerprint_key", None)
    finally:
        st.close()
    if key is None:
        raise UsageError(f"{store}: this user cannot read the store's fingerprint key (leave out --store to "
                         f"fingerprint under a key of this run)")
    return key


# the monitor events that end a wait for a peer: a ZMTP handshake that succeeded, or one that failed (no retry helps)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _wait_for_peer(endpoint: str, kind: int, timeout: float, who: str) -> None:
    """Connect a probe socket of `kind` to `endpoint` and wait up to `timeout` seconds for a ZeroMQ peer of the
    right type to complete the handshake; `EventEndpointError` (one line, exit 2) when none does. The probe sends
    nothing and is closed at once: the publisher sees a subscriber come and go."""
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    try:
        probe = ctx.socket(kind)
        probe.setsockopt(zmq.LINGER, 0)
        monitor = probe.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
        try:
            probe.connect(endpoint)
        except zmq.ZMQError as exc:
            raise EventEndpointError(endpoint, f"cannot connect: {exc.strerror}") from None
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and monitor.poll(max(1, int(left * 1000))):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            raise EventEndpointError(endpoint, f"the peer there is not {who} (the ZeroMQ handshake failed: wrong "
                                               "socket type or protocol)")
        raise EventEndpointError(endpoint, f"nothing answered within {timeout:g} s: is {who} running there? "
                                           "(kvc --timeout S waits longer)")
    finally:
        ctx.destroy(linger=0)


@command
def events(
    endpoint: EndpointOpt = None,
    engine: EngineOpt = Engine.KVC,
    store: FingerprintStoreOpt = None,
    replay: ReplayOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Subscribe and print events as they come.")] = False,
    start: Annotated[int | None, typer.Option(
        "--from", min=0, max=2**63 - 1, show_default=False, metavar="SEQ",
        help="Begin at this sequence number: the batches before the first one received are fetched from --replay "
        "(0: all the publisher still buffers, so the view starts from the cache's full state).")] = None,
    topic: Annotated[str, typer.Option("--topic", help="Only messages whose topic starts with this.")] = "",
    count: Annotated[int, typer.Option("--count", min=0, max=1_000_000_000,
                                       help="Stop after this many batches (0: no limit).")] = 0,
    idle_timeout: Annotated[float, typer.Option(
        "--idle-timeout", min=0.0, max=86400.0,
        help="Stop once no batch came for this many seconds (0: wait for ever).")] = 0.0,
    json: Annotated[bool, typer.Option("--json", help="One JSON object per event per line (hashes in hex) on "
                                                      "stdout, then one summary object ({\"type\": \"Summary\", "
                                                      "batches, events, replayed, missed, malformed, restarts, "
                                                      "jumps, replays_cut_short, blocks: held per medium}), "
                                                      "nothing else. --engine sglang: "
                                                      "kvc's SGLangEventRecord, the salt as salt_fingerprint; "
                                                      "--engine vllm: kvc's VLLMEventRecord, the salt as "
                                                      "salt_fingerprint and in extra_keys as salt:FINGERPRINT."
                                      )] = False,
    debug: DebugOpt = False,
) -> None:
    """Print a live cache's KV events (BlockStored / BlockRemoved / AllBlocksCleared per tier) from its feed, or
    an SGLang engine's (--engine sglang, per medium: GPU, CPU_PINNED, DISK, EXTERNAL) or a vLLM engine's (--engine
    vllm, per medium: GPU, and its offloading tiers' CPU and STORAGE with their owner and locality; per KV-cache
    group), an engine's salts as keyed fingerprints: with --follow as they come, else what the replay buffer
    holds. Each line says how many blocks the event's medium holds after it, as far as the events read tell.
    Events fetched by replay are marked '*' (JSON: "replayed"). Batches missed and no longer buffered are reported
    on stderr at the end. A message that is not a KV-event batch (or a batch with an impossible field) is skipped,
    said on stderr (rate-limited) and counted; the reading goes on. A publisher whose numbering starts again (a
    restart) or jumps is followed from there, said on stderr and counted. A replay answer is printed as it comes, a
    bounded chunk at a time. An address where no publisher answers within the --timeout given before the
    command (`kvc --timeout S events ...`, default 30 s) is one line on stderr and exit 2."""
    if endpoint is None:
        raise UsageError("kvc events needs --endpoint ENDPOINT (the address `kvc serve --events` publishes on; "
                         "env KVC_EVENTS)")
    if not follow and replay is None:
        raise UsageError("kvc events without --follow prints the replay buffer: give --replay ENDPOINT, or "
                         "--follow to subscribe")
    feed, key = FEEDS[engine], _fingerprint_key(engine, store)
    summary = EventsSummary()
    tally = MediumTally(feed.where)

    def show(batches: list[ReceivedBatch[Any]]) -> None:
        for b in batches:
            if count and summary.batches >= count:
                return
            summary.batches += 1
            for rec in feed.records(b, key):
                summary.events += 1
                held = tally.apply(rec)
                print(msgspec.json.encode(rec).decode() if json else feed.line(rec, held), flush=True)

    def malformed(bad: MalformedMessage) -> None:
        said = _malformed_line(sub.malformed, bad)
        if said is not None:
            typer.echo(said, err=True)

    def discontinuity(broke: Discontinuity) -> None:
        if broke.kind == "restarted":
            tally.forget()
        said = _discontinuity_line(sub.restarts + sub.jumps, broke, sub.max_gap)
        if said is not None:
            typer.echo(said, err=True)

    wait = live.timeout()
    sub = FeedSubscriber(endpoint, feed.decode, replay_endpoint=replay, topic=topic, start=start,
                         on_malformed=malformed, on_discontinuity=discontinuity)
    try:
        # ZeroMQ connects in the background and retries for ever: make sure a publisher is there, within --timeout
        _wait_for_peer(endpoint, zmq.SUB, wait, feed.who)
        if replay is not None:
            _wait_for_peer(replay, zmq.DEALER, wait, feed.replay_who)
    except BaseException:
        sub.close()
        raise
    if not json:
        print(feed.header, flush=True)
    try:
        if not follow:
            for chunk in sub.replay(start or 0):  # printed as it comes: a reader holds one chunk, never the answer
                show(chunk)
                if count and summary.batches >= count:
                    break
        else:
            last = time.monotonic()
            while not count or summary.batches < count:
                got = sub.receive(timeout=0.25)
                if got or sub.reading:  # a replay answer being read is no idle feed, even in a chunk it passes whole
                    show(got)
                    last = time.monotonic()
                elif idle_timeout and time.monotonic() - last >= idle_timeout:
                    break
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a follow ends: not an error
    finally:
        sub.close()
    summary.replayed, summary.missed, summary.malformed = sub.replayed, sub.missed, sub.malformed
    summary.restarts, summary.jumps, summary.replays_cut_short = sub.restarts, sub.jumps, sub.replays_cut_short
    summary.blocks = tally.counts()
    if sub.missed:
        typer.echo(f"kvc events: {sub.missed} batches missed and no longer in the replay buffer", err=True)
    if sub.malformed:
        typer.echo(f"kvc events: {sub.malformed} malformed messages skipped (not KV-event batches)", err=True)
    if sub.replays_cut_short:
        typer.echo(f"kvc events: {sub.replays_cut_short} replay answers cut short (silent for {sub.replay_timeout:g} "
                   f"s, a message over {REPLAY_MESSAGE_MAX_BYTES >> 20} MiB, or more batches than any buffer holds)",
                   err=True)
    if json:
        print(msgspec.json.encode(summary).decode(), flush=True)

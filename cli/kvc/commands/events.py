"""`kvc events`: read a live cache's KV-event feed (`kvc serve --events`), as a router would.

With --follow it subscribes to the feed and prints each event as it comes — one line per event, or one JSON
object per line with --json — until Ctrl-C, --count batches or --idle-timeout seconds without one. A gap in the
sequence numbers (the subscriber fell behind, or joined late with --from) is filled from the publisher's replay
socket when --replay names it; events fetched that way are marked. Without --follow it prints what the replay
buffer holds from --from on, and exits. Nothing here ever sees a salt: the feed carries fingerprints.

A message that is not a KV-event batch never ends the reading (a router's feed must survive one bad message): it is
skipped, said in one line on stderr (the first MALFORMED_SHOWN of them, then one line at each power of ten), and
counted in the summary at the end — on stderr, and with --json as the last object on stdout (`EventsSummary`).
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
import typer
import zmq

from kvcache.errors import EventEndpointError
from kvcache.live.events import EventRecord, KVEventSubscriber, MalformedMessage, ReceivedBatch, records

from .. import live
from ..errors import UsageError
from ..options import DebugOpt
from ..render.text import escape_controls, shown
from ..reporting import command

EndpointOpt = Annotated[str | None, typer.Option(
    "--endpoint", envvar="KVC_EVENTS", show_default=False, metavar="ENDPOINT",
    help="The feed's PUB address, as `kvc serve --events` bound it but with a host to connect to (e.g. "
    "tcp://127.0.0.1:5557, ipc:///run/kvc/events). Env: KVC_EVENTS.")]
ReplayOpt = Annotated[str | None, typer.Option(
    "--replay", envvar="KVC_EVENTS_REPLAY", show_default=False, metavar="ENDPOINT",
    help="The feed's replay address (`kvc serve --events-replay`): missed batches are fetched from it. "
    "Env: KVC_EVENTS_REPLAY.")]

MALFORMED_SHOWN = 10  # malformed messages said one line each; after them, one line at 100, 1000, 10000, ...


class EventsSummary(msgspec.Struct, tag="Summary", tag_field="type"):
    """How a `kvc events` reading went: `--json` prints it last, as {"type": "Summary", ...}."""

    batches: int = 0  # printed
    events: int = 0  # printed
    replayed: int = 0  # batches fetched from the replay socket
    missed: int = 0  # batches known missing that no replay gave back
    malformed: int = 0  # messages that were not KV-event batches: skipped


def _malformed_line(count: int, bad: MalformedMessage) -> str | None:
    """The stderr line for the `count`-th malformed message, or None when it is not one to say (rate limit)."""
    if count > MALFORMED_SHOWN and 10 ** len(str(count - 1)) != count:
        return None
    where = f"batch {bad.seq}" if bad.seq is not None else "a message"
    how = " (from the replay socket)" if bad.replayed else ""
    later = "" if count < MALFORMED_SHOWN else (
        " (further ones are counted; one line at each power of ten)" if count == MALFORMED_SHOWN else
        f" ({count} so far)")
    return escape_controls(f"kvc events: skipped {where}{how}: {bad.reason}{later}"[:400])


HEADER = f"{'seq':>6}  {'time':<12}  {'event':<18}  {'medium':<10}  {'namespace':<24}  {'pages':>5}  " \
         f"{'first page':<12}  parent"


def line(rec: EventRecord) -> str:
    """An event as one plain line (hashes shortened to 12 hex digits)."""
    at = time.strftime("%H:%M:%S", time.localtime(rec.ts)) + f".{int(rec.ts * 1000) % 1000:03d}"
    kind = rec.type + (" *" if rec.replayed else "")
    if rec.type == "AllBlocksCleared":
        return f"{rec.seq:>6}  {at:<12}  {kind:<18}  all"
    ns = f"{shown(rec.extra_key)}/{rec.salt_fingerprint or '-'}"
    first = rec.block_hashes[0][:12] if rec.block_hashes else "-"
    parent = (rec.parent_block_hash or "-")[:12] if rec.type == "BlockStored" else ""
    return (f"{rec.seq:>6}  {at:<12}  {kind:<18}  {rec.medium or '-':<10}  {ns:<24}  {len(rec.block_hashes):>5}  "
            f"{first:<12}  {parent}").rstrip()


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
    replay: ReplayOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Subscribe and print events as they come.")] = False,
    start: Annotated[int | None, typer.Option(
        "--from", min=0, show_default=False, metavar="SEQ",
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
                                                      "batches, events, replayed, missed, malformed}), nothing "
                                                      "else.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Print a live cache's KV events (BlockStored / BlockRemoved / AllBlocksCleared per tier) from its feed: with
    --follow as they come, else what the replay buffer holds. Events fetched by replay are marked '*' (JSON:
    "replayed"). Batches missed and no longer buffered are reported on stderr at the end. A message that is not
    a KV-event batch is skipped, said on stderr (rate-limited) and counted; the reading goes on. An address where
    no publisher answers within the --timeout given before the command (`kvc --timeout S events ...`, default
    30 s) is one line on stderr and exit 2."""
    if endpoint is None:
        raise UsageError("kvc events needs --endpoint ENDPOINT (the address `kvc serve --events` publishes on; "
                         "env KVC_EVENTS)")
    if not follow and replay is None:
        raise UsageError("kvc events without --follow prints the replay buffer: give --replay ENDPOINT, or "
                         "--follow to subscribe")
    summary = EventsSummary()

    def show(batches: list[ReceivedBatch]) -> None:
        for b in batches:
            if count and summary.batches >= count:
                return
            summary.batches += 1
            for rec in records(b):
                summary.events += 1
                print(msgspec.json.encode(rec).decode() if json else line(rec), flush=True)

    def malformed(bad: MalformedMessage) -> None:
        said = _malformed_line(sub.malformed, bad)
        if said is not None:
            typer.echo(said, err=True)

    wait = live.timeout()
    sub = KVEventSubscriber(endpoint, replay_endpoint=replay, topic=topic, start=start, on_malformed=malformed)
    try:
        # ZeroMQ connects in the background and retries for ever: make sure a publisher is there, within --timeout
        _wait_for_peer(endpoint, zmq.SUB, wait, "`kvc serve --events`")
        if replay is not None:
            _wait_for_peer(replay, zmq.DEALER, wait, "`kvc serve --events-replay`")
    except BaseException:
        sub.close()
        raise
    if not json:
        print(HEADER, flush=True)
    try:
        if not follow:
            show(sub.fetch(start or 0))
            return
        last = time.monotonic()
        while not count or summary.batches < count:
            got = sub.receive(timeout=0.25)
            if got:
                show(got)
                last = time.monotonic()
            elif idle_timeout and time.monotonic() - last >= idle_timeout:
                break
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a follow ends: not an error
    finally:
        sub.close()
    summary.replayed, summary.missed, summary.malformed = sub.replayed, sub.missed, sub.malformed
    if sub.missed:
        typer.echo(f"kvc events: {sub.missed} batches missed and no longer in the replay buffer", err=True)
    if sub.malformed:
        typer.echo(f"kvc events: {sub.malformed} malformed messages skipped (not KV-event batches)", err=True)
    if json:
        print(msgspec.json.encode(summary).decode(), flush=True)

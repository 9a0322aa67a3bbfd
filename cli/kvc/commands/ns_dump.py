"""`kvc ns dump`: what a store (offline) or a live cache (--socket: per tier) holds, as the KV events a router
would have received from its feed (`kvc serve --events`), so that a router can bootstrap from it.

The events are the feed's own (`kvcache.types.events`): a first `AllBlocksCleared`, then one `BlockStored` per run
of consecutive pages of one chain, each page held once per tier, parents before children, `medium` in the feed's
words (--medium-names), the namespace as extra_key and the salt's keyed fingerprint (never the salt). They are
made by `kvcache.ops.dump`, streamed: a store is walked a chunk at a time (through a live cache's admin socket, a
chunk per request between its scheduler steps), never gathered in memory.

--out FILE writes the batches in the feed's encoding: each one msgpack `EventBatch`, exactly the payload frame the
feed publishes, back to back (a msgpack stream: any msgpack stream reader takes it; kvc's is
`kvcache.live.holdings.read_batches`). Without --out the events are printed on stdout, one line each as `kvc
events` prints them (with --json: one JSON object per event, as `kvc events --json`), then the summary. The summary
(--json: `DumpSummary`, {"type": "Summary", ...}, the last object) says what a consumer that read the events
holds: pages per medium and per namespace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated

import msgspec
import typer

from kvcache.live.event_records import records
from kvcache.live.holdings import HeldPages
from kvcache.live.protocol import DumpChunk, DumpRequest
from kvcache.live.subscriber import ReceivedBatch
from kvcache.ops.dump import BATCH_EVENTS, DumpTier, StoreWalk, batches, medium_of, store_events
from kvcache.types.events import BlockStored, EventBatch, KVEvent, MediumNames, encode_batch

from .. import live
from ..errors import UsageError
from ..options import DEFAULT_STORE, DebugOpt, ReadOnlyOpt, SocketOpt, StoreOpt
from ..outputs import ForceOpt, is_stdout, output_target, writing
from ..render.output import say
from ..render.progress import progress
from ..render.text import literal, shown

TIERS = (DumpTier.DEVICE, DumpTier.HOST, DumpTier.STORAGE)


class DumpSummary(msgspec.Struct, tag="Summary", tag_field="type"):
    """`kvc ns dump --json`: what a consumer of the events holds once it read them all (the last object on stdout)."""

    source: str  # "store" (offline) or "live" (through --socket)
    store: str | None  # offline: the store's location, credentials redacted
    socket: str | None  # live: the admin socket
    out: str | None  # the file written (None: the events went to stdout)
    medium_names: str  # the vocabulary of `medium`
    batches: int = 0
    events: int = 0
    pages: dict[str, int] = {}  # per medium: pages a consumer holds after the events
    namespaces: list[HeldPages] = []  # per medium and namespace
    engine_pages: int = 0  # stored pages an engine named by its own keys (their events carry no tokens)


def _live_events(sock: str, tiers: list[DumpTier], names: MediumNames, chunk: int,
                 advance: list[int]) -> Iterator[KVEvent]:
    """The events of each tier of the live cache at `sock`, a request per tier (the store: per chunk)."""
    with live.client(sock) as client:
        for tier in tiers:
            cursor = None
            while True:
                got = client.call(DumpRequest(tier, names, cursor, chunk), DumpChunk)
                advance[0] += got.pages
                yield from got.events
                cursor = got.cursor
                if cursor is None:
                    break


def dump(
    store: StoreOpt = DEFAULT_STORE,
    socket: SocketOpt = None,
    out: Annotated[Path | None, typer.Option(
        "--out", show_default=False, metavar="FILE",
        help="Write the events to FILE in the feed's encoding (each batch the msgpack EventBatch the feed "
        "publishes, back to back), atomically; stdout then gets the summary only (see --lines).")] = None,
    force: ForceOpt = False,
    lines: Annotated[bool, typer.Option(
        "--lines", help="With --out: print the events on stdout too, as without it.")] = False,
    tier: Annotated[list[DumpTier] | None, typer.Option(
        "--tier", case_sensitive=False, show_default=False,
        help="With --socket: dump only this tier (device: L1, host: L2, storage: the store); repeat for more. "
        "Default: all three. Offline there is the store only.")] = None,
    medium_names: Annotated[MediumNames, typer.Option(
        "--medium-names", case_sensitive=False,
        help="The words of the events' `medium`, as `kvc serve --events-medium-names`: kvc (device / host / "
        "storage) or sglang (GPU / CPU_PINNED / DISK).")] = MediumNames.KVC,
    batch_events: Annotated[int, typer.Option(
        "--batch-events", min=1, max=65_536, help="Events per batch.")] = BATCH_EVENTS,
    chunk_pages: Annotated[int, typer.Option(
        "--chunk-pages", min=1, max=65_536,
        help="With --socket: store pages the live cache walks per request (one request runs between two of its "
        "scheduler steps).")] = 4096,
    read_only: ReadOnlyOpt = False,
    json: Annotated[bool, typer.Option(
        "--json", help="Events as JSON objects, one per line, as `kvc events --json` prints them (hashes in hex), "
        "then the summary object ({\"type\": \"Summary\", batches, events, pages per medium, namespaces: pages per "
        "medium and namespace}); with --out, the summary only.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Write what the store holds (or, with --socket, what the live cache holds in each tier: device, host and its
    store) as the KV events a router would have received from the cache's feed: AllBlocksCleared, then a
    BlockStored per run of consecutive pages, each page once per tier, parents before children, namespaces as
    extra_key and salt fingerprint (never the salt). To --out FILE in the feed's encoding, or on stdout as `kvc
    events` prints them; the summary says what a consumer holds after reading them, per tier and namespace. With
    --out, a progress bar on stderr when it is a terminal."""
    from .events import HEADER, line  # kvc events' own printing; loaded when a dump runs, not with `kvc ns`

    sock = live.socket_path(socket)
    tiers = list(dict.fromkeys(tier)) if tier else list(TIERS if sock is not None else (DumpTier.STORAGE,))
    if sock is None and tiers != [DumpTier.STORAGE]:
        raise UsageError("offline, kvc ns dump reads the store only (--tier storage): the device and host tiers "
                         "are a live cache's, give --socket PATH")
    if lines and out is None:
        raise UsageError("--lines prints the events besides --out FILE: give --out, or leave --lines out")
    target = output_target(out, "--out", force) if out is not None else None  # checked before any work
    show_events = target is None or lines
    summary = DumpSummary("live" if sock is not None else "store", str(store) if sock is None else None, sock,
                          str(out) if out is not None else None, medium_names.value)
    # What a consumer holds, counted, not gathered: a dump gives each page once per tier (a consumer that keeps
    # the pages themselves, `kvcache.live.holdings.Holdings`, rebuilds the same counts from the events)
    per_medium: dict[str, int] = {}
    per_namespace: dict[tuple[str, str | None, str | None], int] = {}
    to_err = target is not None and is_stdout(target)

    def emit(batch: EventBatch, seq: int, sink: IO[bytes] | None) -> None:
        if sink is not None:
            sink.write(encode_batch(batch))
        summary.batches += 1
        summary.events += len(batch.events)
        recs = records(ReceivedBatch(seq, batch, False)) if show_events else [None] * len(batch.events)
        for ev, rec in zip(batch.events, recs, strict=True):
            medium = "-"
            if isinstance(ev, BlockStored):
                medium, n = ev.medium or "-", len(ev.block_hashes)
                per_medium[medium] = per_medium.get(medium, 0) + n
                where = (medium, ev.extra_key, ev.salt_fingerprint)
                per_namespace[where] = per_namespace.get(where, 0) + n
            if rec is not None:
                text = msgspec.json.encode(rec).decode() if json else line(rec, per_medium.get(medium, 0))
                typer.echo(text, err=to_err)

    if show_events and not json:
        typer.echo(HEADER, err=to_err)
    with writing(target) if target is not None else contextlib.nullcontext() as sink:
        if sock is not None:
            done = [0]
            with progress("ns dump", None, enabled=not json and not show_events) as advance:
                for seq, batch in enumerate(batches(_live_events(sock, tiers, medium_names, chunk_pages, done),
                                                    batch_events)):
                    emit(batch, seq, sink)
                    advance(done[0])
        else:
            from ..context import open_inspect

            st = open_inspect(store, read_only=read_only)
            try:
                walk = StoreWalk(st)
                total = sum(r.pages for r in st.namespaces())
                with progress("ns dump", total, enabled=not json and not show_events) as advance:
                    events = store_events(walk, medium_of(DumpTier.STORAGE, medium_names))
                    for seq, batch in enumerate(batches(events, batch_events)):
                        emit(batch, seq, sink)
                        advance(walk.pages)
                summary.engine_pages = walk.engine_pages
            finally:
                st.close()
    summary.pages = dict(sorted(per_medium.items()))
    summary.namespaces = [HeldPages(m, k, f, n) for (m, k, f), n in
                          sorted(per_namespace.items(), key=lambda i: (i[0][0], i[0][1] or "", i[0][2] or ""))]
    if json:
        typer.echo(msgspec.json.encode(summary).decode(), err=to_err)
        return
    _say_summary(summary, to_err)


def _say_summary(summary: DumpSummary, to_err: bool) -> None:
    """The summary in words: where from, where to, pages per tier and namespace."""
    where = f"the live cache at {summary.socket}" if summary.socket else shown(summary.store)
    into = f" into {shown(summary.out)}" if summary.out else ""
    per = ", ".join(f"{shown(m)} {n:,}" for m, n in summary.pages.items()) or "no pages"
    spaces = len({(r.extra_key, r.salt_fingerprint) for r in summary.namespaces})
    text = (f"dumped {where}{into}: {summary.events:,} events in {summary.batches:,} batches; pages held: {per}, "
            f"in {spaces:,} namespaces")
    if summary.engine_pages:
        text += f" ({summary.engine_pages:,} engine pages, without tokens)"
    if to_err:
        typer.echo(text, err=True)
    else:
        say(literal(text))

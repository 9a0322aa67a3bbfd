"""`kvc snapshot PATH`: write a live cache's ownership snapshot (audit it offline with `kvc audit --snapshot`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import live
from ..errors import UsageError
from ..options import DebugOpt, JsonOpt, SocketOpt
from ..outputs import ForceOpt, output_target
from ..render.output import emit_json, say
from ..render.text import esc, human_bytes
from ..reporting import command


@command
def snapshot(
    path: Annotated[Path, typer.Argument(help="Where to write the snapshot (atomically; this command writes it, "
                                         "the server only sends it). A symbolic link, FIFO or device there is "
                                         "refused unless --force.", show_default=False)],
    socket: SocketOpt = None,
    force: ForceOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Have the live cache behind --socket write its ownership snapshot: every pool's ledger and every holder of
    a slot, taken between two scheduler steps. Check it with `kvc audit --snapshot PATH`."""
    sock = live.socket_path(socket)
    if sock is None:
        raise UsageError("kvc snapshot acts on a live cache: give --socket PATH (or KVC_SOCKET); an offline "
                         "replay writes one with `kvc replay --snapshot-out`")
    target = output_target(path, "PATH", force)  # before the server takes a snapshot for nothing
    result = live.snapshot_to(sock, target)
    if json:
        emit_json(result)
    else:
        say(f"snapshot of the live cache at {esc(sock)} written to {esc(result.path)} ({human_bytes(result.bytes)}: "
            f"{result.nodes} tree nodes, {result.holders} other holders)")

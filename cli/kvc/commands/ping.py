"""`kvc ping --socket S`: is a live cache answering on its admin socket? A health check for probes and runbooks.

The ping is the admin protocol's own `PingRequest`, answered with `ServerInfo` (the server's pid, protocol version,
store and tier sizes). It is answered on the cache's owner thread, between two scheduler steps, like every admin
request: an answer means the cache's loop is running, not only that a socket accepts connections.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
import typer

from kvcache.live.protocol import PingRequest, ServerInfo

from .. import live
from ..errors import UsageError
from ..options import DebugOpt, JsonOpt, SocketOpt
from ..render.output import emit_json, say
from ..render.text import esc
from ..reporting import command


class PingResult(msgspec.Struct, frozen=True):
    """What `kvc ping --json` prints: the socket, the round trip, and the server's answer as it sent it."""

    socket: str
    rtt_ms: float  # from connecting to the answer decoded, in milliseconds
    server: ServerInfo


TimeoutOpt = Annotated[float | None, typer.Option(
    "--timeout", min=0.001, max=live.MAX_TIMEOUT_S, show_default=False, metavar="SECONDS",
    help="Seconds to wait for the answer (connecting included); no answer in time is exit 2. Default: the "
    "--timeout given before the command (or KVC_TIMEOUT), else 30.")]


@command
def ping(
    socket: SocketOpt = None,
    timeout: TimeoutOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check that the live cache behind --socket answers: exit 0 with one line (the round-trip time, the server's
    pid, store and protocol version), or one line on stderr and exit 2 when nothing answers in time (no socket,
    nothing listening, a server that does not trust us or that we do not trust, another protocol version)."""
    sock = live.socket_path(socket)
    if sock is None:
        raise UsageError("kvc ping checks a live cache: give --socket PATH (or KVC_SOCKET)")
    client = live.client(sock)
    if timeout is not None:
        client.timeout = timeout
    with client:
        start = time.perf_counter()
        info = client.call(PingRequest(), ServerInfo)
        rtt_ms = (time.perf_counter() - start) * 1000.0
    result = PingResult(sock, rtt_ms, info)
    if json:
        emit_json(result)
    else:
        say(f"{esc(sock)}: answered in {rtt_ms:.2f} ms by pid {info.pid} (store {esc(info.store or '-')}, "
            f"{esc(info.host_mode)} mode, protocol {info.version})")

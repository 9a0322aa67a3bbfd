"""Who is at the other end of an admin socket: both sides check it (SO_PEERCRED) before they trust a byte."""

from __future__ import annotations

import pwd
import socket
import struct

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (SO_PEERCRED: for a client,
    the server as it was when it called listen; for a server, the client as it was when it connected)."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


def describe_uid(uid: int) -> str:
    """A uid as people read it: `uid 1000 (alice)`."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"

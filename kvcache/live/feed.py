"""A KV-event feed's framing over ZeroMQ, its endpoints and how either end opens a socket (`open_socket`): what the
publisher (`events`) and the subscriber (`subscriber`) share (DESIGN §7b).

The framing is vLLM's and SGLang's, so KV-aware routers read kvc's feed unchanged:

- a PUB socket; each batch is one message of three frames: the topic, an 8-byte big-endian sequence number (from
  0, one per batch), the msgpack batch (`kvcache.types.events.EventBatch` on kvc's feed);
- optionally a ROUTER socket, the replay socket: a client sends ``[b"", start]`` (start: 8 bytes, big endian) and
  gets back ``[b"", seq, payload]`` for every batch still in the publisher's bounded replay buffer from `start` on,
  then ``[b"", END_OF_REPLAY, b""]``; or, when the publisher already runs its maximum of answers, the one message
  ``[b"", REPLAY_BUSY, b""]`` (ask again later). SGLang's answers carry the topic before the sequence
  (``[b"", topic, seq, payload]``). A subscriber that sees a gap in the sequence fetches what it missed.

Loopback is the default address: a feed names tenants and page hashes and has no authentication, so it reaches
other hosts only when an address is written out (a wildcard host is flagged: `binds_every_interface`).
"""

from __future__ import annotations

import zmq

from ..errors import EventEndpointError

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the sequence frame that ends a replay answer
REPLAY_BUSY = (-2).to_bytes(8, "big", signed=True)  # the answer when --max-replays answers are running: ask again
DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"  # loopback, any free port: the feed reaches this host only unless asked
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def endpoint_of(text: str) -> str:
    """A ZeroMQ endpoint from what a user typed: a full endpoint as is; a bare port (``5557``) or ``*`` (any free
    port) means TCP on loopback, ``tcp://127.0.0.1:PORT``. An address other than loopback is only ever bound when
    it is written out."""
    text = text.strip()
    if text == "*" or text.isdigit():
        return f"tcp://127.0.0.1:{text}"
    return text


def binds_every_interface(endpoint: str) -> bool:
    """Whether a TCP `endpoint` binds every interface (``tcp://*:P``, ``tcp://0.0.0.0:P``, ``tcp://[::]:P``):
    anyone who can reach the host can read, and ask, what is published there."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host in _WILDCARD_HOSTS


def open_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, endpoint: str, options: dict[int, int],
                bind: bool) -> zmq.Socket[bytes]:
    """A socket of `kind` bound (`bind`) or connected to `endpoint`, with LINGER 0 and `options` set first: ZeroMQ
    gives a socket's connections the options it had when it was bound or connected. EventEndpointError when it
    cannot bind or connect."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options.items():
        sock.setsockopt(option, value)
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise EventEndpointError(endpoint, f"cannot {'bind' if bind else 'connect'}: {exc.strerror}") from None
    return sock

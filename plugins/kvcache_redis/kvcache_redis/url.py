"""A store URL: how a ``redis://`` (``rediss://``, ``redis+cluster://``, ``rediss+cluster://``) location is parsed,
which of its query options are kvc's (`RedisOptions`), and how it is shown with its credentials replaced by ``***``.

Parsed before any connection: a URL that does not parse is an InvalidInput that never quotes the URL's text (an
unencoded '/' in a password cuts the authority short, so any part of a bad URL may hold the password).
"""

from __future__ import annotations

import math
import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import msgspec

from kvcache.storage.kit import InvalidInput

DEFAULT_PREFIX = "kvc:"
DEFAULT_TIMEOUT_S = 2.0  # socket timeout of one command: how long a hung server can stall an L3 job
DEFAULT_CONNECT_TIMEOUT_S = 1.0
DEFAULT_BACKOFF_MAX_S = 2.0  # longest pause between reconnection attempts after a fault
MAX_SECONDS = 3600.0  # the longest timeout or backoff a URL may ask for
_KVC_QUERY = ("prefix", "timeout", "connect_timeout", "backoff_max")

# Query parameters whose values are credentials (redis-py reads password= and username= from the query too).
_SECRET_QUERY = re.compile(r"pass|secret|token|auth|credential|key", re.I)


class RedisOptions(msgspec.Struct, frozen=True):
    """kvc's connection options (URL query parameters or `open` keywords)."""

    prefix: str = DEFAULT_PREFIX  # prepended to every key
    timeout: float = DEFAULT_TIMEOUT_S  # socket timeout of one command, seconds
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    backoff_max: float = DEFAULT_BACKOFF_MAX_S  # longest pause between reconnection attempts


class StoreUrl(msgspec.Struct, frozen=True):
    """A parsed store URL: what redis-py gets, whether it is a cluster, kvc's options, the printable form."""

    client_url: str  # redis:// or rediss:// URL without kvc's query options
    cluster: bool
    options: RedisOptions
    shown: str  # the URL with any password replaced by ***


def redacted(location: str) -> str:
    """How a message names a URL that did not parse: its scheme alone. Its other parts cannot be told apart (an
    unencoded '/' in a password cuts the authority short), so any of them may hold the password."""
    m = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", location)
    return f"{m.group(0)} URL" if m else "a store URL"


def shown(location: str) -> str:
    """`location` (parsed already) rebuilt from its parts with each credential (the userinfo's password, a secret
    query value) as ***: by structure, never by replacing the secret's text wherever it occurs (a password `1`
    would turn 127.0.0.1 into ***27.0.0.***, and the template gives it back)."""
    parts = urlsplit(location)
    netloc = parts.netloc
    if parts.password:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = []
    for field in parts.query.split("&") if parts.query else []:
        name, eq, value = field.partition("=")
        query.append(f"{name}{eq}***" if eq and value and _SECRET_QUERY.search(unquote(name)) else field)
    return (location[:len(parts.scheme) + 3] + netloc + parts.path + ("?" + "&".join(query) if query else "")
            + ("#" + parts.fragment if parts.fragment else ""))


def _seconds(name: str, value: Any) -> float:
    """A URL's number of seconds: finite, > 0 and at most MAX_SECONDS."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"{name} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        raise InvalidInput(f"{name} must be > 0 and at most {MAX_SECONDS:g} seconds, got {value!r}")
    return seconds


def parse_url(location: str, overrides: dict[str, Any]) -> StoreUrl:
    """Parse a store URL; `overrides` (kvc's options given as keywords) win over its query options and are
    popped from the dict. InvalidInput on a URL this backend cannot open."""
    try:
        parts = urlsplit(location)
        hostname, _ = parts.hostname, parts.port  # both parse lazily: a bad host or port raises here
    except ValueError:
        raise InvalidInput(f"{redacted(location)}: not a usable store URL (its host or port does not parse; a "
                           f"password holding '/', '?' or '#' must be percent-encoded)") from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise InvalidInput(f"{redacted(location)}: not a redis://, rediss://, redis+cluster:// or "
                           f"rediss+cluster:// URL")
    if not hostname:
        raise InvalidInput(f"{scheme}:// URL without a host")
    cluster = scheme.endswith("+cluster")
    base = scheme.split("+")[0]
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _KVC_QUERY}
    rest = [(k, v) for k, v in query if k not in _KVC_QUERY]
    fields: dict[str, Any] = {}
    for name in _KVC_QUERY:
        value = overrides.pop(name, None)
        if value is None:
            value = ours.get(name)
        if value is None:
            continue
        if name == "prefix":
            if not isinstance(value, str) or not value:
                raise InvalidInput("the key prefix must be a non-empty string")
            fields[name] = value
        else:
            fields[name] = _seconds(name, value)
    path = parts.path
    if cluster and path.strip("/") not in ("", "0"):
        raise InvalidInput("a Redis Cluster has database 0 only: drop the /db part of the URL")
    if not cluster and not re.fullmatch(r"/?(\d{1,6})?", path):
        # an '@' in the path is a password's unencoded '/' that cut the authority short: the path is not echoed
        said = "the URL's path" if "@" in path else repr(path)
        raise InvalidInput(f"{said}: the database of a redis:// URL is a number, as in redis://host:6379/0 (a "
                           f"password holding '/' must be percent-encoded)")
    client_url = urlunsplit((base, parts.netloc, "" if cluster else path, urlencode(rest), ""))
    return StoreUrl(client_url, cluster, RedisOptions(**fields), shown(location))

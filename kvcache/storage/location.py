"""StoreLocation: a store's path or URL as given, which prints with its credentials redacted.

A URL such as ``redis://:hunter2@cache-host:6379/0`` carries a password. Anything that shows a location (CLI
output, JSON, metrics labels, error messages) holds a `StoreLocation` and prints `str(location)`, which never
contains it; only the code that opens the store reads `location.url`. The secrets it found are listed
(`secrets`), so that text from elsewhere (a driver's error message quoting the URL) can be scrubbed too
(`redact`).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from ..errors import InvalidInput

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Query parameters whose values are credentials (redis-py reads password= and username= from the query too).
_SECRET_QUERY = re.compile(r"pass|secret|token|auth|credential|key", re.I)
REDACTED = "***"


class StoreLocation:
    """A store's path or URL. `str()` and `repr()` redact credentials; `url` is the location to open."""

    __slots__ = ("_url", "_shown", "_secrets")

    def __init__(self, location: str) -> None:
        if not isinstance(location, str):
            raise InvalidInput(f"a store location is a path or URL string, got {type(location).__name__}")
        self._url = location
        self._shown, self._secrets = _redacted(location)

    @property
    def url(self) -> str:
        """The location as given, credentials included: for opening the store only, never for printing."""
        return self._url

    @property
    def is_url(self) -> bool:
        """True for a URL (scheme://...), False for a filesystem path."""
        return _SCHEME.match(self._url) is not None

    @property
    def secrets(self) -> tuple[str, ...]:
        """The credentials in the location, in every spelling they may be quoted in (raw, decoded, encoded)."""
        return self._secrets

    def redact(self, text: str) -> str:
        """`text` with every credential of this location replaced by ***."""
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text

    def __str__(self) -> str:
        return self._shown

    def __repr__(self) -> str:
        return f"StoreLocation({self._shown!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreLocation) and other._url == self._url

    def __hash__(self) -> int:
        return hash(self._url)


def _spellings(secret: str) -> set[str]:
    return {s for s in (secret, unquote(secret), quote(unquote(secret), safe="")) if s}


def _redacted(location: str) -> tuple[str, tuple[str, ...]]:
    """(the printable form, the secrets) of a location; InvalidInput for a URL that cannot be one."""
    if not _SCHEME.match(location):
        return location, ()
    parts = urlsplit(location)
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when asked
    except ValueError:
        netloc = parts.netloc.rpartition("@")[2]  # never echo the credentials before the host
        raise InvalidInput(f"{parts.scheme}://{netloc}: the port is not a number in 0..65535") from None
    secrets: set[str] = set()
    netloc = parts.netloc
    if parts.password:
        secrets |= _spellings(parts.password)
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{REDACTED}@{host}"
    query, hidden = [], False
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if value and _SECRET_QUERY.search(name):
            secrets |= _spellings(value)
            value, hidden = REDACTED, True
        query.append((name, value))
    for raw in re.findall(r"=([^&]*)", parts.query):  # the query's own spelling of each secret
        if unquote(raw) in secrets:
            secrets.add(raw)
    if not secrets:
        return location, ()  # verbatim: urlunsplit would also normalise what it need not touch (lmdb:///x)
    shown_query = urlencode(query, safe="*:/") if hidden else parts.query
    shown = urlunsplit((parts.scheme, netloc, parts.path, shown_query, parts.fragment))
    # longest first, so that a secret containing another is replaced whole
    return shown, tuple(sorted(secrets, key=len, reverse=True))

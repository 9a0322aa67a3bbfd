"""StoreLocation: a store's path or URL as given, which prints with its credentials removed.

A URL such as ``redis://:hunter2@cache-host:6379/0`` carries a password (so may its query: ``?password=``,
``?token=``). Anything that shows a location (CLI output, JSON, metrics labels, error messages) holds a
`StoreLocation` and prints `str(location)`, its *shown form*: the URL rebuilt from its parts with each credential
replaced by ``***`` and everything else as given. Only the code that opens the store reads `location.url`.

Redaction here is by structure, never by substring: the shown form is built from the URL's parts, so a password
``1`` in ``redis://:1@127.0.0.1`` is removed from the userinfo and nowhere else (replacing the text ``1`` would
print ``***27.0.0.***``, and anyone who knows the template reads the secret back). Text from elsewhere that names
the location (an LMDB error naming the store's directory) is shown by replacing the *whole location* — the URL, or
the directory it names — by its shown form (`redact`), never the secret alone. A URL whose structure is ambiguous
(a password holding ``/``, ``?`` or ``#`` unencoded cuts the authority short, so part of it would read as a port or
a path) is refused without echoing any of it.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from ..errors import InvalidInput

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Query parameters whose values are credentials (redis-py reads password= and username= from the query too).
_SECRET_QUERY = re.compile(r"pass|secret|token|auth|credential|key", re.I)
REDACTED = "***"
_PATH_SCHEMES = ("lmdb",)  # a location of these schemes names a directory: the text after `scheme://` is a path
_ENCODE_HINT = "a password holding '/', '?' or '#' must be percent-encoded (%2F, %3F, %23)"


class StoreLocation:
    """A store's path or URL. `str()` and `repr()` show it with its credentials removed; `url` is the location to
    open."""

    __slots__ = ("_url", "_shown", "_secrets", "_spellings")

    def __init__(self, location: str) -> None:
        if not isinstance(location, str):
            raise InvalidInput(f"a store location is a path or URL string, got {type(location).__name__}")
        self._url = location
        self._shown, self._secrets = _shown_form(location)
        self._spellings: list[tuple[str, str]] | None = None

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
        """The credentials in the location, raw and decoded, longest first. Never used to edit text (that would
        give a short one away): a test-time guard checks that no output carries them."""
        return self._secrets

    def redact(self, text: str) -> str:
        """`text` with this location — as given, and (for a path-like location) the directory it names, given or
        resolved — replaced by its shown form. The whole location is the unit replaced, never a credential alone,
        so nothing else in `text` changes. Text unchanged when the location holds no credential."""
        if not self._secrets:
            return text
        for raw, shown in self._spelled():
            text = text.replace(raw, shown)
        return text

    def _spelled(self) -> list[tuple[str, str]]:
        """(raw, shown) spellings of this location, longest raw first (a longer spelling contains a shorter)."""
        if self._spellings is None:
            pairs = {self._url: self._shown}
            m = _SCHEME.match(self._url)
            if m is not None and m.group(1).lower() in _PATH_SCHEMES:
                path, shown_path = self._url[m.end():], self._shown[m.end():]
                pairs[path] = shown_path
                real = os.path.realpath(path) if path else path
                # the resolved directory keeps the credential where the given path had it (the last components)
                pairs[real] = _shown_form(self._url[:m.end()] + real)[0][m.end():]
            self._spellings = sorted(((r, s) for r, s in pairs.items() if r and r != s), key=lambda p: -len(p[0]))
        return self._spellings

    def __str__(self) -> str:
        return self._shown

    def __repr__(self) -> str:
        return f"StoreLocation({self._shown!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreLocation) and other._url == self._url

    def __hash__(self) -> int:
        return hash(self._url)


def _shown_form(location: str) -> tuple[str, tuple[str, ...]]:
    """(the shown form, the credentials) of a location; InvalidInput, naming nothing of the userinfo, for a URL
    whose parts cannot be told apart."""
    m = _SCHEME.match(location)
    if m is None:
        return location, ()
    scheme = m.group(1)
    parts = urlsplit(location)
    after = parts.path + parts.query + parts.fragment
    # an unencoded '/', '?' or '#' in a password ends the authority early: the rest of it reads as a port or path
    cut_short = scheme.lower() not in _PATH_SCHEMES and "@" not in parts.netloc and "@" in after
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when asked
    except ValueError:
        if cut_short:
            raise InvalidInput(f"{scheme}:// URL: the part before its '@' is not a host and port; "
                               f"{_ENCODE_HINT}") from None
        host = parts.netloc.rpartition("@")[2]  # everything before the '@' (the credentials) is left out
        raise InvalidInput(f"{scheme}://{host}: the port is not a number in 0..65535") from None
    if cut_short and parts.netloc and ("@" in parts.path + parts.fragment or not parts.hostname):
        raise InvalidInput(f"{scheme}:// URL: an '@' after its host; {_ENCODE_HINT}")
    secrets: set[str] = set()
    netloc = parts.netloc
    if parts.password:
        secrets |= _decoded(parts.password)
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:{REDACTED}@{host}"
    query = []
    for field in parts.query.split("&") if parts.query else []:
        name, eq, value = field.partition("=")
        if eq and value and _SECRET_QUERY.search(unquote(name)):
            secrets |= _decoded(value)
            value = REDACTED
        query.append(f"{name}{eq}{value}")
    if not secrets:
        return location, ()  # as given, byte for byte
    shown = location[:m.end()] + netloc + parts.path
    shown += ("?" + "&".join(query)) if parts.query else ""
    shown += ("#" + parts.fragment) if parts.fragment else ""
    return shown, tuple(sorted(secrets, key=len, reverse=True))


def _decoded(secret: str) -> set[str]:
    """A credential as written in the URL and as the backend receives it (percent-decoded)."""
    return {s for s in (secret, unquote(secret)) if s}

"""Values as text a terminal shows safely: user-chosen strings, byte counts, times, namespaces.

Every string a user or a tenant chose (extra_key, paths, store URLs, finding details) goes through `shown`:
control characters and invisible format characters are escaped (`\\x1b`, `\\n`, `\\u202e`), and a value with
leading or trailing whitespace, or an empty one, is shown in double quotes, so `" t1"` and `"t1"` never look
alike and a tenant name cannot colour, move or split the operator's terminal. Rich markup is never interpreted
in such text (`esc` escapes it for a markup string).
"""

from __future__ import annotations

import re
import time
from typing import Any

# C0/C1 controls, soft hyphen, bidi and zero-width format characters, BOM, lone surrogates (undecodable bytes)
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
                     r"\ud800-\udfff]")


def escape_controls(text: str) -> str:
    """`text` with control and invisible format characters escaped (\\x1b, \\n, \\u202e)."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def shown(text: str | None, none: str = "-") -> str:
    """A user-chosen string made safe to print (see the module docstring); `none` for None."""
    if text is None:
        return none
    safe = escape_controls(text)
    if safe != safe.strip() or not safe or safe == none or safe.startswith('"'):
        return '"' + safe.replace('"', '\\"') + '"'
    return safe


def literal(text: str) -> str:
    """kvc's own words for a rich markup string, taken literally (any user text in them already `shown`)."""
    from rich.markup import escape

    return escape(text)


def esc(text: str | None, none: str = "-") -> str:
    """`shown(text)` escaped for a rich markup string."""
    from rich.markup import escape

    return escape(shown(text, none))


def ns_label(info: Any) -> str:
    """A namespace (anything with extra_key and salt_fingerprint) as ``extra_key/fingerprint`` for a markup
    string, `-` for an absent part."""
    return f"{esc(info.extra_key)}/{info.salt_fingerprint or '-'}"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def when(ts: float) -> str:
    """A unix time as a short local timestamp ('-' for never)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"

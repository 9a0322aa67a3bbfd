"""What a command reads from its command line beyond typer's types: a request's token ids (--tokens,
--tokens-file) and its namespace (--extra-key with the salt from `kvc.secrets`). Every failure is a `UsageError`
naming the option and the first bad value: exit 2, one line. A file it writes is `kvc.outputs`'s.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvcache.types.namespace import Namespace

from .errors import UsageError
from .secrets import salt_from

if TYPE_CHECKING:
    import numpy as np

_INT = re.compile(r"[0-9]+", re.ASCII)  # ASCII digits only: '٣' is a digit to Python, not a token id
_TOKEN_MAX = 2**32 - 1
# A --tokens-file holds one request: as long as the longest trace line (about two million token ids). /dev/zero
# or a runaway pipe is refused at this many bytes instead of read until memory runs out.
MAX_TOKENS_FILE_BYTES = 16 << 20


def parse_tokens(text: str, source: str = "--tokens") -> "np.ndarray":
    """Token ids from '1,2,3', '1 2 3' or a JSON array of integers; UsageError naming the first bad one."""
    import numpy as np

    text = text.strip()
    if text.startswith("["):
        try:  # typed: a nested array is an error at its first element, never a recursion
            items = msgspec.json.decode(text, type=list[int])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise UsageError(f"{source}: not a JSON array of token ids: {exc}") from None
        words = [str(x) for x in items]
    else:
        words = [w for w in re.split(r"[\s,]+", text) if w]
    if not words:
        raise UsageError(f"{source}: no token ids")
    for i, w in enumerate(words):
        if not _INT.fullmatch(w) or int(w) > _TOKEN_MAX:
            raise UsageError(f"{source}: token {i} is {w[:40]!r}, not an integer in 0..{_TOKEN_MAX} "
                             f"(ASCII digits)")
    return np.array([int(w) for w in words], dtype=np.uint32)


def tokens_arg(tokens: str | None, tokens_file: Path | None) -> "np.ndarray | None":
    """The request's tokens from --tokens or --tokens-file (not both); None when neither is given."""
    if tokens is not None and tokens_file is not None:
        raise UsageError("give --tokens or --tokens-file, not both")
    if tokens_file is not None:
        return parse_tokens(read_bounded(tokens_file, MAX_TOKENS_FILE_BYTES, "--tokens-file"), str(tokens_file))
    if tokens is not None:
        return parse_tokens(tokens)
    return None


def read_bounded(path: Path, limit: int, option: str) -> str:
    """The text of `path` (a file, or a pipe such as `<(...)`), at most `limit` bytes: UsageError beyond, or when
    it cannot be read. Undecodable bytes are kept (surrogateescape) for the parser to name."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UsageError(f"{option} {path}: more than {limit} bytes, the most {option} reads")
    return data.decode("utf-8", errors="surrogateescape")


def namespace_arg(extra_key: str | None, salt: str | None, salt_file: Path | None = None) -> Namespace:
    """The namespace named on the command line (`""` and no value are the default namespace); the salt from
    --salt, --salt-file, stdin or KVC_SALT (kvc.secrets)."""
    return Namespace(extra_key, salt_from(salt, salt_file))


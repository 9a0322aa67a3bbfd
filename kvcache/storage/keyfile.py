"""The fingerprint key file of a store directory: the per-deployment secret behind salt fingerprints and the
namespace ids outputs show (`kvcache.types.namespace`).

The key lives beside the store it keys (``fingerprint.key`` in an LMDB store's directory: hex, one line, mode
0600), so every process that opens the store shows the same fingerprints and nobody without read access to the
store can turn a fingerprint back into a short salt. It is written once, when the store is created (or when a
store made before keys existed is first opened for writing), and never changed: registry records keep the
fingerprints they were written with.
"""

from __future__ import annotations

import os
import tempfile

from ..errors import StoreError
from ..types.namespace import new_fingerprint_key, parse_fingerprint_key

KEY_FILE = "fingerprint.key"


def read_key(directory: str) -> bytes | None:
    """The key in `directory`'s key file; None when there is none or this user may not read it. StoreError when
    it cannot be read otherwise, or holds no key."""
    path = os.path.join(directory, KEY_FILE)
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(256)
    except FileNotFoundError:
        return None
    except PermissionError:
        # Another user's store, readable but not its key (a monitoring account): the registry's fingerprints
        # still read as recorded; what this process derives itself is keyed by its own key (kvcache.types.namespace).
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(path, f"cannot read the fingerprint key: {exc}") from None
    try:
        return parse_fingerprint_key(text, path)
    except ValueError as exc:
        raise StoreError(path, f"not a fingerprint key file ({exc})") from None


def ensure_key(directory: str) -> bytes:
    """The key in `directory`'s key file, writing a new one (mode 0600) when there is none. Two processes racing
    here agree: the file appears whole (temp file + link) and the loser reads the winner's."""
    key = read_key(directory)
    if key is not None:
        return key
    fd, tmp = tempfile.mkstemp(prefix=".fingerprint-", dir=directory)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(new_fingerprint_key().hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, os.path.join(directory, KEY_FILE))
        except FileExistsError:
            pass  # another process wrote it first: theirs is the key
    except OSError as exc:
        raise StoreError(directory, f"cannot write the fingerprint key file: {exc}") from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone; nothing else to clean
    key = read_key(directory)
    assert key is not None
    return key

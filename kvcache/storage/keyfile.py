"""The fingerprint key file of a store directory: the per-deployment secret behind salt fingerprints and the
namespace ids outputs show (`kvcache.types.namespace`).

The key lives beside the store it keys (``fingerprint.key`` in an LMDB store's directory: hex, one line, mode
0600), so every process that opens the store shows the same fingerprints and nobody without read access to the
key can turn a fingerprint back into a short salt. It is part of the store: written once, when the store is
created, and never replaced behind anyone's back. A store whose key file is missing, empty or not a key is
refused (`KeyFileError`, naming the way out: restore the file, or `kvc init --rekey`, which makes a new key and
says what changes). A key file this user may not read is refused wherever the key is needed (writing the store,
deriving an id or a fingerprint); a read-only open goes on without it, showing what the registry recorded (a
monitoring account: the key is 0600 and the store owner's).

A store made before key files existed has none: it is refused like any store whose key is missing, and
`kvc init --rekey` gives it one (its registry's fingerprints were keyed by a constant of the code then).
"""

from __future__ import annotations

import enum
import os
import stat
import tempfile
from collections.abc import Iterable

import msgspec

from ..errors import KeyFileError, KeyMismatch, StoreError
from ..types.fingerprint_key import new_fingerprint_key, parse_fingerprint_key
from ..types.ids import NamespaceId, PageHash
from ..types.keys import hash_root_of_id
from .api import NamespaceRecord, PageMeta, VerifyFinding
from .codec import engine_keyed

KEY_FILE = "fingerprint.key"
KEY_MODE = 0o600
_MAX_READ = 256  # a key is at most 128 hex digits and a newline: more is not a key file


class KeyState(enum.StrEnum):
    """What a store's key file is, to this user."""

    PRESENT = "present"  # a key, readable here
    MISSING = "missing"  # no file
    EMPTY = "empty"  # a file with nothing in it
    CORRUPT = "corrupt"  # a file that is not a key (bad hex, wrong length, not text, too long)
    UNREADABLE = "unreadable"  # a file this user may not read (or one the OS fails to read)


class KeyFileStatus(msgspec.Struct, frozen=True):
    """A store's key file as this user finds it, without the key itself (safe to print)."""

    path: str
    state: KeyState
    mode: int | None  # permission bits, when the file can be stat'ed
    why: str = ""  # what was wrong, for every state but PRESENT (never the file's content)

    @property
    def wide(self) -> bool:
        """Whether group or other may read or write the key (it should be 0600)."""
        return self.mode is not None and bool(self.mode & 0o077)

    def refusal(self) -> str:
        """The one line that refuses a command over this key file (not PRESENT), with the way out."""
        way_out = ("restore it from a backup of the store, or run `kvc init --rekey` to make a new key (display "
                   "ids and salt fingerprints then change, and pages hashed under the old key are not found again)")
        if self.state is KeyState.MISSING:
            return (f"the store's fingerprint key file is missing (a store made before kvc kept one has none "
                    f"either): {way_out}")
        if self.state is KeyState.UNREADABLE:
            return (f"the store's fingerprint key file is not readable by this user ({self.why}): this needs the "
                    f"key (read-only `kvc ns ls`, `kvc stats` and `kvc audit` work without it)")
        return f"the store's fingerprint key file is {self.why}: {way_out}"


def _path(directory: str) -> str:
    return os.path.join(directory, KEY_FILE)


def _load(directory: str) -> tuple[KeyFileStatus, bytes | None]:
    path = _path(directory)
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return KeyFileStatus(path, KeyState.MISSING, None, "missing"), None
    except OSError:
        mode = None  # a directory this user may list but not search: the open below says what
    try:
        # non-blocking: a FIFO put in its place must not hang every command; and only a regular file is a key file
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return KeyFileStatus(path, KeyState.CORRUPT, mode, "not a regular file"), None
            raw = os.read(fd, _MAX_READ + 1)  # bounded: a huge file is not a key
        finally:
            os.close(fd)
    except FileNotFoundError:
        return KeyFileStatus(path, KeyState.MISSING, None, "missing"), None
    except PermissionError:
        return KeyFileStatus(path, KeyState.UNREADABLE, mode, "permission denied"), None
    except OSError as exc:
        return KeyFileStatus(path, KeyState.UNREADABLE, mode, exc.strerror or type(exc).__name__), None
    if not raw.strip():
        return KeyFileStatus(path, KeyState.EMPTY, mode, "empty"), None
    try:
        if len(raw) > _MAX_READ:
            raise ValueError(f"over {_MAX_READ} bytes")
        key = parse_fingerprint_key(raw.decode("ascii"), path)
    except (ValueError, UnicodeDecodeError):
        # the content is a secret, or garbage: never echoed
        return KeyFileStatus(path, KeyState.CORRUPT, mode, "not a key (a key is 32 to 128 hex digits on one "
                                                            "line)"), None
    return KeyFileStatus(path, KeyState.PRESENT, mode), key


def key_status(directory: str) -> KeyFileStatus:
    """What `directory`'s key file is, to this user (never raises for the file's state)."""
    return _load(directory)[0]


def read_key(directory: str) -> bytes | None:
    """The key in `directory`'s key file; None when there is none or this user may not read it. StoreError when
    it holds no key (empty, corrupt) or the OS fails to read it. (An open checks more: `store_key`.)"""
    status, key = _load(directory)
    if status.state is KeyState.MISSING or (status.state is KeyState.UNREADABLE
                                             and status.why == "permission denied"):
        return None
    if key is None:
        raise StoreError(status.path, f"not a fingerprint key file ({status.why})")
    return key


def key_if_any(directory: str) -> bytes | None:
    """The key in `directory`'s key file, or None whatever keeps it from being read (missing, empty, not a key,
    unreadable): for an audit, which reports the key file itself (`key_findings`) and goes on without it."""
    return _load(directory)[1]


def store_key(directory: str, writable: bool) -> bytes | None:
    """The key of the existing store in `directory`, as an open needs it: KeyFileError (one line, the way out)
    when the file is missing, empty or not a key, or when this user may not read it and `writable` (a writer
    records fingerprints under it). None: a read-only open by a user who may not read the key."""
    status, key = _load(directory)
    if key is not None:
        return key
    if status.state is KeyState.UNREADABLE and not writable:
        return None
    raise KeyFileError(status.path, status.refusal())


def _write_temp(directory: str, key: bytes) -> str:
    fd, tmp = tempfile.mkstemp(prefix=".fingerprint-", dir=directory)  # mkstemp creates it 0600
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_key(directory: str) -> bytes:
    """The key of a store created now in `directory`: a new one written (mode 0600), or the one a racing creator
    wrote first (the file appears whole, temp file + link, so both agree)."""
    tmp = None
    try:
        tmp = _write_temp(directory, new_fingerprint_key())
        try:
            os.link(tmp, _path(directory))
        except FileExistsError:
            pass  # another process wrote it first: theirs is the key
        _fsync_dir(directory)
    except OSError as exc:
        raise StoreError(directory, f"cannot write the fingerprint key file: {exc}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass  # already gone; nothing else to clean
    return store_key(directory, writable=True)  # type: ignore[return-value]  # writable: a key or an error


def ensure_key(directory: str) -> bytes:
    """The key of the store in `directory`, writing a new one (0600) when there is no key file: what `kvc migrate`
    gives a store made before key files (format 1). KeyFileError when the file is empty, not a key, or not
    readable here (those are never replaced)."""
    status, key = _load(directory)
    if key is not None:
        return key
    if status.state is KeyState.MISSING:
        return create_key(directory)
    raise KeyFileError(status.path, status.refusal())


def prepare_new_key(directory: str) -> tuple[bytes, str]:
    """A new key and the 0600 temp file holding it in `directory`, for `install_key` (the key a rekey makes)."""
    key = new_fingerprint_key()
    try:
        return key, _write_temp(directory, key)
    except OSError as exc:
        raise StoreError(directory, f"cannot write the fingerprint key file: {exc}") from None


def install_key(directory: str, temp: str) -> None:
    """Put the key file `prepare_new_key` wrote in place of `directory`'s (atomic: old key or new, never half)."""
    try:
        os.replace(temp, _path(directory))
        _fsync_dir(directory)
    except OSError as exc:
        raise StoreError(directory, f"cannot replace the fingerprint key file: {exc}") from None


def key_findings(directory: str, repair: bool = False) -> list[VerifyFinding]:
    """The audit's findings on `directory`'s key file: `key_file` when it is missing, empty or not a key, or when
    a user who may write the store cannot read it (a read-only user who cannot is a monitoring account: no
    finding, the key is not theirs to read); `key_mode` when group or other may read or write it (`repair`:
    chmod 600, then the finding is `repaired`)."""
    status = key_status(directory)
    found = []
    writer = os.access(os.path.join(directory, "data.mdb"), os.W_OK)
    if status.state in (KeyState.MISSING, KeyState.EMPTY, KeyState.CORRUPT) or (
            status.state is KeyState.UNREADABLE and writer):
        found.append(VerifyFinding("key_file", None, f"{status.path}: {status.refusal()}"))
    if status.wide and status.state is not KeyState.MISSING:
        fixed = False
        if repair:
            try:
                os.chmod(status.path, KEY_MODE)
                fixed = True
            except OSError:
                pass  # not the owner: reported, not repaired
        found.append(VerifyFinding("key_mode", None, f"{status.path} is mode {status.mode:04o}: group or other may "
                                   f"read the store's key, and with it guess short salts back from fingerprints "
                                   f"(chmod 600 it)", repaired=fixed))
    return found


# --- a valid key, but not the store's ---------------------------------------------------------------------------


class KeyEvidence:
    """Whether a chain key is the one a store's pages were written under, from what the store recorded under it:
    each namespace record's roots (written with the first page under each root), each token page hanging from no
    stored page (its parent must be its own root), each engine page (its hash is its key's under its root). Each
    one either proves the key or contradicts it. The key is the store's when anything proves it; one that nothing
    proves and something contradicts is another key (a wrong backup restored, a tool that wrote a fresh one): an
    audit under it would call every chain head an orphan and every engine page misfiled, and a repair would
    delete them all. A store rekeyed on purpose (`kvc init --rekey --yes`) reads so too until `kvc audit --repair
    --force` removes what its old key wrote."""

    __slots__ = ("chain_key", "proves", "contradicts", "_roots")

    def __init__(self, chain_key: bytes) -> None:
        self.chain_key = chain_key
        self.proves = 0
        self.contradicts = 0
        self._roots: dict[tuple[bytes, NamespaceId], PageHash] = {}

    def root(self, layout_id: bytes, ns_id: NamespaceId) -> PageHash:
        """The root of (layout, namespace) under the key (computed once)."""
        pair = (layout_id, ns_id)
        found = self._roots.get(pair)
        if found is None:
            found = self._roots[pair] = hash_root_of_id(layout_id, ns_id, self.chain_key)
        return found

    def _count(self, proven: bool) -> None:
        if proven:
            self.proves += 1
        else:
            self.contradicts += 1

    def record(self, ns_id: NamespaceId, record: NamespaceRecord, layout_ids: Iterable[bytes]) -> None:
        """A namespace record (registered under `ns_id`) and the layouts of the store: its recorded roots against
        the roots the key gives (a record without roots, or a store without layouts, says nothing)."""
        layouts = list(layout_ids)
        if record.roots and layouts:
            given = {self.root(lay, ns_id).hex() for lay in layouts}
            self._count(bool(given & set(record.roots)))

    def head(self, meta: PageMeta) -> None:
        """A token page whose parent is no stored page: its parent must be its namespace's root under the key."""
        if not meta.key:
            self._count(meta.parent == self.root(meta.layout_id, meta.ns_id))

    def engine_page(self, page_hash: bytes, meta: PageMeta) -> None:
        """An engine page: its hash must be its key's under its namespace's root under the key."""
        if meta.key:
            self._count(engine_keyed(page_hash, meta, (self.root(meta.layout_id, meta.ns_id),)))

    @property
    def mismatch(self) -> bool:
        """Whether the key is provably not the store's: nothing proves it, something contradicts it."""
        return self.contradicts > 0 and self.proves == 0


KEY_MISMATCH = "key_mismatch"  # the audit's finding kind for it


def mismatch_detail(directory: str, evidence: KeyEvidence) -> str:
    """The one line that names a key file that is not the store's key, and the way out."""
    return (f"{_path(directory)}: this store's key file is not the key its pages were written under ("
            f"{evidence.contradicts} namespace root(s) or page(s) recorded under another key, none under this one: "
            f"a wrong backup restored, or a tool that wrote a fresh key). Restore the store's own "
            f"{KEY_FILE} from a backup (nothing was written or removed under this one); if the key was replaced "
            f"on purpose (`kvc init --rekey --yes`), `kvc audit --repair --force` removes the pages written under "
            f"the old key")


def refuse_mismatch(directory: str, evidence: KeyEvidence) -> None:
    """KeyMismatch (one line, the way out) when `evidence` says the key is not the store's."""
    if evidence.mismatch:
        raise KeyMismatch(_path(directory), mismatch_detail(directory, evidence).split(": ", 1)[1])

"""LMDB and OS faults under a store directory as typed StoreErrors: what opening, reading and writing an environment
(`env`, `shared_env`) and rebuilding one (`salvage`) raise instead of LMDB's and the OS's own exceptions.

Running out of disk surfaces from LMDB as EIO at commit; `translate` reports it as StoreFull when the disk is full.
"""

from __future__ import annotations

import errno
import os

import lmdb

from ...errors import StoreDamaged, StoreError, StoreFull, StoreReadOnly


def error_code(exc: BaseException) -> int | None:
    """The errno an LMDB or OS fault carries (None: it carries none)."""
    code = getattr(exc, "errno", None) or getattr(exc, "code", None)
    return code if isinstance(code, int) else None


def _disk_full(path: str, wanted: int) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < max(wanted, 1 << 20)


def translate(exc: BaseException, path: str, doing: str, wanted: int = 0) -> StoreError:
    """A typed StoreError for an LMDB or OS fault under `path`."""
    code = error_code(exc)
    if code in (errno.ENOSPC, errno.EDQUOT) or (code == errno.EIO and _disk_full(path, wanted)):
        need = f" (needed about {wanted} bytes)" if wanted else ""
        return StoreFull(path, f"{doing}: no space left on the disk{need}")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or isinstance(exc, lmdb.ReadonlyError):
        return StoreReadOnly(path, f"{doing}: the location is read-only ({exc})")
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError)):
        return StoreDamaged(path, f"{doing}: LMDB found a damaged page ({type(exc).__name__}); `kvc audit` says what "
                                  f"is damaged, and `kvc audit --repair` rebuilds the store from what still reads "
                                  f"back sound (keeping the file beside it)")
    return StoreError(path, f"{doing}: {exc}")


def damaged(path: str, exc: BaseException) -> StoreError:
    """The StoreError of a record that does not decode (`exc`, msgspec's), naming the cure."""
    return StoreError(path, f"a damaged record in the store ({exc}); run `kvc audit` to see it and "
                            f"`kvc audit --repair` to remove it")

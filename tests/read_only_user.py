"""A user who may read a store but write nothing of it (a monitoring account), for tests that run kvc as one.

As root the mode bits bind only without CAP_DAC_OVERRIDE and its kin, so the command runs with every capability
dropped (`setpriv`), on a store whose files another uid owns: root is then "other" to them, exactly what a
monitoring account is. Not as another user: that one could not reach a checkout under a 0700 directory (a clone in
`mktemp -d`), nor its .venv. As an ordinary user the mode bits bind already: the store keeps its owner and loses
its write bits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OTHER_UID = 65534  # nobody: the owner of the store while it is read as a monitoring account

# the prefix that runs a command without root's capabilities (empty for an ordinary user)
NO_CAPS = (["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all"]
           if os.geteuid() == 0 else [])


@contextmanager
def read_only_store(store: Path) -> Iterator[None]:
    """Inside: `store` (an LMDB store directory) can be read but neither it nor any file in it written by a
    command run under NO_CAPS; LMDB's lock file included. Its owner and modes are restored on leaving."""
    files = [store, *store.iterdir()]
    saved = {f: os.stat(f) for f in files}
    try:
        for f in files:
            if os.geteuid() == 0:
                os.chown(f, OTHER_UID, OTHER_UID)
            # the key file stays 0600: a monitoring account reads the registry, not the key
            os.chmod(f, 0o555 if f.is_dir() else (0o600 if f.name == "fingerprint.key" else 0o444))
        yield
    finally:
        for f, st in saved.items():
            if os.geteuid() == 0:
                os.chown(f, st.st_uid, st.st_gid)
            os.chmod(f, st.st_mode & 0o7777)


def files_and_mtimes(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file in `directory`: name -> (mtime in ns, size)."""
    return {f.name: (f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(directory.iterdir())}

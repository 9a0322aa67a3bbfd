"""The live caches of a store, found from its serving records (kvcache.live.serves): stale records are skipped,
another machine's are kept unchecked."""

import os
import socket
import subprocess
import sys

from factories import make_layout, make_store
from kvcache.live.serves import live_serves, where
from kvcache.storage.api import ServeRecord


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it, which it does not do at once)


def test_records_of_dead_or_silent_servers_are_skipped_and_another_hosts_kept(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    try:
        me = socket.gethostname()
        dead = ServeRecord("a" * 32, _dead_pid(), me, str(tmp_path / "dead.sock"), 1.0)
        silent = ServeRecord("b" * 32, os.getpid(), me, str(tmp_path / "nobody.sock"), 2.0)  # alive, no socket
        remote = ServeRecord("c" * 32, 1, me + "-elsewhere", "/run/kvc/x.sock", 3.0)
        for record in (dead, silent, remote):
            store.register_serve(record)
        found = live_serves(store)
        assert [(s.record, s.local) for s in found] == [(remote, False)]
        assert where(remote) == f"{me}-elsewhere:/run/kvc/x.sock" and where(silent) == silent.socket
    finally:
        store.close()

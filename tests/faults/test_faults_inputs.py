"""Inputs that escaped the error contract (issue 14, item 5), and `kvc init` on a full disk (item 2): each is one
line on stderr, exit 2, no traceback, and nothing half-made left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

from typer.testing import CliRunner

import faultkit
from kvc.main import app
from kvcache.storage.registry import open_store
from kvcache.types.layout import KVLayout

runner = CliRunner()
BAD_URLS = ["redis://[::1", "redis://127.0.0.1:6379/0?socket_timeout=abc",
            "redis://127.0.0.1:6379/0?ssl_cert_reqs=bogus", "rediss://127.0.0.1:6379/0?ssl_cert_reqs=bogus",
            "redis://127.0.0.1:6379/0?timeout=nan", "redis://127.0.0.1:6379/0?timeout=inf",
            "redis://127.0.0.1:99999/0", "redis://u:pw@127.0.0.1:x/0", "redis://127.0.0.1:6379/x"]


def _one_line_exit_2(args) -> bool:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_bad_inputs_are_one_line_and_exit_2(tmp_path):
    cases = [("ns", "ls", "--store", url) for url in BAD_URLS]
    ok = sum(_one_line_exit_2(args) for args in cases)
    assert "pw" not in runner.invoke(app, ["ns", "ls", "--store", BAD_URLS[7]]).stderr  # the password stays hidden
    # a trace that is one endless line: refused on its first line, not read into memory whole
    endless = faultkit.kvc("replay", "/dev/zero", "--store", tmp_path / "none", timeout=60)
    ok += endless.returncode == 2 and endless.stderr.count("\n") == 1 and "/dev/zero:1" in endless.stderr
    # an upper-case scheme names the same store as the lower-case one
    store = tmp_path / "store"
    open_store(str(store), KVLayout("in@r1", 1, 1, 4, "float16", 4), create=True).close()
    upper = runner.invoke(app, ["ns", "ls", "--store", f"LMDB://{store}", "--json"])
    ok += upper.exit_code == 0 and not (tmp_path / "LMDB:").exists()
    total = len(cases) + 2
    faultkit.record("fuzzed inputs: bad store URLs, an endless trace line, LMDB:// in capitals", total, ok,
                    total - ok, "one line on stderr, exit 2 (the capital scheme opens the store)")
    assert ok == total


def test_init_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        faultkit.skip_or_fail("the full-disk trial mounts a small tmpfs: it needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        faultkit.skip_or_fail(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    outcomes = []
    try:
        # KiB of the 256 taken: full; room for the lock file but not the data; for an empty store but not its
        # layout record
        for fill in (256, 184, 172):
            filler = disk / f"fill-{uuid.uuid4().hex[:6]}"
            with open(filler, "wb") as f:
                try:
                    f.write(b"\0" * (fill << 10))
                except OSError:
                    pass  # full before the end: that is the point
            store = disk / "store"
            out = faultkit.kvc("init", "--store", store, "--page-size", 4, timeout=60)
            clean = out.returncode == 2 and out.stderr.count("\n") == 1 and "no space left" in out.stderr
            outcomes.append(clean and not store.exists())
            filler.unlink()
        again = faultkit.kvc("init", "--store", disk / "store", "--page-size", 4, timeout=60)  # room again
        assert again.returncode == 0, again.stderr
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    faultkit.record("kvc init on a full disk", len(outcomes), sum(outcomes), len(outcomes) - sum(outcomes),
                    "one line, exit 2, no directory left; init works once there is room")
    assert all(outcomes), outcomes

"""Start-up (issue 13): commands that move no KV import no torch (on 0f180b0 `kvc --version` alone imported it:
3.8 s of 4-7 s). Wall times are measured by benchmarks/bench_startup.py, not asserted here."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

KVC = Path(sys.executable).with_name("kvc")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("startup") / "store"
    subprocess.run([str(KVC), "init", "--store", str(path)], check=True, capture_output=True)
    return path


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["ns", "ls"], ["ns", "ls", "--json"], ["stats"],
                                  ["stats", "--prom"], ["audit"], ["ns", "--help"], ["prefetch", "--help"]])
def test_store_only_commands_never_import_torch(store, args):
    # -X importtime lists every module the real entry point imports, one per line, on stderr
    proc = subprocess.run([sys.executable, "-X", "importtime", str(KVC), *args, "--store", str(store)]
                          if args[0] in ("ns", "stats", "audit") and "--help" not in args
                          else [sys.executable, "-X", "importtime", str(KVC), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.M)
    assert "kvc.main" in modules  # the listing is real
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]
    assert "kvcache.engine.cache" not in modules and "pydantic" not in modules

"""The examples in examples/ run and say what the README says they say."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_library_quickstart():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "library_quickstart.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("a1 (tenant-a/") and "0 cached tokens" in lines[0]
    assert "32 cached tokens" in lines[1]  # a2 shares tenant a's system prompt
    assert "0 cached tokens" in lines[2]  # b1: same tokens, other tenant: nothing shared
    assert lines[-1].startswith("audit ok=True")
    assert "secret" not in out.stdout

"""The README's Python examples run as written (in order, in one namespace, in a temp dir)."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    script = "\n".join(blocks).replace("# ... scheduler steps, each calling cache.poll() ...", "cache.poll()")
    (tmp_path / "readme.py").write_text(script)
    out = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[0] == "True"  # the first block prints cache.audit().ok

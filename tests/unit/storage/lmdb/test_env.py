"""Store files that carry no process memory (LMDB's meminit)."""

import os
import subprocess
import sys
from pathlib import Path

PLANT = r"""
import sys
import numpy as np
from kvcache import KVLayout, Namespace, open_store, page_origins
from kvcache.types.keys import pack_tokens

marker = sys.argv[2].encode()
# Blocks of LMDB's page size full of the marker, each pinned below a small live block so the heap cannot give
# them back to the OS, then freed: LMDB's next page buffers are carved out of them.
junk, keep = [], []
for i in range(4000):
    junk.append(bytearray(marker * (4096 // len(marker) + 1))[:4090])
    keep.append(bytearray(600))
del junk
layout = KVLayout("marker@r1", layers=1, kv_heads=1, head_dim=20, dtype="float16", page_size=16)
with open_store(sys.argv[1], layout, create=True) as store:
    for n in range(40):
        tokens = pack_tokens(np.arange(n * 1000, n * 1000 + 128, dtype=np.uint32))
        hashes, origins = page_origins(layout, tokens, Namespace(f"t{n}", "s"))
        store.put(hashes, [np.zeros(layout.bytes_per_page, np.uint8) for _ in hashes], origins)
"""


def test_store_files_never_carry_process_memory(tmp_path):
    # Reproduces the report: with meminit=False the unused bytes of LMDB's pages went to disk as they were in
    # memory (9 copies of this marker in data.mdb, py-lmdb docstrings, kvcache source).
    marker = "KVC-PLANTED-" + os.urandom(6).hex()
    subprocess.run([sys.executable, "-c", PLANT, str(tmp_path / "s"), marker], check=True, timeout=120)
    for f in Path(tmp_path / "s").iterdir():
        assert marker.encode() not in f.read_bytes(), f.name

"""SGLang's `HiCacheFile` (its file-per-page L3) for `bench_l3.py`, run in the peer's interpreter.

Nothing here imports kvc, and kvc never imports this: `bench_l3.py` starts it with the interpreter that can import
sglang (--peer-python / $KVC_PEER_PYTHON). It stores the pages of the baseline's file (`pages` pages of `size`
bytes) with `HiCacheFile.batch_set` under 64-hex keys (SGLang's page keys) in a fresh directory, then answers the
driver, one line each on stdin:

  read N   N passes of `batch_get` of every page, in batches of `batch` pages, into the rows of a preallocated
           uint8 tensor (what HiCache's host pool hands it); answers the fastest pass's seconds;
  check    whether the rows hold the file's bytes (answers 1 or 0).

Answers are lines starting with RESULT (SGLang logs to the same streams). Run:
``python _hicache_file_worker.py PAGES_FILE SIZE PAGES BATCH DIRECTORY``.
"""

from __future__ import annotations

import sys
import time

RESULT = "@@hicache_file "


def main() -> int:
    path, size, pages, batch, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name="bench-l3")
    storage = HiCacheFile(config, file_path=directory)
    src = torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=pages * size).reshape(pages, size))
    keys = [f"{i:064x}" for i in range(pages)]
    for s in range(0, pages, batch):
        if not storage.batch_set(keys[s:s + batch], list(src[s:s + batch])):
            raise SystemExit("HiCacheFile.batch_set refused a page")
    dst = torch.zeros((pages, size), dtype=torch.uint8)
    rows = list(dst)

    def read() -> float:
        start = time.perf_counter()
        for s in range(0, pages, batch):
            got = storage.batch_get(keys[s:s + batch], rows[s:s + batch])
            if any(g is None for g in got):
                raise SystemExit("HiCacheFile.batch_get missed a page")
        return time.perf_counter() - start

    read()  # warm-up: the files' pages into the page cache, the tensor's rows faulted in
    print(RESULT + "ready", flush=True)
    for line in sys.stdin:
        ask = line.split()
        if ask[0] == "read":
            print(RESULT + repr(min(read() for _ in range(int(ask[1])))), flush=True)
        elif ask[0] == "check":
            print(RESULT + str(int(torch.equal(dst, src))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The data plane's reads of an LMDB store (`PageReads`): how many pages of a chain are stored, and their bytes
copied into the caller's buffers, verified. Both run in one short read transaction per batch.

Known traps, measured on the machines this was built on:

- A zero-copy value (``buffers=True``) is a view into the map that is valid only inside its transaction; used
  later it shows other data, and after a map resize it faults (SIGBUS). Pages are copied out inside the read
  transaction, and no view ever leaves it.
- A read transaction held open while writers churn pins every page it can see: one held across a churn grew a
  1 GiB store to 3.3 GiB. Read transactions here last one batch; `integrity` walks the store in chunks.
- ``torch.Tensor.copy_`` with 2 threads fell to ~0.3 GB/s at 256 KiB pages, where ``np.copyto`` into
  ``tensor.numpy()`` ran at ~7 GB/s. Copies go through the buffer protocol (a memoryview slice assignment is one
  memcpy, with less per-call overhead than ``np.copyto``), never through torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lmdb
import numpy as np

from ...errors import StoreChanged
from ...types.ids import PageHash
from ...types.layout import KVLayout
from ..checks import check_page_hashes, out_views_for
from ..codec import CHECKSUM_FIELD, HEADER, Checksum
from ..handle import count_read
from .access import AccessRecords
from .lease import EnvLease

# A page at least this large is copied out of the map by numpy, which releases the GIL while it copies: a page not in
# memory faults in from disk during the copy, and under the GIL every other thread (a second reader, the engine's
# scheduler) would wait for that disk read. Below it a memoryview copy is cheaper than numpy's call.
RELEASED_COPY_BYTES = 1 << 20  # below it numpy's call (~1.5 us) would cost a hot copy more than a cold one gains


class PageReads:
    """`exists_prefix` and `get_into` of one handle. Owns nothing but the read loops: the environment is the
    handle's lease, the quarantined pages are its access records' (a quarantined page is a miss; one that fails
    its checks here joins them), the counters are its counters."""

    def __init__(self, lease: EnvLease, access: AccessRecords, counts: dict[str, int], checksum: Checksum,
                 layout: KVLayout | None) -> None:
        self._lease = lease
        self._access = access
        self._counts = counts
        self._checksum = checksum
        self._layout = layout  # the handle's: the size every page copied out must have

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap)."""
        if not hashes:
            return 0
        check_page_hashes(hashes)
        shared = self._lease.live()
        corrupt = self._access.corrupt

        found = 0  # pages found so far: what a read that fails midway still found

        def walk(txn: lmdb.Transaction) -> int:
            nonlocal found
            # The metadata record, not the page: a page and its metadata are written and removed in one
            # transaction, and a metadata record sits in a leaf page while a large page's value starts on an
            # overflow page of its own (a cold page, often a fault, per lookup: 1 MiB pages were looked up 12-48x
            # slower so). Damage that parts the two is found by get_into's checks and by verify.
            get, db = txn.get, shared.dbs.meta
            found = 0
            for h in hashes:
                if get(h, None, db) is None or (corrupt and h in corrupt):
                    break
                found += 1
            return found

        try:
            shared.reading(walk, buffers=True)
        except lmdb.Error:
            self._counts["read_errors"] += 1
        except StoreChanged:  # a lock-free read writers kept overtaking: nothing it found can be trusted
            self._counts["read_errors"] += 1
            found = 0
        return count_read(self._counts, found, len(hashes))

    def get_into(self, hashes: Sequence[PageHash], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views, each inside the read transaction and verified on
        the copy; return how many consecutive pages from the start were copied. A missing, corrupt or unreadable
        page ends the run (and is counted); one that fails its checks is quarantined (`access`)."""
        outs = out_views_for(hashes, out_views, self._layout)
        n = len(outs)
        if n == 0:
            return 0
        shared = self._lease.live()
        digest, seeds, stored = self._checksum.digest, self._checksum.seeds(hashes), CHECKSUM_FIELD.unpack_from
        digest_parts = self._checksum.digest_parts
        corrupt = self._access.corrupt
        suspect: list[PageHash] = []  # failed their checks: quarantined once the read is known sound (lock-free)
        done = 0  # pages copied and verified so far: what a read that fails midway still delivered

        def copy(txn: lmdb.Transaction) -> int:
            nonlocal done
            get, db = txn.get, shared.dbs.pages
            suspect.clear()
            done = 0
            for h, out, seed in zip(hashes, outs, seeds, strict=True):
                value = get(h, None, db)
                if value is None or (corrupt and h in corrupt):
                    break
                # A stored size other than a page's (the out views were checked above) is a damaged record: a
                # miss, quarantined like a checksum failure. The copy happens inside the transaction (see the
                # module docstring), and is checked on the copy, still in cache: what the caller got is what was
                # verified.
                if len(value) - HEADER != len(out):
                    suspect.append(h)
                    break
                if type(out) is memoryview:
                    if len(out) >= RELEASED_COPY_BYTES:  # numpy copies with the GIL released (see the constant)
                        np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(value, np.uint8, offset=HEADER))
                    else:
                        out[:] = value[HEADER:]
                    summed = digest(out, seed)
                else:  # a page in segments (checks.Segments): copied in order, summed as copied
                    out.fill(value[HEADER:])
                    summed = digest_parts(out.views, seed)
                if summed != stored(value)[0]:
                    suspect.append(h)
                    break
                done += 1
            return done

        try:
            shared.reading(copy, buffers=True)
            for h in suspect:
                self._access.quarantine(h)
        except lmdb.Error:
            self._counts["read_errors"] += 1
        except StoreChanged:  # a lock-free read writers kept overtaking: nothing it copied can be trusted
            self._counts["read_errors"] += 1
            done = 0
        return count_read(self._counts, done, n, copied=True)

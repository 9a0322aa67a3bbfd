"""SlotPool: one tier's KV storage, its page allocator, and the ownership ledger over its pages.

The bytes are a `KVPages` (`kv.py`): kvc's own token-major ``[slots, bytes_per_token]`` uint8 tensor, where one page
(`page_size` consecutive slots) is one contiguous span, or the per-layer tensors an engine owns. Allocation is page-granular and a page is never split between owners, so the ledger keeps one
owner per page; a slot's owner is its page's owner.

Ledger moves (`alloc`, `transfer`, `free`, `disperse`) validate their arguments (`InvalidInput`: a count that is
negative, not an int or more than the pool; pages that are not a 1-D integer array inside the pool; parts that do
not partition the holding), then check the current owner of every page, vectorised, and raise `OwnershipError` /
`DoubleFree`; a move that raises leaves the pool as it was. The one shortcut is a proof, not a skipped check: the
very array an owner's last alloc returned, bytes unchanged, with no move from that owner since, is still the
owner's page by page (see `_check`). With ``ledger=False`` the owner checks and records are
skipped (benchmarks measure the ledger's cost against that); the argument checks and the allocator are the same.

Runs: while the free stack's top still holds pages at their own index (a pool no push has reached there yet), an
alloc takes a run of consecutive pages, and the ledger records it as one slice. A proven run's owners are written
once, by the move that takes the proof back (with the new owner), not at alloc: until then `_unwritten` names
it, and everything that reads the ledger (`owners`, `ledger_codes`, a full check) writes the pending runs first.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import DoubleFree, InvalidConfig, InvalidInput, OwnershipError
from ..types.ids import OwnerCode
from ..types.owners import FREE_CODE, describe_code
from .kv import KVPages

_INDEX = np.int64


class SlotPool:
    """Pages of KV in one tier, each with exactly one recorded owner."""

    def __init__(self, name: str, num_pages: int, page_size: int, bytes_per_token: int,
                 device: str | torch.device = "cpu", pin_memory: bool = False, ledger: bool = True,
                 kv: KVPages | None = None) -> None:
        """`kv`: the tensors an engine owns (`KVPages.layer_first`), `num_pages` of them; None: kvc allocates its
        own token-major tensor on `device` (pinned when `pin_memory` and on the CPU)."""
        if num_pages < 0 or page_size < 1 or bytes_per_token < 1:
            raise InvalidConfig(f"{name} pool: num_pages={num_pages}, page_size={page_size}, "
                                f"bytes_per_token={bytes_per_token} is not a pool")
        if kv is None:
            kv = KVPages.own(num_pages, page_size, bytes_per_token, device, pin_memory)
        elif kv.num_pages != num_pages or kv.page_bytes != page_size * bytes_per_token:
            raise InvalidConfig(f"{name} pool: the engine's KV holds {kv.num_pages} pages of {kv.page_bytes} bytes; "
                                f"the pool needs {num_pages} of {page_size * bytes_per_token} "
                                f"({page_size} tokens of {bytes_per_token} bytes)")
        self.name = name  # "device" or "host": the tier, as errors and reports name it
        self.num_pages = num_pages
        self.page_size = page_size  # tokens (slots) per page
        self.page_bytes = page_size * bytes_per_token
        self.ledger = ledger  # False only to measure the ledger's cost
        self.kv = kv  # where the pages' bytes are (the spans every copy moves)
        # [num_pages, page_bytes] view when a page is one contiguous span (kvc's own pools), row p page p; None over
        # an engine's layer-first tensors
        self.pages = kv.views[0] if len(kv.views) == 1 else None
        # kvc's own pools: the token-major [slots, bytes_per_token] tensor itself (slot s is row s); None over an
        # engine's tensors
        self.storage = self.pages.view(num_pages * page_size, bytes_per_token) if kv.owned and self.pages is not None \
            else None
        self.device_type = kv.device.type  # "cpu" or "cuda": copies branch on it (a torch call to ask)
        # CPU pools of one span: the pages as a numpy array of opaque page-sized elements (`page_rows`), made once:
        # the host side of every copy indexes it (None otherwise).
        self._array = self.pages.numpy() if self.pages is not None and self.device_type == "cpu" else None
        self.page_rows = page_rows(self._array) if self._array is not None else None
        # Free pages are _stack[:free_pages]. Pop and push are slices: O(pages moved), never O(pool).
        self._stack = np.arange(num_pages, dtype=_INDEX)
        # _stack[:_run_end] still holds each page at its own index, as made: an alloc popped from below it takes the
        # run of pages top - n .. top - 1, whose owners are then one slice of the ledger, written like a memset
        # (a scatter of 512 owners costs ~3x). Every push lowers it to where the push began.
        self._run_end = num_pages
        self.free_pages = num_pages  # pages owned by FREE (read-only outside the pool; an attribute, not a property,
        # because admission reads it every time)
        # np.full writes every entry now: zero-filled (calloc) memory would fault in page by page on first use,
        # a cost that belongs to start-up, not to the first allocations.
        self._owner = np.full(num_pages, FREE_CODE, dtype=_INDEX)  # ledger: owner code per page
        self._mark = np.full(num_pages, -1, dtype=_INDEX)  # scratch for the duplicate check in free()
        self._arange = np.arange(num_pages, dtype=_INDEX)
        self._slot_offsets = np.arange(page_size, dtype=_INDEX)
        # owner -> (the array its last alloc returned, that array's bytes then, where those pages sit in the
        # ledger: the slice of a run, else the array): a proof that those pages are still the owner's, taken back by
        # the owner's next move (below). A move of exactly that array, unchanged, skips the per-page check and
        # writes the ledger where the proof says: a request's fresh pages come back whole at commit, and gathering
        # 500 owners from a ledger of millions costs more than the rest of the move.
        self._proofs: dict[OwnerCode, tuple[np.ndarray, bytes, slice | np.ndarray]] = {}
        # owner -> the run its last alloc took, not yet written to _owner (whose entries there still read FREE):
        # the move that takes the owner's proof back writes the run once, with its new owner, instead of twice. Only
        # a proven run is unwritten (its slice names its pages whatever the caller does to the array), and every
        # reader of _owner writes them all first (`_write_runs`): no check or view ever sees a stale entry.
        self._unwritten: dict[OwnerCode, slice] = {}

    # --- queries ---------------------------------------------------------------------------------------------

    @property
    def used_pages(self) -> int:
        """Pages owned by anyone but FREE."""
        return self.num_pages - self.free_pages

    @property
    def device(self) -> torch.device:
        """Where the pages' bytes live."""
        return self.kv.device

    def rows(self) -> np.ndarray:
        """The pages as a ``[num_pages, page_bytes]`` uint8 numpy array over the pool's own memory (row p is page p),
        for a CPU pool of one span, as the host pool always is: L3 reads and writes its pages there in place."""
        if self._array is None:
            raise InvalidConfig(f"{self.name} pool: its pages are not one span in CPU memory ({self.device}, "
                                f"{len(self.kv.views)} spans)")
        return self._array

    def owners(self, pages: np.ndarray) -> np.ndarray:
        """Ledger codes of `pages` (a copy)."""
        self._write_runs()
        codes: np.ndarray = self._owner[pages]
        return codes

    def ledger_codes(self) -> np.ndarray:
        """The whole ledger (a copy): owner code per page."""
        self._write_runs()
        return self._owner.copy()

    def free_list(self) -> np.ndarray:
        """The pages on the free stack (a copy)."""
        return self._stack[: self.free_pages].copy()

    def slots(self, pages: np.ndarray) -> np.ndarray:
        """Token slot indices of `pages`, in order (page p holds slots p*page_size .. p*page_size+page_size-1)."""
        if self.page_size == 1:
            return pages if type(pages) is np.ndarray and pages.dtype is _INT64 else np.asarray(pages, dtype=_INDEX)
        return (np.asarray(pages, dtype=_INDEX)[:, None] * self.page_size + self._slot_offsets).reshape(-1)

    # --- ledger moves ----------------------------------------------------------------------------------------

    def alloc(self, n: int, owner: OwnerCode) -> np.ndarray | None:
        """Take `n` free pages for `owner` (a ledger code). None when fewer than `n` are free: a full pool is an
        expected outcome, not an error."""
        if type(n) is not int or n < 0:
            n = self._count(n)
        top = self.free_pages
        if n > top:
            if n > self.num_pages:
                self._count(n)  # raises: more than the pool could ever give
            return None
        self.free_pages = top - n
        if top <= self._run_end:
            # A run: pages top - n .. top - 1, made rather than copied off the stack (whose span is cold memory by
            # now: reading it costs more than the copy), and one slice of the ledger.
            pages = np.arange(top - n, top, dtype=_INDEX)
            where: slice | np.ndarray = slice(top - n, top)
        else:
            pages = where = self._stack[top - n: top].copy()
        if self.ledger:
            # Pages on the stack are FREE: free() admits only owned, distinct pages, so no check is needed here.
            unwritten = self._unwritten
            if unwritten and owner in unwritten:  # the owner's previous run loses its proof: written now
                self._owner[unwritten.pop(owner)] = owner
            if type(where) is slice:
                unwritten[owner] = where  # written by the move that takes the proof back (see _unwritten)
            else:
                self._owner[where] = owner
            self._proofs[owner] = (pages, pages.tobytes(), where)
        return pages

    def transfer(self, pages: np.ndarray, src: OwnerCode, dst: OwnerCode) -> None:
        """Move `pages` from owner `src` to owner `dst`; every page must be owned by `src`."""
        if self.ledger:
            self._owner[self._check(pages, src, "transfer")] = dst
        else:
            self._check_pages(pages, "transfer")

    def disperse(self, pages: np.ndarray, owner: OwnerCode, parts: list[tuple[int, OwnerCode]]) -> None:
        """Move a holding of `owner`, exactly as `alloc` returned it, to several owners at once: `parts` lists
        ``(end, new_owner)`` for consecutive ranges of `pages` ([previous end, end), the last end = len(pages));
        FREE_CODE returns a range to the free list. One ownership check covers every range. Parts that do not
        partition `pages` are InvalidInput, and leave the pool as it was."""
        where: slice | np.ndarray = pages
        if self.ledger:
            where = self._check(pages, owner, "disperse")
        else:
            self._check_pages(pages, "disperse")
        run = where.start if type(where) is slice else -1  # a proven run: each part's owners are one slice too
        start, top0, n = 0, self.free_pages, len(pages)
        try:
            for end, dst in parts:
                if end < start or end > n:  # (past the holding, a run's slice would name others' pages)
                    raise ValueError
                if end == start:
                    continue
                part = pages[start:end]
                if self.ledger:
                    self._owner[slice(run + start, run + end) if run >= 0 else part] = dst
                start = end
                if dst == FREE_CODE:
                    top = self.free_pages
                    if top < self._run_end:
                        self._run_end = top
                    self._stack[top: top + len(part)] = part
                    self.free_pages = top + len(part)
            if start != n:
                raise ValueError
        except (ValueError, TypeError):
            # undo what the loop did: every page was owner's (checked above); the stack above top0 is free space
            if self.ledger:
                self._owner[where] = owner
            self.free_pages = top0
            raise InvalidInput(f"{self.name} pool: disperse parts {[p[0] for p in parts]} do not partition a "
                               f"holding of {len(pages)} pages") from None

    def free(self, pages: np.ndarray, owner: OwnerCode) -> None:
        """Return `pages`, owned by `owner`, to FREE."""
        if self.ledger:
            where = self._check(pages, owner, "free")
            k = len(pages)
            if not k:
                return
            # A page listed twice would land on the free stack twice and later be handed to two owners.
            mark, ids = self._mark, self._arange[:k]
            mark[pages] = ids
            if (mark[pages] != ids).any():
                dup = int(pages[int(np.flatnonzero(mark[pages] != ids)[0])])
                raise DoubleFree(self.name, "free", dup, self._slot_range(dup), describe_code(owner),
                                 "the same free (page listed twice)", 1)
            self._owner[where] = FREE_CODE
        else:
            self._check_pages(pages, "free")
            k = len(pages)
        top = self.free_pages
        if top < self._run_end:
            self._run_end = top
        self._stack[top: top + k] = pages
        self.free_pages = top + k

    # --- helpers ---------------------------------------------------------------------------------------------

    def _count(self, n: object) -> int:
        """`n` as a page count of an alloc, or InvalidInput (a bool, a float, a negative or too large count)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise InvalidInput(f"{self.name} pool: alloc of {n!r} pages: the count must be an int")
        if not 0 <= n <= self.num_pages:
            raise InvalidInput(f"{self.name} pool: alloc of {n} pages: the count must be in 0..{self.num_pages}")
        return int(n)

    def _check_pages(self, pages: np.ndarray, op: str) -> None:
        # Negative indices would wrap around to other owners' pages (numpy indexing wraps them, unsigned views
        # included) and floats would be truncated: both are refused before anything changes. Viewed as unsigned, a
        # negative page is huge, so one max() bounds both ends.
        try:
            # argmax, not max: a reduction's setup costs several times an argmax over a few hundred pages
            u = pages.view(np.uint64) if pages.dtype is _INT64 else pages.view(_UNSIGNED[pages.dtype])
            bad = u.ndim != 1 or (len(u) and u[u.argmax()] >= self.num_pages)
        except (AttributeError, KeyError, TypeError):  # not an array, or not of an integer dtype
            bad = True
        if bad:
            raise InvalidInput(f"{self.name} pool: {op} needs a 1-D integer array of pages in "
                               f"0..{self.num_pages - 1}, got {_describe(pages)}")

    def _check(self, pages: np.ndarray, owner: OwnerCode, op: str) -> slice | np.ndarray:
        """Check `pages` (as `_check_pages`) and that `owner` owns each of them; returns where they sit in the
        ledger (`_owner[where]` is their owners): the slice of the run an alloc took, when proven, else `pages`.

        Every check precedes a move from `owner`, so it takes the owner's proof back, whatever the outcome (a move
        that then fails only costs the owner's next move the full check). The proof holds when `pages` is the very
        array the owner's last alloc returned, with the same bytes: no page of the owner has moved since (that move
        would have taken the proof), and a move of others' pages that names the owner's pages fails its own check
        and moves nothing."""
        proof = self._proofs.pop(owner, None)
        unwritten = self._unwritten.pop(owner, None) if self._unwritten else None
        if proof is not None and proof[0] is pages and proof[1] == pages.tobytes():
            return proof[2]  # the caller writes every page of it (an unwritten run too), whatever the outcome
        if unwritten is not None:
            self._owner[unwritten] = owner
        self._write_runs()
        self._check_pages(pages, op)
        n = len(pages)
        if n:
            # Compared as bytes: one gather and one memcmp, several times cheaper than (a != b).any() on small
            # arrays.
            current = self._owner[pages]
            if current.tobytes() != owner.to_bytes(8, "little") * n:
                raise self._mismatch(op, pages, current, owner)
        return pages

    def _write_runs(self) -> None:
        """Write every unwritten run into the ledger, with its owner: before anything reads `_owner`."""
        if self._unwritten:
            owner = self._owner
            for code, run in self._unwritten.items():
                owner[run] = code
            self._unwritten.clear()

    def _slot_range(self, page: int) -> tuple[int, int]:
        return page * self.page_size, page * self.page_size + self.page_size - 1

    def _mismatch(self, op: str, pages: np.ndarray, current: np.ndarray, expected: int) -> OwnershipError:
        bad = np.flatnonzero(current != expected)
        i = int(bad[0])
        page, actual = int(pages[i]), int(current[i])
        cls = DoubleFree if actual == FREE_CODE else OwnershipError
        return cls(self.name, op, page, self._slot_range(page), describe_code(expected), describe_code(actual),
                   len(bad))

    def __repr__(self) -> str:
        return (f"SlotPool({self.name}, {self.used_pages}/{self.num_pages} pages used, page_size={self.page_size}, "
                f"{self.page_bytes} B/page, {self.device})")



_INT64 = np.dtype(np.int64)  # what alloc returns, and every holding made from its pages
# The unsigned view of each integer dtype (same width, no copy): a negative page reads as out of range.
_UNSIGNED = {np.dtype(t): np.dtype(t).str.replace("i", "u") for t in (np.int8, np.int16, np.int32, np.int64,
                                                                      np.uint8, np.uint16, np.uint32, np.uint64)}


def page_rows(pages: np.ndarray) -> np.ndarray:
    """A 2-D ``[pages, page_bytes]`` uint8 array (no copy) as a 1-D array of its rows, each one opaque element
    (numpy void): indexing rows is then one memcpy per row instead of numpy's byte-wise subspace loop (64 rows of
    512 B: 2.0 against 4.4 us)."""
    return pages.view(np.dtype((np.void, pages.shape[1]))).reshape(-1)


def _describe(pages: object) -> str:
    if isinstance(pages, np.ndarray):
        if pages.ndim == 1 and pages.dtype.kind in "iu" and len(pages):
            return f"{len(pages)} pages from {int(pages.min())} to {int(pages.max())}"
        return f"an array of shape {pages.shape} and dtype {pages.dtype}"
    return type(pages).__name__

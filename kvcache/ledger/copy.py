"""Copies of whole pages between a cache's two pools: the bytes under every ledger move.

On a GPU, a copy moves scattered pages of every span of a page (`kv.KVPages`: one span for kvc's own pools, one per
layer's K or V over an engine's tensors) with one gather and one scatter (`arena.SpanArena`), whatever the number of
pages or layers; it allocates nothing per call beyond what torch's caching allocators hand back.

- Both pools on the CPU: numpy (`rows.py`), a page a row for kvc's own pools, and over an engine's tensors one
  plan for the copy's pages applied to each span.
- A CUDA pool and the pinned host pool: queued on the copier's own stream, after the work already queued on the
  caller's current stream (an event, never a device-wide wait), and completed by the event `copy` returns. The host
  pool is seen from the GPU through unified addressing (`host_alias`), so the kernels gather and scatter its pages
  over the bus themselves: no staging through pageable memory, no CPU-side scatter. Where the driver refuses that
  alias, a copy stages through pinned memory instead, and device -> host then waits for itself (`Copier.aliased`
  says which path a copier took).

The contract an engine relies on (docs/gpu.md): kvc reads a page the engine wrote after everything the engine had
queued on its current stream when it handed kvc the page (commit, backup); a page kvc loaded is ready for the
stream that was current when the call that loaded it returned (admission waits on the copy's event there, on the
GPU, not on the host).
"""

from __future__ import annotations

import numpy as np
import torch

from .arena import AddressView, SpanArena, arenas
from .pools import SlotPool, page_rows
from .rows import SpanRows, copy_rows


class _CudaInterface:
    """A pointer the GPU can address, in the CUDA array interface `torch.asarray` reads (no copy is made)."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}
        self.owner = owner  # keeps the memory alive as long as the alias


def host_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """`host` (pinned, contiguous uint8) as a flat CUDA tensor over the same memory, which kernels on `device` read
    and write over the bus (unified addressing: a pinned page's device address is its host address). Checked by a
    round trip before use; None where the driver or torch refuses it."""
    if not host.is_pinned() or not host.is_contiguous() or host.numel() == 0:
        return None
    try:
        alias = torch.asarray(_CudaInterface(host.data_ptr(), host.numel(), host), device=device)
        if alias.data_ptr() != host.data_ptr() or alias.device.type != "cuda":
            return None
        probe = host.view(-1)[:1]
        before = int(probe.item())
        alias[:1].fill_((before + 1) % 256)
        torch.cuda.synchronize(device)
        ok = int(probe.item()) == (before + 1) % 256
        probe.fill_(before)
        return alias if ok else None
    except (RuntimeError, TypeError, ValueError):
        return None


def cuda_address_view(device: torch.device, owner: object) -> AddressView:
    """Views of device memory on `device` by address (`arena.AddressView`), keeping `owner` alive with each."""
    def view(ptr: int, nbytes: int) -> torch.Tensor:
        return torch.asarray(_CudaInterface(ptr, nbytes, owner), device=device)
    return view


class Copier:
    """Copies pages between one cache's device pool and its host pool, on a stream of its own when the device is
    a GPU. What each direction indexes is made once, here."""

    def __init__(self, device_pool: SlotPool, host_pool: SlotPool | None) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.cuda = device_pool.device_type == "cuda"
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device_pool.device) if self.cuda else None)  # type: ignore[no-untyped-call]
        # On a GPU: the device pool's spans as arenas (one, unless torch refused a view over them all), each with the
        # first byte of a page it covers; and with the alias, each arena's columns of the host pages in its element
        # type, which its gather lands in and its scatter reads.
        self._arenas: list[tuple[int, SpanArena]] = arenas(
            device_pool.kv, cuda_address_view(device_pool.device, device_pool.kv.views)) \
            if self.cuda and host_pool is not None else []
        self._host_columns: list[torch.Tensor] = []
        # On the CPU over an engine's tensors: (device rows, host rows) per span, numpy rows of one opaque element a
        # page's span, which one `SpanRows` plan a copy moves (kvc's own CPU pools copy whole page rows).
        self._row_pairs: list[tuple[np.ndarray, np.ndarray]] = []
        self.aliased = False  # a GPU copier whose kernels move the host pages themselves (no staging)
        if host_pool is not None and host_pool.pages is not None:
            if self.cuda:
                alias = host_alias(host_pool.pages, device_pool.device)
                if alias is not None:
                    self.aliased = True
                    pages = alias.view(host_pool.num_pages, host_pool.page_bytes)
                    self._host_columns = [pages[:, at:at + arena.page_bytes].view(arena.dtype)
                                          for at, arena in self._arenas]
            elif device_pool.page_rows is None:
                self._row_pairs = [(page_rows(d.numpy()), page_rows(h.numpy()))
                                   for d, h in device_pool.kv.pair(host_pool.kv)]

    def copy(self, src: SlotPool, src_pages: np.ndarray, dst: SlotPool, dst_pages: np.ndarray) \
            -> torch.cuda.Event | None:
        """Copy whole pages `src_pages` of `src` into `dst_pages` of `dst` (one of them this copier's device pool,
        the other its host pool). Returns the event that completes the copy when it was queued on the GPU, None
        when it has completed."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"copy of {len(src_pages)} pages into {len(dst_pages)}")
        ours, host = self.device_pool, self.host_pool
        if not ((src is ours and dst is host) or (src is host and dst is ours)):
            raise ValueError(f"a copier of {self.device_pool.name} <-> {self.host_pool and self.host_pool.name} "
                             f"asked to copy {src.name} -> {dst.name}")
        if not len(src_pages):
            return None
        to_host = src is ours
        if not self.cuda:
            if src.page_rows is not None and dst.page_rows is not None:
                copy_rows(dst.page_rows, dst_pages, src.page_rows, src_pages)
            else:
                plan = SpanRows(dst_pages, src_pages)
                for device_rows, host_rows in self._row_pairs:
                    if to_host:
                        plan.apply(host_rows, device_rows)
                    else:
                        plan.apply(device_rows, host_rows)
            return None
        stream = self.stream
        assert stream is not None
        device = self.device_pool.device
        stream.wait_stream(torch.cuda.current_stream(device))  # after what the engine queued (the pages it wrote)
        with torch.cuda.stream(stream):
            # both indexes in one upload; pinned, so it is queued, and torch's caching host allocator keeps the
            # pinned block until the upload has read it
            both = torch.from_numpy(np.stack([src_pages, dst_pages]).astype(np.int64, copy=False))
            both = both.pin_memory().to(device, non_blocking=True)
            src_index, dst_index = both[0], both[1]
            if self.aliased:
                self._move(to_host, src_index, dst_index)
            elif to_host:
                self._staged_to_host(src_index, dst, dst_pages)
                return None
            else:
                self._staged_to_device(src, src_pages, dst_index)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event

    def order_current_stream(self, event: torch.cuda.Event | None) -> None:
        """Make the caller's current stream wait for a copy's `event` (the GPU waits, the calling thread does not):
        what it queues from now on sees the copied pages. None (a copy that has completed): nothing to wait for."""
        if event is not None:
            torch.cuda.current_stream(self.device_pool.device).wait_event(event)

    def _move(self, to_host: bool, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
        """One gather and one scatter an arena (one arena: two launches, whatever the number of layers)."""
        for (_, arena), columns in zip(self._arenas, self._host_columns, strict=True):
            if to_host:
                columns.index_copy_(0, dst_index, arena.gather(src_index))
            else:
                arena.scatter(dst_index, columns.index_select(0, src_index))

    def _staged_to_host(self, src_index: torch.Tensor, dst: SlotPool, dst_pages: np.ndarray) -> None:
        """Device -> host without the alias: gather on the GPU, one copy over the bus into pinned rows, and the CPU
        scatters them once they have landed (this direction waits for itself)."""
        stream = self.stream
        assert stream is not None and dst.page_rows is not None
        parts = [arena.gather(src_index).view(torch.uint8) for _, arena in self._arenas]
        gathered = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        rows = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
        rows.copy_(gathered, non_blocking=True)
        stream.synchronize()
        copy_rows(dst.page_rows, dst_pages, page_rows(rows.numpy()), np.arange(len(dst_pages)))

    def _staged_to_device(self, src: SlotPool, src_pages: np.ndarray, dst_index: torch.Tensor) -> None:
        """Host -> device without the alias: a numpy gather into pinned rows (torch's caching host allocator keeps
        them until the copy that reads them is done), one copy over the bus, a scatter per arena on the GPU."""
        assert src.page_rows is not None
        n = len(src_pages)
        rows = torch.empty((n, src.page_bytes), dtype=torch.uint8, pin_memory=True)
        rows.numpy()[:] = src.page_rows[src_pages].view(np.uint8).reshape(n, src.page_bytes)
        staged = rows.to(self.device_pool.device, non_blocking=True)
        for at, arena in self._arenas:
            arena.scatter(dst_index, staged[:, at:at + arena.page_bytes].view(arena.dtype))


def copy_pages(src: SlotPool, src_pages: np.ndarray, dst: SlotPool, dst_pages: np.ndarray) -> torch.cuda.Event | None:
    """Copy whole pages `src_pages` of `src` into `dst_pages` of `dst` with a copier made for this one copy (tests
    and benchmarks; a cache keeps one `Copier`, and its stream, for its life). The pool on a GPU, if any, is the
    copier's device pool."""
    device, host = (dst, src) if dst.device_type == "cuda" else (src, dst)
    return Copier(device, host).copy(src, src_pages, dst, dst_pages)

"""L1 <-> L2 copies through the cache's own copy path (`kvcache.ledger.copy.Copier`) against the limit of the machine
they run on, in the same run: backup (device -> host) and load-back (host -> device) of whole pages.

The limit is one contiguous copy of the same bytes: on a GPU, between one pinned host tensor and one device tensor
(what the bus carries); on the CPU, a memcpy of one array into another (`numpy.copyto`). kvc's copies move scattered
(a random permutation of the pool's pages) or consecutive pages, between:

- token-major  kvc's own device pool: one span a page;
- layer-first  a device pool over an engine's tensors, 32 layers of K and V: 64 spans a page, each 1/64 of it.

Also the calling thread's time per copy: from the call until it returns (on a GPU the copy is then queued, and
completes by its event), over the copy's whole duration. Figures are medians of --rounds rounds, the variants
interleaved within each round.

Run: ``python benchmarks/bench_transfer.py [--mib 64] [--rounds 7] [--pages-kib 1,4,12,128,192,2048] [--no-write]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _report import machine, publish, table  # noqa: E402
from kvcache.ledger.copy import Copier  # noqa: E402
from kvcache.ledger.kv import KVPages  # noqa: E402
from kvcache.ledger.pools import SlotPool  # noqa: E402

LAYERS = 32  # a layer-first pool's layers: K and V each, 64 spans a page


def pools(kind: str, page_bytes: int, pages: int, device: str) -> tuple[SlotPool, SlotPool]:
    """A device pool of `kind` and a host pool (pinned on a GPU), `pages` pages of `page_bytes` each, filled."""
    cuda = device.startswith("cuda")
    if kind == "token-major":
        dev = SlotPool("device", pages, 1, page_bytes, device=device)
    else:
        span = page_bytes // (2 * LAYERS)
        k = [torch.empty((pages, span), dtype=torch.uint8, device=device) for _ in range(LAYERS)]
        v = [torch.empty((pages, span), dtype=torch.uint8, device=device) for _ in range(LAYERS)]
        dev = SlotPool("device", pages, 1, page_bytes, kv=KVPages.layer_first(k, v, 1))
    host = SlotPool("host", pages, 1, page_bytes, pin_memory=cuda)
    for view in dev.kv.views:
        view.random_(0, 256) if cuda else view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8))
    assert host.pages is not None
    host.pages.fill_(1)
    return dev, host


def timed(fn, cuda: bool) -> tuple[float, float]:
    """(seconds the call took on the calling thread, seconds until the copy completed)."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    event = fn()
    t1 = time.perf_counter()
    if event is not None:
        event.synchronize()
    if cuda:
        torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t0


def limit(nbytes: int, device: str) -> tuple:
    """The limit's two directions, as callables returning None: one contiguous copy of `nbytes`."""
    if device.startswith("cuda"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def to_device() -> None:
            dev.copy_(host, non_blocking=True)  # returns the tensor, which `timed` must not take for an event

        def to_host() -> None:
            host.copy_(dev, non_blocking=True)

        return to_device, to_host
    a, b = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    return (lambda: np.copyto(b, a)), (lambda: np.copyto(a, b))


def measure(copier: Copier, src: np.ndarray, dst: np.ndarray, limits: tuple, moved: int, nbytes: int, rounds: int,
            cuda: bool) -> tuple[dict[str, float], dict[str, float]]:
    """GB/s of backup, load-back and the limit's two directions (medians), and the calling thread's share of each
    copy's time, over `rounds` interleaved rounds."""
    dev, host = copier.device_pool, copier.host_pool
    assert host is not None
    to_host, to_device = limits
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in ("backup", "load-back", "lim-d2h", "lim-h2d")}
    for _ in range(rounds):
        runs["backup"].append(timed(lambda: copier.copy(dev, src, host, dst), cuda))
        runs["lim-d2h"].append(timed(to_host, cuda))
        runs["load-back"].append(timed(lambda: copier.copy(host, dst, dev, src), cuda))
        runs["lim-h2d"].append(timed(to_device, cuda))
    sample = slice(0, 16)  # the copies moved the right bytes (a figure for a wrong copy would mean nothing)
    if not np.array_equal(dev.kv.read(src[sample]), host.kv.read(dst[sample])):
        raise SystemExit("bench_transfer: a copy moved the wrong bytes")
    med = {k: statistics.median(t for _, t in v) for k, v in runs.items()}
    call = {k: statistics.median(c / t for c, t in v) for k, v in runs.items()}
    return {k: (moved if k in ("backup", "load-back") else nbytes) / med[k] / 1e9 for k in med}, call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes moved per copy, MiB (default 64)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per variant; medians are reported (default 7)")
    ap.add_argument("--pages-kib", default="1,4,12,128,192,2048", help="page sizes, KiB, comma-separated")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="the device pool's device (default: cuda when there is one)")
    ap.add_argument("--no-write", action="store_true", help="print, do not write BENCHMARKS.md")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    nbytes = args.mib << 20
    to_device, to_host = limit(nbytes, args.device)
    rows: list[list[str]] = []
    ratios: dict[str, float] = {}
    worst: dict[str, float] = {}
    aliased = False
    for kib in [int(x) for x in args.pages_kib.split(",")]:
        page_bytes = kib << 10
        pages = max(1, nbytes // page_bytes)
        moved = pages * page_bytes
        for kind in ("token-major", "layer-first"):
            if kind == "layer-first" and page_bytes % (2 * LAYERS):
                continue
            dev, host = pools(kind, page_bytes, pages, args.device)
            copier = Copier(dev, host)
            aliased = copier.aliased
            rng = np.random.default_rng(kib)
            orders = {"scattered": (rng.permutation(pages), rng.permutation(pages)),
                      "consecutive": (np.arange(pages), np.arange(pages))}
            for pattern, (src, dst) in orders.items():
                gb, call = measure(copier, src, dst, (to_host, to_device), moved, nbytes, args.rounds, cuda)
                b_ratio, l_ratio = gb["backup"] / gb["lim-d2h"], gb["load-back"] / gb["lim-h2d"]
                rows.append([f"{kib:,} KiB", kind, pattern, f"{gb['backup']:.2f}", f"{gb['load-back']:.2f}",
                             f"{gb['lim-d2h']:.2f} / {gb['lim-h2d']:.2f}", f"{b_ratio:.2f}x", f"{l_ratio:.2f}x",
                             f"{call['backup']:.2f} / {call['load-back']:.2f}"])
                key = f"{kind.replace('-', '_')}_{pattern}"
                worst[key] = min(worst.get(key, 9e9), b_ratio, l_ratio)
                if kib >= 128:
                    ratios[f"{key}_{kib}k_over_limit"] = round(min(b_ratio, l_ratio), 3)
    where = (f"{torch.cuda.get_device_name(args.device)} ({args.device}); the limit is one pinned copy"
             if cuda else "CPU; the limit is one memcpy (numpy.copyto) of the same bytes")
    note = "on the CPU" if not cuda else "kernels move the host pages through unified addressing" if aliased \
        else "staged through pinned memory (no alias)"
    body = "\n".join([
        "## L1 <-> L2 copies against the bus or memcpy (`benchmarks/bench_transfer.py`)",
        "",
        f"{machine()}. Device pool: {where}. {args.mib} MiB a copy (whole pages), medians of {args.rounds} rounds. "
        f"GB/s = 10^9 bytes/s. \"call / copy\": the calling thread's time in the call over the copy's whole time "
        f"(backup / load-back). Layer-first pools: {LAYERS} layers of K and V (64 spans a page). "
        f"Copier: {note}.",
        "",
        table(["page", "device pool", "pages", "backup GB/s", "load-back GB/s", "limit GB/s (D2H / H2D)",
               "backup / limit", "load-back / limit", "call / copy"], rows),
        "",
        "Worst of both directions, every page size: " + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()) + ".",
    ])
    publish("bench_transfer", body, args.no_write, ratios)


if __name__ == "__main__":
    main()

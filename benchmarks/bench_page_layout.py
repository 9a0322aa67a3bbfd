"""What a page's value layout in LMDB costs on disk and on a read: today's layout against the one that would bring a
page of n x 4 KiB into n overflow pages (docs/capacity.md, "What would lower the ratio").

Raw py-lmdb, no kvc code in the timed loops, so the figures isolate the layout:

  value        today's format 2: key = the 16-byte page hash, value = the 8-byte checksum then the payload; a read
               is one `txn.get`. LMDB stores a value of len bytes in ceil((len + 16) / 4096) overflow pages, so a
               16 KiB page takes 5.
  tail-in-key  a candidate format 3: key = page hash | checksum | the payload's last 16 bytes (40 bytes), value =
               the payload without them: n x 4 KiB - 16 bytes, exactly n overflow pages. A read is one
               `cursor.set_range` by the hash (one B-tree descent, as `get`), the key checked, the value and the
               key's tail copied.

Both reads copy each page into a destination row and verify xxh3_64 on the copy (as `get_into` does); today's
layout is the baseline of the read ratio (bench_l3 sets kvc's reads against a copy out of a mapped file).
Per page size, --store-mb of distinct random pages is written once per layout (transactions of 4 MiB, no fsync),
then --rounds rounds read every page in the order written (random in the B-tree: the hashes are), the variants'
order rotating per round; medians of the rounds. Footprint: the data file's size over the payload.

Run: ``python benchmarks/bench_page_layout.py [--sizes 4,16,64] [--store-mb 256] [--rounds 25] [--scratch DIR]
[--no-write]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import lmdb
import xxhash

from _report import machine, publish, table

HASH = 16  # bytes of a page hash
CHECKSUM = 8  # bytes of the xxh3_64 checksum
TAIL = 16  # payload bytes the tail-in-key layout moves into the key: LMDB's overflow header is 16 bytes
BATCH_BYTES = 4 << 20  # payload per write transaction
ROWS = 64  # destination rows, reused round robin (a host pool's slots)
LAYOUTS = ("value", "tail-in-key")


def _page_hash(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def _write(path: str, layout: str, hashes: list[bytes], payloads: list[bytes]) -> None:
    env = lmdb.open(path, map_size=4 * len(payloads) * len(payloads[0]) + (64 << 20), sync=False, metasync=False)
    per_txn = max(1, BATCH_BYTES // len(payloads[0]))
    for lo in range(0, len(payloads), per_txn):
        with env.begin(write=True) as txn:
            for i in range(lo, min(len(payloads), lo + per_txn)):
                page = payloads[i]
                checksum = xxhash.xxh3_64_intdigest(page).to_bytes(CHECKSUM, "little")
                if layout == "value":
                    txn.put(hashes[i], checksum + page)
                else:
                    txn.put(hashes[i] + checksum + page[-TAIL:], page[:-TAIL])
    env.close()


def _reader(env: lmdb.Environment, layout: str, hashes: list[bytes], rows: memoryview,
            size: int) -> Callable[[], None]:
    """One pass over every page, copied into the rows and verified on the copy."""
    digest = xxhash.xxh3_64_intdigest

    def by_get() -> None:
        with env.begin(buffers=True) as txn:
            get = txn.get
            for i, h in enumerate(hashes):
                value = get(h)
                out = rows[(i % ROWS) * size:(i % ROWS + 1) * size]
                out[:] = value[CHECKSUM:]
                if digest(out) != int.from_bytes(value[:CHECKSUM], "little"):
                    raise AssertionError(f"page {i}: checksum mismatch")

    def by_key() -> None:
        with env.begin(buffers=True) as txn:
            cursor = txn.cursor()
            for i, h in enumerate(hashes):
                if not cursor.set_range(h):
                    raise AssertionError(f"page {i}: missing")
                key, value = cursor.item()
                if key[:HASH] != h:
                    raise AssertionError(f"page {i}: missing")
                out = rows[(i % ROWS) * size:(i % ROWS + 1) * size]
                out[:-TAIL] = value
                out[-TAIL:] = key[HASH + CHECKSUM:]
                if digest(out) != int.from_bytes(key[HASH:HASH + CHECKSUM], "little"):
                    raise AssertionError(f"page {i}: checksum mismatch")

    return by_get if layout == "value" else by_key


def measure(size: int, store_mb: int, rounds: int, scratch: str) -> dict:
    """Footprints and read seconds per round of each layout, for pages of `size` bytes."""
    count = max(ROWS, (store_mb << 20) // size)
    payloads = [os.urandom(size) for _ in range(count)]
    hashes = [_page_hash(i) for i in range(count)]
    rows = memoryview(bytearray(ROWS * size))
    base = os.path.join(scratch, str(size))
    os.makedirs(base)
    readers: dict[str, Callable[[], None]] = {}
    footprint, envs = {}, []
    for layout in LAYOUTS:
        path = os.path.join(base, layout)
        _write(path, layout, hashes, payloads)
        footprint[layout] = os.path.getsize(os.path.join(path, "data.mdb")) / (count * size)
        envs.append(lmdb.open(path, readonly=True, lock=False))
        readers[layout] = _reader(envs[-1], layout, hashes, rows, size)
    del payloads
    for read in readers.values():  # warm: every file in the page cache, every reader checked once
        read()
    seconds: dict[str, list[float]] = {name: [] for name in readers}
    names = list(readers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            readers[name]()
            seconds[name].append(time.perf_counter() - start)
    for env in envs:
        env.close()
    shutil.rmtree(base)
    return {"size": size, "pages": count, "footprint": footprint, "seconds": seconds}


def report(results: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> tuple[str, dict[str, float]]:
    rows, ratios = [], {}
    for res in results:
        kib = f"{res['size'] // 1024}KiB"
        med = {name: statistics.median(s) for name, s in res["seconds"].items()}
        mb = {name: res["pages"] * res["size"] / t / 1e6 for name, t in med.items()}
        fp = res["footprint"]
        rows.append([f"{res['size'] // 1024} KiB", f"{res['pages']:,}", f"{mb['value']:,.0f}", f"{mb['tail-in-key']:,.0f}",
                     f"**{med['value'] / med['tail-in-key']:.2f}x**",
                     f"{fp['value']:.3f}x", f"**{fp['tail-in-key']:.3f}x**"])
        ratios[f"tail_in_key_read_over_value_read[{kib}]"] = round(med["value"] / med["tail-in-key"], 3)
        ratios[f"value_footprint_over_payload[{kib}]"] = round(fp["value"], 3)
        ratios[f"tail_in_key_footprint_over_payload[{kib}]"] = round(fp["tail-in-key"], 3)
    body = "\n".join([
        "## Page value layout: disk against read cost (`benchmarks/bench_page_layout.py`)",
        "",
        "Raw py-lmdb, no kvc code timed: today's value (checksum + payload under the page hash, one `txn.get`) "
        "against a candidate format 3 that keeps a page of n x 4 KiB in n overflow pages (the checksum and the "
        "payload's last 16 bytes in a 40-byte key, found by `cursor.set_range`; docs/capacity.md). Both copy each "
        "page into a destination row and verify xxh3_64 on the copy. "
        f"{args.store_mb} MB of pages per size, written once per layout; {args.rounds} interleaved "
        f"rounds reading every page, medians. {machine()}; 1-minute load average {load[0]:.2f} before, "
        f"{load[1]:.2f} after. Command: `python benchmarks/bench_page_layout.py --sizes {args.sizes} "
        f"--store-mb {args.store_mb} --rounds {args.rounds}`.",
        "",
        table(["page", "pages", "value read MB/s", "tail-in-key read MB/s",
               "tail-in-key read / value read", "value: disk / payload", "tail-in-key: disk / payload"], rows),
    ])
    return body, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,16,64", help="page sizes in KiB, comma-separated (default 4,16,64)")
    parser.add_argument("--store-mb", type=int, default=256, help="MB of pages per size and layout (default 256)")
    parser.add_argument("--rounds", type=int, default=25, help="interleaved read rounds; medians (default 25)")
    parser.add_argument("--scratch", default=None, help="directory for the stores (default: a temporary one)")
    parser.add_argument("--no-write", action="store_true", help="print the figures, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    sizes = [int(s) * 1024 for s in args.sizes.split(",")]
    if any(s < 1024 or s % 1024 for s in sizes):
        parser.error("--sizes: whole KiB of at least 1")
    before = os.getloadavg()[0]
    scratch = tempfile.mkdtemp(prefix="kvc-bench-layout-", dir=args.scratch)
    try:
        results = [measure(size, args.store_mb, args.rounds, scratch) for size in sizes]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    body, ratios = report(results, args, (before, os.getloadavg()[0]))
    publish("bench_page_layout", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

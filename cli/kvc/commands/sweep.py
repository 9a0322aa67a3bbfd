"""`kvc sweep`: a trace's hit rate per tenant and per tier at each of several tier sizes, from byte-free replays
(kvcache.workload.sweep), as a table, `--json`, and a plot of hit rate against capacity (`--plot`)."""

from __future__ import annotations

import contextlib
import enum
import itertools
import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvcache.types.config import HostMode, PrefetchPolicy, WritePolicy
from kvcache.types.sweep import MAX_SWEEP_POINTS, SweepPoint, SweepPolicies
from kvcache.workload.traces import read_trace

from ..context import available_memory, open_inspect
from ..errors import EXIT_FOUND, UsageError
from ..inputs import cpus
from ..options import DEFAULT_STORE, MAX_TOKENS, DebugOpt, JsonOpt, ModeOpt, StoreOpt, WritePolicyOpt
from ..outputs import ForceOpt, output_target, write_file
from ..render.output import emit_json
from ..render.progress import progress
from ..render.sweep import PLOT_FORMATS, plot_note, plot_sweep, print_sweep
from ..render.text import escape_controls, human_bytes
from ..reporting import at_steps, command, step_boundary

MAX_STORAGE_BYTES = 2**63 - 1  # the store records its capacity as a u64; beyond any disk
_SIZE = re.compile(r"(\d{1,19})([kmgt]?)", re.IGNORECASE)
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class SweepPrefetch(str, enum.Enum):
    """The prefetch policies a sweep runs (timeout reads the clock: its hits would depend on the machine)."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"


def parse_sizes(text: str, option: str, low: int, high: int) -> list[int]:
    """A list of sizes from `text` (comma- or space-separated integers, each optionally suffixed k, m, g or t for
    1024, 1024^2, ...): UsageError naming `option` when it is empty, not numbers, out of [low, high], or longer
    than a sweep's sizes."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise UsageError(f"{option}: give at least one size (comma-separated, e.g. 4096,16384)")
    if len(parts) > MAX_SWEEP_POINTS:
        raise UsageError(f"{option}: {len(parts)} sizes; a sweep runs at most {MAX_SWEEP_POINTS}")
    sizes: list[int] = []
    for part in parts:
        m = _SIZE.fullmatch(part)
        if m is None:
            raise UsageError(f"{option} {escape_controls(part)!r}: not a size (a whole number >= {low}, optionally "
                             f"suffixed k, m, g or t)")
        value = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
        if not low <= value <= high:
            raise UsageError(f"{option} {escape_controls(part)}: out of range ({low} to {high})")
        sizes.append(value)
    return list(dict.fromkeys(sizes))  # a size given twice runs once


def plot_format(plot: Path) -> str:
    """`png` or `svg`, from the plot file's extension; UsageError naming --plot otherwise."""
    fmt = plot.suffix.lower().lstrip(".")
    if fmt not in PLOT_FORMATS:
        raise UsageError(f"--plot {escape_controls(str(plot))}: name a .png or .svg file (the extension says which "
                         f"format is drawn)")
    return fmt


def _check_memory(points: list[SweepPoint], bytes_per_token: int, workers: int) -> None:
    """Refuse sizes whose pools the sweep's processes, running at once, could not hold (checked before any runs)."""
    need = sorted(((p.device_tokens + p.host_tokens) * bytes_per_token for p in points), reverse=True)
    held = sum(need[:workers])
    avail = available_memory()
    if held > avail:
        raise UsageError(f"the {min(workers, len(points))} largest sizes running at once need {human_bytes(held)} of "
                         f"memory for their L1 and L2 pools; {human_bytes(avail)} is available (ask for smaller "
                         f"sizes, or fewer --workers)")


@command
def sweep(
    trace: Annotated[Path, typer.Argument(help="JSONL trace, one request per line (docs/trace-format.md).",
                                          show_default=False)],
    device_tokens: Annotated[str, typer.Option(
        "--device-tokens", help="L1 (device pool) sizes in tokens, comma-separated (suffix k, m: x1024, "
        "x1024^2); each at least one page.")] = "16384",
    host_tokens: Annotated[str, typer.Option(
        "--host-tokens", help="L2 (host pool) sizes in tokens, comma-separated; 0: no L2.")] = "65536",
    storage_bytes: Annotated[str, typer.Option(
        "--storage-bytes", help="L3 sizes: the store's payload capacity in bytes (what a store's capacity "
        "counts; suffix k, m, g, t: x1024...), comma-separated; 0: unlimited. Each size starts from an empty "
        "L3.")] = "0",
    store: StoreOpt = DEFAULT_STORE,
    prefetch_policy: Annotated[SweepPrefetch, typer.Option(
        "--prefetch-policy", case_sensitive=False,
        help="What admission takes of a request's L3 prefetch: wait_complete (everything the store holds) or "
        "best_effort (what has arrived). timeout is not swept: what arrives in time depends on the machine.")
    ] = SweepPrefetch.WAIT_COMPLETE,
    write_policy: WritePolicyOpt = WritePolicy.WRITE_THROUGH,
    mode: ModeOpt = HostMode.CACHE,
    batch: Annotated[int, typer.Option("--batch", min=1, max=65536,
                                       help="Requests admitted together per scheduler step.")] = 4,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, max=cpus(), show_default=False,
        help="Processes replaying sizes at once (default, and at most: the cores this process may use).")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", show_default=False,
        help="Also draw hit rate against capacity, one line per tenant, into this .png or .svg file (atomically; "
        "needs matplotlib: pip install 'kvc\\[plot]'; without it a note says so and the table still prints).")
    ] = None,
    force: ForceOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Replay a trace once per combination of tier sizes (--device-tokens x --host-tokens x --storage-bytes, at
    most 64) and report the hit tokens per tenant and per tier of each: exactly what `kvc replay` at that size
    reports on a new store of the --store's layout and key, with L3 I/O inline and prefetches not re-armed on a
    timer (the same tree, ledger, eviction and store code; no KV bytes written or verified, no fsync). Sizes run in
    parallel processes. Nothing is written to --store: each size runs on a scratch store of its own, removed
    afterwards. Exit 1 when the trace holds no request or an ownership audit fails."""
    plot_target = output_target(plot, "--plot", force) if plot is not None else None
    fmt = plot_format(plot) if plot is not None else ""
    sizes = [parse_sizes(device_tokens, "--device-tokens", 1, MAX_TOKENS),
             parse_sizes(host_tokens, "--host-tokens", 0, MAX_TOKENS),
             parse_sizes(storage_bytes, "--storage-bytes", 0, MAX_STORAGE_BYTES)]
    n_points = len(sizes[0]) * len(sizes[1]) * len(sizes[2])
    if n_points > MAX_SWEEP_POINTS:
        raise UsageError(f"--device-tokens x --host-tokens x --storage-bytes: {n_points} combinations; a sweep runs "
                         f"at most {MAX_SWEEP_POINTS}")
    points = [SweepPoint(d, h, s) for d, h, s in itertools.product(*sizes)]
    requests = read_trace(trace)  # validated whole before anything runs
    with contextlib.closing(open_inspect(store)) as handle:
        layouts = handle.layouts()
        key = getattr(handle, "fingerprint_key", None)
    if len(layouts) != 1:
        raise UsageError(f"{store}: the store holds {len(layouts)} layouts; a sweep replays under one (`kvc init` "
                         f"creates a store with one)")
    if key is None:
        raise UsageError(f"{store}: this user cannot read the store's fingerprint key; a sweep needs it (its tenants "
                         f"are shown by fingerprints keyed by it, and its pages hashed as the store's)")
    layout = layouts[0]
    small = [d for d in sizes[0] if d < layout.page_size]
    if small:
        raise UsageError(f"--device-tokens {small[0]}: below one page ({layout.page_size} tokens of the store's "
                         f"layout)")
    n_workers = min(workers or cpus(), len(points)) if requests else 1
    _check_memory(points, layout.bytes_per_token, n_workers)
    policies = SweepPolicies(write_policy, PrefetchPolicy(prefetch_policy.value), mode, batch)
    from kvcache.workload.sweep import sweep as run_sweep

    with at_steps(), progress("sweep", len(points), not json) as advance:  # a Ctrl-C lands between steps
        report = run_sweep(layout, requests, points, policies, workers=n_workers, store_key=key, progress=advance,
                           between_steps=step_boundary)
    if json:
        emit_json(report)
    else:
        print_sweep(report, str(trace))
    if plot is not None and plot_target is not None:
        try:
            drawn = plot_sweep(report, trace.name, fmt)
        except ImportError:
            sys.stderr.write(plot_note(str(plot)))
        else:
            write_file(plot_target, drawn)
    if not requests:
        sys.stderr.write(f"kvc: error: {escape_controls(str(trace))}: the trace holds no request; nothing was "
                         f"replayed\n")
        raise typer.Exit(EXIT_FOUND)
    if not report.ok:
        raise typer.Exit(EXIT_FOUND)

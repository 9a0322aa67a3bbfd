"""The `kvc` typer application: global options and the command groups."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import typer

app = typer.Typer(
    name="kvc",
    help="kvc: a tiered KV-cache core for LLM serving (device, host and persistent page-store tiers) "
    "and the tool to operate it: prefetch, stage, load back, inspect namespaces, audit ownership, replay workloads.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version() -> str:
    try:
        return version("kvc")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvc {_version()}")
        raise typer.Exit()


def _register() -> None:
    from . import (audit_cmd, bench_cmd, demo_cmd, init_cmd, live, ns_cmd, put_cmd, replay_cmd, request_cmd,
                   serve_cmd, snapshot_cmd, stats_cmd)

    # name -> (command, one line for `kvc --help`; `kvc NAME --help` shows the whole docstring)
    commands = {
        "init": (init_cmd.init, "Create a store for one KV layout (idempotent)."),
        "put": (put_cmd.put, "Write a sequence's pages to L3 (synthetic KV, or --kv-file)."),
        "prefetch": (request_cmd.prefetch, "L3 -> L2 for a request, or a namespace's hottest prefixes."),
        "stage": (request_cmd.stage, "Prefetch in buffer mode and show the staged record."),
        "load-back": (request_cmd.load_back, "L3 -> L2 -> L1 for a request, spliced and byte-checked."),
        "replay": (replay_cmd.replay, "Run a JSONL trace through the whole core (--verify)."),
        "generate": (replay_cmd.generate, "Write a synthetic multi-tenant trace."),
        "demo": (demo_cmd.demo, "A multi-tenant workload replayed cold, then warm after a restart."),
        "audit": (audit_cmd.audit, "Store integrity, a snapshot's or a live cache's ownership."),
        "stats": (stats_cmd.stats, "Store (and live cache) figures; --prom for Prometheus."),
        "serve": (serve_cmd.serve, "Run a live cache with an admin socket."),
        "snapshot": (snapshot_cmd.snapshot, "Write a live cache's ownership snapshot."),
        "bench": (bench_cmd.bench, "Run the benchmark scripts and print their ratios."),
    }
    for name, (fn, short) in commands.items():
        app.command(name, short_help=short)(fn)
    app.add_typer(ns_cmd.app, name="ns")
    evict_help = "Live cache only: drop a namespace's pages from L1 and/or L2."
    ns_cmd.app.command("evict", short_help=evict_help)(live.ns_evict)


@app.callback()
def main(
    version_: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                  help="Print kvc's version and exit."),
    socket: str | None = typer.Option(None, "--socket", envvar="KVC_SOCKET", show_default=False,
                                      help="Act on the live cache serving this admin socket (see `kvc serve`); "
                                      "a command's own --socket wins."),
    timeout: float = typer.Option(30.0, "--timeout", envvar="KVC_TIMEOUT",
                                  help="Seconds to wait for a live cache's answer."),
) -> None:
    """kvc: operate a tiered KV cache."""
    from . import live

    live.set_global(socket, timeout)
    _one_intra_op_thread()


def _one_intra_op_thread() -> None:
    """Run torch's CPU ops on the calling thread only. A cache's copies are small per-page gathers and
    scatters, and the L3 I/O thread runs beside them: with OpenMP workers spinning for the same cores, a 10k
    request replay on two cores took 8x longer (44 s instead of 5.8 s, measured with --verify)."""
    import torch

    torch.set_num_threads(1)


_register()

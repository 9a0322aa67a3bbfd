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
    from . import (audit_cmd, bench_cmd, demo_cmd, init_cmd, live, ns_cmd, put_cmd, replay_cmd, request_cmd, serve_cmd,
                   snapshot_cmd, stats_cmd)

    app.command("init")(init_cmd.init)
    app.command("put")(put_cmd.put)
    app.command("prefetch")(request_cmd.prefetch)
    app.command("stage")(request_cmd.stage)
    app.command("load-back")(request_cmd.load_back)
    app.command("replay")(replay_cmd.replay)
    app.command("generate")(replay_cmd.generate)
    app.command("demo")(demo_cmd.demo)
    app.command("bench")(bench_cmd.bench)
    app.add_typer(ns_cmd.app, name="ns")
    app.command("audit")(audit_cmd.audit)
    app.command("stats")(stats_cmd.stats)
    app.command("serve")(serve_cmd.serve)
    app.command("snapshot")(snapshot_cmd.snapshot)
    ns_cmd.app.command("evict")(live.ns_evict)


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

"""The `kvc` typer application: global options and the command groups.

Every invocation runs under kvc.reporting.KvcGroup (one error contract: one line, exit 2; Ctrl-C exit 130), and
every value of every parameter passes `kvc.inputs.guard_values` (finite numbers, UTF-8 text) as it is parsed. The
app runs under every typer from 0.12 on: what it needs of click it takes from typer (`kvc.clickapi`), and its own
options are declared through typer. The command modules import only what reading a store needs; the cache and
torch are imported by the commands that move KV, when they run, so `kvc --version`, `kvc ns ls`, `kvc stats` and
`kvc audit` start in a fraction of a second (benchmarks/bench_startup.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperCommand

from . import clickapi
from .errors import UsageError
from .inputs import guard_values
from .reporting import STATE, KvcGroup

# name -> (module, attribute, one line for `kvc --help`; `kvc NAME --help` shows the whole docstring). A command's
# module is imported only when that command runs (or its own help is asked for): `kvc --version` and `kvc
# --help` import none of them.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "init": ("commands.init", "init", "Create a store for one KV layout (idempotent)."),
    "put": ("commands.put", "put", "Write a sequence's pages to L3 (synthetic KV, or --kv-file)."),
    "prefetch": ("commands.request", "prefetch", "L3 -> L2 for a request, or a namespace's hottest prefixes."),
    "stage": ("commands.request", "stage", "Prefetch in buffer mode and show the staged record."),
    "load-back": ("commands.request", "load_back", "L3 -> L2 -> L1 for a request, spliced and byte-checked."),
    "replay": ("commands.replay", "replay", "Run a JSONL trace through the whole core (--verify)."),
    "generate": ("commands.replay", "generate", "Write a synthetic multi-tenant trace."),
    "sweep": ("commands.sweep", "sweep", "Hit rate per tenant and tier at each of several tier sizes (--plot)."),
    "demo": ("commands.demo", "demo", "A multi-tenant workload replayed cold, then warm after a restart."),
    "explain": ("commands.explain", "explain", "Why one request misses, tier by tier, from the records kept."),
    "audit": ("commands.audit", "audit", "Store integrity, a snapshot's or a live cache's ownership."),
    "stats": ("commands.stats", "stats", "Store (and live cache) figures; --prom for Prometheus."),
    "top": ("commands.top", "top", "A live cache's tiers, hits and copies, refreshed in place."),
    "serve": ("commands.serve", "serve", "Run a live cache with an admin socket (and --metrics-port)."),
    "snapshot": ("commands.snapshot", "snapshot", "Write a live cache's ownership snapshot."),
    "ping": ("commands.ping", "ping", "Check that a live cache answers on its admin socket (exit 0, or 2)."),
    "events": ("commands.events", "events",
               "Follow a live cache's KV-event feed (kvc serve --events), or an SGLang engine's (--engine sglang)."),
    "bench": ("commands.bench", "bench", "Run the benchmark scripts and print their ratios."),
    "migrate": ("commands.migrate", "migrate", "Rewrite a store of an older format to the current one."),
    "version": ("commands.version", "version", "kvc, Python and library versions; store and protocol formats."),
    "ns": ("commands.ns", "app", "Namespaces in the store: list, show a prefix tree, drop (offboarding)."),
}


SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")  # the shells typer writes completion scripts for


def _completion_shell(value: str) -> str:
    """The shell named on the command line, else the one running kvc; exit 2 for a shell without completion."""
    shell = value.strip().lower()
    if not shell:
        try:
            import shellingham  # type: ignore[import-untyped]  # typer's own dependency: the same detection

            shell = shellingham.detect_shell()[0]
        except Exception:  # noqa: BLE001 - not installed, or no shell to find: the user names one
            raise UsageError("cannot tell which shell runs kvc: name it, e.g. `kvc --show-completion bash`") from None
    if shell not in SHELLS:
        raise UsageError(f"no completion for the shell {shell!r}: name one of {', '.join(SHELLS)} (e.g. `kvc "
                         f"--show-completion bash`)")
    return shell


def _show_completion(ctx: typer.Context, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    from typer.completion import get_completion_script

    prog = ctx.find_root().info_name or "kvc"
    typer.echo(get_completion_script(prog_name=prog, complete_var=_complete_var(prog),
                                     shell=_completion_shell(value)))
    raise typer.Exit(0)


def _install_completion(ctx: typer.Context, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    from typer.completion import install

    prog = ctx.find_root().info_name or "kvc"
    shell, path = install(shell=_completion_shell(value), prog_name=prog, complete_var=_complete_var(prog))
    typer.echo(f"{shell} completion installed in {path}; it takes effect in a new shell")
    raise typer.Exit(0)


def _complete_var(prog: str) -> str:
    return "_{}_COMPLETE".format(prog.replace("-", "_").replace(" ", "_").upper())


# `--install-completion [SHELL]` and `--show-completion [SHELL]`: typer's own options take no shell and always
# detect the running one (from `sh -c`: "Shell sh not supported"); these take the shell named, and detect it only
# when none is. They are options of the app's callback (`main`), so that every typer builds them its own way; a
# value is optional only to click's parser (typer >= 0.26 has no such options), so `LazyGroup.parse_args` gives
# one written without a value the empty value ("detect it").
COMPLETION_OPTIONS = ("--install-completion", "--show-completion")


def _completion_value_given(args: list[str]) -> list[str]:
    """`args` with an empty value added after a completion option written without one (last, or before another
    option), up to the command's name: what click's optional values did."""
    out = list(args)
    i = 0
    while i < len(out):
        arg = out[i]
        if arg == "--" or arg in COMMANDS:
            break
        if arg in COMPLETION_OPTIONS:
            if i + 1 == len(out) or out[i + 1].startswith("-"):
                out.insert(i + 1, "")
            i += 2
            continue
        i += 1
    return out


class LazyGroup(KvcGroup):
    """The app's group: lists COMMANDS without importing them, and builds a command when it is resolved."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from typer.completion import completion_init

        super().__init__(*args, **kwargs)
        completion_init()  # typer's completion classes answer `_KVC_COMPLETE=complete_bash` as its scripts expect
        for param in self.params:  # the global options: --timeout, --socket, ...
            guard_values(param)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """click's parsing, with a completion option's missing value given (see `_completion_value_given`)."""
        return super().parse_args(ctx, _completion_value_given(args))

    def list_commands(self, ctx: Any) -> list[str]:
        """Every command's name, in the order of COMMANDS (`kvc --help` lists them so)."""
        return list(COMMANDS)

    def get_command(self, ctx: Any, name: str) -> Any:
        """The command if it was built, else a stand-in carrying its one line of help (its module not imported)."""
        if name in self.commands:
            return self.commands[name]
        if name not in COMMANDS:
            return None
        short = COMMANDS[name][2]  # for the command list of `kvc --help`: the module is not imported for it
        return TyperCommand(name=name, short_help=short, help=short)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        """Build the command about to run (importing its module), then resolve it as click does."""
        name = args[0] if args else None
        if name in COMMANDS and name not in self.commands:
            self.commands[name] = _build(name)
        return super().resolve_command(ctx, args)


def _build(name: str) -> Any:
    """The command `name` as typer builds it, every value of its parameters guarded (`kvc.inputs.guard_values`)."""
    module, attr, short = COMMANDS[name]
    target = getattr(importlib.import_module(f"kvc.{module}"), attr)
    built: Any
    if isinstance(target, typer.Typer):
        built = typer.main.get_group(target)
    else:
        info = typer.models.CommandInfo(name=name, callback=target, short_help=short)
        built = typer.main.get_command_from_info(info, pretty_exceptions_short=True,
                                                 rich_markup_mode=app.rich_markup_mode)
    for _, command in clickapi.walk(built):
        for param in command.params:
            guard_values(param)
    return built


def every_command() -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, command) of every command kvc has, each module imported and each group walked: ("ns", "quota",
    "set"). For checks over all of them (tests, docs); `kvc` itself builds only the command it runs."""
    for name in COMMANDS:
        yield from clickapi.walk(_build(name), (name,))


app = typer.Typer(
    name="kvc",
    cls=LazyGroup,
    help="kvc: a tiered KV-cache core for LLM serving (device, host and persistent page-store tiers) "
    "and the tool to operate it: prefetch, stage, load back, inspect namespaces, audit ownership, replay workloads.",
    no_args_is_help=True,
    add_completion=False,  # LazyGroup adds its own: they take the shell to complete for
    pretty_exceptions_enable=False,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvc")
    except PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvc {_version()}")
        raise typer.Exit()


@app.callback()
def main(
    version_: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                  help="Print kvc's version and exit."),
    socket: str | None = typer.Option(None, "--socket", envvar="KVC_SOCKET", show_default=False,
                                      help="Act on the live cache serving this admin socket (see `kvc serve`); "
                                      "a command's own --socket wins."),
    timeout: float = typer.Option(30.0, "--timeout", envvar="KVC_TIMEOUT", min=0.001, max=86400.0,
                                  help="Seconds to wait for a live cache's answer."),
    debug: bool = typer.Option(False, "--debug", envvar="KVC_DEBUG",
                               help="Show the traceback of an error (any command)."),
    install_completion: str | None = typer.Option(
        None, "--install-completion", callback=_install_completion, is_eager=True, metavar="[SHELL]",
        show_default=False, help=f"Install completion for SHELL ({', '.join(SHELLS)}; default: the shell running "
        "kvc)."),
    show_completion: str | None = typer.Option(
        None, "--show-completion", callback=_show_completion, is_eager=True, metavar="[SHELL]", show_default=False,
        help=f"Print the completion script for SHELL ({', '.join(SHELLS)}; default: the shell running kvc), to copy "
        "it or customise the installation."),
) -> None:
    """kvc: operate a tiered KV cache."""
    from . import live

    STATE.debug = STATE.debug or debug
    live.set_global(socket, timeout)

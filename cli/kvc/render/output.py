"""How kvc prints: for eyes on a terminal, exact values for scripts.

Every command that takes `-o` (`ns ls`, `ns show`, `ns quota show`, `audit`, `stats`) prints its result through
`emit_listing`, so the formats mean the same everywhere:

- `json`: the command's result, one JSON document, exactly what its --json prints;
- `jsonl`: one JSON object per line, one per row of the result (a namespace, a page, a finding, a figure);
- `tsv`: a header line (unless --no-headers), then one tab-separated line per row, raw values: integers without
  separators, bytes as integers without units, times as unix seconds, `-` for none;
- `table`: for eyes on a terminal (rich), numbers with separators and units.

Without -o, a terminal gets `table` and anything else (a pipe, a file, cron) gets `tsv`: box-drawing characters
never reach awk. Cells holding a string someone chose are `shown` safely (`kvc.render.text`); rich markup is never
interpreted in them (tables get plain `Text`).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from .text import escape_controls, human_bytes, shown, when

if TYPE_CHECKING:
    from rich.console import Console

_consoles: dict[bool, "Console"] = {}


def console(stderr: bool = False) -> "Console":
    """The rich console on stdout (or stderr), made — and rich imported — on first use, so a command that prints
    tsv or JSON never loads rich. Piped output gets 120 columns rather than rich's 80, so text keeps one line per
    line."""
    if stderr not in _consoles:
        from rich.console import Console

        stream = sys.stderr if stderr else sys.stdout
        _consoles[stderr] = Console(stderr=stderr, highlight=False, soft_wrap=True,
                                    width=None if stream.isatty() else 120)
    return _consoles[stderr]


def __getattr__(name: str) -> "Console":
    """`out` and `err`: `console()` and `console(stderr=True)`."""
    if name in ("out", "err"):
        return console(stderr=name == "err")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Output(str, enum.Enum):
    """Output formats of listing commands."""

    TABLE = "table"
    TSV = "tsv"
    JSON = "json"
    JSONL = "jsonl"


def output_format(output: Output | None, json: bool = False) -> Output:
    """The format to print in: -o, else --json, else table on a terminal and tsv elsewhere."""
    if output is not None:
        return output
    if json:
        return Output.JSON
    return Output.TABLE if sys.stdout.isatty() else Output.TSV


def emit_json(value: Any) -> None:
    """The command's result as one JSON object on stdout (msgspec structs encode as their fields)."""
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
    sys.stdout.flush()


class Kind(str, enum.Enum):
    """How a column's values print: for eyes (table) and for scripts (tsv)."""

    USER = "user"  # a string someone chose: `shown` in both
    TEXT = "text"  # kvc's own words
    INT = "int"  # 1,234 / 1234
    BYTES = "bytes"  # 1.2 KiB / 1234
    TIME = "time"  # 2026-01-02 03:04:05 / 1767323045
    PERCENT = "percent"  # 88.7 / 88.7
    FLOAT = "float"  # 1,767,323,045.12 / 1767323045.123


class Column(msgspec.Struct, frozen=True):
    """One column of a listing."""

    header: str
    kind: Kind = Kind.TEXT


def cell(value: Any, kind: Kind, human: bool) -> str:
    """One value as a cell of a table (`human`) or of a tsv line."""
    if value is None:
        return "-"
    if kind is Kind.USER:
        return shown(value)
    if kind is Kind.INT:
        return f"{value:,}" if human else str(value)
    if kind is Kind.BYTES:
        return human_bytes(value) if human else str(int(value))
    if kind is Kind.TIME:
        return when(value) if human else str(int(value))
    if kind is Kind.PERCENT:
        return f"{value:.1f}"
    if kind is Kind.FLOAT:
        return f"{value:,.2f}" if human else str(value)  # str: Python's shortest exact form, never 1.8e+09
    return escape_controls(str(value))


class Listing(msgspec.Struct):
    """Rows to print: a title (tables only), columns, rows of raw values, and rows shown in bold (totals)."""

    title: str
    columns: list[Column]
    rows: list[list[Any]]
    bold: list[int] = []  # indexes of rows to emphasise in a table
    header: bool = True  # tables: show the header row


def render(listing: Listing, fmt: Output, no_headers: bool = False, titled: bool = False) -> None:
    """Print a listing as a rich table or as tsv lines (json and jsonl are the command's own structs); `titled`:
    a report's section, whose tsv form starts with its title line (plain lines for a log or a mail)."""
    if fmt is Output.TABLE:
        from rich.table import Table
        from rich.text import Text

        table = Table(title=Text(listing.title), title_justify="left", show_header=listing.header)
        for col in listing.columns:
            table.add_column(col.header, justify="left" if col.kind in (Kind.USER, Kind.TEXT, Kind.TIME)
                             else "right")
        for i, row in enumerate(listing.rows):
            table.add_row(*(Text(cell(v, c.kind, True)) for v, c in zip(row, listing.columns, strict=True)),
                          style="bold" if i in listing.bold else None)
        console().print(table)
        return
    lines = [escape_controls(listing.title)] if titled and listing.title else []
    if listing.header and not no_headers:
        lines.append("\t".join(c.header for c in listing.columns))
    lines += ["\t".join(cell(v, c.kind, False) for v, c in zip(row, listing.columns, strict=True))
              for row in listing.rows]
    if lines:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()


def emit_rows(rows: Sequence[Any]) -> None:
    """jsonl: one JSON object per row."""
    sys.stdout.write("".join(msgspec.json.encode(r).decode() + "\n" for r in rows))
    sys.stdout.flush()


def emit_listing(fmt: Output, result: Any, rows: Sequence[Any], table: Callable[[], None]) -> None:
    """Print a command's result in its -o format (see the module docstring): the whole struct for json (and
    --json), its `rows` as JSON lines for jsonl, otherwise what `table()` renders in `fmt` (table or tsv)."""
    if fmt is Output.JSON:
        emit_json(result)
    elif fmt is Output.JSONL:
        emit_rows(rows)
    else:
        table()


def say(text: str) -> None:
    """A line of kvc's own words (rich markup allowed; user strings must come through `esc`)."""
    console().print(text)

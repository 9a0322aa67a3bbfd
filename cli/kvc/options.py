"""The command-line options kvc commands share, declared once so that every command spells, documents and parses
them alike (DESIGN §8): the store, the socket, the output formats, a request's namespace and tokens, and the
tier sizes and policies of an embedded cache. An option one command alone takes is declared beside it.

Each is an `Annotated` type for a command's parameter (`store: StoreOpt = DEFAULT_STORE`); what their values mean
beyond typer's types is `kvc.inputs`'s. Imports stay light (no torch, no cache, no rich): every command module
imports this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, cast

import typer

from kvcache.storage.location import StoreLocation
from kvcache.types.config import HostMode, PrefetchPolicy, WritePolicy

from .render.output import Output
from .secrets import store_location

# A StoreLocation at run time: typer passes an option's default through its parser (store_location), as it does a
# value given on the command line; the string is what --help shows.
DEFAULT_STORE = cast(StoreLocation, "./kvc-store")
MAX_TOKENS = 2**40  # per tier: far beyond any machine; what the machine holds is checked before allocating

# --- where a command acts, and how it answers -------------------------------------------------------------------

StoreOpt = Annotated[StoreLocation, typer.Option(
    "--store", envvar="KVC_STORE", show_default=True, parser=store_location, metavar="PATH|URL",
    help="The L3 store: a directory (LMDB) or a URL such as redis://host:port/0. Env: KVC_STORE. A password in "
    "the URL is never printed.")]
SocketOpt = Annotated[str | None, typer.Option(
    "--socket", help="Act on the live cache serving this admin socket (`kvc serve`, or an engine's "
    "AdminServer) instead of opening the store. Also accepted before the command; env: KVC_SOCKET. Nothing is "
    "sent to a server running as another user than you or root unless env KVC_SERVER_UID names its uid.",
    show_default=False)]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
OutputOpt = Annotated[Output | None, typer.Option(
    "-o", "--output", case_sensitive=False, show_default=False,
    help="table (for a terminal), tsv (tab-separated, raw numbers, for awk/cut), json (one object) or jsonl "
    "(one object per row). Default: table on a terminal, tsv otherwise.")]
NoHeadersOpt = Annotated[bool, typer.Option("--no-headers", help="tsv: leave out the header line.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]
ReadOnlyOpt = Annotated[bool, typer.Option(
    "--read-only", help="Write nothing to the store's directory, not even LMDB's lock file: read the store "
    "lock-free, as a user who cannot write lock.mdb does anyway (a monitoring account). Each read is checked "
    "against concurrent writers and run again if they overtook it; one they keep overtaking fails (exit 2). A "
    "line on stderr says when a store is read lock-free.")]

# --- a request: its namespace and its tokens --------------------------------------------------------------------

ExtraKeyOpt = Annotated[str | None, typer.Option(
    "--extra-key", help="The namespace's extra_key (tenant, LoRA adapter, ...). Omit for requests without one.")]
SaltOpt = Annotated[str | None, typer.Option(
    "--salt", show_default=False,
    help="The namespace's cache_salt. `-` reads it from stdin. A value given here is visible to every local user "
    "in the process list: prefer env KVC_SALT or --salt-file. `''` means no salt (overrides KVC_SALT). Used "
    "only to derive the namespace; never printed or stored.")]
SaltFileOpt = Annotated[Path | None, typer.Option(
    "--salt-file", show_default=False,
    help="Read the namespace's cache_salt from this file: its first line. A regular file of at most 4 KiB (a "
    "pipe or device is refused); a warning says when its group or others can read it (keep it mode 0600).")]
TokensOpt = Annotated[str | None, typer.Option(
    "--tokens", help="The request's token ids (ASCII digits), comma- or space-separated (1,2,3) or a JSON array.")]
TokensFileOpt = Annotated[Path | None, typer.Option(
    "--tokens-file", help="A file of token ids: a JSON array, or integers separated by commas or whitespace.")]

# --- an embedded cache's tiers and policies (kvc replay, kvc serve) --------------------------------------------

DeviceOpt = Annotated[int, typer.Option("--device-tokens", min=1, max=MAX_TOKENS,
                                         help="L1 (device pool) capacity in tokens.")]
HostOpt = Annotated[int, typer.Option("--host-tokens", min=0, max=MAX_TOKENS,
                                       help="L2 (host pool) capacity in tokens; 0: no L2.")]
PrefetchPolicyOpt = Annotated[PrefetchPolicy, typer.Option(
    "--prefetch-policy", case_sensitive=False,
    help="What admission takes of a request's L3 prefetch: best_effort (what has arrived), wait_complete "
    "(everything the store holds), timeout (what arrives within the prefetch timeout).")]
WritePolicyOpt = Annotated[WritePolicy, typer.Option(
    "--write-policy", case_sensitive=False,
    help="When committed pages are backed up to L2 and L3: write_through (at commit), write_through_selective "
    "(at commit, once a page has been hit twice), write_back (when evicted from the device).")]
ModeOpt = Annotated[HostMode, typer.Option(
    "--mode", case_sensitive=False,
    help="Where prefetched pages wait for their request: cache (host-only tree nodes, shared) or buffer "
    "(a staged record of that request, spliced at its admission).")]

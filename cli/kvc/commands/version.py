"""`kvc version`: which kvc this is, on which Python and libraries, and which on-disk and wire formats it reads
and writes — what a bug report or an upgrade check needs, in one command.

Library versions come from the installed distributions' metadata (`importlib.metadata`), never by importing the
library: `kvc version` does not load torch, and a library that is missing shows as null instead of failing.
"""

from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

import msgspec

from ..options import DebugOpt, JsonOpt
from ..render.output import emit_json, say
from ..render.text import esc
from ..reporting import command

# The distributions kvc runs on (pyproject's dependencies) and the optional ones it uses when present: name as
# pip knows it -> shown under this key.
LIBRARIES = ("torch", "numpy", "msgspec", "lmdb", "xxhash", "pyzmq", "prometheus_client", "typer", "click", "rich",
             "redis", "safetensors")


class Formats(msgspec.Struct, frozen=True):
    """The format versions this kvc writes: a store and an ownership snapshot (it reads those up to these
    versions), and the admin socket's protocol (a live client and server must have the same)."""

    store: int  # kvcache.storage.codec.FORMAT_VERSION: the format record of every backend's store
    snapshot: int  # kvcache.diagnostics.snapshot.SNAPSHOT_VERSION
    admin_protocol: int  # kvcache.ops.requests.PROTOCOL_VERSION: a live client and server must agree on it


class Backend(msgspec.Struct, frozen=True):
    """An L3 backend registered in the entry-point group `kvcache.storage`, and the distribution that provides it."""

    scheme: str  # the URL scheme it opens (`lmdb` also opens a plain path)
    distribution: str | None
    version: str | None


class VersionInfo(msgspec.Struct, frozen=True):
    """What `kvc version --json` prints."""

    kvc: str
    python: str  # e.g. "3.11.7"
    implementation: str  # e.g. "cpython"
    platform: str  # e.g. "Linux-6.1.0-x86_64-with-glibc2.36"
    libraries: dict[str, str | None]  # distribution -> installed version, or null when it is not installed
    formats: Formats
    backends: list[Backend]


def kvc_version() -> str:
    """The installed kvc's version ("0+unknown" when run from a source tree without an install)."""
    return _installed("kvc") or "0+unknown"


def _installed(name: str) -> str | None:
    try:
        return dist_version(name)
    except PackageNotFoundError:
        return None


def version_info() -> VersionInfo:
    """This kvc's versions, as `kvc version` reports them."""
    from kvcache.diagnostics.snapshot import SNAPSHOT_VERSION
    from kvcache.ops.requests import PROTOCOL_VERSION
    from kvcache.storage.codec import FORMAT_VERSION
    from kvcache.storage.registry import backends

    found = [Backend(scheme, ep.dist.name if ep.dist else None, ep.dist.version if ep.dist else None)
             for scheme, ep in sorted(backends().items())]
    return VersionInfo(kvc_version(), platform.python_version(), sys.implementation.name, platform.platform(),
                       {name: _installed(name) for name in LIBRARIES},
                       Formats(FORMAT_VERSION, SNAPSHOT_VERSION, PROTOCOL_VERSION), found)


@command
def version(json: JsonOpt = False, debug: DebugOpt = False) -> None:
    """Print kvc's version, the Python and library versions it runs on, the format versions it writes (store,
    snapshot, admin protocol) and the L3 backends installed. `kvc --version` prints the first line only."""
    info = version_info()
    if json:
        emit_json(info)
        return
    libs = ", ".join(f"{name} {v}" for name, v in info.libraries.items() if v is not None)
    missing = ", ".join(name for name, v in info.libraries.items() if v is None)
    say(f"kvc {esc(info.kvc)}")
    say(f"python {esc(info.python)} ({esc(info.implementation)}, {esc(info.platform)})")
    say(f"libraries: {esc(libs)}" + (f" (not installed: {esc(missing)})" if missing else ""))
    say(f"formats: store {info.formats.store}, snapshot {info.formats.snapshot}, "
        f"admin protocol {info.formats.admin_protocol}")
    say("backends: " + ", ".join(f"{esc(b.scheme)} ({esc(b.distribution or '?')} {esc(b.version or '?')})"
                                 for b in info.backends))

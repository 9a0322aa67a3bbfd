"""The CLI's own exit codes and error types (DESIGN §8). How a command ends — one line on stderr, exit 2, the JSON
error object, Ctrl-C — is `kvc.reporting`'s."""

from __future__ import annotations

from kvcache.errors import KVCacheError

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130  # DESIGN §8, and 128 + SIGINT


class UsageError(KVCacheError):
    """Bad command-line input found by the CLI itself (exit 2)."""


class Interrupted(Exception):
    """SIGINT arrived while a command ran; raised after the command's cleanups have run."""

"""The CLI's own exit codes and error types (DESIGN §8). How a command ends — one line on stderr, exit 2, the JSON
error object, Ctrl-C — is `kvc.reporting`'s."""

from __future__ import annotations

from kvcache.errors import InvariantViolation, KVCacheError

EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130  # DESIGN §8, and 128 + SIGINT


class UsageError(KVCacheError):
    """Bad command-line input found by the CLI itself (exit 2)."""


class Interrupted(Exception):
    """SIGINT arrived while a command ran; raised after the command's cleanups have run."""


class SecretInOutput(InvariantViolation):
    """A line kvc was about to print holds a secret of this invocation (a salt, a store password): a kvc bug, found
    by the guard tests switch on (`kvc.secrets.guard`). Names the channel, never the text; it is not caught."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        super().__init__(f"a secret of this invocation reached {channel}: a message embeds it (a kvc bug)")

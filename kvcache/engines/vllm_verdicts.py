"""What kvc's vLLM tier knows of the keys live requests asked about (`Verdicts`), so that `lookup` answers a key it
has a verdict for without asking the store again, and a key whose promotion failed is a MISS from then on (vLLM
would promote it again every step otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable


class Verdicts:
    """What the tier knows of keys a live request asked about: present (True), absent (False) or being probed
    (None). A verdict lives while a request that asked lives (`release`), so it is never stale for long; a stored
    cascade makes its keys present, a failed promotion absent. Scheduler thread only (vLLM's lock)."""

    __slots__ = ("known", "asked", "refs")

    def __init__(self) -> None:
        self.known: dict[bytes, bool | None] = {}
        self.asked: dict[str, set[bytes]] = {}  # req_id -> keys it asked about
        self.refs: dict[bytes, int] = {}  # key -> live requests that asked about it (a finish costs its own keys)

    def note(self, key: bytes, req_id: str, verdict: bool | None) -> None:
        """Record `verdict` on `key`, asked about by request `req_id` (kept while that request lives)."""
        self.known[key] = verdict
        keys = self.asked.setdefault(req_id, set())
        if key not in keys:
            keys.add(key)
            self.refs[key] = self.refs.get(key, 0) + 1

    def settle(self, keys: Iterable[bytes], verdict: bool, only_pending: bool = False) -> None:
        """Set the verdict of `keys` that have one (a probe's answer sets only those still pending)."""
        known = self.known
        for key in keys:
            if key in known and (not only_pending or known[key] is None):
                known[key] = verdict

    def forget_pending(self, keys: Iterable[bytes]) -> None:
        """A probe that never answered: the keys are asked again."""
        for key in keys:
            if key in self.known and self.known[key] is None:
                del self.known[key]

    def release(self, req_id: str) -> None:
        """A request finished: drop the verdicts no other live request asked for."""
        for key in self.asked.pop(req_id, ()):
            left = self.refs[key] - 1
            if left:
                self.refs[key] = left
            else:
                del self.refs[key]
                self.known.pop(key, None)

"""What the host mode decides, as one table (DESIGN §5): what a device -> host backup becomes, which tier a
prefetch holds and what it fetches, and whether a finished fetch is parked as a staged record.

- cache mode: L2 is a cache tier of its own. A backup becomes the node's host copy; L3 writes read host copies; a
  prefetch attaches below the match's host copies (holding the anchor's host copy) and its pages become host-only
  nodes at admission.
- buffer mode: L2 is only a bounce buffer. A backup is a bounce copy, written to L3 and freed at the
  acknowledgement; a prefetch extends the device prefix (holding it on the device) and a finished fetch is parked
  as a staged record, spliced at admission.

Every engine module asks these rules, and the backup target picks the landing and the backups classes
(`kvcache.engine.landing`, `kvcache.engine.backups`); none re-decides the mode.
"""

from __future__ import annotations

import enum

import msgspec

from ..types.config import HostMode
from ..types.tier import Tier


class BackupTarget(enum.Enum):
    """What a completed device -> host backup becomes."""

    TREE = "tree"  # the node's host copy, a cache tier of its own
    BOUNCE = "bounce"  # a bounce copy written to L3 and freed at the acknowledgement
    NONE = "none"  # nothing is backed up (no host tier, or a bounce buffer with no store to write to)


class HostModeRules(msgspec.Struct, frozen=True):
    """The rules of one host mode, for one cache."""

    backup: BackupTarget
    # The tier a prefetch's span starts after and holds while it lives: the host copies its pages attach below
    # (cache mode) or the device prefix its splice extends (buffer mode).
    prefetch_tier: Tier
    park_fetches: bool  # a finished fetch becomes a staged record (buffer mode) instead of host-only nodes

    @property
    def backs_up(self) -> bool:
        """Device pages are copied to L2 at all."""
        return self.backup is not BackupTarget.NONE


# (host mode, has a store) -> what a backup becomes, for a cache with a host tier.
_BACKUP: dict[tuple[HostMode, bool], BackupTarget] = {
    (HostMode.CACHE, True): BackupTarget.TREE,
    (HostMode.CACHE, False): BackupTarget.TREE,
    (HostMode.BUFFER, True): BackupTarget.BOUNCE,
    (HostMode.BUFFER, False): BackupTarget.NONE,
}
_PREFETCH_TIER: dict[HostMode, Tier] = {HostMode.CACHE: Tier.HOST, HostMode.BUFFER: Tier.DEVICE}
_PARKS: dict[HostMode, bool] = {HostMode.CACHE: False, HostMode.BUFFER: True}


def rules_for(mode: HostMode, has_host_tier: bool, has_store: bool) -> HostModeRules:
    """The rules of `mode` for a cache with or without a host tier and an L3 store."""
    backup = _BACKUP[mode, has_store] if has_host_tier else BackupTarget.NONE
    return HostModeRules(backup, _PREFETCH_TIER[mode], _PARKS[mode])

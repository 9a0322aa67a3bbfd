"""kvcache.engine.host_mode: what each host mode decides, as one table."""

import pytest

from kvcache import HostMode
from kvcache.engine.host_mode import BackupTarget, rules_for
from kvcache.types.tier import Tier


@pytest.mark.parametrize("mode, host, store, backup, tier, parks", [
    (HostMode.CACHE, True, True, BackupTarget.TREE, Tier.HOST, False),
    (HostMode.CACHE, True, False, BackupTarget.TREE, Tier.HOST, False),
    (HostMode.BUFFER, True, True, BackupTarget.BOUNCE, Tier.DEVICE, True),
    (HostMode.BUFFER, True, False, BackupTarget.NONE, Tier.DEVICE, True),  # a bounce buffer with nowhere to go
    (HostMode.CACHE, False, True, BackupTarget.NONE, Tier.HOST, False),  # no host tier: nothing is backed up
    (HostMode.BUFFER, False, True, BackupTarget.NONE, Tier.DEVICE, True),
])
def test_rules_of_each_mode(mode, host, store, backup, tier, parks):
    rules = rules_for(mode, host, store)
    assert (rules.backup, rules.prefetch_tier, rules.park_fetches) == (backup, tier, parks)
    assert rules.backs_up == (backup is not BackupTarget.NONE)


def test_every_mode_has_rules():
    for mode in HostMode:
        for host in (True, False):
            for store in (True, False):
                rules_for(mode, host, store)  # a mode missing from a table raises KeyError

import pytest

from factories import make_layout
from kvcache import CacheConfig, InvalidConfig, WritePolicy
from kvcache.types.config import BACKUP_RULES


def test_every_policy_has_a_rule():
    assert set(BACKUP_RULES) == set(WritePolicy)
    assert BACKUP_RULES[WritePolicy.WRITE_BACK].on_evict and not BACKUP_RULES[WritePolicy.WRITE_BACK].on_commit


def test_pages_round_down():
    cfg = CacheConfig(make_layout(page_size=4), device_tokens=10, host_tokens=9)
    assert cfg.device_pages == 2 and cfg.host_pages == 2


@pytest.mark.parametrize("kw", [dict(device_tokens=0), dict(host_tokens=-1), dict(host_tokens=2),
                                dict(write_through_threshold=0), dict(load_back_budget_tokens=-1),
                                dict(write_policy=WritePolicy.WRITE_BACK, host_tokens=0)])
def test_invalid(kw):
    args = dict(device_tokens=16, host_tokens=16)
    args.update(kw)
    with pytest.raises(InvalidConfig):
        CacheConfig(make_layout(page_size=4), **args)


def test_policies_given_by_value_become_enums():
    from kvcache.types.config import HostMode, PrefetchPolicy

    cfg = CacheConfig(make_layout(), device_tokens=16, host_tokens=16, write_policy="write_back",
                      host_mode="buffer", prefetch_policy="timeout")
    assert cfg.write_policy is WritePolicy.WRITE_BACK and cfg.host_mode is HostMode.BUFFER
    assert cfg.prefetch_policy is PrefetchPolicy.TIMEOUT
    with pytest.raises(InvalidConfig, match="write_policy='write_sideways'"):
        CacheConfig(make_layout(), device_tokens=16, write_policy="write_sideways")

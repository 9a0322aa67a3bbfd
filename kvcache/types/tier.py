"""The pool tiers, as holds, evictions and reports name them."""

import enum


class Tier(str, enum.Enum):
    """A pool tier, as holds and reports name it."""

    DEVICE = "device"  # L1
    HOST = "host"  # L2

"""kvcache.storage.checks: the argument checks every backend shares."""

from __future__ import annotations

import pytest

from kvcache.errors import InvalidInput
from kvcache.storage.checks import check_page_hashes


def test_check_page_hashes_rejects_anything_but_16_bytes():
    check_page_hashes([bytes(16), b"x" * 16])
    for bad in (b"short", bytes(17), "0" * 16, None):
        with pytest.raises(InvalidInput):
            check_page_hashes([bytes(16), bad])

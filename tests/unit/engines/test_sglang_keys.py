"""SGLang's storage key chain recomputed by kvc (`kvcache.engines.sglang_keys`) against golden vectors SGLang 0.5.23
wrote itself (tests/goldens/sglang/make_sglang_keys.py): every prompt, namespace and page size, without SGLang."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvcache.engines.sglang_keys import page_keys, storage_keys, storage_namespace_seed
from kvcache.errors import InvalidInput

GOLDENS = json.loads((Path(__file__).resolve().parents[2] / "goldens" / "sglang" / "sglang_keys.json").read_text())
CASES = GOLDENS["cases"]


def _id(case: dict) -> str:
    return f"{case['prompt']}-{case['extra_key']}-{'salt' if case['cache_salt'] else 'nosalt'}-p{case['page_size']}"


def test_the_goldens_cover_what_the_issue_names():
    pages = {c["page_size"] for c in CASES}
    spaces = {(c["extra_key"], c["cache_salt"]) for c in CASES}
    short_last = [c for c in CASES if len(GOLDENS["prompts"][c["prompt"]]) % c["page_size"]]
    assert GOLDENS["sglang_version"] == "0.5.23"
    assert pages == {1, 16, 64}
    assert (None, None) in spaces and any(e and s for e, s in spaces) and any(s and not e for e, s in spaces)
    assert short_last  # a partial last page
    assert any(t > 2**32 - 1 for t in GOLDENS["prompts"]["wide_tokens"])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_seed_and_page_keys_match_sglang(case):
    tokens = GOLDENS["prompts"][case["prompt"]]
    seed = storage_namespace_seed(case["extra_key"], case["cache_salt"])
    assert (seed.hex() if seed is not None else None) == case["seed"]
    assert [k.hex() for k in page_keys(tokens, case["page_size"], seed)] == case["keys"]


@pytest.mark.parametrize("case", [c for c in CASES if c["prompt"] == "partial_last_page"], ids=_id)
def test_storage_keys_are_the_whole_pages_of_the_chain(case):
    tokens = GOLDENS["prompts"][case["prompt"]]
    whole = len(tokens) // case["page_size"]
    keys = storage_keys(np.array(tokens, dtype=np.uint32), case["page_size"], case["extra_key"], case["cache_salt"])
    assert [k.hex() for k in keys] == case["keys"][:whole]
    assert len(keys) < len(case["keys"]) or case["page_size"] == 1


def test_an_empty_salt_is_no_salt_and_an_empty_extra_key_is_a_namespace():
    assert storage_keys([1, 2], 1, "a", "") == storage_keys([1, 2], 1, "a", None)
    assert storage_namespace_seed("", None) is not None
    assert storage_keys([1, 2], 1, "", None) != storage_keys([1, 2], 1, None, None)


def test_bad_input_is_refused():
    with pytest.raises(InvalidInput):
        page_keys([1, -1], 1)
    with pytest.raises(InvalidInput):
        page_keys([2**63], 1)
    with pytest.raises(InvalidInput):
        page_keys([1.5], 1)
    with pytest.raises(InvalidInput):
        page_keys([1], 0)
    with pytest.raises(InvalidInput):
        page_keys([1], 1, b"short")

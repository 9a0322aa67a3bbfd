"""Write tests/goldens/sglang/sglang_keys.json: SGLang 0.5.23's own storage key chains, the golden vectors
tests/unit/engines/test_sglang_keys.py checks `kvcache.engines.sglang_keys` against (without SGLang).

Run once, with SGLang's venv (per ../shared/peer-bench/README.md), from the repository root:

    /work/peer/venv/bin/python tests/goldens/sglang/make_sglang_keys.py

It imports nothing of kvc: every vector comes from SGLang's functions (`storage_namespace_seed`, `get_hash_str`,
`get_storage_hash_str` with a RadixKey carrying the namespace, as HiCache's controller calls it). Re-run it when
SGLang's key scheme changes; commit the JSON it writes.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str, storage_namespace_seed

OUT = Path(__file__).resolve().parent / "sglang_keys.json"

# (extra_key, cache_salt): none, each alone, both, an empty extra_key (a namespace of its own), non-ASCII text
NAMESPACES = [(None, None), ("tenant-a", None), (None, "s3cret-salt"), ("tenant-a", "s3cret-salt"), ("", None),
              ("lora/é", "sel ü")]
PAGE_SIZES = [1, 16, 64]


def prompts() -> dict[str, list[int]]:
    """Named prompts: short, whole pages, a short last page, token ids past 32 bits (SGLang's wide pages)."""
    rng = random.Random(23)
    return {
        "short": [1, 2, 3, 4, 5],
        "whole_pages": [rng.randrange(0, 152_000) for _ in range(128)],
        "partial_last_page": [rng.randrange(0, 152_000) for _ in range(150)],
        "max_u32": [0, 2**32 - 1, 7, 2**32 - 1],
        "wide_tokens": [3, 2**32 + 5, 9] + [rng.randrange(0, 152_000) for _ in range(30)],
    }


def dumps(doc: dict) -> str:
    """JSON with one prompt and one case per line: diffable, and a tenth of indent's size."""
    def one(value: object) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = [f' "sglang_version": {one(doc["sglang_version"])},', ' "prompts": {']
    lines += [f"  {one(k)}: {one(v)}," for k, v in doc["prompts"].items()]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" },", ' "cases": [']
    lines += [f"  {one(c)}," for c in doc["cases"]]
    lines[-1] = lines[-1].rstrip(",")
    return "{\n" + "\n".join(lines) + "\n ]\n}\n"


def main() -> None:
    cases = []
    for name, tokens in prompts().items():
        for extra_key, salt in NAMESPACES:
            seed = storage_namespace_seed(extra_key, salt)
            for page_size in PAGE_SIZES:
                keys = get_hash_str(tokens, seed, page_size=page_size)
                # the controller's call: the namespace rides on the RadixKey, the seed is derived inside
                via_key = get_storage_hash_str(RadixKey(tokens, extra_key=extra_key, cache_salt=salt), None,
                                               page_size=page_size)
                assert via_key == keys, (name, extra_key, page_size)
                cases.append({"prompt": name, "extra_key": extra_key, "cache_salt": salt, "page_size": page_size,
                              "seed": seed, "keys": keys})
    import sglang

    doc = {"sglang_version": sglang.__version__, "prompts": prompts(), "cases": cases}
    OUT.write_text(dumps(doc))
    print(f"wrote {len(cases)} cases to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()

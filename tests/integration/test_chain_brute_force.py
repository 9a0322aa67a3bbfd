"""Brute force of a short salt from what kvc publishes and prints (issue 26, item 1).

A 4-tenant replay with 3-letter salts publishes its KV events; then `ns ls`, `ns show`, `stats` and `audit` print
the store as JSON. An attacker who knows everything the code knows except the store's secret tries every salt of
`[a-z]{3}` for every extra_key seen: the namespace id, the chain root as the code computes it without a key, and
the first page hash below it for every first page seen. Nothing must match: the chain root is keyed by the store's
secret. The attack is checked to work: with the store's chain key it finds every salt (the test can fail).

The attack is written against blake2b directly (not kvc's functions), so the same file runs on a kvc without
keyed roots, where it finds the salts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
import string

import msgspec
from typer.testing import CliRunner

from factories import l3_cache, make_layout, make_store
from kvc.main import app
from kvcache import Namespace, WorkloadSpec, generate, replay
from kvcache.types.events import BlockStored

ROOT_PERSON = b"kvc.page.root.v1"  # the root's personalisation: a constant of the code, as an attacker reads it
SALTS = ["".join(random.Random(26).choices(string.ascii_lowercase, k=3)) for _ in range(4)]
HEX = re.compile(rb"[0-9a-f]{16,64}")
runner = CliRunner()


def root_of(layout_id: bytes, ns_id: bytes, key: bytes) -> bytes:
    return hashlib.blake2b(layout_id + ns_id, digest_size=16, key=key, person=ROOT_PERSON).digest()


def first_hash(root: bytes, page: bytes) -> bytes:
    return hashlib.blake2b(root + page, digest_size=16).digest()


def attack(extra_keys: set[str], first_pages: dict[str, set[bytes]], layout_id: bytes, published: set[bytes],
           key: bytes = b"") -> dict[str, list[str]]:
    """Every 3-letter salt of [a-z] per extra_key whose namespace id, root or first page hash (chained under
    `key`: b"" is everything the code knows) is in `published` (raw digests and their hex)."""
    found: dict[str, list[str]] = {}
    for ek in sorted(extra_keys):
        pages = first_pages.get(ek, set())
        for letters in itertools.product(string.ascii_lowercase, repeat=3):
            salt = "".join(letters)
            ns_id = Namespace(ek, salt).id
            root = root_of(layout_id, ns_id, key)
            candidates = [ns_id, root, *(first_hash(root, p) for p in pages)]
            if any(c in published or c.hex().encode() in published for c in candidates):
                found.setdefault(ek, []).append(salt)
    return found


def test_no_salt_falls_out_of_the_feed_or_the_outputs(tmp_path, monkeypatch):
    layout = make_layout(4)
    path = tmp_path / "store"
    store = make_store(path, layout)
    cache = l3_cache(store, device_tokens=512, host_tokens=1024)
    batches: list = []
    cache.attach_events(batches.append)
    spec = WorkloadSpec(requests=60, tenants=4, shared_prefix_tokens=0, system_prompt_tokens=16, documents=2,
                        document_tokens=32, user_tokens=8, output_tokens=4, seed=3)
    trace = [msgspec.structs.replace(r, cache_salt=SALTS[int(r.extra_key.split("-")[1])]) for r in generate(spec)]
    replay(cache, trace)
    chain_key = getattr(store, "chain_key", b"")  # the secret the attacker lacks (none on a kvc without it)
    cache.close()
    store.close()

    stored = [ev for b in batches for ev in b.events if isinstance(ev, BlockStored)]
    heads = [ev for ev in stored if ev.parent_block_hash is None]
    assert len({ev.extra_key for ev in heads}) == 4, "every tenant's first page is on the feed"
    first_pages: dict[str, set[bytes]] = {}
    published: set[bytes] = set()
    for ev in stored:
        published.update(ev.block_hashes)
        published.update(h.hex().encode() for h in ev.block_hashes)
    for ev in heads:
        first_pages.setdefault(ev.extra_key, set()).add(
            b"".join(t.to_bytes(4, "little") for t in ev.token_ids[:ev.block_size]))

    # What the CLI prints about the store, as JSON; ns show is asked by each tenant (who knows its salt).
    outputs = [runner.invoke(app, ["ns", "ls", "--store", str(path), "--json"]),
               runner.invoke(app, ["stats", "--store", str(path), "--json"]),
               runner.invoke(app, ["audit", "--store", str(path), "--json"])]
    for i, salt in enumerate(SALTS):
        monkeypatch.setenv("KVC_SALT", salt)
        outputs.append(runner.invoke(app, ["ns", "show", f"tenant-{i}", "--store", str(path), "--json"]))
    monkeypatch.delenv("KVC_SALT")
    for out in outputs:
        assert out.exit_code == 0, out.output
        doc = json.loads(out.stdout)
        assert doc is not None
        published.update(HEX.findall(out.stdout.encode()))
    shown = [json.loads(o.stdout) for o in outputs[3:]]
    assert all(s["roots"] for s in shown), "ns show prints each tenant's first pages with their hashes"
    for s, ek in zip(shown, sorted(first_pages), strict=True):
        first_pages[ek].update(b"".join(t.to_bytes(4, "little") for t in r["tokens"][:4]) for r in s["roots"])

    # The attack works: with the store's chain key it finds every tenant's salt on the feed.
    with_key = attack(set(first_pages), first_pages, layout.layout_id, published, chain_key)
    assert {ek: salts for ek, salts in with_key.items()} == {f"tenant-{i}": [s] for i, s in enumerate(SALTS)}
    # Without it, nothing matches: not the feed, not any output.
    assert attack(set(first_pages), first_pages, layout.layout_id, published) == {}

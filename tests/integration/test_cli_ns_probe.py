"""`kvc ns probe --engine sglang` and `kvc ns show` on a real LMDB store holding engine pages, written through the
store's engine-page API (`engine_origins`) under SGLang's own keys (tests/goldens/sglang/sglang_keys.json, written by
SGLang): the probe recomputes the chain for the prompt and namespace and counts what the store holds; `ns show`
shows those pages by their keys. The salt never reaches stdout or stderr."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from factories import make_layout, make_store
from kvc.main import app
from kvcache.storage.api import engine_origins
from kvcache.storage.registry import open_store
from kvcache.types.namespace import Namespace

GOLDENS = json.loads((Path(__file__).resolve().parents[1] / "goldens" / "sglang" / "sglang_keys.json").read_text())
SALT = "s3cret-salt"
CASE = next(c for c in GOLDENS["cases"] if c["prompt"] == "partial_last_page" and c["page_size"] == 16
            and c["extra_key"] == "tenant-a" and c["cache_salt"] == SALT)
TOKENS = GOLDENS["prompts"]["partial_last_page"]  # 150 tokens: 9 whole pages of 16, and 6 more
KEYS = [bytes.fromhex(k) for k in CASE["keys"]]  # SGLang's, the short last one included (never stored)


def _write(store, layout, keys: list[bytes], namespace: Namespace, parent_key: bytes | None = None) -> None:
    hashes, origins = engine_origins(layout, namespace, store.chain_key, keys, parent_key)
    pages = [np.full(layout.bytes_per_page, i, dtype=np.uint8) for i in range(len(keys))]
    result = store.put(hashes, pages, origins)
    assert result.written == len(keys), result


@pytest.fixture
def engine_store(tmp_path):
    """An LMDB store of two layouts of 16-token pages and one of 64, where an SGLang adapter wrote pages 0-5 and 7
    of the prompt (page 6 never written: 7 hangs from the root) under kvc namespace "sglang", and page 0 under
    another kvc namespace."""
    path = tmp_path / "store"
    first = make_layout(16)
    store = make_store(path, first)
    _write(store, first, KEYS[:6], Namespace("sglang"))
    _write(store, first, KEYS[7:8], Namespace("sglang"), parent_key=KEYS[6])  # a parent it never got
    _write(store, first, KEYS[:1], Namespace("other-engine"))
    store.close()
    for layout in (make_layout(16, model="second-model@r1"), make_layout(64)):
        open_store(str(path), layout, add_layout=True).close()
    return path, first, make_layout(16, model="second-model@r1")


def _salt_file(tmp_path, salt: str) -> Path:
    f = tmp_path / "salt"
    f.write_text(salt + "\n")
    f.chmod(0o600)
    return f


def _kvc(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert SALT not in result.stdout + result.stderr
    return result


def _probe(path, tmp_path, *args, salt: str = SALT, extra_key: str = "tenant-a"):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    return _kvc("ns", "probe", "--engine", "sglang", "--extra-key", extra_key, "--salt-file",
                _salt_file(tmp_path, salt), "--tokens-file", tokens, "--store", path, *args)


def _metas(path, layout) -> list:
    """Every engine page's metadata as the store records it (hits, access times), in key order."""
    store = open_store(str(path), readonly=True)
    try:
        hashes, _ = engine_origins(layout, Namespace("sglang"), store.chain_key, KEYS)
        return [store.page_meta(h) for h in hashes]
    finally:
        store.close()


def test_probe_counts_consecutive_and_present_pages_per_layout(engine_store, tmp_path):
    path, first, second = engine_store
    before = _metas(path, first)
    result = _probe(path, tmp_path, "--page-size", "16", "--json")
    assert result.exit_code == 0, result.stderr
    assert _metas(path, first) == before  # a probe reads: no hit, no access time recorded
    assert sum(m is not None for m in before) == 7
    out = json.loads(result.stdout)
    from kvcache.storage.keyfile import read_key

    assert out["engine"] == "sglang" and out["namespace"] == {"extra_key": "sglang", "salt_fingerprint": None}
    assert out["extra_key"] == "tenant-a" and out["salt_fingerprint"] == Namespace(None, SALT).fingerprint(
        read_key(str(path)))
    assert (out["tokens"], out["page_size"], out["pages"]) == (150, 16, 9)
    by_id = {r["layout_id"]: (r["consecutive"], r["present"]) for r in out["layouts"]}
    assert by_id == {first.layout_id.hex(): (6, 7), second.layout_id.hex(): (0, 0)}


def test_probe_finds_nothing_for_another_salt_extra_key_or_kvc_namespace(engine_store, tmp_path):
    path, first, _ = engine_store
    layout = ("--layout", first.layout_id.hex()[:16], "--page-size", "16", "--json")
    for result in (_probe(path, tmp_path, *layout, salt="another-salt"),
                   _probe(path, tmp_path, *layout, extra_key="tenant-b"),
                   _probe(path, tmp_path, *layout, "--namespace", "sglang-2")):
        assert result.exit_code == 0, result.stderr
        assert [(r["consecutive"], r["present"]) for r in json.loads(result.stdout)["layouts"]] == [(0, 0)]
    other = _probe(path, tmp_path, *layout, "--namespace", "other-engine")
    assert [(r["consecutive"], r["present"]) for r in json.loads(other.stdout)["layouts"]] == [(1, 1)]


def test_probe_table_says_it_per_layout(engine_store, tmp_path):
    path, first, _ = engine_store
    result = _probe(path, tmp_path, "--page-size", "16", "-o", "tsv")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split("\t") == ["layout id", "layout", "pages", "consecutive", "present", "consecutive tokens"]
    row = next(x.split("\t") for x in lines[1:] if x.startswith(first.layout_id.hex()[:16]))
    assert row[2:] == ["9", "6", "7", "96"]


@pytest.mark.parametrize("args, says", [
    ((), "--page-size"),  # the store holds layouts of 16 and 64 tokens
    (("--page-size", "32"), "no layout of page size 32"),
    (("--page-size", "16", "--layout", "zz"), "--layout"),
    (("--page-size", "16", "--engine", "vllm"), "'vllm'"),
])
def test_probe_refuses_bad_input_in_one_line(engine_store, tmp_path, args, says):
    result = _probe(engine_store[0], tmp_path, *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr


def test_ns_show_presents_engine_pages_by_their_keys(engine_store):
    path, _, _ = engine_store
    as_json = _kvc("ns", "show", "sglang", "--store", path, "--depth", "8", "--json")
    assert as_json.exit_code == 0, as_json.stderr
    tree = msgspec.json.decode(as_json.stdout)
    keys, node = [], None
    roots = tree["roots"]
    assert {r["key"] for r in roots} == {KEYS[0].hex(), KEYS[7].hex()}  # page 7 hangs from the root
    node = next(r for r in roots if r["key"] == KEYS[0].hex())
    while node is not None:
        keys.append(node["key"])
        assert node["tokens"] == []
        node = node["children"][0] if node["children"] else None
    assert keys == [k.hex() for k in KEYS[:6]]
    tsv = _kvc("ns", "show", "sglang", "--store", path, "-o", "tsv")
    lines = tsv.stdout.splitlines()
    assert lines[0].split("\t") == ["depth", "page_hash", "hits", "bytes", "tokens", "key"]
    assert lines[1].split("\t")[4:] in (["", KEYS[0].hex()], ["", KEYS[7].hex()])
    table = _kvc("ns", "show", "sglang", "--store", path, "-o", "table")
    assert f"key {KEYS[0].hex()[:16]}" in table.stdout


def test_ns_show_of_token_pages_has_no_key(tmp_path):
    path = tmp_path / "store"
    assert _kvc("init", "--store", path, "--page-size", "4").exit_code == 0
    assert _kvc("put", "--store", path, "--extra-key", "t", "--tokens", "1,2,3,4,5,6,7,8").exit_code == 0
    tree = msgspec.json.decode(_kvc("ns", "show", "t", "--store", path, "--json").stdout)
    assert "key" not in tree["roots"][0] and tree["roots"][0]["tokens"] == [1, 2, 3, 4]
    tsv = _kvc("ns", "show", "t", "--store", path, "-o", "tsv").stdout.splitlines()
    assert tsv[0].split("\t") == ["depth", "page_hash", "hits", "bytes", "tokens"]

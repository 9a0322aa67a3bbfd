"""What operators see of a vLLM deployment that kvc's tier (`kvcache.engines.vllm.KvcTier`, driven here by the
stand-in of vLLM's tiering manager, tests/unit/engines/fake_vllm.py) wrote into a real LMDB store: `kvc ns ls`
lists its namespace, `kvc ns show` its chunks by vLLM's own keys, `kvc stats` its layout, `kvc audit` checks it,
and `kvc ns drop` removes it so the deployment's next lookups miss."""

from __future__ import annotations

import hashlib
import json

from typer.testing import CliRunner

from kvc.main import app
from kvcache.engines.vllm import KvcTier
from unit.engines.fake_vllm import Manager, Region, Spec, chunk_bytes, offload_key, offloading_config

ROW = 4096


def deployment(store: str, namespace: str) -> Manager:
    region = Region(16, ROW)
    spec = Spec(offloading_config(), [{"type": "KvcTier", "kvc_store": store}])
    return Manager(KvcTier(offloading_spec=spec, primary_kv_view=region.view, tier_type="KvcTier",
                           kvc_store=store, kvc_namespace=namespace), region)


def kvc(store: str, *args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--store", store, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_operators_list_show_check_and_drop_a_vllm_deployment(tmp_path):
    store = str(tmp_path / "l3")
    m = deployment(store, "prod-qwen")
    keys = [offload_key(hashlib.sha256(f"b{i}".encode()).digest()) for i in range(4)]
    req = m.request("w", keys)
    m.wait([m.cascade(keys, [chunk_bytes("b", i, ROW) for i in range(4)], req)])
    m.tier.shutdown()

    (row,) = kvc(store, "ns", "ls")["namespaces"]
    assert (row["extra_key"], row["pages"], row["bytes"]) == ("prod-qwen", 4, 4 * ROW)
    shown, chain = kvc(store, "ns", "show", "prod-qwen", "--depth", "8"), []
    node = shown["roots"]
    while node:
        assert len(node) == 1
        chain.append(node[0]["key"])
        node = node[0]["children"]
    assert chain == [k.hex() for k in keys]  # vLLM's OffloadKeys, as a chain of the prompt's chunks
    (layout,) = kvc(store, "stats")["layout_list"]
    assert layout["arrangement"] == "vllm_chunk" and layout["page_bytes"] == ROW
    assert layout["engine_config"].startswith("vllm tp=1 ") and layout["model"] == "Qwen/Qwen3-0.6B"
    audit = kvc(store, "audit")
    assert audit["ok"] and audit["checked"]["pages"] == 4

    dropped = kvc(store, "ns", "drop", "prod-qwen", "--yes")
    assert dropped["dropped"] and dropped["store_pages"] == 4
    again = deployment(store, "prod-qwen")
    assert again.settle(keys, again.request("r", keys)) == 0  # the deployment's next lookups miss
    again.tier.shutdown()

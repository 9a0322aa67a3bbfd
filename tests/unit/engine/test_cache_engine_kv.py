"""A cache whose L1 is the engine's own per-layer K and V tensors (`TieredCache(device_kv=KVPages.layer_first(...))`):
the ledger, the tree, audits, backups, load-backs and L3 work over it as over kvc's own pool, and the bytes an engine
wrote per layer come back, per layer, in whichever slots the cache hands out next."""

import numpy as np
import pytest
import torch

from devices import TEST_DEVICE
from factories import make_store
from kvcache import AdmitStatus, CacheConfig, InvalidConfig, KVLayout, Namespace, Request, TieredCache
from kvcache.ledger.kv import KVPages
from kvcache.types.keys import page_hashes

LAYERS, HEADS, DIM, PS, PAGES = 3, 2, 4, 4, 16
NS = Namespace("t1", "salt-1")


def layout(arrangement="kv_layer", mla=False):
    return KVLayout("engine-model@r1", layers=LAYERS, kv_heads=1 if mla else HEADS, head_dim=DIM, dtype="bfloat16",
                    page_size=PS, mla=mla, arrangement=arrangement)


class Engine:
    """An engine's KV as SGLang's MHA pool (or MLA pool) holds it, and its forward: per layer, per token slot."""

    def __init__(self, mla=False):
        heads = 1 if mla else HEADS
        self.k = [torch.zeros(PAGES * PS, heads, DIM, dtype=torch.bfloat16, device=TEST_DEVICE)
                  for _ in range(LAYERS)]
        self.v = None if mla else [torch.zeros_like(t) for t in self.k]
        self.kv = KVPages.layer_first(self.k, self.v, PS)

    def forward(self, slots, tokens):
        """Write each token's K and V in every layer: values that depend on the token and the layer only."""
        idx = torch.as_tensor(np.asarray(slots), device=TEST_DEVICE)
        for layer, t in enumerate([*self.k, *(self.v or [])]):
            value = torch.as_tensor(tokens, dtype=torch.float32, device=TEST_DEVICE)[:, None, None] + layer / 8
            t[idx] = value.expand(len(tokens), *t.shape[1:]).to(t.dtype)

    def tokens_at(self, slots):
        """What each tensor holds at `slots`, as the token values the forward wrote (per layer, K then V)."""
        idx = torch.as_tensor(np.asarray(slots), device=TEST_DEVICE)
        return [(t[idx].float()[:, 0, 0] - layer / 8).round().long().cpu().tolist()
                for layer, t in enumerate([*self.k, *(self.v or [])])]


def kv_layer_pages(engine, device_pages):
    """What L2 and L3 must hold for these device pages, computed from the engine's tensors without kvc: per page, K
    layer by layer, then V layer by layer, each page_size tokens of bytes."""
    rows = []
    for p in np.asarray(device_pages).tolist():
        parts = [t[p * PS:(p + 1) * PS].cpu().contiguous().view(torch.uint8).reshape(-1)
                 for t in [*engine.k, *(engine.v or [])]]
        rows.append(torch.cat(parts).numpy())
    return np.stack(rows)


def run(cache, engine, rid, tokens):
    adm = cache.admit(Request(rid, tokens, NS))
    assert adm.status is AdmitStatus.ADMITTED
    new = adm.slots[adm.cached_tokens:]
    engine.forward(new, tokens[adm.cached_tokens:])
    cache.commit(rid)
    return adm


@pytest.mark.parametrize("mla", [False, True])
def test_a_prefix_backed_up_from_the_engines_tensors_loads_back_into_other_slots_layer_by_layer(mla):
    engine = Engine(mla)
    cache = TieredCache(CacheConfig(layout(mla=mla), device_tokens=PAGES * PS, host_tokens=64, device=TEST_DEVICE),
                        device_kv=engine.kv)
    tokens = list(range(100, 124))
    adm = run(cache, engine, "a", tokens)
    cache.flush()
    assert cache.audit().ok
    m = cache.match(Request("m", tokens, NS))
    host = [n.host for n in cache.tree.path(m.device_node) if n.host is not None]
    assert np.array_equal(cache.host_pool.kv.read(np.concatenate(host)), kv_layer_pages(engine, adm.pages))
    cache.evict(device_tokens=PAGES * PS)
    for t in [*engine.k, *(engine.v or [])]:
        t.fill_(-1)  # nothing stale can pass for what the load-back brings
    adm = cache.admit(Request("b", tokens, NS))
    assert adm.cached_tokens == 24 and adm.loaded_back_tokens == 24
    assert engine.tokens_at(adm.slots[:24]) == [tokens] * len(engine.kv.views)
    cache.commit("b")
    assert cache.audit().ok and cache.device_pool.pages is None  # kvc's own pool was never made


def test_pages_stored_from_one_engines_tensors_are_read_into_another_engines_through_l3(tmp_path):
    store = make_store(tmp_path / "s", layout())
    config = CacheConfig(layout(), device_tokens=PAGES * PS, host_tokens=64, device=TEST_DEVICE, io_thread=False)
    first = Engine()
    writer = TieredCache(config, store, device_kv=first.kv)
    tokens = list(range(7, 7 + 20))  # 5 pages
    adm = run(writer, first, "w", tokens)
    writer.flush()
    stored = np.zeros((5, writer.device_pool.page_bytes), dtype=np.uint8)
    hashes = page_hashes(writer.layout.layout_id, Request("w", tokens, NS).key, PS, writer.chain_key)
    assert store.get_into(hashes, list(stored)) == 5
    assert np.array_equal(stored, kv_layer_pages(first, adm.pages))  # L3 holds each page in kv_layer order
    writer.close()
    second = Engine()
    reader = TieredCache(config, store, device_kv=second.kv)
    reader.prefetch(Request("r", tokens, NS))
    reader.flush()
    adm = reader.admit(Request("r", tokens, NS))
    assert adm.cached_tokens == 20
    assert second.tokens_at(adm.slots[:20]) == [tokens] * len(second.kv.views)
    reader.commit("r")
    assert reader.audit().ok
    reader.close()
    store.close()


def test_an_engines_kv_must_agree_with_the_layout():
    engine = Engine()
    with pytest.raises(InvalidConfig, match="'kv_layer' order; the layout says 'token'"):
        TieredCache(CacheConfig(layout("token"), device_tokens=PAGES * PS, device=TEST_DEVICE), device_kv=engine.kv)
    with pytest.raises(InvalidConfig, match="holds 16 pages .* the pool needs 8"):
        TieredCache(CacheConfig(layout(), device_tokens=8 * PS, device=TEST_DEVICE), device_kv=engine.kv)

"""kvcache.engines.sglang.KvcStorage under SGLang's own classes (skipped where SGLang is not installed; run it with
SGLang's interpreter: see tests/unit/engines/fake_sglang.py for the stand-ins the unit tests use instead).

SGLang builds the backend through its storage backend factory (`--hicache-storage-backend dynamic`) and registers
its real host pools (MHA and MLA, every layout kvc supports, on CPU); the pages go through a real LMDB store.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

import pytest
import tomllib

sglang = pytest.importorskip("sglang", reason="SGLang is not installed here: `make engine-check` runs these in its venv "
                                               "(tests/unit/engines runs the adapter on stand-ins)")
torch = pytest.importorskip("torch")

with warnings.catch_warnings():  # SGLang warns on import that CPUs lack its GPU quantisation kernels
    warnings.simplefilter("ignore")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host import common as pool_common
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvcache.engines.sglang import SGLangL3
from kvcache.engines.sglang_pool import POOL_FORMS, HostPages
from kvcache.errors import EngineUnsupported
from kvcache.storage.registry import ENTRY_POINT_GROUP, backends
from unit.engines.fake_sglang import FakeMHAHostPool, FakeMLAHostPool

ROOT = Path(__file__).resolve().parents[2]
LAYERS, HEADS, HEAD_DIM, LORA, ROPE = 3, 2, 8, 16, 8


@pytest.fixture(autouse=True)
def kvc_backends(tmp_path_factory, monkeypatch):
    """kvc's store backends findable in SGLang's interpreter. kvc is not installed there: its entry points (the
    project's and the Redis plugin's, from their pyproject.toml) are laid out as an install would leave them."""
    if "lmdb" not in backends():
        site = tmp_path_factory.mktemp("site")
        for project in (ROOT, ROOT / "plugins" / "kvcache_redis"):
            meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
            info = site / f"{meta['name']}-{meta['version']}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: "
                                           f"{meta['version']}\n")
            points = meta["entry-points"][ENTRY_POINT_GROUP]
            (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n" +
                                                   "".join(f"{k} = {v}\n" for k, v in points.items()))
        monkeypatch.syspath_prepend(str(site))
        assert "lmdb" in backends()
    # SGLang registers host memory with CUDA by default; on CPU its own plain allocator does
    monkeypatch.setitem(pool_common.ALLOC_MEMORY_FUNCS, "cpu", pool_common.alloc_with_pin_memory)


def storage_config(store: str, mla: bool = False, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="org/test-model", extra_config={
                                    "backend_name": "kvc", "module_path": "kvcache.engines.sglang",
                                    "class_name": "KvcStorage", "kvc_store": store, "interface_v1": 1, **extra})


def mha_pool(layout: str, page_size: int, tokens: int = 64) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(size=tokens, page_size=page_size, dtype=torch.bfloat16, head_num=HEADS,
                              head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MHATokenToKVPoolHost(device._mha_buffer_info(), 2.0, 0, page_size, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS)


def mla_pool(layout: str, page_size: int, tokens: int = 64) -> MLATokenToKVPoolHost:
    device = MLATokenToKVPool(size=tokens, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=LORA,
                              qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    return MLATokenToKVPoolHost(device._mla_buffer_info(), 2.0, 0, page_size, layout, pin_memory=False,
                                device="cpu", device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS,
                                target_layer_num=LAYERS)


def fill(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def page(pool, p: int) -> bytes:
    return bytes(pool.get_data_page(p * pool.page_size).contiguous().view(torch.uint8).numpy())


def keys(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def slots(pool, pages: list[int]) -> torch.Tensor:
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def build(store: str, pool, mla: bool = False) -> HiCacheStorage:
    """As SGLang's cache controller attaches a backend: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(store, mla), pool)
    backend.register_mem_pool_host(pool)
    return backend


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", sorted(POOL_FORMS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_sglangs_factory_builds_it_and_its_real_host_pools_round_trip_through_both_interfaces(
        tmp_path, mla, layout, page_size):
    store = str(tmp_path / "l3")
    make = mla_pool if mla else mha_pool
    src, dst = make(layout, page_size, tokens=4 * page_size), make(layout, page_size, tokens=4 * page_size)
    fill(src, 1)
    writer, reader = build(store, src, mla), build(store, dst, mla)
    assert isinstance(writer, HiCacheStorage) and isinstance(writer, SGLangL3)
    assert type(writer).__name__ == "KvcStorage"
    zero, generic = keys("zero", 3), keys("generic", 3)
    assert writer.batch_set_v1(zero, slots(src, [0, 1, 2])) == [True] * 3
    # the generic interface as SGLang's controller drives it: get_data_page out, set_from_flat_data_page in
    assert writer.batch_set(generic, [src.get_data_page(p * page_size) for p in (3, 4, 5)]) is True
    assert reader.batch_exists(zero + generic) == 6
    assert reader.batch_get_v1(generic, slots(dst, [0, 1, 2])) == [True] * 3
    got = reader.batch_get(zero, [dst.get_dummy_flat_data_page() for _ in zero])
    for i, data in enumerate(got):
        dst.set_from_flat_data_page((3 + i) * page_size, data)
    assert [page(dst, p) for p in range(6)] == [page(src, p) for p in (3, 4, 5, 0, 1, 2)]


@pytest.mark.parametrize("layout", sorted(POOL_FORMS))
def test_the_unit_tests_stand_ins_hold_pages_as_sglangs_own_pools_do(layout):
    for real, fake, mla in ((mha_pool(layout, 4), FakeMHAHostPool, False),
                            (mla_pool(layout, 4), FakeMLAHostPool, True)):
        kw = ({"pages": real.size // 4, "layers": LAYERS, "kv_cache_dim": LORA + ROPE} if mla else
              {"pages": real.size // 4, "layers": LAYERS, "heads": HEADS, "head_dim": HEAD_DIM})
        stand_in = fake(layout, 4, **kw)
        assert stand_in.kv_buffer.shape == real.kv_buffer.shape
        fill(real, 2)
        stand_in.kv_buffer.copy_(real.kv_buffer)
        assert [page(stand_in, p) for p in range(4)] == [page(real, p) for p in range(4)]
        assert HostPages(stand_in, "m", mla, None).layout == HostPages(real, "m", mla, None).layout
        flat = real.get_data_page(8)
        stand_in.set_from_flat_data_page(0, flat)
        real.set_from_flat_data_page(0, flat)
        assert page(stand_in, 0) == page(real, 0)
        assert stand_in.get_dummy_flat_data_page().shape == real.get_dummy_flat_data_page().shape


def test_its_stats_are_sglangs_storage_metrics_and_v2_pools_are_refused(tmp_path):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = mha_pool("page_first", 4)
    backend = build(str(tmp_path / "l3"), pool)
    assert backend.batch_set_v1(keys("s", 2), slots(pool, [0, 1])) == [True, True]
    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics) and metrics.kvc.pages_written == 2
    with pytest.raises(EngineUnsupported, match="v2 host pool"):
        backend.register_mem_host_pool_v2(pool, "mamba")
    assert "sglang" in sys.modules

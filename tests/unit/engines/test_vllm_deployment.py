"""kvcache.engines.vllm_deployment: a vLLM deployment's identity, read from vLLM's OffloadingConfig (the stand-in
of tests/unit/engines/fake_vllm.py has its attribute names), as the layout its chunks are stored under."""

from __future__ import annotations

import dataclasses

import pytest

from kvcache.engines.vllm_deployment import ARRANGEMENT, VLLM_DTYPES, deployment
from kvcache.errors import EngineUnsupported
from kvcache.types.layout import DTYPE_BYTES
from unit.engines.fake_vllm import Group, offloading_config

ROW = 262144


def test_the_layout_is_an_opaque_chunk_named_by_model_dtype_chunk_and_run_config():
    d = deployment(offloading_config(tokens_per_block=16, blocks_per_chunk=4, layers=28), ROW)
    lay = d.layout()
    assert (lay.model, lay.dtype, lay.page_size, lay.layers) == ("Qwen/Qwen3-0.6B", "bfloat16", 64, 28)
    assert lay.arrangement == ARRANGEMENT and lay.bytes_per_page == ROW
    assert lay.engine_config.startswith("vllm tp=1 pp=1 pcp=1 dcp=1 world=1 groups=1 layers=28 chunk=4x16")
    assert lay.engine_config.endswith(f"#{d.digest}") and len(d.digest) == 12


def _changed(config, **parallel):
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **parallel))


BASE = offloading_config()
CHANGES = {
    "model": offloading_config(model="meta-llama/Llama-3.1-8B"),
    "dtype": offloading_config(dtype="float16"),
    "tp": offloading_config(tp=2),
    "pp": _changed(BASE, pp_size=2),
    "pcp": _changed(BASE, pcp_size=2),
    "dcp": _changed(BASE, dcp_size=2),
    "world": _changed(BASE, world_size=4),
    "rank": _changed(BASE, rank=1),
    "layers": offloading_config(layers=5),
    "layer name": dataclasses.replace(BASE, groups=(dataclasses.replace(BASE.groups[0], layer_names=tuple(
        n.replace("attn", "mla") for n in BASE.groups[0].layer_names)),)),
    "group id": dataclasses.replace(BASE, groups=(dataclasses.replace(BASE.groups[0], group_id=1),)),
    "sliding window": dataclasses.replace(BASE, groups=(dataclasses.replace(BASE.groups[0],
                                                                            sliding_window_size_in_chunks=8),)),
    "groups": offloading_config(groups=2),
    "tokens per block": offloading_config(tokens_per_block=32),
    "blocks per chunk": offloading_config(blocks_per_chunk=2),
    "tokens per hash": dataclasses.replace(BASE, cache=dataclasses.replace(BASE.cache, tokens_per_hash=8)),
    "replicated": offloading_config(replicated_layout=True),
    "canonical": offloading_config(canonical_layout=True),
    "kv layout": offloading_config(kv_cache_layout="HND"),
}


@pytest.mark.parametrize("what", sorted(CHANGES))
def test_every_field_of_the_run_config_is_part_of_the_identity(what):
    assert deployment(CHANGES[what], ROW).layout().layout_id != deployment(BASE, ROW).layout().layout_id


def test_the_chunk_size_is_part_of_the_identity_and_the_same_config_is_the_same_layout():
    assert deployment(BASE, ROW).layout().layout_id != deployment(BASE, ROW * 2).layout().layout_id
    assert deployment(BASE, ROW).layout() == deployment(offloading_config(), ROW).layout()
    # data-parallel replicas of one deployment share their chunks: the replica index is not part of it
    assert deployment(_changed(BASE, data_parallel_index=3, data_parallel_size=4), ROW).layout() == \
        deployment(BASE, ROW).layout()


def test_every_vllm_dtype_name_maps_to_a_kvc_dtype():
    assert set(VLLM_DTYPES.values()) <= set(DTYPE_BYTES)
    assert deployment(offloading_config(dtype="torch.bfloat16"), ROW).dtype == "bfloat16"


@pytest.mark.parametrize("config, row, says", [
    (offloading_config(dtype="fp8_ds_mla"), ROW, "KV cache dtype"),
    (offloading_config(), 0, "without chunks"),
    (dataclasses.replace(BASE, groups=()), ROW, "without KV cache groups"),
    (offloading_config(model="  "), ROW, "names no model"),
])
def test_what_kvc_cannot_name_is_engine_unsupported(config, row, says):
    with pytest.raises(EngineUnsupported, match=says):
        deployment(config, row)


def test_groups_of_different_block_sizes_take_the_largest_chunk():
    two = dataclasses.replace(BASE, groups=(Group(0, 16, ("a",)), Group(1, 64, ("b",))))
    assert deployment(two, ROW).tokens_per_chunk == 64

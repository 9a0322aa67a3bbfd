import pytest

from kvcache import InvalidLayout, KVLayout


def base(**kw):
    fields = dict(model="llama@r1", layers=2, kv_heads=4, head_dim=8, dtype="bfloat16", page_size=16)
    fields.update(kw)
    return KVLayout(**fields)


def test_sizes():
    lay = base()
    assert lay.bytes_per_token == 2 * 2 * 4 * 8 * 2
    assert lay.bytes_per_page == lay.bytes_per_token * 16


@pytest.mark.parametrize("change", [dict(model="llama@r2"), dict(layers=3), dict(kv_heads=2), dict(head_dim=16),
                                    dict(dtype="float16"), dict(page_size=32)])
def test_layout_id_covers_every_field(change):
    assert base().layout_id != base(**change).layout_id
    assert base().layout_id == base().layout_id


@pytest.mark.parametrize("bad", [dict(model=""), dict(layers=0), dict(head_dim=-1), dict(page_size=True),
                                 dict(dtype="float64"), dict(kv_heads=1.5)])
def test_invalid(bad):
    with pytest.raises(InvalidLayout):
        base(**bad)


# --- what engines' pages need: MLA, V's width, the byte order of a page, the shard ---------------------------

from kvcache import Shard  # noqa: E402
from kvcache.types.layout import ARRANGEMENTS  # noqa: E402

# layout ids computed on main before these fields existed: a layout that uses none of them keeps its id, bit for bit
GOLDEN_IDS = {
    "8f3143e534da60b5981e4573f87c6f69": dict(),
    "ea6127108fdebe61f0f329e8df9d8626": dict(model="Qwen/Qwen3-0.6B@main", layers=28, kv_heads=8, head_dim=128,
                                             dtype="float16", page_size=64),
}


@pytest.mark.parametrize("golden", sorted(GOLDEN_IDS))
def test_an_existing_layout_keeps_its_id(golden):
    assert base(**GOLDEN_IDS[golden]).layout_id.hex() == golden
    explicit = base(**GOLDEN_IDS[golden], v_head_dim=0, mla=False, arrangement="token", shard=None)
    assert explicit.layout_id.hex() == golden  # the defaults spelled out are the same layout


@pytest.mark.parametrize("change", [dict(v_head_dim=16), dict(arrangement="kv_token"), dict(arrangement="kv_layer"),
                                    dict(shard=Shard(0, 1)), dict(shard=Shard(0, 2)), dict(shard=Shard(1, 2)),
                                    dict(shard=Shard(0, 2, pp_rank=1, pp_size=2)),
                                    dict(shard=Shard(0, 2, cp_rank=1, cp_size=2)),
                                    dict(kv_heads=1, mla=True)])
def test_each_engine_field_is_part_of_the_identity(change):
    plain = base(kv_heads=change.get("kv_heads", 4))
    assert base(**change).layout_id != plain.layout_id


def test_two_shards_never_share_an_id():
    ids = {base(shard=Shard(tp, 4, pp_rank=pp, pp_size=2)).layout_id for tp in range(4) for pp in range(2)}
    assert len(ids) == 8 and base().layout_id not in ids


def test_sizes_with_a_v_width_and_mla():
    assert base(v_head_dim=4).bytes_per_token == 2 * 4 * (8 + 4) * 2  # layers * kv_heads * (K + V widths) * bytes
    assert base(v_head_dim=8).bytes_per_token == base().bytes_per_token
    mla = base(kv_heads=1, head_dim=576, mla=True)
    assert mla.bytes_per_token == 2 * 576 * 2  # one latent per token per layer, no V
    assert mla.bytes_per_page == mla.bytes_per_token * 16


@pytest.mark.parametrize("bad", [dict(mla=True), dict(kv_heads=1, mla=True, v_head_dim=4), dict(mla=1),
                                 dict(v_head_dim=-1), dict(v_head_dim=True), dict(arrangement="layer"),
                                 dict(shard=(0, 2))])
def test_invalid_engine_fields(bad):
    with pytest.raises(InvalidLayout):
        base(**bad)


@pytest.mark.parametrize("bad", [dict(tp_rank=2, tp_size=2), dict(tp_rank=-1, tp_size=2), dict(tp_rank=0, tp_size=0),
                                 dict(tp_rank=0, tp_size=1, pp_rank=1), dict(tp_rank=0, tp_size=1, cp_size=0),
                                 dict(tp_rank=True, tp_size=2)])
def test_invalid_shards(bad):
    with pytest.raises(InvalidLayout):
        Shard(**bad)


def test_engine_layouts_round_trip_and_describe_themselves():
    import msgspec

    lay = base(kv_heads=1, mla=True, arrangement="kv_layer", shard=Shard(1, 2, pp_rank=0, pp_size=2))
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(lay), type=KVLayout) == lay
    assert msgspec.json.decode(b'{"model":"llama@r1","layers":2,"kv_heads":4,"head_dim":8,"dtype":"bfloat16",'
                               b'"page_size":16}', type=KVLayout) == base()  # a record written before them
    text = lay.describe()
    assert "mla" in text and "arrangement=kv_layer" in text and "tp=1/2 pp=0/2" in text
    assert base().describe() == "llama@r1 layers=2 kv_heads=4 head_dim=8 dtype=bfloat16 page_size=16"
    assert "v_head_dim=4" in base(v_head_dim=4).describe()


def test_every_arrangement_is_described():
    assert set(ARRANGEMENTS) == {"token", "kv_token", "kv_layer", "vllm_chunk"}
    assert all(text.strip() for text in ARRANGEMENTS.values())


# --- opaque pages: an engine's chunk whose geometry the engine keeps (vLLM's offload rows) -----------------------

from kvcache.types.layout import OPAQUE  # noqa: E402


def chunk(**kw):
    fields = dict(model="Qwen/Qwen3-0.6B", layers=28, kv_heads=1, head_dim=1, dtype="bfloat16", page_size=16,
                  arrangement="vllm_chunk", page_bytes=262144, engine_config="vllm tp=1 #abc")
    fields.update(kw)
    return KVLayout(**fields)


def test_an_opaque_page_is_page_bytes_long_and_has_no_per_token_geometry():
    assert OPAQUE == {"vllm_chunk"}
    lay = chunk()
    assert lay.bytes_per_page == 262144
    with pytest.raises(InvalidLayout, match="opaque"):
        lay.bytes_per_token  # noqa: B018  (no cache of kvc's own can hold it token by token)
    text = lay.describe()
    assert "page_bytes=262144" in text and "vllm tp=1 #abc" in text and "kv_heads" not in text


@pytest.mark.parametrize("change", [dict(page_bytes=131072), dict(engine_config="vllm tp=2 #def"),
                                    dict(engine_config=""), dict(layers=27), dict(page_size=32),
                                    dict(dtype="float16")])
def test_page_bytes_and_engine_config_are_part_of_the_identity(change):
    assert chunk(**change).layout_id != chunk().layout_id


@pytest.mark.parametrize("bad", [dict(page_bytes=0), dict(arrangement="token"), dict(kv_heads=2), dict(head_dim=8),
                                 dict(mla=True), dict(v_head_dim=4), dict(page_bytes=-1), dict(engine_config=3)])
def test_page_bytes_go_with_an_opaque_arrangement_and_nothing_else(bad):
    with pytest.raises(InvalidLayout):
        chunk(**bad)
    with pytest.raises(InvalidLayout):
        base(page_bytes=4096)  # a page with a geometry has no page_bytes of its own


def test_an_opaque_layout_round_trips():
    import msgspec

    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(chunk()), type=KVLayout) == chunk()

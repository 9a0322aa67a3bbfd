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

import pytest

from kvcache import InvalidInput, InvalidTokens, Namespace, Request


def test_request_carries_its_namespace_in_its_key():
    ns = Namespace("t1", "salt-xyzzy")
    r = Request("r1", [1, 2, 3], ns, output_len=4)
    assert r.key.namespace == ns and r.namespace == ns and len(r) == 3 and r.tokens == [1, 2, 3]
    assert "xyzzy" not in repr(r)


@pytest.mark.parametrize("kwargs", [dict(rid=""), dict(rid=3), dict(namespace="t1"), dict(output_len=-1)])
def test_invalid(kwargs):
    args = dict(rid="r", tokens=[1], namespace=Namespace(), output_len=None)
    args.update(kwargs)
    with pytest.raises(InvalidInput):
        Request(**args)


def test_bad_tokens_named():
    with pytest.raises(InvalidTokens, match="-5"):
        Request("r", [1, -5])


def test_immutable():
    r = Request("r", [1])
    with pytest.raises(AttributeError):
        r.rid = "x"  # type: ignore[misc]

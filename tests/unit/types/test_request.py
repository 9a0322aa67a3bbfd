import pytest

from kvcache import InvalidInput, InvalidTokens, Namespace, RadixKey, Request


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


def test_a_request_from_packed_bytes_keeps_them_as_its_key_and_still_checks_their_length():
    # Packed bytes skip pack_tokens' type tests; the key is what the token list would give, the bytes themselves.
    ns = Namespace("t1")
    data = RadixKey.of([7, 8, 2**32 - 1], ns).data
    r = Request("r", data, ns, output_len=2, ttl_s=5.0)
    assert r.key == RadixKey.of([7, 8, 2**32 - 1], ns) and r.key.data is data and r.tokens == [7, 8, 2**32 - 1]
    assert (r.rid, r.output_len, r.ttl_s, r.namespace) == ("r", 2, 5.0, ns)
    with pytest.raises(InvalidTokens):
        Request("r", data[:-1], ns)  # not whole tokens
    with pytest.raises(InvalidInput):
        Request("r", data, "t1")  # type: ignore[arg-type]  # the namespace is checked first
    assert Request("r", b"").tokens == []
    with pytest.raises(AttributeError):
        r.key = RadixKey.of([1], ns)  # type: ignore[misc]

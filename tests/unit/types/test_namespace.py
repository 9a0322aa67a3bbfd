import pickle

import msgspec
import pytest

from kvcache import InvalidNamespace, Namespace, NamespaceInfo


def test_empty_string_and_none_are_one_namespace():
    assert Namespace("", "") == Namespace(None, None) == Namespace()
    assert Namespace("", "").id == Namespace().id
    assert hash(Namespace("", None)) == hash(Namespace(None, ""))
    assert Namespace("", "").extra_key is None and Namespace().is_default


def test_fields_matter():
    ids = {Namespace(k, s).id for k in (None, "t1", "t2") for s in (None, "s1", "s2")}
    assert len(ids) == 9
    # length prefixes keep concatenations apart
    assert Namespace("ab", "c") != Namespace("a", "bc")
    assert Namespace("t1", None) != Namespace(None, "t1")


def test_salt_never_shown():
    ns = Namespace("tenant", "hunter2-secret")
    for text in (repr(ns), str(ns), ns.label, repr(ns.info()), msgspec.json.encode(ns.info()).decode()):
        assert "hunter2-secret" not in text
    assert ns.salt_fingerprint and len(ns.salt_fingerprint) == 12
    with pytest.raises(TypeError):
        msgspec.json.encode(ns)  # a Namespace cannot be serialised by accident


def test_fingerprint_is_stable_and_keyed():
    a, b = Namespace("x", "s"), Namespace("y", "s")
    assert a.salt_fingerprint == b.salt_fingerprint  # a property of the salt alone
    assert Namespace("x", "t").salt_fingerprint != a.salt_fingerprint
    assert Namespace("x").salt_fingerprint is None


def test_immutable_and_picklable():
    ns = Namespace("t1", "s")
    with pytest.raises(AttributeError):
        ns.extra_key = "other"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(ns)) == ns


@pytest.mark.parametrize("bad", [1, b"bytes", ["list"], 2.0])
def test_wrong_types_rejected(bad):
    with pytest.raises(InvalidNamespace):
        Namespace(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidNamespace):
        Namespace("ok", bad)  # type: ignore[arg-type]


def test_info():
    assert Namespace("t1").info() == NamespaceInfo("t1", None)

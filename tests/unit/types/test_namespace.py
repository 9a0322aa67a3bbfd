import pickle

import msgspec
import pytest

from kvcache import InvalidNamespace, Namespace, NamespaceInfo
from kvcache.types.namespace import UNKNOWN_FINGERPRINT

KEY = bytes(range(32))  # a fingerprint key (a store's)


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
    for text in (repr(ns), str(ns), ns.label, repr(ns.info(KEY)), msgspec.json.encode(ns.info(KEY)).decode()):
        assert "hunter2-secret" not in text
    fingerprint = ns.fingerprint(KEY)
    assert fingerprint and len(fingerprint) == 12
    with pytest.raises(TypeError):
        msgspec.json.encode(ns)  # a Namespace cannot be serialised by accident


def test_fingerprint_is_stable_and_keyed():
    a, b = Namespace("x", "s"), Namespace("y", "s")
    assert a.fingerprint(KEY) == b.fingerprint(KEY)  # a property of the salt alone
    assert Namespace("x", "t").fingerprint(KEY) != a.fingerprint(KEY)
    assert Namespace("x").fingerprint(KEY) is None


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
    assert Namespace("t1").info(KEY) == NamespaceInfo("t1", None)
    # without a key, a salted namespace's fingerprint is unknown (as a registry records one under an earlier key),
    # and its label says it has a salt, not which
    assert Namespace("t1", "s").info(None) == NamespaceInfo("t1", UNKNOWN_FINGERPRINT)
    assert Namespace("t1").info(None) == NamespaceInfo("t1", None)
    assert (Namespace("t1", "s").label, Namespace("t1").label, Namespace().label) == ("t1/?", "t1/-", "-/-")

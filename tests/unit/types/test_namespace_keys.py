"""Namespace's keyed digests (the fingerprint key) and text that cannot be a namespace field."""

import os
import pickle
import subprocess
import sys

import pytest

from kvcache import InvalidInput, InvalidNamespace, Namespace
from kvcache.errors import KeyFileError
from kvcache.types.fingerprint_key import FINGERPRINT_KEY_ENV, FingerprintKey, parse_fingerprint_key
from kvcache.types.namespace import display_id

KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


@pytest.mark.parametrize("field", ["extra_key", "cache_salt"])
@pytest.mark.parametrize("text", ["\udcff\udcfe", "t1\ud800", "\udfff"])
def test_lone_surrogates_are_invalid_namespaces(field, text):
    # what Python makes of the bytes ff fe on a command line (surrogateescape): no UTF-8, no digest, no JSON
    with pytest.raises(InvalidNamespace) as info:
        Namespace(**{field: text}) if field == "extra_key" else Namespace("t1", text)
    assert text not in str(info.value)  # the value (maybe the salt) is never echoed


def test_fingerprints_differ_across_keys_and_never_equal_the_unkeyed_public_digest():
    ns = Namespace("t1", "wrong")
    a, b = ns.fingerprint(KEY_A), ns.fingerprint(KEY_B)
    assert a != b and len(a) == len(b) == 12
    assert ns.fingerprint(KEY_A) == a  # stable under one key
    assert Namespace("t2", "wrong").fingerprint(KEY_A) == a  # a property of the salt alone
    assert "c39589a45512" not in (a, b)  # the README's old fingerprint of the salt `wrong` (a public constant key)
    assert ns.info(KEY_A).salt_fingerprint == a and Namespace("t1").fingerprint(KEY_A) is None


def test_a_key_value_derives_fingerprints_display_ids_and_labels_under_its_own_secret():
    ns = Namespace("t1", "s")
    a, b = FingerprintKey(KEY_A), FingerprintKey(KEY_B)
    assert a.fingerprint(ns) == ns.fingerprint(KEY_A) != b.fingerprint(ns)
    assert a.display_id(ns.id) == display_id(ns.id, KEY_A) != b.display_id(ns.id)
    assert len(a.display_id(ns.id)) == 16 and a.display_id(ns.id) not in ns.id_hex  # not a prefix of the raw id
    assert a.info(ns).salt_fingerprint == a.fingerprint(ns) and a.info(Namespace("t1")).salt_fingerprint is None
    assert a.label(ns) == f"t1/{a.fingerprint(ns)}" and a.label(Namespace()) == "-/-"
    assert a == FingerprintKey(bytes(KEY_A)) and a != b and a.secret == a.known == KEY_A
    assert KEY_A.hex() not in repr(a) and pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(InvalidInput):
        FingerprintKey(b"short")


def test_of_takes_the_given_key_else_env_else_a_random_key_of_its_own(monkeypatch):
    monkeypatch.delenv(FINGERPRINT_KEY_ENV, raising=False)
    assert FingerprintKey.of(KEY_A) == FingerprintKey(KEY_A)
    drawn = {FingerprintKey.of(None).fingerprint(Namespace("t1", "wrong")) for _ in range(2)}
    assert len(drawn) == 2  # no constant in the code: two keyless values disagree
    monkeypatch.setenv(FINGERPRINT_KEY_ENV, KEY_B.hex())
    assert FingerprintKey.of(None) == FingerprintKey(KEY_B) and FingerprintKey.of(KEY_A) == FingerprintKey(KEY_A)


def test_nothing_in_the_process_keys_a_namespace():
    """A namespace has no fingerprint of its own: none is derived without a key given (no key of the process)."""
    code = ("from kvcache import Namespace; ns = Namespace('t1', 'wrong'); "
            "print(ns.label, ns.info(None).salt_fingerprint, hasattr(ns, 'salt_fingerprint'), "
            "hasattr(ns, 'display_id'))")
    env = {k: v for k, v in os.environ.items() if k != FINGERPRINT_KEY_ENV}
    env[FINGERPRINT_KEY_ENV] = KEY_A.hex()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["t1/?", "?", "False", "False"]


@pytest.mark.parametrize("text", ["", "xyz", "00" * 15, "00" * 65])
def test_bad_keys_are_refused_without_echoing_them(text):
    with pytest.raises(InvalidInput) as info:
        parse_fingerprint_key(text)
    assert FINGERPRINT_KEY_ENV in str(info.value)
    assert parse_fingerprint_key("ab" * 32) == b"\xab" * 32


def test_a_withheld_key_refuses_every_keyed_value_naming_where_and_why(monkeypatch):
    ns = Namespace("t1", "withheld-salt")
    withheld = FingerprintKey.withheld("here", "no key")
    assert withheld.is_withheld and withheld.known is None and "here" in repr(withheld)
    for derive in (withheld.fingerprint, withheld.info, withheld.label, lambda n: withheld.display_id(n.id),
                   lambda n: withheld.secret):
        with pytest.raises(KeyFileError, match="here: no key"):
            derive(ns)
    with pytest.raises(KeyFileError):
        withheld.info(Namespace("t1"))  # even without a salt: a context without a key derives nothing
    assert pickle.loads(pickle.dumps(withheld)) == withheld
    # or_withheld: the key given, else the deployment's (env), else withheld — never a random one
    monkeypatch.delenv(FINGERPRINT_KEY_ENV, raising=False)
    assert FingerprintKey.or_withheld(KEY_A, "here", "no key") == FingerprintKey(KEY_A)
    assert FingerprintKey.or_withheld(None, "here", "no key") == withheld
    monkeypatch.setenv(FINGERPRINT_KEY_ENV, KEY_B.hex())
    assert FingerprintKey.or_withheld(None, "here", "no key") == FingerprintKey(KEY_B)

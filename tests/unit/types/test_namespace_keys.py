"""Namespace's keyed digests (the fingerprint key) and text that cannot be a namespace field."""

import os
import subprocess
import sys

import pytest

from kvcache import InvalidInput, InvalidNamespace, Namespace
from kvcache.types.namespace import (
    FINGERPRINT_KEY_ENV,
    display_id,
    fingerprint_key,
    parse_fingerprint_key,
    use_fingerprint_key,
)

KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


@pytest.fixture
def restore_key():
    before = fingerprint_key()
    yield
    use_fingerprint_key(before)


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


def test_the_process_key_drives_salt_fingerprint_and_display_id(restore_key):
    ns = Namespace("t1", "s")
    use_fingerprint_key(KEY_A)
    fp_a, shown_a = ns.salt_fingerprint, ns.display_id
    use_fingerprint_key(KEY_B)
    assert ns.salt_fingerprint == ns.fingerprint(KEY_B) != fp_a
    assert ns.display_id == display_id(ns.id, KEY_B) != shown_a
    assert len(shown_a) == 16 and shown_a not in ns.id_hex  # not a prefix of the raw id
    with pytest.raises(InvalidInput):
        use_fingerprint_key(b"short")


def test_an_unconfigured_process_draws_a_random_key_and_env_sets_one():
    code = ("from kvcache import Namespace; print(Namespace('t1', 'wrong').salt_fingerprint)")
    env = {k: v for k, v in os.environ.items() if k != FINGERPRINT_KEY_ENV}
    runs = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert len(runs) == 2  # no constant in the code: two unconfigured processes disagree
    env[FINGERPRINT_KEY_ENV] = KEY_A.hex()
    keyed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert keyed.stdout.strip() == Namespace("t1", "wrong").fingerprint(KEY_A)


@pytest.mark.parametrize("text", ["", "xyz", "00" * 15, "00" * 65])
def test_bad_keys_are_refused_without_echoing_them(text):
    with pytest.raises(InvalidInput) as info:
        parse_fingerprint_key(text)
    assert FINGERPRINT_KEY_ENV in str(info.value)
    assert parse_fingerprint_key("ab" * 32) == b"\xab" * 32


def test_a_withheld_key_is_never_replaced_by_a_random_one_in_that_context_only(monkeypatch):
    import threading

    from kvcache.errors import KeyFileError
    from kvcache.types.namespace import (
        fingerprint_key_scope,
        known_fingerprint_key,
        use_fingerprint_key,
        withhold_fingerprint_key,
    )

    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)
    ns = Namespace("t1", "withheld-salt")
    with fingerprint_key_scope():
        use_fingerprint_key(None)
        withhold_fingerprint_key("here", "no key")
        assert known_fingerprint_key() is None
        with pytest.raises(KeyFileError, match="here: no key"):
            ns.info()
        with pytest.raises(KeyFileError):
            _ = ns.display_id
        other: list = []
        thread = threading.Thread(target=lambda: other.append(ns.info().salt_fingerprint))  # another context
        thread.start()
        thread.join()
        assert other[0] is not None and known_fingerprint_key() is None  # its random key is never "known"
        use_fingerprint_key(b"k" * 32)
        assert ns.info().salt_fingerprint == ns.fingerprint(b"k" * 32) and known_fingerprint_key() == b"k" * 32
    ns.info()  # the scope ended: nothing withheld

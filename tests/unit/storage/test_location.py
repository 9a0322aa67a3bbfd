"""StoreLocation: a store's path or URL that prints with its credentials removed, by structure (issue 36, item 5).

On ebaf189 `redact` replaced every occurrence of a credential's text: a password `1` turned 127.0.0.1 into
***27.0.0.***, and an lmdb:// location with a ?token= printed as `lmdb:/...` (urlunsplit's normal form) — the tests
marked "ebaf189" fail there."""

import os
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache import InvalidInput
from kvcache.storage.location import StoreLocation


@pytest.mark.parametrize("url, shown, secret", [
    ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0", "hunter2"),
    ("redis://bob:p%40ss@cache:6379/0?prefix=prod:", "redis://bob:***@cache:6379/0?prefix=prod:", "p@ss"),
    ("rediss+cluster://u:pw-x@h1:7000", "rediss+cluster://u:***@h1:7000", "pw-x"),
    ("redis://cache:6379/0?password=zz9&prefix=a:", "redis://cache:6379/0?password=***&prefix=a:", "zz9"),
    ("lmdb:///srv/kvc?token=t0k", "lmdb:///srv/kvc?token=***", "t0k"),  # ebaf189: lmdb:/srv/kvc?token=***
])
def test_credentials_never_print(url, shown, secret):
    location = StoreLocation(url)
    assert str(location) == shown and repr(location) == f"StoreLocation({shown!r})"
    assert location.url == url and location.is_url
    assert secret in location.secrets


def test_a_one_character_password_is_removed_from_its_place_only():
    # ebaf189: the error line read redis://:***@***27.0.0.***:***/0 ... connecting to ***27.0.0.***
    location = StoreLocation("redis://:1@127.0.0.1:6379/0?prefix=p1:")
    assert str(location) == "redis://:***@127.0.0.1:6379/0?prefix=p1:"
    said = "Error 111 connecting to 127.0.0.1:6379 for prefix p1:"
    assert location.redact(said) == said  # text that does not name the location is left as it is
    assert location.redact(f"{location.url}: refused") == f"{location}: refused"


@given(st.text(min_size=1, max_size=8))
def test_the_shown_form_is_the_same_whatever_the_password(password):
    """Structure, not substring: nothing of the password, not even where it would match, reaches the shown form."""
    for url in (f"redis://:{quote(password, safe='')}@127.0.0.1:6379/0?prefix=a.1/e:",
                f"redis://127.0.0.1:6379/0?password={quote(password, safe='')}&prefix=a.1/e:"):
        location = StoreLocation(url)
        assert str(location) in ("redis://:***@127.0.0.1:6379/0?prefix=a.1/e:",
                                 "redis://127.0.0.1:6379/0?password=***&prefix=a.1/e:")
        assert location.redact(f"cannot reach {url}") == f"cannot reach {location}"


def test_a_path_location_shows_its_directory_given_or_resolved(tmp_path, monkeypatch):
    """An LMDB store's errors name its directory (the store resolves it): that whole path is what is shown."""
    real = tmp_path / "s?token=a"
    real.mkdir()
    (tmp_path / "link").symlink_to(tmp_path)
    monkeypatch.chdir(tmp_path / "link")
    location = StoreLocation("lmdb://s?token=a")
    assert str(location) == "lmdb://s?token=***"
    said = f"{real}/data.mdb: cannot read; s?token=a is the store; a salt: a"
    assert location.redact(said) == f"{tmp_path}/s?token=***/data.mdb: cannot read; s?token=*** is the store; a " \
                                    f"salt: a"
    assert os.path.realpath("s?token=a") == str(real)


def test_paths_and_plain_urls_print_as_given():
    for plain in ("./kvc-store", "/srv/prod/kvc-store", "redis://cache:6379/0?prefix=p:", "lmdb:///srv/kvc",
                  "redis://h:1/0?prefix=a@b", "lmdb://d/a@b"):
        location = StoreLocation(plain)
        assert str(location) == plain and location.secrets == () and location.redact(plain) == plain
    assert not StoreLocation("./kvc-store").is_url
    assert StoreLocation("a") == StoreLocation("a") != StoreLocation("b")


def test_a_bad_port_is_invalid_input_without_the_password():
    with pytest.raises(InvalidInput) as info:
        StoreLocation("redis://:hunter2@127.0.0.1:notaport/0")
    assert "hunter2" not in str(info.value) and "notaport" in str(info.value)
    with pytest.raises(InvalidInput):
        StoreLocation(b"bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["redis://:se/cret@host:6379/0", "redis://:12/cret@host:6379/0",
                                 "redis://:se?cret@host", "redis://user:12#cret@host", "redis://u:se/cr@t@h/0"])
def test_a_password_that_cuts_the_url_short_is_refused_without_any_of_it(url):
    """An unencoded '/', '?' or '#' ends the authority early: part of the password would read as a port or a
    path and be printed. ebaf189 echoed `redis://:se` or showed the URL whole."""
    with pytest.raises(InvalidInput) as info:
        StoreLocation(url)
    message = str(info.value)
    assert not [part for part in ("cret", "cr@t", ":se", ":12") if part in message], message
    assert message.startswith("redis:// URL: ") and "percent-encoded" in message

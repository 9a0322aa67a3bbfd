"""StoreLocation: a store's path or URL that prints with its credentials redacted."""

import pytest

from kvcache import InvalidInput
from kvcache.storage.location import StoreLocation


@pytest.mark.parametrize("url, shown, secret", [
    ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0", "hunter2"),
    ("redis://bob:p%40ss@cache:6379/0?prefix=prod:", "redis://bob:***@cache:6379/0?prefix=prod:", "p@ss"),
    ("rediss+cluster://u:pw-x@h1:7000", "rediss+cluster://u:***@h1:7000", "pw-x"),
    ("redis://cache:6379/0?password=zz9&prefix=a:", "redis://cache:6379/0?password=***&prefix=a:", "zz9"),
])
def test_credentials_never_print(url, shown, secret):
    location = StoreLocation(url)
    assert str(location) == shown and repr(location) == f"StoreLocation({shown!r})"
    assert location.url == url and location.is_url
    assert secret in location.secrets
    message = f"cannot reach {url} (auth {secret})"
    assert secret not in location.redact(message) and "***" in location.redact(message)


def test_paths_and_plain_urls_print_as_given():
    for plain in ("./kvc-store", "/var/lib/kvc", "redis://cache:6379/0?prefix=p:", "lmdb:///srv/kvc"):
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

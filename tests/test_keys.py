"""Key normalisation as Flux does it (kvs_util_normalize_key)."""

import errno

import pytest

from broker.errors import ErrnoError
from kvs import keys


@pytest.mark.parametrize(
    ("key", "norm"),
    [
        ("a", "a"),
        ("a.b.c", "a.b.c"),
        ("a..b", "a.b"),
        (".a.b.", "a.b"),
        ("...a...b...", "a.b"),
        ("", "."),
        (".", "."),
        ("....", "."),
    ],
)
def test_normalize(key: str, norm: str) -> None:
    assert keys.normalize(key) == norm
    assert keys.check_key(key) == norm


def test_split_join_round_trip() -> None:
    assert keys.split(".") == []
    assert keys.split("a..b.") == ["a", "b"]
    assert keys.join([]) == "."
    assert keys.join(["a", "b"]) == "a.b"
    assert keys.join(keys.split("x.y.z")) == "x.y.z"


@pytest.mark.parametrize("bad", [None, 3, b"a", ["a"], "a\0b"])
def test_check_key_rejects(bad: object) -> None:
    with pytest.raises(ErrnoError) as e:
        keys.check_key(bad)
    assert e.value.errnum == errno.EINVAL


@pytest.mark.parametrize(
    ("target", "parsed"),
    [
        ("a.b", (None, "a.b")),
        ("ns1::a.b", ("ns1", "a.b")),
        ("ns1::", ("ns1", "")),
        ("::a", (None, "::a")),
        ("job-1::x::y", ("job-1", "x::y")),
    ],
)
def test_parse_ns_target(target: str, parsed: tuple[str | None, str]) -> None:
    assert keys.parse_ns_target(target) == parsed

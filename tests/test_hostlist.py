"""Host lists as Flux writes them (RFC 29), for ``overlay lookup``."""

from __future__ import annotations

import pytest

from broker.hostlist import MAX_HOSTS, encode, expand


def test_adjacent_numbered_names_fold_into_ranges() -> None:
    assert encode([f"fake{i}" for i in range(15)]) == "fake[0-14]"
    assert encode(["fake2"]) == "fake2"
    assert encode(["n1", "n2", "n3", "n7", "login", "n8"]) == "n[1-3,7],login,n8"
    assert encode(["n08", "n09", "n10"]) == "n[08-10]"  # (zero-padded: one width)
    assert encode(["n8", "n09"]) == "n8,n09"


def test_order_and_repeats_are_kept() -> None:
    """One name per rank: four ranks on one host are four names."""
    assert encode(["vm"] * 4) == "vm,vm,vm,vm"
    assert encode(["n3", "n1", "n2"]) == "n[3,1-2]"
    assert encode(["n1", "n1"]) == "n1,n1"
    for hosts in (["n3", "n1", "n2"], ["n1", "n1", "n2"], ["a", "b1", "b2", "a"],
                  [f"r{i}-ib" for i in range(3)], ["n08", "n09", "n10", "x"]):
        assert expand(encode(hosts)) == hosts


def test_expand_reads_brackets_lists_and_suffixes() -> None:
    assert expand("fake[0-2,5],x") == ["fake0", "fake1", "fake2", "fake5", "x"]
    assert expand("n[08-10]") == ["n08", "n09", "n10"]
    assert expand("rack[1-2]-ib") == ["rack1-ib", "rack2-ib"]
    assert expand("node1.example.org") == ["node1.example.org"]


@pytest.mark.parametrize("bad, why", [
    ("fake2[", "unbalanced brackets"),
    ("a]b", "not a host name"),
    ("a,,b", "not a host name"),
    ("", "not a host name"),
    ("a[3-1]", "does not ascend"),
    ("a[x]", "not a number or range"),
    ("a[1-2", "unbalanced brackets"),
    ("a[[1]]", "unbalanced brackets"),
    ("n[1-2]x[1-2]", "only one bracketed range per name"),  # (balanced: it said unbalanced)
    (f"n[0-{MAX_HOSTS}]", "names more than"),
])
def test_a_malformed_list_says_what_is_wrong(bad: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[")):
        expand(bad)

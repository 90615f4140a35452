"""Event subscriptions by string prefix, and the sequence-gap tracker (broker/events.py)."""

from __future__ import annotations

import logging
import random

import pytest

from broker.events import SeqTracker, SubscriptionTable


def test_prefix_is_a_plain_string_prefix() -> None:
    t = SubscriptionTable()
    t.subscribe("kvs", "kvs.namespace-job-1")
    assert t.match("kvs.namespace-job-1-setroot") == ["kvs"]
    # job-1 is also a prefix of job-10: subscribers check the payload (DESIGN 7)
    assert t.match("kvs.namespace-job-10-setroot") == ["kvs"]
    assert t.match("kvs.namespace-job-1") == ["kvs"]
    assert t.match("kvs.namespace-job-") == []
    assert t.match("kvs.namespace-job-2-setroot") == []
    assert t.match("") == []


def test_a_trailing_separator_excludes_longer_names() -> None:
    t = SubscriptionTable()
    t.subscribe("w", "kvs.namespace-job-1-")
    assert t.match("kvs.namespace-job-1-setroot") == ["w"]
    assert t.match("kvs.namespace-job-10-setroot") == []


def test_empty_prefix_matches_everything() -> None:
    t = SubscriptionTable()
    t.subscribe("all", "")
    assert t.match("") == ["all"]
    assert t.match("anything.at.all") == ["all"]


def test_each_subscriber_listed_once() -> None:
    t = SubscriptionTable()
    for prefix in ("", "a", "a.b", "a.b.c"):
        t.subscribe("x", prefix)
    t.subscribe("y", "a.b")
    t.subscribe("z", "b")
    assert sorted(t.match("a.b.c.d")) == ["x", "y"]
    assert sorted(t.match("b.1")) == ["x", "z"]
    assert t.prefixes() == 5
    assert t.count_for("x") == 4 and t.count_for("y") == 1 and t.count_for("nobody") == 0


def test_reference_counts() -> None:
    t = SubscriptionTable()
    t.subscribe("s", "ev.")
    t.subscribe("s", "ev.")
    assert t.unsubscribe("s", "ev.") is True
    assert t.match("ev.1") == ["s"]  # one reference left
    assert t.unsubscribe("s", "ev.") is True
    assert t.match("ev.1") == []
    assert t.unsubscribe("s", "ev.") is False
    assert t.prefixes() == 0


def test_unsubscribe_unknown() -> None:
    t = SubscriptionTable()
    t.subscribe("s", "a")
    assert t.unsubscribe("other", "a") is False
    assert t.unsubscribe("s", "b") is False
    assert t.match("abc") == ["s"]


def test_unsubscribe_leaves_other_subscribers_and_lengths() -> None:
    t = SubscriptionTable()
    t.subscribe("s1", "abc")
    t.subscribe("s2", "abc")
    t.subscribe("s3", "xyz")  # same length as abc
    t.subscribe("s4", "ab")
    assert t.unsubscribe("s1", "abc")
    assert sorted(t.match("abcd")) == ["s2", "s4"]
    assert t.unsubscribe("s2", "abc")
    assert t.match("abcd") == ["s4"]
    assert t.match("xyz!") == ["s3"]  # length 3 is still probed for xyz
    assert t.unsubscribe("s3", "xyz")
    assert t.match("xyz!") == []
    assert t.prefixes() == 1


def test_unsubscribe_all_drops_every_reference() -> None:
    t = SubscriptionTable()
    for _ in range(3):
        t.subscribe("gone", "a.")
    t.subscribe("gone", "b.")
    t.subscribe("stays", "a.")
    t.unsubscribe_all("gone", ["a.", "b.", "never-subscribed"])
    assert t.match("a.1") == ["stays"]
    assert t.match("b.1") == []
    assert t.count_for("gone") == 0
    assert t.prefixes() == 1



def test_a_remembered_match_follows_every_change() -> None:
    """``match`` remembers its answer per topic: a subscribe, an unsubscribe
    or a client's disconnect (``unsubscribe_all``) made after a topic was
    matched must change the next answer for it (a stale one delivers
    events to a client that left, or misses a new subscriber)."""
    t = SubscriptionTable()
    t.subscribe("a", "ev.")
    assert t.match("ev.1") == ["a"]
    t.subscribe("b", "ev.1")
    assert sorted(t.match("ev.1")) == ["a", "b"]
    assert t.unsubscribe("b", "ev.1")
    assert t.match("ev.1") == ["a"]
    t.unsubscribe_all("a", ["ev."])
    assert t.match("ev.1") == []

def test_matches_brute_force() -> None:
    rng = random.Random(7)
    alphabet = "ab.-1"
    t = SubscriptionTable()
    subs: dict[str, set[str]] = {}
    for i in range(200):
        who = f"s{i % 23}"
        prefix = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        t.subscribe(who, prefix)
        subs.setdefault(who, set()).add(prefix)
    for _ in range(500):
        topic = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
        expected = {w for w, ps in subs.items() if any(topic.startswith(p) for p in ps)}
        found = t.match(topic)
        assert len(found) == len(set(found))
        assert set(found) == expected, topic


def test_seq_tracker_counts_and_logs_gaps(caplog: pytest.LogCaptureFixture) -> None:
    tr = SeqTracker("rank 3")
    with caplog.at_level(logging.WARNING, logger="kvbroker.events"):
        for seq in (1, 2, 3):
            tr.see(seq)
        assert tr.gaps == 0 and not caplog.records
        tr.see(5)
        assert tr.gaps == 1 and tr.last == 5
        assert "rank 3" in caplog.text and "expected 4, got 5" in caplog.text
        tr.see(6)
        assert tr.gaps == 1


def test_seq_tracker_first_event_may_start_anywhere() -> None:
    tr = SeqTracker("late joiner")
    tr.see(40)  # a rank (or module) that starts late does not count the past as a gap
    tr.see(41)
    assert tr.gaps == 0 and tr.last == 41

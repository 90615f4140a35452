"""Event subscriptions matched by topic prefix, and rank 0's sequencer.

A subscription is a string prefix: ``kvs.namespace-job-1`` receives
``kvs.namespace-job-1-setroot`` -- and also ``kvs.namespace-job-10-setroot``,
so subscribers check payload fields where that matters (docs/protocol.md, Events).

Matching cost does not grow with the number of subscriptions: for a topic of
length n we probe the dict of prefixes once per *distinct subscribed prefix
length* <= n, and the answer is remembered per topic until the subscriptions
change.  Subscribing is a dict insert; it never blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Iterable

log = logging.getLogger("kvbroker.events")

MATCH_CACHE = 1024
"""Topics whose subscribers are remembered (all forgotten when it fills up)."""


class SubscriptionTable:
    """Prefix -> subscribers, with per-(subscriber, prefix) reference counts."""

    def __init__(self) -> None:
        self._by_prefix: dict[str, dict[Hashable, int]] = {}
        self._length_refs: Counter[int] = Counter()
        self._lengths: list[int] = []
        self._matches: dict[str, list[Hashable]] = {}  # topic -> match(topic)

    def subscribe(self, subscriber: Hashable, prefix: str) -> None:
        self._matches.clear()
        subs = self._by_prefix.get(prefix)
        if subs is None:
            subs = self._by_prefix[prefix] = {}
            self._length_refs[len(prefix)] += 1
            if self._length_refs[len(prefix)] == 1:
                self._lengths = sorted(self._length_refs)
        subs[subscriber] = subs.get(subscriber, 0) + 1

    def unsubscribe(self, subscriber: Hashable, prefix: str) -> bool:
        """Drop one reference; returns False if there was no such subscription."""
        subs = self._by_prefix.get(prefix)
        if not subs or subscriber not in subs:
            return False
        self._matches.clear()
        subs[subscriber] -= 1
        if subs[subscriber] == 0:
            del subs[subscriber]
            if not subs:
                self._drop_prefix(prefix)
        return True

    def unsubscribe_all(self, subscriber: Hashable, prefixes: Iterable[str]) -> None:
        self._matches.clear()
        for prefix in list(prefixes):
            subs = self._by_prefix.get(prefix)
            if subs and subs.pop(subscriber, None) is not None and not subs:
                self._drop_prefix(prefix)

    def _drop_prefix(self, prefix: str) -> None:
        del self._by_prefix[prefix]
        n = len(prefix)
        self._length_refs[n] -= 1
        if self._length_refs[n] == 0:
            del self._length_refs[n]
            self._lengths = sorted(self._length_refs)

    def match(self, topic: str) -> list[Hashable]:
        """Subscribers with at least one prefix of ``topic`` (each listed once).

        The list is shared with later calls: do not modify it.
        """
        found = self._matches.get(topic)
        if found is None:
            if len(self._matches) >= MATCH_CACHE:
                self._matches.clear()
            found = self._matches[topic] = self._match(topic)
        return found

    def _match(self, topic: str) -> list[Hashable]:
        by_prefix = self._by_prefix
        tlen = len(topic)
        found: list[Hashable] = []
        for n in self._lengths:
            if n > tlen:
                break
            subs = by_prefix.get(topic[:n])
            if subs:
                found.extend(subs)
        if len(found) > 1:
            found = list(dict.fromkeys(found))
        return found

    def prefixes(self) -> int:
        return len(self._by_prefix)

    def count_for(self, subscriber: Hashable) -> int:
        return sum(1 for subs in self._by_prefix.values() if subscriber in subs)


class SeqTracker:
    """Remembers the last event sequence number seen and logs gaps."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.last = 0
        self.gaps = 0

    def see(self, seq: int) -> None:
        if self.last and seq != self.last + 1:
            self.gaps += 1
            log.warning("%s: event seq gap: expected %d, got %d", self.name, self.last + 1, seq)
        self.last = seq

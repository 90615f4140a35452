"""Per-user counts that keep no entry for a user who holds nothing.

The router (subscriptions, services, requests held below a rank) and the
KVS (version waits) cap what each guest user may hold; their counters
must not grow by one entry per user ever seen.
"""

from __future__ import annotations

from collections import Counter


def add_count(counter: Counter[int], key: int, n: int) -> None:
    """Add ``n`` to ``counter[key]``, dropping the key at 0."""
    left = counter[key] + n
    if left > 0:
        counter[key] = left
    else:
        counter.pop(key, None)

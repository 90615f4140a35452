"""When a link counts as stuck (``broker.linkstall``): a pure unit test of
the verdict, on a clock of its own."""

from __future__ import annotations

from broker.linkstall import HARD_FACTOR, STALL_GRACE, StallJudge

MARK = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_over_the_mark_a_link_is_stuck_only_once_its_peer_stops_reading() -> None:
    clock = Clock()
    judge = StallJudge(MARK, clock)
    assert not judge.stuck(MARK)  # (at the mark: not over)
    assert not judge.stuck(MARK + 1)  # over, just now: the peer may read yet
    clock.now += STALL_GRACE / 2
    judge.progressed()  # it reads
    clock.now += STALL_GRACE * 0.9
    assert not judge.stuck(2 * MARK)  # read less than the grace ago
    clock.now += STALL_GRACE * 0.2
    assert judge.stuck(2 * MARK)  # nothing read for longer than the grace


def test_past_the_hard_bound_a_link_is_stuck_whatever_its_peer_does() -> None:
    clock = Clock()
    judge = StallJudge(MARK, clock)
    judge.progressed()
    assert not judge.stuck(HARD_FACTOR * MARK)
    assert judge.stuck(HARD_FACTOR * MARK + 1)


def test_each_time_over_the_mark_is_judged_from_its_own_start() -> None:
    """A link whose peer had not needed to read for a while (all of it in
    the kernel's buffer) going over again: judged from then, not from the
    first time it went over."""
    clock = Clock()
    judge = StallJudge(MARK, clock)
    assert not judge.stuck(MARK + 1)
    clock.now += 1.0
    judge.progressed()
    judge.clear()  # (drained under the mark)
    clock.now += 10 * STALL_GRACE  # quiet: nothing to read
    assert not judge.stuck(MARK + 1)  # over again, just now
    assert not judge.stuck(MARK // 2)  # (under: cleared)
    clock.now += STALL_GRACE + 1
    assert not judge.stuck(MARK + 1)  # a new time over: from now
    clock.now += STALL_GRACE + 1
    assert judge.stuck(MARK + 1)

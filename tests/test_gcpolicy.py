"""broker.gcpolicy: a rank sets the collector's thresholds itself (the
application's choice, never on import), reports them in
``broker.stats-get``, and lets ``KVBROKER_GC_THRESHOLDS`` override them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from test_broker_support import stats

from broker import gcpolicy


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_importing_changes_nothing(restore_gc: None) -> None:
    gc.set_threshold(700, 10, 10)
    import importlib

    importlib.reload(gcpolicy)
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize(("value", "expected"), [
    ("", gcpolicy.THRESHOLDS),
    ("900,11,12", (900, 11, 12)),
    ("python", (700, 10, 10)),          # CPython's own, kept as they are
    ("1,2", gcpolicy.THRESHOLDS),       # malformed: the rank's default, with a warning
    ("0,10,10", gcpolicy.THRESHOLDS),   # 0 would disable collection: refused
    ("a,b,c", gcpolicy.THRESHOLDS),
])
def test_tune(restore_gc: None, value: str, expected: tuple[int, int, int]) -> None:
    gc.set_threshold(700, 10, 10)
    assert gcpolicy.tune({gcpolicy.ENV: value}) == expected
    assert gc.get_threshold() == expected


async def test_every_rank_runs_with_the_server_thresholds(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst)
    for rank in (0, 1):
        report = (await stats(h, rank))["gc"]
        assert report["thresholds"] == list(gcpolicy.THRESHOLDS)
        assert len(report["collections"]) == 3


async def test_environment_overrides_the_thresholds(start_instance, connect,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gcpolicy.ENV, "900,11,12")
    inst = await start_instance(size=1)
    h = await connect(inst)
    assert (await stats(h))["gc"]["thresholds"] == [900, 11, 12]

"""The progress tracker: its local side (samples per second, hivemind's ``performance_ema``), the
records it reduces to the collaboration's progress (pure: ``now`` is given), and reports from the
training thread, which reach the others when they matter, and only then (a DHT store costs ~2 ms
of CPU over both peers: too much for every 15 ms step)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kit
from kit.optim.progress import LocalProgress, PerformanceEMA, ProgressTracker, aggregate
from kit.optim.splits import ROUND_HISTORY, RoundTag
from kit.runtime import Runtime


def test_performance_ema_smooths_the_rate_between_reports() -> None:
    ema = PerformanceEMA(alpha=0.5)
    assert ema.samples_per_second == 0.0
    assert ema.update(4, 0.25) == 16.0  # the first measurement is taken as it is
    assert ema.update(4, 0.5) == pytest.approx(0.5 * 16.0 + 0.5 * 8.0)
    assert ema.update(0, 1.0) == pytest.approx(12.0)  # nothing done: nothing learned
    assert ema.update(4, 0.0) == pytest.approx(12.0)  # no time measured (same clock tick)


def test_global_progress_counts_samples_at_the_newest_epoch_only() -> None:
    def record(epoch: int, samples: int, rate: float, time: float = 100.0) -> LocalProgress:
        return LocalProgress(b"p%d" % epoch, epoch, samples, rate, time, False)

    progress = aggregate([record(3, 10, 5.0), record(2, 50, 5.0)], 40, now=102.0)
    assert progress.epoch == 3 and progress.samples_accumulated == 10 and not progress.ready
    # 10 reported + 2 s x 5/s since the report: 20 of 40; 10 samples/s from both peers.
    assert progress.eta_next_epoch == pytest.approx(2.0)
    assert aggregate([], 40, now=0.0).eta_next_epoch == math.inf


# --- the tracker on real DHT peers -------------------------------------------------------------

SLOW_REFRESH = {"min_refresh_period": 5.0, "max_refresh_period": 10.0}  # nothing periodic in time


@pytest.fixture
def dhts() -> Iterator[tuple[kit.DHT, kit.DHT]]:
    first = kit.DHT(host="127.0.0.1", client_mode=False)
    second = kit.DHT(initial_peers=first.get_visible_maddrs(), host="127.0.0.1", client_mode=False)
    yield first, second
    second.shutdown()
    first.shutdown()


def tracker(dht: kit.DHT, target: int = 1000, **options: Any) -> ProgressTracker:
    async def start(_: Any, node: Any) -> ProgressTracker:
        started = ProgressTracker(
            node, "run", target, identity=node.peer.identity, client_mode=False, **options
        )
        started.start()
        return started

    result: ProgressTracker = dht.run_coroutine(start)
    return result


def stop(dht: kit.DHT, *trackers: ProgressTracker) -> None:
    for one in trackers:

        async def shutdown(_: Any, node: Any, one: ProgressTracker = one) -> None:
            await one.shutdown()

        dht.run_coroutine(shutdown)


def seen_by(dht: kit.DHT, observer: ProgressTracker, within: float) -> list[tuple[int, int]]:
    """(epoch, samples) of the others' records, once a fresh fetch shows any (bounded)."""
    give_up = time.monotonic() + within
    while True:

        async def look(_: Any, node: Any) -> Any:
            return await observer.wait_for_update(1.0)

        dht.run_coroutine(look)
        records = [(r.epoch, r.samples_accumulated) for r in observer._others]
        if records or time.monotonic() > give_up:
            return records
        time.sleep(0.05)


def counted_stores(dht: kit.DHT, key: str) -> list[float]:
    """Times of the stores of ``key`` by this DHT's node (its method, wrapped)."""
    node, times = dht.node, []
    store = node.store

    async def counting(k: Any, *args: Any, **kwargs: Any) -> Any:
        if k == key:
            times.append(time.monotonic())
        return await store(k, *args, **kwargs)

    node.store = counting  # type: ignore[method-assign]
    return times


@pytest.mark.sockets
def test_a_new_epoch_reported_from_another_thread_wakes_the_loop_at_once() -> None:
    """asyncio.Event.set() from the training thread did not wake the loop (and could raise
    "deque mutated during iteration"): the new epoch waited for the next refresh, 10 s here.
    A loop of its own, so that nothing else wakes it."""
    runtime = Runtime("progress-test")
    dht = kit.DHT(host="127.0.0.1", client_mode=False, runtime=runtime)
    stores = counted_stores(dht, "run_progress")
    ours = tracker(dht, **SLOW_REFRESH)
    try:
        give_up = time.monotonic() + 5.0
        while not stores and time.monotonic() < give_up:  # the start is published
            time.sleep(0.01)
        assert len(stores) == 1
        reporter = threading.Thread(target=ours.report_local_progress, args=(1, 0))
        reporter.start()
        reporter.join()
        reported = time.monotonic()
        while len(stores) == 1 and time.monotonic() < reported + 2.0:
            time.sleep(0.01)
        assert len(stores) == 2 and stores[1] - reported < 1.0
    finally:
        stop(dht, ours)
        dht.shutdown()
        runtime.shutdown()


@pytest.mark.sockets
def test_sample_reports_are_batched(dhts) -> None:
    first, second = dhts
    stores = counted_stores(first, "run_progress")
    ours = tracker(first, target=1000, min_refresh_period=0.3, max_refresh_period=10.0)
    theirs = tracker(second, **SLOW_REFRESH)
    try:
        assert seen_by(second, theirs, within=5.0) == [(0, 0)]
        before = len(stores)
        for samples in range(1, 301):  # 300 steps of one sample in ~0.6 s: below the target
            ours.report_local_progress(0, samples)
            time.sleep(0.002)
        time.sleep(0.6)  # the last report goes out within min_refresh_period
        assert 1 <= len(stores) - before <= 6, [t - stores[0] for t in stores]
        assert seen_by(second, theirs, within=0.0) == [(0, 300)]
    finally:
        stop(first, ours)
        stop(second, theirs)


@pytest.mark.sockets
def test_samples_that_reach_the_target_are_published_at_once(dhts) -> None:
    first, second = dhts
    ours, theirs = tracker(first, target=1000, **SLOW_REFRESH), tracker(second, **SLOW_REFRESH)
    try:
        assert seen_by(second, theirs, within=5.0) == [(0, 0)]
        ours.report_local_progress(0, 500)  # below the target: with the next refresh (5 s)
        ours.report_local_progress(0, 1000)  # reaches it: the others must know now
        time.sleep(0.3)
        assert seen_by(second, theirs, within=0.0) == [(0, 1000)]
    finally:
        stop(first, ours)
        stop(second, theirs)


def test_a_record_carries_its_round_tags_and_a_malformed_list_drops_the_record() -> None:
    tag = RoundTag(4, b"\x07" * 8, 3)
    record = LocalProgress(b"p", 5, 0, 1.0, 10.0, False, rounds=(tag,))
    assert LocalProgress.from_dict(record.to_dict()) == record
    body = record.to_dict()
    del body["rounds"]  # an older peer's record
    assert LocalProgress.from_dict(body) == LocalProgress(b"p", 5, 0, 1.0, 10.0, False)
    for bad in ("nope", [[4, b"x"]], [tag.to_wire()] * (ROUND_HISTORY + 1), [[4, b"", 3]]):
        assert LocalProgress.from_dict({**body, "rounds": bad}) is None


@pytest.mark.sockets
def test_round_tags_reach_the_others_at_once_and_only_the_last_are_kept(dhts) -> None:
    first, second = dhts
    ours, theirs = tracker(first, **SLOW_REFRESH), tracker(second, **SLOW_REFRESH)
    try:
        assert seen_by(second, theirs, within=5.0) == [(0, 0)]
        for epoch in range(ROUND_HISTORY + 2):
            ours.add_round(RoundTag(epoch, b"g%d" % epoch, 2))
        assert [t.epoch for t in ours.round_tags] == list(range(2, ROUND_HISTORY + 2))
        ours.report_local_progress(1, 0)  # a new report keeps them
        time.sleep(0.3)
        seen_by(second, theirs, within=0.0)
        assert theirs.others_round_tags() == [(first.peer_id.to_bytes(), ours.round_tags)]
    finally:
        stop(first, ours)
        stop(second, theirs)

"""The progress tracker's local side: samples per second (hivemind's ``performance_ema``) and the
records it reduces to the collaboration's progress (pure: ``now`` is given)."""

from __future__ import annotations

import math

import pytest

from kit.optim.progress import LocalProgress, PerformanceEMA, aggregate


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

"""Peers online and samples/s over time: one point per collection, thinned as the run grows."""

from __future__ import annotations

import pytest

from kit.errors import MetricsStateError
from kit.metrics.history import MetricsHistory


def test_points_are_kept_in_order_and_thinned_to_the_limit() -> None:
    history = MetricsHistory(max_points=10)
    for second in range(100):
        history.add(float(second), peers=second % 4, samples_per_second=second * 1.5)
    points = history.points()
    assert 5 <= len(points) <= 10
    times = [point["time"] for point in points]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] >= 90.0
    assert points[0] == {"time": 0.0, "peers": 0, "samples_per_second": 0.0}
    spacing = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(spacing) <= 4 * min(spacing)  # evenly spread, not the first 10 seconds


def test_a_short_run_keeps_every_collection() -> None:
    history = MetricsHistory()
    history.add(1.0, 2, 10.0)
    history.add(3.0, 3, 12.5)
    assert history.points() == [
        {"time": 1.0, "peers": 2, "samples_per_second": 10.0},
        {"time": 3.0, "peers": 3, "samples_per_second": 12.5},
    ]


def test_a_saved_series_loads_as_it_was_and_thinned_to_a_smaller_limit() -> None:
    history = MetricsHistory(max_points=10)
    for second in range(100):
        history.add(float(second), peers=second % 4, samples_per_second=second * 1.5)
    restored = MetricsHistory(max_points=10)
    restored.load_json(history.to_json())
    assert restored.points() == history.points()
    restored.add(1000.0, 3, 1.0)  # and it goes on with the saved spacing
    assert restored.points()[-1]["time"] == 1000.0
    smaller = MetricsHistory(max_points=4)
    smaller.load_json(history.to_json())
    assert 2 <= len(smaller.points()) <= 4


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"points": []}',
        '{"spacing": 1.0, "points": [[1.0, 2]]}',
        '{"spacing": 1.0, "points": [[2.0, 1, 1.0], [1.0, 1, 1.0]]}',
        '{"spacing": -1.0, "points": []}',
        '{"spacing": 1.0, "points": [[1.0, 1, 1e999]]}',
    ],
)
def test_an_unreadable_series_is_refused_with_a_hint(text: str) -> None:
    history = MetricsHistory()
    history.add(1.0, 2, 3.0)
    with pytest.raises(MetricsStateError, match="help:"):
        history.load_json(text)
    assert history.points() == [{"time": 1.0, "peers": 2, "samples_per_second": 3.0}]

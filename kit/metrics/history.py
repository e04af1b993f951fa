"""The collaboration over time: peers online and samples/s, for the dashboard's charts.

Holds :class:`MetricsHistory`, a bounded series of ``(time, peers online, samples/s)`` points, one
per metrics collection. When it is full, every other point is dropped and the spacing between
kept points doubles, so a run of any length fits in :data:`MAX_POINTS` points: recent hours at
full resolution would cost memory nobody looks at. Pure (time comes in), torch-free; the
collector feeds it and the dashboard reads it. It doesn't persist: a restarted coordinator
starts a new series (the loss curve, per global step, is kept in the book).
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: Points kept at most (a chart of 800 px has no use for more).
MAX_POINTS = 720


@dataclasses.dataclass(frozen=True)
class HistoryPoint:
    time: float  # DHT time of the collection
    peers: int  # training peers online
    samples_per_second: float  # their total throughput

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MetricsHistory:
    """Peers online and samples/s over time, thinned as it grows.

    Args:
        max_points: points kept at most (at least 4).
    """

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max(4, max_points)
        self._points: list[HistoryPoint] = []
        self._spacing = 0.0  # minimum seconds between kept points (doubles when thinned)

    def add(self, now: float, peers: int, samples_per_second: float) -> None:
        """Record the collaboration at ``now`` (skipped if closer than the current spacing)."""
        point = HistoryPoint(now, int(peers), float(samples_per_second))
        if self._points and now - self._points[-1].time < self._spacing:
            return
        self._points.append(point)
        if len(self._points) > self.max_points:
            self._points = self._points[::2]
            span = self._points[-1].time - self._points[0].time
            self._spacing = span / max(1, len(self._points) - 1)

    def points(self) -> list[dict[str, Any]]:
        """Oldest first, as JSON-ready dicts."""
        return [point.to_dict() for point in self._points]

"""The collaboration over time: peers online and samples/s, for the dashboard's charts.

Holds :class:`MetricsHistory`, a bounded series of ``(time, peers online, samples/s)`` points, one
per metrics collection. When it is full, every other point is dropped and the spacing between
kept points doubles, so a run of any length fits in :data:`MAX_POINTS` points: recent hours at
full resolution would cost memory nobody looks at. Pure (time comes in), torch-free; the
collector feeds it and the dashboard reads it; the collector saves it beside the contribution
book (:meth:`MetricsHistory.to_json`), so a restarted coordinator's charts go on where they
stopped instead of starting over.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from kit.errors import MetricsStateError

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

    def to_json(self) -> str:
        """The series (and its spacing) as JSON, for :meth:`load_json`."""
        points = [[p.time, p.peers, p.samples_per_second] for p in self._points]
        return json.dumps({"spacing": self._spacing, "points": points}, allow_nan=False)

    def load_json(self, text: str) -> None:
        """Replace the series with one saved by :meth:`to_json` (thinned to ``max_points``).

        Raises:
            MetricsStateError: not a series this kit wrote (corrupt, truncated, non-finite).
        """
        try:
            state = json.loads(text)
            spacing = float(state["spacing"])
            points = [HistoryPoint(float(t), int(n), float(r)) for t, n, r in state["points"]]
            numbers = [spacing, *(v for p in points for v in (p.time, p.samples_per_second))]
            if not all(math.isfinite(v) and v >= 0 for v in numbers):
                raise ValueError("a negative or non-finite number")
            if any(b.time < a.time for a, b in zip(points, points[1:], strict=False)):
                raise ValueError("points out of order")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise MetricsStateError(
                f"the saved metrics history is unreadable ({type(e).__name__}: {e}) - help: "
                "move the file away to start the charts afresh"
            ) from e
        while len(points) > self.max_points:
            points = points[::2]
        self._points, self._spacing = points, spacing

"""The leaderboard as a notebook widget: who contributed how much to the run.

Holds :func:`leaderboard_html` (the rows of ``kit.metrics``' leaderboard as an escaped HTML table)
and :class:`LeaderboardWidget` (that table plus a "Refresh" button, fed by any callable returning
the rows: the coordinator's collector in the config notebook, or the coordinator's
``/api/leaderboard`` from a volunteer's notebook). It computes nothing: ``kit.metrics`` does.
"""

from __future__ import annotations

import html
import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

Rows = Sequence[dict[str, Any]]


def leaderboard_html(rows: Rows, *, highlight: str | None = None, limit: int = 50) -> str:
    """An HTML table of the leaderboard rows (rank, user, samples, compute hours, peers online).

    Args:
        rows: ``MetricsCollector.leaderboard()`` rows, best first.
        highlight: a username shown in bold (the volunteer's own row).
        limit: rows shown at most.
    """
    if not rows:
        return "<p>No contributions yet.</p>"
    lines = [
        "<table><tr><th>#</th><th>user</th><th>samples</th><th>compute hours</th>"
        "<th>peers online</th></tr>"
    ]
    for index, row in enumerate(rows[:limit]):
        name = str(row.get("username", "?"))
        cell = html.escape(name)
        if highlight is not None and name == highlight:
            cell = f"<b>{cell}</b>"
        if not row.get("verified", True):
            cell += " <small>(unverified)</small>"
        lines.append(
            f"<tr><td>{int(row.get('rank') or index + 1)}</td><td>{cell}</td>"
            f"<td>{int(row.get('samples', 0)):,}</td>"
            f"<td>{float(row.get('compute_hours', 0.0)):.2f}</td>"
            f"<td>{int(row.get('peers_online', 0))}</td></tr>"
        )
    lines.append("</table>")
    return "".join(lines)


class LeaderboardWidget:
    """An ipywidgets leaderboard with a Refresh button.

    Args:
        rows: returns the current rows (may raise a ``KitError``; shown as one line).
        highlight: a username shown in bold.
    """

    def __init__(self, rows: Callable[[], Rows], *, highlight: str | None = None) -> None:
        import ipywidgets as widgets

        self._rows = rows
        self._highlight = highlight
        self.table = widgets.HTML(value="")
        self.button = widgets.Button(description="Refresh")
        self.button.on_click(lambda _: self.refresh())
        self.widget = widgets.VBox([self.table, self.button])
        self.refresh()

    def refresh(self) -> None:
        """Fetch the rows again and redraw; an error becomes one readable line."""
        from kit.errors import KitError

        try:
            rows = self._rows()
        except KitError as error:
            self.table.value = f"<p style='color:#b00'>{html.escape(str(error))}</p>"
            return
        self.table.value = leaderboard_html(rows, highlight=self._highlight)

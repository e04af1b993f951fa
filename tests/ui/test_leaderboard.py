"""The leaderboard widget: escaped names, order, the own row, unverified marks, refresh, errors."""

from __future__ import annotations

from kit.errors import TransientError
from kit.ui.leaderboard import LeaderboardWidget, leaderboard_html

ROWS = [
    {
        "rank": 1,
        "username": "alice",
        "samples": 12345,
        "compute_hours": 1.5,
        "peers_online": 2,
        "verified": True,
    },
    {
        "rank": 2,
        "username": "<script>x</script>",
        "samples": 10,
        "compute_hours": 0.01,
        "peers_online": 0,
        "verified": False,
    },
]


def test_rows_are_escaped_ordered_and_the_own_row_is_bold() -> None:
    page = leaderboard_html(ROWS, highlight="alice")
    assert page.index("alice") < page.index("&lt;script&gt;")
    assert "<script>" not in page
    assert "<b>alice</b>" in page and "12,345" in page and "1.50" in page
    assert "(unverified)" in page.split("&lt;script&gt;")[1]
    assert leaderboard_html([]) == "<p>No contributions yet.</p>"
    assert page.count("<tr>") == 3 and leaderboard_html(ROWS, limit=1).count("<tr>") == 2


def test_refresh_fetches_again_and_errors_are_one_line() -> None:
    answers: list = [ROWS[:1], TransientError("coordinator down - help: wait a minute"), ROWS]
    calls = []

    def rows():
        calls.append(1)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    widget = LeaderboardWidget(rows)
    assert "alice" in widget.table.value and "script" not in widget.table.value
    widget.button.click()
    assert "coordinator down - help: wait a minute" in widget.table.value
    widget.button.click()
    assert "&lt;script&gt;" in widget.table.value and len(calls) == 3

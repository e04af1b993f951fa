"""The notebook training panel, fed snapshot sequences like the trainer would."""

from __future__ import annotations

import math
from dataclasses import replace

import ipywidgets as widgets
import pytest

from kit.training.status import TrainingState, TrainingStatus
from kit.ui.panel import (
    TrainingPanel,
    downsample,
    format_eta,
    plot_is_due,
    progress_text,
    render_loss_png,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_status(**fields: object) -> TrainingStatus:
    base = TrainingStatus(
        state=TrainingState.TRAINING,
        global_epoch=5,
        local_epoch=4,
        samples_accumulated=1234,
        target_batch_size=4096,
        eta_next_step=12.0,
        peers_online=7,
        samples_per_second=31.25,
        samples_total=98765,
        loss_history=((1, 9.0), (2, 8.5)),
        username="alice",
        rank=3,
        leaderboard_size=17,
        message="training",
        device="Tesla T4 (fp16)",
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def all_text(panel: TrainingPanel) -> str:
    def walk(widget: widgets.Widget) -> list[widgets.Widget]:
        found = [widget]
        for child in getattr(widget, "children", ()):
            found.extend(walk(child))
        return found

    return "\n".join(
        w.value for w in walk(panel.widget) if isinstance(getattr(w, "value", None), str)
    )


def test_the_epoch_shows_local_steps_undone_for_non_finite_parameters() -> None:
    panel = TrainingPanel(on_stop=lambda: None, clock=FakeClock())
    panel.update(make_status())
    assert panel.epoch.value == "5 (mine: 4)"
    panel.update(make_status(rollbacks=1))
    assert panel.epoch.value == "5 (mine: 4) · 1 step undone (inf/NaN)"
    panel.update(make_status(rollbacks=2))
    assert panel.epoch.value == "5 (mine: 4) · 2 steps undone (inf/NaN)"


def test_labels_and_progress_match_the_snapshot() -> None:
    panel = TrainingPanel(on_stop=lambda: None, clock=FakeClock())
    panel.update(make_status())
    assert panel.progress.value == pytest.approx(1234 / 4096)
    assert panel.progress_label.value == "1,234 / 4,096 samples · ETA 12 s"
    assert panel.contribution.value == "#3 of 17"
    assert panel.peers.value == "7"
    assert panel.speed.value == "31.2 samples/s"
    assert panel.samples.value == "98,765"
    assert panel.device.value == "Tesla T4 (fp16)"
    assert "training" in panel.state.value
    assert "alice" in panel.title.value
    assert bytes(panel.plot.value).startswith(PNG_MAGIC)

    panel.update(make_status(samples_accumulated=5000, eta_next_step=math.inf, rank=None))
    assert panel.progress.value == 1.0
    assert panel.progress_label.value == "5,000 / 4,096 samples · ETA unknown"
    assert panel.contribution.value == "—"


def test_plot_changes_only_when_the_loss_history_changes() -> None:
    clock = FakeClock()
    panel = TrainingPanel(on_stop=lambda: None, clock=clock)
    history = ((1, 9.0), (2, 8.5))
    panel.update(make_status(loss_history=history))
    first = panel.plot.value
    assert bytes(first).startswith(PNG_MAGIC)

    # A new loss within the plot interval of the last render: throttled.
    longer = (*history, (3, 7.0))
    clock.now += 0.5
    panel.update(make_status(loss_history=longer))
    assert panel.plot.value is first

    # Interval elapsed: drawn, and the bytes differ.
    clock.now += 2.0
    panel.update(make_status(loss_history=longer))
    second = panel.plot.value
    assert bytes(second) != bytes(first) and bytes(second).startswith(PNG_MAGIC)

    # Same history, other fields changed, much time passed: the picture is not re-rendered.
    clock.now += 10
    panel.update(make_status(loss_history=longer, samples_accumulated=2000, peers_online=9))
    assert panel.plot.value is second

    # A history of the same length whose oldest point was dropped still counts as new.
    shifted = (*longer[1:], (4, 6.5))
    panel.update(make_status(loss_history=shifted))
    third = panel.plot.value
    assert bytes(third) != bytes(second)

    # The final snapshot is always drawn, even inside the interval.
    clock.now += 0.1
    panel.finish(make_status(state=TrainingState.STOPPED, loss_history=(*shifted, (5, 6.0))))
    assert bytes(panel.plot.value) != bytes(third)


def test_plot_is_due_rules() -> None:
    h1 = ((1, 1.0),)
    h2 = ((1, 1.0), (2, 0.5))
    assert plot_is_due(h1, None, None, now=0.0)
    assert not plot_is_due(h1, h1, 0.0, now=100.0)
    assert not plot_is_due(h2, h1, 0.0, now=1.0, interval=2.0)
    assert plot_is_due(h2, h1, 0.0, now=2.0, interval=2.0)
    assert plot_is_due(h2, h1, 0.0, now=0.1, interval=2.0, force=True)
    assert not plot_is_due(h1, h1, 0.0, now=0.1, force=True)


def test_downsample_keeps_long_histories_small_and_drops_non_finite() -> None:
    history = [(step, float(step)) for step in range(10_000)]
    points = downsample(history, max_points=100)
    assert len(points) == 100
    assert points[0][1] == pytest.approx(49.5)  # the mean of the first bucket of 100
    assert points[-1][1] == pytest.approx(9949.5)
    with_nan = [(1, 1.0), (2, math.nan), (3, math.inf), (4, 0.5)]
    assert downsample(with_nan) == [(1.0, 1.0), (4.0, 0.5)]
    assert render_loss_png(with_nan).startswith(PNG_MAGIC)
    assert render_loss_png(()).startswith(PNG_MAGIC)


def test_strings_from_outside_are_escaped() -> None:
    panel = TrainingPanel(on_stop=lambda: None, clock=FakeClock())
    panel.update(
        make_status(
            username="<script>alert(1)</script>",
            message='<img src=x onerror="x"> help: do <b>this</b>',
        )
    )
    text = all_text(panel)
    assert "<script>" not in text
    assert "<img" not in text and "<b>this" not in text
    assert "&lt;script&gt;" in panel.title.value
    assert "&lt;img" in panel.message.value


def test_error_messages_are_red() -> None:
    panel = TrainingPanel(on_stop=lambda: None, clock=FakeClock())
    panel.update(make_status(message="all good"))
    assert "#d32f2f" not in panel.message.value
    panel.update(make_status(message="peer lost. help: check your network"))
    assert "#d32f2f" in panel.message.value
    panel.finish(make_status(state=TrainingState.FAILED, message="crashed"))
    assert "#d32f2f" in panel.message.value
    assert "failed" in panel.state.value
    assert panel.stop_button.disabled and panel.stop_button.description == "Failed"


def test_stop_calls_on_stop_exactly_once() -> None:
    calls: list[int] = []
    panel = TrainingPanel(on_stop=lambda: calls.append(1), clock=FakeClock())
    panel.update(make_status())
    panel.stop_button.click()
    panel.stop_button.click()
    assert calls == [1]
    assert panel.stop_button.disabled
    assert panel.stop_button.description == "Stopping…"
    panel.finish(make_status(state=TrainingState.STOPPED))
    assert panel.stop_button.description == "Stopped"
    panel.stop_button.click()
    assert calls == [1]


def test_a_failing_on_stop_is_shown_as_one_line() -> None:
    def on_stop() -> None:
        raise RuntimeError("trainer already gone")

    panel = TrainingPanel(on_stop=on_stop, clock=FakeClock())
    panel.stop_button.click()
    assert "trainer already gone" in panel.message.value
    assert "help:" in panel.message.value


def test_late_snapshots_do_not_overwrite_the_final_one() -> None:
    panel = TrainingPanel(on_stop=lambda: None, clock=FakeClock())
    panel.finish(make_status(state=TrainingState.STOPPED, peers_online=2))
    panel.update(make_status(state=TrainingState.TRAINING, peers_online=9))
    assert "stopped" in panel.state.value
    assert panel.peers.value == "2"


def test_format_eta_and_progress_text() -> None:
    assert format_eta(math.inf) == "unknown"
    assert format_eta(math.nan) == "unknown"
    assert format_eta(-1) == "unknown"
    assert format_eta(12.4) == "12 s"
    assert format_eta(120) == "2 min"
    assert format_eta(185) == "3 min 5 s"
    assert format_eta(7800) == "2 h 10 min"
    status = make_status(samples_accumulated=0, target_batch_size=1, eta_next_step=0.2)
    assert progress_text(status) == "0 / 1 samples · ETA 0 s"

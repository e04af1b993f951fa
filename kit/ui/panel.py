"""The live training panel a volunteer watches in a notebook.

Holds :class:`TrainingPanel` (ipywidgets: loss plot, state badge, progress toward the next global
step, this peer's speed and contribution, device, last message, a Stop button) and the pure
helpers it draws with (:func:`downsample`, :func:`render_loss_png`, :func:`format_eta`,
:func:`progress_text`). It only draws :class:`~kit.training.status.TrainingStatus` snapshots and
calls ``on_stop``; it decides nothing about training.

The loss plot is a PNG set into one ``widgets.Image``: the browser swaps the picture in place,
so there is no flicker (``clear_output`` + ``plt.show`` blanks the cell on every redraw). The
figure is drawn with matplotlib's object API (``Figure`` + Agg), never ``pyplot``, so the
notebook's own plotting state and backend are left alone. Only widgets and attributes that exist
in both ipywidgets 7.7 (Colab) and 8.x are used.
"""

from __future__ import annotations

import html
import io
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kit.training.status import TrainingState, TrainingStatus

if TYPE_CHECKING:  # ipywidgets is imported where a widget is made: `kit join` runs without it
    import ipywidgets as widgets

logger = logging.getLogger(__name__)

#: Seconds between two renders of the loss plot. Increase this if the notebook feels sluggish
#: while training (each render costs ~50-100 ms of CPU and one ~10 kB PNG message to the browser).
PLOT_INTERVAL = 2.0
#: Points drawn at most; longer histories are averaged in buckets (keeps a render cheap).
PLOT_MAX_POINTS = 400
#: Badge colors per state: green = working, blue = talking to peers, amber = getting ready,
#: orange = trouble being handled, grey = ended, red = failed.
STATE_COLORS = {
    TrainingState.STARTING: "#f9a825",
    TrainingState.LOGGING_IN: "#f9a825",
    TrainingState.JOINING: "#f9a825",
    TrainingState.DOWNLOADING_STATE: "#f9a825",
    TrainingState.TRAINING: "#2e7d32",
    TrainingState.AVERAGING: "#1565c0",
    TrainingState.RECONNECTING: "#ef6c00",
    TrainingState.STOPPING: "#757575",
    TrainingState.STOPPED: "#757575",
    TrainingState.FAILED: "#d32f2f",
}
ERROR_COLOR = "#d32f2f"


def format_eta(seconds: float) -> str:
    """``12 s``, ``3 min 5 s``, ``2 h 10 min``, or ``unknown`` for inf/NaN/negative."""
    if not math.isfinite(seconds) or seconds < 0:
        return "unknown"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        minutes, secs = divmod(whole, 60)
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, rest = divmod(whole, 3600)
    return f"{hours} h {rest // 60} min"


def progress_text(status: TrainingStatus) -> str:
    """``1,234 / 4,096 samples · ETA 12 s`` for the next global step."""
    return (
        f"{status.samples_accumulated:,} / {status.target_batch_size:,} samples"
        f" · ETA {format_eta(status.eta_next_step)}"
    )


def epoch_text(status: TrainingStatus) -> str:
    """``12 (mine: 11)``, and the local steps undone for non-finite parameters when there were any
    (each is also logged with what to do; a count that keeps growing means this peer diverges)."""
    text = f"{status.global_epoch:,} (mine: {status.local_epoch:,})"
    if status.rollbacks:
        undone = "step" if status.rollbacks == 1 else "steps"
        text += f" · {status.rollbacks:,} {undone} undone (inf/NaN)"
    return text


def contribution_text(status: TrainingStatus) -> str:
    """``#3 of 17`` (this user's leaderboard place), or an em dash while unknown."""
    if status.rank is None:
        return "—"
    if status.leaderboard_size > 0:
        return f"#{status.rank:,} of {status.leaderboard_size:,}"
    return f"#{status.rank:,}"


def downsample(
    history: Sequence[tuple[int, float]], max_points: int = PLOT_MAX_POINTS
) -> list[tuple[float, float]]:
    """At most ``max_points`` (step, loss) points: bucket means of the finite points.

    Means (not every n-th point) keep the curve's level honest when losses are noisy; NaN/inf
    losses (a skipped step) are dropped because they would wreck the y axis.
    """
    finite = [(float(step), float(loss)) for step, loss in history if math.isfinite(loss)]
    if len(finite) <= max_points:
        return finite
    points: list[tuple[float, float]] = []
    for bucket in range(max_points):
        lo = bucket * len(finite) // max_points
        hi = (bucket + 1) * len(finite) // max_points
        chunk = finite[lo:hi]
        points.append(
            (sum(p[0] for p in chunk) / len(chunk), sum(p[1] for p in chunk) / len(chunk))
        )
    return points


def render_loss_png(
    history: Sequence[tuple[int, float]],
    *,
    max_points: int = PLOT_MAX_POINTS,
    size_inches: tuple[float, float] = (5.2, 2.2),
    dpi: int = 90,
) -> bytes:
    """A small PNG of the loss curve (step on x, loss on y).

    Args:
        history: (local step, loss) pairs, oldest first.
        max_points: points drawn at most (see :func:`downsample`).
        size_inches: figure size; with ``dpi`` this sets the picture's pixels.
        dpi: dots per inch.

    Returns:
        PNG bytes (a plot with a "waiting" note when there is no finite loss yet).
    """
    # Imported here: matplotlib costs ~0.3 s to import and only the notebook panel needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size_inches, dpi=dpi)
    FigureCanvasAgg(figure)  # attaches itself: PNG through Agg, whatever the notebook's backend
    axes = figure.add_subplot()
    points = downsample(history, max_points)
    if points:
        axes.plot([p[0] for p in points], [p[1] for p in points], color="#1565c0", linewidth=1.2)
    else:
        axes.text(0.5, 0.5, "waiting for the first loss…", ha="center", va="center")
    axes.set_xlabel("step", fontsize=8)
    axes.set_ylabel("loss", fontsize=8)
    axes.tick_params(labelsize=7)
    axes.grid(True, alpha=0.3)
    figure.tight_layout(pad=0.4)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_is_due(
    history: tuple[tuple[int, float], ...],
    drawn: tuple[tuple[int, float], ...] | None,
    last_render: float | None,
    now: float,
    interval: float = PLOT_INTERVAL,
    force: bool = False,
) -> bool:
    """Whether the loss plot should be rendered again (pure: the clock is an argument).

    Re-render only when the history differs from the one drawn, and at most once per
    ``interval`` seconds unless ``force`` (the final state must always be drawn).
    """
    if drawn is not None and history == drawn:
        return False
    if force or last_render is None:
        return True
    return now - last_render >= interval


def _badge(state: TrainingState) -> str:
    color = STATE_COLORS.get(state, "#757575")
    return (
        f'<span style="background: {color}; color: white; padding: 2px 8px;'
        f' border-radius: 8px; font-weight: bold">{html.escape(state.value)}</span>'
    )


def _message_html(status: TrainingStatus) -> str:
    text = html.escape(status.message)
    if status.state is TrainingState.FAILED or "help:" in status.message:
        return f'<span style="color: {ERROR_COLOR}">{text}</span>'
    return f"<span>{text}</span>"


class TrainingPanel:
    """The notebook panel for one volunteer's training peer.

    ``update`` may be called from any thread (the trainer's); calls are serialized.

    Args:
        on_stop: called once when the volunteer presses Stop (it should ask the trainer to
            stop; the final snapshot is then drawn with :meth:`finish`).
        plot_interval: seconds between two loss plot renders. Increase this if the notebook
            feels sluggish while training.
        clock: monotonic seconds (tests pass a fake).

    Example::

        panel = TrainingPanel(on_stop=trainer.stop)
        display(panel.widget)
        trainer.add_listener(panel.update)
    """

    def __init__(
        self,
        on_stop: Callable[[], None],
        *,
        plot_interval: float = PLOT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_stop = on_stop
        self._plot_interval = plot_interval
        self._clock = clock
        self._lock = threading.RLock()
        self._stop_requested = False
        self._finished = False
        self._drawn_history: tuple[tuple[int, float], ...] | None = None
        self._last_render: float | None = None
        self._last_status: TrainingStatus | None = None
        import ipywidgets as widgets

        self.title = widgets.HTML(value="<b>Training</b>")
        self.state = widgets.HTML(value=_badge(TrainingState.STARTING))
        self.plot = widgets.Image(
            value=b"", format="png", layout=widgets.Layout(width="100%", max_width="520px")
        )
        self.progress = widgets.FloatProgress(
            value=0.0,
            min=0.0,
            max=1.0,
            description="next step",
            layout=widgets.Layout(width="420px"),
        )
        self.progress_label = widgets.Label(value="")
        self.epoch = widgets.Label(value="")
        self.peers = widgets.Label(value="")
        self.speed = widgets.Label(value="")
        self.samples = widgets.Label(value="")
        self.contribution = widgets.Label(value="")
        self.device = widgets.Label(value="")
        self.message = widgets.HTML(value="")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.on_click(self._on_stop_click)

        def row(name: str, value: widgets.Widget) -> widgets.HBox:
            label = widgets.Label(value=name, layout=widgets.Layout(width="110px"))
            return widgets.HBox([label, value])

        self._box = widgets.VBox(
            [
                widgets.HBox([self.title, self.state]),
                self.plot,
                widgets.HBox([self.progress, self.progress_label]),
                row("Global step", self.epoch),
                row("Peers online", self.peers),
                row("My speed", self.speed),
                row("My samples", self.samples),
                row("Contribution", self.contribution),
                row("Device", self.device),
                self.message,
                self.stop_button,
            ]
        )

    @property
    def widget(self) -> widgets.VBox:
        """The panel to ``display()``."""
        return self._box

    @property
    def last_status(self) -> TrainingStatus | None:
        """The snapshot drawn last."""
        return self._last_status

    def update(self, status: TrainingStatus) -> None:
        """Draw one snapshot. A finished state (stopped / failed) is drawn as by :meth:`finish`."""
        self._draw(status, final=status.state.finished)

    def finish(self, status: TrainingStatus) -> None:
        """Draw the final snapshot: the plot is rendered now and the Stop button is retired."""
        self._draw(status, final=True)

    def _draw(self, status: TrainingStatus, *, final: bool) -> None:
        with self._lock:
            if self._finished:
                return  # a late snapshot from the trainer must not overwrite the final one
            self._last_status = status
            who = f" as {html.escape(status.username)}" if status.username else ""
            self.title.value = f"<b>Training{who}</b>"
            self.state.value = _badge(status.state)
            self.progress.value = status.progress_fraction
            self.progress_label.value = progress_text(status)
            self.epoch.value = epoch_text(status)
            self.peers.value = f"{status.peers_online:,}"
            self.speed.value = f"{status.samples_per_second:,.1f} samples/s"
            self.samples.value = f"{status.samples_total:,}"
            self.contribution.value = contribution_text(status)
            self.device.value = status.device  # a Label shows text as is, never as HTML
            self.message.value = _message_html(status)
            self._maybe_render(status.loss_history, force=final)
            if final:
                self._finished = True
                self._retire_stop_button(status.state)

    def _maybe_render(self, history: tuple[tuple[int, float], ...], *, force: bool) -> None:
        now = self._clock()
        if not plot_is_due(
            history, self._drawn_history, self._last_render, now, self._plot_interval, force
        ):
            return
        try:
            self.plot.value = render_loss_png(history)
        except Exception as error:  # a plotting bug must not stop the panel (or training)
            logger.warning("could not draw the loss plot: %s: %s", type(error).__name__, error)
        self._drawn_history = history
        self._last_render = now

    def _retire_stop_button(self, state: TrainingState) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Failed" if state is TrainingState.FAILED else "Stopped"

    def _on_stop_click(self, _button: Any = None) -> None:
        with self._lock:
            if self._stop_requested or self._finished:
                return
            self._stop_requested = True
            self.stop_button.disabled = True
            self.stop_button.description = "Stopping…"
        try:
            self._on_stop()
        except Exception as error:  # shown as a line, not a traceback in the output area
            logger.warning("stopping failed: %s: %s", type(error).__name__, error)
            self.message.value = (
                f'<span style="color: {ERROR_COLOR}">Could not stop: '
                f"{html.escape(type(error).__name__)}: {html.escape(str(error))}"
                " help: interrupt the kernel (■ button) to stop training.</span>"
            )

"""The terminal view of a training peer, for ``kit join`` on the command line.

Holds :class:`ConsoleReporter`: one ``tqdm.auto`` bar toward the next global step (description
with the state and the global step; postfix with the loss, this peer's samples/s and the peers
online) plus one log line per state change, per new message and per global step. It only draws
:class:`~kit.training.status.TrainingStatus` snapshots; it decides nothing about training. The
notebook view is :mod:`kit.ui.panel`.

Log lines go through ``logging`` while the bar is temporarily lifted
(``tqdm.contrib.logging.logging_redirect_tqdm``), so a line never lands in the middle of the bar.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from typing import IO, Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kit.training.status import TrainingState, TrainingStatus
from kit.ui.panel import contribution_text, format_eta

logger = logging.getLogger(__name__)

#: Seconds between two bar redraws on a terminal. Increase this if a slow SSH link lags.
TTY_REFRESH_SECONDS = 0.5
#: Seconds between two bar redraws when stderr is a file or a pipe (each redraw is a line there).
FILE_REFRESH_SECONDS = 30.0


class ConsoleReporter:
    """Draws training snapshots on a terminal: a progress bar and a few log lines.

    ``update`` may be called from any thread; calls are serialized.

    Args:
        stream: where the bar is drawn (log lines go wherever ``logging`` is configured).
        mininterval: seconds between two bar redraws; default depends on whether ``stream`` is a
            terminal (see :data:`TTY_REFRESH_SECONDS` / :data:`FILE_REFRESH_SECONDS`).

    Example::

        reporter = ConsoleReporter()
        trainer.add_listener(reporter.update)
        ...
        reporter.close()
    """

    def __init__(self, stream: IO[str] | None = None, *, mininterval: float | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        if mininterval is None:
            is_tty = bool(getattr(self._stream, "isatty", lambda: False)())
            mininterval = TTY_REFRESH_SECONDS if is_tty else FILE_REFRESH_SECONDS
        self._mininterval = mininterval
        self._lock = threading.Lock()
        self._bar: Any = None
        self._state: TrainingState | None = None
        self._message = ""
        self._global_epoch: int | None = None
        self._rollbacks = 0

    def update(self, status: TrainingStatus) -> None:
        """Draw one snapshot: move the bar, log what changed since the last one."""
        with self._lock:
            self._log_changes(status)
            self._draw_bar(status)

    def finish(self, status: TrainingStatus) -> None:
        """Draw the final snapshot, then close the bar."""
        self.update(status)
        self.close()

    def close(self) -> None:
        """Close the bar (leaving its last line on the terminal). Safe to call twice."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _log(self, level: int, text: str, *args: Any) -> None:
        if self._bar is None:
            logger.log(level, text, *args)
            return
        with logging_redirect_tqdm():
            logger.log(level, text, *args)

    def _log_changes(self, status: TrainingStatus) -> None:
        if status.state is not self._state:
            self._state = status.state
            self._log(logging.INFO, "state: %s", status.state.value)
        if self._global_epoch is not None and status.global_epoch > self._global_epoch:
            loss = status.last_loss
            self._log(
                logging.INFO,
                "global step %d reached (my loss %s, %d peers online, contribution %s)",
                status.global_epoch,
                f"{loss:.4f}" if loss is not None else "n/a",
                status.peers_online,
                contribution_text(status),
            )
        self._global_epoch = status.global_epoch
        if status.rollbacks > self._rollbacks:
            self._log(
                logging.WARNING,
                "%d local step(s) undone so far: they left inf/NaN parameters - help: one is a "
                "glitch; a growing count means this peer diverges (lower optimizer.lr, or train "
                "in fp32 on this GPU)",
                status.rollbacks,
            )
        self._rollbacks = status.rollbacks
        if status.message and status.message != self._message:
            level = logging.ERROR if status.state is TrainingState.FAILED else logging.INFO
            if status.state is not TrainingState.FAILED and "help:" in status.message:
                level = logging.WARNING
            self._log(level, "%s", status.message)
        self._message = status.message

    def _draw_bar(self, status: TrainingStatus) -> None:
        total = max(1, status.target_batch_size)
        if self._bar is None:
            self._bar = tqdm(
                total=total,
                file=self._stream,
                unit="samples",
                mininterval=self._mininterval,
                dynamic_ncols=True,
                leave=True,
            )
        bar = self._bar
        if bar.total != total:
            bar.total = total
        bar.set_description(f"{status.state.value} · step {status.global_epoch}", refresh=False)
        loss = status.last_loss
        bar.set_postfix(
            loss=f"{loss:.4f}" if loss is not None and math.isfinite(loss) else "n/a",
            mine=f"{status.samples_per_second:.1f}/s",
            peers=status.peers_online,
            eta=format_eta(status.eta_next_step),
            refresh=False,
        )
        target = min(status.samples_accumulated, total)
        delta = target - bar.n
        if delta >= 0:
            bar.update(delta)  # redraws at most every mininterval seconds
        else:
            # A new global step (or peers' records expiring) moved the count back: tqdm cannot
            # count down, so restart the bar's count and timer. reset() draws the bar once; a
            # refresh() here would print the same line a second time on a file or a pipe.
            bar.reset(total=total)
            bar.update(target)

"""The terminal reporter for ``kit join``, drawing into a StringIO."""

from __future__ import annotations

import io
import logging
from dataclasses import replace

import pytest

from kit.training.status import TrainingState, TrainingStatus
from kit.ui.console import ConsoleReporter


def status(**fields: object) -> TrainingStatus:
    base = TrainingStatus(
        state=TrainingState.TRAINING,
        global_epoch=3,
        samples_accumulated=100,
        target_batch_size=1000,
        peers_online=4,
        samples_per_second=12.5,
        loss_history=((1, 2.5),),
    )
    return replace(base, **fields)  # type: ignore[arg-type]


def ui_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kit.ui.console"]


def test_bar_is_drawn_into_the_stream(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    stream = io.StringIO()
    reporter = ConsoleReporter(stream=stream, mininterval=0)
    reporter.update(status())
    reporter.update(status(samples_accumulated=600))
    reporter.close()
    output = stream.getvalue()
    assert "training · step 3" in output
    assert "600/1000" in output
    assert "loss=2.5000" in output
    assert "peers=4" in output
    assert "mine=12.5/s" in output


def test_one_log_line_per_state_change_message_and_global_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    reporter = ConsoleReporter(stream=io.StringIO(), mininterval=0)
    reporter.update(status(state=TrainingState.JOINING, message="joining the run"))
    for accumulated in (100, 200, 300):  # same state, same message: no new lines
        reporter.update(status(samples_accumulated=accumulated, message="joining the run"))
    reporter.update(status(global_epoch=4, samples_accumulated=10, message="joining the run"))
    reporter.update(status(global_epoch=4, samples_accumulated=20, message="joining the run"))
    reporter.finish(
        status(state=TrainingState.FAILED, global_epoch=4, message="boom. help: restart")
    )
    lines = ui_lines(caplog)
    assert lines == [
        "state: joining",
        "joining the run",
        "state: training",
        "global step 4 reached (my loss 2.5000, 4 peers online, contribution —)",
        "state: failed",
        "boom. help: restart",
    ]
    levels = [r.levelno for r in caplog.records if r.name == "kit.ui.console"]
    assert levels[-1] == logging.ERROR


def test_undone_steps_are_warned_once_per_new_rollback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    reporter = ConsoleReporter(stream=io.StringIO(), mininterval=0)
    for rollbacks in (0, 1, 1, 1, 3, 3):
        reporter.update(status(rollbacks=rollbacks))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(" local")[0] for r in warnings] == ["1", "3"]
    assert "help:" in warnings[0].getMessage()


def test_count_going_back_restarts_the_bar() -> None:
    stream = io.StringIO()
    reporter = ConsoleReporter(stream=stream, mininterval=0)
    reporter.update(status(samples_accumulated=900))
    reporter.update(status(global_epoch=4, samples_accumulated=50, target_batch_size=2000))
    reporter.close()
    reporter.close()  # twice is fine
    output = stream.getvalue()
    assert "900/1000" in output
    assert "50/2000" in output


def test_a_file_stream_is_not_spammed() -> None:
    stream = io.StringIO()  # not a tty: long redraw interval by default
    reporter = ConsoleReporter(stream=stream)
    for accumulated in range(0, 1000, 10):
        reporter.update(status(samples_accumulated=accumulated))
    reporter.close()
    assert stream.getvalue().count("\r") < 10


def test_a_new_global_step_is_drawn_once_in_a_log_file() -> None:
    stream = io.StringIO()  # a file or a pipe, as `kit demo` gives its volunteers
    reporter = ConsoleReporter(stream=stream)
    for step in (3, 4, 5):
        reporter.update(status(global_epoch=step, samples_accumulated=0))
        reporter.update(status(global_epoch=step, samples_accumulated=900))
    drawn = [line for line in stream.getvalue().split("\r") if line.strip()]
    assert sum("step 4" in line for line in drawn) == 1
    assert sum("step 5" in line for line in drawn) == 1
    reporter.close()

"""The volunteer's side (``notebooks/join.ipynb``, ``kit join ADDRESS``): join a run and train.

``kit.join(address)`` is the whole volunteer flow in one call: it opens a :class:`Volunteer`
session (``kit.volunteer_session``: fetch the run, log in, plan the hardware, start a DHT peer,
build the model, data pipeline and ``kit.Optimizer``, train in one background thread), logs in
with a Hugging Face token when the run is allowlisted (a widget in notebooks), and shows the
training: in a notebook a panel (``kit.ui``) with the loss, the peers and this volunteer's
contribution, and a Stop button, while the notebook stays responsive; on a terminal progress
lines until Ctrl+C. ``kit join ADDRESS`` is the same on the command line (GPU servers).

It holds the showing and driving only: the session's wiring is ``kit.volunteer_session``, the
loop ``kit.training.trainer``, the widgets ``kit.ui``.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import ssl
from typing import Any

from kit.errors import CoordinatorUnreachable, KitError
from kit.http_client import MAX_ANSWER_BYTES, http_get
from kit.remote_run import RunInfo, coordinator_url, fetch_run_info, load_run_tokenizer
from kit.training.status import TrainingState, TrainingStatus
from kit.volunteer_session import Volunteer

logger = logging.getLogger(__name__)

# The run-info names lived here before kit.remote_run, and Volunteer before
# kit.volunteer_session: kept importable from here.
__all__ = [
    "MAX_ANSWER_BYTES",
    "CoordinatorUnreachable",
    "RunInfo",
    "Volunteer",
    "coordinator_url",
    "fetch_run_info",
    "http_get",
    "join",
    "load_run_tokenizer",
]


# --- the one-call entry of the join notebook and the CLI ----------------------------------------


def join(
    address: str,
    *,
    hf_token: str | None = None,
    username: str | None = None,
    work_dir: str | os.PathLike[str] = ".",
    max_steps: int | None = None,
    max_seconds: float | None = None,
    widgets: bool | None = None,
    block: bool | None = None,
    **options: Any,
) -> Volunteer:
    """Join the run at ``address`` and train: the whole volunteer flow in one call.

    In a notebook it shows a login widget when the run is allowlisted and no cached Hugging Face
    token is found (``HF_TOKEN``, the Kaggle or Colab secret, ``huggingface-cli login``), then a
    live panel with a Stop button, and returns at once while training goes on in the
    background. On a terminal it prints progress and blocks until Ctrl+C or the limits.

    Args:
        address: the link the organizer handed out.
        hf_token: your Hugging Face access token (read role is enough).
        username: your name on the leaderboard in open (not allowlisted) runs.
        work_dir: where kit keeps this peer's key and caches.
        max_steps, max_seconds: stop by itself after this many local steps / seconds.
        widgets: show ipywidgets (default: when running in a notebook).
        block: wait until training ends (default: not in notebooks, yes on a terminal).
        **options: more :class:`Volunteer` arguments (``client_mode``, ``host``, ``hardware``).
    """
    from kit.ui import find_cached_hf_token

    in_notebook = _in_notebook() if widgets is None else widgets
    block = (not in_notebook) if block is None else block
    volunteer = Volunteer(
        address, hf_token=hf_token, username=username, work_dir=work_dir, **options
    )
    token = hf_token or (find_cached_hf_token() if volunteer.needs_login else None)
    if in_notebook:
        _join_with_widgets(volunteer, token, max_steps=max_steps, max_seconds=max_seconds)
    else:
        _join_on_console(volunteer, token, max_steps=max_steps, max_seconds=max_seconds)
    if block:
        try:
            while not volunteer.wait(1.0):
                pass
        except KeyboardInterrupt:
            logger.info("Ctrl+C: leaving the run")
        finally:
            volunteer.stop()
    return volunteer


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return (
        shell is not None
        and type(shell).__name__ != "TerminalInteractiveShell"
        and (hasattr(shell, "kernel"))
    )


def _join_on_console(volunteer: Volunteer, token: str | None, **limits: Any) -> None:
    from kit.ui import ConsoleReporter

    if volunteer.needs_login:
        if token is None:
            raise KitError(
                "this run is allowlisted - help: pass --hf-token, or set HF_TOKEN to a Hugging "
                "Face access token (huggingface.co/settings/tokens)"
            )
        logger.info("logged in as %s", volunteer.login(token))
    reporter = ConsoleReporter()
    volunteer.start(**limits)
    volunteer.add_status_listener(reporter.update)


def _join_with_widgets(volunteer: Volunteer, token: str | None, **limits: Any) -> None:
    import threading

    from IPython.display import display

    from kit.ui import LoginWidget, TrainingPanel

    def stop_in_background() -> None:
        # Never block the kernel: the Stop button's handler runs on it.
        threading.Thread(target=volunteer.stop, name="kit-stop", daemon=True).start()

    panel = TrainingPanel(on_stop=stop_in_background)

    def begin() -> None:
        display(panel.widget)
        panel.update(dataclasses.replace(volunteer.status, state=TrainingState.JOINING))
        try:
            volunteer.start(**limits)
        except KitError as error:
            panel.finish(TrainingStatus(state=TrainingState.FAILED, message=str(error)))
            volunteer.stop()
            return
        except KeyboardInterrupt:  # the kernel was interrupted while joining
            volunteer.stop()
            panel.finish(TrainingStatus(state=TrainingState.STOPPED, message="stopped"))
            return

        def show(status: TrainingStatus) -> None:
            if status.state.finished:
                panel.finish(status)
            else:
                panel.update(status)

        volunteer.add_status_listener(show)

    if not volunteer.needs_login:
        begin()
        return
    if token is not None:
        try:
            volunteer.login(token)
        except KitError as error:
            logger.warning("the cached Hugging Face token did not work: %s", error)
        else:
            begin()
            return

    def on_success(username: str, _token: str) -> None:
        begin()

    login = LoginWidget(check=volunteer.login, on_success=on_success)
    display(login.widget)


def add_command(subparsers: Any) -> None:
    """``kit join ADDRESS``: the join notebook's flow on a terminal (GPU servers)."""
    parser = subparsers.add_parser("join", help="join a run and train (a volunteer)")
    parser.add_argument("address", help="the coordinator link the organizer handed out")
    parser.add_argument("--hf-token", default=None, help="Hugging Face token (default: $HF_TOKEN)")
    parser.add_argument("--username", default=None, help="your name in open runs")
    parser.add_argument("--work-dir", default=".", help="where kit keeps its key and caches")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after N local steps")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after N seconds")
    parser.add_argument("--host", default="0.0.0.0", help="listen here (127.0.0.1: local only)")
    parser.add_argument(
        "--client-mode", action="store_true", help="never listen (behind NAT); default: detect"
    )
    parser.add_argument(
        "--ca-file", default=None, help="trust this CA for the coordinator's https/wss certificate"
    )
    parser.add_argument(
        "--allow-insecure-http",
        action="store_true",
        help="send your Hugging Face token to a plain-http coordinator (trusted networks only)",
    )
    parser.set_defaults(handler=_join_command)


#: The signal on which a ``kit join`` process writes every thread's stack to stderr (POSIX only).
STACKS_SIGNAL = getattr(signal, "SIGUSR1", None)


def dump_stacks_on_signal() -> bool:
    """Write every thread's stack to stderr on ``STACKS_SIGNAL``, without stopping: where a
    process that should have ended is stuck (``kit demo`` asks an overrunning volunteer before
    it terminates it; by hand: ``kill -USR1 PID``). False where the platform has no such signal.
    """
    if STACKS_SIGNAL is None:
        return False
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    return True


def _join_command(args: argparse.Namespace) -> int:
    dump_stacks_on_signal()  # a volunteer that hangs can say where (kit demo asks)
    try:
        volunteer = join(
            args.address,
            hf_token=args.hf_token,
            username=args.username,
            work_dir=args.work_dir,
            max_steps=args.max_steps,
            max_seconds=args.max_seconds,
            widgets=False,
            block=True,
            host=args.host,
            client_mode=True if args.client_mode else None,
            ssl_context=ssl.create_default_context(cafile=args.ca_file) if args.ca_file else None,
            allow_insecure_http=args.allow_insecure_http,
        )
    except KitError as error:
        logger.error("%s", error)
        return 1
    status = volunteer.status
    if status.state is TrainingState.FAILED:
        logger.error("%s", status.message)
        return 1
    logger.info(
        "done: %d samples, %d global steps, last loss %s",
        status.samples_total,
        status.local_epoch,
        f"{status.last_loss:.4f}" if status.last_loss is not None else "n/a",
    )
    return 0

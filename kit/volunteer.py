"""The volunteer's side (``notebooks/join.ipynb``, ``kit join ADDRESS``): join a run and train.

``kit.join(address)`` fetches the run from the coordinator (config, bootstrap peers, authority
key), logs in with a Hugging Face token when the run is allowlisted (widget in notebooks), picks
device, precision and micro-batch for this machine (``kit.hardware``), starts a DHT peer
(client mode by itself when the machine is unreachable), builds the model, data pipeline and
``kit.Optimizer`` from the run config, and trains in one background thread while the notebook
stays responsive and a panel (``kit.ui``) shows the loss, the peers and this volunteer's
contribution. :class:`Volunteer` is that session; ``stop()`` leaves gracefully.

It holds the wiring only: the loop is ``kit.training.trainer``, the widgets are ``kit.ui``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kit.errors import CoordinatorUnreachable, KitError, KitUsageError
from kit.http_client import MAX_ANSWER_BYTES, http_get
from kit.remote_run import (
    RunInfo,
    coordinator_url,
    fetch_run_info,
    load_run_tokenizer,
    open_served_data,
)
from kit.training.status import TrainingState, TrainingStatus

if TYPE_CHECKING:  # imported late where used: ``import kit`` stays light (no torch, no network)
    import torch

    from kit.auth.authorizer import AllowlistAuthorizer
    from kit.dht import DHT, DHTNode
    from kit.hardware import Hardware, TrainingPlan
    from kit.metrics import MetricsReporter
    from kit.p2p.identity import Identity, IdentityLock
    from kit.p2p.peer import Peer
    from kit.training.data_position import DataPosition
    from kit.training.trainer import Trainer

logger = logging.getLogger(__name__)

#: Seconds between two looks at the coordinator's leaderboard (for "my rank" in the panel).
LEADERBOARD_PERIOD = 30.0

__all__ = [  # the run-info names lived here before kit.remote_run; kept importable from here
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


class Volunteer:
    """One volunteer's session in a run: login, peer, model, data, training thread.

    Args:
        address: the coordinator's link (``https://host:port``) or kit address.
        hf_token: a Hugging Face access token (allowlisted runs); None = ask / find a cached one.
        username: the name shown on the leaderboard in open runs (allowlisted runs use the
            Hugging Face account).
        work_dir: where the identity key, the tokenizer cache and relative data paths live.
        hardware: a ``kit.hardware.Hardware`` (tests); default: detect this machine.
        client_mode: None = detect reachability; True when this machine cannot accept connections.
        host: where this peer listens (default every interface; "127.0.0.1" for local runs).
        ssl_context: how to check the coordinator's certificate (https/wss); None = the system
            CAs. Pass one that trusts the organizer's CA for a self-signed coordinator.
        allow_insecure_http: send the Hugging Face token to a plain-http coordinator that is not
            on this machine (only on a network you trust; loopback is always allowed).
    """

    def __init__(
        self,
        address: str,
        *,
        hf_token: str | None = None,
        username: str | None = None,
        work_dir: str | os.PathLike[str] = ".",
        hardware: Hardware | None = None,
        client_mode: bool | None = None,
        host: str = "0.0.0.0",
        ssl_context: ssl.SSLContext | None = None,
        allow_insecure_http: bool = False,
    ) -> None:
        self.host = host
        self.ssl_context = ssl_context
        self.allow_insecure_http = allow_insecure_http
        self.info = fetch_run_info(address, ssl_context=ssl_context)
        self.config = self.info.config
        self.work_dir = Path(work_dir)
        self.hf_token = hf_token
        self.username = username
        self.hardware = hardware
        self.client_mode = client_mode
        self.authorizer: AllowlistAuthorizer | None = None
        self.dht: DHT | None = None
        self.trainer: Trainer | None = None
        self.data_position: DataPosition | None = None  # once training
        self.reporter: MetricsReporter | None = None
        self._identity: Identity | None = None
        self._identity_lock: IdentityLock | None = None

    @property
    def needs_login(self) -> bool:
        return self.info.authority_public_key is not None and self.authorizer is None

    def identity(self) -> Identity:
        if self._identity is None:
            from kit.p2p.identity import IdentityInUse, load_identity

            run = self.config.collaboration.run_id
            for index in range(16):  # a second notebook on the same machine gets another key
                path = self.work_dir / ".kit" / f"identity-{run}-{index}.key"
                try:
                    self._identity, self._identity_lock = load_identity(path)
                    break
                except IdentityInUse:
                    continue
            else:
                raise KitError("16 kit peers already run here - help: stop one of them first")
        return self._identity

    def default_username(self) -> str:
        """The name of an open run's leaderboard: the one given, else one from the peer id."""
        if self.username is None:
            self.username = f"anonymous-{str(self.identity().peer_id)[:8]}"
        return self.username

    def login(self, hf_token: str) -> str:
        """Get an access token from the coordinator with ``hf_token``; returns the username.

        Raises:
            InvalidHubToken, NotAllowlisted, Revoked, TokenServiceUnavailable: with what to do.
        """
        from kit.auth import authorizer_from_coordinator
        from kit.runtime import get_runtime

        if self.info.authority_public_key is None:  # an open run: nobody checks names
            return self.default_username()
        authorizer = get_runtime().call(
            authorizer_from_coordinator(
                self.info.url,
                hf_token.strip(),
                self.identity(),
                authority_public_key=self.info.authority_public_key,
                ssl_context=self.ssl_context,
                allow_insecure_http=self.allow_insecure_http,
                check_period=self.config.access.check_seconds,  # bans apply within this
            ),
            timeout=60.0,
        )
        self.authorizer = authorizer
        token = authorizer.token
        self.username = token.username if token is not None else None
        self.hf_token = hf_token
        return str(self.username)

    def start(self, *, max_steps: int | None = None, max_seconds: float | None = None) -> None:
        """Join the run and train in a background thread (returns once the peer is up)."""
        from kit.dht import DHT
        from kit.hardware import detect
        from kit.training.trainer import Trainer

        if self.needs_login:
            if self.hf_token is None:
                raise KitError(
                    "this run is allowlisted: log in first - help: pass hf_token=... or set HF_TOKEN"
                )
            self.login(self.hf_token)
        identity = self.identity()
        self.default_username()
        peer_options: dict[str, Any] = dict(
            identity=identity,
            run_id=self.config.collaboration.run_id,
            config_hash=self.info.config_hash,
        )
        if self.authorizer is not None:
            peer_options["authorizer"] = self.authorizer
        if self.ssl_context is not None:
            peer_options["client_ssl"] = self.ssl_context
        self.dht = dht = DHT(
            initial_peers=list(self.info.initial_peers),
            client_mode=self.client_mode,
            host=self.host,
            peer_options=peer_options,
        )
        from kit.training.assembly import build_training, plan_training

        hw = self.hardware or detect(workdir=self.work_dir)
        model, plan = plan_training(self.config, hw)
        batches = self._batches(plan, identity)
        # Every choice of the plan is built: checkpointing, a replica per GPU, 8-bit, offload.
        parts = build_training(self.config, plan, model, self.dht)
        gpus = getattr(hw, "gpus", None) or ()
        label = gpus[0].name if gpus and plan.device.startswith("cuda") else plan.device
        if plan.replicas > 1:
            label = f"{plan.replicas} × {label}"
        self.trainer = trainer = Trainer(
            parts.model,
            parts.optimizer,
            batches,
            plan,
            clip_grad_norm=self.config.optimizer.clip_grad_norm,
            username=self.username,
            device_label=f"{label} ({plan.precision})",
            replicas=parts.replicas,
        )
        if self.data_position is not None:
            trainer.add_step_listener(self.data_position.on_step)
        self._start_reporter(identity, trainer, dht)
        self._follow_leaderboard(trainer, dht)
        for reason in plan.reasons:
            logger.info("plan: %s", reason)
        trainer.start(max_steps=max_steps, max_seconds=max_seconds)

    def _batches(self, plan: TrainingPlan, identity: Identity) -> Iterator[dict[str, torch.Tensor]]:
        from kit.data.pipeline import PretrainingPipeline
        from kit.training.data_position import DataPosition, data_position_path

        if plan.auxiliary:
            return iter(())
        cache = self.work_dir / ".kit"
        tokenizer = load_run_tokenizer(self.info, cache, self.ssl_context)
        pipeline = PretrainingPipeline.from_config(
            self.config.data,
            tokenizer,
            peer_identity=identity.peer_id.to_bytes(),
            served=open_served_data(  # a private run's data: our token in every request
                self.info,
                cache,
                self.ssl_context,
                authorization=None if self.authorizer is None else self.authorizer.bearer,
            ),
        )
        # A restart of this machine goes on where its data stream stopped (saved with its key).
        path = data_position_path(
            self.work_dir / ".kit", self.config.collaboration.run_id, str(identity.peer_id)
        )
        self.data_position = DataPosition(pipeline, path)
        self.data_position.restore()
        return pipeline.batches(max(1, plan.micro_batch))

    def _start_reporter(self, identity: Identity, trainer: Trainer, dht: DHT) -> None:
        from kit.metrics import MetricsReporter

        authorizer = self.authorizer
        username = self.default_username()

        def token() -> bytes | None:
            current = authorizer.token if authorizer is not None else None
            return current.to_bytes() if current is not None else None

        async def start(_: DHT, node: DHTNode) -> MetricsReporter:
            reporter = MetricsReporter(
                node,
                self.config.collaboration.run_id,
                identity,
                username=username,
                token=token,
                device=trainer.status.device,
            )
            reporter.start()
            return reporter

        self.reporter = reporter = dht.run_coroutine(start)

        def on_step(samples: int, loss: float, compute: float) -> None:
            reporter.update(
                epoch=trainer.optimizer.local_epoch,
                loss=loss,
                samples_total=trainer.samples_total,
                compute_seconds=trainer.compute_seconds,
                samples_per_second=trainer.optimizer.tracker.local.samples_per_second,
            )

        trainer.add_step_listener(on_step)
        trainer.optimizer.add_round_listener(reporter.attest_round)  # credit is attested

    def _follow_leaderboard(self, trainer: Trainer, dht: DHT) -> None:
        """Keep "my rank" in the status fresh: a task owned by this peer, cancelled with it."""
        import asyncio

        url, username = self.info.url + "/api/leaderboard", self.username

        async def follow() -> None:
            while True:
                try:
                    body = await asyncio.to_thread(
                        http_get, url, timeout=10.0, limit=2**22, ssl_context=self.ssl_context
                    )
                    rows = json.loads(body)["leaderboard"]
                    rank = next(
                        (i + 1 for i, row in enumerate(rows) if row.get("username") == username),
                        None,
                    )
                    trainer.update_status(notify=False, rank=rank, leaderboard_size=len(rows))
                except (KitError, ValueError, KeyError, TypeError, AttributeError) as error:
                    logger.debug("leaderboard unavailable: %s", error)
                await asyncio.sleep(LEADERBOARD_PERIOD)

        async def spawn(_: DHT, node: DHTNode) -> None:
            peer = cast("Peer", node.peer)  # a volunteer's DHT runs on kit's websocket peer
            peer.spawn(follow(), "leaderboard")

        dht.run_coroutine(spawn)

    @property
    def status(self) -> TrainingStatus:
        if self.trainer is None:
            state = TrainingState.LOGGING_IN if self.needs_login else TrainingState.STARTING
            return TrainingStatus(state=state, username=self.username)
        return self.trainer.status

    def add_status_listener(self, listener: Callable[[TrainingStatus], None]) -> None:
        """Call ``listener`` with every new status of the training (once started)."""
        if self.trainer is None:
            raise KitUsageError("the volunteer has not started - help: call start() first")
        self.trainer.add_status_listener(listener)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until training ends (limits reached or stopped); True when it has."""
        return self.trainer is None or bool(self.trainer.wait(timeout))

    def stop(self, timeout: float = 60.0) -> None:
        """Leave the run: finish the current step, stop the peer (idempotent)."""
        if self.trainer is not None:
            self.trainer.update_status(state=TrainingState.STOPPING, message="leaving the run")
            self.trainer.stop(timeout)
            self.trainer.optimizer.shutdown()
            if self.data_position is not None and not self.trainer.running:
                self.data_position.save()
        if self.reporter is not None and self.dht is not None and self.dht.is_alive():
            reporter = self.reporter

            async def stop_reporter(_: DHT, __: DHTNode) -> None:
                await reporter.shutdown()

            self.dht.run_coroutine(stop_reporter)
            self.reporter = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.authorizer is not None:
            from kit.runtime import get_runtime

            get_runtime().call(self.authorizer.close(), timeout=10.0)
        if self._identity_lock is not None:
            self._identity_lock.release()
            self._identity_lock = None
        if self.trainer is not None and not self.trainer.status.state.finished:
            self.trainer.update_status(state=TrainingState.STOPPED, message="left the run")


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


def _join_command(args: argparse.Namespace) -> int:
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

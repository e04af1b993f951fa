"""One volunteer's session in a run: login, DHT peer, model, data, training thread, reporter.

Holds :class:`Volunteer` (re-exported by ``kit.volunteer``, its entry module): it fetches the
run from the coordinator (config, bootstrap peers, authority key), logs in with a Hugging Face
token when the run is allowlisted, picks device, precision and micro-batch for this machine
(``kit.hardware``), starts a DHT peer (client mode by itself when the machine is unreachable),
builds the model, data pipeline and ``kit.Optimizer`` from the run config, trains in one
background thread (``kit.training.trainer``), publishes this volunteer's contribution
(``kit.metrics``) and keeps its leaderboard rank in the status; ``stop()`` leaves gracefully.

Separate from ``kit.volunteer`` because it is the wiring alone, the same from a notebook, a
terminal or a test: how a session is shown and driven (widgets, console, ``kit join``) is the
entry module's.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kit.errors import KitError, KitUsageError
from kit.http_client import http_get
from kit.remote_run import fetch_run_info, load_run_tokenizer, open_served_data
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
        if self.info.relays:  # member relays first: NAT'd volunteers spread over them
            peer_options["relays"] = tuple(self.info.relays)
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

"""The coordinator's auxiliary peer: it helps average, keeps checkpoints, and seeds restarts.

An auxiliary peer computes no gradients (DeDLOC §3.2: CPU-only helpers join averaging rounds with
weight 0, adding bandwidth to the butterfly all-reduce). This one also keeps the run's
checkpoints: every ``checkpoint.every_epochs`` global steps it downloads the collaboration's
state from the volunteers (verified, as a late joiner would) and saves it with
:class:`~kit.training.checkpoints.CheckpointManager`, which pushes it to the Hub in a thread of
its own. After a coordinator restart it restores the newest checkpoint and serves it as a state
donor at that step, so that a collaboration whose volunteers all left resumes where it was,
instead of from the initial weights.

It runs in one worker thread it owns (the optimizer's calls block); ``stop()`` ends it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kit.config import RunConfig
from kit.errors import KitError, StateDownloadFailed

logger = logging.getLogger(__name__)

#: Seconds between two attempts to download the state for a checkpoint that failed.
CHECKPOINT_RETRY_SECONDS = 30.0
#: Seconds between checks for a push that is due (a failed or rate-limited one is retried).
PUSH_CHECK_SECONDS = 60.0


class AuxiliaryPeer:
    """An auxiliary ``kit.Optimizer`` plus the run's checkpoints.

    Args:
        config: the run.
        dht: the coordinator's running DHT.
        checkpoint_root: a relative ``checkpoint.folder`` is taken relative to this folder.
        hub_token, hf_endpoint: for pushing checkpoints (see ``CheckpointManager``).
        tokenizer_dir: copied into each checkpoint, so each one loads on its own.
        loss: returns the collaboration's latest loss (for the commit message), or None.
    """

    def __init__(
        self,
        config: RunConfig,
        dht: Any,
        *,
        checkpoint_root: str | Path = ".",
        hub_token: str | None = None,
        hf_endpoint: str | None = None,
        tokenizer_dir: str | Path | None = None,
        loss: Callable[[], float | None] = lambda: None,
    ) -> None:
        from kit.training.checkpoints import CheckpointManager

        folder = Path(config.checkpoint.folder)
        if not folder.is_absolute():
            folder = Path(checkpoint_root) / folder
        self.config = config
        self.dht = dht
        self.loss = loss
        self.manager = CheckpointManager(
            dataclasses.replace(config.checkpoint, folder=str(folder)),
            hub_token=hub_token,
            endpoint=hf_endpoint,
            run_config=config,
            tokenizer_dir=tokenizer_dir,
        )
        self.model: Any = None
        self.optimizer: Any = None
        self.restored_step: int | None = None
        self.attestor: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pusher: threading.Thread | None = None
        self._next_attempt = 0.0
        self._next_push_check = 0.0

    def start(self) -> None:
        """Build the model and optimizer, restore the newest checkpoint, start the thread."""
        from kit.training.components import build_collaborative_optimizer, build_model

        self.model = build_model(self.config)
        self.optimizer = build_collaborative_optimizer(
            self.model, self.config, self.dht, batch_size_per_step=None, auxiliary=True
        )
        self._attest_rounds()
        self._restore()
        self._thread = threading.Thread(target=self._run, name="kit-auxiliary", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the thread, wait for a push in flight, shut the optimizer down (idempotent)."""
        self._stop.set()
        for thread in (self._thread, self._pusher):
            if thread is not None:
                thread.join(timeout)
        self._thread = self._pusher = None
        if self.optimizer is not None:
            self.optimizer.shutdown()
            self.optimizer = None
        attestor, self.attestor = self.attestor, None
        if attestor is not None and self.dht.is_alive():

            async def stop_attesting(_: Any, __: Any) -> None:
                await attestor.shutdown()

            self.dht.run_coroutine(stop_attesting)

    def _attest_rounds(self) -> None:
        """Attest the weights of every round this peer joins: the organizer's own attestation
        decides a volunteer's credit for that round (``kit.metrics.ledger``)."""
        from kit.metrics import RoundAttestor

        run_id = self.config.collaboration.run_id

        async def start(_: Any, node: Any) -> Any:
            authorizer = node.peer.authorizer

            def token() -> bytes | None:
                current = getattr(authorizer, "token", None)
                return current.to_bytes() if current is not None else None

            attestor = RoundAttestor(node, run_id, node.peer.identity, token=token)
            attestor.start()
            return attestor

        self.attestor = self.dht.run_coroutine(start)
        self.optimizer.add_round_listener(self.attestor.record)

    # --- restore -------------------------------------------------------------------------------

    def _restore(self) -> None:
        from transformers import AlbertForPreTraining

        restored = self.manager.restore()
        if restored is None:
            return
        saved = AlbertForPreTraining.from_pretrained(restored.folder)
        self.model.load_state_dict(saved.state_dict())
        optimizer = self.optimizer
        optimizer.opt.load_state_dict(restored.optimizer_state)
        if optimizer.scheduler is not None and restored.scheduler_state is not None:
            optimizer.scheduler.load_state_dict(restored.scheduler_state)
        optimizer.local_epoch = restored.step
        self.restored_step = restored.step
        optimizer.share_state()
        logger.info(
            "restored the checkpoint of step %d (%s); serving it to peers",
            restored.step,
            restored.source,
        )

    # --- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.optimizer.step()
                self._maybe_checkpoint()
                if time.monotonic() >= self._next_push_check:
                    self._next_push_check = time.monotonic() + PUSH_CHECK_SECONDS
                    self._push_in_background()
            except KitError as error:
                logger.warning("auxiliary peer: %s", error)
                self._stop.wait(1.0)
            except Exception:
                logger.exception("auxiliary peer: unexpected error (it keeps running)")
                self._stop.wait(5.0)

    def _maybe_checkpoint(self) -> None:
        epoch = self.optimizer.tracker.global_progress.epoch
        now = time.monotonic()
        if not self.manager.is_due(epoch) or now < self._next_attempt:
            return
        self._next_attempt = now + CHECKPOINT_RETRY_SECONDS
        try:
            loaded = self.optimizer.load_state_from_peers(
                timeout=self.config.collaboration.load_state_timeout
            )
        except StateDownloadFailed as error:
            logger.warning("checkpoint of step %d postponed: %s", epoch, error)
            return
        if not loaded:  # nobody shares a state: ours is not trained, never save it
            logger.warning("checkpoint of step %d postponed: no peer shares its state", epoch)
            return
        optimizer = self.optimizer
        with torch.no_grad():
            folder = self.manager.maybe_save(
                optimizer.local_epoch,
                self.model,
                optimizer.opt.state_dict(),
                optimizer.scheduler.state_dict() if optimizer.scheduler is not None else None,
                self.loss(),
                time.time(),
            )
        if folder is not None:
            logger.info("saved checkpoint %s", folder)
            self._push_in_background()

    def _push_in_background(self) -> None:
        if self._pusher is not None and self._pusher.is_alive():
            return  # the next save is pushed when this upload is done (push_every_minutes)
        self._pusher = threading.Thread(
            target=self.manager.maybe_push, args=(time.time(),), name="kit-push", daemon=True
        )
        self._pusher.start()

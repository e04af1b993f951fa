"""The coordinator's checkpoints of the shared model: when to save, prune, push, what to restore.

Holds :class:`CheckpointManager` (when to save, how many to keep, when to push, what to restore
after a restart). Its parts: one folder on disk, written atomically (``checkpoint_folder``:
:func:`save_checkpoint`, re-exported here), in the series format of ``checkpoint_format``; the
uploads and downloads (``checkpoint_hub``). It does not decide *what* the state is (the
coordinator downloads it from peers) nor evaluate checkpoints (``kit.evaluation``).

Nothing is unpickled: hivemind's ``optimizer_state.pt`` needs ``torch.load``, which runs code
from whoever wrote the file; here a checkpoint downloaded from the Hub is safetensors + JSON
(``training_state``) and validated before use.

On the Hub the repo's root always holds the newest checkpoint (so ``from_pretrained(repo)`` gets
the latest model), and its history is the series: each push is one commit titled
``"step 120, loss 3.2100"`` (``checkpoint_format.commit_title``).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kit.errors import CheckpointError, MalformedTrainingState
from kit.training.checkpoint_folder import (
    STAGING_FOLDER,
    complete_checkpoints,
    fsync_tree,
    publish_folder,
    remove_tree,
    save_checkpoint,
)
from kit.training.checkpoint_format import CHECKPOINT_FOLDER_FORMAT, read_checkpoint_info
from kit.training.checkpoint_hub import (
    download_checkpoint,
    hub_hint,
    push_checkpoint,
    short_error,
)
from kit.training.training_state import SavedTrainingState, load_training_state

if TYPE_CHECKING:
    from kit.config import CheckpointConfig, RunConfig

logger = logging.getLogger(__name__)

#: A failed push is retried after at most this many seconds (or push_every_minutes if shorter).
PUSH_RETRY_SECONDS = 60.0

CORRUPT_SUFFIX = ".corrupt"  # a checkpoint restore could not read is renamed step_XXXXXX.corrupt

# --- the coordinator's manager ----------------------------------------------------------------


@dataclass(frozen=True)
class RestoredCheckpoint:
    """The state to resume from: load the model from :attr:`folder`, then the two states."""

    step: int  # global optimizer step of the checkpoint
    folder: Path  # local checkpoint folder: Model.from_pretrained(folder)
    optimizer_state: dict[str, Any]  # optimizer.load_state_dict(...)
    scheduler_state: dict[str, Any] | None  # scheduler.load_state_dict(...) (None: none saved)
    info: dict[str, Any] = field(default_factory=dict)  # loss, time, config_hash of the save
    source: str = "local"  # "local" or "hub" (downloaded into the folder)


class CheckpointManager:
    """Decides when the coordinator saves, prunes and pushes, and what it restores on restart.

    Every method is blocking and thread-safe. From the coordinator's asyncio loop, run
    :meth:`maybe_save`, :meth:`maybe_push` and :meth:`restore` in an executor
    (``loop.run_in_executor(None, manager.maybe_push, time.time())``): a push uploads the whole
    model. Pushes never raise: a failure is logged with what to do and retried later.

    Example::

        manager = CheckpointManager(config.checkpoint, hub_token=token, run_config=config)
        restored = manager.restore()
        ...
        manager.maybe_save(step, model, opt.state_dict(), sched.state_dict(), loss, time.time())
        manager.maybe_push(time.time())

    Args:
        config: the run's ``checkpoint:`` section (folder, hub_repo, every_epochs,
            push_every_minutes, keep_last).
        hub_token: a Hub token with write access to ``config.hub_repo`` (None: the logged-in
            user's token, ``HF_TOKEN``).
        endpoint: the Hub URL (None: ``HF_ENDPOINT``, else huggingface.co).
        run_config: recorded with each save (config hash) and compared on restore.
        tokenizer_dir: a tokenizer folder copied into every save, so that each checkpoint loads
            on its own (``kit.evaluate`` needs it).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        hub_token: str | None = None,
        endpoint: str | None = None,
        run_config: RunConfig | None = None,
        tokenizer_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config = config
        self.root = Path(config.folder).expanduser()
        self._token, self._endpoint = hub_token, endpoint
        self._run_config = run_config
        self._tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
        self._lock = threading.Lock()  # guards the fields below (save and push run on threads)
        self._pushing: Path | None = None  # never pruned while it uploads
        self._pushed_step: int | None = None
        self._next_push_at: float | None = None  # None: push as soon as there is something new
        self._repo_created = False
        newest = self.latest_step()
        self._saved_step = newest if newest is not None else 0
        # Folders left by a crash mid-save: no process is writing into them any more.
        remove_tree(self.root / STAGING_FOLDER)

    # --- local -------------------------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder, or None if there is none."""
        found = complete_checkpoints(self.root)
        return found[-1][1] if found else None

    def latest_step(self) -> int | None:
        """The step of :meth:`latest`, or None."""
        found = complete_checkpoints(self.root)
        return found[-1][0] if found else None

    def is_due(self, step: int) -> bool:
        """True when ``step`` crossed a multiple of ``every_epochs`` since the last save.

        Crossing (not equality) because the coordinator may observe steps 49 then 51: the save
        then happens at 51, and the next one at the first step >= 100 (DeDLOC's coordinator
        saved on ``step % interval == 0`` and silently skipped such checkpoints).
        """
        every = self.config.every_epochs
        with self._lock:
            return step // every > self._saved_step // every

    def maybe_save(
        self,
        step: int,
        model: Any,
        optimizer_state: Mapping[str, Any],
        scheduler_state: Mapping[str, Any] | None,
        loss: float | None,
        now: float,
    ) -> Path | None:
        """Save (then prune) if :meth:`is_due`; returns the new folder, or None.

        A full or read-only disk is logged as an error and retried at the next call (the
        coordinator keeps running; the last good checkpoint stays).

        Raises:
            KitUsageError: the state holds values that cannot be saved (a bug in the caller).
        """
        if not self.is_due(step):
            return None
        try:
            folder = save_checkpoint(
                self.root,
                step,
                model,
                optimizer_state,
                scheduler_state,
                loss=loss,
                run_config=self._run_config,
                tokenizer_dir=self._tokenizer_dir,
                now=now,
            )
        except (OSError, CheckpointError) as exc:
            logger.error(
                "could not save the checkpoint of step %d in %s (%s: %s) - help: free disk "
                "space or fix the permissions of checkpoint.folder; kit retries at the next step",
                step,
                self.root,
                type(exc).__name__,
                exc,
            )
            return None
        with self._lock:
            self._saved_step = max(self._saved_step, step)
        self.prune()
        return folder

    def prune(self) -> list[Path]:
        """Delete all but the ``keep_last`` newest checkpoints; returns the deleted folders.

        The folder being pushed is never deleted. Each folder is first renamed into the staging
        folder, so a crash mid-delete never leaves a half checkpoint behind.
        """
        found = complete_checkpoints(self.root)
        with self._lock:
            doomed = [
                folder
                for _, folder in found[: max(0, len(found) - self.config.keep_last)]
                if folder != self._pushing
            ]
        staging = self.root / STAGING_FOLDER
        for folder in doomed:
            staging.mkdir(parents=True, exist_ok=True)
            trash = Path(tempfile.mkdtemp(prefix="pruned.", dir=staging))
            os.replace(folder, trash / folder.name)
            remove_tree(trash)
            logger.info("deleted old checkpoint %s (keep_last=%d)", folder, self.config.keep_last)
        return doomed

    # --- the Hub -----------------------------------------------------------------------------

    def maybe_push(self, now: float) -> int | None:
        """Push the newest checkpoint if it is new and ``push_every_minutes`` have passed.

        Blocking (uploads the model): run it in an executor. Never raises for Hub failures:
        they are logged with a hint and retried after ``min(PUSH_RETRY_SECONDS, interval)``.

        Args:
            now: ``time.time()``; the interval counts from the previous attempt.

        Returns:
            The step pushed, or None (nothing new, not yet time, no hub_repo, or failure).
        """
        if self.config.hub_repo is None:
            return None
        found = complete_checkpoints(self.root)
        interval = self.config.push_every_minutes * 60.0
        with self._lock:
            if self._pushing is not None or not found or found[-1][0] == self._pushed_step:
                return None
            if self._next_push_at is not None and now < self._next_push_at:
                return None
            step, folder = found[-1]
            self._pushing = folder
        try:
            self._push(step, folder)
        # Any failure of the Hub (HTTP, network, a full disk) must not stop the coordinator.
        except Exception as exc:
            retry = min(PUSH_RETRY_SECONDS, interval)
            logger.warning(
                "could not push step %d to the Hub repo %s: %s - help: %s (retrying in %.0f s)",
                step,
                self.config.hub_repo,
                short_error(exc),
                hub_hint(exc),
                retry,
            )
            logger.debug("push failure details", exc_info=True)
            with self._lock:
                self._next_push_at = now + retry
            return None
        finally:
            with self._lock:
                self._pushing = None
        with self._lock:
            self._pushed_step = step
            self._next_push_at = now + interval
        return step

    def _push(self, step: int, folder: Path) -> None:
        from huggingface_hub import HfApi

        repo = self.config.hub_repo
        assert repo is not None  # checked by maybe_push
        api = HfApi(endpoint=self._endpoint, token=self._token)
        if not self._repo_created:
            api.create_repo(repo, repo_type="model", exist_ok=True)
            self._repo_created = True
        push_checkpoint(api, repo, step, folder)

    # --- restart -------------------------------------------------------------------------------

    def restore(self) -> RestoredCheckpoint | None:
        """The state to resume from after a restart: the newest local checkpoint, else the Hub's.

        With no local checkpoint and a ``hub_repo``, the repo's head is downloaded into the
        checkpoint folder (as ``step_XXXXXX``). A missing or empty repo means a fresh run (None).
        A local checkpoint whose training state is corrupt (a disk error, an edit by hand) is
        renamed ``step_XXXXXX.corrupt``, with a warning, and the next older one is tried.

        Returns:
            The restored checkpoint, or None when there is nothing to resume from.

        Raises:
            MalformedTrainingState: every local checkpoint is corrupt (the newest one's error),
                or the Hub's is.
            CheckpointRestoreFailed: the Hub could not be reached or refused the token (we do
                not silently start from scratch over a run that has checkpoints).
        """
        local = [folder for _, folder in reversed(complete_checkpoints(self.root))]
        first_error: MalformedTrainingState | None = None
        for folder in local:
            try:
                loaded = load_training_state(folder)
            except MalformedTrainingState as exc:
                # Set aside (kept for a look, no longer "complete"): else it would still be the
                # newest checkpoint, the one pushed to the Hub and served.
                aside = folder.with_name(folder.name + CORRUPT_SUFFIX)
                logger.warning(
                    "checkpoint %s is unreadable, moved to %s; trying an older one: %s",
                    folder,
                    aside.name,
                    exc,
                )
                os.replace(folder, aside)
                first_error = first_error or exc
                continue
            return self._restored(folder, "local", loaded)
        if first_error is not None:
            raise first_error  # we do not silently start over, nor fetch the Hub over local work
        if self.config.hub_repo is None:
            return None
        downloaded = self._download_latest()
        if downloaded is None:
            return None
        return self._restored(downloaded, "hub", load_training_state(downloaded))

    def _restored(
        self, folder: Path, source: str, loaded: SavedTrainingState
    ) -> RestoredCheckpoint:
        step, optimizer_state, scheduler_state, info = loaded
        if self._run_config is not None and info.get("config_hash") not in (
            None,
            self._run_config.config_hash(),
        ):
            logger.warning(
                "checkpoint %s was saved with another run config (hash %s) - help: if the model "
                "or optimizer changed on purpose, ignore this; otherwise start from the run.yaml "
                "it was trained with",
                folder,
                info.get("config_hash"),
            )
        with self._lock:
            self._saved_step = max(self._saved_step, step)
            if source == "hub":
                self._pushed_step = step
        logger.info("restored step %d from %s (%s)", step, folder, source)
        return RestoredCheckpoint(
            step, folder, optimizer_state, scheduler_state, info, source=source
        )

    def _download_latest(self) -> Path | None:
        repo = self.config.hub_repo
        assert repo is not None  # checked by restore
        staging = self.root / STAGING_FOLDER
        staging.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix="download.", dir=staging))
        try:
            if not download_checkpoint(repo, building, token=self._token, endpoint=self._endpoint):
                return None
            step = read_checkpoint_info(building)["step"]
            final = self.root / CHECKPOINT_FOLDER_FORMAT.format(step=step)
            fsync_tree(building)
            publish_folder(building, final, staging)
            return final
        finally:
            remove_tree(building)

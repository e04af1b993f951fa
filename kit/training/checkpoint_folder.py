"""One checkpoint folder on disk: written atomically, published in one rename, listed.

Holds :func:`save_checkpoint` (the model, its optimizer and scheduler state, written without
pickle by ``training_state``, the tokenizer, and ``kit_checkpoint.json`` last), the atomic
publish and delete of folders, and :func:`complete_checkpoints` (the folders a restart or a push
may use). One checkpoint is one folder, in the series format of ``checkpoint_format`` (which
``kit.evaluation.checkpoints`` lists)::

    <checkpoint.folder>/
        step_000120/
            config.json, model.safetensors   model.save_pretrained(folder)
            training_state.safetensors       every optimizer/scheduler tensor, by a stable name
            training_state.json              the rest of their structure, step, loss, time, hash
            tokenizer.json ...               copied from the run's tokenizer folder, if given
            kit_checkpoint.json              {"step": 120, "loss": 3.21, ...} (written last)
        .incomplete/                         folders being written or deleted; never listed

A folder is built under ``.incomplete/`` and renamed into place in one ``os.replace``, so a crash
mid-save leaves nothing that ``CheckpointManager.latest`` or ``kit.evaluate`` would pick up
(sahajBERT's coordinator wrote in place, and a kill during ``save_pretrained`` left a torn
checkpoint behind).

Separate from ``checkpoints`` because it is the file system's side alone, with no policy: the
manager there decides when to save, what to prune, push and restore, and calls these.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kit.errors import CheckpointError, KitUsageError
from kit.training.checkpoint_format import (
    CHECKPOINT_FOLDER_FORMAT,
    read_checkpoint_info,
    write_checkpoint_info,
)
from kit.training.training_state import TRAINING_STATE_JSON, write_training_state

if TYPE_CHECKING:
    from kit.config import RunConfig

logger = logging.getLogger(__name__)

#: Where folders are built before they are renamed into place (and moved to before deletion).
STAGING_FOLDER = ".incomplete"

_FOLDER_NAME = re.compile(r"^step_(\d+)$")


def save_checkpoint(
    folder_root: str | os.PathLike[str],
    step: int,
    model: Any,
    optimizer_state: Mapping[str, Any],
    scheduler_state: Mapping[str, Any] | None,
    *,
    loss: float | None,
    run_config: RunConfig | None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    now: float | None = None,
) -> Path:
    """Write ``<folder_root>/step_{step:06d}/`` atomically and return its path.

    The folder is built under ``<folder_root>/.incomplete/`` and renamed into place, replacing an
    older save of the same step. Blocking (seconds for a large model): from asyncio, run it in an
    executor. The optimizer must not step while this runs (pass a copy if it might).

    Args:
        folder_root: the checkpoint folder (``checkpoint.folder`` of the run config).
        step: the global optimizer step of this state (>= 0).
        model: a ``transformers`` model; saved with ``save_pretrained`` (safetensors).
        optimizer_state: ``optimizer.state_dict()``: nested dicts/lists of tensors and scalars.
        scheduler_state: ``scheduler.state_dict()``, or None without a scheduler.
        loss: the swarm's mean training loss at ``step``; None (or NaN) if unknown.
        run_config: the run's config, whose ``config_hash()`` is recorded; None to skip.
        tokenizer_dir: a ``tokenizer.save_pretrained`` folder whose files are copied in.
        now: ``time.time()`` of the save, recorded in the JSON files (default: read the clock).

    Returns:
        The final checkpoint folder.

    Raises:
        KitUsageError: the state holds values that are not tensors or plain data.
        OSError: the disk is full or the folder is not writable.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise KitUsageError(f"step must be an int >= 0, got {step!r} help: pass the global step")
    root = Path(folder_root).expanduser()
    staging = root / STAGING_FOLDER
    staging.mkdir(parents=True, exist_ok=True)
    final = root / CHECKPOINT_FOLDER_FORMAT.format(step=step)
    building = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=staging))
    saved_at = time.time() if now is None else now
    config_hash = run_config.config_hash() if run_config is not None else None
    try:
        model.save_pretrained(building)
        write_training_state(
            building, step, optimizer_state, scheduler_state, loss, saved_at, config_hash
        )
        if tokenizer_dir is not None:
            _copy_tokenizer(Path(tokenizer_dir), building)
        # Written last: a folder with this file is complete (evaluation lists folders by it).
        write_checkpoint_info(
            building, step=step, loss=loss, time=saved_at, config_hash=config_hash
        )
        fsync_tree(building)
        publish_folder(building, final, staging)
    except BaseException:
        remove_tree(building)
        raise
    logger.info("saved checkpoint of step %d to %s", step, final)
    return final


def _copy_tokenizer(source: Path, folder: Path) -> None:
    if not source.is_dir():
        raise CheckpointError(
            f"tokenizer folder {source} does not exist - help: pass the folder written by "
            "tokenizer.save_pretrained(...), or tokenizer_dir=None"
        )
    for file in sorted(source.iterdir()):
        if file.is_file() and not (folder / file.name).exists():  # never replace model files
            shutil.copy2(file, folder / file.name)


def fsync_tree(folder: Path) -> None:
    """Flush the files to disk before the rename makes them visible (a power cut otherwise can
    leave a renamed folder of empty files on ext4 with delayed allocation)."""
    for file in folder.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def publish_folder(building: Path, final: Path, staging: Path) -> None:
    """Rename ``building`` to ``final``; an older folder there is moved aside, then deleted."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix="replaced.", dir=staging)) / final.name
        os.replace(final, old)
    os.replace(building, final)
    if hasattr(os, "O_DIRECTORY"):  # make the rename durable (POSIX; Windows has no dir fsync)
        descriptor = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    if old is not None:
        remove_tree(old.parent)


def remove_tree(folder: Path) -> None:
    """Delete ``folder`` and everything in it; what cannot be deleted is left behind."""
    shutil.rmtree(folder, ignore_errors=True)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        if not _FOLDER_NAME.match(folder.name) or not (folder / TRAINING_STATE_JSON).is_file():
            continue
        try:
            step = read_checkpoint_info(folder)["step"]
        except CheckpointError as exc:
            logger.warning("ignoring checkpoint folder %s: %s", folder, exc)
            continue
        found.append((step, folder))
    return sorted(found)

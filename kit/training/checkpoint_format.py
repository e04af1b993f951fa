"""A checkpoint series on disk and on the Hub: the format its writer and its reader share.

The coordinator writes checkpoints (``kit.training.checkpoints``); the researcher's notebook
lists and reads them (``kit.evaluation.checkpoints``). Both take the format from here, so
neither depends on the other. Standard library only.

The series format::

    checkpoints/
        step_000050/
            kit_checkpoint.json     {"step": 50, "loss": 7.91}
            config.json             }
            model.safetensors       } model.save_pretrained(folder)
            tokenizer.json ...      } tokenizer.save_pretrained(folder)  (or pass tokenizer=...)
        step_000100/
            ...

``kit_checkpoint.json`` is one JSON object with at least ``step`` (int >= 0, the global optimizer
step) and ``loss`` (float or null, the swarm's mean training loss at that step). Other keys are
allowed and kept in :attr:`Checkpoint.info`. Write it with :func:`write_checkpoint_info`. The
folder name (``step_{step:06d}``) is for humans; the step is read from the JSON.

On the Hub, a series is the repo's commit history: every commit whose title reads like
``"Step 120, loss 3.21"`` (what the sahajBERT coordinator committed, recipes §3.6) is one
checkpoint at that revision. Other commits (README edits, "initial commit") are skipped.
What this module does not do: save or load models (``kit.training.checkpoints``), find a
series on the Hub (``kit.evaluation.checkpoints``).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from kit.errors import CheckpointError

#: File name of the step/loss record inside each checkpoint folder of a series.
CHECKPOINT_INFO_FILE = "kit_checkpoint.json"
#: Folder name for one checkpoint of a series (the coordinator's convention; not parsed).
CHECKPOINT_FOLDER_FORMAT = "step_{step:06d}"

# Commit titles: "Step 19519, loss 1.999" (sahajBERT), "Epoch 12, loss 3.2" (TTT), "step=5 loss=nan".
_TITLE_STEP = re.compile(r"\b(?:step|epoch)\s*[:=#]?\s*(\d+)", re.IGNORECASE)
_TITLE_LOSS = re.compile(
    r"\bloss\s*[:=]?\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|nan|inf)", re.IGNORECASE
)


def write_checkpoint_info(
    folder: str | os.PathLike[str], *, step: int, loss: float | None, **extra: Any
) -> Path:
    """Write ``kit_checkpoint.json`` into a checkpoint folder (what the coordinator calls).

    Args:
        folder: the folder that holds (or will hold) the ``save_pretrained`` files.
        step: the global optimizer step of this checkpoint (>= 0).
        loss: the swarm's mean training loss at that step, or None if unknown (NaN and
            infinity are written as null: JSON has no NaN).
        **extra: more JSON-serializable facts (time, samples seen, peers); readers keep them.

    Returns:
        The path of the written file.
    """
    if loss is not None and not math.isfinite(loss):
        loss = None
    record: dict[str, Any] = {"step": step, "loss": loss, **extra}
    _validate_info(record, where=str(folder))
    path = Path(folder) / CHECKPOINT_INFO_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def read_checkpoint_info(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate the ``kit_checkpoint.json`` of one checkpoint folder.

    Raises:
        CheckpointError: the file is missing, is not JSON, or lacks a valid step/loss.
    """
    path = Path(folder) / CHECKPOINT_INFO_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} does not exist - help: the coordinator writes it with "
            "kit.evaluate.write_checkpoint_info(folder, step=..., loss=...)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not readable JSON ({exc}) - help: rewrite it with write_checkpoint_info()"
        ) from exc
    _validate_info(record, where=str(path))
    return record


def _validate_info(record: Any, *, where: str) -> None:
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{where}: checkpoint record must be a JSON object - help: "
            'write {"step": <int>, "loss": <float or null>}'
        )
    step, loss = record.get("step"), record.get("loss", "missing")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"{where}: 'step' must be an integer >= 0, got {step!r} - help: "
            "write the global optimizer step of the checkpoint"
        )
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        raise CheckpointError(
            f"{where}: 'loss' must be a number or null, got {loss!r} - help: "
            "write the swarm's mean training loss, or null if unknown"
        )


def parse_commit_title(title: str) -> tuple[int | None, float | None]:
    """The (step, loss) of a Hub commit title like ``"Step 120, loss 3.21"``; None where absent."""
    step_match = _TITLE_STEP.search(title)
    loss_match = _TITLE_LOSS.search(title)
    step = int(step_match.group(1)) if step_match else None
    loss = float(loss_match.group(1)) if loss_match else None
    return step, loss


def commit_title(step: int, loss: float | None) -> str:
    """The Hub commit title of a checkpoint, e.g. ``"step 120, loss 3.2100"``.

    :func:`parse_commit_title` reads it back; an unknown loss is written
    as ``"loss unknown"``, which it reads as None (like the null in ``kit_checkpoint.json``).
    """
    if loss is None or not math.isfinite(loss):
        return f"step {step}, loss unknown"
    return f"step {step}, loss {loss:.4f}"

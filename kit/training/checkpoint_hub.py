"""The coordinator's checkpoints on the Hugging Face Hub: one push, the newest download, and
what to tell the organizer when the Hub fails.

Holds :func:`push_checkpoint` (a checkpoint folder as one commit titled
``"step 120, loss 3.2100"``, ``checkpoint_format.commit_title``, with a progress bar as the
weights upload), :func:`download_checkpoint` (the repo's head, the newest checkpoint, into a
folder) and :func:`hub_hint` (what to do about a failed Hub call, from its HTTP status).

Separate from ``checkpoints`` because it is the one part that talks to the Hub (through
``huggingface_hub``, imported late so that the coordinator starts without it until a push):
``CheckpointManager`` decides when to push and what to restore, and keeps the folders on disk
(atomic saves, pruning, where a download is published); this module only moves one folder to
or from a repo.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from kit.errors import CheckpointRestoreFailed
from kit.training.checkpoint_format import (
    CHECKPOINT_INFO_FILE,
    commit_title,
    read_checkpoint_info,
)

if TYPE_CHECKING:
    from huggingface_hub import HfApi

logger = logging.getLogger(__name__)


def push_checkpoint(api: HfApi, repo: str, step: int, folder: Path) -> None:
    """Upload ``folder`` (a complete checkpoint of ``step``) to ``repo``'s root as one commit.

    Blocking (uploads the whole model). Hidden files (``.cache`` ...) stay local.

    Raises:
        Exception: whatever ``huggingface_hub`` raises (HTTP, network); the caller logs it with
            :func:`hub_hint` and retries.
    """
    from huggingface_hub import CommitOperationAdd

    info = read_checkpoint_info(folder)
    files = sorted(
        path
        for path in folder.rglob("*")
        if path.is_file() and not path.relative_to(folder).as_posix().startswith(".")
    )
    operations = [
        CommitOperationAdd(path.relative_to(folder).as_posix(), str(path)) for path in files
    ]
    started = time.monotonic()
    total = sum(path.stat().st_size for path in files)
    # One file at a time, so the bar moves as the large weights upload (LFS/Xet on the Hub).
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"pushing step {step}") as bar:
        for operation, path in zip(operations, files, strict=True):
            api.preupload_lfs_files(repo, additions=[operation], repo_type="model")
            bar.update(path.stat().st_size)
    commit = api.create_commit(
        repo,
        operations=operations,
        commit_message=commit_title(step, info.get("loss")),
        commit_description=f"run config hash: {info.get('config_hash') or 'not recorded'}",
        repo_type="model",
    )
    logger.info(
        "pushed step %d to %s in %.1f s (%s)",
        step,
        repo,
        time.monotonic() - started,
        getattr(commit, "commit_url", ""),
    )


def download_checkpoint(
    repo: str, folder: Path, *, token: str | None, endpoint: str | None
) -> bool:
    """Download the head of ``repo`` (its newest checkpoint) into the empty ``folder``.

    Returns:
        True when ``folder`` now holds a checkpoint; False for a fresh run: the repo does not
        exist (or the token may not see it: logged with a hint), or it holds no checkpoint yet.

    Raises:
        CheckpointRestoreFailed: the Hub could not be reached or refused the token.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        snapshot_download(
            repo,
            repo_type="model",
            local_dir=folder,
            token=token,
            endpoint=endpoint,
        )
    except RepositoryNotFoundError:
        logger.warning(
            "Hub repo %s does not exist (or this token may not see it): starting a fresh "
            "run - help: if the run has checkpoints there, pass a token that can read it",
            repo,
        )
        return False
    except Exception as exc:
        raise CheckpointRestoreFailed(
            f"could not download the newest checkpoint from {repo}: {short_error(exc)} - "
            f"help: {hub_hint(exc)}; or set checkpoint.hub_repo to null to start "
            "from scratch"
        ) from exc
    shutil.rmtree(folder / ".cache", ignore_errors=True)
    (folder / ".gitattributes").unlink(missing_ok=True)
    if not (folder / CHECKPOINT_INFO_FILE).exists():
        logger.info("Hub repo %s holds no checkpoint yet: starting a fresh run", repo)
        return False
    return True


def short_error(exc: BaseException) -> str:
    """``"<class name>: <first line>"`` of an exception (Hub errors carry pages of detail)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def hub_hint(exc: BaseException) -> str:
    """What the organizer should do about a failed Hub call, from its HTTP status."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status == 401:
        return "the Hub does not know this token; pass a valid one (hf.co/settings/tokens)"
    if status == 403:
        return (
            "this token may not write to checkpoint.hub_repo; use a token with the 'write' role "
            "that belongs to the repo's owner or to a member of its organization"
        )
    if status == 429:
        return "the Hub rate-limits you; raise checkpoint.push_every_minutes"
    return "check the network and HF_ENDPOINT; the Hub may be down"

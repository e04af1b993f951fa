"""Checkpoints to evaluate: where they live, how a series of them is laid out, how they load.

Holds :class:`Checkpoint` (a local ``save_pretrained`` folder, or a Hub repo at a revision),
series discovery (the format: ``kit.training.checkpoint_format``), tokenizer/model loading with a
vocabulary check, and the device choice. It does not train or score anything.

On the Hub, a series is the repo's commit history: every commit whose title reads like
``"Step 120, loss 3.21"`` (what the sahajBERT coordinator committed, recipes §3.6) is one
checkpoint at that revision. Other commits (README edits, "initial commit") are skipped.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kit.errors import CheckpointError, VocabularyMismatch
from kit.training.checkpoint_format import (
    CHECKPOINT_INFO_FILE,
    parse_commit_title,
    read_checkpoint_info,
)

logger = logging.getLogger(__name__)

# Weights, config and tokenizer files; never optimizer_state.pt (as large as the model, unused).
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt"]
# Older Hub models (IndicBERT, bnRoBERTa) ship only this; transformers loads it weights-only.
_HUB_LEGACY_WEIGHTS = ["pytorch_model*.bin"]
# Models pad their embedding table to a multiple of at most 128 rows (Megatron); a larger surplus
# means the tokenizer belongs to another model.
_VOCAB_PADDING = 128


@dataclass(frozen=True)
class Checkpoint:
    """One model to evaluate: a local ``save_pretrained`` folder or a Hub repo at a revision.

    Example:
        >>> Checkpoint("neuropark/sahajBERT", revision="main", name="sahajBERT")
    """

    source: str  # local folder, or Hub repo id such as "neuropark/sahajBERT"
    revision: str | None = None  # Hub commit oid, branch or tag (None = main); unused for folders
    tokenizer: str | None = None  # tokenizer folder or repo when it is not saved with the model
    name: str | None = None  # label in tables and plots; default: folder or repo name
    step: int | None = None  # global optimizer step, for checkpoints of a series
    loss: float | None = None  # the swarm's training loss at that step, if recorded
    info: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the rest of the record

    @property
    def is_local(self) -> bool:
        """True when :attr:`source` is an existing folder on this machine."""
        return Path(self.source).expanduser().is_dir()

    @property
    def label(self) -> str:
        """The name shown in tables and plots."""
        if self.name:
            return self.name
        if self.is_local:
            return Path(self.source).expanduser().resolve().name
        short = self.source.rsplit("/", 1)[-1]
        return f"{short}@{self.revision[:8]}" if self.revision else short


def as_checkpoint(value: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """A :class:`Checkpoint` from a folder, a repo id, or ``"repo@revision"``."""
    if isinstance(value, Checkpoint):
        return value
    text = os.fspath(value)
    if "@" in text and not Path(text).expanduser().exists():
        repo, revision = text.rsplit("@", 1)
        return Checkpoint(repo, revision=revision or None)
    return Checkpoint(text)


def list_checkpoints(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    tokenizer: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
) -> list[Checkpoint]:
    """Every checkpoint of a series, sorted by step.

    Args:
        source: the coordinator's local checkpoint folder (subfolders with
            ``kit_checkpoint.json``), or a Hub repo id whose commits are checkpoints.
        revision: branch whose history to list (Hub only; default main).
        tokenizer: tokenizer folder/repo for every checkpoint (default: each one's own files).
        token: Hub token for private repos (default: the logged-in user's).
        endpoint: Hub URL (default: ``HF_ENDPOINT`` read now, else huggingface.co).

    Raises:
        CheckpointError: no checkpoint found, a record is malformed, or the Hub refused.
    """
    root = Path(source).expanduser()
    if root.is_dir():
        return _list_local(root, tokenizer)
    return _list_hub(os.fspath(source), revision, tokenizer, token, endpoint)


def _list_local(root: Path, tokenizer: str | None) -> list[Checkpoint]:
    folders = [root] if (root / CHECKPOINT_INFO_FILE).exists() else sorted(root.iterdir())
    found: list[Checkpoint] = []
    for folder in folders:
        if not (folder / CHECKPOINT_INFO_FILE).exists():
            if folder.is_dir() and (folder / "config.json").exists():
                logger.warning("skipping %s: it has no %s", folder, CHECKPOINT_INFO_FILE)
            continue
        record = read_checkpoint_info(folder)
        loss = record["loss"]
        found.append(
            Checkpoint(
                os.fspath(folder),
                tokenizer=tokenizer,
                name=folder.name,
                step=record["step"],
                loss=None if loss is None else float(loss),
                info=record,
            )
        )
    if not found:
        raise CheckpointError(
            f"no checkpoint in {root}: no subfolder holds a {CHECKPOINT_INFO_FILE} - help: point "
            "at the coordinator's checkpoint folder (its subfolders are step_000123/...)"
        )
    return sorted(found, key=lambda c: c.step or 0)


def _list_hub(
    repo: str, revision: str | None, tokenizer: str | None, token: str | None, endpoint: str | None
) -> list[Checkpoint]:
    from huggingface_hub import HfApi

    try:
        commits = HfApi(endpoint=resolve_endpoint(endpoint), token=token).list_repo_commits(
            repo, revision=revision
        )
    except hub_errors() as exc:
        raise CheckpointError(
            f"{repo!r} is neither a local folder nor a Hub repo whose history could be read "
            f"({type(exc).__name__}: {exc}) - help: check the path or repo id, HF_ENDPOINT, "
            "and your token for private repos"
        ) from exc
    by_step: dict[int, Checkpoint] = {}
    for commit in commits:  # newest first: a re-upload of a step replaces the older one
        step, loss = parse_commit_title(commit.title or "")
        if step is None or step in by_step:
            continue
        by_step[step] = Checkpoint(
            repo,
            revision=commit.commit_id,
            tokenizer=tokenizer,
            name=f"step {step}",
            step=step,
            loss=loss,
            info={"title": commit.title, "oid": commit.commit_id},
        )
    if not by_step:
        raise CheckpointError(
            f"no commit of {repo!r} has a title like 'Step 120, loss 3.21' - help: evaluate "
            "single revisions with Checkpoint(repo, revision=...) instead"
        )
    return [by_step[step] for step in sorted(by_step)]


# --- loading --------------------------------------------------------------------------------------


def hub_errors() -> tuple[type[BaseException], ...]:
    """Exceptions huggingface_hub raises for unreachable, missing or refused repos."""
    from huggingface_hub import errors

    return (OSError, ValueError, getattr(errors, "HTTPError", OSError))


def resolve_endpoint(endpoint: str | None = None) -> str | None:
    """The Hub URL to use: the argument, else ``HF_ENDPOINT`` as set *now* (not at import)."""
    return endpoint or os.environ.get("HF_ENDPOINT") or None


def local_folder(
    ref: str,
    revision: str | None = None,
    *,
    token: str | None = None,
    endpoint: str | None = None,
) -> Path:
    """A local folder holding ``ref``: the folder itself, or a Hub snapshot at ``revision``.

    Hub files are fetched with ``snapshot_download`` (cached, so re-use is free), passing the
    endpoint explicitly so that ``HF_ENDPOINT`` set after import is honoured. Safetensors are
    preferred; ``pytorch_model.bin`` is fetched only for repos that have nothing else.

    Raises:
        CheckpointError: not a folder, and the Hub has no such repo/revision or is unreachable.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    where = resolve_endpoint(endpoint)
    try:
        folder = Path(
            snapshot_download(
                ref, revision=revision, token=token, endpoint=where, allow_patterns=_HUB_FILES
            )
        )
        if not any(folder.glob("*.safetensors")) and (folder / "config.json").exists():
            logger.info("%s has no safetensors weights; fetching pytorch_model.bin", ref)
            folder = Path(
                snapshot_download(
                    ref,
                    revision=revision,
                    token=token,
                    endpoint=where,
                    allow_patterns=_HUB_LEGACY_WEIGHTS + _HUB_FILES,
                )
            )
    except hub_errors() as exc:
        raise CheckpointError(
            f"{ref!r} is not a local folder, and fetching it from the Hub (revision "
            f"{revision or 'main'}) failed: {type(exc).__name__}: {exc} - help: check the path "
            "or repo id, the revision, HF_ENDPOINT and your token"
        ) from exc
    return folder


def model_folder(
    checkpoint: Checkpoint, *, token: str | None = None, endpoint: str | None = None
) -> Path:
    """The local folder of a checkpoint's model files, checked to hold a ``config.json``.

    Raises:
        CheckpointError: not found (see :func:`local_folder`), or no ``config.json`` there.
    """
    folder = local_folder(checkpoint.source, checkpoint.revision, token=token, endpoint=endpoint)
    if not (folder / "config.json").is_file():
        series = (
            " (it looks like a series: use evaluate_series)"
            if any(folder.glob(f"*/{CHECKPOINT_INFO_FILE}"))
            else ""
        )
        raise CheckpointError(
            f"{checkpoint.source} holds no config.json, so it is not a saved model{series} - "
            "help: point at a folder written by model.save_pretrained(folder)"
        )
    return folder


def model_vocab_size(folder: Path, checkpoint: Checkpoint) -> int | None:
    """``vocab_size`` from the checkpoint's ``config.json`` (None if the config has none).

    Raises:
        CheckpointError: the config cannot be read or names an unknown model type.
    """
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(os.fspath(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"cannot read the config of {checkpoint.label} in {folder} ({type(exc).__name__}: "
            f"{exc}) - help: the folder needs the config.json written by save_pretrained"
        ) from exc
    vocab = getattr(config, "vocab_size", None)
    return int(vocab) if vocab is not None else None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' per-load report and weight bars for one load, then restore them.

    Loading a pretraining checkpoint into a classification model always reports the new head and
    the unused MLM head; with 3 seeds x 2 tasks that buries the notebook. We log one line instead.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_tokenizer(
    checkpoint: Checkpoint, *, token: str | None = None, endpoint: str | None = None
) -> Any:
    """The checkpoint's tokenizer (its own files, or :attr:`Checkpoint.tokenizer`).

    Raises:
        CheckpointError: no tokenizer files there.
    """
    from transformers import AutoTokenizer

    if checkpoint.tokenizer:
        folder = local_folder(checkpoint.tokenizer, token=token, endpoint=endpoint)
    else:
        folder = local_folder(
            checkpoint.source, checkpoint.revision, token=token, endpoint=endpoint
        )
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(os.fspath(folder))
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"no usable tokenizer in {folder} ({type(exc).__name__}: {exc}) - help: save it "
            "next to the model with tokenizer.save_pretrained(folder), or pass tokenizer=..."
        ) from exc


def check_vocabulary(checkpoint: Checkpoint, model_vocab: int, tokenizer_vocab: int) -> None:
    """Raise :class:`VocabularyMismatch` unless the tokenizer fits the embedding table.

    A tokenizer larger than the table would index past it. A tokenizer from elsewhere
    (``checkpoint.tokenizer``) with a table more than ``_VOCAB_PADDING`` rows larger is another
    model's. A tokenizer saved with the checkpoint (as kit's coordinator saves it) is the
    model's own, whatever the surplus: a run's ``model.vocab_size`` may exceed what its
    tokenizer learned from a small corpus (the demo: 8,000 rows, ~1,900 pieces).
    """
    surplus = model_vocab - tokenizer_vocab
    foreign = checkpoint.tokenizer is not None
    if surplus < 0 or (foreign and surplus >= _VOCAB_PADDING):
        raise VocabularyMismatch(checkpoint.label, model_vocab, tokenizer_vocab)
    if surplus:
        logger.debug(
            "%s: %d embeddings for %d tokens (padded table)",
            checkpoint.label,
            model_vocab,
            tokenizer_vocab,
        )


def load_pretrained(auto_class: Any, folder: Path, checkpoint: Checkpoint, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained(folder, **kwargs)`` with a short log instead of the report.

    Raises:
        CheckpointError: the folder is not a loadable ``save_pretrained`` checkpoint.
    """
    try:
        with quiet_transformers():
            model, info = auto_class.from_pretrained(
                os.fspath(folder), output_loading_info=True, **kwargs
            )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(
            f"cannot load {checkpoint.label} from {folder} as {auto_class.__name__} "
            f"({type(exc).__name__}: {exc}) - help: the folder needs config.json and "
            "model.safetensors written by model.save_pretrained(folder)"
        ) from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        logger.debug("%s: newly initialized %s", checkpoint.label, ", ".join(missing))
    return model, missing


def resolve_device(preference: str = "auto") -> Any:
    """The torch device to use: CUDA if present, else Apple MPS, else CPU (or ``preference``)."""
    import torch

    if preference != "auto":
        return torch.device(preference)
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")

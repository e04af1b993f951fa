"""Fine-tuning a checkpoint on one downstream task, once per seed: a plain torch loop.

Holds :class:`FinetuneConfig` (frozen, validated), :class:`RunResult`, and :func:`finetune`,
which tokenizes a task's data once and then, per seed, loads a fresh model with a new head,
trains it with AdamW and a linear warmup/decay schedule, keeps the epoch that scores best on the
validation split, and scores that one on the test split. It does not build tables or plots.

Why a plain loop and not ``transformers.Trainer``: the loop is 60 lines, runs offline without
``accelerate`` surprises, and is fast on the tiny models the tests use. It keeps the recipe of
sahajBERT's ``train_ner.py`` / ``train_ncc.py`` (recipes §5.3): evaluate every epoch, keep the
best epoch, stop early after ``patience`` epochs without gain. Unlike those scripts it selects
on the task metric rather than on the validation loss, since the metric is what gets reported.
The hyperparameters behind the paper's numbers were never published (recipes §5.3), so the
defaults below are common BERT fine-tuning values, not the paper's.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from kit.errors import ConfigError
from kit.evaluation.checkpoints import (
    Checkpoint,
    check_vocabulary,
    load_pretrained,
    load_tokenizer,
    model_folder,
    model_vocab_size,
    resolve_device,
)
from kit.evaluation.metrics import accuracy, entity_scores, word_tags
from kit.evaluation.tasks import TOKEN_CLASSIFICATION, TaskData, collate, encode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneConfig:
    """Hyperparameters of one fine-tuning run (the same for every seed, model and task)."""

    learning_rate: float = 3e-5  # peak AdamW LR; lower it (1e-5) if large models diverge or score 0
    weight_decay: float = 0.01  # AdamW decay on weights (not biases or norms), as in BERT
    warmup_ratio: float = 0.1  # share of steps with linear warmup; raise it if early loss spikes
    num_epochs: int = (
        20  # passes over the training split (recipes §5.3); early stopping ends sooner
    )
    patience: int | None = 3  # stop after this many epochs without validation gain; None = never
    batch_size: int = 32  # examples per optimizer step; lower it if the GPU runs out of memory
    eval_batch_size: int = 64  # examples per forward pass when scoring
    max_length: int = 128  # tokens per example (recipes §5.3); raise it if words go unscored
    max_grad_norm: float = 1.0  # gradient clipping norm; lower it if the training loss spikes
    select_split: str | None = "validation"  # split that picks the best epoch; None = last epoch
    eval_split: str = "test"  # split the reported number comes from
    max_train_examples: int | None = None  # use only the first N training examples (quick looks)
    max_eval_examples: int | None = None  # use only the first N validation/test examples
    device: str = "auto"  # "auto" = CUDA, else MPS, else CPU; or e.g. "cpu", "cuda:1"

    def __post_init__(self) -> None:
        positive = {
            "learning_rate": self.learning_rate,
            "num_epochs": self.num_epochs,
            "batch_size": self.batch_size,
            "eval_batch_size": self.eval_batch_size,
            "max_length": self.max_length,
            "max_grad_norm": self.max_grad_norm,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(
                    f"FinetuneConfig.{name} must be > 0, got {value!r} - help: "
                    f"use the default {getattr(FinetuneConfig, name)!r}"
                )
        if not 0.0 <= self.warmup_ratio < 1.0 or self.weight_decay < 0:
            raise ConfigError(
                "FinetuneConfig.warmup_ratio must be in [0, 1) and weight_decay "
                ">= 0 - help: use the defaults 0.1 and 0.01"
            )
        for name in ("patience", "max_train_examples", "max_eval_examples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(
                    f"FinetuneConfig.{name} must be None or >= 1, got {value!r} - "
                    "help: use None to turn it off"
                )


@dataclass(frozen=True)
class RunResult:
    """One fine-tuning run: one model, one task, one seed."""

    model: str  # checkpoint label
    task: str  # task key ("ner", "ncc")
    seed: int  # the seed of this run (head init, data order, dropout)
    metric: str  # name of the reported metric ("f1", "accuracy")
    value: float  # the reported metric on the eval split, in [0, 1]
    scores: dict[str, float] = field(default_factory=dict)  # every metric on the eval split
    best_epoch: int = 0  # epoch (1-based) whose weights were scored
    epochs_run: int = 0  # epochs trained before stopping
    train_loss: float = float("nan")  # mean training loss of the last epoch
    seconds: float = 0.0  # wall time of the run


def set_seed(seed: int) -> None:
    """Seed Python and torch (CPU and every GPU) for one run."""
    random.seed(seed)
    torch.manual_seed(seed)


def finetune(
    checkpoint: Checkpoint,
    data: TaskData,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    config: FinetuneConfig | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    progress: bool = True,
) -> list[RunResult]:
    """Fine-tune ``checkpoint`` on ``data`` once per seed and score each run.

    Args:
        checkpoint: the model to start from (its MLM/SOP heads are dropped, a new head is added).
        data: the task's checked dataset, from ``load_task_data``.
        seeds: one run per seed.
        config: hyperparameters (default :class:`FinetuneConfig`).
        token: Hub token for private repos.
        endpoint: Hub URL (default ``HF_ENDPOINT``).
        progress: show tqdm bars.

    Returns:
        One :class:`RunResult` per seed, in order.

    Raises:
        CheckpointError / VocabularyMismatch: the checkpoint or its tokenizer is unusable.
        DatasetSchemaError: a split the config names is missing, or labels are out of range.
    """
    config = config or FinetuneConfig()
    spec = data.task
    folder = model_folder(checkpoint, token=token, endpoint=endpoint)
    tokenizer = load_tokenizer(checkpoint, token=token, endpoint=endpoint)
    vocab = model_vocab_size(folder, checkpoint)
    if vocab is not None:
        check_vocabulary(checkpoint, vocab, len(tokenizer))
    encoded = {
        "train": encode(
            data, "train", tokenizer, max_length=config.max_length, limit=config.max_train_examples
        ),
        "eval": encode(
            data,
            config.eval_split,
            tokenizer,
            max_length=config.max_length,
            limit=config.max_eval_examples,
        ),
    }
    if config.select_split is not None and config.select_split in data.splits:
        encoded["select"] = encode(
            data,
            config.select_split,
            tokenizer,
            max_length=config.max_length,
            limit=config.max_eval_examples,
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = resolve_device(config.device)
    results = []
    for seed in tqdm(list(seeds), desc=f"{checkpoint.label} {spec.name}", disable=not progress):
        run = _Run(checkpoint, data, folder, encoded, pad_id, config, device, seed, progress)
        results.append(run.execute())
    return results


class _Run:
    """One seed: load a fresh model, train with early stopping, score the best epoch."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        data: TaskData,
        folder: Any,
        encoded: dict[str, list[dict[str, Any]]],
        pad_id: int,
        config: FinetuneConfig,
        device: torch.device,
        seed: int,
        progress: bool,
    ) -> None:
        self.checkpoint, self.data, self.folder, self.encoded = checkpoint, data, folder, encoded
        self.pad_id, self.config, self.device, self.seed = pad_id, config, device, seed
        self.progress = progress

    def execute(self) -> RunResult:
        from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

        started = time.monotonic()
        spec, names, config = self.data.task, self.data.label_names, self.config
        set_seed(self.seed)  # before loading: the new head's init depends on it
        auto = (
            AutoModelForTokenClassification
            if spec.kind == TOKEN_CLASSIFICATION
            else AutoModelForSequenceClassification
        )
        model, _ = load_pretrained(
            auto,
            self.folder,
            self.checkpoint,
            num_labels=len(names),
            id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)},
        )
        model.to(self.device)
        train = self.encoded["train"]
        steps_per_epoch = math.ceil(len(train) / config.batch_size)
        optimizer, scheduler = _optimizer(model, config, steps_per_epoch * config.num_epochs)
        order = torch.Generator().manual_seed(self.seed)
        best_score, best_epoch, best_state, stale = -1.0, 0, None, 0
        epoch, train_loss = 0, float("nan")
        for epoch in range(1, config.num_epochs + 1):
            train_loss = self._train_epoch(model, optimizer, scheduler, order, epoch)
            if "select" not in self.encoded:
                continue
            score = self._score(model, "select")[spec.metric]
            logger.debug(
                "%s %s seed %d epoch %d: %s %.4f",
                self.checkpoint.label,
                spec.name,
                self.seed,
                epoch,
                spec.metric,
                score,
            )
            if score > best_score:
                best_score, best_epoch, stale = score, epoch, 0
                best_state = {
                    k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
                }
            else:
                stale += 1
                if config.patience is not None and stale >= config.patience:
                    break
        if best_state is not None:
            model.load_state_dict(best_state)
        else:
            best_epoch = epoch
        scores = self._score(model, "eval")
        seconds = time.monotonic() - started
        logger.info(
            "%s %s seed %d: %s %.2f (epoch %d of %d, %.0f s)",
            self.checkpoint.label,
            spec.name,
            self.seed,
            spec.metric,
            100 * scores[spec.metric],
            best_epoch,
            epoch,
            seconds,
        )
        return RunResult(
            self.checkpoint.label,
            spec.name,
            self.seed,
            spec.metric,
            scores[spec.metric],
            scores,
            best_epoch,
            epoch,
            train_loss,
            seconds,
        )

    def _score(self, model: Any, split: str) -> dict[str, float]:
        examples = self.encoded[split]
        predictions = predict(
            model, examples, self.config.eval_batch_size, self.device, self.pad_id
        )
        return score_predictions(self.data, examples, predictions)

    def _train_epoch(
        self, model: Any, optimizer: Any, scheduler: Any, order: torch.Generator, epoch: int
    ) -> float:
        train, size = self.encoded["train"], self.config.batch_size
        permutation = torch.randperm(len(train), generator=order).tolist()
        model.train()
        total, batches = 0.0, 0
        starts = range(0, len(train), size)
        bar = tqdm(
            starts, desc=f"seed {self.seed} epoch {epoch}", leave=False, disable=not self.progress
        )
        for start in bar:
            batch = collate([train[i] for i in permutation[start : start + size]], self.pad_id)
            loss = model(**{k: v.to(self.device) for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total, batches = total + float(loss.detach()), batches + 1
            bar.set_postfix(loss=f"{total / batches:.3f}", refresh=False)
        return total / max(batches, 1)


def _optimizer(model: Any, config: FinetuneConfig, total_steps: int) -> tuple[Any, Any]:
    """AdamW without decay on biases and norms, linear warmup then linear decay to 0."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        lowered = name.lower()
        (no_decay if "bias" in lowered or "norm" in lowered else decay).append(parameter)
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.learning_rate,
    )
    warmup = int(config.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def predict(
    model: Any,
    examples: Sequence[dict[str, Any]],
    batch_size: int,
    device: torch.device,
    pad_id: int,
) -> list[Any]:
    """Argmax class per example (classification) or per token (NER, unpadded)."""
    model.eval()
    predictions: list[Any] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = collate(chunk, pad_id)
        batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        best = logits.argmax(dim=-1).cpu().tolist()
        if logits.dim() == 3:  # token classification: drop the padding
            best = [
                row[: len(example["input_ids"])] for row, example in zip(best, chunk, strict=True)
            ]
        predictions.extend(best)
    return predictions


def score_predictions(
    data: TaskData, examples: Sequence[dict[str, Any]], predictions: Sequence[Any]
) -> dict[str, float]:
    """The task's metrics for predictions on encoded examples (fractions in [0, 1])."""
    labels = [example["labels"] for example in examples]
    if data.task.kind == TOKEN_CLASSIFICATION:
        gold, predicted = word_tags(predictions, labels, data.label_names)
        return entity_scores(gold, predicted)
    return {"accuracy": accuracy(list(predictions), labels)}

"""The downstream tasks sahajBERT was judged on: their datasets, schema checks and tokenization.

Holds the two :class:`TaskSpec` s (recipes §5.1-5.2): named-entity recognition on WikiANN ``bn``
(seqeval F1) and news category classification on IndicGLUE ``sna.bn`` (accuracy); loading
through ``datasets.load_dataset`` for the real Hub datasets and for local json/parquet folders
alike; schema checks with errors that name what is missing; and tokenization into model inputs.
It does not train or score.

Labels follow ``run_ner.py`` as sahajBERT used it (recipes §5.3): only the first sub-token of a
word carries the word's label, later sub-tokens and special tokens get ``IGNORE_INDEX``. Words cut
off by ``max_length`` drop out of the score, as they did there; we log how many.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kit.errors import DatasetSchemaError, EvaluationError, UnknownTask
from kit.evaluation.metrics import IGNORE_INDEX

logger = logging.getLogger(__name__)

TOKEN_CLASSIFICATION = "token_classification"
SEQUENCE_CLASSIFICATION = "sequence_classification"


@dataclass(frozen=True)
class TaskSpec:
    """What one downstream task needs from a dataset and how it is scored."""

    name: str  # short key for APIs and the CLI: "ner", "ncc"
    kind: str  # TOKEN_CLASSIFICATION or SEQUENCE_CLASSIFICATION
    title: str  # column header in the results table, as in the paper: "NER F1"
    metric: str  # key of the reported metric: "f1" or "accuracy"
    dataset: tuple[str, str | None]  # default load_dataset(path, name) of the real data
    input_column: str  # words (list[str]) for NER, text (str) for classification
    label_column: str  # ClassLabel (list of ClassLabel for NER)
    label_names: tuple[str, ...]  # class names used when the files store plain ids


NER = TaskSpec(
    name="ner",
    kind=TOKEN_CLASSIFICATION,
    title="NER F1",
    metric="f1",
    dataset=("wikiann", "bn"),
    input_column="tokens",
    label_column="ner_tags",
    label_names=("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"),
)
NCC = TaskSpec(
    name="ncc",
    kind=SEQUENCE_CLASSIFICATION,
    title="NCC Acc",
    metric="accuracy",
    dataset=("indic_glue", "sna.bn"),
    input_column="text",
    label_column="label",
    label_names=("kolkata", "state", "national", "sports", "entertainment", "international"),
)
#: Every task by its key, in the paper's column order.
TASKS: Mapping[str, TaskSpec] = {NER.name: NER, NCC.name: NCC}
_ALIASES = {"wikiann": "ner", "wikiann-bn": "ner", "sna": "ncc", "sna.bn": "ncc", "news": "ncc"}


def get_task(task: str | TaskSpec) -> TaskSpec:
    """The :class:`TaskSpec` for a key (``"ner"``, ``"ncc"``) or an alias.

    Raises:
        UnknownTask: no such task.
    """
    if isinstance(task, TaskSpec):
        return task
    key = _ALIASES.get(str(task).strip().lower(), str(task).strip().lower())
    if key not in TASKS:
        raise UnknownTask(str(task), tuple(TASKS))
    return TASKS[key]


@dataclass(frozen=True)
class DatasetSource:
    """Where a task's data comes from; every field goes to ``datasets.load_dataset``.

    Example:
        >>> DatasetSource("wikiann", "bn")            # the real data on the Hub
        >>> DatasetSource("/data/wikiann_bn")         # a folder of train/validation/test files
    """

    path: str  # Hub dataset ("wikiann") or a local folder of {train,validation,test}.{parquet,json}
    name: str | None = None  # configuration of a Hub dataset ("bn", "sna.bn"); None for folders
    data_files: Mapping[str, str | Sequence[str]] | None = None  # explicit split -> files
    cache_dir: str | None = None  # datasets' Arrow cache; None = the HF default under ~/.cache


def as_source(task: TaskSpec, source: DatasetSource | str | None) -> DatasetSource:
    """``source`` as a :class:`DatasetSource`; None means the task's real dataset."""
    if source is None:
        return DatasetSource(*task.dataset)
    if isinstance(source, DatasetSource):
        return source
    return DatasetSource(str(source))


@dataclass(frozen=True)
class TaskData:
    """A task's dataset after its schema was checked."""

    task: TaskSpec  # which task the data is for
    splits: Mapping[str, Any]  # split name -> datasets.Dataset
    label_names: tuple[str, ...]  # class id -> name, from the dataset's ClassLabel
    source: DatasetSource  # where it was loaded from

    def split(self, name: str, limit: int | None = None) -> Any:
        """One split, cut to its first ``limit`` examples.

        Raises:
            DatasetSchemaError: the dataset has no such split.
        """
        if name not in self.splits:
            raise DatasetSchemaError(
                f"{self.task.name} dataset {self.source.path!r} has no {name!r} split (it has "
                f"{', '.join(self.splits)}) - help: add {name} files, or set FinetuneConfig "
                "eval_split / select_split to a split it has"
            )
        dataset = self.splits[name]
        return dataset.select(range(min(limit, len(dataset)))) if limit is not None else dataset


def load_task_data(task: str | TaskSpec, source: DatasetSource | str | None = None) -> TaskData:
    """Load a task's dataset with ``datasets.load_dataset`` and check its schema.

    Args:
        task: ``"ner"``, ``"ncc"`` or a :class:`TaskSpec`.
        source: where to load from; None loads the real dataset (needs Internet once).

    Raises:
        UnknownTask: unknown task name.
        DatasetSchemaError: a split lacks the task's columns, or labels are not class labels.
        EvaluationError: the dataset cannot be found or read.
    """
    import datasets

    spec = get_task(task)
    src = as_source(spec, source)
    try:
        loaded = datasets.load_dataset(
            src.path,
            src.name,
            data_files=dict(src.data_files) if src.data_files else None,
            cache_dir=src.cache_dir,
        )
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise EvaluationError(
            f"cannot load the {spec.name} dataset {src.path!r} (config {src.name!r}): "
            f"{type(exc).__name__}: {exc} - help: check the name, or pass a folder holding "
            "train/validation/test .parquet or .json files"
        ) from exc
    if not isinstance(loaded, datasets.DatasetDict):
        loaded = datasets.DatasetDict({"train": loaded})
    splits = {name: _checked_split(spec, src, name, split) for name, split in loaded.items()}
    names = _label_names(spec, next(iter(splits.values())))
    return TaskData(spec, splits, names, src)


def _checked_split(spec: TaskSpec, src: DatasetSource, split_name: str, split: Any) -> Any:
    import datasets

    needed = (spec.input_column, spec.label_column)
    missing = [column for column in needed if column not in split.column_names]
    if missing:
        raise DatasetSchemaError(
            f"the {spec.name} dataset {src.path!r} (split {split_name!r}) lacks column(s) "
            f"{', '.join(missing)}; it has {', '.join(split.column_names) or 'none'} - help: "
            f"{spec.name} needs {spec.input_column!r} and {spec.label_column!r} like "
            f"load_dataset{spec.dataset!r}; rename columns with dataset.rename_column(...)"
        )
    feature = split.features[spec.label_column]
    inner = _inner_feature(feature) if spec.kind == TOKEN_CLASSIFICATION else feature
    if inner is None:
        raise DatasetSchemaError(
            f"the {spec.name} column {spec.label_column!r} must hold one label per word, got "
            f"{feature} - help: store a list of tag ids (or tag names) per sentence"
        )
    if isinstance(inner, datasets.ClassLabel):
        return split
    label = datasets.ClassLabel(names=list(spec.label_names))
    target = datasets.Sequence(label) if spec.kind == TOKEN_CLASSIFICATION else label
    try:  # plain ids or tag names: give them the task's names (validated by datasets)
        return split.cast_column(spec.label_column, target)
    except (ValueError, TypeError) as exc:
        raise DatasetSchemaError(
            f"the {spec.name} labels in {spec.label_column!r} are neither class ids nor the names "
            f"{', '.join(spec.label_names)} ({exc}) - help: store them as a ClassLabel feature"
        ) from exc


def _inner_feature(feature: Any) -> Any:
    if isinstance(feature, list) and len(feature) == 1:  # older datasets' [ClassLabel(...)]
        return feature[0]
    return getattr(feature, "feature", None)


def _label_names(spec: TaskSpec, split: Any) -> tuple[str, ...]:
    feature = split.features[spec.label_column]
    names = tuple((_inner_feature(feature) if spec.kind == TOKEN_CLASSIFICATION else feature).names)
    if spec.kind == TOKEN_CLASSIFICATION:
        bad = [n for n in names if n != "O" and not n.startswith(("B-", "I-"))]
        if bad:
            raise DatasetSchemaError(
                f"NER tags must be IOB2 (O, B-X, I-X); found {', '.join(bad)} - help: use "
                "WikiANN's tags O, B-PER, I-PER, B-ORG, I-ORG, B-LOC, I-LOC"
            )
    return names


def align_labels(word_ids: Sequence[int | None], word_labels: Sequence[int]) -> list[int]:
    """Token-level labels: each word's first sub-token gets its label, the rest IGNORE_INDEX.

    Args:
        word_ids: per token, the index of its word (None for special tokens), as given by a fast
            tokenizer's ``encoding.word_ids()``.
        word_labels: the label id of each word.
    """
    labels: list[int] = []
    previous: int | None = None
    for word in word_ids:
        if word is None or word == previous:
            labels.append(IGNORE_INDEX)
        else:
            labels.append(word_labels[word])
        previous = word
    return labels


def encode(
    data: TaskData, split: str, tokenizer: Any, *, max_length: int, limit: int | None = None
) -> list[dict[str, Any]]:
    """Tokenize one split into model inputs with ``labels`` (per token for NER).

    Raises:
        DatasetSchemaError: a label id is out of range, or the split is missing.
        EvaluationError: NER with a slow tokenizer (word alignment needs a fast one).
    """
    dataset = data.split(split, limit)
    spec = data.task
    inputs = dataset[spec.input_column]
    labels = dataset[spec.label_column]
    n_classes = len(data.label_names)
    if spec.kind == TOKEN_CLASSIFICATION:
        if not getattr(tokenizer, "is_fast", False):
            raise EvaluationError(
                f"NER needs a fast tokenizer to align words and sub-tokens; got "
                f"{type(tokenizer).__name__} - help: save a tokenizer.json with the checkpoint"
            )
        batch = tokenizer(
            list(inputs), is_split_into_words=True, truncation=True, max_length=max_length
        )
    else:
        batch = tokenizer(list(inputs), truncation=True, max_length=max_length)
    examples: list[dict[str, Any]] = []
    dropped_words = 0
    for index, label in enumerate(labels):
        flat = label if spec.kind == TOKEN_CLASSIFICATION else [label]
        if any(not 0 <= value < n_classes for value in flat):
            raise DatasetSchemaError(
                f"{spec.name} split {split!r} example {index} has label {label!r} outside "
                f"0..{n_classes - 1} - help: labels must be ids of {', '.join(data.label_names)}"
            )
        example = {key: batch[key][index] for key in batch}
        if spec.kind == TOKEN_CLASSIFICATION:
            word_ids = batch.word_ids(index)
            example["labels"] = align_labels(word_ids, label)
            dropped_words += len(label) - len({w for w in word_ids if w is not None})
        else:
            example["labels"] = int(label)
        examples.append(example)
    if dropped_words:
        logger.warning(
            "%s/%s: %d words beyond max_length=%d are not scored",
            spec.name,
            split,
            dropped_words,
            max_length,
        )
    return examples


def collate(examples: Sequence[Mapping[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest example: ids with ``pad_token_id``, labels with IGNORE_INDEX."""
    longest = max(len(example["input_ids"]) for example in examples)
    batch: dict[str, torch.Tensor] = {}
    for key in examples[0]:
        if key == "labels" and not isinstance(examples[0][key], list):
            batch[key] = torch.tensor([example[key] for example in examples], dtype=torch.long)
            continue
        fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}.get(key, 0)
        rows = [list(example[key]) + [fill] * (longest - len(example[key])) for example in examples]
        batch[key] = torch.tensor(rows, dtype=torch.long)
    return batch

"""Scores: seqeval entity-level F1 for NER, accuracy for classification, mean ± std over seeds.

Pure functions on plain lists (no torch), so every number in the report can be checked by hand.
It does not run models: ``finetune.py`` turns model outputs into the id lists used here.

NER is scored the way sahajBERT's ``train_ner.py`` scored it (recipes §5.4): word-level tags
(the prediction at each word's first sub-token), entity-level micro-averaged seqeval with its
default, conlleval-style chunking. That chunking is lenient: an ``I-X`` that follows ``O`` or
another type starts a new ``X`` entity instead of being an error, and an entity counts only when
both its boundaries and its type match.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: Label id of positions that are not scored (special tokens, later sub-tokens, padding);
#: the value ``torch.nn.CrossEntropyLoss`` ignores by default.
IGNORE_INDEX = -100


def entity_scores(
    gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Entity-level micro precision, recall and F1 (seqeval defaults) plus token accuracy.

    Args:
        gold: per sentence, the gold IOB2 tag of each word.
        predicted: per sentence, the predicted tag of each word (same lengths as ``gold``).

    Returns:
        ``{"precision", "recall", "f1", "accuracy"}``, each in [0, 1]. With no entity predicted
        (or none in the gold), the undefined ratios are 0, as in conlleval.
    """
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    if len(gold) != len(predicted) or any(
        len(g) != len(p) for g, p in zip(gold, predicted, strict=True)
    ):
        raise ValueError("gold and predicted tags must have the same shape")
    gold_lists = [list(sentence) for sentence in gold]
    predicted_lists = [list(sentence) for sentence in predicted]
    if not any(gold_lists):
        return {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 0.0}
    return {
        "precision": float(precision_score(gold_lists, predicted_lists, zero_division=0)),
        "recall": float(recall_score(gold_lists, predicted_lists, zero_division=0)),
        "f1": float(f1_score(gold_lists, predicted_lists, zero_division=0)),
        "accuracy": float(accuracy_score(gold_lists, predicted_lists)),
    }


def word_tags(
    predicted_ids: Sequence[Sequence[int]],
    label_ids: Sequence[Sequence[int]],
    names: Sequence[str],
) -> tuple[list[list[str]], list[list[str]]]:
    """Word-level (gold, predicted) tags from token-level ids.

    Only positions whose label is not :data:`IGNORE_INDEX` are words (their first sub-token);
    the prediction there is the word's prediction.

    Args:
        predicted_ids: per sentence, the argmax class id at every token position.
        label_ids: per sentence, the aligned label ids (IGNORE_INDEX where not scored).
        names: class id -> tag, e.g. ``("O", "B-PER", ...)``.
    """
    gold: list[list[str]] = []
    predicted: list[list[str]] = []
    for sentence_predictions, sentence_labels in zip(predicted_ids, label_ids, strict=True):
        gold.append([])
        predicted.append([])
        for prediction, label in zip(sentence_predictions, sentence_labels, strict=True):
            if label == IGNORE_INDEX:
                continue
            gold[-1].append(names[label])
            predicted[-1].append(names[prediction])
    return gold, predicted


def accuracy(predicted: Sequence[int], gold: Sequence[int]) -> float:
    """Share of examples whose predicted class is the gold one (0.0 for no examples)."""
    if len(predicted) != len(gold):
        raise ValueError("predicted and gold must have the same length")
    if not gold:
        return 0.0
    return sum(int(p == g) for p, g in zip(predicted, gold, strict=True)) / len(gold)


@dataclass(frozen=True)
class MeanStd:
    """Mean and sample standard deviation of one metric over ``n`` seeds (fractions, not %)."""

    mean: float  # average over the runs
    std: float  # sample standard deviation (n - 1 in the denominator); 0.0 when n == 1
    n: int  # number of runs

    def format(self, scale: float = 100.0, digits: int = 2) -> str:
        """Like the paper's table: ``"95.45 ± 0.53"`` (percent); just the mean when n == 1."""
        if self.n == 0 or math.isnan(self.mean):
            return "—"
        mean = f"{self.mean * scale:.{digits}f}"
        return mean if self.n == 1 else f"{mean} ± {self.std * scale:.{digits}f}"


def mean_std(values: Sequence[float]) -> MeanStd:
    """The :class:`MeanStd` of per-seed values.

    The sample standard deviation is used because three fine-tuning runs are a sample of the
    run-to-run spread, not the whole population; the paper does not say which it used.
    """
    if not values:
        return MeanStd(float("nan"), float("nan"), 0)
    if len(values) == 1:
        return MeanStd(float(values[0]), 0.0, 1)
    return MeanStd(float(statistics.fmean(values)), float(statistics.stdev(values)), len(values))

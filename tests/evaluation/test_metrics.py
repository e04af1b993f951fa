"""Scores: seqeval entity F1 on hand-checked cases, word-level decoding, mean ± std formatting.

Every expected number below is worked out by hand in the comments (conlleval chunking: an I-X
after O or after another type opens a new X entity), never computed with seqeval.
"""

from __future__ import annotations

import warnings

import pytest

from kit.evaluation.metrics import (
    IGNORE_INDEX,
    MeanStd,
    accuracy,
    entity_scores,
    mean_std,
    word_tags,
)

CASES = {
    # name: (gold, predicted, (precision, recall, f1))
    "exact": (
        [["B-PER", "I-PER", "O", "B-LOC"]],
        [["B-PER", "I-PER", "O", "B-LOC"]],
        (1.0, 1.0, 1.0),  # 2 of 2 predicted right, 2 of 2 gold found
    ),
    "partial entity": (
        [["B-PER", "I-PER", "O", "B-LOC"]],
        [["B-PER", "O", "O", "B-LOC"]],
        (0.5, 0.5, 0.5),  # PER(0..0) is not PER(0..1); only LOC(3) matches: 1/2, 1/2
    ),
    "entity too long": (
        [["B-ORG", "O", "O"]],
        [["B-ORG", "I-ORG", "O"]],
        (0.0, 0.0, 0.0),  # ORG(0..1) is not ORG(0..0)
    ),
    "wrong type": (
        [["B-ORG", "I-ORG", "O", "B-LOC", "O", "B-PER"]],
        [["B-LOC", "I-LOC", "O", "B-LOC", "O", "O"]],
        (0.5, 1 / 3, 0.4),  # right: LOC(3) only; P 1/2, R 1/3, F1 2*(1/6)/(5/6) = 0.4
    ),
    "I- without B- opens an entity": (
        [["O", "B-PER", "I-PER", "O"]],
        [["O", "I-PER", "I-PER", "O"]],
        (1.0, 1.0, 1.0),  # I-PER after O starts PER(1..2), which is the gold entity
    ),
    "type switch inside an entity splits it": (
        [["B-PER", "I-PER", "O"]],
        [["B-PER", "I-LOC", "O"]],
        (0.0, 0.0, 0.0),  # predicted PER(0..0) and LOC(1..1); gold PER(0..1): none right
    ),
    "micro average over sentences": (
        [["B-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "O"]],
        [["B-PER", "O", "B-LOC"], ["B-ORG", "O", "B-PER"]],
        (0.5, 2 / 3, 4 / 7),  # right 2 (PER, LOC) of 4 predicted, of 3 gold; F1 (2/3)/(7/6)
    ),
    "no entity predicted": (
        [["B-PER", "O"]],
        [["O", "O"]],
        (0.0, 0.0, 0.0),  # nothing predicted: precision undefined, reported 0 as conlleval
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_entity_scores_match_hand_computed_values(name: str) -> None:
    gold, predicted, (precision, recall, f1) = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "undefined metric" warnings leak to notebooks
        scores = entity_scores(gold, predicted)
    assert scores["precision"] == pytest.approx(precision)
    assert scores["recall"] == pytest.approx(recall)
    assert scores["f1"] == pytest.approx(f1)


def test_token_accuracy_is_reported_too() -> None:
    gold, predicted, _ = CASES["wrong type"]
    # 6 words; tags equal at positions 2, 3, 4 -> 3/6
    assert entity_scores(gold, predicted)["accuracy"] == pytest.approx(0.5)


def test_entity_scores_rejects_ragged_input() -> None:
    with pytest.raises(ValueError):
        entity_scores([["O", "O"]], [["O"]])


def test_word_tags_use_the_first_sub_token_of_each_word() -> None:
    names = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
    # [CLS] w0a w0b w1a [SEP] [PAD]: labels only on w0a and w1a
    labels = [[IGNORE_INDEX, 1, IGNORE_INDEX, 2, IGNORE_INDEX, IGNORE_INDEX]]
    predicted = [[3, 1, 4, 0, 3, 3]]  # w0b says I-LOC and specials say B-LOC: both ignored
    gold_tags, predicted_tags = word_tags(predicted, labels, names)
    assert gold_tags == [["B-PER", "I-PER"]]
    assert predicted_tags == [["B-PER", "O"]]


def test_accuracy() -> None:
    assert accuracy([1, 2, 3, 0], [1, 2, 0, 0]) == pytest.approx(0.75)
    assert accuracy([], []) == 0.0
    with pytest.raises(ValueError):
        accuracy([1], [1, 2])


def test_mean_std_uses_the_sample_standard_deviation() -> None:
    # mean 0.95; deviations 0, +0.01, -0.01 -> sum of squares 2e-4 / (3 - 1) -> std 0.01
    summary = mean_std([0.95, 0.96, 0.94])
    assert summary.n == 3
    assert summary.mean == pytest.approx(0.95)
    assert summary.std == pytest.approx(0.01)
    assert summary.format() == "95.00 ± 1.00"


def test_format_like_the_paper() -> None:
    assert MeanStd(0.9545, 0.0053, 3).format() == "95.45 ± 0.53"
    assert MeanStd(0.7446, 0.0191, 3).format() == "74.46 ± 1.91"
    assert mean_std([0.9]).format() == "90.00"  # one run: no spread to show
    assert mean_std([]).format() == "—"

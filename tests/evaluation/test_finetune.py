"""The fine-tuning loop: it learns the synthetic tasks, is seeded, and validates its config."""

from __future__ import annotations

import math

import pytest

from kit.errors import ConfigError, DatasetSchemaError
from kit.evaluation.checkpoints import Checkpoint
from kit.evaluation.finetune import FinetuneConfig, finetune
from kit.evaluation.tasks import DatasetSource, load_task_data
from tests.evaluation.conftest import TinyWorld

FAST = FinetuneConfig(
    learning_rate=1e-2, num_epochs=8, batch_size=8, warmup_ratio=0.0, patience=None, device="cpu"
)


@pytest.mark.parametrize(
    "bad",
    [
        {"learning_rate": 0.0},
        {"num_epochs": 0},
        {"batch_size": -1},
        {"warmup_ratio": 1.0},
        {"weight_decay": -0.1},
        {"patience": 0},
        {"max_train_examples": 0},
    ],
)
def test_config_is_validated(bad: dict) -> None:
    with pytest.raises(ConfigError, match="help:"):
        FinetuneConfig(**bad)


def test_ner_learns_and_seeds_are_reproducible(world: TinyWorld) -> None:
    data = load_task_data("ner", DatasetSource(str(world.ner), cache_dir=world.cache))
    checkpoint = Checkpoint(str(world.checkpoint), name="tiny")
    first, second, again = finetune(checkpoint, data, seeds=(0, 1, 0), config=FAST, progress=False)
    assert (first.model, first.task, first.metric, first.seed) == ("tiny", "ner", "f1", 0)
    # each entity word carries one tag: a working loop gets most entities right; an
    # untrained head (a broken loop) scores near 0
    assert first.value > 0.6 and second.value > 0.6
    assert again.value == first.value and again.train_loss == first.train_loss
    assert second.train_loss != first.train_loss  # another seed, another run
    assert set(first.scores) == {"precision", "recall", "f1", "accuracy"}
    assert 1 <= first.best_epoch <= first.epochs_run == FAST.num_epochs


def test_ncc_training_loss_falls_below_chance(world: TinyWorld) -> None:
    data = load_task_data("ncc", DatasetSource(str(world.ncc), cache_dir=world.cache))
    (run,) = finetune(
        Checkpoint(str(world.checkpoint)), data, seeds=(0,), config=FAST, progress=False
    )
    assert run.metric == "accuracy" and 0.0 <= run.value <= 1.0
    assert run.train_loss < 0.8 * math.log(6)  # cross-entropy of guessing among 6 classes


def test_early_stopping_and_missing_eval_split(world: TinyWorld) -> None:
    data = load_task_data("ner", DatasetSource(str(world.ner), cache_dir=world.cache))
    config = FinetuneConfig(
        learning_rate=1e-9, num_epochs=6, patience=1, batch_size=16, device="cpu"
    )
    (run,) = finetune(
        Checkpoint(str(world.checkpoint)), data, seeds=(0,), config=config, progress=False
    )
    assert run.epochs_run < 6  # a learning rate this small makes no progress: stop early
    with pytest.raises(DatasetSchemaError, match="no 'dev' split"):
        finetune(
            Checkpoint(str(world.checkpoint)),
            data,
            seeds=(0,),
            config=FinetuneConfig(eval_split="dev"),
            progress=False,
        )

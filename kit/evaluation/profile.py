"""The CPU quick profile: an evaluation that a CPU (Binder) finishes in minutes, and what it skips.

The paper's protocol wants a GPU: every training example (WikiANN-bn 10,000, sna.bn 11,284), up
to 20 epochs, 3 seeds, next to four baselines; on Binder's two cores it runs for days. On a CPU,
:func:`kit.evaluation.plan.plan_evaluation` fills what the notebook left open with
:data:`CPU_QUICK`: the first 2,000 training and 1,000 validation/test examples of each task, 3
epochs, one seed, the run's first and newest checkpoints, no baselines (the demo's checkpoints:
about 2 minutes on two cores). The results table then carries the profile's column,
``(CPU quick profile: 2,000 train, 1,000 test, 1 seed)``, and the plan's text says what was
left out. Pure: split sizes and settings in, numbers and words out; nothing is loaded or timed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kit.evaluation.finetune import FinetuneConfig
from kit.evaluation.tasks import get_task

#: Epochs of the paper's recipe (``FinetuneConfig``'s default; early stopping usually ends sooner).
PAPER_EPOCHS = FinetuneConfig.num_epochs


@dataclass(frozen=True)
class QuickProfile:
    """What a CPU fine-tunes by default: a fixed subset of each task, few epochs, one seed."""

    train_examples: int = 2_000  # the first N training examples of each task
    eval_examples: int = 1_000  # the first N validation and test examples of each task
    num_epochs: int = 3  # passes over the subset; the best one on the validation subset is scored
    seeds: int = 1  # fine-tuning runs per model and task

    def finetune_settings(self) -> dict[str, int]:
        """The profile's ``FinetuneConfig`` fields (the notebook's ``FINETUNE`` overrides them)."""
        return {
            "max_train_examples": self.train_examples,
            "max_eval_examples": self.eval_examples,
            "num_epochs": self.num_epochs,
        }


#: The profile a CPU gets.
CPU_QUICK = QuickProfile()


@dataclass(frozen=True)
class Subset:
    """How many examples of one task a fine-tuning run reads, next to the split's full size."""

    train: int  # training examples used
    test: int  # examples of the reported split (``eval_split``) scored
    full_train: int  # examples in the whole training split
    full_test: int  # examples in the whole reported split


def subsets(
    config: FinetuneConfig, sizes: Mapping[str, Mapping[str, int]], tasks: Sequence[str]
) -> dict[str, Subset]:
    """Per task key, the examples ``config`` makes a run read out of splits of ``sizes``."""
    found = {}
    for task in tasks:
        name = get_task(task).name
        split = sizes[name]
        train = split.get("train", 0)
        test = split.get(config.eval_split, 0)
        found[name] = Subset(
            train=min(train, config.max_train_examples or train),
            test=min(test, config.max_eval_examples or test),
            full_train=train,
            full_test=test,
        )
    return found


def protocol_label(used: Mapping[str, Subset], seeds: int) -> str:
    """The results table's column: ``"CPU quick profile: 2,000 train, 1,000 test, 1 seed"``."""
    train = _counts({task: subset.train for task, subset in used.items()})
    test = _counts({task: subset.test for task, subset in used.items()})
    return f"CPU quick profile: {train} train, {test} test, {seeds} seed{'s' if seeds > 1 else ''}"


def left_out(
    used: Mapping[str, Subset],
    *,
    epochs: int,
    seeds: int,
    paper_seeds: int,
    baselines: Sequence[str],
    skipped_checkpoints: int,
) -> tuple[str, ...]:
    """What the paper's protocol does that this evaluation does not, one phrase each.

    Args:
        used: per task, the examples read (from :func:`subsets`).
        epochs: epochs of each run; seeds: runs per model and task.
        paper_seeds: the paper's runs per model and task (3).
        baselines: the paper's baselines that will not be fine-tuned (their names).
        skipped_checkpoints: checkpoints of the run that are not judged.
    """
    missing = []
    cut = {task: subset for task, subset in used.items() if subset.train < subset.full_train}
    if cut:
        missing.append(
            "the rest of the training data ("
            + ", ".join(
                f"{task.upper()} {s.train:,} of {s.full_train:,}" for task, s in cut.items()
            )
            + ")"
        )
    cut = {task: subset for task, subset in used.items() if subset.test < subset.full_test}
    if cut:
        missing.append(
            "the rest of the test data ("
            + ", ".join(f"{task.upper()} {s.test:,} of {s.full_test:,}" for task, s in cut.items())
            + ")"
        )
    if epochs < PAPER_EPOCHS:
        missing.append(f"epochs {epochs + 1}-{PAPER_EPOCHS}")
    if seeds < paper_seeds:
        missing.append(
            f"{paper_seeds - seeds} more seed(s) (the paper's mean ± std of {paper_seeds})"
        )
    if baselines:
        missing.append(f"the baselines ({', '.join(baselines)})")
    if skipped_checkpoints > 0:
        missing.append(f"{skipped_checkpoints} checkpoint(s) between the first and the newest")
    return tuple(missing)


def _counts(values: Mapping[str, int]) -> str:
    """``"2,000"`` when every task reads as many, else ``"NER 48 / NCC 40"``."""
    if len(set(values.values())) <= 1:
        return f"{next(iter(values.values()), 0):,}"
    return " / ".join(f"{task.upper()} {count:,}" for task, count in values.items())

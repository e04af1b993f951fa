"""What the evaluation notebook runs by default, and how long that will take, said before it starts.

The paper's set (every model × 3 seeds × 2 tasks, next to XLM-R large, IndicBERT and bnRoBERTa)
wants a GPU: on Binder's CPU it would run for days. :func:`plan_evaluation` therefore fills in
what the notebook left open (``None``) by the device:

* **CPU**: the run's newest checkpoint (``run.yaml`` here: its Hub repo, else the coordinator's
  newest local checkpoint; the published sahajBERT if there is no run), one seed, no baselines;
* **GPU**: the paper's set, 3 seeds, with the run's checkpoint in it when there is one.

It estimates the time first: one timed training step of each model's architecture (built from
its ``config.json`` with random weights, so nothing large is downloaded) times the steps the
fine-tuning will take at most (``num_epochs`` passes; early stopping usually ends sooner), plus
the scoring passes. It doesn't fine-tune anything (``kit.evaluation.finetune``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kit.errors import KitError
from kit.evaluation.checkpoints import Checkpoint, as_checkpoint, list_checkpoints, resolve_device
from kit.evaluation.finetune import FinetuneConfig
from kit.evaluation.tasks import get_task

logger = logging.getLogger(__name__)

#: The published sahajBERT (recipes §5.5).
SAHAJBERT = Checkpoint("neuropark/sahajBERT", name="sahajBERT")
#: The paper's baselines. The bnRoBERTa id is the one the blog names; the XLM-R and IndicBERT
#: ids are the Hub's canonical ones (the blog gives only the names).
DEFAULT_BASELINES: tuple[Checkpoint, ...] = (
    Checkpoint("FacebookAI/xlm-roberta-large", name="XLM-R large"),
    Checkpoint("ai4bharat/indic-bert", name="IndicBERT"),
    Checkpoint("neuralspace-reverie/indic-transformers-bn-roberta", name="bnRoBERTa"),
)

#: Seeds per model and task in the paper's table.
PAPER_SEEDS = 3
#: Examples per split of the real datasets (the Hub's WikiANN ``bn`` and IndicGLUE ``sna.bn``).
SPLIT_SIZES: Mapping[str, Mapping[str, int]] = {
    "ner": {"train": 10_000, "validation": 1_000, "test": 1_000},
    "ncc": {"train": 11_284, "validation": 1_411, "test": 1_411},
}
#: A scoring pass (no backward, larger batches) costs about this share of a training step.
EVAL_STEP_SHARE = 0.35

StepTimer = Callable[[Checkpoint, FinetuneConfig, str], float]


@dataclasses.dataclass(frozen=True)
class EvaluationPlan:
    """What will be fine-tuned, where, and about how long it takes."""

    device: str  # "cpu", "cuda", "mps"
    checkpoints: tuple[Checkpoint, ...]  # the models judged
    baselines: tuple[Checkpoint, ...]  # fine-tuned the same way after them
    seeds: int
    tasks: tuple[str, ...]
    seconds: float | None  # estimate (None: a model's config could not be read)
    why: str  # where the defaults came from

    def text(self) -> str:
        """One paragraph for the notebook, printed before anything runs."""
        models = len(self.checkpoints) + len(self.baselines)
        baselines = f"{len(self.baselines)} baselines" if self.baselines else "no baselines"
        estimate = "unknown" if self.seconds is None else _duration(self.seconds)
        return (
            f"On the {self.device.upper()}: {models} model(s) ({baselines}) x {len(self.tasks)} "
            f"task(s) x {self.seeds} seed(s); {self.why}. Estimated time: {estimate} at most "
            "(early stopping usually ends sooner)."
        )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def run_checkpoint(
    run_yaml: str | Path = "run.yaml", state_dir: str | Path = "coordinator"
) -> Checkpoint | None:
    """The run's newest checkpoint: its Hub repo, else the coordinator's newest local one."""
    from kit.config import RunConfig

    if not Path(run_yaml).is_file():
        return None
    settings = RunConfig.from_file(run_yaml).checkpoint
    if settings.hub_repo:
        return Checkpoint(settings.hub_repo, name="this run")
    folder = Path(settings.folder)
    folder = folder if folder.is_absolute() else Path(state_dir) / folder
    try:
        newest = list_checkpoints(folder)[-1]
    except (KitError, OSError):
        return None
    return dataclasses.replace(newest, name=f"this run ({newest.name})")


def time_one_step(checkpoint: Checkpoint, config: FinetuneConfig, device: str) -> float:
    """Seconds of one training step of ``checkpoint``'s architecture (random weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    model_config = AutoConfig.from_pretrained(checkpoint.source, revision=checkpoint.revision)
    model = AutoModelForSequenceClassification.from_config(model_config).to(device)
    model.train()
    vocab = int(getattr(model_config, "vocab_size", 1000))
    length = min(config.max_length, int(getattr(model_config, "max_position_embeddings", 512)))
    ids = torch.randint(0, vocab, (config.batch_size, length), device=device)
    labels = torch.zeros(config.batch_size, dtype=torch.long, device=device)
    timings = []
    for _ in range(2):  # the first one warms up allocators and kernels
        started = time.perf_counter()
        model(input_ids=ids, labels=labels).loss.backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
    return timings[-1]


def estimate_seconds(
    models: Sequence[Checkpoint],
    tasks: Sequence[str],
    seeds: int,
    config: FinetuneConfig,
    device: str,
    *,
    sizes: Mapping[str, Mapping[str, int]] = SPLIT_SIZES,
    step: StepTimer = time_one_step,
) -> float | None:
    """An upper bound of the fine-tuning time (None if a model's architecture cannot be read)."""
    steps = 0.0
    for task in tasks:
        split = sizes.get(task, SPLIT_SIZES[get_task(task).name])
        train = min(split["train"], config.max_train_examples or split["train"])
        scored = sum(
            min(split[name], config.max_eval_examples or split[name])
            for name in {config.select_split or "", config.eval_split} & set(split)
        )
        per_epoch = math.ceil(train / config.batch_size)
        scoring = math.ceil(scored / config.eval_batch_size) * EVAL_STEP_SHARE
        steps += (per_epoch + scoring) * config.num_epochs * seeds
    total = 0.0
    for model in models:
        try:
            total += steps * step(model, config, device)
        except Exception as error:  # transformers/Hub errors of many kinds: no estimate then
            logger.warning("cannot time %s (%s): no time estimate", model.source, error)
            return None
    return total


def split_sizes(datasets: Mapping[str, Any] | None) -> dict[str, Mapping[str, int]]:
    """Examples per split: counted for local dataset folders, the real datasets' otherwise."""
    from kit.evaluation.tasks import load_task_data

    sizes: dict[str, Mapping[str, int]] = dict(SPLIT_SIZES)
    for task, source in (datasets or {}).items():
        data = load_task_data(task, source)
        sizes[get_task(task).name] = {name: len(split) for name, split in data.splits.items()}
    return sizes


def plan_evaluation(
    checkpoints: Sequence[Any] | None = None,
    *,
    tasks: Sequence[str] = ("ner", "ncc"),
    seeds: int | None = None,
    baselines: Sequence[Any] | None = None,
    config: FinetuneConfig | None = None,
    datasets: Mapping[str, Any] | None = None,
    run_yaml: str | Path = "run.yaml",
    state_dir: str | Path = "coordinator",
    device: str | None = None,
    step: StepTimer = time_one_step,
) -> EvaluationPlan:
    """Fill in the notebook's ``None`` settings by the device (see the module docstring)."""
    config = config or FinetuneConfig()
    device = device or str(resolve_device(config.device).type)
    gpu = device != "cpu"
    ours = run_checkpoint(run_yaml, state_dir)
    why = []
    if checkpoints is None:
        chosen = [ours] if ours is not None else ([] if gpu else [SAHAJBERT])
        why.append(
            f"the run's newest checkpoint {ours.source}" if ours else "no run.yaml checkpoint here"
        )
    else:
        chosen = [as_checkpoint(item) for item in checkpoints]
    if baselines is None:
        others = [SAHAJBERT, *DEFAULT_BASELINES] if gpu else []
        why.append("the paper's models as baselines" if gpu else "no baselines on a CPU")
    else:
        others = [as_checkpoint(item) for item in baselines]
    if seeds is None:
        seeds = PAPER_SEEDS if gpu else 1
        why.append(f"{seeds} seed(s) on a {'GPU' if gpu else 'CPU'}")
    models = [*chosen, *others]
    sizes = split_sizes(datasets)
    seconds = estimate_seconds(models, tasks, seeds, config, device, sizes=sizes, step=step)
    return EvaluationPlan(
        device=device,
        checkpoints=tuple(chosen),
        baselines=tuple(others),
        seeds=seeds,
        tasks=tuple(tasks),
        seconds=seconds,
        why="; ".join(why) or "as set in the cell above",
    )

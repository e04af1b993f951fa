"""What the evaluation notebook runs by default, and how long that will take, said before it starts.

The paper's set (every model x 3 seeds x 2 tasks on all their data, next to XLM-R large, IndicBERT
and bnRoBERTa) wants a GPU: on Binder's CPU it would run for days. :func:`plan_evaluation`
therefore fills in what the notebook left open (``None``) by the device:

* **CPU**: the quick profile (``kit.evaluation.profile``): the run's first and newest checkpoints
  (``run``: a folder holding run.yaml and the coordinator's ``coordinator/``, as the config
  notebook and ``kit demo --work-dir`` leave them, or the run's Hub repo; the published
  sahajBERT if there is no run), the first 2,000 training and 1,000 test examples of each task,
  3 epochs, one seed, no baselines; the plan says what that leaves out, and the results table
  names the profile in a column;
* **GPU**: the paper's protocol, unchanged: the paper's set, 3 seeds, every example, up to 20
  epochs, with the run's newest checkpoint in it when there is one.

It estimates the time first: one timed training step of each model's architecture (built from
its ``config.json`` with random weights, so nothing large is downloaded) times the steps the
fine-tuning will take at most (``num_epochs`` passes; early stopping usually ends sooner), plus
the scoring passes. It doesn't fine-tune anything (``kit.evaluation.finetune``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kit.errors import CheckpointError, KitError
from kit.evaluation.checkpoints import Checkpoint, as_checkpoint, list_checkpoints, resolve_device
from kit.evaluation.finetune import FinetuneConfig
from kit.evaluation.profile import CPU_QUICK, QuickProfile, left_out, protocol_label, subsets
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
    """What will be fine-tuned, where, how, and about how long it takes."""

    device: str  # "cpu", "cuda", "mps"
    checkpoints: tuple[Checkpoint, ...]  # the models judged
    baselines: tuple[Checkpoint, ...]  # fine-tuned the same way after them
    seeds: int
    tasks: tuple[str, ...]
    seconds: float | None  # estimate (None: a model's config could not be read)
    why: str  # where the defaults came from
    config: FinetuneConfig = FinetuneConfig()  # the fine-tuning settings (CPU: the quick profile's)
    protocol: str | None = None  # the table's column on a CPU; None: the paper's protocol
    left_out: tuple[str, ...] = ()  # what the paper's protocol does that this plan does not

    def text(self) -> str:
        """One paragraph for the notebook, printed before anything runs."""
        models = len(self.checkpoints) + len(self.baselines)
        baselines = f"{len(self.baselines)} baselines" if self.baselines else "no baselines"
        estimate = "unknown" if self.seconds is None else _duration(self.seconds)
        text = (
            f"On the {self.device.upper()}: {models} model(s) ({baselines}) x {len(self.tasks)} "
            f"task(s) x {self.seeds} seed(s); {self.why}. Estimated time: {estimate} at most "
            "(early stopping usually ends sooner)."
        )
        if self.protocol is not None:
            text += f" {self.protocol}, {self.config.num_epochs} epoch(s)."
        if self.left_out:
            text += (
                f" Not done here: {'; '.join(self.left_out)} (on a GPU the notebook runs the "
                "paper's protocol)."
            )
        return text


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def run_checkpoints(
    run: str | os.PathLike[str] = ".",
    state_dir: str | os.PathLike[str] | None = None,
    *,
    token: str | None = None,
    endpoint: str | None = None,
) -> list[Checkpoint]:
    """The run's checkpoints, oldest first; [] when there is no run (or no checkpoint) there.

    Args:
        run: a folder holding the run's ``run.yaml`` (the config notebook's folder, or
            ``kit demo --work-dir``'s), a ``run.yaml`` itself, or the run's Hub repo id.
        state_dir: the coordinator's state folder; default ``coordinator`` beside run.yaml.
        token, endpoint: for a Hub repo (default: the logged-in user's token, ``HF_ENDPOINT``).

    A run.yaml with a ``checkpoint.hub_repo`` is read from the Hub (every "Step N" commit),
    else from its local checkpoint folder (relative to the state folder).
    """
    from kit.config import RunConfig

    path = Path(run).expanduser()
    run_yaml = path / "run.yaml" if path.is_dir() else path
    if not run_yaml.is_file():
        if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", os.fspath(run)):
            return _hub_series(os.fspath(run), token, endpoint)
        return []
    settings = RunConfig.from_file(run_yaml).checkpoint
    if settings.hub_repo:
        return _hub_series(settings.hub_repo, token, endpoint)
    folder = Path(settings.folder)
    state = Path(state_dir) if state_dir is not None else run_yaml.parent / "coordinator"
    folder = folder if folder.is_absolute() else state / folder
    try:
        found = list_checkpoints(folder)
    except (KitError, OSError):
        return []
    return [_ours(checkpoint) for checkpoint in found]


def run_checkpoint(
    run: str | os.PathLike[str] = ".", state_dir: str | os.PathLike[str] | None = None
) -> Checkpoint | None:
    """The run's newest checkpoint (see :func:`run_checkpoints`), or None."""
    found = run_checkpoints(run, state_dir)
    return found[-1] if found else None


def _ours(checkpoint: Checkpoint) -> Checkpoint:
    step = checkpoint.step
    return dataclasses.replace(
        checkpoint, name="this run" + ("" if step is None else f" (step {step})")
    )


def _hub_series(repo: str, token: str | None, endpoint: str | None) -> list[Checkpoint]:
    """A Hub repo's "Step N" commits, or its main revision when it has none."""
    try:
        found = list_checkpoints(repo, token=token, endpoint=endpoint)
    except CheckpointError as error:
        logger.warning("judging %s as it is now: %s", repo, error)
        return [Checkpoint(repo, name="this run")]
    return [_ours(checkpoint) for checkpoint in found]


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


def config_for_device(
    finetune: Mapping[str, Any] | None = None,
    *,
    device: str | None = None,
    profile: QuickProfile = CPU_QUICK,
) -> FinetuneConfig:
    """The fine-tuning settings by the device: on a CPU the quick ``profile``'s subset and
    epochs, else ``FinetuneConfig``'s defaults (the paper's), with ``finetune``'s fields on top.

    ``device``: None = the one ``finetune["device"]`` (default "auto") resolves to.
    """
    overrides = dict(finetune or {})
    device = device or str(resolve_device(overrides.get("device", "auto")).type)
    base = profile.finetune_settings() if device == "cpu" else {}
    return FinetuneConfig(**{**base, **overrides})


def plan_evaluation(
    checkpoints: Sequence[Any] | None = None,
    *,
    tasks: Sequence[str] = ("ner", "ncc"),
    seeds: int | None = None,
    baselines: Sequence[Any] | None = None,
    config: FinetuneConfig | None = None,
    finetune: Mapping[str, Any] | None = None,
    datasets: Mapping[str, Any] | None = None,
    run: str | os.PathLike[str] = ".",
    state_dir: str | os.PathLike[str] | None = None,
    device: str | None = None,
    profile: QuickProfile = CPU_QUICK,
    step: StepTimer = time_one_step,
    token: str | None = None,
    endpoint: str | None = None,
) -> EvaluationPlan:
    """Fill in the notebook's ``None`` settings by the device (see the module docstring).

    Args:
        checkpoints, seeds, baselines: None = chosen by the device.
        config: the fine-tuning settings as they are; None = the device's (CPU: ``profile``'s
            subset and epochs, else ``FinetuneConfig``'s defaults) with ``finetune`` on top.
        finetune: ``FinetuneConfig`` fields overriding the device's (the notebook's FINETUNE).
        datasets: local dataset folders per task (their splits are counted).
        run, state_dir: where the run's checkpoints are (:func:`run_checkpoints`).
        device: None = CUDA, else MPS, else CPU (as the fine-tuning picks).
        step: times one training step (tests pass a stand-in).
    """
    if config is None:
        config = config_for_device(finetune, device=device, profile=profile)
    device = device or str(resolve_device(config.device).type)
    gpu = device != "cpu"
    series = run_checkpoints(run, state_dir, token=token, endpoint=endpoint)
    why: list[str] = []
    skipped = 0
    if checkpoints is None:
        chosen = _default_checkpoints(series, gpu)
        skipped = 0 if gpu else max(0, len(series) - len(chosen))
        if not series:
            why.append(f"no run with a checkpoint at {os.fspath(run)!r}")
        elif len(chosen) == 2:
            why.append(
                f"the run's first and newest checkpoints: {chosen[0].label}, {chosen[1].label}"
            )
        else:
            why.append(f"the run's newest checkpoint: {chosen[0].label}")
    else:
        chosen = [as_checkpoint(item) for item in checkpoints]
    if baselines is None:
        others = [SAHAJBERT, *DEFAULT_BASELINES] if gpu else []
        why.append("the paper's models as baselines" if gpu else "no baselines on a CPU")
    else:
        others = [as_checkpoint(item) for item in baselines]
    if seeds is None:
        seeds = PAPER_SEEDS if gpu else profile.seeds
        why.append(f"{seeds} seed(s) on a {'GPU' if gpu else 'CPU'}")
    models = [*chosen, *others]
    sizes = split_sizes(datasets)
    seconds = estimate_seconds(models, tasks, seeds, config, device, sizes=sizes, step=step)
    protocol: str | None = None
    missing: tuple[str, ...] = ()
    if not gpu:
        used = subsets(config, sizes, tasks)
        protocol = protocol_label(used, seeds)
        named = {checkpoint.label for checkpoint in others}
        missing = left_out(
            used,
            epochs=config.num_epochs,
            seeds=seeds,
            paper_seeds=PAPER_SEEDS,
            baselines=[b.label for b in (SAHAJBERT, *DEFAULT_BASELINES) if b.label not in named],
            skipped_checkpoints=skipped,
        )
    return EvaluationPlan(
        device=device,
        checkpoints=tuple(chosen),
        baselines=tuple(others),
        seeds=seeds,
        tasks=tuple(tasks),
        seconds=seconds,
        why="; ".join(why) or "as set in the cell above",
        config=config,
        protocol=protocol,
        left_out=missing,
    )


def _default_checkpoints(series: Sequence[Checkpoint], gpu: bool) -> list[Checkpoint]:
    """GPU: the run's newest (the paper's set comes with it); CPU: its first and newest, or
    the published sahajBERT when there is no run."""
    if not series:
        return [] if gpu else [SAHAJBERT]
    if gpu or len(series) == 1:
        return [series[-1]]
    return [series[0], series[-1]]

"""Judge checkpoints the way sahajBERT was judged: the API behind ``notebooks/evaluate.ipynb``.

Three questions a researcher asks of a collaborative run, one function each:

* :func:`compare` - how good is the model? Fine-tune it on WikiANN-bn NER (seqeval F1) and
  IndicGLUE sna.bn news classification (accuracy) with N seeds, next to baselines (the paper's
  XLM-R large, IndicBERT, bnRoBERTa by default), and get the paper's mean ± std table.
* :func:`evaluate_series` - is the run on track? The same (or the cheap masked-LM loss) for
  every checkpoint of the run, plotted against the training step.
* :func:`masked_lm_loss` - what is one checkpoint's held-out masked-LM loss and perplexity?
* :func:`plan_evaluation` - what the notebook runs by default on this device (CPU: the quick
  profile, the run's first and newest checkpoints on 2,000 training and 1,000 test examples per
  task, 3 epochs, one seed, no baselines, and what that leaves out; GPU: the paper's protocol)
  and how long it will take.

:func:`run` does the first two for the notebook's single call. The pieces live in
``kit/evaluation/`` (checkpoints, tasks, metrics, finetune, mlm, report); this module only wires
them and re-exports the public names. Everything runs on CPU (slowly) and uses CUDA or MPS when
present. Nothing here downloads anything unless a Hub model or the real datasets are asked for.

Example::

    from kit import evaluate

    table = evaluate.compare(["neuropark/sahajBERT"], seeds=3, baselines=())
    print(table)  # Model       NER F1         NCC Acc
    #               sahajBERT   95.45 ± 0.53   91.97 ± 0.47   (the paper's numbers)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from kit.errors import ConfigError, EvaluationError
from kit.evaluation.checkpoints import Checkpoint, as_checkpoint, list_checkpoints
from kit.evaluation.finetune import FinetuneConfig, RunResult, finetune
from kit.evaluation.metrics import MeanStd, accuracy, entity_scores, mean_std
from kit.evaluation.mlm import MaskedLMResult
from kit.evaluation.mlm import masked_lm_loss as _masked_lm_loss
from kit.evaluation.plan import (
    DEFAULT_BASELINES,
    SAHAJBERT,
    EvaluationPlan,
    plan_evaluation,
    run_checkpoint,
    run_checkpoints,
)
from kit.evaluation.profile import CPU_QUICK, QuickProfile
from kit.evaluation.report import (
    PAPER_RESULTS,
    ModelRow,
    ResultsTable,
    SeriesPoint,
    SeriesResult,
    show,
)
from kit.evaluation.tasks import TASKS, DatasetSource, TaskData, TaskSpec, get_task, load_task_data
from kit.training.checkpoint_format import (
    CHECKPOINT_FOLDER_FORMAT,
    CHECKPOINT_INFO_FILE,
    parse_commit_title,
    read_checkpoint_info,
    write_checkpoint_info,
)

__all__ = [
    "CHECKPOINT_FOLDER_FORMAT",
    "CHECKPOINT_INFO_FILE",
    "CPU_QUICK",
    "DEFAULT_BASELINES",
    "PAPER_RESULTS",
    "SAHAJBERT",
    "TASKS",
    "Checkpoint",
    "DatasetSource",
    "EvaluationPlan",
    "EvaluationReport",
    "FinetuneConfig",
    "MaskedLMResult",
    "MeanStd",
    "QuickProfile",
    "ResultsTable",
    "RunResult",
    "SeriesPoint",
    "SeriesResult",
    "TaskSpec",
    "accuracy",
    "compare",
    "entity_scores",
    "evaluate_series",
    "get_task",
    "list_checkpoints",
    "load_task_data",
    "masked_lm_loss",
    "mean_std",
    "parse_commit_title",
    "plan_evaluation",
    "read_checkpoint_info",
    "run",
    "run_checkpoint",
    "run_checkpoints",
    "write_checkpoint_info",
]

logger = logging.getLogger(__name__)

ModelLike = str | os.PathLike[str] | Checkpoint
Datasets = Mapping[str, DatasetSource | str] | None


def compare(
    models: Sequence[ModelLike],
    *,
    tasks: Sequence[str] = ("ner", "ncc"),
    seeds: int | Sequence[int] = 3,
    baselines: Sequence[ModelLike] = DEFAULT_BASELINES,
    datasets: Datasets = None,
    config: FinetuneConfig | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    progress: bool = True,
    protocol: str | None = None,
) -> ResultsTable:
    """Fine-tune every model (then every baseline) on every task with N seeds; the paper's table.

    Args:
        models: local ``save_pretrained`` folders, Hub repo ids (``"repo@revision"`` pins a
            commit) or :class:`Checkpoint` s.
        tasks: task keys in column order: ``"ner"`` (WikiANN-bn F1), ``"ncc"`` (sna.bn accuracy).
        seeds: how many seeds (0..N-1), or the seeds themselves.
        baselines: Hub models fine-tuned the same way after ``models``; ``()`` for none. The
            defaults are the paper's; they download ~3 GB and want a GPU.
        datasets: task key -> :class:`DatasetSource` or folder; tasks not listed use the real
            datasets (``load_dataset("wikiann", "bn")``, ``("indic_glue", "sna.bn")``).
        config: fine-tuning hyperparameters.
        output_dir: if given, write ``results.json``, ``results.csv`` and ``runs.csv`` there.
        token: Hub token for private repos.
        endpoint: Hub URL (default ``HF_ENDPOINT``).
        progress: show tqdm bars.
        protocol: how the numbers were obtained when not by the paper's protocol (the plan's
            ``protocol``: "CPU quick profile: ..."); the table shows it in a column.

    Raises:
        UnknownTask, DatasetSchemaError, CheckpointError, VocabularyMismatch, ConfigError.
    """
    seed_list = _seeds(seeds)
    specs = [get_task(task) for task in tasks]
    checkpoints = [as_checkpoint(m) for m in [*models, *baselines]]
    if not checkpoints:
        raise ConfigError("compare() got no model - help: pass a checkpoint folder or repo id")
    config = config or FinetuneConfig()
    data = _load_all(specs, datasets)
    rows = []
    bar = tqdm(checkpoints, desc="models", disable=not progress or len(checkpoints) < 2)
    for checkpoint in bar:
        runs = {
            spec.name: tuple(
                finetune(
                    checkpoint,
                    data[spec.name],
                    seeds=seed_list,
                    config=config,
                    token=token,
                    endpoint=endpoint,
                    progress=progress,
                )
            )
            for spec in specs
        }
        rows.append(ModelRow(checkpoint.label, checkpoint.source, checkpoint.revision, runs))
    table = ResultsTable(
        tuple(spec.name for spec in specs), tuple(rows), asdict(config), protocol=protocol
    )
    logger.info("fine-tuning results (%d seeds):\n%s", len(seed_list), table.format())
    if output_dir is not None:
        table.save(output_dir)
    return table


def evaluate_series(
    source: str | os.PathLike[str] | Sequence[Checkpoint],
    *,
    tasks: Sequence[str] = ("ner",),
    seeds: int | Sequence[int] = 1,
    heldout_texts: Sequence[str] | str | os.PathLike[str] | None = None,
    max_points: int | None = None,
    datasets: Datasets = None,
    config: FinetuneConfig | None = None,
    output_dir: str | os.PathLike[str] = "evaluation",
    revision: str | None = None,
    tokenizer: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    progress: bool = True,
) -> SeriesResult:
    """Score every checkpoint of a run and plot the metrics against the training step.

    Args:
        source: the coordinator's checkpoint folder (``step_000123/`` subfolders holding
            ``kit_checkpoint.json``), a Hub repo whose commits are "Step N, loss X", or a list
            of :class:`Checkpoint` s with ``step`` set.
        tasks: tasks to fine-tune on at every step; ``()`` to plot only the MLM/training loss.
        seeds: seeds per checkpoint (1 is usually enough to see a trend).
        heldout_texts: documents (or a text file, one per line) for the masked-LM loss.
        max_points: evaluate at most this many checkpoints, evenly spread, first and last kept.
        datasets: as in :func:`compare`.
        config: fine-tuning hyperparameters.
        output_dir: where ``series.png``, ``series.json`` and ``series.csv`` go.
        revision: Hub branch whose history to list.
        tokenizer: tokenizer folder or repo, if checkpoints do not carry their own.
        token: Hub token for private repos.
        endpoint: Hub URL (default ``HF_ENDPOINT``).
        progress: show tqdm bars.

    Returns:
        The points and the paths of the files written (``result.plot_path`` is the PNG).
    """
    seed_list = _seeds(seeds)
    specs = [get_task(task) for task in tasks]
    if max_points is not None and max_points < 1:
        raise ConfigError(
            f"max_points must be None or >= 1, got {max_points} - help: use "
            "None to evaluate every checkpoint"
        )
    texts = _texts(heldout_texts)
    if not specs and texts is None:
        raise ConfigError(
            "evaluate_series() has nothing to measure - help: pass tasks=('ner',) "
            "or heldout_texts=[...]"
        )
    if isinstance(source, (str, os.PathLike)):
        checkpoints = list_checkpoints(
            source, revision=revision, tokenizer=tokenizer, token=token, endpoint=endpoint
        )
    else:
        checkpoints = sorted(source, key=lambda c: c.step or 0)
    checkpoints = _spread(checkpoints, max_points)
    config = config or FinetuneConfig()
    data = _load_all(specs, datasets)
    points = []
    for checkpoint in tqdm(checkpoints, desc="checkpoints", disable=not progress):
        metrics = {}
        for spec in specs:
            runs = finetune(
                checkpoint,
                data[spec.name],
                seeds=seed_list,
                config=config,
                token=token,
                endpoint=endpoint,
                progress=progress,
            )
            metrics[spec.name] = mean_std([r.value for r in runs])
        mlm = None
        if texts is not None:
            mlm = _masked_lm_loss(
                checkpoint,
                texts,
                max_length=config.max_length,
                device=config.device,
                token=token,
                endpoint=endpoint,
                progress=progress,
            )
        points.append(
            SeriesPoint(
                checkpoint.step or 0,
                checkpoint.label,
                checkpoint.revision,
                checkpoint.loss,
                metrics,
                mlm,
            )
        )
    result = SeriesResult(tuple(spec.name for spec in specs), tuple(points))
    return result.save(output_dir)


def masked_lm_loss(
    checkpoint: ModelLike,
    texts: Sequence[str] | str | os.PathLike[str],
    *,
    mask_probability: float = 0.15,
    seed: int = 0,
    max_length: int = 128,
    batch_size: int = 16,
    device: str = "auto",
    token: str | None = None,
    endpoint: str | None = None,
    progress: bool = True,
) -> MaskedLMResult:
    """Held-out masked-LM loss and perplexity of one checkpoint (deterministic masking).

    Args:
        checkpoint: folder, repo id, ``"repo@revision"`` or :class:`Checkpoint`.
        texts: documents, or the path of a text file with one document per line.
        mask_probability: share of tokens to predict (0.15 as in pretraining).
        seed: masking seed; keep it fixed to compare checkpoints.
        max_length: tokens per document.
        batch_size: documents per forward pass.
        device: "auto" (CUDA, MPS, CPU) or a torch device string.
        token: Hub token for private repos.
        endpoint: Hub URL (default ``HF_ENDPOINT``).
        progress: show a tqdm bar.

    Raises:
        CheckpointError: no masked-LM head, or the checkpoint cannot be loaded.
        VocabularyMismatch: the tokenizer does not fit the embedding table.
        EvaluationError: no text, or the text file does not exist.
    """
    return _masked_lm_loss(
        as_checkpoint(checkpoint),
        _texts(texts) or [],
        mask_probability=mask_probability,
        seed=seed,
        max_length=max_length,
        batch_size=batch_size,
        device=device,
        token=token,
        endpoint=endpoint,
        progress=progress,
    )


@dataclass(frozen=True)
class EvaluationReport:
    """What :func:`run` produced: the table, the series, and where the files are."""

    table: ResultsTable | None  # fine-tuning table, if checkpoints were given
    series: SeriesResult | None  # checkpoint series, if a series was given
    output_dir: Path  # folder holding results.* and series.*

    def show(self, paper: bool = True) -> None:
        """Display the table (with the paper's numbers below it) and the plot."""
        show(self.table, self.series, paper=paper)


def run(
    checkpoints: Sequence[ModelLike] = (),
    *,
    tasks: Sequence[str] = ("ner", "ncc"),
    seeds: int | Sequence[int] = 3,
    baselines: Sequence[ModelLike] = DEFAULT_BASELINES,
    series: str | os.PathLike[str] | None = None,
    series_tasks: Sequence[str] | None = None,
    series_seeds: int | Sequence[int] = 1,
    series_max_points: int | None = None,
    heldout_texts: Sequence[str] | str | os.PathLike[str] | None = None,
    datasets: Datasets = None,
    config: FinetuneConfig | None = None,
    output_dir: str | os.PathLike[str] = "evaluation",
    tokenizer: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    progress: bool = True,
    protocol: str | None = None,
) -> EvaluationReport:
    """The notebook's one call: :func:`compare` the checkpoints, then :func:`evaluate_series`.

    Arguments are those of the two functions; ``series_tasks`` defaults to ``tasks``. Either
    part is skipped when it has nothing to do (no checkpoints and no baselines, or no series).
    """
    out = Path(output_dir)
    table = None
    if list(checkpoints) or list(baselines):
        table = compare(
            checkpoints,
            tasks=tasks,
            seeds=seeds,
            baselines=baselines,
            datasets=datasets,
            config=config,
            output_dir=out,
            token=token,
            endpoint=endpoint,
            progress=progress,
            protocol=protocol,
        )
    result = None
    if series is not None:
        result = evaluate_series(
            series,
            tasks=tasks if series_tasks is None else series_tasks,
            seeds=series_seeds,
            heldout_texts=heldout_texts,
            max_points=series_max_points,
            datasets=datasets,
            config=config,
            output_dir=out,
            tokenizer=tokenizer,
            token=token,
            endpoint=endpoint,
            progress=progress,
        )
    return EvaluationReport(table, result, out)


def _seeds(seeds: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError(f"seeds must be >= 1, got {seeds} - help: the paper used 3")
        return tuple(range(seeds))
    if not seeds:
        raise ConfigError("seeds is empty - help: pass a count (3) or a list of seeds")
    return tuple(int(seed) for seed in seeds)


def _load_all(specs: Sequence[TaskSpec], datasets: Datasets) -> dict[str, TaskData]:
    sources = {get_task(key).name: value for key, value in (datasets or {}).items()}
    return {spec.name: load_task_data(spec, sources.get(spec.name)) for spec in specs}


def _texts(texts: Sequence[str] | str | os.PathLike[str] | None) -> list[str] | None:
    if texts is None:
        return None
    if isinstance(texts, (str, os.PathLike)):
        try:
            lines = Path(texts).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise EvaluationError(
                f"cannot read held-out text file {os.fspath(texts)!r} ({exc}) - help: pass a "
                "text file with one document per line, or a list of strings"
            ) from exc
        return [line for line in lines if line.strip()]
    return list(texts)


def _spread(checkpoints: list[Checkpoint], max_points: int | None) -> list[Checkpoint]:
    """At most ``max_points`` checkpoints, evenly spaced, keeping the first and the last."""
    if max_points is None or len(checkpoints) <= max_points:
        return checkpoints
    if max_points == 1:
        return checkpoints[-1:]
    last = len(checkpoints) - 1
    picks = sorted({round(i * last / (max_points - 1)) for i in range(max_points)})
    return [checkpoints[i] for i in picks]

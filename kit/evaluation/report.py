"""What an evaluation leaves behind: the paper-style table, the metric-vs-step plot, JSON and CSV.

Holds :class:`ResultsTable` (models x tasks, mean ± std over seeds, formatted like the DeDLOC
blog's table), :class:`SeriesResult` (one point per checkpoint of a training run) and the
writers for their files. It computes no metric and runs no model.

Plots are drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas, so nothing global
(the pyplot state, the notebook's backend) is touched and it works headless.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kit.evaluation.finetune import RunResult
from kit.evaluation.metrics import MeanStd, mean_std
from kit.evaluation.mlm import MaskedLMResult
from kit.evaluation.tasks import get_task

logger = logging.getLogger(__name__)

#: The DeDLOC blog's table (recipes §5.5): NER F1 on WikiANN-bn, NCC accuracy on sna.bn,
#: mean ± std over 3 fine-tuning runs, as fractions.
PAPER_RESULTS: Mapping[str, Mapping[str, MeanStd]] = {
    "sahajBERT": {"ner": MeanStd(0.9545, 0.0053, 3), "ncc": MeanStd(0.9197, 0.0047, 3)},
    "XLM-R large": {"ner": MeanStd(0.9648, 0.0022, 3), "ncc": MeanStd(0.9005, 0.0038, 3)},
    "IndicBERT": {"ner": MeanStd(0.9252, 0.0045, 3), "ncc": MeanStd(0.7446, 0.0191, 3)},
    "bnRoBERTa": {"ner": MeanStd(0.8232, 0.0067, 3), "ncc": MeanStd(0.8094, 0.0045, 3)},
}
#: Fine-tuning runs behind each of the paper's numbers.
PAPER_RUNS = 3


@dataclass(frozen=True)
class ModelRow:
    """One model's runs in a results table."""

    name: str  # label shown in the table
    source: str  # folder or Hub repo id
    revision: str | None  # Hub revision, if any
    runs: Mapping[str, tuple[RunResult, ...]]  # task key -> one result per seed

    def summary(self, task: str) -> MeanStd:
        """Mean ± std of the task's reported metric over this model's seeds."""
        return mean_std([run.value for run in self.runs.get(task, ())])


@dataclass(frozen=True)
class ResultsTable:
    """Fine-tuning results of several models on several tasks, in the paper's format.

    ``print(table)`` gives the plain-text table; in a notebook it renders as Markdown.
    """

    tasks: tuple[str, ...]  # task keys, in column order
    rows: tuple[ModelRow, ...]  # one row per model, in the order they were given
    config: Mapping[str, Any] = field(default_factory=dict)  # FinetuneConfig used, as a dict
    protocol: str | None = None  # e.g. "CPU quick profile: ..."; None = the paper's protocol

    def cells(self, paper: bool = False) -> list[list[str]]:
        """Header plus one row per model: ``[["Model", "NER F1", ...], ["sahajBERT", ...]]``.

        With a :attr:`protocol` (the CPU quick profile), a last column says how each row was
        obtained: ``(CPU quick profile: 2,000 train, 1,000 test, 1 seed)``, and the paper's
        rows ``(paper: all data, 3 seeds)``, since the two are not measured alike.
        """
        extra = ["Protocol"] if self.protocol else []
        lines = [["Model"] + [get_task(task).title for task in self.tasks] + extra]
        ours = [f"({self.protocol})"] if self.protocol else []
        for row in self.rows:
            lines.append([row.name] + [row.summary(task).format() for task in self.tasks] + ours)
        if paper:
            theirs = [f"(paper: all data, {PAPER_RUNS} seeds)"] if self.protocol else []
            for name, reported in PAPER_RESULTS.items():
                lines.append(
                    [f"{name} (paper)"]
                    + [reported[t].format() if t in reported else "—" for t in self.tasks]
                    + theirs
                )
        return lines

    def format(self, paper: bool = False) -> str:
        """Aligned plain text, e.g. ``sahajBERT    95.45 ± 0.53   91.97 ± 0.47``."""
        lines = self.cells(paper)
        widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
        return "\n".join(
            "   ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in lines
        )

    def to_markdown(self, paper: bool = False) -> str:
        """The table as GitHub Markdown."""
        lines = self.cells(paper)
        out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
        out += ["| " + " | ".join(line) + " |" for line in lines[1:]]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def to_dict(self) -> dict[str, Any]:
        """Everything in the table, JSON-ready (metrics as fractions)."""
        models = []
        for row in self.rows:
            results = {}
            for task in self.tasks:
                summary = row.summary(task)
                results[task] = {
                    "metric": get_task(task).metric,
                    "mean": _json_float(summary.mean),
                    "std": _json_float(summary.std),
                    "n": summary.n,
                    "runs": [_run_dict(run) for run in row.runs.get(task, ())],
                }
            models.append(
                {
                    "name": row.name,
                    "source": row.source,
                    "revision": row.revision,
                    "results": results,
                }
            )
        return {
            "tasks": list(self.tasks),
            "models": models,
            "config": dict(self.config),
            "protocol": self.protocol,
        }

    def save(self, folder: str | os.PathLike[str]) -> list[Path]:
        """Write ``results.json``, ``results.csv`` (mean/std) and ``runs.csv`` (every seed)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "results.json", out / "results.csv", out / "runs.csv"]
        written[0].write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        summary_rows = [
            [
                row.name,
                row.source,
                row.revision or "",
                task,
                get_task(task).metric,
                row.summary(task).mean,
                row.summary(task).std,
                row.summary(task).n,
            ]
            for row in self.rows
            for task in self.tasks
        ]
        _write_csv(
            written[1],
            ["model", "source", "revision", "task", "metric", "mean", "std", "n"],
            summary_rows,
        )
        run_rows = [
            [
                row.name,
                task,
                run.seed,
                run.metric,
                run.value,
                run.best_epoch,
                run.epochs_run,
                run.seconds,
            ]
            for row in self.rows
            for task in self.tasks
            for run in row.runs.get(task, ())
        ]
        _write_csv(
            written[2],
            ["model", "task", "seed", "metric", "value", "best_epoch", "epochs_run", "seconds"],
            run_rows,
        )
        return written


@dataclass(frozen=True)
class SeriesPoint:
    """One checkpoint of a training run and what it scored."""

    step: int  # global optimizer step
    checkpoint: str  # label of the checkpoint
    revision: str | None  # Hub commit, if the series came from the Hub
    train_loss: float | None  # the swarm's training loss at that step, if recorded
    metrics: Mapping[str, MeanStd]  # task key -> mean ± std over the seeds
    mlm: MaskedLMResult | None = None  # held-out masked-LM loss, if texts were given


@dataclass(frozen=True)
class SeriesResult:
    """Metrics of a series of checkpoints against the training step, plus the files written."""

    tasks: tuple[str, ...]  # task keys that were fine-tuned at every step
    points: tuple[SeriesPoint, ...]  # sorted by step
    files: tuple[Path, ...] = ()  # plot, JSON and CSV, once saved

    @property
    def plot_path(self) -> Path | None:
        """The PNG plot, once saved."""
        return next((path for path in self.files if path.suffix == ".png"), None)

    def to_dict(self) -> dict[str, Any]:
        """All points, JSON-ready."""
        return {"tasks": list(self.tasks), "points": [_point_dict(p) for p in self.points]}

    def save(self, folder: str | os.PathLike[str], stem: str = "series") -> SeriesResult:
        """Write ``<stem>.png``, ``<stem>.json`` and ``<stem>.csv``; returns a copy with ``files``."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        png, js, table = out / f"{stem}.png", out / f"{stem}.json", out / f"{stem}.csv"
        plot_series(self, png)
        js.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        header = ["step", "checkpoint", "revision", "train_loss"]
        for task in self.tasks:
            header += [f"{task}_mean", f"{task}_std", f"{task}_n"]
        header += ["mlm_loss", "perplexity"]
        rows = []
        for p in self.points:
            row: list[Any] = [p.step, p.checkpoint, p.revision or "", _csv_float(p.train_loss)]
            for task in self.tasks:
                m = p.metrics.get(task, mean_std([]))
                row += [_csv_float(m.mean), _csv_float(m.std), m.n]
            row += [
                _csv_float(p.mlm.loss if p.mlm else None),
                _csv_float(p.mlm.perplexity if p.mlm else None),
            ]
            rows.append(row)
        _write_csv(table, header, rows)
        logger.info("series plot and data written to %s", out)
        return SeriesResult(self.tasks, self.points, (png, js, table))


def plot_series(series: SeriesResult, path: str | Path) -> Path:
    """Draw every metric against the training step, one panel each, into a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [p.step for p in series.points]
    panels: list[tuple[str, list[float], list[float]]] = []
    for task in series.tasks:
        summaries = [p.metrics.get(task, mean_std([])) for p in series.points]
        panels.append(
            (
                f"{get_task(task).title} (%)",
                [100 * s.mean for s in summaries],
                [100 * s.std if s.n > 1 else 0.0 for s in summaries],
            )
        )
    if any(p.mlm for p in series.points):
        panels.append(
            ("held-out MLM loss", [p.mlm.loss if p.mlm else math.nan for p in series.points], [])
        )
    if any(p.train_loss is not None for p in series.points):
        panels.append(
            (
                "training loss",
                [math.nan if p.train_loss is None else p.train_loss for p in series.points],
                [],
            )
        )
    figure = Figure(figsize=(5.0 * max(1, len(panels)), 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, max(1, len(panels)), squeeze=False)[0]
    for axis, (title, values, errors) in zip(axes, panels, strict=False):
        axis.errorbar(steps, values, yerr=errors if any(errors) else None, marker="o", capsize=3)
        axis.set_title(title)
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
    if not panels:
        axes[0].set_title("nothing to plot: no task, held-out text or training loss")
    figure.savefig(path, dpi=110)
    return Path(path)


def show(table: ResultsTable | None, series: SeriesResult | None, paper: bool = True) -> None:
    """Display the table and the plot: rich in a notebook, plain text otherwise."""
    try:
        from IPython import get_ipython
        from IPython.display import Image, Markdown, display

        rich = get_ipython() is not None
    except ImportError:
        rich = False
    if table is not None:
        if rich:
            display(Markdown(table.to_markdown(paper)))
        else:
            print(table.format(paper))  # show() was asked for: the table is the output
    if series is not None and series.plot_path is not None:
        if rich:
            display(Image(filename=str(series.plot_path)))
        else:
            print(f"plot: {series.plot_path}")


def _run_dict(run: RunResult) -> dict[str, Any]:
    data = asdict(run)
    data["scores"] = {k: _json_float(v) for k, v in run.scores.items()}
    data["train_loss"] = _json_float(run.train_loss)
    return data


def _point_dict(point: SeriesPoint) -> dict[str, Any]:
    return {
        "step": point.step,
        "checkpoint": point.checkpoint,
        "revision": point.revision,
        "train_loss": _json_float(point.train_loss),
        "metrics": {
            task: {"mean": _json_float(m.mean), "std": _json_float(m.std), "n": m.n}
            for task, m in point.metrics.items()
        },
        "mlm": None
        if point.mlm is None
        else {
            k: _json_float(v) if isinstance(v, float) else v for k, v in asdict(point.mlm).items()
        },
    }


def _json_float(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _csv_float(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else repr(float(value))


def _write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)

"""The paper-style table and the series files, built from hand-made results."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from kit.evaluation.finetune import RunResult
from kit.evaluation.metrics import MeanStd
from kit.evaluation.mlm import MaskedLMResult
from kit.evaluation.report import ModelRow, ResultsTable, SeriesPoint, SeriesResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _runs(model: str, task: str, values: list[float]) -> tuple[RunResult, ...]:
    metric = "f1" if task == "ner" else "accuracy"
    return tuple(RunResult(model, task, seed, metric, value) for seed, value in enumerate(values))


def _table() -> ResultsTable:
    rows = (
        ModelRow(
            "sahajBERT",
            "neuropark/sahajBERT",
            "abc",
            {
                "ner": _runs("sahajBERT", "ner", [0.95, 0.96, 0.94]),  # 95.00 ± 1.00
                "ncc": _runs("sahajBERT", "ncc", [0.92, 0.92, 0.92]),  # 92.00 ± 0.00
            },
        ),
        ModelRow("mine", "/runs/final", None, {"ner": _runs("mine", "ner", [0.5])}),
    )
    return ResultsTable(("ner", "ncc"), rows, {"learning_rate": 3e-5})


def test_table_in_the_papers_format() -> None:
    assert _table().format().splitlines() == [
        "Model       NER F1         NCC Acc",
        "sahajBERT   95.00 ± 1.00   92.00 ± 0.00",
        "mine        50.00          —",
    ]
    with_paper = _table().format(paper=True)
    assert "XLM-R large (paper)   96.48 ± 0.22   90.05 ± 0.38" in with_paper
    assert _table().to_markdown().splitlines()[:3] == [
        "| Model | NER F1 | NCC Acc |",
        "|---|---|---|",
        "| sahajBERT | 95.00 ± 1.00 | 92.00 ± 0.00 |",
    ]


def test_a_quick_profile_table_says_so_in_a_column(tmp_path: Path) -> None:
    quick = dataclasses.replace(
        _table(), protocol="CPU quick profile: 2,000 train, 1,000 test, 1 seed"
    )
    assert quick.format().splitlines()[:2] == [
        "Model       NER F1         NCC Acc        Protocol",
        "sahajBERT   95.00 ± 1.00   92.00 ± 0.00   "
        "(CPU quick profile: 2,000 train, 1,000 test, 1 seed)",
    ]
    markdown = quick.to_markdown(paper=True).splitlines()
    assert markdown[0] == "| Model | NER F1 | NCC Acc | Protocol |"
    assert markdown[-1] == (
        "| bnRoBERTa (paper) | 82.32 ± 0.67 | 80.94 ± 0.45 | (paper: all data, 3 seeds) |"
    )
    quick.save(tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["protocol"] == quick.protocol
    assert json.loads(_table().save(tmp_path)[0].read_text())["protocol"] is None


def test_table_files(tmp_path: Path) -> None:
    written = _table().save(tmp_path)
    assert [p.name for p in written] == ["results.json", "results.csv", "runs.csv"]
    data = json.loads((tmp_path / "results.json").read_text())
    ner = data["models"][0]["results"]["ner"]
    assert ner["n"] == 3 and abs(ner["mean"] - 0.95) < 1e-12 and abs(ner["std"] - 0.01) < 1e-12
    assert [run["seed"] for run in ner["runs"]] == [0, 1, 2]
    assert data["models"][1]["results"]["ncc"] == {
        "metric": "accuracy",
        "mean": None,
        "std": None,
        "n": 0,
        "runs": [],
    }
    summary = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [(r["model"], r["task"], r["n"]) for r in summary] == [
        ("sahajBERT", "ner", "3"),
        ("sahajBERT", "ncc", "3"),
        ("mine", "ner", "1"),
        ("mine", "ncc", "0"),
    ]
    assert len(list(csv.DictReader((tmp_path / "runs.csv").open()))) == 7


def test_series_files(tmp_path: Path) -> None:
    points = tuple(
        SeriesPoint(
            step,
            f"step_{step:06d}",
            None,
            loss,
            {"ner": MeanStd(f1, 0.02, 2)},
            MaskedLMResult("x", mlm, 2.718**mlm, 100, 10),
        )
        for step, loss, f1, mlm in (
            (50, 7.5, 0.2, 6.0),
            (100, None, 0.5, 4.0),
            (150, 3.0, 0.7, 3.0),
        )
    )
    result = SeriesResult(("ner",), points).save(tmp_path)
    assert result.plot_path == tmp_path / "series.png"
    assert result.plot_path.read_bytes()[:8] == PNG_MAGIC
    rows = list(csv.DictReader((tmp_path / "series.csv").open()))
    assert [r["step"] for r in rows] == ["50", "100", "150"]
    assert rows[1]["train_loss"] == "" and float(rows[2]["ner_mean"]) == 0.7
    assert float(rows[0]["mlm_loss"]) == 6.0
    data = json.loads((tmp_path / "series.json").read_text())
    assert data["points"][1]["metrics"]["ner"] == {"mean": 0.5, "std": 0.02, "n": 2}


def test_series_plot_without_tasks(tmp_path: Path) -> None:
    points = (SeriesPoint(1, "a", None, 5.0, {}), SeriesPoint(2, "b", None, 4.0, {}))
    result = SeriesResult((), points).save(tmp_path, stem="loss")
    assert result.plot_path is not None and result.plot_path.name == "loss.png"
    assert result.plot_path.read_bytes()[:8] == PNG_MAGIC

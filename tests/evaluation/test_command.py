"""``kit evaluate ...`` end to end on the tiny checkpoint and datasets."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kit.cli import main
from tests.evaluation import tiny
from tests.evaluation.conftest import TinyWorld


def test_mlm_prints_one_json_line(
    world: TinyWorld, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("\n".join(t for t, _ in tiny.ncc_texts(10, seed=5)), encoding="utf-8")
    assert main(["evaluate", "mlm", str(world.checkpoint), "--heldout", str(heldout)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["model"] == "checkpoint" and line["masked_tokens"] > 0 and line["loss"] > 0


@pytest.fixture
def quiet_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")


@pytest.mark.usefixtures("quiet_datasets")
def test_finetune_prints_the_table_with_the_cpu_profile_column(
    world: TinyWorld,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a CPU the command plans as the notebook does: what is given on the command line is
    kept (2 seeds, 1 epoch), the rest is the quick profile's, and the table says so."""
    arguments = ["evaluate", "finetune", str(world.checkpoint), "--task", "ncc", "--seeds", "2"]
    arguments += ["--no-baselines", "--data", f"ncc={world.ncc}", "--epochs", "1"]
    with caplog.at_level(logging.INFO, logger="kit"):
        code = main([*arguments, "--device", "cpu", "--output", str(tmp_path / "out")])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["Model", "NCC", "Acc", "Protocol"]
    assert lines[1].startswith("checkpoint") and "±" in lines[1]
    assert "(CPU quick profile: 48 train, 16 test, 2 seeds)" in lines[1], lines[1]
    assert "On the CPU: 1 model(s) (no baselines) x 1 task(s) x 2 seed(s)" in caplog.text
    assert (tmp_path / "out" / "results.json").exists()


@pytest.mark.usefixtures("quiet_datasets")
def test_finetune_paper_protocol_takes_what_is_given(
    world: TinyWorld, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["evaluate", "finetune", str(world.checkpoint), "--task", "ncc", "--seeds", "1"]
    arguments += ["--no-baselines", "--data", f"ncc={world.ncc}", "--epochs", "1"]
    assert main([*arguments, "--paper-protocol", "--output", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["Model", "NCC", "Acc"]  # the paper's protocol: no column


def test_finetune_paper_protocol_needs_models(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["evaluate", "finetune", "--paper-protocol", "--no-baselines"]) == 1
    assert "--paper-protocol needs the models to judge - help:" in caplog.text


@pytest.mark.processes
@pytest.mark.timeout(600)  # + the session's one `kit demo` run, if first
@pytest.mark.usefixtures("quiet_datasets")
def test_finetune_without_models_judges_the_runs_first_and_newest_checkpoints(
    world: TinyWorld,
    demo_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``kit evaluate finetune --run DEMO`` on a CPU: the checkpoints of ``kit demo
    --work-dir``, first and newest, with the quick profile (its 3 epochs, 1 seed)."""
    from kit import evaluate

    series = evaluate.list_checkpoints(demo_run / "coordinator" / "checkpoints")
    judged = [series[0], series[-1]] if len(series) > 1 else series[-1:]
    labels = [f"this run (step {checkpoint.step})" for checkpoint in judged]
    arguments = ["evaluate", "finetune", "--run", str(demo_run), "--task", "ncc"]
    arguments += ["--data", f"ncc={world.ncc}", "--device", "cpu"]
    with caplog.at_level(logging.INFO, logger="kit"):
        assert main([*arguments, "--output", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["Model", "NCC", "Acc", "Protocol"]
    rows = lines[1:]
    assert len(rows) == len(labels)
    for label, row in zip(labels, rows, strict=True):
        assert row.startswith(label) and row.endswith(
            "(CPU quick profile: 48 train, 16 test, 1 seed)"
        ), row
    assert ", ".join(labels) in caplog.text and "3 epoch(s)" in caplog.text


def test_bad_task_is_an_error_line(world: TinyWorld, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        code = main(
            ["evaluate", "finetune", str(world.checkpoint), "--task", "pos", "--no-baselines"]
        )
    assert code == 1
    assert "unknown evaluation task 'pos'" in caplog.text


def test_bad_data_argument(world: TinyWorld, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        code = main(["evaluate", "series", str(world.root), "--data", "ner"])
    assert code == 1 and "--data expects TASK=PATH" in caplog.text


def test_series_on_a_cpu_uses_the_quick_profile_with_what_is_given_on_top(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kit import evaluate

    seen: list[dict] = []

    class Result:
        def to_dict(self) -> dict:
            return {"points": [{"step": 1}]}

    def series(source: str, **kwargs: object) -> Result:
        seen.append(kwargs)
        return Result()

    monkeypatch.setattr(evaluate, "evaluate_series", series)
    with caplog.at_level(logging.INFO, logger="kit"):
        assert main(["evaluate", "series", "run/", "--device", "cpu", "--epochs", "1"]) == 0
    config = seen[0]["config"]
    assert (config.max_train_examples, config.max_eval_examples) == (2_000, 1_000)  # the profile
    assert config.num_epochs == 1  # given
    assert "on a CPU: at every checkpoint the first 2000 training" in caplog.text

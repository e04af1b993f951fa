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


def test_finetune_prints_the_table(
    world: TinyWorld,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datasets

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    code = main(
        [
            "evaluate",
            "finetune",
            str(world.checkpoint),
            "--task",
            "ncc",
            "--seeds",
            "2",
            "--no-baselines",
            "--data",
            f"ncc={world.ncc}",
            "--epochs",
            "1",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["Model", "NCC", "Acc"]
    assert lines[1].startswith("checkpoint") and "±" in lines[1]
    assert (tmp_path / "out" / "results.json").exists()


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

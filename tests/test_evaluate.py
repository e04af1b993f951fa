"""``kit.evaluate``: the paper's table over 3 seeds, a checkpoint series plot, bad input, notebook."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from kit import evaluate
from kit.errors import (
    CheckpointError,
    ConfigError,
    DatasetSchemaError,
    UnknownTask,
    VocabularyMismatch,
)
from tests.evaluation import tiny
from tests.evaluation.conftest import one_torch_thread  # noqa: F401  (autouse fixture)

QUICK = evaluate.FinetuneConfig(
    learning_rate=1e-2, num_epochs=3, batch_size=8, warmup_ratio=0.0, patience=None, device="cpu"
)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("evaluate")
    tokenizer = tiny.make_tokenizer(root / "tokenizer")
    cache = str(root / "datasets-cache")
    return {
        "root": root,
        "tokenizer": tokenizer,
        "checkpoint": tiny.make_checkpoint(root / "final", tokenizer),
        "datasets": {
            "ner": evaluate.DatasetSource(
                str(tiny.make_ner_dataset(root / "ner")), cache_dir=cache
            ),
            "ncc": evaluate.DatasetSource(
                str(tiny.make_ncc_dataset(root / "ncc")), cache_dir=cache
            ),
        },
    }


def _sample_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_three_seeds_mean_std_table(inputs: dict, tmp_path: Path) -> None:
    table = evaluate.compare(
        [inputs["checkpoint"]],
        seeds=3,
        baselines=(),
        datasets=inputs["datasets"],
        config=QUICK,
        output_dir=tmp_path,
        progress=False,
    )
    (row,) = table.rows
    assert row.name == "final" and table.tasks == ("ner", "ncc")
    cells = []
    for task in ("ner", "ncc"):
        values = [run.value for run in row.runs[task]]
        assert [run.seed for run in row.runs[task]] == [0, 1, 2]
        assert all(0.0 <= v <= 1.0 for v in values)
        mean, std = sum(values) / 3, _sample_std(values)
        assert row.summary(task).mean == pytest.approx(mean)
        assert row.summary(task).std == pytest.approx(std)
        cells.append(f"{100 * mean:.2f} ± {100 * std:.2f}")
    lines = table.format().splitlines()
    assert lines[0].split() == ["Model", "NER", "F1", "NCC", "Acc"]
    assert lines[1].split("   ")[0] == "final"
    assert [cell.strip() for cell in lines[1].split("   ")[1:] if cell.strip()] == cells
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["models"][0]["results"]["ner"]["n"] == 3
    assert saved["config"]["learning_rate"] == QUICK.learning_rate


def test_default_baselines_are_the_papers() -> None:
    names = [b.label for b in evaluate.DEFAULT_BASELINES]
    assert names == ["XLM-R large", "IndicBERT", "bnRoBERTa"]
    assert set(evaluate.PAPER_RESULTS) == {"sahajBERT", *names}
    assert (
        evaluate.DEFAULT_BASELINES[2].source == "neuralspace-reverie/indic-transformers-bn-roberta"
    )


def test_checkpoint_series_plot(inputs: dict, tmp_path: Path) -> None:
    run = tmp_path / "checkpoints"
    for step, loss, seed in ((500, 3.5, 2), (100, 7.25, 1), (900, None, 3), (1300, 2.0, 4)):
        folder = tiny.make_checkpoint(run / f"step_{step:06d}", inputs["tokenizer"], seed=seed)
        evaluate.write_checkpoint_info(folder, step=step, loss=loss)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("\n".join(t for t, _ in tiny.ncc_texts(12, seed=3)), encoding="utf-8")
    result = evaluate.evaluate_series(
        run,
        tasks=("ner",),
        seeds=1,
        heldout_texts=heldout,
        max_points=3,
        datasets=inputs["datasets"],
        config=QUICK,
        output_dir=tmp_path / "out",
        progress=False,
    )
    assert [p.step for p in result.points] == [100, 900, 1300]  # 3 of 4, first and last kept
    assert [p.train_loss for p in result.points] == [7.25, None, 2.0]
    assert all(p.mlm is not None and p.mlm.masked_tokens > 0 for p in result.points)
    assert result.plot_path == tmp_path / "out" / "series.png"
    assert result.plot_path.read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader((tmp_path / "out" / "series.csv").open()))
    assert [int(r["step"]) for r in rows] == [100, 900, 1300]
    assert all(0.0 <= float(r["ner_mean"]) <= 1.0 for r in rows)
    assert json.loads((tmp_path / "out" / "series.json").read_text())["tasks"] == ["ner"]


def test_unknown_task_fails_before_any_work(inputs: dict) -> None:
    with pytest.raises(UnknownTask, match="'pos'"):
        evaluate.compare(["does/not-matter"], tasks=("ner", "pos"), baselines=())
    with pytest.raises(UnknownTask):
        evaluate.compare([inputs["checkpoint"]], baselines=(), datasets={"posh": "x"})


def test_dataset_without_expected_columns(inputs: dict, tmp_path: Path) -> None:
    folder = tmp_path / "news"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"headline": "x", "label": 1}\n', encoding="utf-8")
    with pytest.raises(DatasetSchemaError, match="lacks column\\(s\\) text"):
        evaluate.compare(
            [inputs["checkpoint"]],
            tasks=("ncc",),
            baselines=(),
            datasets={
                "ncc": evaluate.DatasetSource(str(folder), cache_dir=str(tmp_path / "cache"))
            },
            progress=False,
        )


def test_vocabulary_that_does_not_fit(inputs: dict, tmp_path: Path) -> None:
    small = tiny.make_checkpoint(tmp_path / "small", inputs["tokenizer"], vocab_size=50)
    with pytest.raises(VocabularyMismatch, match="50 token embeddings"):
        evaluate.compare(
            [small],
            tasks=("ncc",),
            baselines=(),
            seeds=1,
            datasets=inputs["datasets"],
            config=QUICK,
            progress=False,
        )


def test_series_folder_given_as_one_checkpoint(inputs: dict, tmp_path: Path) -> None:
    evaluate.write_checkpoint_info(tmp_path / "step_000001", step=1, loss=None)
    with pytest.raises(CheckpointError, match="use evaluate_series"):
        evaluate.compare(
            [tmp_path],
            tasks=("ncc",),
            baselines=(),
            seeds=1,
            datasets=inputs["datasets"],
            config=QUICK,
            progress=False,
        )


def test_bad_seeds_and_nothing_to_do(inputs: dict) -> None:
    with pytest.raises(ConfigError, match="seeds"):
        evaluate.compare([inputs["checkpoint"]], seeds=0, baselines=())
    with pytest.raises(ConfigError, match="nothing to measure"):
        evaluate.evaluate_series(inputs["root"], tasks=())
    with pytest.raises(ConfigError, match="max_points"):
        evaluate.evaluate_series(inputs["root"], max_points=0)


@pytest.mark.notebooks
def test_notebook_on_a_cpu_judges_the_runs_checkpoint_once_and_says_how_long_first(
    inputs: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat
    from nbclient import NotebookClient

    from kit.config import RunConfig

    run = tmp_path / "checkpoints"
    for step, seed in ((10, 1), (20, 2)):
        folder = tiny.make_checkpoint(run / f"step_{step:06d}", inputs["tokenizer"], seed=seed)
        evaluate.write_checkpoint_info(folder, step=step, loss=10.0 / step)
    config = RunConfig.tiny_demo()  # the run the organizer wrote, checkpoints saved here
    run_yaml = tmp_path / "run.yaml"
    RunConfig.from_dict(
        {**config.to_dict(), "checkpoint": {**config.to_dict()["checkpoint"], "folder": str(run)}}
    ).to_file(run_yaml)
    notebook = nbformat.read(REPO / "notebooks" / "evaluate.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    datasets = {task: source.path for task, source in inputs["datasets"].items()}
    for name, value in {  # the defaults stay: CHECKPOINTS, SEEDS and BASELINES are None
        "RUN_YAML, STATE_DIR": (str(run_yaml), str(tmp_path)),
        "SERIES": str(run),
        "DATASETS": datasets,
        "FINETUNE": {"num_epochs": 2, "batch_size": 8, "learning_rate": 1e-2, "device": "cpu"},
        "OUTPUT_DIR": str(tmp_path / "out"),
    }.items():
        source, found = re.subn(
            rf"^{re.escape(name)} = .*$", f"{name} = {value!r}", parameters.source, flags=re.M
        )
        assert found == 1, name
        parameters.source = source
    assert re.search(r"^CHECKPOINTS = None$", parameters.source, re.M)
    assert re.search(r"^SEEDS = None$", parameters.source, re.M)
    assert re.search(r"^BASELINES = None$", parameters.source, re.M)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    NotebookClient(
        notebook, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(REPO)}}
    ).execute()
    outputs = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    ]
    printed = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    first = printed.splitlines()[0]
    assert first.startswith("On the CPU: 1 model(s) (no baselines) x 2 task(s) x 1 seed(s)"), first
    assert "step_000020" in first and re.search(r"Estimated time: \d+ (s|min)", first), first
    shown = [o for o in outputs if o.get("output_type") == "display_data"]
    markdown = [o["data"]["text/markdown"] for o in shown if "text/markdown" in o["data"]]
    assert any("this run (step_000020)" in text and "(paper)" in text for text in markdown)
    assert any("image/png" in o["data"] for o in shown)
    with (tmp_path / "out" / "runs.csv").open() as file:
        runs = list(csv.DictReader(file))
    assert len(runs) == 2 and {row["seed"] for row in runs} == {"0"}  # one seed, two tasks
    assert (tmp_path / "out" / "series.png").exists()


def test_the_plan_follows_the_device_and_estimates_from_one_timed_step(
    inputs: dict, tmp_path: Path
) -> None:
    from kit.evaluation.plan import SPLIT_SIZES

    cpu = evaluate.plan_evaluation(
        run_yaml=tmp_path / "none.yaml", device="cpu", step=lambda *_: 0.5
    )
    assert [c.source for c in cpu.checkpoints] == ["neuropark/sahajBERT"]  # no run here
    assert cpu.baselines == () and cpu.seeds == 1
    steps = sum(
        (math.ceil(size["train"] / 32) + math.ceil((size["validation"] + size["test"]) / 64) * 0.35)
        * 20
        for size in SPLIT_SIZES.values()
    )
    assert cpu.seconds == pytest.approx(steps * 0.5)
    gpu = evaluate.plan_evaluation(
        run_yaml=tmp_path / "none.yaml", device="cuda", step=lambda *_: 0.01
    )
    names = [c.name for c in gpu.baselines]
    assert names == ["sahajBERT", "XLM-R large", "IndicBERT", "bnRoBERTa"] and gpu.seeds == 3
    assert gpu.checkpoints == () and gpu.seconds == pytest.approx(steps * 0.01 * 3 * 4)
    assert "On the CUDA: 4 model(s) (4 baselines) x 2 task(s) x 3 seed(s)" in gpu.text()
    # A real timed step of a local checkpoint's architecture (random weights, nothing downloaded).
    timed = evaluate.plan_evaluation(
        [inputs["checkpoint"]], seeds=1, baselines=[], device="cpu", config=QUICK
    )
    assert timed.seconds is not None and 0 < timed.seconds < 3600

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


#: The whole notebook on the demo's checkpoints with tiny task data (~1 min; its normal run here).
NOTEBOOK_TIMEOUT = 300


@pytest.mark.notebooks
@pytest.mark.processes
@pytest.mark.timeout(NOTEBOOK_TIMEOUT + 400)  # + the session's one `kit demo` run, if first
def test_evaluate_notebook_cpu_quick_profile_judges_the_demos_first_and_newest_checkpoints(
    inputs: dict, demo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """notebooks/evaluate.ipynb headless with its CPU defaults (CHECKPOINTS, SEEDS, BASELINES,
    FINETUNE as shipped) on what `kit demo --work-dir` left, with tiny local task data: the plan
    is printed first, and the table carries the quick profile's column, whose numbers are the
    plan's (the profile's 2,000 / 1,000, cut to the tiny splits' 48 / 16)."""
    import nbformat
    from nbclient import NotebookClient

    series = evaluate.list_checkpoints(demo_run / "coordinator" / "checkpoints")
    judged = [series[0], series[-1]] if len(series) > 1 else series[-1:]
    labels = [f"this run (step {checkpoint.step})" for checkpoint in judged]
    datasets = {task: source.path for task, source in inputs["datasets"].items()}
    plan = evaluate.plan_evaluation(run=demo_run, datasets=inputs["datasets"], device="cpu")
    assert [c.label for c in plan.checkpoints] == labels
    assert plan.protocol == "CPU quick profile: 48 train, 16 test, 1 seed"
    column = f"({plan.protocol})"
    notebook = nbformat.read(REPO / "notebooks" / "evaluate.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    for name, value in {  # everything else as shipped: CPU defaults
        "RUN": str(demo_run),
        "SERIES": str(demo_run / "coordinator" / "checkpoints"),
        "DATASETS": datasets,
        "OUTPUT_DIR": str(tmp_path / "out"),
    }.items():
        source, found = re.subn(
            rf"^{re.escape(name)} = .*$", f"{name} = {value!r}", parameters.source, flags=re.M
        )
        assert found == 1, name
        parameters.source = source
    for name in ("CHECKPOINTS", "SEEDS", "BASELINES", "STATE_DIR"):
        assert re.search(rf"^{name} = None$", parameters.source, re.M), name
    assert re.search(r"^FINETUNE = \{\}$", parameters.source, re.M)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # this checkout's kit, from any folder
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU, even on a GPU machine
    workdir = tmp_path / "notebooks"  # where Binder runs it: not the repository root
    workdir.mkdir()
    NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=NOTEBOOK_TIMEOUT,
        resources={"metadata": {"path": str(workdir)}},
    ).execute()
    outputs = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    ]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    first = printed.splitlines()[0]
    models = f"{len(judged)} model(s) (no baselines) x 2 task(s) x 1 seed(s)"
    assert first.startswith(f"On the CPU: {models}"), first
    assert ", ".join(labels) in first and re.search(r"Estimated time: \d+ (s|min)", first)
    assert f"{plan.protocol}, 3 epoch(s)." in first, first
    assert "Not done here:" in first and "epochs 4-20" in first and "2 more seed(s)" in first
    assert "the baselines (sahajBERT, XLM-R large, IndicBERT, bnRoBERTa)" in first
    shown = [o for o in outputs if o.get("output_type") == "display_data"]
    (table,) = [o["data"]["text/markdown"] for o in shown if "text/markdown" in o["data"]]
    lines = table.splitlines()
    assert lines[0] == "| Model | NER F1 | NCC Acc | Protocol |", lines[0]
    for label, line in zip(labels, lines[2:], strict=False):
        assert line.startswith(f"| {label} | ") and line.endswith(f" | {column} |"), line
    assert "| sahajBERT (paper) | 95.45 ± 0.53 | 91.97 ± 0.47 | (paper: all data, 3 seeds) |" in (
        lines
    )
    assert any("image/png" in o["data"] for o in shown)  # the series plot
    with (tmp_path / "out" / "runs.csv").open() as file:
        runs = list(csv.DictReader(file))
    assert [(row["model"], row["task"], row["seed"]) for row in runs] == [
        (label, task, "0") for label in labels for task in ("ner", "ncc")
    ]
    assert all(int(row["epochs_run"]) <= 3 for row in runs)  # the profile's epochs
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["protocol"] == plan.protocol
    assert saved["config"]["max_train_examples"] == 2_000 and saved["config"]["num_epochs"] == 3
    assert (tmp_path / "out" / "series.png").exists()


def test_the_plan_follows_the_device_and_estimates_from_one_timed_step(
    inputs: dict, tmp_path: Path
) -> None:
    from kit.evaluation.plan import SPLIT_SIZES

    cpu = evaluate.plan_evaluation(run=tmp_path / "none", device="cpu", step=lambda *_: 0.5)
    assert [c.source for c in cpu.checkpoints] == ["neuropark/sahajBERT"]  # no run here
    assert cpu.baselines == () and cpu.seeds == 1
    # The CPU quick profile: 2,000 training and 1,000 validation/test examples, 3 epochs.
    quick = sum((math.ceil(2_000 / 32) + math.ceil(2_000 / 64) * 0.35) * 3 for _ in SPLIT_SIZES)
    assert cpu.seconds == pytest.approx(quick * 0.5)
    steps = sum(
        (math.ceil(size["train"] / 32) + math.ceil((size["validation"] + size["test"]) / 64) * 0.35)
        * 20
        for size in SPLIT_SIZES.values()
    )
    gpu = evaluate.plan_evaluation(run=tmp_path / "none", device="cuda", step=lambda *_: 0.01)
    names = [c.name for c in gpu.baselines]
    assert names == ["sahajBERT", "XLM-R large", "IndicBERT", "bnRoBERTa"] and gpu.seeds == 3
    assert gpu.checkpoints == () and gpu.seconds == pytest.approx(steps * 0.01 * 3 * 4)
    assert "On the CUDA: 4 model(s) (4 baselines) x 2 task(s) x 3 seed(s)" in gpu.text()
    # A real timed step of a local checkpoint's architecture (random weights, nothing downloaded).
    timed = evaluate.plan_evaluation(
        [inputs["checkpoint"]], seeds=1, baselines=[], device="cpu", config=QUICK
    )
    assert timed.seconds is not None and 0 < timed.seconds < 3600

"""The CPU quick profile and the plan's choice by device: a CPU gets the profile (a subset, 3
epochs, one seed, the run's first and newest checkpoints, no baselines) and says what it leaves
out; a GPU gets the paper's protocol unchanged. Where the run is: a folder, a run.yaml, a Hub repo.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kit.config import RunConfig
from kit.evaluation.checkpoints import Checkpoint
from kit.evaluation.finetune import FinetuneConfig
from kit.evaluation.plan import (
    DEFAULT_BASELINES,
    PAPER_SEEDS,
    SAHAJBERT,
    SPLIT_SIZES,
    plan_evaluation,
    run_checkpoints,
)
from kit.evaluation.profile import (
    CPU_QUICK,
    PAPER_EPOCHS,
    QuickProfile,
    Subset,
    left_out,
    protocol_label,
    subsets,
)
from kit.training.checkpoint_format import commit_title, write_checkpoint_info
from tests.evaluation import tiny
from tests.evaluation.conftest import TinyWorld

PAPER_MODELS = ["sahajBERT", "XLM-R large", "IndicBERT", "bnRoBERTa"]


def make_run(root: Path, world: TinyWorld, steps: tuple[int, ...] = (5, 10, 15)) -> Path:
    """A run folder as the config notebook leaves it: run.yaml, coordinator/checkpoints/."""
    root.mkdir(parents=True, exist_ok=True)
    config = RunConfig.tiny_demo().to_dict()
    config["checkpoint"]["folder"] = "checkpoints"  # relative: the coordinator's state folder
    RunConfig.from_dict(config).to_file(root / "run.yaml")
    for step in steps:
        folder = root / "coordinator" / "checkpoints" / f"step_{step:06d}"
        tiny.make_checkpoint(folder, world.tokenizer, seed=step)
        write_checkpoint_info(folder, step=step, loss=10.0 / step)
    return root


def test_the_profile_is_a_fixed_subset_few_epochs_one_seed() -> None:
    expected = QuickProfile(train_examples=2_000, eval_examples=1_000, num_epochs=3, seeds=1)
    assert expected == CPU_QUICK
    config = FinetuneConfig(**CPU_QUICK.finetune_settings())
    used = subsets(config, SPLIT_SIZES, ("ner", "ncc"))
    assert used == {
        "ner": Subset(train=2_000, test=1_000, full_train=10_000, full_test=1_000),
        "ncc": Subset(train=2_000, test=1_000, full_train=11_284, full_test=1_411),
    }
    assert protocol_label(used, 1) == "CPU quick profile: 2,000 train, 1,000 test, 1 seed"
    small = {"ner": Subset(48, 16, 48, 16), "ncc": Subset(40, 16, 40, 16)}
    assert protocol_label(small, 3) == "CPU quick profile: NER 48 / NCC 40 train, 16 test, 3 seeds"
    missing = left_out(
        used,
        epochs=3,
        seeds=1,
        paper_seeds=3,
        baselines=PAPER_MODELS,
        skipped_checkpoints=4,
    )
    assert missing == (
        "the rest of the training data (NER 2,000 of 10,000, NCC 2,000 of 11,284)",
        "the rest of the test data (NCC 1,000 of 1,411)",
        f"epochs 4-{PAPER_EPOCHS}",
        "2 more seed(s) (the paper's mean ± std of 3)",
        "the baselines (sahajBERT, XLM-R large, IndicBERT, bnRoBERTa)",
        "4 checkpoint(s) between the first and the newest",
    )
    everything = {"ner": Subset(10, 5, 10, 5)}
    done = left_out(
        everything, epochs=20, seeds=3, paper_seeds=3, baselines=(), skipped_checkpoints=0
    )
    assert done == ()


def test_a_cpu_plan_takes_the_quick_profile_and_says_what_it_leaves_out(
    world: TinyWorld, tmp_path: Path
) -> None:
    run = make_run(tmp_path, world)
    plan = plan_evaluation(run=run, device="cpu", step=lambda *_: 0.5)
    assert [c.label for c in plan.checkpoints] == ["this run (step 5)", "this run (step 15)"]
    assert plan.baselines == () and plan.seeds == 1
    assert plan.config == FinetuneConfig(
        max_train_examples=2_000, max_eval_examples=1_000, num_epochs=3
    )
    assert plan.protocol == "CPU quick profile: 2,000 train, 1,000 test, 1 seed"
    assert "1 checkpoint(s) between the first and the newest" in plan.left_out
    assert "the baselines (sahajBERT, XLM-R large, IndicBERT, bnRoBERTa)" in plan.left_out
    steps = sum((math.ceil(2_000 / 32) + math.ceil(2 * 1_000 / 64) * 0.35) * 3 for _ in SPLIT_SIZES)
    assert plan.seconds == pytest.approx(2 * steps * 0.5)  # two models
    text = plan.text()
    assert text.startswith("On the CPU: 2 model(s) (no baselines) x 2 task(s) x 1 seed(s)")
    assert "first and newest checkpoints: this run (step 5), this run (step 15)" in text
    assert "CPU quick profile: 2,000 train, 1,000 test, 1 seed, 3 epoch(s)." in text
    assert "Not done here: the rest of the training data" in text
    # The notebook's FINETUNE goes over the profile; local data is counted, not assumed.
    datasets = {"ner": str(world.ner), "ncc": str(world.ncc)}
    small = plan_evaluation(
        run=run / "run.yaml",
        device="cpu",
        finetune={"max_train_examples": 20, "num_epochs": 2},
        datasets=datasets,
        step=lambda *_: 0.5,
    )
    assert small.config.num_epochs == 2 and small.config.max_eval_examples == 1_000
    assert small.protocol == "CPU quick profile: 20 train, 16 test, 1 seed"
    assert "the rest of the training data (NER 20 of 48, NCC 20 of 48)" in small.left_out
    # One checkpoint in the run: that one; none: the published sahajBERT.
    lone = make_run(tmp_path / "lone", world, steps=(7,))
    assert [
        c.label for c in plan_evaluation(run=lone, device="cpu", step=lambda *_: 0).checkpoints
    ] == ["this run (step 7)"]
    nothing = plan_evaluation(run=tmp_path / "nowhere", device="cpu", step=lambda *_: 0)
    assert nothing.checkpoints == (SAHAJBERT,) and "no run with a checkpoint at" in nothing.why


def test_a_gpu_plan_keeps_the_papers_protocol(world: TinyWorld, tmp_path: Path) -> None:
    run = make_run(tmp_path, world)
    plan = plan_evaluation(run=run, device="cuda", step=lambda *_: 0.01)
    assert [c.label for c in plan.checkpoints] == ["this run (step 15)"]  # the newest
    assert [c.label for c in plan.baselines] == PAPER_MODELS
    assert plan.baselines == (SAHAJBERT, *DEFAULT_BASELINES) and plan.seeds == PAPER_SEEDS == 3
    assert plan.config == FinetuneConfig()  # every example, up to 20 epochs
    assert plan.protocol is None and plan.left_out == ()
    assert "quick profile" not in plan.text() and "Not done" not in plan.text()
    tuned = plan_evaluation(
        run=run, device="cuda", finetune={"learning_rate": 1e-5}, step=lambda *_: 0.01
    )
    assert tuned.config == FinetuneConfig(learning_rate=1e-5) and tuned.protocol is None


def test_the_run_is_found_beside_its_run_yaml_or_in_its_state_folder(
    world: TinyWorld, tmp_path: Path
) -> None:
    run = make_run(tmp_path / "organizer", world)
    by_folder = run_checkpoints(run)
    assert [c.step for c in by_folder] == [5, 10, 15]
    assert run_checkpoints(run / "run.yaml") == by_folder
    moved = tmp_path / "state"
    (run / "coordinator").rename(moved)
    assert run_checkpoints(run) == []
    assert [c.step for c in run_checkpoints(run, moved)] == [5, 10, 15]
    assert run_checkpoints(tmp_path / "no-such-folder") == []
    assert run_checkpoints("../no-such-demo") == []  # a missing folder, not a Hub repo


def test_a_hub_repo_run_is_its_step_commits(world: TinyWorld, tmp_path: Path) -> None:
    from kit.testing.fake_hub import FakeHub

    repo = "neuropark/tiny-run"
    with FakeHub() as hub, hub.patched_client(tmp_path / "hf"):
        hub.create_repo(repo)
        for step in (3, 6, 9):
            folder = tiny.make_checkpoint(tmp_path / f"s{step}", world.tokenizer, seed=step)
            files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
            hub.commit(repo, files, commit_title(step, 1.0 / step))
        hub.commit(repo, {"README.md": b"# tiny\n"}, "Update README.md")
        oids = {commit.title: commit.oid for commit in hub.commits(repo)}
        plan = plan_evaluation(run=repo, device="cpu", step=lambda *_: 0.0)
        assert [c.label for c in plan.checkpoints] == ["this run (step 3)", "this run (step 9)"]
        assert [c.revision for c in plan.checkpoints] == [
            oids[commit_title(3, 1 / 3)],
            oids[commit_title(9, 1 / 9)],
        ]
        # A run.yaml whose checkpoints go to that repo reads the same history.
        config = RunConfig.tiny_demo().to_dict()
        config["checkpoint"]["hub_repo"] = repo
        RunConfig.from_dict(config).to_file(tmp_path / "run.yaml")
        assert [c.step for c in run_checkpoints(tmp_path)] == [3, 6, 9]
        assert run_checkpoints(tmp_path) == run_checkpoints(repo)
        # A model repo without "step N" commits is judged as it is now.
        hub.create_repo("neuropark/plain")
        hub.commit("neuropark/plain", {"README.md": b"# plain\n"}, "Update README.md")
        assert run_checkpoints("neuropark/plain") == [
            Checkpoint("neuropark/plain", name="this run")
        ]

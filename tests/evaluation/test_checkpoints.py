"""Checkpoints: the kit_checkpoint.json series format, Hub commit series, vocabulary checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kit.errors import CheckpointError, VocabularyMismatch
from kit.evaluation.checkpoints import (
    Checkpoint,
    as_checkpoint,
    check_vocabulary,
    list_checkpoints,
    resolve_device,
    resolve_endpoint,
)
from kit.evaluation.mlm import masked_lm_loss
from kit.training.checkpoint_format import (
    CHECKPOINT_INFO_FILE,
    parse_commit_title,
    read_checkpoint_info,
    write_checkpoint_info,
)
from tests.evaluation import tiny
from tests.evaluation.conftest import TinyWorld

HELDOUT = [" ".join(words) for words, _ in tiny.ner_sentences(12, seed=99)]


def test_checkpoint_info_round_trip(tmp_path: Path) -> None:
    path = write_checkpoint_info(tmp_path / "step_000120", step=120, loss=3.21, peers=7)
    assert path.name == CHECKPOINT_INFO_FILE
    assert json.loads(path.read_text()) == {"step": 120, "loss": 3.21, "peers": 7}
    assert read_checkpoint_info(path.parent)["step"] == 120
    write_checkpoint_info(tmp_path / "diverged", step=5, loss=math.nan)  # JSON has no NaN
    assert read_checkpoint_info(tmp_path / "diverged")["loss"] is None


@pytest.mark.parametrize(
    ("record", "complaint"),
    [
        ('{"loss": 1.0}', "'step'"),
        ('{"step": -1, "loss": 1.0}', "'step'"),
        ('{"step": "7", "loss": 1.0}', "'step'"),
        ('{"step": 7, "loss": "low"}', "'loss'"),
        ("[7]", "JSON object"),
        ("{step: 7", "not readable JSON"),
    ],
)
def test_malformed_checkpoint_info_is_refused(tmp_path: Path, record: str, complaint: str) -> None:
    (tmp_path / CHECKPOINT_INFO_FILE).write_text(record)
    with pytest.raises(CheckpointError, match=complaint) as caught:
        read_checkpoint_info(tmp_path)
    assert "help:" in str(caught.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint_info(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("title", "expected"),
    [
        ("Step 19519, loss 1.999", (19519, 1.999)),
        ("step 120, loss 3.21", (120, 3.21)),
        ("Epoch 12, loss 2e-1", (12, 0.2)),
        ("step=5 loss=nan", (5, math.nan)),
        ("Step 29", (29, None)),
        ("initial commit", (None, None)),
        ("Update README.md", (None, None)),
    ],
)
def test_parse_commit_title(title: str, expected: tuple) -> None:
    step, loss = parse_commit_title(title)
    assert step == expected[0]
    if expected[1] is None:
        assert loss is None
    elif math.isnan(expected[1]):
        assert loss is not None and math.isnan(loss)
    else:
        assert loss == pytest.approx(expected[1])


def test_local_series_sorted_by_step(tmp_path: Path) -> None:
    for step, loss in ((300, 2.5), (50, None), (1000, 1.75)):
        write_checkpoint_info(tmp_path / f"step_{step:06d}", step=step, loss=loss)
    (tmp_path / "notes").mkdir()  # not a checkpoint: ignored
    found = list_checkpoints(tmp_path, tokenizer="tok")
    assert [(c.step, c.loss) for c in found] == [(50, None), (300, 2.5), (1000, 1.75)]
    assert found[0].label == "step_000050" and found[0].tokenizer == "tok"
    assert [c.step for c in list_checkpoints(tmp_path / "step_000300")] == [300]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no subfolder holds a kit_checkpoint.json"):
        list_checkpoints(tmp_path / "empty")


def test_checkpoint_labels_and_parsing(tmp_path: Path) -> None:
    assert as_checkpoint("neuropark/sahajBERT@abc123").revision == "abc123"
    assert Checkpoint("neuropark/sahajBERT").label == "sahajBERT"
    assert Checkpoint("neuropark/sahajBERT", revision="0123456789ab").label == "sahajBERT@01234567"
    assert as_checkpoint(tmp_path).label == tmp_path.name
    assert Checkpoint("x/y", name="mine").label == "mine"


def test_vocabulary_check() -> None:
    checkpoint = Checkpoint("run/final")
    check_vocabulary(checkpoint, 32000, 32000)
    check_vocabulary(checkpoint, 32064, 32000)  # padded to a multiple of 64: fine
    with pytest.raises(VocabularyMismatch) as caught:
        check_vocabulary(checkpoint, 32000, 32001)
    assert "32000 token embeddings" in str(caught.value) and "help:" in str(caught.value)
    # The run's own tokenizer, saved with the checkpoint: a table larger than what it learned.
    check_vocabulary(checkpoint, 8000, 1904)
    with pytest.raises(VocabularyMismatch):  # a tokenizer from elsewhere: another model's
        check_vocabulary(Checkpoint("run/final", tokenizer="other/model"), 32000, 8000)


def test_vocabulary_mismatch_on_load(world: TinyWorld, tmp_path: Path) -> None:
    small = tiny.make_checkpoint(
        tmp_path / "small", world.tokenizer, vocab_size=40, save_tokenizer=False
    )
    checkpoint = Checkpoint(str(small), tokenizer=str(world.checkpoint))
    with pytest.raises(VocabularyMismatch, match="has 40 token embeddings"):
        masked_lm_loss(checkpoint, HELDOUT, progress=False)


def test_device_choice() -> None:
    assert resolve_device("cpu").type == "cpu"
    expected = "cuda" if torch.cuda.is_available() else None
    assert resolve_device().type == (expected or resolve_device().type)
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert resolve_device().type == "cpu"


def test_endpoint_is_read_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert resolve_endpoint() == "http://127.0.0.1:9"
    assert resolve_endpoint("http://other") == "http://other"


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def test_hub_series_loads_each_revision(world: TinyWorld, tmp_path: Path) -> None:
    from kit.testing.fake_hub import FakeHub

    repo = "neuropark/tiny-albert"
    folders = {
        step: tiny.make_checkpoint(tmp_path / f"s{step}", world.tokenizer, seed=step)
        for step in (10, 20)
    }
    with FakeHub() as hub, hub.patched_client(tmp_path / "hf"):
        hub.create_repo(repo)
        for step, loss in ((10, 5.5), (20, 4.25)):
            files = {**_files(folders[step]), "optimizer_state.pt": b"never fetched"}
            hub.commit(repo, files, f"Step {step}, loss {loss}")
        hub.commit(repo, {"README.md": b"# tiny\n"}, "Update README.md")
        found = list_checkpoints(repo)
        assert [(c.step, c.loss) for c in found] == [(10, 5.5), (20, 4.25)]
        oids = {commit.title: commit.oid for commit in hub.commits(repo)}
        assert [c.revision for c in found] == [
            oids["Step 10, loss 5.5"],
            oids["Step 20, loss 4.25"],
        ]
        at_10 = masked_lm_loss(found[0], HELDOUT, progress=False).loss
        at_20 = masked_lm_loss(found[1], HELDOUT, progress=False).loss
        assert not any("optimizer" in r.path for r in hub.requests)
        with pytest.raises(CheckpointError, match="fetching it from the Hub"):
            masked_lm_loss(Checkpoint("neuropark/missing"), HELDOUT, progress=False)
    local_10 = masked_lm_loss(Checkpoint(str(folders[10])), HELDOUT, progress=False).loss
    local_20 = masked_lm_loss(Checkpoint(str(folders[20])), HELDOUT, progress=False).loss
    assert at_10 == pytest.approx(local_10) and at_20 == pytest.approx(local_20)
    assert at_10 != pytest.approx(at_20)  # the revision really selects the weights


def test_hub_repo_without_step_commits(tmp_path: Path) -> None:
    from kit.testing.fake_hub import FakeHub

    with FakeHub() as hub, hub.patched_client(tmp_path / "hf"):
        hub.create_repo("neuropark/empty")
        with pytest.raises(CheckpointError, match="no commit of 'neuropark/empty'"):
            list_checkpoints("neuropark/empty")
        with pytest.raises(CheckpointError, match="neither a local folder nor a Hub repo"):
            list_checkpoints("neuropark/absent")

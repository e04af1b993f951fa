"""Coordinator checkpoints: save/load round trips, pruning, atomicity, pushes to a fake Hub, restore.

The model is a tiny ALBERT built here (nothing downloaded); the Hub is ``kit.testing.FakeHub``
on loopback, talked to by the real ``huggingface_hub`` client.
"""

from __future__ import annotations

import json
import logging
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AlbertConfig, AlbertForPreTraining

from kit.config import CheckpointConfig
from kit.errors import CheckpointRestoreFailed, KitUsageError, MalformedTrainingState
from kit.evaluation.checkpoints import list_checkpoints
from kit.testing.fake_hub import FakeHub
from kit.training import checkpoint_folder
from kit.training.checkpoint_format import commit_title, parse_commit_title
from kit.training.checkpoints import (
    CheckpointManager,
    load_training_state,
    save_checkpoint,
)
from tests.evaluation.conftest import one_torch_thread  # noqa: F401  (autouse fixture)

REPO = "kitorg/albert-ckpt"
WRITE_TOKEN, READ_TOKEN = "hf_coordinator_write", "hf_coordinator_read"


def _schedule(step: int) -> float:
    return 1.0 / (1.0 + step)


class Run:
    """A tiny ALBERT with AdamW and a LambdaLR schedule, trained on one fixed batch."""

    def __init__(self, model: AlbertForPreTraining | None = None, seed: int = 0) -> None:
        torch.manual_seed(seed)
        if model is None:
            config = AlbertConfig(
                vocab_size=40,
                embedding_size=8,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=24,
                max_position_embeddings=16,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                classifier_dropout_prob=0.0,
            )
            model = AlbertForPreTraining(config)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule)
        generator = torch.Generator().manual_seed(1)
        self.batch = {
            "input_ids": torch.randint(0, 40, (2, 8), generator=generator),
            "labels": torch.randint(0, 40, (2, 8), generator=generator),
            "sentence_order_label": torch.tensor([0, 1]),
        }

    def step(self) -> float:
        self.optimizer.zero_grad()
        loss = self.model(**self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return float(loss.detach())

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def save(self, root: Path, step: int, **kwargs: Any) -> Path:
        return save_checkpoint(
            root,
            step,
            self.model,
            self.optimizer.state_dict(),
            self.scheduler.state_dict(),
            loss=kwargs.pop("loss", 3.25),
            run_config=None,
            **kwargs,
        )


def _resume(folder: Path, optimizer_state: dict[str, Any], scheduler_state: Any) -> Run:
    run = Run(AlbertForPreTraining.from_pretrained(folder), seed=99)
    run.optimizer.load_state_dict(optimizer_state)
    run.scheduler.load_state_dict(scheduler_state)
    return run


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.fixture
def trained() -> Run:
    run = Run()
    for _ in range(3):
        run.step()
    return run


def _manager(
    root: Path,
    hub: FakeHub | None = None,
    token: str = WRITE_TOKEN,
    tokenizer_dir: Path | None = None,
    **options: Any,
) -> CheckpointManager:
    config = CheckpointConfig(
        folder=str(root), hub_repo=REPO if hub else None, **{"every_epochs": 10, **options}
    )
    return CheckpointManager(
        config,
        hub_token=token if hub else None,
        endpoint=hub.endpoint if hub else None,
        tokenizer_dir=tokenizer_dir,
    )


# --- one folder ---------------------------------------------------------------------------------


def test_saved_state_resumes_exactly_like_the_original(tmp_path: Path, trained: Run) -> None:
    folder = trained.save(tmp_path, 3, tokenizer_dir=None)
    assert folder == tmp_path / "step_000003"
    step, optimizer_state, scheduler_state, info = load_training_state(folder)
    assert (step, info["loss"], info["version"]) == (3, 3.25, 1)
    assert not any(
        isinstance(v, bytes) for v in json.loads((folder / "training_state.json").read_text())
    )

    resumed = _resume(folder, optimizer_state, scheduler_state)
    _assert_same(resumed.parameters(), trained.parameters())  # the model round-trips exactly
    assert resumed.scheduler.get_last_lr() == trained.scheduler.get_last_lr()
    for _ in range(2):  # and so does the next update: Adam moments, step counts, the LR schedule
        assert resumed.step() == trained.step()
        _assert_same(resumed.parameters(), trained.parameters())


def test_training_state_names_tensors_by_their_path(tmp_path: Path, trained: Run) -> None:
    folder = trained.save(tmp_path, 3)
    names = set(load_file(folder / "training_state.safetensors"))
    assert "optimizer/state/0/exp_avg" in names and "optimizer/state/0/exp_avg_sq" in names
    info = json.loads((folder / "kit_checkpoint.json").read_text())
    assert (info["step"], info["loss"]) == (3, 3.25)


def test_special_floats_tuples_and_int_keys_round_trip(tmp_path: Path, trained: Run) -> None:
    shared = torch.arange(4.0)
    optimizer_state = {
        "state": {0: {"m": shared, "again": shared}, "0": {"x": torch.ones(2, dtype=torch.int64)}},
        "param_groups": [{"betas": (0.9, 0.999), "best": math.inf, "worst": -math.inf, "n": None}],
        "__tensor__": "a key that looks like a tag",
    }
    scheduler_state = {"nan": math.nan, "flags": [True, False]}
    save_checkpoint(
        tmp_path, 7, trained.model, optimizer_state, scheduler_state, loss=None, run_config=None
    )
    step, loaded, scheduler, info = load_training_state(tmp_path / "step_000007")
    assert step == 7 and info["loss"] is None
    assert (
        torch.equal(loaded["state"][0]["m"], shared)
        and loaded["state"][0]["again"] is loaded["state"][0]["m"]
    )
    assert loaded["state"]["0"]["x"].dtype == torch.int64
    assert loaded["param_groups"] == [
        {"betas": (0.9, 0.999), "best": math.inf, "worst": -math.inf, "n": None}
    ]
    assert loaded["__tensor__"] == "a key that looks like a tag"
    assert math.isnan(scheduler["nan"]) and scheduler["flags"] == [True, False]


def test_tokenizer_files_are_copied_without_replacing_model_files(
    tmp_path: Path, trained: Run
) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"fake": true}')
    (tokenizer / "config.json").write_text("not the model config")
    folder = trained.save(tmp_path / "ckpt", 5, tokenizer_dir=tokenizer)
    assert (folder / "tokenizer.json").read_text() == '{"fake": true}'
    assert json.loads((folder / "config.json").read_text())["model_type"] == "albert"


def test_state_that_is_not_plain_data_is_refused(tmp_path: Path, trained: Run) -> None:
    with pytest.raises(KitUsageError, match="optimizer/state/lam"):
        save_checkpoint(
            tmp_path,
            1,
            trained.model,
            {"state": {"lam": object()}},
            None,
            loss=1.0,
            run_config=None,
        )
    assert not (tmp_path / "step_000001").exists()
    assert list((tmp_path / ".incomplete").iterdir()) == []


def _corrupt_json(folder: Path, change: Any) -> None:
    path = folder / "training_state.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "training_state.json").unlink(), "training_state.json is missing"),
        (lambda f: (f / "training_state.safetensors").unlink(), "safetensors is missing"),
        (lambda f: (f / "training_state.json").write_text("{not json"), "cannot read"),
        (lambda f: (f / "training_state.safetensors").write_bytes(b"\x08" * 20), "cannot read"),
        (lambda f: _corrupt_json(f, lambda m: m.update(version=99)), "version-1"),
        (lambda f: _corrupt_json(f, lambda m: m.update(step=-1)), "'step'"),
        (lambda f: _corrupt_json(f, lambda m: m.update(optimizer=[1, 2])), "must be a mapping"),
        (
            lambda f: _corrupt_json(f, lambda m: m.update(optimizer={"__tensor__": "nope"})),
            "missing tensor",
        ),
        (
            lambda f: _corrupt_json(f, lambda m: m.update(scheduler={"__dict__": [[1]]})),
            "pair",
        ),
        (
            lambda f: _corrupt_json(f, lambda m: m.update(optimizer={"state": {}})),
            "nothing uses",
        ),
        (
            lambda f: save_file(
                {"optimizer/state/0/exp_avg": torch.zeros(2, dtype=torch.complex64)},
                f / "training_state.safetensors",
            ),
            "dtype",
        ),
    ],
)
def test_malformed_training_state_raises_a_typed_error(
    tmp_path: Path, trained: Run, damage: Any, message: str
) -> None:
    folder = trained.save(tmp_path, 3)
    damage(folder)
    with pytest.raises(MalformedTrainingState, match=message) as caught:
        load_training_state(folder)
    assert "help:" in str(caught.value)


# --- the manager: saving, pruning, atomicity ----------------------------------------------------


def test_every_epochs_saves_when_a_multiple_is_crossed(tmp_path: Path, trained: Run) -> None:
    manager = _manager(tmp_path, keep_last=10)
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    saved = [
        step
        for step in (0, 3, 9, 10, 10, 11, 19, 21, 29, 40)
        if manager.maybe_save(step, trained.model, *state, loss=2.0, now=0.0) is not None
    ]
    assert saved == [10, 21, 40]  # 20 was never observed: saved at 21, the first step past it
    assert manager.latest() == tmp_path / "step_000040"
    # a restarted coordinator continues the same rhythm from its newest folder
    assert not _manager(tmp_path).is_due(49) and _manager(tmp_path).is_due(50)


def test_prune_keeps_the_last_checkpoints(tmp_path: Path, trained: Run) -> None:
    manager = _manager(tmp_path, every_epochs=1, keep_last=2)
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    for step in (1, 2, 3, 4):
        manager.maybe_save(step, trained.model, *state, loss=2.0, now=0.0)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]  # evaluation lists them too


def test_crash_mid_save_leaves_nothing_latest_would_pick(
    tmp_path: Path, trained: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager(tmp_path)
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    manager.maybe_save(10, trained.model, *state, loss=2.0, now=0.0)

    def killed(*args: Any) -> None:  # the process dies just before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_folder, "publish_folder", killed)
    monkeypatch.setattr(checkpoint_folder, "remove_tree", lambda folder: None)  # and cleans nothing
    with pytest.raises(KeyboardInterrupt):
        manager.maybe_save(20, trained.model, *state, loss=1.0, now=1.0)
    monkeypatch.undo()
    leftovers = list((tmp_path / ".incomplete").iterdir())
    assert len(leftovers) == 1 and (leftovers[0] / "kit_checkpoint.json").exists()  # fully written

    assert manager.latest() == tmp_path / "step_000010"
    assert [c.step for c in list_checkpoints(tmp_path)] == [10]
    restarted = _manager(tmp_path)
    assert restarted.latest() == tmp_path / "step_000010"
    assert not (tmp_path / ".incomplete").exists()  # the new manager cleaned the leftovers
    assert restarted.is_due(20)


def test_saving_a_step_again_replaces_it(tmp_path: Path, trained: Run) -> None:
    trained.save(tmp_path, 10, loss=5.0)
    trained.save(tmp_path, 10, loss=4.0)
    assert load_training_state(tmp_path / "step_000010").info["loss"] == 4.0
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["step_000010"]


def test_save_failure_is_logged_and_retried(
    tmp_path: Path, trained: Run, caplog: pytest.LogCaptureFixture
) -> None:
    manager = _manager(tmp_path / "ckpt", tokenizer_dir=tmp_path / "no-such-tokenizer")
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    with caplog.at_level(logging.ERROR, logger="kit.training.checkpoints"):
        assert manager.maybe_save(10, trained.model, *state, loss=2.0, now=0.0) is None
    assert "help:" in caplog.text and manager.latest() is None
    assert manager.is_due(11)


# --- the Hub ------------------------------------------------------------------------------------


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    real_getaddrinfo = socket.getaddrinfo

    def loopback_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        if str(host) not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"test guard: no network beyond loopback (tried {host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    with FakeHub() as fake:
        fake.add_user("coordinator", token=WRITE_TOKEN, orgs=["kitorg"])
        fake.add_token("coordinator", READ_TOKEN, role="read")
        with fake.patched_client(tmp_path / "hf_home"):
            yield fake


@pytest.mark.sockets
def test_push_commits_the_newest_checkpoint_at_the_repo_root(
    tmp_path: Path, trained: Run, hub: FakeHub
) -> None:
    manager = _manager(tmp_path / "ckpt", hub)
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    assert manager.maybe_push(now=0.0) is None  # nothing saved yet
    manager.maybe_save(10, trained.model, *state, loss=3.14159, now=0.0)
    assert manager.maybe_push(now=0.0) == 10

    head = hub.commits(REPO)[0]
    assert head.title == "step 10, loss 3.1416"
    assert parse_commit_title(head.title) == (10, 3.1416)
    assert {"config.json", "model.safetensors", "training_state.safetensors"} <= set(head.files)
    assert {"training_state.json", "kit_checkpoint.json"} <= set(head.files)
    local = tmp_path / "ckpt" / "step_000010"
    assert (
        head.files["training_state.safetensors"]
        == (local / "training_state.safetensors").read_bytes()
    )
    assert [c.step for c in list_checkpoints(REPO, endpoint=hub.endpoint)] == [10]


@pytest.mark.sockets
def test_pushes_are_rate_limited(tmp_path: Path, trained: Run, hub: FakeHub) -> None:
    manager = _manager(tmp_path / "ckpt", hub, push_every_minutes=10)
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    manager.maybe_save(10, trained.model, *state, loss=3.0, now=0.0)
    assert manager.maybe_push(now=1000.0) == 10
    assert manager.maybe_push(now=1001.0) is None  # nothing new
    manager.maybe_save(20, trained.model, *state, loss=2.0, now=1100.0)
    manager.maybe_save(30, trained.model, *state, loss=1.0, now=1200.0)
    assert manager.maybe_push(now=1000.0 + 599) is None  # too early
    assert manager.maybe_push(now=1000.0 + 600) == 30  # the newest only; 20 is skipped
    titles = [c.title for c in hub.commits(REPO)]
    assert titles == ["step 30, loss 1.0000", "step 10, loss 3.0000", "initial commit"]
    assert [c.step for c in list_checkpoints(REPO, endpoint=hub.endpoint)] == [10, 30]


@pytest.mark.sockets
def test_push_failure_is_logged_and_retried_later(
    tmp_path: Path, trained: Run, hub: FakeHub, caplog: pytest.LogCaptureFixture
) -> None:
    hub.create_repo(REPO)
    manager = _manager(tmp_path / "ckpt", hub, token=READ_TOKEN, push_every_minutes=30)
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    manager.maybe_save(10, trained.model, *state, loss=3.0, now=0.0)
    with caplog.at_level(logging.WARNING, logger="kit.training.checkpoints"):
        assert manager.maybe_push(now=0.0) is None  # 403: a read token may not push
    assert "write" in caplog.text and "help:" in caplog.text
    assert [c.title for c in hub.commits(REPO)] == ["initial commit"]

    manager._token = WRITE_TOKEN  # the organizer fixed the token
    assert manager.maybe_push(now=30.0) is None  # the retry waits (not a hammer on the Hub)
    assert manager.maybe_push(now=60.0) == 10  # ... but not a whole push interval
    assert hub.commits(REPO)[0].title == "step 10, loss 3.0000"


@pytest.mark.sockets
def test_restore_from_the_hub_after_a_restart(tmp_path: Path, trained: Run, hub: FakeHub) -> None:
    manager = _manager(tmp_path / "first", hub)
    state = trained.optimizer.state_dict(), trained.scheduler.state_dict()
    manager.maybe_save(10, trained.model, *state, loss=3.0, now=0.0)
    assert manager.maybe_push(now=0.0) == 10

    restarted = _manager(tmp_path / "second", hub)  # another machine: empty local folder
    assert restarted.latest() is None
    restored = restarted.restore()
    assert restored is not None and restored.source == "hub" and restored.step == 10
    assert restored.folder == tmp_path / "second" / "step_000010"
    assert restarted.latest() == restored.folder
    assert not (restored.folder / ".cache").exists()
    resumed = _resume(restored.folder, restored.optimizer_state, restored.scheduler_state)
    _assert_same(resumed.parameters(), trained.parameters())
    assert resumed.step() == trained.step()
    _assert_same(resumed.parameters(), trained.parameters())
    assert restarted.maybe_push(now=10_000.0) is None  # what came from the Hub is not re-pushed
    assert not restarted.is_due(19) and restarted.is_due(20)


@pytest.mark.sockets
def test_restore_prefers_local_and_starts_fresh_without_a_repo(
    tmp_path: Path, trained: Run, hub: FakeHub
) -> None:
    assert _manager(tmp_path / "a", hub).restore() is None  # no repo on the Hub: a fresh run
    hub.create_repo(REPO)
    assert _manager(tmp_path / "a", hub).restore() is None  # only .gitattributes: fresh too
    trained.save(tmp_path / "a", 7)
    restored = _manager(tmp_path / "a", hub).restore()
    assert restored is not None and (restored.source, restored.step) == ("local", 7)


def test_restore_skips_a_corrupt_newest_checkpoint_for_an_older_one(
    tmp_path: Path, trained: Run, caplog: pytest.LogCaptureFixture
) -> None:
    trained.save(tmp_path, 7)
    newest = trained.save(tmp_path, 9)
    (newest / "training_state.safetensors").write_bytes(b"\x08" * 20)  # a bad disk block
    with caplog.at_level("WARNING", logger="kit.training.checkpoints"):
        restored = _manager(tmp_path).restore()
    assert restored is not None and (restored.source, restored.step) == ("local", 7)
    assert "step_000009 is unreadable" in caplog.text
    # Set aside: never again the newest checkpoint (pushed to the Hub, served to joiners).
    assert (tmp_path / "step_000009.corrupt").is_dir() and not newest.exists()
    assert _manager(tmp_path).latest() == tmp_path / "step_000007"
    (tmp_path / "step_000007" / "training_state.json").write_text("{not json")
    with pytest.raises(MalformedTrainingState, match="help:"):  # never a silent fresh start
        _manager(tmp_path).restore()


@pytest.mark.sockets
def test_restore_refuses_to_start_over_when_the_hub_refuses(
    tmp_path: Path, trained: Run, hub: FakeHub
) -> None:
    hub.create_repo(REPO)
    manager = _manager(tmp_path / "a", hub, token="hf_unknown_token")
    with pytest.raises(CheckpointRestoreFailed, match="help:"):
        manager.restore()
    assert manager.latest() is None


def test_commit_title_reads_back() -> None:
    assert parse_commit_title(commit_title(12, 2.5)) == (12, 2.5)
    assert parse_commit_title(commit_title(12, None)) == (12, None)
    assert parse_commit_title(commit_title(12, math.nan)) == (12, None)

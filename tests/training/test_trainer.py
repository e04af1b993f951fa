"""The volunteer's training loop on one real peer: steps, losses, status, stop, mixed precision."""

from __future__ import annotations

import dataclasses
import threading
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

import kit
from kit.config import RunConfig
from kit.hardware.plan import TrainingPlan
from kit.training.albert_speed import speed_up
from kit.training.assembly import training_loss
from kit.training.components import build_collaborative_optimizer, build_model
from kit.training.status import TrainingState, TrainingStatus
from kit.training.trainer import Trainer

pytestmark = pytest.mark.sockets


def tiny_config() -> RunConfig:
    config = RunConfig.tiny_demo(data_files=["unused/*.txt"])
    model = dataclasses.replace(
        config.model, vocab_size=64, embedding_size=16, hidden_size=32, intermediate_size=64
    )
    collaboration = dataclasses.replace(
        config.collaboration, target_batch_size=8, batch_size_per_step=4, matchmaking_time=0.5,
        averaging_timeout=5.0,
    )  # fmt: skip
    tokenizer = dataclasses.replace(config.tokenizer, vocab_size=64)
    return dataclasses.replace(
        config, model=model, tokenizer=tokenizer, collaboration=collaboration
    )


def random_batches(batch: int, seq: int = 16, vocab: int = 64):
    generator = torch.Generator().manual_seed(0)
    # A learnable pattern: every sequence repeats one token, masked at a few positions.
    while True:
        token = torch.randint(5, vocab, (batch, 1), generator=generator)
        input_ids = token.repeat(1, seq)
        labels = torch.full_like(input_ids, -100)
        labels[:, 3] = input_ids[:, 3]
        input_ids[:, 3] = 4
        yield {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "token_type_ids": torch.zeros_like(input_ids),
            "labels": labels,
            "sentence_order_label": torch.zeros(batch, dtype=torch.long),
        }


@pytest.fixture
def dht():
    node = kit.DHT(host="127.0.0.1", client_mode=False)
    yield node
    node.shutdown()


def make_trainer(dht, plan: TrainingPlan) -> Trainer:
    config = tiny_config()
    model = build_model(config)
    optimizer = build_collaborative_optimizer(
        model, config, dht, batch_size_per_step=plan.batch_size_per_step
    )
    return Trainer(model, optimizer, random_batches(plan.micro_batch), plan, username="alice")


def test_steps_record_losses_and_global_steps(dht) -> None:
    plan = TrainingPlan(micro_batch=2, accumulation_steps=2)
    trainer = make_trainer(dht, plan)
    seen: list[TrainingStatus] = []
    steps: list[tuple[int, float, float]] = []
    trainer.add_status_listener(seen.append)
    trainer.add_step_listener(lambda *args: steps.append(args))
    try:
        trainer.run(max_steps=8)
    finally:
        trainer.optimizer.shutdown()
    status = trainer.status
    assert status.state is TrainingState.STOPPED
    assert trainer.local_steps == 8 and trainer.samples_total == 32
    assert [samples for samples, _, _ in steps] == [4] * 8
    assert len(status.loss_history) == 8 and status.loss_history[-1][0] == 8
    # 8 steps x 4 samples with a global batch of 8 = 4 global steps by this lone peer.
    assert trainer.optimizer.local_epoch == 4 and status.local_epoch == 4
    assert status.username == "alice"
    assert TrainingState.TRAINING in {s.state for s in seen}
    first, last = status.loss_history[0][1], status.loss_history[-1][1]
    assert last < first  # the pattern is learnable in a few steps


def test_stop_from_another_thread_ends_the_worker(dht) -> None:
    trainer = make_trainer(dht, TrainingPlan(micro_batch=2, accumulation_steps=1))
    started = threading.Event()
    trainer.add_step_listener(lambda *args: started.set())
    try:
        trainer.start()
        assert started.wait(60)
        assert trainer.stop(timeout=60)
        assert not trainer.running
        assert trainer.status.state is TrainingState.STOPPED
        with pytest.raises(kit.errors.KitError):
            trainer.start()
    finally:
        trainer.optimizer.shutdown()


def test_bf16_autocast_on_cpu_trains(dht) -> None:
    plan = TrainingPlan(micro_batch=2, accumulation_steps=1, precision="bf16")
    trainer = make_trainer(dht, plan)
    try:
        trainer.run(max_steps=3)
    finally:
        trainer.optimizer.shutdown()
    assert trainer.local_steps == 3
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_step_that_turns_parameters_nan_is_rolled_back_and_shown(dht) -> None:
    trainer = make_trainer(dht, TrainingPlan(micro_batch=2, accumulation_steps=2))
    inner = trainer.optimizer.opt
    original, calls = inner.step, []

    def exploding_step(closure=None):
        calls.append(1)
        result = original(closure)
        if len(calls) == 2:  # the second global step diverges
            with torch.no_grad():
                inner.param_groups[0]["params"][0].fill_(float("inf"))
        return result

    inner.step = exploding_step
    try:
        trainer.run(max_steps=6)
    finally:
        trainer.optimizer.shutdown()
    assert len(calls) >= 2
    assert trainer.status.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_failing_listener_does_not_stop_training(dht) -> None:
    trainer = make_trainer(dht, TrainingPlan(micro_batch=2, accumulation_steps=1))

    def broken(status: TrainingStatus) -> None:
        raise RuntimeError("display broke")

    trainer.add_status_listener(broken)
    try:
        trainer.run(max_steps=2)
    finally:
        trainer.optimizer.shutdown()
    assert trainer.local_steps == 2


def test_data_errors_end_in_a_failed_state_with_the_message(dht) -> None:
    def failing():
        yield from ()
        raise kit.errors.DataSourceNotFound("no data here - help: check data.sources")

    config = tiny_config()
    model = build_model(config)
    plan = TrainingPlan(micro_batch=2, accumulation_steps=1)
    optimizer = build_collaborative_optimizer(model, config, dht, batch_size_per_step=2)
    trainer = Trainer(model, optimizer, failing(), plan)
    try:
        with pytest.raises(kit.errors.DataSourceNotFound):
            trainer.run(max_steps=2)
    finally:
        optimizer.shutdown()
    assert trainer.status.state is TrainingState.FAILED
    assert "help: check data.sources" in trainer.status.message


class ScriptedTracker:
    """The parts of a ProgressTracker the trainer reads, with a scripted number of peers."""

    def __init__(self, peers: list[int]) -> None:
        from kit.optim.progress import GlobalProgress, LocalProgress

        self.peers = peers
        self.progress_type = GlobalProgress
        self.local = LocalProgress(b"me", 0, 0, 10.0, 0.0, False)
        self.ready_to_update_epoch = False

    async def wait_for_update(self, timeout: float):
        return self.global_progress

    @property
    def global_progress(self):
        count = self.peers[0] if len(self.peers) == 1 else self.peers.pop(0)
        return self.progress_type(0, 0, 8, count, 0, float("inf"), 0.0)


class ScriptedOptimizer:
    target_batch_size = 8
    local_epoch = 0

    def __init__(self, peers: list[int]) -> None:
        self.tracker = ScriptedTracker(peers)
        self.param_groups: list = []

    def step(
        self, batch_size: int, grad_scaler: object = None, clip_grad_norm: float | None = None
    ) -> None:
        pass

    def zero_grad(self) -> None:
        pass


def test_losing_every_other_peer_shows_reconnecting_then_recovers() -> None:
    model = build_model(tiny_config())
    # Reads of the progress: one when joining, then two per step (before and after it).
    peers = [3, 3, 3, 3, 3, 1, 1, 1, 1, 2]
    plan = TrainingPlan(micro_batch=2, accumulation_steps=1)
    trainer = Trainer(model, ScriptedOptimizer(peers), random_batches(2), plan)
    seen: list[TrainingStatus] = []
    trainer.add_status_listener(seen.append)
    trainer.run(max_steps=5)
    states = [status.state for status in seen]
    first_reconnecting = states.index(TrainingState.RECONNECTING)
    assert TrainingState.TRAINING in states[:first_reconnecting]  # others were seen first
    assert "training alone" in seen[first_reconnecting].message
    recovered = [s for s in seen[first_reconnecting:] if s.state is TrainingState.TRAINING]
    assert recovered and recovered[0].message == "back with 1 other peer(s)"
    assert trainer.status.state is TrainingState.STOPPED


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host: on a GPU each one waits for its kernels.
    (Reads of the CPU batch in ``prepare_batch``, before anything reaches the device, are free
    there too, and not counted.)"""

    READS = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.tensors: list[torch.Tensor] = []  # what was read (kept alive: ids stay unique)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in self.READS:
            callers = {frame.name for frame in traceback.extract_stack(limit=6)}
            if "prepare_batch" not in callers:
                self.reads.append(func.__name__)
                self.tensors.append(args[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("scaled", [False, True], ids=["bf16-like", "fp16-scaler"])
def test_a_local_step_reads_only_the_previous_step_back(dht, scaled: bool) -> None:
    """What a GPU peer does between global steps (deferred checks, as on CUDA): per local
    step, one read of the previous step's loss and one of its inf/NaN flag, both done by the
    time the next step's kernels are queued; no read of the step just computed."""
    config = tiny_config()
    config = dataclasses.replace(
        config, collaboration=dataclasses.replace(config.collaboration, target_batch_size=10_000)
    )
    plan = TrainingPlan(micro_batch=2, accumulation_steps=2)
    model = build_model(config)
    optimizer = build_collaborative_optimizer(model, config, dht, batch_size_per_step=4)
    optimizer._accumulated.deferred = True  # the accelerator's path, on this CPU
    speed_up(model)
    trainer = Trainer(model, optimizer, random_batches(2), plan, loss=training_loss)
    if scaled:
        trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    try:
        trainer.run(max_steps=2)  # warm: joined, tracker started, its steps all read
        counts = []
        for _ in range(5):
            with HostReads() as reads:
                trainer._local_step()
            counts.append(sorted(reads.reads))
            # This step's loss and inf/NaN flag stay unread until the next step is queued.
            current = {id(trainer._pending[-1].loss), id(optimizer._accumulated._pending[-1].ok)}
            assert not current & {id(tensor) for tensor in reads.tensors}
    finally:
        optimizer.shutdown()
    assert counts[0] == ["__bool__"]  # (nothing of the trainer's was pending yet)
    assert counts[1:] == [["__bool__", "__float__"]] * 4

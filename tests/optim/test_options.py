"""kit.Optimizer's options with two in-process peers: each must still equal one-process training.

reuse_grad_buffers, offload_optimizer, delay_optimizer_step, AMP (torch.amp.GradScaler on CPU),
parameter averaging skipped after exact rounds, and an auxiliary peer joining a trainer's rounds.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import kit
from kit.errors import KitUsageError
from kit.optim.state_averaging import SAFETY_PERIOD, state_averaging_needed
from tests.optim.reference import make_model, micro_batches, target_batch_size, train_reference

pytestmark = [pytest.mark.sockets]
EPOCHS = 3


def make_optimizer(dht: Any, model: torch.nn.Module, target: int, **options: Any) -> kit.Optimizer:
    return kit.Optimizer(
        dht=dht,
        run_id="options-test",
        target_batch_size=target,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        params=model.parameters(),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)),
        matchmaking_time=2.0,
        averaging_timeout=30.0,
        tracker_opts={"min_refresh_period": 0.1, "max_refresh_period": 0.5},
        **options,
    )


def train_exactly(
    opt: kit.Optimizer, model: torch.nn.Module, peer: int, amp: bool, errors: list[BaseException]
) -> None:
    """Each epoch: this peer's shard, then wait for the global step (and a delayed one to land)."""
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if amp else None
        deadline = time.monotonic() + 120
        for epoch in range(EPOCHS):
            for inputs, targets in micro_batches(peer, epoch):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                opt.step(batch_size=len(inputs), grad_scaler=scaler)
                if not opt.reuse_grad_buffers:
                    opt.zero_grad()
            while (opt.local_epoch == epoch or opt._inner.pending) and (
                time.monotonic() < deadline
            ):
                opt.step(batch_size=0)  # our shard is in: wait for the step to be applied
                time.sleep(0.01)
        while opt._state_round.running and time.monotonic() < deadline:
            opt.step(batch_size=0)  # let a background parameter round finish and land
            time.sleep(0.01)
    except BaseException as e:  # reported by the test's thread
        errors.append(e)


def train_pair(**options: Any) -> list[dict[str, Any]]:
    """Train two peers; returns their state averagers' statistics."""
    amp = options.pop("amp", False)
    with kit.DHT(host="127.0.0.1", client_mode=False) as first:
        address = first.get_visible_maddrs()[0]
        with kit.DHT(initial_peers=[address], host="127.0.0.1", client_mode=False) as second:
            models = [make_model(), make_model()]
            opts = [
                make_optimizer(dht, model, target_batch_size(2), **options)
                for dht, model in zip((first, second), models, strict=True)
            ]
            errors: list[BaseException] = []
            threads = [
                threading.Thread(target=train_exactly, args=(opt, model, peer, amp, errors))
                for peer, (opt, model) in enumerate(zip(opts, models, strict=True))
            ]
            try:
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(150)
                stats = [opt.state_averager.statistics() for opt in opts]
            finally:
                for opt in opts:
                    opt.shutdown()
            assert not errors, errors
    expected = train_reference(2, EPOCHS)
    for opt, model in zip(opts, models, strict=True):
        assert opt.local_epoch == EPOCHS
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        relative = float((params - expected).abs().max() / expected.abs().max())
        assert relative <= 1e-5, f"relative error {relative:.2e} with {options}"
    return stats


@pytest.mark.async_timeout(200)
@pytest.mark.parametrize(
    "options",
    [
        {"reuse_grad_buffers": True},
        {"offload_optimizer": True},
        {"delay_optimizer_step": True},
        {"amp": True},
    ],
    ids=["reuse_grad_buffers", "offload_optimizer", "delay_optimizer_step", "amp"],
)
def test_two_peers_with_an_option_equal_one_process(options: dict[str, Any]) -> None:
    train_pair(average_state_every=0, **options)


@pytest.mark.async_timeout(200)
def test_parameters_are_averaged_only_while_drifted() -> None:
    """Fresh peers are drifted (their init is nobody's): one parameter round, then exact
    gradient rounds keep them identical and no more parameter rounds run."""
    for stats in train_pair(average_state_every=1):
        assert stats["full_rounds"] == 1 and stats["partial_rounds"] == 0


def test_state_averaging_needed() -> None:
    decide = state_averaging_needed
    assert not decide(3, 1, local_updates=False, drifted=False, others_drifted=False)
    assert decide(3, 1, local_updates=False, drifted=True, others_drifted=False)
    assert decide(3, 1, local_updates=False, drifted=False, others_drifted=True)
    assert decide(3, 1, local_updates=True, drifted=False, others_drifted=False)
    assert not decide(3, 2, local_updates=True, drifted=True, others_drifted=True)  # not due
    assert not decide(3, 0, local_updates=True, drifted=True, others_drifted=True)  # never
    assert decide(2 * SAFETY_PERIOD, 2, local_updates=False, drifted=False, others_drifted=False)


def test_reuse_grad_buffers_forbids_zero_grad() -> None:
    model = make_model()
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        opt = make_optimizer(dht, model, 16, reuse_grad_buffers=True)
        try:
            with pytest.raises(KitUsageError, match="help:"):
                opt.zero_grad()
        finally:
            opt.shutdown()


def test_amp_scale_is_removed_and_overflow_halves_it() -> None:
    model = make_model()
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        opt = make_optimizer(dht, model, 1000)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        try:
            inputs = torch.randn(4, 8)
            torch.nn.functional.mse_loss(model(inputs), inputs[:, :2]).backward()
            unscaled = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), inputs[:, :2])
            scaler.scale(loss).backward()
            opt.step(batch_size=4, grad_scaler=scaler)
            for accumulator, grad in zip(opt._accumulators, unscaled, strict=True):
                torch.testing.assert_close(accumulator, grad * 4)
            opt.zero_grad()
            overflow = torch.nn.functional.mse_loss(model(inputs), inputs[:, :2]) * float("inf")
            scaler.scale(overflow).backward()
            opt.step(batch_size=4, grad_scaler=scaler)
            assert scaler.get_scale() == 2.0**7
            assert opt._local_samples == 4
        finally:
            opt.shutdown()


@pytest.mark.async_timeout(200)
def test_auxiliary_peer_joins_the_rounds_of_a_lone_trainer() -> None:
    with kit.DHT(host="127.0.0.1", client_mode=False) as first:
        address = first.get_visible_maddrs()[0]
        with kit.DHT(initial_peers=[address], host="127.0.0.1", client_mode=False) as second:
            model = make_model()
            trainer = make_optimizer(first, model, target_batch_size(1), average_state_every=0)
            helper = kit.Optimizer(
                dht=second,
                run_id="options-test",
                target_batch_size=target_batch_size(1),
                optimizer=torch.optim.SGD(make_model().parameters(), lr=0.1),
                matchmaking_time=2.0,
                auxiliary=True,
                tracker_opts={"min_refresh_period": 0.1, "max_refresh_period": 0.5},
            )
            stop = threading.Event()

            def assist() -> None:
                while not stop.is_set():
                    helper.step()

            assistant = threading.Thread(target=assist)
            assistant.start()
            errors: list[BaseException] = []
            try:
                train_exactly(trainer, model, 0, False, errors)
                stop.set()
                assistant.join(30)
                stats = trainer.grad_averager.statistics()
                helper_stats = helper.grad_averager.statistics()
            finally:
                stop.set()
                trainer.shutdown()
                helper.shutdown()
            assert not errors, errors
            assert stats["full_rounds"] == EPOCHS and stats["last_round"]["group_size"] == 2
            assert helper_stats["full_rounds"] == EPOCHS
    expected = train_reference(1, EPOCHS)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert float((params - expected).abs().max() / expected.abs().max()) <= 1e-5

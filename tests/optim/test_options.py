"""kit.Optimizer's options with two in-process peers: each must still equal one-process training.

reuse_grad_buffers, offload_optimizer, delay_optimizer_step, delay_grad_averaging, AMP
(torch.amp.GradScaler on CPU), parameter averaging skipped after exact rounds, local updates with
averaged optimizer statistics and extra tensors, and an auxiliary peer joining a trainer's rounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import kit
from kit.averaging.partition import PartReport
from kit.errors import ConfigError, KitUsageError
from kit.optim.rounds import RoundOutcome
from kit.optim.state_averaging import SAFETY_PERIOD, initialize_statistics, state_averaging_needed
from kit.runtime import get_runtime
from tests.optim.reference import make_model, micro_batches, target_batch_size, train_reference

pytestmark = [pytest.mark.sockets]
EPOCHS = 3


def make_optimizer(dht: Any, model: torch.nn.Module, target: int, **options: Any) -> kit.Optimizer:
    options = {"matchmaking_time": 2.0, "averaging_timeout": 30.0, **options}
    return kit.Optimizer(
        dht=dht,
        run_id="options-test",
        target_batch_size=target,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        params=model.parameters(),
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)),
        tracker_opts={"min_refresh_period": 0.1, "max_refresh_period": 0.5},
        **options,
    )


def train_exactly(
    opt: kit.Optimizer,
    model: torch.nn.Module,
    peer: int,
    amp: bool | str,
    errors: list[BaseException],
    epochs: int = EPOCHS,
) -> None:
    """Each epoch: this peer's shard, then wait for the global step (and a delayed one to land)."""
    try:
        # A scale that would grow at every clean update: with reuse_grad_buffers .grad would
        # mix two scales unless growth waits for the global step (kit.optim.grad_scaling).
        growth_interval = 1 if amp == "growing" else 2000
        scaler = (
            torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
            if amp
            else None
        )
        deadline = time.monotonic() + 120
        for epoch in range(epochs):
            for inputs, targets in micro_batches(peer, epoch):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                (scaler.scale(loss) if scaler is not None else loss).backward()
                opt.step(batch_size=len(inputs), grad_scaler=scaler)
                if not opt.reuse_grad_buffers:
                    opt.zero_grad()
                if scaler is not None:
                    scaler.update()  # as after scaler.step(opt) in plain PyTorch
            while (opt.local_epoch == epoch or opt._inner.pending) and (
                time.monotonic() < deadline
            ):
                opt.step(batch_size=0)  # our shard is in: wait for the step to be applied
                time.sleep(0.01)
        while opt._driver.state_round.running and time.monotonic() < deadline:
            opt.step(batch_size=0)  # let a background parameter round finish and land
            time.sleep(0.01)
    except BaseException as e:  # reported by the test's thread
        errors.append(e)


def wait_until_seen(opt: kit.Optimizer, peers: int, timeout: float = 30.0) -> None:
    """Until ``opt``'s tracker sees ``peers`` peers (itself included): a peer that sees nobody
    steps without a round (kit.optim.rounds)."""
    deadline = time.monotonic() + timeout
    while opt.tracker.global_progress.num_peers < peers and time.monotonic() < deadline:
        get_runtime().call(opt.tracker.wait_for_update(1.0), timeout=5.0)
    assert opt.tracker.global_progress.num_peers >= peers


def train_all(
    opts: Sequence[kit.Optimizer],
    models: Sequence[torch.nn.Module],
    *,
    amp: bool | str = False,
    epochs: int = EPOCHS,
) -> None:
    """Every peer trains its shard in a thread of its own (``train_exactly``); re-raises errors."""
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=train_exactly, args=(opt, model, peer, amp, errors, epochs))
        for peer, (opt, model) in enumerate(zip(opts, models, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert not errors, errors


def run_pair(
    extra: Sequence[Sequence[torch.Tensor]] = ((), ()),
    after: Callable[[list[kit.Optimizer], str], None] | None = None,
    **options: Any,
) -> tuple[list[kit.Optimizer], list[torch.nn.Module], list[dict[str, Any]]]:
    """Train two peers; returns them, their models and their state averagers' statistics.

    ``after(opts, address)`` runs once both are done, before they shut down.
    """
    amp = options.pop("amp", False)
    with kit.DHT(host="127.0.0.1", client_mode=False) as first:
        address = first.get_visible_maddrs()[0]
        with kit.DHT(initial_peers=[address], host="127.0.0.1", client_mode=False) as second:
            models = [make_model(), make_model()]
            opts = [
                make_optimizer(dht, model, target_batch_size(2), extra_tensors=tensors, **options)
                for dht, model, tensors in zip((first, second), models, extra, strict=True)
            ]
            try:
                train_all(opts, models, amp=amp)
                stats = [opt.state_averager.statistics() for opt in opts]
                if after is not None:
                    after(opts, address)
            finally:
                for opt in opts:
                    opt.shutdown()
    return opts, models, stats


def train_pair(**options: Any) -> list[dict[str, Any]]:
    """Train two peers, check they equal one process; returns their state rounds' statistics."""
    opts, models, stats = run_pair(**options)
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
        {"delay_grad_averaging": True},
        {"delay_grad_averaging": True, "reuse_grad_buffers": True},
        {"amp": True, "reuse_grad_buffers": True},
        {"amp": True, "offload_optimizer": True},
        {"amp": True, "delay_optimizer_step": True, "reuse_grad_buffers": True},
        {"amp": True, "delay_grad_averaging": True},
        {"amp": "growing", "reuse_grad_buffers": True},
        {"amp": "growing"},
    ],
    ids=[
        "reuse_grad_buffers",
        "offload_optimizer",
        "delay_optimizer_step",
        "amp",
        "delay_grad_averaging",
        "delay_grad_averaging+reuse_grad_buffers",
        "amp+reuse_grad_buffers",
        "amp+offload_optimizer",
        "amp+delay_optimizer_step+reuse_grad_buffers",
        "amp+delay_grad_averaging",
        "growing-amp+reuse_grad_buffers",
        "growing-amp",
    ],
)
def test_two_peers_with_an_option_equal_one_process(options: dict[str, Any]) -> None:
    train_pair(average_state_every=0, **options)


@pytest.mark.async_timeout(200)
def test_parameters_are_averaged_only_while_drifted() -> None:
    """Fresh peers are drifted (their init is nobody's): one parameter round, then exact
    gradient rounds keep them identical and no more parameter rounds run."""
    for stats in train_pair(average_state_every=1):
        assert stats["full_rounds"] == 1 and stats["partial_rounds"] == 0


@pytest.mark.async_timeout(200)
def test_a_lossy_gradient_codec_keeps_peers_identical_without_parameter_rounds() -> None:
    """fp16 gradients: every member decodes the same shared average (averaging/averages.py), so
    after the fresh peers' one parameter round the two stay bit-identical, and no more rounds."""
    opts, models, stats = run_pair(average_state_every=1, grad_compression=kit.Float16Compression())
    assert all(
        opt._driver.rounds is not None and opt._driver.rounds.exact_gradients for opt in opts
    )
    for stat in stats:
        assert stat["full_rounds"] == 1 and stat["partial_rounds"] == 0
    first, second = ([p.detach().reshape(-1) for p in m.parameters()] for m in models)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.async_timeout(200)
def test_local_updates_average_parameters_named_statistics_and_extra_tensors() -> None:
    """use_local_updates: each peer steps on its own shard, so parameters and Adam's moments
    differ; every epoch's round averages the parameters, exp_avg_sq and the extra tensors (not
    exp_avg: it is not named). A late joiner downloads the extra tensors with the state."""
    joined: list[torch.Tensor] = []

    def late_joiner(opts: list[kit.Optimizer], address: str) -> None:
        with kit.DHT(initial_peers=[address], host="127.0.0.1", client_mode=False) as dht:
            mine = torch.zeros(3)
            late = make_optimizer(
                dht,
                make_model(),
                target_batch_size(2),
                use_local_updates=True,
                average_opt_statistics=("exp_avg_sq",),
                extra_tensors=[mine],
            )
            try:
                late.load_state_from_peers(timeout=30)
                joined.append(mine.clone())
            finally:
                late.shutdown()

    opts, models, _ = run_pair(
        extra=([torch.full((3,), 1.0)], [torch.full((3,), 3.0)]),
        after=late_joiner,
        use_local_updates=True,
        average_opt_statistics=("exp_avg_sq",),
        delay_state_averaging=False,  # each epoch's round done before the next local step
    )
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    torch.testing.assert_close(flat[0], flat[1], rtol=0, atol=1e-6)
    states = [[opt.opt.state[p] for p in opt.opt.param_groups[0]["params"]] for opt in opts]
    for first, second in zip(*states, strict=True):
        torch.testing.assert_close(first["exp_avg_sq"], second["exp_avg_sq"], rtol=0, atol=1e-9)
    assert any(  # the moments not asked for stay each peer's own
        not torch.allclose(first["exp_avg"], second["exp_avg"])
        for first, second in zip(*states, strict=True)
    )
    for opt in opts:
        torch.testing.assert_close(opt._extra[0], torch.full((3,), 2.0))
    torch.testing.assert_close(joined[0], torch.full((3,), 2.0))
    # A reference without the rounds: the two shards' local training really differs.
    assert float((flat[0] - train_reference(1, EPOCHS)).abs().max()) > 1e-4


def three_dhts(stack: contextlib.ExitStack) -> list[kit.DHT]:
    """Three DHT peers on loopback, the first the others' bootstrap (closed with ``stack``)."""
    first = stack.enter_context(kit.DHT(host="127.0.0.1", client_mode=False))
    address = first.get_visible_maddrs()[0]
    return [first] + [
        stack.enter_context(kit.DHT(initial_peers=[address], host="127.0.0.1", client_mode=False))
        for _ in range(2)
    ]


def assert_one_state(
    models: Sequence[torch.nn.Module], opts: Sequence[Any], *, moments: Sequence[str], atol: float
) -> None:
    """Every peer holds the same parameters (within ``atol``) and optimizer ``moments``."""
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    for other in flat[1:]:
        torch.testing.assert_close(flat[0], other, rtol=1e-6, atol=atol)
    for name in moments:
        held = [
            torch.cat([opt.opt.state[p][name].reshape(-1) for p in opt._params]) for opt in opts
        ]
        for other in held[1:]:
            torch.testing.assert_close(held[0], other, rtol=1e-6, atol=1e-12)


@pytest.mark.async_timeout(200)
def test_a_peer_whose_round_failed_fetches_the_others_state() -> None:
    """Three peers; peer 0's gradient round fails once (it steps on its own gradient). The other
    two average without it (it keeps showing the failed epoch until they are done, so they do not
    take their round for over). Peer 0 then downloads their state in the background, so all three
    end with the same parameters *and* Adam moments (parameter averaging alone would leave its
    moments apart; it is off here), and nobody got stuck."""
    with contextlib.ExitStack() as stack:
        dhts = three_dhts(stack)
        models = [make_model() for _ in dhts]
        opts = [
            # No parameter rounds: only the state download can bring peer 0 back in line.
            make_optimizer(dht, model, target_batch_size(3), average_state_every=0)
            for dht, model in zip(dhts, models, strict=True)
        ]
        failed: list[int] = []
        rounds = opts[0]._driver.rounds
        assert rounds is not None
        average = rounds.average

        def fail_once(epoch: int, samples: int, **options: Any) -> RoundOutcome:
            if epoch == 1 and not failed:
                failed.append(epoch)
                return RoundOutcome(epoch, None, 3, exact=True)  # its group never formed
            return average(epoch, samples, **options)

        rounds.average = fail_once  # type: ignore[method-assign]
        try:
            train_all(opts, models, epochs=6)
            deadline = time.monotonic() + 30
            while opts[0]._driver.sharing.refreshing and time.monotonic() < deadline:
                opts[0].step(batch_size=0)  # let the download land
                time.sleep(0.05)
            # The other two took every epoch's round, the failed one too (without peer 0).
            full = [opt.grad_averager.statistics()["full_rounds"] for opt in opts[1:]]
        finally:
            for opt in opts:
                opt.shutdown()
    assert failed == [1] and full == [6, 6]
    assert_one_state(models, opts, moments=("exp_avg_sq",), atol=1e-7)


@pytest.mark.async_timeout(200)
def test_peers_of_a_partial_round_end_with_one_state() -> None:
    """Three peers; at epoch 1 the aggregator of part 0 is lost (as in tests/netsim/test_churn.py):
    every member keeps its own gradient there. Stepping with those, all three would step
    differently and none would hold the collaboration's state (refreshes then swapped drifted
    states, and a complete parameter round cleared drift while Adam's moments differed); the lost
    chunks step with a zero gradient instead, so all three end with the same parameters *and*
    moments."""
    with contextlib.ExitStack() as stack:
        dhts = three_dhts(stack)
        models = [make_model() for _ in dhts]
        opts = [
            make_optimizer(dht, model, target_batch_size(3), average_state_every=1)
            for dht, model in zip(dhts, models, strict=True)
        ]
        partial: list[int] = []
        for opt in opts:
            rounds = opt._driver.rounds
            assert rounds is not None
            rounds.average = _losing_part_zero(rounds, 1, partial)  # type: ignore[method-assign]
        try:
            train_all(opts, models, epochs=8)
            deadline = time.monotonic() + 30
            while any(opt._driver.sharing.refreshing for opt in opts):
                assert time.monotonic() < deadline, "a refresh never landed"
                for opt in opts:
                    opt.step(batch_size=0)  # let the downloads land
                time.sleep(0.05)
        finally:
            for opt in opts:
                opt.shutdown()
    assert partial == [1, 1, 1]
    # (float rounding of landed deltas is allowed, as in the failed-round test; a divergence not)
    assert_one_state(models, opts, moments=("exp_avg", "exp_avg_sq"), atol=1e-12)


def _losing_part_zero(
    rounds: Any, at_epoch: int, partial: list[int]
) -> Callable[..., RoundOutcome]:
    """``rounds.average`` whose round of ``at_epoch`` leaves part 0 at this peer's own gradient
    (its aggregator failed after the others' parts were averaged)."""
    average = rounds.average

    def losing(epoch: int, samples: int, **options: Any) -> RoundOutcome:
        with rounds.averager.get_tensors() as buffers:
            own = [b.clone() for b in buffers]
        outcome = average(epoch, samples, **options)
        if epoch != at_epoch or outcome.result is None:
            return outcome
        partial.append(epoch)
        result = outcome.result
        with rounds.averager.get_tensors() as buffers:
            for spec in result.plan.parts[0]:  # part 0's chunks keep this peer's values
                result.plan.chunk_view(buffers, spec).copy_(result.plan.chunk_view(own, spec))
        report = result.report
        lost = PartReport.missing(0, report.parts[0].senders, len(report.parts[0].chunk_peers))
        report = dataclasses.replace(report, parts=(lost, *report.parts[1:]))
        return dataclasses.replace(outcome, result=dataclasses.replace(result, report=report))

    return losing


def test_optimizer_statistics_are_created_without_moving_anything() -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    initialize_statistics(opt, ("exp_avg", "exp_avg_sq"))
    for param, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(param, old) and param.grad is None
        assert float(opt.state[param]["step"]) == 0.0
    with pytest.raises(ConfigError, match="help:.*exp_avg_sq"):
        initialize_statistics(opt, ("momentum_buffer",))


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


def test_shutdown_gives_a_background_round_shutdown_timeout_then_cancels_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A background round waits for a peer that never comes (a 30 s matchmaking time):
    shutdown waits shutdown_timeout for it, not the round's minute, and says so."""
    model = make_model()
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        with pytest.raises(ConfigError, match="help:"):
            make_optimizer(dht, model, 4, shutdown_timeout=-1.0)
        opt = make_optimizer(
            dht,
            model,
            4,
            matchmaking_time=30.0,
            averaging_timeout=90.0,
            delay_grad_averaging=True,
            shutdown_timeout=0.5,
        )
        address = dht.get_visible_maddrs()[0]
        with kit.DHT(initial_peers=[address], host="127.0.0.1", client_mode=False) as other:
            silent = make_optimizer(other, make_model(), 4)  # seen, but never steps
            try:
                wait_until_seen(opt, 2)
                shut_down_a_background_round(opt, model, caplog)
            finally:
                silent.shutdown()


def shut_down_a_background_round(
    opt: kit.Optimizer, model: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    inputs, targets = micro_batches(0, 0)[0]
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    opt.step(batch_size=4)  # the target: the round (and the step) go to the background
    assert opt._inner.pending
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="kit.optim.optimizer"):
        opt.shutdown()
    took = time.monotonic() - began
    assert took < 15.0, took  # before: the round's whole search, 2 x 30 + 1 s
    assert "did not finish within shutdown_timeout=0.5 s" in caplog.text


def test_amp_scale_is_removed_and_overflow_halves_it_at_update() -> None:
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
            for accumulator, grad in zip(opt._accumulated._sums, unscaled, strict=True):
                torch.testing.assert_close(accumulator, grad * 4)
            opt.zero_grad()
            overflow = torch.nn.functional.mse_loss(model(inputs), inputs[:, :2]) * float("inf")
            scaler.scale(overflow).backward()
            opt.step(batch_size=4, grad_scaler=scaler)
            scaler.update()  # the step recorded its inf: the scale backs off, as after scaler.step
            assert scaler.get_scale() == 2.0**7
            assert opt._accumulated.samples == 4
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

            wait_until_seen(trainer, 2)  # alone, it would step without a round
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

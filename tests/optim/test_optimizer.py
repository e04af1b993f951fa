"""kit.Optimizer with real peer processes: equivalence to large-batch training, hot join, churn."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kit
from kit.dht import Ed25519SignatureValidator
from kit.errors import ConfigError
from kit.p2p.identity import Identity
from tests.optim.reference import make_model, target_batch_size, train_reference

pytestmark = [pytest.mark.processes, pytest.mark.sockets]
ROOT = Path(__file__).resolve().parents[2]


def start_peers(
    bootstrap: str, tmp_path: Path, indices: list[int], peers: int, *extra: str
) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.optim.collab_peer",
                "--initial-peer",
                bootstrap,
                "--peer-index",
                str(index),
                "--target",
                str(target_batch_size(peers)),
                "--out",
                str(tmp_path / f"peer{index}"),
                *extra,
            ],
            cwd=ROOT,
        )
        for index in indices
    ]


def finish(processes: list[subprocess.Popen[bytes]], timeout: float = 150) -> None:
    try:
        for process in processes:
            assert process.wait(timeout) == 0
    finally:
        for process in processes:
            process.kill()


@pytest.mark.async_timeout(200)
def test_three_peers_equal_one_process_with_the_global_batch(tmp_path: Path) -> None:
    """DeDLOC's "complete equivalence to regular distributed training", as a test."""
    epochs = 5
    with kit.DHT(host="127.0.0.1", client_mode=False) as bootstrap:
        processes = start_peers(
            bootstrap.get_visible_maddrs()[0],
            tmp_path,
            [0, 1, 2],
            3,
            "--epochs",
            str(epochs),
            "--exact",
        )
        finish(processes)
    expected = train_reference(3, epochs).numpy()
    rounds_seen: list[dict[int, dict[str, float]]] = []
    for index in range(3):
        params = np.load(tmp_path / f"peer{index}.npy")
        report = json.loads((tmp_path / f"peer{index}.json").read_text())
        assert report["epoch"] == epochs
        assert report["lr"] == pytest.approx(
            0.01 / (1 + epochs)
        )  # the scheduler stepped once per epoch
        relative = np.abs(params - expected).max() / np.abs(expected).max()
        assert relative <= 1e-5, f"peer {index}: relative error {relative:.2e}"
        # Every round's listeners saw the group's weights (kit.metrics attests them), the
        # same at every member: the three peers, each with the samples it brought.
        weights = {r["epoch"]: r["weights"] for r in report["rounds"]}
        assert sorted(weights) == list(range(epochs))
        rounds_seen.append(weights)
    for epoch in range(epochs):
        seen = [weights[epoch] for weights in rounds_seen]
        assert all(w == seen[0] for w in seen) and len(seen[0]) == 3
        assert all(value > 0 for value in seen[0].values())
    untrained = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()]).numpy()
    assert np.abs(expected - untrained).max() > 1e-3  # training did move the parameters


def wait_for_epoch(path: Path, epoch: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip() and int(path.read_text()) >= epoch:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path.name} did not reach epoch {epoch}")


@pytest.mark.async_timeout(240)
def test_churn_peer_killed_and_late_joiner(tmp_path: Path) -> None:
    """One peer killed mid-run, one started late: training goes on, the late peer downloads the
    state and catches up, and every live peer ends with identical parameters."""
    epochs = 8
    with kit.DHT(host="127.0.0.1", client_mode=False) as bootstrap:
        address = bootstrap.get_visible_maddrs()[0]
        linger = tmp_path / "joiner-done"
        common = ("--epochs", str(epochs), "--average-state-every", "1", "--step-delay", "0.1")
        processes = start_peers(
            address, tmp_path, [0, 1, 2], 2, *common, "--linger-file", str(linger)
        )
        try:
            wait_for_epoch(tmp_path / "peer1.epoch", 2)
            processes[1].kill()  # mid-run, without a goodbye
            late = start_peers(address, tmp_path, [3], 2, *common, "--load-state")
            finish(late, timeout=180)
            linger.touch()  # the others served the state until the joiner was done
            finish([processes[0], processes[2]], timeout=60)
        finally:
            for process in processes:
                process.kill()
    finals = {i: np.load(tmp_path / f"peer{i}.npy") for i in (0, 2, 3)}
    reports = {i: json.loads((tmp_path / f"peer{i}.json").read_text()) for i in (0, 2, 3)}
    assert all(report["epoch"] == epochs for report in reports.values())
    assert reports[3]["loaded_epoch"] > 1  # it joined at the collaboration's epoch, not at 0
    for other in (2, 3):
        gap = np.abs(finals[0] - finals[other]).max()
        assert gap <= 1e-6 * np.abs(finals[0]).max(), divergence(tmp_path, reports, 0, other)


def divergence(tmp_path: Path, reports: dict[int, Any], a: int, b: int) -> str:
    """Where peers ``a`` and ``b`` parted: their gap after every epoch both saved, and the
    gradient rounds each took part in (a failure of this test once, in a full-suite run only,
    left nothing to go on)."""
    lines = [f"peers {a} and {b} ended apart; epoch: max |difference| of their parameters"]
    for epoch in range(1, max(reports[a]["epoch"], reports[b]["epoch"]) + 1):
        saved = [tmp_path / f"peer{i}.e{epoch}.npy" for i in (a, b)]
        if all(path.exists() for path in saved):
            gap = np.abs(np.load(saved[0]) - np.load(saved[1])).max()
            lines.append(f"  epoch {epoch}: {gap:.3e}")
    for i in (a, b):
        members = [(r["epoch"], sorted(k[-4:] for k in r["weights"])) for r in reports[i]["rounds"]]
        lines.append(f"  peer {i} (epochs {reports[i]['epochs']}) rounds: {members}")
    return "\n".join(lines)


def test_parameter_rounds_average_adams_moments_unless_told_otherwise() -> None:
    """A peer pulled back by a parameter round must step like the others again: with Adam's
    moments left apart, the same gradient moved it elsewhere (kit.optim.splits says when)."""
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        chosen = {}
        for name, options in {
            "default": {},
            "local updates": {"use_local_updates": True},
            "hivemind's": {"average_opt_statistics": ()},
        }.items():
            model = make_model()
            opt = kit.Optimizer(
                dht=dht,
                run_id=f"moments-{len(chosen)}",
                target_batch_size=8,
                optimizer=lambda p: torch.optim.Adam(p, lr=0.1),
                params=model.parameters(),
                **options,  # type: ignore[arg-type]
            )
            try:
                chosen[name] = opt.average_opt_statistics
                state = opt.opt.state[next(iter(opt.opt.state))] if opt.opt.state else {}
                assert all(torch.count_nonzero(state[n]) == 0 for n in chosen[name])
            finally:
                opt.shutdown()
    assert chosen == {
        "default": ("exp_avg", "exp_avg_sq"),
        "local updates": (),
        "hivemind's": (),
    }


def test_bad_arguments_fail_at_construction() -> None:
    model = make_model()
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        common = dict(dht=dht, run_id="bad", target_batch_size=8)
        cases = [
            dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),  # factory without params
            dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), params=model.parameters()),
            dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), delay_optimizer_step=True),
            dict(
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                client_mode=True,
                auxiliary=True,
            ),
            dict(
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                auxiliary=True,
                batch_size_per_step=4,
            ),
            dict(  # delayed rounds end in a delayed optimizer step
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                params=model.parameters(),
                delay_grad_averaging=True,
                delay_optimizer_step=False,
            ),
            dict(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), grad_averager_factory=1),
            dict(  # a name, not a sequence of names
                optimizer=torch.optim.Adam(model.parameters()),
                average_opt_statistics="exp_avg_sq",
            ),
            dict(  # SGD without momentum keeps no statistics
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                average_opt_statistics=("exp_avg_sq",),
            ),
            dict(optimizer=torch.optim.Adam(model.parameters()), extra_tensors=[[1.0]]),
            dict(  # auxiliary peers help gradient rounds, and local updates have none
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                auxiliary=True,
                use_local_updates=True,
            ),
        ]
        for case in cases:
            with pytest.raises(ConfigError, match="help:"):
                kit.Optimizer(**common, **case)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            kit.Optimizer(
                dht=dht,
                run_id="bad",
                target_batch_size=0,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            )


def test_hivemind_quickstart_runs_with_only_its_import_changed() -> None:
    # Both peers bootstrap from the test's DHT: a lone quickstart peer trains without waiting for
    # anyone (parameter rounds run in the background), so it could be done before a second one
    # that bootstraps from it has started.
    with kit.DHT(host="127.0.0.1", client_mode=False) as bootstrap:
        address = bootstrap.get_visible_maddrs()[0]
        peers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.optim.hivemind_quickstart", address, "--steps", "40"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            outputs = [peer.communicate(timeout=150)[0] for peer in peers]
        finally:
            for peer in peers:
                peer.kill()
    assert all(peer.returncode == 0 for peer in peers)
    for text in outputs:
        summary = text.strip().splitlines()[-1].split()
        assert summary[0] == "epoch" and int(summary[1]) >= 4  # 40 steps x 32 / 128, at least


def test_non_finite_gradients_are_skipped_and_never_sent(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        opt = kit.Optimizer(
            dht=dht,
            run_id="nan-test",
            target_batch_size=1000,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            matchmaking_time=1.0,
        )
        try:
            model(torch.randn(4, 8)).sum().backward()
            opt.step(batch_size=4)
            before = [a.clone() for a in opt._accumulated._sums]
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).sum() * float("nan")
            loss.backward()
            with caplog.at_level("WARNING", logger="kit.optim.optimizer"):
                opt.step(batch_size=4)
            assert "non-finite" in caplog.text
            assert opt._accumulated.samples == 4  # the poisoned batch was not counted...
            assert all(
                torch.equal(a, b) for a, b in zip(opt._accumulated._sums, before, strict=True)
            )  # ...nor added
            assert all(torch.isfinite(a).all() for a in opt._accumulated._sums)
        finally:
            opt.shutdown()


def test_a_lone_first_peer_with_hivemind_options_trains_at_once() -> None:
    """hivemind's test_optimizer, the kit way: averager_opts win over kit's defaults, the first
    peer's load_state_from_peers returns at once, and the hivemind names are there."""
    model = make_model()
    key = Identity.generate()
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        opt = kit.Optimizer(
            dht=dht,
            run_id="lone",
            target_batch_size=8,
            batch_size_per_step=4,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            params=model.parameters(),
            matchmaking_time=0.3,
            averaging_timeout=5.0,
            averager_opts={"request_timeout": 0.25},
            tracker_opts={"private_key": key, "max_refresh_period": 1.0},
        )
        try:
            assert opt.state_averager.settings.request_timeout == 0.25  # the user's value
            assert opt.grad_averager is not None and opt.scheduled_grads is None
            assert opt.tracker._validator.local_owner == Ed25519SignatureValidator(key).local_owner
            started = time.monotonic()
            assert opt.load_state_from_peers() is False  # nobody else: at once, as hivemind
            assert time.monotonic() - started < 2.0
            started = time.monotonic()
            while opt.local_epoch < 2:
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                time.sleep(0.05)
            assert opt.local_epoch == opt.tracker.global_epoch == 2
            # Nobody to average with: no round was even tried (each would have searched
            # 2 x 0.3 + 1 s), so the gradient averager has no step yet.
            assert time.monotonic() - started < 2.0
            assert opt.scheduled_grads is None
            assert opt.tracker.performance_ema.samples_per_second > 0
            assert opt.is_alive() and opt.tracker.is_alive()
        finally:
            opt.shutdown()
        assert not opt.is_alive() and not opt.tracker.is_alive()
        assert not opt.grad_averager.is_alive()


def test_local_updates_have_no_gradient_averager() -> None:
    model = make_model()
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        opt = kit.Optimizer(
            dht=dht,
            run_id="local",
            target_batch_size=8,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            use_local_updates=True,
        )
        try:
            assert opt.grad_averager is None and opt.scheduled_grads is None  # as hivemind
        finally:
            opt.shutdown()

"""``kit preflight`` and the coordinator's start-up check (one implementation): a run a remote
volunteer can train in passes; a run whose tokenizer or data a remote volunteer cannot reach is
refused at start, with each reason and what to do; a volunteer with another kit is told; a
private run's data is checked with the coordinator's own token, or an allowlisted user's."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kit
from kit.config import RunConfig, SourceConfig
from kit.coordinator import Coordinator, CoordinatorOptions, create_authority
from kit.demo import prepare
from kit.errors import ConfigError, DataSourceNotFound, PreflightFailed
from kit.preflight import CHECKS, run_preflight
from tests.p2p.tls import make_certificate
from tests.test_coordinator import free_port

pytestmark = pytest.mark.sockets


def options(root: Path, **changes: object) -> CoordinatorOptions:
    values: dict[str, object] = dict(
        host="127.0.0.1",
        state_dir=str(root / "coordinator"),
        tokenizer_dir=str(root / "demo_tokenizer"),
        auxiliary_peer=False,
        shard_tokens=4_000,
    )
    values.update(changes)
    return CoordinatorOptions(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def organizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, Path]:
    root = tmp_path_factory.mktemp("organizer")
    config, _ = prepare(root, documents=300)
    return config, root


@pytest.fixture(scope="module")
def running(organizer: tuple[RunConfig, Path]) -> Iterator[Coordinator]:
    config, root = organizer
    with Coordinator(config, options(root)) as coordinator:
        yield coordinator


def test_a_run_a_remote_volunteer_can_train_in_passes(running: Coordinator, tmp_path: Path) -> None:
    assert running.preflight is not None and running.preflight.ok  # its own start-up check
    report = run_preflight(running.join_url, work_dir=tmp_path / "volunteer")
    assert report.ok, report.text()
    assert [check.name for check in report.checks] == list(CHECKS)
    assert "preflight passed" in report.text()
    assert sorted(p.name for p in (tmp_path / "volunteer").iterdir()) == [".kit"]


def test_another_kit_version_is_a_problem_with_the_organizers_wheel_as_help(
    running: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    describe = running.handout.describe
    monkeypatch.setattr(
        running.handout, "describe", lambda base: {**describe(base), "kit_version": "9.9.9"}
    )
    report = run_preflight(running.join_url)
    (problem,) = report.problems
    assert problem.startswith(f"versions: kit {kit.__version__} here, the organizer runs kit 9.9.9")
    assert "help: install the organizer's kit from http://127.0.0.1:" in problem
    assert ".whl" in problem
    assert [check.ok for check in report.checks] == [True, True, False, True, True, True]


def test_kit_preflight_on_a_dead_link_exits_1_with_help(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kit", "preflight", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert done.stdout.startswith("FAIL run: cannot reach") and "help:" in done.stdout
    assert "preflight failed: 1 problem(s)" in done.stdout


def test_a_coordinator_without_a_tokenizer_volunteers_can_get_refuses_to_start(
    organizer: tuple[RunConfig, Path], tmp_path: Path
) -> None:
    config, root = organizer
    nowhere = dataclasses.replace(config.tokenizer, output_dir=str(tmp_path / "no-tokenizer"))
    port = free_port()
    coordinator = Coordinator(
        dataclasses.replace(config, tokenizer=nowhere),
        options(root, tokenizer_dir=None, state_dir=str(tmp_path / "state"), port=port),
    )
    with pytest.raises(PreflightFailed) as refused:
        coordinator.start()
    (problem,) = refused.value.problems
    assert (
        problem.startswith("tokenizer: the coordinator serves no tokenizer") and "help:" in problem
    )
    assert "could not train" in str(refused.value)
    with socket.socket() as sock:  # nothing was left running
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_coordinator_on_every_interface_with_no_public_address_refuses_before_it_starts(
    organizer: tuple[RunConfig, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config notebook's default host, on a machine whose addresses are all private (a
    laptop, a cloud VM behind 1:1 NAT): no link with 0.0.0.0 in it, no green check; a hint."""
    from kit.p2p import interfaces

    monkeypatch.setattr(interfaces, "_raw_interface_addresses", lambda: ["127.0.0.1", "10.0.0.4"])
    config, root = organizer
    state = tmp_path / "state"
    with pytest.raises(ConfigError, match="no public address .* help: pass --announce"):
        Coordinator(config, options(root, host="0.0.0.0", state_dir=str(state))).start()
    assert not state.exists()  # nothing started half-way
    _, other_key = make_certificate(tmp_path, prefix="other-")
    certfile, _ = make_certificate(tmp_path)
    mismatched = options(
        root, state_dir=str(state), tls_certfile=str(certfile), tls_keyfile=str(other_key)
    )
    with pytest.raises(ConfigError, match="does not match the certificate"):
        Coordinator(config, mismatched).start()
    assert not state.exists()


def test_the_start_up_check_dials_the_announced_address_not_a_loopback_rewrite(
    organizer: tuple[RunConfig, Path], tmp_path: Path
) -> None:
    """Announced at a port where nothing listens: what volunteers would be handed does not
    answer, so the coordinator does not start, and says which address failed and why."""
    config, root = organizer
    port, wrong = free_port(), free_port()
    coordinator = Coordinator(
        config,
        options(
            root, state_dir=str(tmp_path / "state"), port=port, announce=(f"127.0.0.1:{wrong}",)
        ),
    )
    with pytest.raises(PreflightFailed) as refused:
        coordinator.start()
    (problem,) = refused.value.problems
    assert problem.startswith("run: cannot reach") and f"127.0.0.1:{wrong}" in problem
    with socket.socket() as sock:  # nothing was left running
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_preflight_dials_the_peer_addresses_a_run_hands_out(
    running: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/ws"
    info = running.run_info
    monkeypatch.setattr(
        running, "run_info", lambda base=None: {**info(base), "initial_peers": [dead]}
    )
    report = run_preflight(running.join_url)
    (problem,) = report.problems
    assert problem.startswith(f"peers: 127.0.0.1:{dead.split('/')[4]}: ") and "refused" in problem
    assert "help: volunteers dial these addresses" in problem
    live = running.addresses[0]  # one answers: enough for a volunteer, the dead one is named
    monkeypatch.setattr(
        running, "run_info", lambda base=None: {**info(base), "initial_peers": [dead, live]}
    )
    report = run_preflight(running.join_url)
    assert report.ok, report.text()
    assert "1 of 2 peer address(es) answer; 1 unreachable" in report.text()


def test_a_coordinator_whose_hub_dataset_volunteers_cannot_stream_refuses_to_start(
    organizer: tuple[RunConfig, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets.config

    from kit.testing.fake_hub import FakeHub

    config, root = organizer
    missing = SourceConfig("wiki", path="organizer/no-such-dataset", probability=0.5)
    files = dataclasses.replace(config.data.sources[0], probability=0.5)
    data = dataclasses.replace(config.data, sources=(files, missing))
    with FakeHub() as hub, hub.patched_client(tmp_path / "hf_home"):
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", hub.endpoint)  # frozen at import
        coordinator = Coordinator(
            dataclasses.replace(config, data=data),
            options(root, state_dir=str(tmp_path / "state")),
        )
        with pytest.raises(PreflightFailed) as refused:
            coordinator.start()
    (problem,) = refused.value.problems
    assert problem.startswith("data: source 'wiki'") and "help:" in problem


def test_a_coordinator_whose_files_are_missing_refuses_to_start(
    organizer: tuple[RunConfig, Path], tmp_path: Path
) -> None:
    config, root = organizer
    gone = dataclasses.replace(config.data.sources[0], data_files=(str(tmp_path / "gone/*.txt"),))
    coordinator = Coordinator(
        dataclasses.replace(config, data=dataclasses.replace(config.data, sources=(gone,))),
        options(root, state_dir=str(tmp_path / "state")),
    )
    with pytest.raises(DataSourceNotFound, match="no file matches .*help:"):
        coordinator.start()
    coordinator.shutdown()


def test_a_private_runs_data_is_checked_with_a_token_and_refused_without(
    organizer: tuple[RunConfig, Path], tmp_path: Path
) -> None:
    from kit.testing.fake_hub import FakeHub

    config, root = organizer
    port, state = free_port(), tmp_path / "state"
    access = dataclasses.replace(
        config.access,
        usernames=("alice",),
        authority_public_key=create_authority(state),
        coordinator=f"/ip4/127.0.0.1/tcp/{port}/ws",
    )
    private = dataclasses.replace(config, access=access)
    with FakeHub() as hub:
        hub.add_user("alice", token="hf_alice")
        hub.add_user("mallory", token="hf_mallory")
        settings = options(root, state_dir=str(state), port=port, hf_endpoint=hub.endpoint)
        with Coordinator(private, settings) as coordinator:
            # Its start-up check read its own data with its own peer's token.
            assert coordinator.preflight is not None and coordinator.preflight.ok

            def preflight(*arguments: str) -> subprocess.CompletedProcess[str]:
                command = [sys.executable, "-m", "kit", "preflight", coordinator.join_url]
                environment = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
                return subprocess.run(
                    [*command, *arguments],
                    capture_output=True,
                    text=True,
                    timeout=180,
                    cwd=tmp_path,
                    env=environment,
                )

            stranger = preflight()
            assert stranger.returncode == 1, stranger.stdout
            lines = stranger.stdout.splitlines()
            assert [line.split(":")[0] for line in lines[:5]] == [
                "ok   run", "ok   peers", "ok   versions", "ok   tokenizer", "FAIL data"
            ]  # fmt: skip
            assert "HTTP 401: no access token: this run's data is for allowlisted users" in lines[4]
            assert "--hf-token" in lines[4]
            unlisted = run_preflight(coordinator.join_url, hf_token="hf_mallory")
            (problem,) = unlisted.problems
            assert problem.startswith("data: ") and "not on the allowlist" in problem, problem
            member = preflight("--hf-token", "hf_alice")
            assert member.returncode == 0, member.stdout
            assert "preflight passed" in member.stdout

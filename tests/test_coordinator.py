"""The organizer's coordinator with real volunteers on loopback: allowlist through a fake Hugging
Face Hub, contribution on the leaderboard, dashboard API, checkpoints pushed to the Hub, and a
restart that resumes from the last checkpoint while the volunteer keeps training."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from kit.config import RunConfig
from kit.coordinator import Coordinator, CoordinatorOptions, create_authority
from kit.data.remote import ServedData
from kit.demo import prepare
from kit.errors import AccessRefused, ConfigError, NotAllowlisted, Revoked
from kit.http_client import http_get
from kit.testing.fake_hub import FakeHub
from kit.volunteer import CoordinatorUnreachable, Volunteer, coordinator_url, fetch_run_info

pytestmark = [pytest.mark.sockets]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(url: str) -> object:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as answer:
        return json.loads(answer.read())


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub() as fake:
        fake.add_user("alice", token="hf_alice")
        fake.add_user("bob", token="hf_bob")
        fake.add_user("organizer", token="hf_organizer", token_role="write")
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield fake


def allowlisted_run(tmp_path: Path, port: int) -> RunConfig:
    config, _ = prepare(tmp_path, documents=300)
    state_dir = tmp_path / "coordinator"
    access = dataclasses.replace(
        config.access,
        usernames=("alice",),
        authority_public_key=create_authority(state_dir),
        coordinator=f"/ip4/127.0.0.1/tcp/{port}/ws",
    )
    collaboration = dataclasses.replace(config.collaboration, target_batch_size=16)
    checkpoint = dataclasses.replace(
        config.checkpoint,
        hub_repo="organizer/tiny-albert",
        every_epochs=2,
        push_every_minutes=0.0,
        keep_last=2,
    )
    return dataclasses.replace(
        config, access=access, collaboration=collaboration, checkpoint=checkpoint
    )


def start_coordinator(config: RunConfig, tmp_path: Path, port: int, hub: FakeHub) -> Coordinator:
    options = CoordinatorOptions(
        host="127.0.0.1",
        port=port,
        state_dir=str(tmp_path / "coordinator"),
        tokenizer_dir=str(tmp_path / "demo_tokenizer"),
        hub_token="hf_organizer",
        hf_endpoint=hub.endpoint,
        metrics_period=1.0,
    )
    coordinator = Coordinator(config, options)
    coordinator.start()
    return coordinator


@pytest.mark.timeout(400)
def test_allowlisted_run_leaderboard_checkpoints_and_restart(tmp_path, hub) -> None:
    port = free_port()
    config = allowlisted_run(tmp_path, port)
    coordinator = start_coordinator(config, tmp_path, port, hub)
    volunteer = None
    try:
        info = fetch_run_info(coordinator.join_url)
        public = dataclasses.replace(config.access, usernames=(), organizations=())
        assert info.config == dataclasses.replace(config, access=public)  # no allowlist
        assert info.config_hash == config.config_hash()
        assert info.tokenizer_url is not None

        # An unlisted Hub user gets a clear refusal and no token.
        stranger = Volunteer(coordinator.join_url, work_dir=tmp_path / "bob", host="127.0.0.1")
        with pytest.raises(NotAllowlisted, match="help:"):
            stranger.login("hf_bob")
        stranger.stop()

        volunteer = Volunteer(
            coordinator.join_url, work_dir=tmp_path / "alice", host="127.0.0.1", client_mode=False
        )
        assert volunteer.needs_login
        assert volunteer.login("hf_alice") == "alice"
        volunteer.start()

        def alice_on_board() -> bool:
            board = get_json(coordinator.http_url + "/api/leaderboard")
            rows = board["leaderboard"] if isinstance(board, dict) else board
            return any(
                r["username"] == "alice" and r["samples"] > 0 and r["verified"] for r in rows
            )

        wait_for(alice_on_board, 120, "alice on the leaderboard")
        wait_for(lambda: coordinator.auxiliary.manager.latest() is not None, 120, "a checkpoint")

        def pushes() -> list:
            return [c for c in hub.commits("organizer/tiny-albert") if c.title.startswith("step ")]

        wait_for(lambda: pushes(), 120, "a push to the Hub")
        pushed = pushes()[0]
        assert "model.safetensors" in pushed.files and "kit_checkpoint.json" in pushed.files
        # The tokenizer went to the run's repo when the coordinator started.
        (tokenizer_commit,) = [
            c for c in hub.commits("organizer/tiny-albert") if c.title == "tokenizer of the run"
        ]
        assert "tokenizer.json" in tokenizer_commit.files
        metrics = get_json(coordinator.http_url + "/api/metrics")
        assert isinstance(metrics, dict)
        page = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            coordinator.dashboard_url, timeout=10
        )
        assert b"<html" in page.read().lower()
        saved_step = coordinator.auxiliary.manager.latest_step()
        samples_before = next(
            r["samples"] for r in coordinator.collector.leaderboard() if r["username"] == "alice"
        )

        # The coordinator restarts; the volunteer keeps training meanwhile.
        coordinator.shutdown()
        steps_while_down = volunteer.trainer.local_steps
        # A round that the coordinator's auxiliary peer left mid-way fails after its timeout;
        # then the volunteer goes on alone.
        wait_for(
            lambda: volunteer.trainer.local_steps > steps_while_down + 2,
            60,
            "the volunteer training while the coordinator is down",
        )
        assert volunteer.trainer.running
        coordinator = start_coordinator(config, tmp_path, port, hub)
        titles = [c.title for c in hub.commits("organizer/tiny-albert")]
        assert titles.count("tokenizer of the run") == 1  # pushed once, not again at each start
        assert coordinator.auxiliary.restored_step is not None
        assert coordinator.auxiliary.restored_step >= saved_step
        restored = {row["username"]: row["samples"] for row in coordinator.collector.leaderboard()}
        assert restored.get("alice", 0) >= samples_before  # the leaderboard survived the restart
        wait_for(
            lambda: coordinator.collector.summary().get("peers_online", 0) >= 1,
            60,
            "the volunteer seen again by the restarted coordinator",
        )
    finally:
        if volunteer is not None:
            volunteer.stop()
        coordinator.shutdown()
    assert volunteer.status.state.value == "stopped"
    # Its data position was saved beside its key: a restart goes on from there.
    assert list((tmp_path / "alice" / ".kit").glob("data-position-*.json"))


@pytest.mark.timeout(300)
def test_a_revoked_user_is_cut_off_credited_nothing_more_and_stays_banned(tmp_path, hub) -> None:
    port = free_port()
    config = allowlisted_run(tmp_path, port)
    coordinator = start_coordinator(config, tmp_path, port, hub)
    volunteer = Volunteer(
        coordinator.join_url, work_dir=tmp_path / "alice", host="127.0.0.1", client_mode=False
    )
    try:
        volunteer.login("hf_alice")
        volunteer.start()

        def samples(field: str = "samples") -> int:
            board = coordinator.collector.leaderboard()
            return next((r[field] for r in board if r["username"] == "alice"), 0)

        wait_for(lambda: samples() > 0, 120, "alice on the leaderboard")
        coordinator.revoke(usernames=["alice"], duration=3600.0)
        frozen = samples("claimed")
        steps = volunteer.trainer.local_steps
        wait_for(lambda: volunteer.trainer.local_steps > steps + 5, 60, "alice training on alone")
        fetches = coordinator.collector.fetches
        wait_for(lambda: coordinator.collector.fetches >= fetches + 2, 30, "two more fetches")
        # Her new records are not credited: her claim stays where it was at the ban (rounds of
        # before the ban may still be attested late, up to that claim).
        assert samples("claimed") == frozen and 0 < samples() <= frozen
        with pytest.raises(Revoked, match="help:"):  # and she gets no new token
            Volunteer(coordinator.join_url, work_dir=tmp_path / "a2", host="127.0.0.1").login(
                "hf_alice"
            )
        coordinator.shutdown()
        coordinator = start_coordinator(config, tmp_path, port, hub)  # the ban is kept
        with pytest.raises(Revoked, match="help:"):
            Volunteer(coordinator.join_url, work_dir=tmp_path / "a3", host="127.0.0.1").login(
                "hf_alice"
            )
    finally:
        volunteer.stop()
        coordinator.shutdown()


def test_a_restarted_coordinator_with_no_volunteers_serves_its_checkpoint(tmp_path, hub) -> None:
    """All volunteers left; the coordinator restarts from its checkpoint, and a new volunteer
    downloads that state instead of starting from the initial weights."""
    import torch

    from kit.training.components import build_model

    port = free_port()
    config = dataclasses.replace(allowlisted_run(tmp_path, port), access=RunConfig().access)
    # A checkpoint at step 7 with recognizable weights, as a previous coordinator left it.
    from kit.training.checkpoints import save_checkpoint
    from kit.training.components import build_inner_optimizer, build_scheduler, parameter_groups

    model = build_model(config)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.01)
    inner = build_inner_optimizer(parameter_groups(model, 0.01), config.optimizer)
    scheduler = build_scheduler(inner, config.optimizer)
    save_checkpoint(
        Path(config.checkpoint.folder),
        7,
        model,
        inner.state_dict(),
        scheduler.state_dict(),
        loss=5.0,
        run_config=config,
    )
    coordinator = start_coordinator(config, tmp_path, port, hub)
    volunteer = None
    try:
        assert coordinator.auxiliary.restored_step == 7
        volunteer = Volunteer(
            coordinator.join_url, work_dir=tmp_path / "v", host="127.0.0.1", client_mode=False
        )
        volunteer.start(max_steps=1)
        assert volunteer.wait(180)
        assert volunteer.trainer.optimizer.local_epoch >= 7
    finally:
        if volunteer is not None:
            volunteer.stop()
        coordinator.shutdown()


def test_bad_addresses_and_dead_coordinators_give_clear_errors(tmp_path) -> None:
    assert coordinator_url("https://run.example.org/") == "https://run.example.org"
    assert coordinator_url("/ip4/127.0.0.1/tcp/8765/ws") == "http://127.0.0.1:8765"
    assert coordinator_url("/dns/run.example.org/tcp/443/wss") == "https://run.example.org:443"
    with pytest.raises(ConfigError, match="help:"):
        coordinator_url("not an address")
    with pytest.raises(CoordinatorUnreachable, match="help:"):
        fetch_run_info(f"http://127.0.0.1:{free_port()}", timeout=5)


def test_coordinator_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="help:"):
        CoordinatorOptions(tls_certfile="cert.pem")
    with pytest.raises(ConfigError, match="help:"):
        CoordinatorOptions(port=70000)


def test_a_run_yaml_whose_authority_key_is_not_ours_is_refused(tmp_path) -> None:
    config, _ = prepare(tmp_path, documents=50)
    other = create_authority(tmp_path / "elsewhere")
    access = dataclasses.replace(
        config.access, authority_public_key=other, coordinator="/ip4/127.0.0.1/tcp/1/ws"
    )
    coordinator = Coordinator(
        dataclasses.replace(config, access=access),
        CoordinatorOptions(host="127.0.0.1", state_dir=str(tmp_path / "coordinator")),
    )
    with pytest.raises(ConfigError, match="authority"):
        coordinator.start()
    coordinator.shutdown()


def test_volunteers_join_an_allowlisted_coordinator_over_wss(tmp_path, hub) -> None:
    """TLS on the coordinator's port (Colab/Kaggle let only HTTPS out): run info, token, tokenizer
    and the peer connection all go over https/wss, checked against the organizer's certificate.
    The served data goes to token holders only: the volunteer trains from it with its token, a
    stranger is refused."""
    import ssl

    from tests.p2p.tls import make_certificate

    port = free_port()
    config = allowlisted_run(tmp_path, port)
    access = dataclasses.replace(config.access, coordinator=f"/ip4/127.0.0.1/tcp/{port}/wss")
    config = dataclasses.replace(
        config,
        access=access,
        checkpoint=dataclasses.replace(config.checkpoint, hub_repo=None),
    )
    certfile, keyfile = make_certificate(tmp_path)
    options = CoordinatorOptions(
        host="127.0.0.1",
        port=port,
        tls_certfile=str(certfile),
        tls_keyfile=str(keyfile),
        state_dir=str(tmp_path / "coordinator"),
        tokenizer_dir=str(tmp_path / "demo_tokenizer"),
        auxiliary_peer=False,
        metrics_period=1.0,
    )
    trusted = ssl.create_default_context(cafile=str(certfile))
    with Coordinator(config, options) as coordinator:
        assert coordinator.join_url == f"https://127.0.0.1:{port}"
        with pytest.raises(CoordinatorUnreachable):  # the system CAs do not know this certificate
            fetch_run_info(coordinator.join_url, timeout=5)
        # Its own start-up check read the served data with its own peer's token.
        assert coordinator.preflight is not None and coordinator.preflight.ok
        # A stranger reads how to join (run, tokenizer, wheel, join notebook), not the data.
        info = fetch_run_info(coordinator.join_url, ssl_context=trusted)
        assert info.data_manifest_url is not None and info.tokenizer_url and info.install_url
        for public in (info.tokenizer_url, info.install_url, info.url + "/join.ipynb"):
            assert http_get(public, ssl_context=trusted)
        with pytest.raises(AccessRefused, match="HTTP 401: no access token.*allowlisted.*help:"):
            ServedData.fetch(info.data_manifest_url, tmp_path / "stranger", ssl_context=trusted)
        volunteer = Volunteer(
            coordinator.join_url,
            work_dir=tmp_path / "alice",
            host="127.0.0.1",
            client_mode=False,
            ssl_context=trusted,
        )
        try:
            assert volunteer.login("hf_alice") == "alice"
            volunteer.start(max_steps=3)
            assert volunteer.wait(120)
            assert volunteer.status.state.value == "stopped"
            assert volunteer.trainer.local_steps == 3
        finally:
            volunteer.stop()


def access_coordinator(state: Path, hf_endpoint: str, **access: object) -> Coordinator:
    """A started coordinator of an allowlisted run for tests of access (``access`` changes the
    ``access:`` section; ``metrics_period`` too): no auxiliary peer, no tokenizer, so no
    start-up check of training."""
    port = free_port()
    metrics_period = float(access.pop("metrics_period", 10.0))  # type: ignore[arg-type]
    changed = dataclasses.replace(
        RunConfig().access,
        authority_public_key=create_authority(state),
        coordinator=f"/ip4/127.0.0.1/tcp/{port}/ws",
        **access,  # type: ignore[arg-type]
    )
    options = CoordinatorOptions(
        host="127.0.0.1",
        port=port,
        state_dir=str(state),
        hf_endpoint=hf_endpoint,
        auxiliary_peer=False,
        preflight=False,
        metrics_period=metrics_period,
    )
    coordinator = Coordinator(dataclasses.replace(RunConfig(), access=changed), options)
    coordinator.start()
    return coordinator


def test_the_run_info_shows_what_a_volunteer_needs_and_not_the_allowlist(tmp_path, hub) -> None:
    """/api/run (and the dashboard's /api/metrics) answer anyone: no user or org names there."""
    coordinator = access_coordinator(
        tmp_path / "coordinator",
        hub.endpoint,
        usernames=("alice", "bob"),
        organizations=("secret-lab",),
    )
    config, access = coordinator.config, coordinator.config.access
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        for path in ("/api/run", "/api/metrics"):
            body = opener.open(coordinator.http_url + path, timeout=10).read().decode()
            for name in ("alice", "bob", "secret-lab"):
                assert name not in body, f"{path} shows {name!r}"
        info = fetch_run_info(coordinator.join_url)  # what a volunteer reads still joins
        assert info.config_hash == config.config_hash()
        assert info.authority_public_key is not None and info.initial_peers
        assert info.config.access.coordinator == access.coordinator
        assert info.config.access.check_seconds == access.check_seconds
        assert Volunteer(coordinator.join_url, work_dir=tmp_path / "a").login("hf_alice") == "alice"
    finally:
        coordinator.shutdown()

"""What the coordinator hands to volunteers: ``/api/run`` (the wheel's URL as the volunteer reached
the coordinator, the tokenizer's digest, the run's extra bootstrap peers), the join notebook with
the link in it, and NAT'd volunteers that keep training through an organizer's ``kit dht`` peer
while the coordinator restarts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import kit
from kit.config import RunConfig
from kit.coordinator import Coordinator, CoordinatorOptions
from kit.demo import prepare
from kit.dht import DHT
from kit.preflight import run_preflight
from kit.volunteer import Volunteer, fetch_run_info, http_get
from tests.test_coordinator import free_port, wait_for

pytestmark = pytest.mark.sockets


def get(url: str, headers: dict[str, str]) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(urllib.request.Request(url, headers=headers), timeout=30) as answer:
        return bytes(answer.read())


def local_options(root: Path, tokenizer_dir: Path) -> CoordinatorOptions:
    """A coordinator on loopback with no auxiliary peer and no start-up check (fast)."""
    return CoordinatorOptions(
        host="127.0.0.1",
        state_dir=str(root / "coordinator"),
        tokenizer_dir=str(tokenizer_dir),
        auxiliary_peer=False,
        preflight=False,
    )


def organizer_dht(run_id: str) -> DHT:
    """The organizer's extra public peer, as `kit dht --run-id RUN` runs it."""
    return DHT(
        host="127.0.0.1",
        port=0,
        client_mode=False,
        peer_options={"relay_service": True, "run_id": run_id},
    )


def test_run_info_names_the_wheel_as_reached_the_tokenizer_digest_and_bootstrap_peers(
    tmp_path: Path,
) -> None:
    config, tokenizer_dir = prepare(tmp_path, documents=200)
    extra = "/dns/dht.example.org/tcp/31337/ws"
    config = dataclasses.replace(
        config, access=dataclasses.replace(config.access, bootstrap_peers=(extra,))
    )
    with Coordinator(config, local_options(tmp_path, tokenizer_dir)) as coordinator:
        url = coordinator.join_url
        # Reached through a TLS proxy under its public name: absolute URLs say so.
        behind_proxy = {"Host": "run.example.org", "X-Forwarded-Proto": "https"}
        run = json.loads(get(url + "/api/run", behind_proxy))
        assert (
            run["install"]
            == f"https://run.example.org/install/kit_collab-{kit.__version__}-py3-none-any.whl"
        )
        assert run["kit_version"] == kit.__version__
        assert run["initial_peers"][-1] == extra and len(run["initial_peers"]) == 2
        tokenizer = http_get(url + run["tokenizer_url"])
        assert run["tokenizer_sha256"] == hashlib.sha256(tokenizer).hexdigest()
        assert run["data_manifest"] == "/api/data/manifest.json"
        # The wheel is the one the coordinator built, served whole.
        wheel = http_get(url + "/install/" + Path(run["install"]).name)
        assert wheel == coordinator.handout.wheel.read_bytes()
        assert run["install_sha256"] == hashlib.sha256(wheel).hexdigest()
        notebook = json.loads(get(url + "/join.ipynb", behind_proxy))
        (cell,) = [c for c in notebook["cells"] if c["cell_type"] == "code"]
        assert 'COORDINATOR = "https://run.example.org"' in "".join(cell["source"])
        assert 'WHEEL += "#sha256=" + RUN["install_sha256"]' in "".join(cell["source"])
        # A volunteer gets all of it, with URLs made absolute against its link.
        info = fetch_run_info(url)
        assert info.install_url is not None and info.install_url.startswith(url + "/install/")
        assert info.install_sha256 == run["install_sha256"]
        assert info.data_manifest_url == url + "/api/data/manifest.json"
        assert info.initial_peers[-1] == extra
        # A Host header that is not a host name is not echoed into URLs.
        odd = json.loads(get(url + "/api/run", {"Host": 'evil"><script>'}))
        assert odd["install"].startswith(url + "/install/")


@pytest.mark.processes  # pip, as the join cell runs it
def test_pip_installs_the_pinned_wheel_and_refuses_other_bytes(tmp_path: Path) -> None:
    """The join cell's ``URL#sha256=...``: pip takes the served wheel with its published digest,
    refuses it under any other digest (what a changed file looks like) and keeps nothing; the
    preflight says the same before any volunteer tries."""
    config, tokenizer_dir = prepare(tmp_path, documents=200)
    with Coordinator(config, local_options(tmp_path, tokenizer_dir)) as coordinator:
        info = fetch_run_info(coordinator.join_url)
        assert info.install_url is not None and info.install_sha256 is not None

        def pip_download(digest: str, into: Path) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-index"]
            return subprocess.run(
                [*command, "-d", str(into), f"{info.install_url}#sha256={digest}"],
                capture_output=True,
                text=True,
                timeout=120,
                env={k: v for k, v in os.environ.items() if "proxy" not in k.lower()},
            )

        good = pip_download(info.install_sha256, tmp_path / "good")
        assert good.returncode == 0, good.stderr
        assert [p.name for p in (tmp_path / "good").iterdir()] == [Path(info.install_url).name]
        wrong = "0" * 64
        refused = pip_download(wrong, tmp_path / "refused")
        assert refused.returncode != 0
        assert "DO NOT MATCH THE HASHES" in refused.stderr and wrong in refused.stderr
        assert not list((tmp_path / "refused").glob("*.whl"))
        coordinator.handout.wheel_sha256 = wrong  # /api/run now gives a digest pip would refuse
        report = run_preflight(coordinator.join_url)
        (problem,) = report.problems
        assert problem.startswith("versions: the wheel at ") and "pip would refuse it" in problem


@pytest.mark.processes  # two training volunteers and a coordinator restart
@pytest.mark.timeout(300)
def test_natd_volunteers_keep_training_through_a_bootstrap_peer_while_the_coordinator_restarts(
    tmp_path: Path,
) -> None:
    config, tokenizer_dir = prepare(tmp_path, documents=300)
    dht = organizer_dht(config.collaboration.run_id)
    port = free_port()
    volunteers: list[Volunteer] = []
    coordinator = None
    try:
        (extra,) = dht.get_visible_addresses()
        config = dataclasses.replace(
            config,
            access=dataclasses.replace(config.access, bootstrap_peers=(extra,)),
            collaboration=dataclasses.replace(
                config.collaboration,
                target_batch_size=32,
                matchmaking_time=1.0,
                averaging_timeout=8.0,
            ),
        )

        def start() -> Coordinator:
            options = CoordinatorOptions(
                host="127.0.0.1",
                port=port,
                state_dir=str(tmp_path / "coordinator"),
                tokenizer_dir=str(tokenizer_dir),
                auxiliary_peer=False,
                metrics_period=1.0,
                preflight=False,
            )
            started = Coordinator(config, options)
            started.start()
            return started

        coordinator = start()
        # Two volunteers behind NAT, as on Colab and Kaggle: they never listen, and are relayed.
        for name in ("nat-a", "nat-b"):
            volunteer = Volunteer(
                coordinator.join_url,
                work_dir=tmp_path / name,
                username=name,
                host="127.0.0.1",
                client_mode=True,
            )
            assert volunteer.info.initial_peers[-1] == extra
            volunteer.start()
            volunteers.append(volunteer)

        def epochs() -> list[int]:
            return [v.trainer.optimizer.local_epoch for v in volunteers]

        def peers_seen() -> list[int]:
            return [v.trainer.optimizer.tracker.global_progress.num_peers for v in volunteers]

        wait_for(lambda: min(epochs()) >= 2, 120, "the volunteers training together")

        async def relays(_: object, node: object) -> int:
            return len(node.peer.relay_client.relayed_addresses())  # type: ignore[attr-defined]

        assert [v.dht.run_coroutine(relays) for v in volunteers] == [2, 2]  # coordinator + kit dht

        coordinator.shutdown()
        coordinator = None
        before = max(epochs())
        # Only the organizer's `kit dht` peer is up: it holds the DHT (their progress records)
        # and relays. Without it, each would see only itself and step alone on its own samples.
        # (Their gradient rounds fall back to local gradients meanwhile: two client-mode peers
        # have no aggregator until the coordinator's auxiliary peer is back.)
        wait_for(
            lambda: min(epochs()) >= before + 2, 120, "global steps while the coordinator is down"
        )
        assert peers_seen() == [2, 2]  # still one collaboration
        assert all(v.trainer.running for v in volunteers)
        coordinator = start()
        wait_for(
            lambda: coordinator.collector.summary().get("peers_online", 0) >= 2,
            60,
            "the volunteers seen again by the restarted coordinator",
        )
    finally:
        for volunteer in volunteers:
            volunteer.stop()
        if coordinator is not None:
            coordinator.shutdown()
        dht.shutdown()


def test_bootstrap_peers_must_be_addresses() -> None:
    from kit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"access.bootstrap_peers\[0\].*help:"):
        RunConfig.from_dict({"access": {"bootstrap_peers": ["not an address"]}})
    parsed = RunConfig.from_dict({"access": {"bootstrap_peers": "/ip4/10.0.0.1/tcp/31337/ws"}})
    assert parsed.access.bootstrap_peers == ("/ip4/10.0.0.1/tcp/31337/ws",)
    assert parsed.config_hash() == RunConfig().config_hash()  # not hashed: may change mid-run


def run_join_cell(link: str) -> list[str]:
    """Execute the join notebook's cell as IPython would, and return its ``%pip`` lines expanded
    (the commands the volunteer's kernel would run), without installing or joining anything."""
    from IPython.core.inputtransformer2 import TransformerManager
    from IPython.utils.text import DollarFormatter

    from kit.join_notebook import join_cell

    code = TransformerManager().transform_cell(join_cell(link))
    code = code.replace("import kit\n", "").replace("volunteer = kit.join(COORDINATOR)", "")
    namespace: dict[str, object] = {}
    commands: list[str] = []

    class Shell:  # what get_ipython() gives the cell: %pip expands {names} from the namespace
        def run_line_magic(self, name: str, line: str) -> None:
            assert name == "pip", name
            commands.append(DollarFormatter().format(line, **namespace))

    namespace["get_ipython"] = Shell
    exec(compile(code, "join-cell", "exec"), namespace)
    return commands


@pytest.mark.parametrize("optimizer, extras", [("lamb", set()), ("lamb8bit", {"eightbit"})])
def test_the_join_cell_installs_the_extras_the_runs_optimizer_needs(
    tmp_path: Path, optimizer: str, extras: set[str]
) -> None:
    import shlex

    from packaging.requirements import Requirement

    config, tokenizer_dir = prepare(tmp_path, documents=200)
    config = dataclasses.replace(
        config, optimizer=dataclasses.replace(config.optimizer, name=optimizer)
    )
    with Coordinator(config, local_options(tmp_path, tokenizer_dir)) as coordinator:
        answer = json.loads(get(coordinator.join_url + "/api/run", {}))
        assert answer["install_extras"] == sorted(extras)
        commands = run_join_cell(coordinator.join_url)
    wheel = answer["install"] + "#sha256=" + answer["install_sha256"]  # pinned: pip checks it
    assert commands[0].split() == ["install", "-q", "--no-deps", "--force-reinstall", wheel]
    # The second line installs what is missing: kit's dependencies and the run's extras.
    arguments = shlex.split(commands[1])
    assert arguments[:2] == ["install", "-q"] and len(arguments) == 3, commands
    requirement = Requirement(arguments[2])
    assert (requirement.name, requirement.extras, requirement.url) == ("kit-collab", extras, wheel)

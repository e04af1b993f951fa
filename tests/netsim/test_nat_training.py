"""NAT'd volunteers train through a public peer (issue 10, scenario 3), in network namespaces.

One public host runs the bootstrap peer, which also relays; two hosts sit behind NAT (no route
in: they can only dial out) and join in client mode, as Colab and Kaggle volunteers do: they
register at the relay (without one they could not start). All three train ``kit.Optimizer``
(``tests.netsim.churn_peer``) until a set epoch; then a third NAT'd peer joins late and downloads
the state, partly from the NAT'd peers through the relay. The test checks that the NAT'd peers
took part in every gradient round (groups of three, no failed round), that the relay carried
bytes, and that every peer ends at that epoch with the same parameters. Needs root, iproute2 and
nftables (marker ``netns``); skipped elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from kit.testing.netsim import HostSpec, NetSim
from tests.netsim.churn_peer import finish
from tests.netsim.skips import skip_without_netns

PEER_MODULE = "tests.netsim.churn_peer"
FINAL_EPOCH = 8
TARGET_BATCH = 192  # three peers x 16 samples per 0.1 s: ~0.4 s to gather
TIMEOUT = 150.0


@pytest.mark.netns
@pytest.mark.processes
@pytest.mark.timeout(240)
@skip_without_netns
def test_nat_peers_train_in_client_mode_through_a_public_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = [HostSpec("public")] + [HostSpec(f"home{i}", nat=True) for i in (1, 2, 3)]
    common = [f"--run-dir={tmp_path}", f"--target={TARGET_BATCH}", f"--lifetime={TIMEOUT}"]
    monkeypatch.setenv("KIT_CHURN_LOG", "DEBUG")  # the peers log each round's group size
    with NetSim(hosts) as sim:
        processes = [
            sim.python(
                "public",
                PEER_MODULE,
                "--index=0",
                f"--host={sim.host('public').address}",
                "--bootstrap",
                "--relay",
                *common,
            )
        ]

        def start_nat_peer(index: int, host: str) -> None:
            processes.append(
                sim.python(
                    host,
                    PEER_MODULE,
                    f"--index={index}",
                    f"--host={sim.host(host).address}",
                    "--client-mode",
                    *common,
                )
            )

        start_nat_peer(1, "home1")
        start_nat_peer(2, "home2")
        try:
            (tmp_path / "final_epoch").write_text(str(FINAL_EPOCH))
            _wait_for_epoch(tmp_path, processes, FINAL_EPOCH)
            # A late NAT'd joiner downloads the state from up to three donors at once: two of
            # them NAT'd too, reachable only through the public peer's relay.
            start_nat_peer(3, "home3")
            _wait_for_epoch(tmp_path, processes, FINAL_EPOCH)
            codes = list(finish(tmp_path, dict(enumerate(processes)), 60).values())
        finally:
            for process in processes:
                process.kill()
                process.wait(10)
    logs = [(tmp_path / f"peer{i}.log").read_text(errors="replace") for i in range(4)]
    assert codes == [0, 0, 0, 0], logs
    for log in logs:
        assert "Traceback" not in log and "averaging failed" not in log, log[-3000:]
    # The NAT'd peers' gradients went into every round but the first ones (joining).
    for log in logs[1:3]:
        assert log.count("grad_averager: averaged with 3 peers") >= FINAL_EPOCH - 3, log[-3000:]
    finals = [json.loads((tmp_path / f"peer{i}.final.json").read_text()) for i in range(4)]
    assert {f["epoch"] for f in finals} == {FINAL_EPOCH}, finals
    assert finals[0]["relayed_bytes"] > 0, finals  # the joiner's download went through the relay
    params = [np.load(tmp_path / f"peer{i}.final.npy", allow_pickle=False) for i in range(4)]
    for other in params[1:]:
        assert np.abs(other - params[0]).max() <= 1e-6 * np.abs(params[0]).max()


def _wait_for_epoch(run_dir: Path, processes: list[subprocess.Popen[bytes]], epoch: int) -> None:
    """Until every peer logged a step at ``epoch`` (bounded; a dead peer fails at once)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for index, process in enumerate(processes):
            if process.poll() is not None:
                log = (run_dir / f"peer{index}.log").read_text(errors="replace")
                raise AssertionError(
                    f"peer {index} exited with {process.returncode}:\n{log[-3000:]}"
                )
        reached = []
        for index in range(len(processes)):
            events = run_dir / f"peer{index}.events"
            lines = events.read_text().split("\n") if events.exists() else []
            last = [line for line in lines if line.strip()][-1:] if lines else []
            reached.append(bool(last) and int(last[0].split()[1]) >= epoch)
        if all(reached):
            return
        time.sleep(0.2)
    raise AssertionError(f"not every peer reached epoch {epoch} within {TIMEOUT:.0f} s")

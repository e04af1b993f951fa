"""Churn (issue 10, scenario 4): peers SIGKILLed and started every 10-30 s while kit.Optimizer trains.

One stable bootstrap peer (it trains too, and never dies) and a pool of peer processes
(``tests.netsim.churn_peer``), each in its own network namespace of a :class:`NetSim` (public
hosts on one bridge, unshaped links: this scenario is about membership, not bandwidth). A seeded
churn driver SIGKILLs a random non-bootstrap peer or starts a new one every 10-30 s, keeping 3 to
5 peers alive (at most 5 processes: the machine has 2 cores). After ``CHURN_SECONDS`` the churn
stops, the survivors are brought to one final epoch and released; each writes its parameters
once its own repairs landed (``churn_peer.finish``: a round that failed under load in the last
epochs is repaired in the background), all stop gracefully, and the test checks:

1. no stall: the longest time the collaboration's epoch (the max over all peers' event logs,
   killed peers included) went without advancing is <= 2 x the median step time plus
   ``STALL_ALLOWANCE_SECONDS``;
2. every survivor ends at the same epoch with the same parameters (tight tolerance);
3. no peer crashed: survivors exit 0 with no traceback in their logs, and no peer exited before
   the driver killed or released it;
4. the collaboration took at least ``min_steps()`` global steps.

The scenario needs root, iproute2 and nftables (marker ``netns``); it is skipped elsewhere.
``KIT_CHURN_SECONDS`` shortens the churn for local iterations (default 180 s);
``KIT_CHURN_KEEP=dir`` keeps the run's event logs, peer logs, parameter digests and final
parameters there; ``KIT_CHURN_LOG=DEBUG`` makes the peers log kit.optim's rounds. When the
survivors end apart, the failure names the epochs at which peers held different parameters
(:func:`partings`: where to start reading their logs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kit.testing.netsim import HostSpec, NetSim
from tests.netsim.churn_peer import finish
from tests.netsim.skips import skip_without_netns

logger = logging.getLogger(__name__)

CHURN_SECONDS = float(os.environ.get("KIT_CHURN_SECONDS", "180"))  # the 3 minutes
CHURN_INTERVAL = (10.0, 30.0)  # seconds between two churn events (uniform)
SEED = 10  # the churn driver's choices: which peer dies, when, kill or start
MIN_ALIVE, MAX_ALIVE = 3, 5  # peers alive, the bootstrap included (5 processes at most)
POOL_SLOTS = MAX_ALIVE - 1  # namespaces for non-bootstrap peers; a new peer takes a free one
TARGET_BATCH = 384  # ~3-4 peers x 16 samples / 0.1 s: ~1 s to gather, plus ~1.5 s matchmaking
MATCHMAKING_SECONDS = 1.5
# A step's normal duration already contains one matchmaking; a step hit by churn can also need a
# round that fails when a member vanishes (detected when its connection drops: the kernel closes a
# SIGKILLed process's sockets) and a fresh matchmaking for the next: 2 x matchmaking, plus 2 s of
# scheduling slack on a 2-core machine shared with other test runs.
STALL_ALLOWANCE_SECONDS = 2 * MATCHMAKING_SECONDS + 2.0
# After the churn: global steps without churn before the survivors stop. A peer whose round
# failed took a local step and drifted; a parameter round at a following epoch repairs it.
QUIET_EPOCHS = 5
JOIN_TIMEOUT = 120.0  # a new peer imports torch, joins the DHT, downloads the state (slow CI)
FINISH_TIMEOUT = 120.0  # survivors reach the final epoch / exit after the release
PEER_MODULE = "tests.netsim.churn_peer"
TIMEOUT = int(CHURN_SECONDS + 2 * JOIN_TIMEOUT + 2 * FINISH_TIMEOUT + 60)


def min_steps(churn_seconds: float) -> int:
    """Global steps the collaboration must at least take: one per 10 s (normal: one per ~3 s)."""
    return max(3, int(churn_seconds / 10))


def epoch_increments(
    events: list[list[tuple[float, int]]], start: float, end: float
) -> list[tuple[float, int]]:
    """When the collaboration's epoch (max over every peer's log) rose, within [start, end].

    Args:
        events: per peer, its ``(time, local_epoch)`` lines.
        start, end: the window (the churn period).

    Returns:
        ``(time, new_epoch)`` pairs, time-ordered; the first is the epoch already reached at
        ``start`` (with time ``start``).
    """
    merged = sorted(e for peer in events for e in peer if e[0] <= end)
    best = max((epoch for t, epoch in merged if t <= start), default=0)
    rises = [(start, best)]
    for t, epoch in merged:
        if t > start and epoch > best:
            best = epoch
            rises.append((t, epoch))
    return rises


def stall_figures(rises: list[tuple[float, int]], end: float) -> tuple[float, float, int]:
    """(longest stall, median step time, steps) of an :func:`epoch_increments` timeline.

    The time from the last rise to ``end`` counts as a stall too (one that never ended); the
    median step time is over the gaps between rises, divided by the epochs each gap advanced.
    """
    gaps = [b[0] - a[0] for a, b in zip(rises, rises[1:], strict=False)]
    steps = rises[-1][1] - rises[0][1]
    per_step = [
        (b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(rises[1:], rises[2:], strict=False)
    ]  # from the first rise on: the window starts mid-step
    median = statistics.median(per_step) if per_step else float("inf")
    return max([*gaps, end - rises[-1][0]]), median, steps


def read_events(path: Path) -> list[tuple[float, int]]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 2:  # a SIGKILL may cut the last line short
            rows.append((float(parts[0]), int(parts[1])))
    return rows


def partings(run_dir: Path, peers: list[int]) -> list[tuple[int, dict[str, list[int]]]]:
    """Epochs at which ``peers`` held different parameters when they reached them (from the
    ``peer<i>.params`` digests: the parameters right after the step into that epoch), with which
    peers held which digest. Epochs with a parameter round may show a passing difference (its
    delta lands later); a difference that stays points at the round that made it."""
    held: dict[int, dict[str, list[int]]] = {}
    for index in peers:
        path = run_dir / f"peer{index}.params"
        for line in path.read_text().splitlines() if path.exists() else []:
            parts = line.split()
            if len(parts) == 2:  # (a SIGKILL may cut the last line short)
                held.setdefault(int(parts[0]), {}).setdefault(parts[1], []).append(index)
    return [(epoch, held[epoch]) for epoch in sorted(held) if len(held[epoch]) > 1]


@dataclass
class Churn:
    """The running scenario: processes by peer index and what the driver did."""

    sim: NetSim
    run_dir: Path
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    slots: dict[int, str] = field(default_factory=dict)  # live peer index -> host name
    killed: list[int] = field(default_factory=list)
    started: list[int] = field(default_factory=list)  # after the initial peers
    crashed: dict[int, int | None] = field(default_factory=dict)  # index -> exit code
    next_index: int = 1

    def start(self, *, bootstrap: bool = False) -> int:
        index = 0 if bootstrap else self.next_index
        if not bootstrap:
            self.next_index += 1
        used = set(self.slots.values())
        host = (
            "boot" if bootstrap else next(f"s{i}" for i in range(POOL_SLOTS) if f"s{i}" not in used)
        )
        args = [f"--index={index}", f"--run-dir={self.run_dir}", f"--target={TARGET_BATCH}"]
        args += [
            f"--host={self.sim.host(host).address}",
            f"--matchmaking-time={MATCHMAKING_SECONDS}",
        ]
        args += [f"--lifetime={TIMEOUT}"] + (["--bootstrap"] if bootstrap else [])
        self.processes[index] = self.sim.python(host, PEER_MODULE, *args)
        self.slots[index] = host
        return index

    def kill(self, index: int) -> None:
        process = self.processes[index]
        process.kill()  # SIGKILL: no goodbye (ip netns exec execs python: this is the peer)
        process.wait(10)
        del self.slots[index]
        self.killed.append(index)

    def alive(self) -> list[int]:
        return sorted(self.slots)

    def check_crashes(self) -> None:
        for index in self.alive():
            code = self.processes[index].poll()
            if code is not None:
                self.crashed[index] = code
                del self.slots[index]

    def events(self, index: int) -> list[tuple[float, int]]:
        return read_events(self.run_dir / f"peer{index}.events")

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        give_up = time.monotonic() + timeout
        while not ready():
            self.check_crashes()
            assert not self.crashed, (f"while waiting for {what}", self.crashed, self.logs())
            assert time.monotonic() < give_up, f"timed out waiting for {what}: {self.logs()}"
            time.sleep(0.2)

    def joined(self) -> bool:
        return all(self.events(i) for i in self.alive())

    def logs(self, tail: int = 3000) -> dict[int, str]:
        return {
            i: (self.run_dir / f"peer{i}.log").read_text(errors="replace")[-tail:]
            for i in self.alive() + list(self.crashed)
            if (self.run_dir / f"peer{i}.log").exists()
        }


def drive(churn: Churn, rng: random.Random, seconds: float) -> None:
    """SIGKILL or start a peer every CHURN_INTERVAL seconds, for ``seconds``."""
    end = time.monotonic() + seconds
    next_event = time.monotonic() + rng.uniform(*CHURN_INTERVAL)
    while time.monotonic() < end:
        churn.check_crashes()
        assert not churn.crashed, (churn.crashed, churn.logs())
        if time.monotonic() >= next_event:
            pool = [i for i in churn.alive() if i != 0]
            alive = len(pool) + 1
            kill = alive >= MAX_ALIVE or (alive > MIN_ALIVE and rng.random() < 0.5)
            if kill:
                victim = rng.choice(pool)
                churn.kill(victim)
                logger.info("churn: killed peer %d", victim)
            else:
                churn.started.append(churn.start())
                logger.info("churn: started peer %d", churn.started[-1])
            next_event = time.monotonic() + rng.uniform(*CHURN_INTERVAL)
        time.sleep(0.2)


# --- the stall metric (pure; no root needed) --------------------------------------------------


def test_stall_metric_counts_gaps_and_an_unfinished_stall() -> None:
    events = [[(0.0, 0), (1.0, 1), (3.0, 2)], [(2.0, 1), (5.0, 3), (6.0, 4), (13.0, 5)]]
    rises = epoch_increments(events, start=0.5, end=20.0)
    assert rises == [(0.5, 0), (1.0, 1), (3.0, 2), (5.0, 3), (6.0, 4), (13.0, 5)]
    longest, median, steps = stall_figures(rises, end=20.0)
    assert (longest, median, steps) == (7.0, 2.0, 5)  # 13 -> 20 (still stalled at the end)
    dead = epoch_increments([[(0.0, 4), (1.0, 5)]], start=2.0, end=30.0)
    assert stall_figures(dead, end=30.0)[0] == 28.0  # nothing after the start: one long stall


# --- the scenario -----------------------------------------------------------------------------


@pytest.mark.netns
@pytest.mark.processes
@pytest.mark.sockets
@pytest.mark.timeout(TIMEOUT)
@skip_without_netns
def test_training_survives_churn(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    hosts = [HostSpec("boot")] + [HostSpec(f"s{i}") for i in range(POOL_SLOTS)]
    with NetSim(hosts) as sim:
        churn = Churn(sim, tmp_path)
        try:
            churn.start(bootstrap=True)
            churn.wait_until(
                "the bootstrap", lambda: (tmp_path / "bootstrap.addr").exists(), JOIN_TIMEOUT
            )
            for _ in range(MIN_ALIVE):
                churn.start()
            churn.wait_until("the initial peers", churn.joined, JOIN_TIMEOUT)
            churn_start = time.time()
            drive(churn, rng, CHURN_SECONDS)
            churn_end = time.time()
            # Bring the survivors to one epoch: a little past the collaboration's, once a peer
            # started in the last seconds of churn has joined, then release them.
            churn.wait_until("the last joiners", churn.joined, JOIN_TIMEOUT)
            current = max(e for i in churn.processes for _, e in churn.events(i))
            final_epoch = current + QUIET_EPOCHS
            (tmp_path / "final_epoch").write_text(str(final_epoch))
            churn.wait_until(
                f"every survivor at epoch {final_epoch}",
                lambda: all(churn.events(i)[-1][1] >= final_epoch for i in churn.alive()),
                FINISH_TIMEOUT,
            )
            survivors = churn.alive()
            codes = finish(tmp_path, {i: churn.processes[i] for i in survivors}, FINISH_TIMEOUT)
        finally:
            for process in churn.processes.values():
                with contextlib.suppress(OSError):
                    process.kill()
            for process in churn.processes.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10)

    if os.environ.get("KIT_CHURN_KEEP"):  # keep the run's files (pytest rotates tmp_path)
        shutil.copytree(tmp_path, os.environ["KIT_CHURN_KEEP"], dirs_exist_ok=True)
    logs = {i: (tmp_path / f"peer{i}.log").read_text(errors="replace") for i in survivors}
    all_events = [churn.events(i) for i in churn.processes]
    rises = epoch_increments(all_events, churn_start, churn_end)
    longest, median, steps = stall_figures(rises, churn_end)
    finals = {i: json.loads((tmp_path / f"peer{i}.final.json").read_text()) for i in survivors}
    params = {i: np.load(tmp_path / f"peer{i}.final.npy", allow_pickle=False) for i in survivors}
    failed_rounds = sum(
        path.read_text(errors="replace").count("averaging failed")
        for path in tmp_path.glob("peer*.log")
    )
    spread = max(float(np.abs(params[i] - params[0]).max()) for i in survivors)
    summary = (
        f"churn {CHURN_SECONDS:.0f} s: {steps} global steps, {len(churn.killed)} kills, "
        f"{len(churn.started)} starts, longest stall {longest:.1f} s, median step {median:.2f} s, "
        f"survivors {survivors} at epochs {sorted({f['epoch'] for f in finals.values()})}, "
        f"parameter spread {spread:.2e}, failed rounds {failed_rounds}, losses {[round(f['loss'], 4) for f in finals.values()]}"
    )
    logger.info(summary)
    print(summary, file=sys.stderr)

    # (3) no crash
    assert codes == {i: 0 for i in survivors}, (codes, logs)
    for index, text in logs.items():
        assert "Traceback" not in text, f"peer {index}:\n{text[-5000:]}"
    # (2) one epoch, one set of parameters
    assert {f["epoch"] for f in finals.values()} == {final_epoch}, finals
    scale = float(np.abs(params[0]).max())
    differences = {i: float(np.abs(params[i] - params[0]).max()) for i in survivors}
    if spread > 1e-6 * scale:  # (stderr is shown whole; an assertion's message is cut short)
        print(f"parted at epochs {partings(tmp_path, sorted(churn.processes))}", file=sys.stderr)
        print(f"final states {finals}", file=sys.stderr)
        for index, text in logs.items():
            print(f"--- peer {index}, the end of its log:\n{text[-4000:]}", file=sys.stderr)
    assert spread <= 1e-6 * scale, (differences, scale, finals)
    # (4) progress, and (1) no stall
    assert steps >= min_steps(CHURN_SECONDS), summary
    assert longest <= 2 * median + STALL_ALLOWANCE_SECONDS, (summary, rises)

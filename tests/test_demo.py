"""``kit demo``, the README's main command: a coordinator and 3 volunteer processes train a tiny
ALBERT together; it exits 0 within its budget and the loss at the end is below the start."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kit.demo import write_corpus

pytestmark = [pytest.mark.sockets, pytest.mark.processes]


def test_kit_demo_trains_and_the_loss_goes_down(tmp_path) -> None:
    command = [sys.executable, "-m", "kit", "demo", "--duration", "45", "--work-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=420)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "dashboard at http://127.0.0.1:" in done.stdout
    found = re.search(
        r"(\d+) global steps by (\d+) volunteers; loss ([\d.]+) -> ([\d.]+)", done.stdout
    )
    assert found is not None, done.stdout[-2000:]
    steps, volunteers, start, end = found.groups()
    assert int(steps) >= 3 and int(volunteers) == 3
    assert float(end) < float(start)
    # Every volunteer left by itself at the end of its time, and the coordinator kept a checkpoint.
    assert list((tmp_path / "coordinator" / "checkpoints").glob("step_*/kit_checkpoint.json"))


def test_the_demo_corpus_is_generated_locally_and_reproducibly(tmp_path) -> None:
    first = write_corpus(tmp_path / "a", documents=40)
    second = write_corpus(tmp_path / "b", documents=40)
    assert [f.read_text("utf-8") for f in first] == [f.read_text("utf-8") for f in second]
    assert sum(len(f.read_text("utf-8").splitlines()) for f in first) == 40


def test_bad_arguments_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kit", "demo", "--peers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "help:" in done.stderr

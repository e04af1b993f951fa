"""``kit demo``, the README's main command: a coordinator and 3 volunteer processes train a tiny
ALBERT together; it exits 0 within its budget and the loss at the end is below the start.

While it runs, its coordinator is what a remote volunteer meets: ``/api/run`` names the wheel of
the same kit, ``/join.ipynb`` is one cell with the link, ``kit preflight`` passes from an empty
folder, and a headless ``kit join`` on a machine without ipywidgets trains from an empty folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import kit
from kit.demo import write_corpus
from kit.volunteer import http_get

pytestmark = [pytest.mark.sockets, pytest.mark.processes]

#: Makes ``import ipywidgets`` fail in a Python that has it installed (a GPU server without it).
NO_IPYWIDGETS = """
import sys

class _NoIpywidgets:
    def find_spec(self, name, path=None, target=None):
        if name == "ipywidgets" or name.startswith("ipywidgets."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoIpywidgets())
"""


def without_ipywidgets(folder: Path) -> dict[str, str]:
    """An environment whose Python cannot import ipywidgets (a sitecustomize blocks it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(NO_IPYWIDGETS)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def kit_process(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kit", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise


def check_as_a_remote_volunteer(url: str, tmp_path: Path) -> None:
    run = json.loads(http_get(url + "/api/run"))
    assert run["kit_version"] == kit.__version__
    wheel = http_get(run["install"])
    wheel_file = tmp_path / Path(run["install"]).name
    wheel_file.write_bytes(wheel)
    with zipfile.ZipFile(wheel_file) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    assert f"Version: {kit.__version__}" in text and "Name: kit-collab" in text
    notebook = json.loads(http_get(url + "/join.ipynb"))
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert len(code) == 1 and f'COORDINATOR = "{url}"' in "".join(code[0]["source"])

    checked_in, joined_in = tmp_path / "preflight", tmp_path / "headless"
    checked_in.mkdir()
    joined_in.mkdir()
    environment = without_ipywidgets(tmp_path / "no-ipywidgets")
    blocked = subprocess.run(
        [sys.executable, "-c", "import ipywidgets"], env=environment, capture_output=True
    )
    assert blocked.returncode != 0  # the blocker works
    # Both at once (each mostly waits for its imports on this loaded machine).
    checking = kit_process("preflight", url, cwd=checked_in)
    joining = kit_process(
        "join", url, "--host", "127.0.0.1", "--max-steps", "2", "--username", "headless",
        cwd=joined_in, env=environment,
    )  # fmt: skip
    checked_out, checked_err = finish(checking, 240)
    assert checking.returncode == 0, checked_out + checked_err[-2000:]
    assert "preflight passed" in checked_out
    _, joined_err = finish(joining, 240)
    assert joining.returncode == 0, joined_err[-3000:]
    assert re.search(r"done: [1-9]\d* samples", joined_err), joined_err[-2000:]
    # The console: kit's own lines, not websockets' INFO chatter.
    assert "websockets" not in joined_err and "HTTP response sent" not in joined_err


def test_kit_demo_trains_and_a_remote_volunteer_can_join_it(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    command = [sys.executable, "-m", "kit", "demo", "--duration", "60", "--work-dir", str(work)]
    errors = (tmp_path / "stderr.txt").open("w")  # a file: a full pipe would stall the demo
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        assert process.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 180
        url = None
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen.append(line)
            found = re.search(r"dashboard at (http://127\.0\.0\.1:\d+)/", line)
            url = found.group(1) if found else None
        assert url is not None, "".join(seen)
        check_as_a_remote_volunteer(url, tmp_path)
        stdout, _ = process.communicate(timeout=420)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        errors.close()
    stdout = "".join(seen) + stdout
    stderr = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 0, (stdout + stderr)[-3000:]
    found = re.search(r"(\d+) global steps by (\d+) volunteers; loss ([\d.]+) -> ([\d.]+)", stdout)
    assert found is not None, stdout[-2000:]
    steps, volunteers, start, end = found.groups()
    assert int(steps) >= 3 and int(volunteers) == 4  # its 3 and the headless one
    assert float(end) < float(start)
    # Every volunteer left by itself at the end of its time, and the coordinator kept a checkpoint.
    saved = list((work / "coordinator" / "checkpoints").glob("step_*/kit_checkpoint.json"))
    assert saved, stdout[-1000:] + stderr[-4000:]
    # Its volunteers got data and tokenizer as remote ones do: their folders hold their own
    # key, caches and log, nothing of the organizer's.
    for index in range(3):
        assert sorted(p.name for p in (work / f"volunteer-{index}").iterdir()) == [
            ".kit",
            "log.txt",
        ]
    assert list((work / "volunteer-0" / ".kit" / "data").glob("*/*.kitshard.zst"))
    # The console shows kit's own lines and one progress line, not websockets' INFO chatter.
    assert "websockets" not in stderr and "HTTP response sent" not in stderr


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


def test_the_verdict_fits_the_runs_length() -> None:
    """A short run is judged on taking global steps together, not on a loss that may rise by
    chance over 4 steps; 20 steps or more must bring the loss down (ends averaged)."""
    from kit.demo import LOSS_JUDGED_FROM, judge

    def result(steps: int, losses: list[float], codes: tuple[int, ...] = (0, 0)) -> dict:
        return {"global_steps": steps, "losses": losses, "exit_codes": list(codes)}

    short = judge(result(4, [9.2, 9.3, 9.25, 9.4]))  # went up: too short to say
    assert short[0] is False and "too few to judge the loss" in short[1]
    assert judge(result(0, []))[0] is True
    failed, why = judge(result(30, [9.0] * 30, codes=(0, 1)))
    assert failed and "exited with an error" in why
    falling = [9.0 - 0.05 * i for i in range(LOSS_JUDGED_FROM)]
    assert judge(result(LOSS_JUDGED_FROM, falling)) == (
        False,
        f"the loss went down over {LOSS_JUDGED_FROM} global steps (8.9500 -> 8.1000)",
    )
    noisy_end = [*falling[:-1], 9.5]  # one bad last point does not decide
    assert judge(result(LOSS_JUDGED_FROM, noisy_end))[0] is False
    flat = judge(result(LOSS_JUDGED_FROM, [9.0] * LOSS_JUDGED_FROM))
    assert flat[0] is True and "did not go down" in flat[1]
    # A fast run whose curve has few points (one per metrics collection): judged on those.
    assert judge(result(48, [9.53, 9.34])) == (
        False,
        "the loss went down over 48 global steps (9.5300 -> 9.3400)",
    )
    assert judge(result(48, [9.34, 9.53]))[0] is True
    assert judge(result(48, [9.5]))[0] is False  # seen once: nothing to compare


STUCK_VOLUNTEER = """
import time
from kit.volunteer import dump_stacks_on_signal

def stuck_in_a_round():
    time.sleep(120)

assert dump_stacks_on_signal()
print("ready", flush=True)
stuck_in_a_round()
"""


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGUSR1"), reason="POSIX signals only")
def test_a_volunteer_that_does_not_stop_says_where_it_hangs_then_is_terminated(
    tmp_path: Path,
) -> None:
    import signal

    from kit.demo import stop_volunteers

    log = tmp_path / "log.txt"
    with log.open("wb") as output:
        stuck = subprocess.Popen(
            [sys.executable, "-c", STUCK_VOLUNTEER], stdout=output, stderr=subprocess.STDOUT
        )
        finished = subprocess.Popen([sys.executable, "-c", "pass"])
        finished.wait(60)
        give_up = time.monotonic() + 60
        while "ready" not in log.read_text() and time.monotonic() < give_up:
            assert stuck.poll() is None, log.read_text()
            time.sleep(0.05)
        started = time.monotonic()
        stop_volunteers([stuck, finished])
    assert time.monotonic() - started < 20
    assert stuck.returncode == -signal.SIGTERM and finished.returncode == 0
    stacks = log.read_text()
    assert "Current thread" in stacks and "in stuck_in_a_round" in stacks, stacks

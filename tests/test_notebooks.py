"""The organizer's and the volunteer's notebooks, run headless with nbclient, and the Binder files.

* ``notebooks/config.ipynb`` with a tiny allowlisted run: it writes run.yaml, shows the memory
  table and starts a coordinator whose ``/api/run`` a cell appended here checks.
* ``notebooks/join.ipynb`` (one cell) against a real coordinator started here, logging in through
  a fake Hugging Face Hub with the ``HF_TOKEN`` the kernel inherits: it trains in the background,
  shows up on the leaderboard, and stops cleanly. A wrong token in the login widget gives one
  readable line, not a traceback.
* ``binder/``: CPU torch pinned like requirements.txt, kit installed with its notebook extras
  (the environment built and both notebooks run in it: ``tests/test_binder.py``).
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import re
import site
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kit.config import RunConfig
from kit.coordinator import Coordinator, CoordinatorOptions, create_authority
from kit.demo import prepare, write_corpus
from kit.testing.fake_hub import FakeHub
from kit.volunteer import http_get

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
BINDER = REPO / "binder"
#: Seconds a whole notebook may take on a loaded 2-core machine (its normal run is ~10-40 s).
NOTEBOOK_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(url: str) -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as answer:
        return json.loads(answer.read())


def code_outputs(notebook: Any) -> list[Any]:
    return [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    ]


def text_of(outputs: list[Any]) -> str:
    """Everything the notebook printed or displayed as text/HTML, joined."""
    parts: list[str] = []
    for output in outputs:
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        for kind in ("text/plain", "text/html"):
            value = output.get("data", {}).get(kind)
            if value:
                parts.append(value if isinstance(value, str) else "".join(value))
    return "\n".join(parts)


def execute(notebook: Any, cwd: Path) -> None:
    from nbclient import NotebookClient

    NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=NOTEBOOK_TIMEOUT,
        resources={"metadata": {"path": str(cwd)}},
    ).execute()


@pytest.fixture
def quiet_kernel_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the kernel inherits: no Hub beyond loopback, one torch thread, no progress bars."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)


# --- the organizer's notebook -------------------------------------------------------------------

CONFIG_CHECK = """
import json, re, shutil, subprocess, sys, tempfile
from kit.config import RunConfig
from kit.volunteer import http_get

def kit_command(*args, cwd, timeout):
    return subprocess.run([sys.executable, "-m", "kit", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)

try:
    url = coordinator.join_url
    run = json.loads(http_get(url + "/api/run"))
    assert run["run_id"] == RUN_ID == config.collaboration.run_id, run["run_id"]
    assert run["config_hash"] == config.config_hash() == RunConfig.from_file("run.yaml").config_hash()
    assert run["tokenizer_url"] and run["data_manifest"] and run["install"].endswith(".whl"), run
    # The organizer's files go away: volunteers get everything from the coordinator.
    shutil.rmtree("corpus")
    shutil.rmtree("tokenizer")
    with tempfile.TemporaryDirectory() as empty:
        checked = kit_command("preflight", url, cwd=empty, timeout=180)
    assert checked.returncode == 0, checked.stdout + checked.stderr[-3000:]
    assert "preflight passed" in checked.stdout, checked.stdout
    with tempfile.TemporaryDirectory() as empty:
        joined = kit_command("join", url, "--host", "127.0.0.1", "--max-steps", "24", cwd=empty,
                             timeout=240)
        left_behind = sorted(path.name for path in __import__("pathlib").Path(empty).iterdir())
    assert joined.returncode == 0, joined.stderr[-3000:]
    done = re.search(r"done: (\\d+) samples, (\\d+) global steps", joined.stderr)
    assert done is not None and int(done.group(2)) >= 2, joined.stderr[-3000:]
    assert left_behind == [".kit"], left_behind  # its key and caches, nothing else
    print("volunteer trained", done.group(2), "global steps on served data")
finally:
    coordinator.shutdown()
"""


@pytest.mark.notebooks
@pytest.mark.sockets
@pytest.mark.processes
def test_config_notebook_with_its_defaults_starts_a_run_a_remote_volunteer_trains_in(
    tmp_path: Path, quiet_kernel_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat

    # This run needs no Hub: a call to it would fail at once on a closed loopback port. (Not
    # HF_HUB_OFFLINE: huggingface_hub reads it once at import, and this process imports it.)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    organizer = tmp_path / "organizer"
    write_corpus(organizer / "corpus", documents=600)  # where DATA_FILES points by default
    port = free_port()
    notebook = nbformat.read(NOTEBOOKS / "config.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    source, replaced = re.subn(
        r"^HOST, PORT = .*$", f'HOST, PORT = "127.0.0.1", {port}', parameters.source, flags=re.M
    )
    assert replaced == 1
    parameters.source = source  # everything else as the organizer finds it
    notebook.cells.append(nbformat.v4.new_code_cell(CONFIG_CHECK))
    execute(notebook, organizer)

    outputs = code_outputs(notebook)
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("<table" in table for table in html), "the memory table is not shown"
    printed = text_of(outputs)
    assert "trained a tokenizer of" in printed
    assert "preflight passed" in printed
    assert f"join link for volunteers: http://127.0.0.1:{port}" in printed
    assert f'COORDINATOR = "http://127.0.0.1:{port}"' in printed  # the cell to paste
    assert "volunteer trained" in printed
    written = RunConfig.from_file(organizer / "run.yaml")
    assert written.collaboration.run_id == "my-albert"
    assert [source.served for source in written.data.sources] == [True]


# --- the volunteer's notebook -------------------------------------------------------------------


@dataclasses.dataclass
class AllowlistedRun:
    hub: FakeHub
    coordinator: Coordinator
    root: Path


@pytest.fixture
def allowlisted_run(tmp_path: Path, quiet_kernel_env: None) -> Iterator[AllowlistedRun]:
    """A tiny run that only the Hub user alice may join, its coordinator, and the fake Hub."""
    port = free_port()
    config, tokenizer_dir = prepare(tmp_path, documents=300)
    state_dir = tmp_path / "coordinator"
    config = dataclasses.replace(
        config,
        collaboration=dataclasses.replace(
            config.collaboration, run_id="join-notebook", target_batch_size=16
        ),
        access=dataclasses.replace(
            config.access,
            usernames=("alice",),
            authority_public_key=create_authority(state_dir),
            coordinator=f"/ip4/127.0.0.1/tcp/{port}/ws",
        ),
    )
    with FakeHub() as hub:
        hub.add_user("alice", token="hf_alice")
        options = CoordinatorOptions(
            host="127.0.0.1",
            port=port,
            state_dir=str(state_dir),
            tokenizer_dir=str(tokenizer_dir),
            hf_endpoint=hub.endpoint,
            metrics_period=1.0,
        )
        coordinator = Coordinator(config, options)
        coordinator.start()
        try:
            yield AllowlistedRun(hub, coordinator, tmp_path)
        finally:
            coordinator.shutdown()


JOIN_CHECK = """
import json, time
from kit.volunteer import http_get

deadline = time.monotonic() + 120
on_board = []
while time.monotonic() < deadline:
    if volunteer.status.state.value == "failed":
        raise RuntimeError(volunteer.status.message)
    if volunteer.status.samples_total > 0:
        rows = json.loads(http_get(COORDINATOR + "/api/leaderboard"))["leaderboard"]
        on_board = [r for r in rows if r["username"] == "alice" and r["samples"] > 0]
        if on_board:
            break
    time.sleep(1.0)
assert on_board, f"alice not on the leaderboard in time: {volunteer.status}"
assert volunteer.status.username == "alice"
volunteer.stop()
assert volunteer.status.state.value == "stopped", volunteer.status
print("volunteer stopped after", volunteer.status.samples_total, "samples")
"""


JOIN_CHECK += """
import importlib.metadata, sys
assert kit.__file__.startswith(sys.prefix), kit.__file__  # the wheel, not the developer's kit
print("kit", kit.__version__, "from", kit.__file__)
"""


def fresh_venv_kernel(root: Path) -> str:
    """A virtual environment that sees this interpreter's packages (torch, ipykernel, ...) but not
    this checkout's kit, and a Jupyter kernel running in it; returns the kernel's name.

    Not ``--system-site-packages``: run from a virtual environment (or a conda env), that gives
    the *base* interpreter's packages, which may lack ipykernel and everything else. Instead a
    ``.pth`` file lists the site-packages folders of the interpreter running the tests, as plain
    paths: Python does not read the ``.pth`` files inside them, so this checkout's editable kit
    (an import hook in such a file) stays out, as on a fresh Colab machine.
    """
    venv = root / "venv"
    # --without-pip: pip (and setuptools) come from the tests' interpreter like everything else,
    # as on Colab; a venv's own old setuptools would make pip want to upgrade it for torch.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    folders = [p for p in dict.fromkeys(site.getsitepackages()) if Path(p).is_dir()]
    (own,) = (venv / "lib").glob("python3*/site-packages")
    (own / "tests-interpreter.pth").write_text("".join(f"{folder}\n" for folder in folders))
    spec = root / "jupyter" / "kernels" / "kit-venv"
    spec.mkdir(parents=True)
    argv = [str(venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "kit venv", "language": "python"})
    )
    return "kit-venv"


def site_packages(venv: Path) -> list[str]:
    (folder,) = (venv / "lib").glob("python3*/site-packages")
    ours = ("__pycache__", "tests-interpreter.pth")
    return sorted(path.name for path in folder.iterdir() if path.name not in ours)


@pytest.mark.notebooks
@pytest.mark.sockets
@pytest.mark.processes  # the kernel is a training peer of its own
def test_join_notebook_installs_from_the_coordinator_in_a_fresh_venv_and_trains(
    allowlisted_run: AllowlistedRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat
    from nbclient import NotebookClient

    run = allowlisted_run
    link = run.coordinator.join_url
    # The notebook as the dashboard hands it out: the link filled in, INSTALL = True.
    notebook = nbformat.reads(http_get(link + "/join.ipynb").decode(), as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert len(code) == 1, "the join notebook is one cell"
    assert f'COORDINATOR = "{link}"' in code[0].source
    assert re.search(r"^INSTALL = True\b", code[0].source, re.M)
    notebook.cells.append(nbformat.v4.new_code_cell(JOIN_CHECK))
    kernel = fresh_venv_kernel(run.root)
    monkeypatch.setenv("JUPYTER_PATH", str(run.root / "jupyter"))
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the kernel must import the installed wheel
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # nothing may be downloaded: no package upgraded
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.setenv("HF_ENDPOINT", run.hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_alice")
    workdir = run.root / "volunteer"
    workdir.mkdir()
    NotebookClient(
        notebook,
        kernel_name=kernel,
        timeout=NOTEBOOK_TIMEOUT,
        resources={"metadata": {"path": str(workdir)}},
    ).execute()

    outputs = code_outputs(notebook)
    assert not [o for o in outputs if o.get("output_type") == "error"], text_of(outputs)[-3000:]
    # Only kit went into the venv: every dependency was already there and stayed as it was.
    assert site_packages(run.root / "venv") == ["kit", "kit_collab-0.1.0.dist-info"]
    printed = text_of(outputs)
    assert "kit 0.1.0 from " + str(run.root / "venv") in printed, printed[-2000:]
    widgets = [
        o
        for o in code[0].outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert widgets, "kit.join showed no panel"
    # The widget state nbclient saved: the panel ended on "stopped", and no login box was shown
    # (the kernel's HF_TOKEN logged in by itself).
    state = json.dumps(notebook.metadata.get("widgets", {}))
    assert ">stopped</span>" in state
    assert "PasswordModel" not in state
    assert "volunteer stopped after" in printed
    rows = run.coordinator.collector.leaderboard()
    alice = [row for row in rows if row["username"] == "alice"]
    assert alice and alice[0]["samples"] > 0 and alice[0]["verified"], rows


def test_the_repository_join_notebook_is_the_served_one_with_a_placeholder() -> None:
    from kit.join_notebook import PLACEHOLDER_LINK, join_notebook

    assert json.loads((NOTEBOOKS / "join.ipynb").read_text("utf-8")) == join_notebook()
    assert PLACEHOLDER_LINK in (NOTEBOOKS / "join.ipynb").read_text("utf-8")


@pytest.mark.sockets
def test_wrong_token_in_the_login_widget_is_one_readable_line(
    allowlisted_run: AllowlistedRun,
) -> None:
    from kit.ui import LoginWidget
    from kit.volunteer import Volunteer

    volunteer = Volunteer(
        allowlisted_run.coordinator.join_url,
        work_dir=allowlisted_run.root / "mallory",
        host="127.0.0.1",
    )
    started: list[str] = []
    try:
        assert volunteer.needs_login
        login = LoginWidget(check=volunteer.login, on_success=lambda user, _: started.append(user))
        login.password.value = "hf_not_a_real_token"
        login.button.click()
        shown = login.status.value
        assert "help:" in shown and "Traceback" not in shown, shown
        assert "refused this access token" in shown, shown
        assert "hf_not_a_real_token" not in shown  # the secret is never echoed
        assert not started and login.username is None and volunteer.needs_login
        assert not login.button.disabled  # the volunteer can paste another token
        login.password.value = "hf_alice"
        login.button.click()
        assert started == ["alice"] and "Logged in as alice" in login.status.value, (
            login.status.value
        )
    finally:
        volunteer.stop()


# --- Binder ---------------------------------------------------------------------------------------


def _requirement_lines(path: Path) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line]


def test_binder_files_match_the_project() -> None:
    binder = _requirement_lines(BINDER / "requirements.txt")
    development = _requirement_lines(REPO / "requirements.txt")
    torch_pin = [line for line in development if line.startswith("torch==")]
    assert len(torch_pin) == 1
    assert torch_pin[0] in binder, "binder's torch pin differs from requirements.txt"
    # A CPU build from the PyTorch CPU index; nothing that pulls CUDA wheels onto Binder.
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in binder
    requirements = "\n".join(binder).lower().replace("/whl/cpu", "")
    for cuda in ("+cu", "/whl/cu", "nvidia-", "cuda"):
        assert cuda not in requirements, f"binder/requirements.txt asks for a CUDA build: {cuda}"
    # torch's pin satisfies setup.cfg's lower bound; kit comes with the notebook and eval extras.
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    requires = setup["options"]["install_requires"].split()
    (bound,) = [r for r in requires if r.startswith("torch>=")]
    pinned = tuple(int(part) for part in torch_pin[0].split("==")[1].split("."))
    assert pinned >= tuple(int(part) for part in bound.split(">=")[1].split("."))
    extras = setup["options.extras_require"]
    install = [line for line in binder if line.startswith("-e")]
    assert len(install) == 1 and install[0].startswith("-e .["), "kit from the repository root"
    wanted = set(re.search(r"\[(.*)\]", install[0]).group(1).split(","))  # type: ignore[union-attr]
    assert {"notebook", "eval"} <= wanted and wanted <= set(extras)
    runtime = (BINDER / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.\d+", runtime), runtime
    floor = setup["options"]["python_requires"].removeprefix(">=")
    assert int(runtime.split(".")[1]) >= int(floor.split(".")[1]), (runtime, floor)
    # Every notebook the Binder files (and the README's Binder link) name exists.
    readme = (REPO / "README.md").read_text()
    text = (BINDER / "requirements.txt").read_text() + readme
    named = set(re.findall(r"notebooks/[\w.-]+\.ipynb", text))
    named |= {"notebooks/config.ipynb", "notebooks/evaluate.ipynb"}
    for name in sorted(named):
        assert (REPO / name).is_file(), f"{name} is named but missing"

"""The organizer's and the volunteer's notebooks, run headless with nbclient, and the Binder files.

* ``notebooks/config.ipynb`` with a tiny allowlisted run: it writes run.yaml, shows the memory
  table and starts a coordinator whose ``/api/run`` a cell appended here checks.
* ``notebooks/join.ipynb`` (one cell) against a real coordinator started here, logging in through
  a fake Hugging Face Hub with the ``HF_TOKEN`` the kernel inherits: it trains in the background,
  shows up on the leaderboard, and stops cleanly. A wrong token in the login widget gives one
  readable line, not a traceback.
* ``binder/``: CPU torch pinned like requirements.txt, kit installed with its notebook extras.
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kit.config import RunConfig
from kit.coordinator import Coordinator, CoordinatorOptions, create_authority
from kit.demo import prepare
from kit.testing.fake_hub import FakeHub

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
import json, urllib.request
from kit.config import RunConfig
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(coordinator.join_url + "/api/run", timeout=30) as answer:
        run = json.loads(answer.read())
    assert run["run_id"] == RUN_ID == config.collaboration.run_id, run["run_id"]
    assert run["config_hash"] == config.config_hash()
    assert run["authority_public_key"] == config.access.authority_public_key
    assert run["initial_peers"] and run["tokenizer_url"] == "/api/tokenizer.json"
    reloaded = RunConfig.from_file("run.yaml")
    assert reloaded == config and reloaded.config_hash() == run["config_hash"]
    assert RunConfig.from_dict(run["config"]) == config
    assert list(reloaded.access.usernames) == ALLOWLIST
    print("api/run checked:", run["config_hash"][:16])
finally:
    coordinator.shutdown()
"""


@pytest.mark.notebooks
@pytest.mark.sockets
def test_config_notebook_writes_run_yaml_and_starts_a_coordinator(
    tmp_path: Path, quiet_kernel_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat

    # This run needs no Hub: a call to it would fail at once on a closed loopback port. (Not
    # HF_HUB_OFFLINE: huggingface_hub reads it once at import, and this process imports it.)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    _, tokenizer_dir = prepare(tmp_path / "data", documents=200)
    port = free_port()
    notebook = nbformat.read(NOTEBOOKS / "config.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source = "\n".join(
        [
            'RUN_ID = "notebook-test"',
            'MODEL = "tiny"',
            f"DATA_FILES = [{str(tmp_path / 'data' / 'demo_corpus' / '*.txt')!r}]",
            f"TOKENIZER_DIR = {str(tokenizer_dir)!r}",
            "TARGET_BATCH_SIZE = 16",
            "LEARNING_RATE = 0.01",
            "WARMUP_STEPS = 5",
            "TOTAL_STEPS = 100",
            'ALLOWLIST = ["alice"]',
            "ORGANIZATIONS = []",
            "HUB_REPO = None",
            "PUBLIC_ADDRESS = None",
            f'HOST, PORT = "127.0.0.1", {port}',
            f"STATE_DIR = {str(tmp_path / 'state')!r}",
            "START_COORDINATOR = True",
        ]
    )
    notebook.cells.append(nbformat.v4.new_code_cell(CONFIG_CHECK))
    execute(notebook, tmp_path)

    outputs = code_outputs(notebook)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert not [o for o in outputs if o.get("name") == "stderr" and "Traceback" in o["text"]]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("<table" in table for table in html), "the memory table is not shown"
    printed = text_of(outputs)
    assert f"join link for volunteers: http://127.0.0.1:{port}" in printed
    assert "api/run checked:" in printed
    written = RunConfig.from_file(tmp_path / "run.yaml")
    assert written.collaboration.run_id == "notebook-test"
    assert written.access.usernames == ("alice",)
    assert written.access.authority_public_key == create_authority(tmp_path / "state")


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


def _join_parameters(source: str, coordinator: str) -> str:
    """The join cell with the coordinator's link and the install line skipped."""
    source, links = re.subn(
        r'^COORDINATOR = ".*"$', f"COORDINATOR = {coordinator!r}", source, flags=re.M
    )
    source, installs = re.subn(r"^INSTALL = True\b", "INSTALL = False", source, flags=re.M)
    assert links == 1 and installs == 1, "the join cell no longer has COORDINATOR / INSTALL lines"
    return source


@pytest.mark.notebooks
@pytest.mark.sockets
@pytest.mark.processes  # the kernel is a training peer of its own
def test_join_notebook_logs_in_trains_and_stops(
    allowlisted_run: AllowlistedRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat

    run = allowlisted_run
    notebook = nbformat.read(NOTEBOOKS / "join.ipynb", as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert len(code) == 1, "the join notebook is one cell"
    code[0].source = _join_parameters(code[0].source, run.coordinator.join_url)
    notebook.cells.append(nbformat.v4.new_code_cell(JOIN_CHECK))
    monkeypatch.setenv("HF_ENDPOINT", run.hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_alice")
    workdir = run.root / "volunteer"
    workdir.mkdir()
    execute(notebook, workdir)

    outputs = code_outputs(notebook)
    assert not [o for o in outputs if o.get("output_type") == "error"]
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
    assert "volunteer stopped after" in text_of(outputs)
    rows = run.coordinator.collector.leaderboard()
    alice = [row for row in rows if row["username"] == "alice"]
    assert alice and alice[0]["samples"] > 0 and alice[0]["verified"], rows


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

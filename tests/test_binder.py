"""Binder's environment, built as repo2docker builds it, runs both notebooks with their CPU defaults.

repo2docker installs the Python that ``binder/runtime.txt`` names, runs ``pip install -r
binder/requirements.txt`` from the repository root, and installs nothing else. So does this test:
a fresh virtual environment of the ``python3.X`` found on PATH (skipped, saying so, when there is
none), those requirements alone, and a Jupyter kernel of that environment that runs

* ``notebooks/config.ipynb`` as shipped (the tiny preset on the organizer's ``corpus/``), on a
  loopback port: its coordinator starts, passes its start-up check, answers ``/api/run``, and is
  stopped by a cell appended here (the port is free afterwards);
* ``notebooks/evaluate.ipynb`` with its CPU defaults on a Hub repo (``RUN``): the checkpoints of a
  real ``kit demo`` run, pushed by kit's own push to a fake Hub, with tiny local task data. The
  table carries the CPU quick profile's column.

Nothing comes from the Internet but packages: the index of PyTorch's CPU wheels that the
requirements name may not resolve where the tests run; pip then finds the same CPU wheel among
its local wheels (``PIP_FIND_LINKS``), and ``PIP_RETRIES=1`` keeps each failed lookup of that
index instant (pip's default five retries back off for ~8 s per package).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation import tiny
from tests.test_notebooks import code_outputs, free_port, text_of

REPO = Path(__file__).resolve().parents[1]
BINDER = REPO / "binder"
#: Seconds the fresh environment's install may take (about 1 min with pip's cache warm).
INSTALL_TIMEOUT = 900
#: Seconds a whole notebook may take in it (each runs in under a minute here).
NOTEBOOK_TIMEOUT = 300

CONFIG_CHECK = """
import json
from kit.volunteer import http_get

try:
    assert coordinator is not None, "the coordinator did not start"
    run = json.loads(http_get(coordinator.join_url + "/api/run"))
    assert run["run_id"] == RUN_ID and run["install"].endswith(".whl"), run
    print("coordinator answered /api/run of", run["run_id"])
finally:
    if coordinator is not None:
        coordinator.shutdown()
        print("coordinator stopped")
"""


def runtime_python() -> str:
    """The interpreter binder/runtime.txt names, from PATH; skips the test when there is none."""
    runtime = (BINDER / "runtime.txt").read_text().strip()
    version = runtime.removeprefix("python-")
    found = shutil.which(f"python{version}")
    if found is None:
        pytest.skip(f"binder/runtime.txt asks for Python {version}: no python{version} on PATH")
    return found


def binder_environment(root: Path) -> Path:
    """A fresh venv with binder/requirements.txt installed, as repo2docker runs it."""
    venv = root / "binder-venv"
    subprocess.run([runtime_python(), "-m", "venv", str(venv)], check=True, timeout=300)
    log = root / "pip.log"
    environment = dict(os.environ, PIP_RETRIES="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    environment.pop("PYTHONPATH", None)
    with log.open("w") as output:
        done = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-r", "binder/requirements.txt"],
            cwd=REPO,  # as repo2docker does: "." in the requirements is the repository
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=INSTALL_TIMEOUT,
        )
    assert done.returncode == 0, log.read_text()[-4000:]
    return venv


def kernel_of(venv: Path, jupyter: Path) -> str:
    """A Jupyter kernel spec running ``venv``'s Python; returns its name."""
    spec = jupyter / "kernels" / "binder"
    spec.mkdir(parents=True)
    argv = [str(venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "Binder", "language": "python"})
    )
    return "binder"


def execute(notebook: Any, kernel: str, cwd: Path) -> str:
    """Run ``notebook`` in ``cwd``; returns all it printed or showed as text, HTML or Markdown;
    fails on any error output."""
    from nbclient import NotebookClient

    NotebookClient(
        notebook,
        kernel_name=kernel,
        timeout=NOTEBOOK_TIMEOUT,
        resources={"metadata": {"path": str(cwd)}},
    ).execute()
    outputs = code_outputs(notebook)
    markdown = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    printed = "\n".join([text_of(outputs), *markdown])
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, [(o["ename"], o["evalue"]) for o in errors] + [printed[-3000:]]
    return printed


def set_parameters(notebook: Any, values: dict[str, object]) -> None:
    (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    for name, value in values.items():
        cell.source, found = re.subn(
            rf"^{re.escape(name)} = .*$", f"{name} = {value!r}", cell.source, flags=re.M
        )
        assert found == 1, name


def push_demo_checkpoints(hub: Any, demo_run: Path, repo: str) -> list[int]:
    """The demo's checkpoints, pushed to ``repo`` as its coordinator pushes them."""
    from huggingface_hub import HfApi

    from kit.training.checkpoint_format import read_checkpoint_info
    from kit.training.checkpoint_hub import push_checkpoint

    hub.add_user("organizer", token="hf_organizer")
    api = HfApi(endpoint=hub.endpoint, token="hf_organizer")
    api.create_repo(repo)
    steps = []
    for folder in sorted((demo_run / "coordinator" / "checkpoints").glob("step_*")):
        step = int(read_checkpoint_info(folder)["step"])
        push_checkpoint(api, repo, step, folder)
        steps.append(step)
    return steps


def port_is_closed(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2.0)
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.notebooks
@pytest.mark.sockets
@pytest.mark.processes
@pytest.mark.timeout(INSTALL_TIMEOUT + 2 * NOTEBOOK_TIMEOUT + 400)  # + the session's demo run
def test_binder_environment_runs_the_config_and_evaluation_notebooks_with_cpu_defaults(
    demo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat

    from kit.demo import write_corpus
    from kit.testing.fake_hub import FakeHub

    started = time.monotonic()
    venv = binder_environment(tmp_path)
    installed = time.monotonic() - started
    kernel = kernel_of(venv, tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the kernel imports the environment's kit
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # Binder: a CPU

    # The organizer's notebook: the tiny preset on its corpus/, on loopback (a test listens
    # nowhere else; on Binder the defaults' 0.0.0.0 is a container's own interface).
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # no Hub in this run
    organizer = tmp_path / "organizer"
    write_corpus(organizer / "corpus", documents=600)
    port = free_port()
    config = nbformat.read(REPO / "notebooks" / "config.ipynb", as_version=4)
    (parameters,) = [c for c in config.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source, replaced = re.subn(
        r"^HOST, PORT = .*$", f'HOST, PORT = "127.0.0.1", {port}', parameters.source, flags=re.M
    )
    assert replaced == 1
    config.cells.append(nbformat.v4.new_code_cell(CONFIG_CHECK))
    printed = execute(config, kernel, organizer)
    assert (
        "preflight passed" in printed
        and f"join link for volunteers: http://127.0.0.1:{port}" in printed
    )
    assert (
        "coordinator answered /api/run of my-albert" in printed and "coordinator stopped" in printed
    )
    assert port_is_closed(port), "the config notebook's coordinator still listens"

    # The researcher's notebook on the run's Hub repo, CPU defaults, tiny task data.
    data = tmp_path / "tasks"
    datasets = {
        "ner": str(tiny.make_ner_dataset(data / "ner")),
        "ncc": str(tiny.make_ncc_dataset(data / "ncc")),
    }
    with FakeHub() as hub:
        steps = push_demo_checkpoints(hub, demo_run, "organizer/kit-demo")
        judged = [steps[0], steps[-1]] if len(steps) > 1 else steps[-1:]
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        evaluation = nbformat.read(REPO / "notebooks" / "evaluate.ipynb", as_version=4)
        set_parameters(
            evaluation,
            {"RUN": "organizer/kit-demo", "DATASETS": datasets, "OUTPUT_DIR": "evaluation"},
        )
        researcher = tmp_path / "researcher"
        researcher.mkdir()
        printed = execute(evaluation, kernel, researcher)
        fetched = {request.path for request in hub.requests}
    plan = [line for line in printed.splitlines() if line.startswith("On the CPU: ")]
    assert plan and f"{len(judged)} model(s) (no baselines)" in plan[0], printed[-3000:]
    assert "Not done here:" in plan[0] and "the baselines (sahajBERT" in plan[0], plan[0]
    column = "(CPU quick profile: 48 train, 16 test, 1 seed)"
    for step in judged:
        assert re.search(
            rf"\| this run \(step {step}\) \| [\d.]+ \| [\d.]+ \| {re.escape(column)} \|", printed
        ), printed[-2000:]
    assert any("/resolve/" in path and "model.safetensors" in path for path in fetched)
    results = json.loads((researcher / "evaluation" / "results.json").read_text())
    assert [model["name"] for model in results["models"]] == [
        f"this run (step {s})" for s in judged
    ]
    print(f"binder environment installed in {installed:.0f} s; both notebooks ran")

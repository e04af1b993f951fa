"""``kit.ui`` without ipywidgets (a GPU server): the console view works; widgets say what is missing."""

from __future__ import annotations

import subprocess
import sys

BLOCK_AND_USE = """
import sys

class NoIpywidgets:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ipywidgets":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoIpywidgets())
import kit.ui, kit.volunteer
from kit.training.status import TrainingState, TrainingStatus
reporter = kit.ui.ConsoleReporter()
reporter.update(TrainingStatus(state=TrainingState.TRAINING))
reporter.close()
assert "ipywidgets" not in sys.modules
try:
    kit.ui.TrainingPanel(on_stop=lambda: None)
except ModuleNotFoundError as error:
    print("widgets need:", error.name)
"""


def test_kit_ui_imports_and_draws_on_a_console_without_ipywidgets() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_USE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "widgets need: ipywidgets"

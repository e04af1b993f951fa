"""The ``kit`` command's console: kit's own messages at the chosen level, other libraries' INFO
lines (websockets' "HTTP response sent", "connection closed") only with ``--log-level DEBUG``."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
from kit.cli import configure_logging
configure_logging(sys.argv[1])
logging.getLogger("kit.demo").info("kit says hello")
logging.getLogger("websockets.server").info("HTTP response sent (200 OK)")
logging.getLogger("websockets.server").warning("a websockets warning")
"""


@pytest.mark.parametrize(
    ("level", "shown", "hidden"),
    [
        ("INFO", ["kit says hello", "a websockets warning"], ["HTTP response sent"]),
        ("DEBUG", ["kit says hello", "HTTP response sent", "a websockets warning"], []),
        ("WARNING", ["a websockets warning"], ["kit says hello", "HTTP response sent"]),
    ],
)
def test_third_party_info_lines_only_with_debug(level: str, shown: list, hidden: list) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, level], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for text in shown:
        assert text in done.stderr
    for text in hidden:
        assert text not in done.stderr

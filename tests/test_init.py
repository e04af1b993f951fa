"""``import kit as hivemind``: hivemind's top-level names and subpackages, loaded lazily.

Covers ``kit/__init__.py`` and the two re-exports for ported hivemind scripts, ``kit/utils.py``
and ``kit/compression.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_hivemind_names_are_reachable_and_import_kit_stays_light() -> None:
    script = """
import sys
import kit as hivemind
assert "torch" not in sys.modules, "import kit must not import torch"
assert isinstance(hivemind.utils.get_dht_time(), float)
assert "torch" not in sys.modules, "kit.utils must not import torch"
from kit.averaging import adaptive_compression, compression
assert hivemind.compression.Float16Compression is compression.Float16Compression
assert hivemind.compression.PerTensorCompression is adaptive_compression.PerTensorCompression
import kit.averaging
assert kit.averaging.SizeAdaptiveCompression is adaptive_compression.SizeAdaptiveCompression
assert kit.SizeAdaptiveCompression is adaptive_compression.SizeAdaptiveCompression
assert hivemind.optim.Optimizer is hivemind.Optimizer
assert hivemind.averaging.DecentralizedAverager is hivemind.DecentralizedAverager
from kit.averaging.allreduce import AveragingMode
from kit.averaging.control import AveragingStage, StepControl
assert [m.value for m in AveragingMode] == [0, 1, 2]
assert AveragingStage.FINISHED.value == 4
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_unknown_names_raise_attribute_error() -> None:
    import kit

    with pytest.raises(AttributeError):
        kit.TrainingAverager  # noqa: B018 - hivemind's deprecated averager: not in kit
    assert kit.utils.ValueWithExpiration is kit.dht.ValueWithExpiration

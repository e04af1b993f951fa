"""The wheel of the running kit, as the coordinator serves it: built offline from the source tree,
cached by version and source digest, complete (package data and entry point included), and made
again from an installed (non-editable) kit that has no source tree."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kit
from kit.wheel import kit_wheel, source_root, wheel_name


def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return archive.read(name).decode()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert source_root() is not None  # the tests run from a checkout
    return kit_wheel(tmp_path_factory.mktemp("cache"))


def test_the_wheel_is_this_kit_and_is_cached(built: Path, tmp_path: Path) -> None:
    assert built.name == wheel_name() == f"kit_collab-{kit.__version__}-py3-none-any.whl"
    inside = names(built)
    assert "kit/__init__.py" in inside and "kit/dashboard/page.html" in inside
    assert not any("__pycache__" in name or name.startswith("tests/") for name in inside)
    text = metadata(built)
    assert f"Version: {kit.__version__}" in text and "Requires-Dist: torch>=2.1" in text
    stamp = built.stat().st_mtime_ns
    assert kit_wheel(built.parent.parent) == built and built.stat().st_mtime_ns == stamp
    root = source_root()
    assert root is not None and not (root / "build").exists()  # built on a copy
    elsewhere = kit_wheel(tmp_path / "another-state-dir")  # another coordinator here: a copy
    assert elsewhere != built and elsewhere.read_bytes() == built.read_bytes()


def test_an_installed_kit_without_sources_packs_itself_again(built: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-qq", "--no-deps", "--no-index"]
    subprocess.run([*pip, "--target", str(site), str(built)], check=True, timeout=180)
    environment = dict(os.environ, PYTHONPATH=str(site))
    script = (
        "import sys, kit.wheel; assert kit.wheel.source_root() is None, kit.__file__; "
        f"print(kit.wheel.kit_wheel({str(tmp_path / 'cache')!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=environment,
        cwd=tmp_path,  # not the checkout: "-c" puts the current folder first on sys.path
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    repacked = Path(done.stdout.strip())
    assert names(repacked) >= {"kit/__init__.py", "kit/dashboard/page.html"}
    assert f"Version: {kit.__version__}" in metadata(repacked)
    again = tmp_path / "again"  # pip accepts it (its RECORD's hashes are right)
    subprocess.run([*pip, "--target", str(again), str(repacked)], check=True, timeout=180)
    assert (again / "kit" / "wheel.py").read_bytes() == (site / "kit" / "wheel.py").read_bytes()

"""The wheel of the running kit, which the coordinator serves so every volunteer runs its version.

:func:`kit_wheel` returns a ``.whl`` of exactly the kit this process imported, built once per
version and source digest into a cache folder (the coordinator's state folder):

* from a source tree (a checkout, an editable install): ``pip wheel --no-deps
  --no-build-isolation --no-index`` on a copy of the tree, so nothing is downloaded and the
  checkout gets no ``build/`` folder;
* from an installed wheel (no source tree): the installed files named in the distribution's
  ``RECORD``, packed again with a fresh ``RECORD``.

The join notebook installs it with ``pip install --no-deps --force-reinstall`` (the organizer's
build, even when a kit of the same version is there) and then a plain ``pip install`` of the same
file, which only adds missing dependencies: ``setup.cfg`` holds lower bounds only, so nothing
Colab or Kaggle preinstalled is upgraded. It doesn't serve the file (the coordinator does).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import kit
from kit.errors import KitError

logger = logging.getLogger(__name__)

#: The distribution name of kit on the package index (and in its wheel's file name).
DISTRIBUTION = "kit-collab"
#: Files of a source tree that go into the wheel besides the ``kit`` package.
PROJECT_FILES = ("setup.cfg", "pyproject.toml", "README.md")
#: Seconds ``pip wheel`` may take (it takes ~1-3 s offline).
BUILD_TIMEOUT = 300.0
#: Wheels this process built, by source digest: another coordinator here copies instead.
_BUILT: dict[str, Path] = {}


def wheel_name(version: str = kit.__version__) -> str:
    """The file name of kit's wheel, e.g. ``kit_collab-0.1.0-py3-none-any.whl``."""
    return f"{DISTRIBUTION.replace('-', '_')}-{version}-py3-none-any.whl"


def source_root() -> Path | None:
    """The project folder of the running kit when it runs from a source tree, else None."""
    root = Path(kit.__file__).resolve().parent.parent
    return root if all((root / name).is_file() for name in PROJECT_FILES[:2]) else None


def _package_files(root: Path) -> list[Path]:
    package = root / "kit"
    return sorted(
        path
        for path in package.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.suffix not in (".pyc", ".pyo")
    )


def source_digest(root: Path) -> str:
    """SHA-256 over the package files and project files of a source tree (names and bytes)."""
    digest = hashlib.sha256()
    files = _package_files(root) + [
        root / name for name in PROJECT_FILES if (root / name).is_file()
    ]
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def kit_wheel(cache_dir: str | os.PathLike[str]) -> Path:
    """The wheel of the running kit, built (or found) in ``cache_dir``.

    Raises:
        KitError: the wheel cannot be built here (the message says why and what to do).
    """
    root = source_root()
    if root is None:
        return _repacked_wheel(Path(cache_dir))
    digest = source_digest(root)
    folder = Path(cache_dir) / f"{kit.__version__}-{digest[:16]}"
    target = folder / wheel_name()
    if target.is_file():
        return target
    earlier = _BUILT.get(digest)
    if earlier is not None and earlier.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(earlier, target)
        return target
    with tempfile.TemporaryDirectory(prefix="kit-wheel-") as scratch:
        copy = Path(scratch) / "src"
        copy.mkdir()
        for path in _package_files(root):
            destination = copy / path.relative_to(root)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
        for name in PROJECT_FILES:
            if (root / name).is_file():
                shutil.copy2(root / name, copy / name)
        built = Path(scratch) / "out"
        built_wheel = _pip_wheel(copy, built, offline=True)
        if built_wheel is None:
            logger.info("building kit's wheel offline failed; trying with pip's build isolation")
            built_wheel = _pip_wheel(copy, built, offline=False)
        assert built_wheel is not None  # the online attempt raises instead
        folder.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(built_wheel, partial)
        os.replace(partial, target)
    _BUILT[digest] = target
    logger.info("built %s for volunteers", target)
    return target


_HELP = "install setuptools>=64 and wheel (pip install setuptools wheel), then start again"


def _pip_wheel(source: Path, output: Path, *, offline: bool) -> Path | None:
    """``pip wheel`` of ``source``; offline with the installed setuptools, else isolated (this
    downloads setuptools, for Pythons whose environments come without it)."""
    flags = ["--no-build-isolation", "--no-index"] if offline else []
    command = [
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", *flags,
        "--wheel-dir", str(output), str(source),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        if offline:
            return None
        raise KitError(f"building kit's wheel failed ({error}) - help: {_HELP}") from None
    wheels = list(output.glob("*.whl"))
    if done.returncode == 0 and len(wheels) == 1:
        return wheels[0]
    if offline:
        return None
    raise KitError(f"building kit's wheel failed: {done.stderr.strip()[-500:]} - help: {_HELP}")


def _repacked_wheel(cache_dir: Path) -> Path:
    """A wheel of an installed (non-editable) kit, from the files its RECORD lists."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise KitError(
            f"kit runs from neither a source tree nor an installed {DISTRIBUTION} - help: "
            "install kit with pip, or run it from its repository"
        ) from None
    files = [path for path in distribution.files or () if not str(path).endswith(".pyc")]
    target = cache_dir / f"{kit.__version__}-installed" / wheel_name()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    record_name = next(str(p) for p in files if str(p).endswith(".dist-info/RECORD"))
    rows = []
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            name = str(path)
            if name == record_name or name.startswith(("..", "/")) or "__pycache__" in name:
                continue  # scripts outside site-packages are made again by pip at install
            data = Path(str(distribution.locate_file(path))).read_bytes()
            if name.endswith((".dist-info/INSTALLER", ".dist-info/direct_url.json")):
                continue  # written by the installer, not part of a wheel
            archive.writestr(name, data)
            encoded = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{name},sha256={encoded.decode()},{len(data)}")
        rows.append(f"{record_name},,")
        archive.writestr(record_name, "\n".join(rows) + "\n")
    os.replace(partial, target)
    return target

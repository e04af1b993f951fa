"""``coordinator.json``: how ``kit revoke`` finds the coordinator that runs from a state dir.

Written atomically (one rename) when the coordinator is up, removed at its shutdown, it says
where the running coordinator answers on this machine (``url``: loopback for a wildcard
listener), its run id, authority key and process id. A file left by a coordinator that died
names a process that is gone or a port that does not answer, which ``kit revoke`` reports as no
coordinator running. Torch-free, standard library only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kit.config import RunConfig
from kit.errors import ConfigError

COORDINATOR_FILE = "coordinator.json"


def coordinator_file_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / COORDINATOR_FILE


def local_url(host: str, port: int, *, secure: bool) -> str:
    """Where this machine reaches a port that listens on ``host`` (any address: loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if secure else 'http'}://{shown}:{port}"


def write_coordinator_file(
    state_dir: str | Path, config: RunConfig, host: str, port: int | None, *, secure: bool
) -> None:
    """Say in ``state_dir`` that this process serves ``config``'s run on ``port`` (one rename)."""
    body = {
        "url": local_url(host, port or 0, secure=secure),
        "run_id": config.collaboration.run_id,
        "authority_public_key": config.access.authority_public_key,
        "pid": os.getpid(),
        "started": time.time(),
    }
    path = coordinator_file_path(state_dir)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(body, indent=1) + "\n", "utf-8")
    os.replace(partial, path)


def remove_coordinator_file(state_dir: str | Path) -> None:
    """Remove ``coordinator.json`` if this process wrote it (a stopping coordinator)."""
    path = coordinator_file_path(state_dir)
    try:
        written_by = json.loads(path.read_text("utf-8")).get("pid")
    except (OSError, ValueError, AttributeError):
        return
    if written_by == os.getpid():
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class CoordinatorFile:
    """What ``coordinator.json`` says of the coordinator that wrote it."""

    url: str  # where it answers on this machine, e.g. http://127.0.0.1:8765
    run_id: str
    authority_public_key: str | None  # base58, None: an open run
    pid: int  # its process


def read_coordinator_file(state_dir: str | Path) -> CoordinatorFile | None:
    """The state dir's ``coordinator.json`` (None: there is none).

    Raises:
        ConfigError: the file is not one a coordinator writes.
    """
    path = coordinator_file_path(state_dir)
    try:
        body = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} is unreadable ({type(e).__name__}) - help: delete it if no coordinator "
            "runs from this state dir; a coordinator writes it when it starts"
        ) from None
    key = body.get("authority_public_key") if isinstance(body, dict) else None
    if (
        not isinstance(body, dict)
        or not isinstance(body.get("url"), str)
        or not isinstance(body.get("run_id"), str)
        or type(body.get("pid")) is not int
        or not (key is None or isinstance(key, str))
    ):
        raise ConfigError(
            f"{path} is not a coordinator's - help: delete it if no coordinator runs from "
            "this state dir; a coordinator writes it when it starts"
        )
    return CoordinatorFile(body["url"], body["run_id"], key, body["pid"])


def process_alive(pid: int) -> bool:
    """True if a process ``pid`` exists (maybe another user's)."""
    if pid <= 0:
        return False
    if sys.platform == "win32":  # pragma: no cover - os.kill would END the process there
        return True  # its port tells
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists (another user's), or this platform cannot tell: ask its port
    return True

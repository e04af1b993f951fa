"""Linux network namespaces for :class:`kit.testing.netsim.NetSim`: their names, finding and
deleting the ones a dead run left, and the processes run in them (environment, output lines,
teardown).

Names are ``ksim<pid>x<n>-...``: the pid of the process that made them, so a later run deletes
the namespaces of runs whose process is gone (a killed CI job) and never those of a live one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import subprocess
import time
from collections.abc import Sequence

from kit.errors import KitTimeout, NetnsUnavailable

logger = logging.getLogger(__name__)

NAME_PREFIX = "ksim"  # every namespace of every NetSim starts with this
COMMAND_TIMEOUT = 15.0  # one ip/tc/nft call; they take milliseconds
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
_line_buffers: dict[int, bytearray] = {}  # pid -> bytes read past the last line (read_line)


def check_available() -> None:
    """Raise :class:`NetnsUnavailable` unless namespaces, tc and nft can be used here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root - help: run these tests as root")
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(
                f"{tool!r} is not installed - help: run .ci/netns-deps.sh (iproute2, nftables)"
            )
    probe = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT
    )
    if probe.returncode != 0:
        raise NetnsUnavailable(f"`ip netns list` failed: {probe.stderr.strip()}")


def run_tag(pid: int, serial: int) -> str:
    """The namespace-name prefix of one NetSim: unique per process and per instance."""
    return f"{NAME_PREFIX}{pid}x{serial}"


def stale_namespaces(names: Sequence[str], alive: set[int]) -> list[str]:
    """Namespaces of ours whose creating process (the pid in the name) is not in ``alive``."""
    stale = []
    for name in names:
        pid_text = name[len(NAME_PREFIX) :].split("x", 1)[0]
        if name.startswith(NAME_PREFIX) and pid_text.isdigit() and int(pid_text) not in alive:
            stale.append(name)
    return stale


def list_namespaces() -> list[str]:
    listing = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT
    )
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


def clean_stale() -> list[str]:
    """Delete namespaces left by NetSims whose process died (e.g. killed CI jobs)."""
    alive = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    removed = stale_namespaces(list_namespaces(), alive)
    for name in removed:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=COMMAND_TIMEOUT)
    if removed:
        logger.info("removed stale namespaces %s", removed)
    return removed


def clean_environment() -> dict[str, str]:
    """The environment for processes in namespaces: no HTTP proxies (websockets >= 15 would
    send 10.231.x.x dials through one), and this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARIABLES}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    return env


def read_line(process: subprocess.Popen[bytes], *, timeout: float) -> str:
    """The next line a process started by :meth:`NetSim.popen` prints, waiting at most ``timeout``.

    Raises:
        KitTimeout: no full line within ``timeout`` (the process is left running).
        NetnsUnavailable: the process exited before printing a line.
    """
    assert process.stdout is not None, "start the process with NetSim.popen (stdout piped)"
    buffered = _line_buffers.setdefault(process.pid, bytearray())
    deadline = time.monotonic() + timeout
    while b"\n" not in buffered:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KitTimeout(f"no line from {process.args!r} within {timeout:.0f} s")
        readable, _, _ = select.select([process.stdout], [], [], remaining)
        if readable:
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                raise NetnsUnavailable(
                    f"{process.args!r} exited ({process.wait(5)}) before printing a line"
                )
            buffered += chunk
    line, _, rest = bytes(buffered).partition(b"\n")
    buffered[:] = rest
    return line.decode().strip()


def teardown(namespaces: list[str], processes: list[subprocess.Popen[bytes]]) -> None:
    # Kill processes first: a namespace with processes in it outlives `ip netns del`.
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(3.0)
        except subprocess.TimeoutExpired:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(3.0)
    for process in processes:
        _line_buffers.pop(process.pid, None)
    for name in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=COMMAND_TIMEOUT)
    namespaces.clear()
    processes.clear()

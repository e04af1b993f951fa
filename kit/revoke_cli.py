"""``kit revoke``: ban users or peer keys from a running coordinator, from its state dir.

::

    kit revoke --state-dir coordinator --user alice --duration 1d
    kit revoke --state-dir coordinator --peer-key 9aE4...base58 --duration 30m
    kit revoke --state-dir coordinator --list

Reads the run's authority key in the state dir (without the running coordinator's lock: the
key never changes), finds the coordinator that runs from that state dir (its
``coordinator.json``), signs a ban request and sends it (``kit.revocation_admin``: the format,
the coordinator's checks). The coordinator applies it as ``Coordinator.revoke`` does: their
connections close now, they get no new token, every other peer learns the ban from the DHT,
and the ban is kept across restarts. The answer is the ban list, signed by the authority: this
command verifies it with the key and prints the active bans on stdout (the product); ``--list``
prints them without banning anyone, from the kept list in the state dir when no coordinator
runs. Exit codes: 0 done, 1 failed (the reason on stderr), 2 a bad command line; a refused
request changes nothing.

Separate from ``kit.revocation_admin`` (the coordinator's side and the format both sides share)
as ``kit.auth.token_client`` is from ``kit.auth.endpoint``: this module is the organizer's
client and its printing, and nothing of it runs in the coordinator.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import datetime
import json
import logging
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kit.auth.revocation import RevocationList
from kit.coordinator_file import (
    CoordinatorFile,
    coordinator_file_path,
    process_alive,
    read_coordinator_file,
)
from kit.errors import (
    AccessRefused,
    ConfigError,
    CoordinatorUnreachable,
    KitError,
    KitUsageError,
    MalformedToken,
)
from kit.p2p.identity import PUBLIC_KEY_SIZE, Identity, PeerID, b58decode, b58encode
from kit.revocation_admin import BANS_PATH, REVOKE_PATH, RevokeRequest, ban_problem
from kit.run_authority import read_authority, read_revocations, revocations_path

logger = logging.getLogger(__name__)

#: Seconds to wait for the coordinator's answer (a ban waits for the DHT store).
DEFAULT_TIMEOUT = 60.0
MAX_ANSWER_BYTES = 1 << 20
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def add_command(subparsers: Any) -> None:
    """``kit revoke``: the organizer's bans, mid-run."""
    parser = subparsers.add_parser(
        "revoke",
        help="ban users or peer keys from a running coordinator (or --list the bans)",
        description=(
            "Ban Hugging Face users and/or peer keys from the run of the coordinator running "
            "from --state-dir: their connections close, they get no new token, every peer "
            "refuses them, until the ban ends. Signed with the authority key in --state-dir."
        ),
        epilog=(
            "examples:\n"
            "  kit revoke --state-dir coordinator --user alice --duration 7d\n"
            "  kit revoke --state-dir coordinator --peer-key KEY --duration 30m\n"
            "  kit revoke --state-dir coordinator --list"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--state-dir", default="coordinator", help="the coordinator's state dir (its --state-dir)"
    )
    parser.add_argument(
        "--user", action="append", default=[], metavar="NAME", help="Hub user to ban (repeatable)"
    )
    parser.add_argument(
        "--peer-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a peer's Ed25519 public key (base58) to ban (repeatable)",
    )
    parser.add_argument(
        "--duration", default="1d", help="how long: 30m, 12h, 1d, 7d, or seconds (default 1d)"
    )
    parser.add_argument("--list", action="store_true", help="show the active bans, ban nobody")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for the coordinator (default {DEFAULT_TIMEOUT:.0f})",
    )
    parser.set_defaults(handler=_revoke_command)


def _revoke_command(args: argparse.Namespace) -> int:
    usernames: list[str] = list(args.user)
    keys: list[bytes] = []
    duration = 0.0
    try:  # the whole command line first: a bad value bans nobody
        if args.list:
            if args.user or args.peer_key:
                raise ConfigError("--list bans nobody - help: drop --user/--peer-key, or --list")
        else:
            keys = [parse_peer_key(text) for text in args.peer_key]
            duration = parse_duration(args.duration)
            problem = ban_problem(usernames, keys, duration)
            if problem:
                raise ConfigError(problem)
        if not args.timeout > 0:
            raise ConfigError("--timeout must be > 0 seconds - help: keep the default (60)")
    except ConfigError as error:
        logger.error("%s", error)
        return 2
    try:
        if args.list:
            print(list_bans(args.state_dir, timeout=args.timeout).text(), flush=True)
            return 0
        bans = revoke(args.state_dir, usernames, keys, duration, timeout=args.timeout)
    except KitError as error:
        logger.error("%s", error)
        return 1
    banned = [f"user {name}" for name in usernames] + [f"key {b58encode(key)}" for key in keys]
    print(f"banned for {human_duration(duration)}: {', '.join(banned)}", flush=True)
    print(bans.text(), flush=True)
    return 0


# --- the command line's values -------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """``30m``, ``12h``, ``1d``, ``7d``, ``1w`` or seconds (``3600``, ``90s``) → seconds.

    Raises:
        ConfigError: anything else.
    """
    found = _DURATION.match(text)
    if found is None:
        raise ConfigError(
            f"--duration {text!r} is not a duration - help: e.g. 30m, 12h, 1d, 7d, or seconds"
        )
    return float(found.group(1)) * _UNITS[found.group(2)]


def parse_peer_key(text: str) -> bytes:
    """A peer's public key, from base58.

    Raises:
        ConfigError: not base58, or not 32 bytes.
    """
    try:
        key = b58decode(text.strip())
    except ValueError:
        key = b""
    if len(key) != PUBLIC_KEY_SIZE:
        raise ConfigError(
            f"--peer-key {text[:60]!r} is not a peer's public key - help: give its Ed25519 "
            f"public key ({PUBLIC_KEY_SIZE} bytes) in base58, as kit prints keys; to ban a "
            "person whatever their key, use --user"
        )
    return key


def human_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d" + (f" {hours} h" if hours else "")
    if hours:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    if minutes:
        return f"{minutes} min" + (f" {secs} s" if secs else "")
    return f"{secs} s"


# --- the bans, verified ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bans:
    """A run's ban list, verified with the authority key, and where it came from."""

    run_id: str | None  # None: unknown (no coordinator, no list kept)
    revocations: RevocationList | None  # None: none was ever kept
    now: float  # when it was read (Unix time): the bans active then are shown
    source: str  # e.g. "the coordinator at http://127.0.0.1:8765"

    def active(self) -> RevocationList | None:
        return None if self.revocations is None else self.revocations.pruned(self.now)

    def text(self) -> str:
        """What ``kit revoke`` prints: one line about the list, then one per active ban."""
        active = self.active()
        entries: list[tuple[str, float]] = []
        if active is not None:
            entries += [(f"user {name}", until) for name, until in active.usernames]
            entries += [
                (f"key  {b58encode(key)} (peer {PeerID.from_public_key(key).short()})", until)
                for key, until in active.peer_public_keys
            ]
        count = f"{len(entries)} active ban{'s' if len(entries) != 1 else ''}"
        run = f"run {self.run_id}: " if self.run_id else ""
        lines = [f"{run}{count if entries else 'nobody is banned'} ({self.source})"]
        width = max((len(what) for what, _ in entries), default=0)
        for what, until in entries:
            when = datetime.datetime.fromtimestamp(until, datetime.timezone.utc)
            left = human_duration(until - self.now)
            lines.append(f"  {what:<{width}}  until {when:%Y-%m-%d %H:%M:%S} UTC ({left} left)")
        return "\n".join(lines)


def revoke(
    state_dir: str | Path,
    usernames: Sequence[str] = (),
    peer_public_keys: Sequence[bytes] = (),
    duration: float = 86400.0,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> Bans:
    """Ban users and/or peer keys from the run of the coordinator running from ``state_dir``.

    Returns:
        The ban list after the ban, as the coordinator signed it (verified here).

    Raises:
        KitUsageError: an open run: no authority key, so nobody can be banned.
        IdentityError: the authority key cannot be read.
        CoordinatorUnreachable: no coordinator runs from ``state_dir``.
        ConfigError: a bad ban; or the coordinator there is another run's, or another key's.
        AccessRefused: the coordinator refused the request (its reason).
    """
    authority = read_authority(state_dir)
    running = _running_coordinator(state_dir)
    _check_same_authority(state_dir, running, authority)
    try:  # is it there, and of this run? (before anything is signed)
        _public_bans(running, authority.public_key, timeout)
    except CoordinatorUnreachable as error:
        raise CoordinatorUnreachable(
            f"no coordinator is running from {state_dir}: {error}"
        ) from None
    request = RevokeRequest.sign(
        authority,
        running.run_id,
        usernames=usernames,
        peer_public_keys=peer_public_keys,
        duration=duration,
        now=time.time(),
    )
    status, body = _get(running.url + REVOKE_PATH, {"Authorization": request.header()}, timeout)
    if status != 200:
        raise AccessRefused(f"the coordinator refused the ban: {_reason(status, body)}", status)
    bans = _verified(body, running, authority.public_key)
    held = (
        {} if bans.revocations is None else dict(bans.revocations.usernames),
        {} if bans.revocations is None else dict(bans.revocations.peer_public_keys),
    )
    missing = [name for name in usernames if held[0].get(name, 0.0) <= request.time]
    missing += [b58encode(key) for key in peer_public_keys if held[1].get(key, 0.0) <= request.time]
    if missing:
        raise CoordinatorUnreachable(
            f"the coordinator answered, but its ban list lacks {', '.join(missing)} - help: "
            "retry; see the coordinator's log"
        )
    return bans


def list_bans(state_dir: str | Path, *, timeout: float = DEFAULT_TIMEOUT) -> Bans:
    """The run's ban list: the running coordinator's, else the one kept in ``state_dir``.

    Raises:
        KitUsageError: an open run: no authority key, so no bans.
        IdentityError: the authority key cannot be read.
        ConfigError: the kept list is unreadable or not the authority's; another run's
            coordinator answers.
    """
    running = read_coordinator_file(state_dir)
    if running is not None and running.authority_public_key is None:
        raise _open_run(running)
    authority = read_authority(state_dir)
    if running is not None and process_alive(running.pid):
        _check_same_authority(state_dir, running, authority)
        try:
            return _public_bans(running, authority.public_key, timeout)
        except CoordinatorUnreachable as error:
            logger.info("%s", error)
    kept = read_revocations(state_dir, authority.public_key)
    path = revocations_path(Path(state_dir))
    run_id = kept.run_id if kept is not None else (running.run_id if running else None)
    source = f"no coordinator answers from {state_dir}; " + (
        f"the list kept in {path}" if kept else f"no list kept in {path}"
    )
    return Bans(run_id, kept, time.time(), source)


# --- talking to the coordinator ------------------------------------------------------------------


def _running_coordinator(state_dir: str | Path) -> CoordinatorFile:
    running = read_coordinator_file(state_dir)
    start = f"kit coordinator --config run.yaml --state-dir {state_dir}"
    if running is None:
        raise CoordinatorUnreachable(
            f"no coordinator is running from {state_dir} (no {coordinator_file_path(state_dir)})"
            f" - help: bans need the running coordinator: start it ({start}), or pass the "
            "--state-dir it runs from"
        )
    if not process_alive(running.pid):
        raise CoordinatorUnreachable(
            f"no coordinator is running from {state_dir}: its coordinator.json was left by "
            f"process {running.pid}, which has ended - help: start it ({start})"
        )
    if running.authority_public_key is None:
        raise _open_run(running)
    return running


def _open_run(running: CoordinatorFile) -> KitUsageError:
    return KitUsageError(
        f"run {running.run_id!r} is open (no access.authority_public_key in its run.yaml), so "
        "nobody can be banned - help: create an authority (kit coordinator --create-authority), "
        "put its key in run.yaml and restart the coordinator"
    )


def _check_same_authority(
    state_dir: str | Path, running: CoordinatorFile, authority: Identity
) -> None:
    if running.authority_public_key != b58encode(authority.public_key):
        raise ConfigError(
            f"the authority.key in {state_dir} is not the authority of run {running.run_id!r} "
            f"(its run.yaml names {running.authority_public_key}) - help: restore the right "
            "authority.key in that state dir"
        )


def _public_bans(running: CoordinatorFile, authority_public_key: bytes, timeout: float) -> Bans:
    status, body = _get(running.url + BANS_PATH, {}, timeout)
    if status != 200:
        raise CoordinatorUnreachable(
            f"{running.url} is not the coordinator of run {running.run_id!r} (GET {BANS_PATH}: "
            f"HTTP {status}) - help: its coordinator.json is stale; start the coordinator"
        )
    return _verified(body, running, authority_public_key)


def _verified(body: bytes, running: CoordinatorFile, authority_public_key: bytes) -> Bans:
    """The ban list of an answer, checked: this run's, signed by its authority."""
    try:
        answer = json.loads(body)
        run_id, authority, now = answer["run_id"], answer["authority"], float(answer["time"])
    except (ValueError, TypeError, KeyError):
        raise CoordinatorUnreachable(
            f"{running.url} answered something else than a ban list - help: is the coordinator "
            "running there? start it, or delete a stale coordinator.json"
        ) from None
    if run_id != running.run_id:
        raise ConfigError(
            f"the coordinator at {running.url} runs {run_id!r}, not {running.run_id!r} "
            "- help: coordinator.json is stale (another coordinator took its port): start the "
            f"coordinator of {running.run_id!r}, or pass the --state-dir of {run_id!r}"
        )
    if authority is not True:
        raise _open_run(running)
    try:
        data = base64.urlsafe_b64decode(str(answer["list"]))
        revocations = RevocationList.from_bytes(data)
        revocations.verify(authority_public_key)
    except (KeyError, ValueError, binascii.Error, MalformedToken, KitError) as error:
        raise AccessRefused(
            f"the ban list from {running.url} does not verify with the authority key ({error})"
            " - help: that is not this run's coordinator; check coordinator.json's url"
        ) from None
    if revocations.run_id != running.run_id:
        raise ConfigError(f"the ban list from {running.url} is run {revocations.run_id!r}'s")
    return Bans(run_id, revocations, now, f"from the coordinator at {running.url}")


def _reason(status: int, body: bytes) -> str:
    try:
        answer = json.loads(body)
        text = f"HTTP {status} {answer['error']}: {answer['message']}"
    except (ValueError, TypeError, KeyError):
        text = f"HTTP {status}: " + body[:200].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text)[:1000]


def _get(url: str, headers: Mapping[str, str], timeout: float) -> tuple[int, bytes]:
    """GET ``url`` on this machine: (status, body) for every answer (refusals have reasons);
    ``kit.http_client`` is the volunteers' GET, which keeps only 401/403's reasons."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if url.startswith("https:"):
        # The coordinator's certificate names its public host, not the address it listens on
        # here. Not checking it costs nothing: the request is signed and bound to run, time and
        # nonce, and the ban list that comes back is verified with the authority key.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with opener.open(request, timeout=timeout) as answer:
            return int(answer.status), answer.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as error:
        return error.code, error.read(MAX_ANSWER_BYTES)
    except (OSError, ValueError) as error:
        where = urllib.parse.urlsplit(url)
        raise CoordinatorUnreachable(
            f"nothing answers at {where.scheme}://{where.netloc} "
            f"({getattr(error, 'reason', error)}) - help: start the coordinator (kit coordinator "
            "--config run.yaml --state-dir ...); it replaces the coordinator.json a stopped one "
            "left"
        ) from None

"""``kit preflight URL``: play a remote volunteer from an empty folder, and say what would fail.

A run is only as good as what a volunteer on Colab can reach: the coordinator's ``/api/run``, a
compatible kit, the tokenizer, the data stream, a model that trains. :func:`run_preflight` walks
that path as ``kit.join`` does (through ``kit.remote_run``, in a fresh temporary folder, without
joining the swarm) and stops short of the network of peers:

1. **run**: fetch ``/api/run``; the config parses and hashes the same here.
   **peers**: the bootstrap peers it hands out answer a TCP (and TLS) dial from here; the
   coordinator checking itself dials each of its own addresses, the ones volunteers get.
2. **versions**: this kit is the organizer's version; installed packages meet kit's lower bounds.
3. **tokenizer**: the coordinator's copy (or the Hub repo) loads, has the recipe's special
   tokens and fits the model's vocabulary.
4. **data**: every source opens (served shards from the coordinator, Hub datasets) and one
   batch of micro-batch 1 is built. A private run serves its data to allowlisted users only:
   pass ``hf_token`` (``kit preflight URL --hf-token``) to log in as a volunteer does, or an
   ``authorization`` callable (the coordinator's own check); without either the check fails
   and says so.
5. **training step**: one forward and backward pass of the run's model on the CPU, finite loss.

Each check gives one line; a failed one says what to do (``help:``). The coordinator runs the
same function against itself when it starts and refuses to start when it fails, so a run whose
tokenizer or data no remote volunteer can reach never hands out a link.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import math
import os
import socket
import ssl
import tempfile
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kit
from kit.errors import KitError, PreflightFailed

PEER_DIAL_TIMEOUT = 5.0  # seconds per address; a firewall that drops packets takes this long
CHECKS = ("run", "peers", "versions", "tokenizer", "data", "training step")


@dataclasses.dataclass(frozen=True)
class Check:
    """The outcome of one check."""

    name: str  # one of CHECKS
    ok: bool
    detail: str  # what was found; for a failure, the problem and its help: line


@dataclasses.dataclass(frozen=True)
class PreflightReport:
    """Every check that ran, in order (the first failed check of a chain stops the chain)."""

    url: str
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def problems(self) -> tuple[str, ...]:
        return tuple(f"{check.name}: {check.detail}" for check in self.checks if not check.ok)

    def text(self) -> str:
        """One line per check, then the verdict."""
        lines = [f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        if self.ok:
            lines.append(f"preflight passed: a remote volunteer can train in {self.url}")
        else:
            lines.append(f"preflight failed: {len(self.problems)} problem(s) in {self.url}")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise :class:`PreflightFailed` listing every problem, if there is one."""
        if not self.ok:
            listed = "; ".join(self.problems)
            raise PreflightFailed(
                f"a remote volunteer could not train in this run: {listed}", self.problems
            )


def _dependency_problems() -> list[str]:
    """Installed packages below kit's lower bounds (empty when kit's metadata is not installed)."""
    from packaging.requirements import Requirement

    try:
        requirements = importlib.metadata.requires("kit-collab") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{requirement.name} {installed} (kit needs {requirement.specifier})")
    return problems


def _training_step(config: Any, batch: dict[str, Any]) -> float:
    import torch

    from kit.training.components import build_model

    torch.manual_seed(0)
    model = build_model(config)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    return float(loss.detach())


def run_preflight(
    address: str,
    *,
    work_dir: str | Path | None = None,
    ssl_context: ssl.SSLContext | None = None,
    authorization: Callable[[], str | None] | None = None,
    hf_token: str | None = None,
    allow_insecure_http: bool = False,
    own_addresses: Sequence[str] | None = None,
) -> PreflightReport:
    """Walk a remote volunteer's path into the run at ``address`` (see the module docstring).

    Args:
        address: the coordinator's link.
        work_dir: the volunteer's folder (default: a fresh temporary one, deleted afterwards).
        ssl_context: how to check the coordinator's certificate (None: the system CAs).
        authorization: gives the ``Authorization`` header of data requests (a private run).
        hf_token: a Hugging Face token of an allowlisted user: in a private run, log in with
            it (a throwaway peer key) and fetch the data with the access token it gets.
        allow_insecure_http: send ``hf_token`` to a plain-http coordinator on another machine.
        own_addresses: the coordinator's check of itself: these peer addresses must all answer
            (default: one of the run's bootstrap peers must).
    """
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="kit-preflight-") as folder:
            return run_preflight(
                address,
                work_dir=folder,
                ssl_context=ssl_context,
                authorization=authorization,
                hf_token=hf_token,
                allow_insecure_http=allow_insecure_http,
                own_addresses=own_addresses,
            )
    from kit.remote_run import fetch_run_info, load_run_tokenizer, open_served_data

    cache = Path(work_dir) / ".kit"
    checks: list[Check] = []

    def check(name: str, step: Callable[[], str]) -> bool:
        try:
            checks.append(Check(name, True, step()))
        except KitError as error:
            checks.append(Check(name, False, str(error)))
        except (OSError, ValueError, RuntimeError) as error:  # torch, datasets, the file system
            detail = f"{type(error).__name__}: {error} - help: tell the organizer, with this line"
            checks.append(Check(name, False, detail))
        return checks[-1].ok

    found: dict[str, Any] = {}

    def run() -> str:
        found["info"] = info = fetch_run_info(address, timeout=30.0, ssl_context=ssl_context)
        config = info.config
        return (
            f"{config.collaboration.run_id!r}, config hash {info.config_hash[:12]}, "
            f"{len(info.initial_peers)} bootstrap peer(s)"
        )

    def peers() -> str:
        listed = list(own_addresses if own_addresses is not None else found["info"].initial_peers)
        problems = [
            p for p in (dial_problem(a, ssl_context, PEER_DIAL_TIMEOUT) for a in listed) if p
        ]
        if not listed or (problems and (own_addresses is not None or len(problems) == len(listed))):
            raise PreflightFailed(
                f"{'; '.join(problems) or 'no bootstrap peer is handed out'} - help: volunteers "
                "dial these addresses: open the port in the firewall, or announce the address "
                "that reaches this machine (--announce / PUBLIC_ADDRESS)"
            )
        unreachable = f"; {len(problems)} unreachable: {'; '.join(problems)}" if problems else ""
        return (
            f"{len(listed) - len(problems)} of {len(listed)} peer address(es) answer{unreachable}"
        )

    def versions() -> str:
        theirs = found["info"].kit_version
        pinned = "; the served wheel matches its sha256" if found["info"].install_sha256 else ""
        problems = _dependency_problems()
        if theirs is not None and theirs != kit.__version__:
            problems.insert(0, f"kit {kit.__version__} here, the organizer runs kit {theirs}")
        if problems:
            raise PreflightFailed(
                "; ".join(problems) + " - help: install the organizer's kit from "
                f"{found['info'].install_url or 'the coordinator'} (the join notebook does)"
            )
        wheel = _wheel_problem(found["info"], ssl_context)
        if wheel:
            raise PreflightFailed(wheel)
        return f"kit {kit.__version__}; installed packages meet kit's requirements{pinned}"

    def tokenizer() -> str:
        from kit.data.examples import VocabularyTables

        found["tokenizer"] = loaded = load_run_tokenizer(found["info"], cache, ssl_context)
        size = VocabularyTables.from_tokenizer(loaded).vocab_size
        model_size = found["info"].config.model.vocab_size
        if size > model_size:
            raise PreflightFailed(
                f"the tokenizer has {size} pieces, the model embeds {model_size} - help: set "
                "model.vocab_size (and tokenizer.vocab_size) to the tokenizer's size"
            )
        where = "the coordinator" if found["info"].tokenizer_url else "the Hub"
        return f"{size} pieces from {where}"

    def data() -> str:
        from kit.data.pipeline import PretrainingPipeline

        info = found["info"]
        bearer = authorization
        if bearer is None and hf_token and info.authority_public_key is not None:
            bearer = _login(info, hf_token, ssl_context, allow_insecure_http)
        pipeline = PretrainingPipeline.from_config(
            info.config.data,
            found["tokenizer"],
            peer_identity=b"kit-preflight",
            served=open_served_data(info, cache, ssl_context, authorization=bearer),
        )
        batches = pipeline.batches(1)
        found["batch"] = batch = next(batches, None)
        batches.close()  # closes the open shard reader now, not at interpreter exit
        if batch is None:
            raise PreflightFailed("the data ended before one example - help: check data.sources")
        names = ", ".join(
            f"{source.name} ({'served' if source.served else source.path})"
            for source in info.config.data.sources
        )
        return f"one batch of {tuple(batch['input_ids'].shape)} tokens from {names}"

    def training_step() -> str:
        loss = _training_step(found["info"].config, found["batch"])
        if not math.isfinite(loss):
            raise PreflightFailed(
                f"the loss of one step is {loss} - help: check the model settings of run.yaml"
            )
        return f"forward and backward on the CPU at micro-batch 1, loss {loss:.3f}"

    if check("run", run):
        check("peers", peers)
        check("versions", versions)
        if check("tokenizer", tokenizer) and check("data", data):
            check("training step", training_step)
    return PreflightReport(str(found["info"].url if "info" in found else address), tuple(checks))


def _wheel_problem(info: Any, ssl_context: ssl.SSLContext | None) -> str | None:
    """Whether the served wheel is the one whose digest ``/api/run`` gives (None: it is, or
    none is served): the join cell pins that digest, and pip refuses any other bytes."""
    from kit.http_client import http_get

    if info.install_url is None or info.install_sha256 is None:
        return None
    served = hashlib.sha256(http_get(info.install_url, timeout=60.0, ssl_context=ssl_context))
    if served.hexdigest() == info.install_sha256:
        return None
    return (
        f"the wheel at {info.install_url} has sha256 {served.hexdigest()[:16]}..., /api/run "
        f"says {info.install_sha256[:16]}...: the join cell's pip would refuse it - help: "
        "restart the coordinator (it builds and hashes the wheel again); if it persists, "
        "something between the coordinator and volunteers changes the file"
    )


def _login(
    info: Any, hf_token: str, ssl_context: ssl.SSLContext | None, allow_insecure_http: bool
) -> Callable[[], str | None]:
    """Log in as a volunteer would (a throwaway key); the access token as a bearer callable.

    Raises:
        InvalidHubToken, NotAllowlisted, Revoked, TokenServiceUnavailable: no token.
    """
    from kit.auth import authorizer_from_coordinator
    from kit.p2p.identity import Identity
    from kit.runtime import get_runtime

    authorizer = get_runtime().call(
        authorizer_from_coordinator(
            info.url,
            hf_token.strip(),
            Identity.generate(),
            authority_public_key=info.authority_public_key,
            ssl_context=ssl_context,
            allow_insecure_http=allow_insecure_http,
        ),
        timeout=60.0,
    )
    get_runtime().call(authorizer.close(), timeout=10.0)  # no renewals: the check is short
    return authorizer.bearer


def check_own_link(
    url: str,
    addresses: Sequence[str],
    *,
    authorization: Callable[[], str | None] | None = None,
) -> PreflightReport:
    """:func:`run_preflight` of a coordinator against itself, at the join link ``url`` and the
    peer ``addresses`` it hands out (each must answer from here). Not a loopback rewrite: an
    address that does not reach this machine fails. The certificate is checked as a
    volunteer's kit checks it (the system CAs, the name in the link), except on loopback (a
    local run: no certificate names 127.0.0.1). ``authorization``: the coordinator's own peer
    token, for the data of a private run.
    """
    from kit.p2p.interfaces import is_loopback_only

    context = None
    if is_loopback_only(urllib.parse.urlsplit(url).hostname or ""):
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return run_preflight(
        url, ssl_context=context, authorization=authorization, own_addresses=addresses
    )


def dial_problem(address: str, ssl_context: ssl.SSLContext | None, timeout: float) -> str | None:
    """Why a volunteer could not open a connection to the peer at ``address`` (None: it can):
    TCP, and TLS with the certificate checked for wss:// (a relayed address: its relay's)."""
    from kit.address import AddressError, parse_address

    try:
        parsed = parse_address(address)
    except AddressError as e:
        return str(e)
    while parsed.relay is not None:
        parsed = parsed.relay
    try:
        with socket.create_connection((parsed.host, parsed.port), timeout=timeout) as sock:
            if parsed.secure:
                context = ssl_context or ssl.create_default_context()
                sock.settimeout(timeout)
                with context.wrap_socket(sock, server_hostname=parsed.host):
                    pass
    except ssl.SSLError as e:
        return f"{parsed.host}:{parsed.port}: TLS failed ({e.reason or e})"
    except OSError as e:
        return f"{parsed.host}:{parsed.port}: {e.strerror or e}"
    return None


def add_command(subparsers: Any) -> None:
    """``kit preflight URL``: check that a remote volunteer could train in a run."""
    parser = subparsers.add_parser(
        "preflight", help="check, from an empty folder, that a volunteer could train in a run"
    )
    parser.add_argument("address", help="the coordinator's link")
    parser.add_argument(
        "--work-dir", default=None, help="the volunteer folder to use (default: a fresh temp one)"
    )
    parser.add_argument(
        "--ca-file", default=None, help="trust this CA for the coordinator's https certificate"
    )
    parser.add_argument(
        "--hf-token",
        default=None,
        help="a private run's data is for allowlisted users: log in with this Hugging Face "
        "token (default: $HF_TOKEN)",
    )
    parser.add_argument(
        "--allow-insecure-http",
        action="store_true",
        help="send the HF token to a plain-http coordinator on another machine",
    )
    parser.set_defaults(handler=_preflight_command)


def _preflight_command(args: argparse.Namespace) -> int:
    context = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else None
    report = run_preflight(
        args.address,
        work_dir=args.work_dir,
        ssl_context=context,
        hf_token=args.hf_token or os.environ.get("HF_TOKEN") or None,
        allow_insecure_http=args.allow_insecure_http,
    )
    print(report.text(), flush=True)
    return 0 if report.ok else 1

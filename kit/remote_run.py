"""A run as a remote volunteer sees it: the coordinator's link, ``/api/run``, the tokenizer, the data.

A volunteer starts from one link and an empty folder. This module turns the link into a
:class:`RunInfo` (``GET /api/run``: the config and its hash, bootstrap peers, the authority key,
where the tokenizer, the served data and the organizer's kit wheel are), loads the run's
tokenizer (the coordinator's copy, checked against its published SHA-256, else the Hub repo the
config names) and opens the served data (:class:`~kit.data.remote.ServedData`). ``kit.join`` and
``kit preflight`` (and the coordinator's own start-up check) go through exactly these functions,
so the check sees what volunteers will see. It doesn't start peers or train (``kit.volunteer``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import ssl
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit.config import RunConfig
from kit.errors import ConfigError, CoordinatorUnreachable, DataSourceNotFound
from kit.http_client import http_get

#: Where volunteers fetch the run (config, bootstrap addresses, authority key).
RUN_INFO_PATH = "/api/run"
#: Where volunteers fetch the tokenizer the coordinator serves.
TOKENIZER_PATH = "/api/tokenizer.json"


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What the coordinator tells a joining volunteer (``GET /api/run``)."""

    url: str  # http(s)://host:port of the coordinator
    config: RunConfig
    config_hash: str
    initial_peers: tuple[str, ...]  # the coordinator's addresses, then the run's bootstrap peers
    authority_public_key: bytes | None
    tokenizer_url: str | None  # absolute URL of tokenizer.json, when the coordinator serves it
    tokenizer_sha256: str | None = None  # its published digest (a download is checked against it)
    data_manifest_url: str | None = None  # absolute URL of the served data's manifest, if any
    install_url: str | None = None  # the wheel of the organizer's kit
    install_sha256: str | None = None  # its digest: the join cell pins it (pip checks it)
    kit_version: str | None = None  # the organizer's kit version
    relays: tuple[str, ...] = ()  # whom a NAT'd peer registers with: member relays first


def coordinator_url(address: str) -> str:
    """``http(s)://host:port`` from a URL or a kit address (``/ip4/.../tcp/N/ws[s]/p2p/ID``)."""
    text = address.strip().rstrip("/")
    if text.startswith(("http://", "https://")):
        return text
    if text.startswith(("ws://", "wss://")):
        return "http" + text[2:]
    from kit.address import AddressError, parse_address

    try:
        parsed = parse_address(text)
    except (AddressError, ValueError) as error:
        raise ConfigError(
            f"{address!r} is not a coordinator address ({error}) - help: paste the link the "
            "organizer gave you, e.g. https://run.example.org"
        ) from None
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    return f"{'https' if parsed.secure else 'http'}://{host}:{parsed.port}"


def _absolute(base: str, reference: Any) -> str | None:
    if not reference:
        return None
    if not isinstance(reference, str):
        raise TypeError(f"expected a URL, got {type(reference).__name__}")
    return urllib.parse.urljoin(base + "/", reference)


def fetch_run_info(
    address: str, *, timeout: float = 15.0, ssl_context: ssl.SSLContext | None = None
) -> RunInfo:
    """Ask the coordinator for the run; validate the config and its hash.

    Raises:
        CoordinatorUnreachable: no answer, or not a kit run.
        ConfigError: the address is not a link, or this kit computes another config hash.
    """
    url = coordinator_url(address)
    body = http_get(url + RUN_INFO_PATH, timeout=timeout, ssl_context=ssl_context)
    try:
        answer = json.loads(body)
        config = RunConfig.from_dict(answer["config"])
        peers = tuple(str(peer) for peer in answer["initial_peers"])
        key = answer.get("authority_public_key")
        tokenizer_url = _absolute(url, answer.get("tokenizer_url"))
        digest = answer.get("tokenizer_sha256")
        manifest_url = _absolute(url, answer.get("data_manifest"))
        install_url = _absolute(url, answer.get("install"))
        wheel_digest = answer.get("install_sha256")
        version = answer.get("kit_version")
        relays = tuple(str(relay) for relay in answer.get("relays") or ())
    except (ValueError, KeyError, TypeError) as error:
        raise CoordinatorUnreachable(
            f"{url} did not answer with a kit run ({type(error).__name__}: {error}) - help: "
            "check that the address is a kit coordinator and that your kit is up to date"
        ) from None
    if config.config_hash() != answer.get("config_hash"):
        raise ConfigError(
            "the coordinator's config hash differs from the one this kit computes - help: "
            "install the organizer's kit (the join notebook does: INSTALL = True)"
        )
    from kit.address import b58decode

    return RunInfo(
        url=url,
        config=config,
        config_hash=str(answer["config_hash"]),
        initial_peers=peers,
        authority_public_key=b58decode(key) if key else None,
        tokenizer_url=tokenizer_url,
        tokenizer_sha256=str(digest) if digest else None,
        data_manifest_url=manifest_url,
        install_url=install_url,
        install_sha256=str(wheel_digest) if wheel_digest else None,
        kit_version=str(version) if version else None,
        relays=relays,
    )


def load_run_tokenizer(
    info: RunInfo, cache_dir: Path, ssl_context: ssl.SSLContext | None = None
) -> Any:
    """The run's tokenizer: the coordinator's copy (digest checked), else the config's Hub repo.

    Raises:
        DataSourceNotFound: neither is available, or the copy does not match its digest.
        CoordinatorUnreachable: the coordinator did not answer.
    """
    from kit.data.tokenizer import load_tokenizer

    if info.tokenizer_url is None:
        if info.config.tokenizer.hub_repo:
            return load_tokenizer(info.config.tokenizer.hub_repo)
        raise DataSourceNotFound(
            "the coordinator serves no tokenizer and the run names no tokenizer.hub_repo - help: "
            "ask the organizer to start the coordinator with its tokenizer (kit coordinator "
            "--tokenizer-dir, or the config notebook's TOKENIZER cell)"
        )
    label = info.tokenizer_sha256 or info.config_hash
    target = cache_dir / f"tokenizer-{label[:16]}.json"
    if not target.is_file():
        body = http_get(info.tokenizer_url, ssl_context=ssl_context)
        if info.tokenizer_sha256 and hashlib.sha256(body).hexdigest() != info.tokenizer_sha256:
            raise DataSourceNotFound(
                f"the tokenizer from {info.tokenizer_url} does not match the digest the run "
                "publishes - help: retry; if it persists, tell the organizer"
            )
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        partial.write_bytes(body)
        os.replace(partial, target)
    return load_tokenizer(target)


def open_served_data(
    info: RunInfo,
    cache_dir: Path,
    ssl_context: ssl.SSLContext | None = None,
    authorization: Callable[[], str | None] | None = None,
) -> Any:
    """The data the coordinator serves (a :class:`~kit.data.remote.ServedData`), or None.

    In a private run (``info.authority_public_key``) the data is for allowlisted users only:
    ``authorization`` gives the current ``Authorization: Bearer`` value of each request.

    Raises:
        AccessRefused: a private run and no valid access token (the reason says what to do).
        DataSourceNotFound: the run has organizer files the coordinator does not serve.
        CoordinatorUnreachable: the manifest could not be fetched.
    """
    from kit.data.remote import ServedData

    served = [source.name for source in info.config.data.sources if source.served]
    if info.data_manifest_url is None:
        if served:
            raise DataSourceNotFound(
                f"sources {', '.join(map(repr, served))} are files on the organizer's disk, and "
                "the coordinator does not serve them - help: ask the organizer to update kit"
            )
        return None
    return ServedData.fetch(
        info.data_manifest_url,
        cache_dir / "data" / info.config_hash[:16],
        ssl_context=ssl_context,
        authorization=authorization,
    )

"""The ``access:`` and ``checkpoint:`` sections: who may join, and where the model is saved.

Holds ``AccessConfig`` (the allowlist of Hugging Face users and organizations, the authority key
and the coordinator's address, token lifetime) and ``CheckpointConfig`` (local folder, Hub repo,
how often to save and push). The organizer may change both during a run, so neither goes into
``RunConfig.config_hash()``. It doesn't issue or check tokens (``kit.auth``) nor write
checkpoints (the trainer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from kit.address import AddressError, b58decode, parse_address
from kit.config.fields import (
    _as_tuple,
    _check_keys,
    _to_plain,
    check_bool,
    check_hub_name,
    check_int,
    check_number,
    check_text,
    config_error,
    store_normalized,
)

#: An Ed25519 public key is 32 bytes (RFC 8032 §5.1.5).
AUTHORITY_KEY_BYTES = 32


@dataclasses.dataclass(frozen=True)
class AccessConfig:
    """Who may join the run (the ``access:`` section of run.yaml).

    With no ``authority_public_key`` the run is unauthenticated: anyone who knows the run id and
    an address may join (fine on a private network, or for a demo). With one, every peer must
    present an access token signed by that key, which the coordinator issues to allowlisted
    Hugging Face users (DeDLOC §4.2 used the same allowlist scheme through a HF auth server).
    """

    # fmt: off
    usernames: tuple[str, ...] = ()  # Hub users who may join, as in their profile URL
    organizations: tuple[str, ...] = ()  # members of these Hub organizations may join (any role)
    open: bool = False  # true: any Hub user may join (still named in tokens, so revocable)
    authority_public_key: str | None = None  # base58 Ed25519 key that signs tokens; null = no auth
    coordinator: str | None = None  # the coordinator's kit address, shown on /api/run (informational: volunteers use the join link)
    bootstrap_peers: tuple[str, ...] = ()  # more public peers (`kit dht`) volunteers join and relay through
    token_lifetime: float = 1_800.0  # seconds a token is valid; lower = removals apply sooner, more renewals
    check_seconds: float = 30.0  # every peer re-reads the ban list and checks tokens this often; lower = bans apply sooner
    # fmt: on

    SECTION: ClassVar[str] = "access"

    def __post_init__(self) -> None:
        where = self.SECTION
        for field in ("usernames", "organizations"):
            names = getattr(self, field)
            if not isinstance(names, tuple):
                raise config_error(
                    f"{where}.{field}", f"must be a list, got {names!r}", "write [alice, bob]"
                )
            for index, name in enumerate(names):
                check_hub_name(f"{where}.{field}[{index}]", name)
        check_bool(f"{where}.open", self.open)
        if self.authority_public_key is not None:
            _check_authority_key(f"{where}.authority_public_key", self.authority_public_key)
        if self.coordinator is not None:
            _check_address(f"{where}.coordinator", self.coordinator)
        if not isinstance(self.bootstrap_peers, tuple):
            raise config_error(
                f"{where}.bootstrap_peers",
                f"must be a list, got {self.bootstrap_peers!r}",
                "write [/dns/dht.example.org/tcp/31337/ws/p2p/...]",
            )
        for index, address in enumerate(self.bootstrap_peers):
            _check_address(f"{where}.bootstrap_peers[{index}]", address)
        lifetime = check_number(
            f"{where}.token_lifetime",
            self.token_lifetime,
            minimum=60,
            hint="use at least 60 seconds (kit's default: 1800)",
        )
        store_normalized(self, "token_lifetime", lifetime)
        check = check_number(
            f"{where}.check_seconds",
            self.check_seconds,
            minimum=0.5,
            hint="use 0.5 s or more (kit's default: 30); each check reads the DHT once",
        )
        store_normalized(self, "check_seconds", check)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "access") -> AccessConfig:
        """Build from the ``access:`` mapping of a run configuration (raises ConfigError)."""
        values = _check_keys(cls, data, where)
        for field in ("usernames", "organizations", "bootstrap_peers"):
            if field in values:
                values[field] = _as_tuple(f"{where}.{field}", values[field])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists of names) that ``from_dict`` reads back."""
        return _to_plain(self)


def _check_authority_key(where: str, text: object) -> None:
    check_text(where, text, hint="paste the key the coordinator prints, or null")
    assert isinstance(text, str)
    try:
        raw = b58decode(text)
    except ValueError as error:
        raise config_error(
            where, f"is not base58 ({error})", "paste the key the coordinator prints"
        ) from None
    if len(raw) != AUTHORITY_KEY_BYTES:
        raise config_error(
            where,
            f"decodes to {len(raw)} bytes, not an Ed25519 public key ({AUTHORITY_KEY_BYTES})",
            "paste the whole key the coordinator prints",
        )


def _check_address(where: str, text: object) -> None:
    check_text(where, text, hint="write the address the coordinator prints, or null")
    try:
        parse_address(str(text))
    except (AddressError, ValueError) as error:
        message = str(error)
        hint = message.split("help: ", 1)[1] if "help: " in message else "check the address"
        raise config_error(where, f"is not a kit address: {text!r}", hint) from None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the model is saved (the ``checkpoint:`` section of run.yaml).

    sahajBERT's coordinator pushed to the Hub about every 50 global steps and kept 2 local
    checkpoints (DeDLOC ``run_first_peer.py``, ``save_total_limit 2``).
    """

    # fmt: off
    folder: str = "checkpoints"  # local folder of saved checkpoints (one sub-folder per global step)
    hub_repo: str | None = None  # push to this Hub model repo, "owner/name"; null = local only
    every_epochs: int = 50  # save every N global steps; lower it if restarts lose too much work
    push_every_minutes: float = 10.0  # push the newest save at most this often; raise it if the Hub rate-limits you
    keep_last: int = 2  # local checkpoints kept (older ones deleted); raise it to roll back further
    # fmt: on

    SECTION: ClassVar[str] = "checkpoint"

    def __post_init__(self) -> None:
        where = self.SECTION
        check_text(f"{where}.folder", self.folder, hint="name a folder")
        if self.hub_repo is not None:
            check_hub_name(f"{where}.hub_repo", self.hub_repo, repo=True)
        check_int(f"{where}.every_epochs", self.every_epochs, minimum=1)
        minutes = check_number(f"{where}.push_every_minutes", self.push_every_minutes, minimum=0)
        store_normalized(self, "push_every_minutes", minutes)
        check_int(f"{where}.keep_last", self.keep_last, minimum=1, hint="keep at least 1")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "checkpoint") -> CheckpointConfig:
        """Build from the ``checkpoint:`` mapping of a run configuration (raises ConfigError)."""
        return cls(**_check_keys(cls, data, where))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that ``from_dict`` reads back."""
        return _to_plain(self)

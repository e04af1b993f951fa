"""The coordinator's side of admission: who a volunteer is (the Hub), who may join (the
allowlist), and the authority that signs their access tokens and the revocation list.

Identity comes from Hugging Face: a volunteer proves they are Hub user ``alice`` by handing a
user access token to the coordinator, which asks the Hub's ``whoami`` endpoint (the design of
the TTT auth server, hivemind-api §2.6 / recipes §4.7; sahajBERT's password login is gone from
the Hub). The coordinator then checks the :class:`Allowlist` (user names and/or Hub
organizations) and its :class:`TokenIssuer` signs a short-lived
:class:`~kit.auth.tokens.AccessToken` for the volunteer's peer key.

What this module does not do: HTTP (``kit.auth.endpoint`` serves the token endpoint), the
handshake hook (``kit.auth.authorizer``). :class:`TokenIssuer` reads no clock: it takes ``now``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kit.auth.revocation import RevocationList
from kit.auth.tokens import MAX_RUN_ID, NAME_PATTERN, AccessToken
from kit.errors import (
    ConfigError,
    InvalidHubToken,
    NotAllowlisted,
    Revoked,
    TokenServiceUnavailable,
)
from kit.p2p.identity import Identity

logger = logging.getLogger(__name__)

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
#: The user name of the coordinator's own token. "@" cannot start a Hub name, so no volunteer
#: can ever be mistaken for the coordinator (nor revoke it by name).
COORDINATOR_USERNAME = "@coordinator"
TOKEN_HELP = (
    "create a user access token with the read role at https://huggingface.co/settings/tokens "
    "and pass it as hf_token (an organization token is not accepted)"
)


def hub_endpoint(endpoint: str | None = None) -> str:
    """The Hub to ask: ``endpoint`` if given, else ``$HF_ENDPOINT`` (read now, not at import
    time, so a notebook may set it late), else https://huggingface.co."""
    chosen = endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT
    return chosen.rstrip("/")


@dataclass(frozen=True)
class HubUser:
    """Who the Hub says an access token belongs to."""

    username: str  # the Hub user name, e.g. "alice"
    organizations: tuple[str, ...] = ()  # the Hub organizations the user is a member of


def hub_user(hf_token: str, *, endpoint: str | None = None) -> HubUser:
    """Ask the Hub who owns ``hf_token`` (blocking: call it in a thread from async code).

    The token goes to the Hub's ``/api/whoami-v2`` and nowhere else; it is never logged.

    Args:
        hf_token: a Hugging Face user access token ("hf_...").
        endpoint: the Hub URL; None = ``$HF_ENDPOINT`` or https://huggingface.co.

    Raises:
        InvalidHubToken: the Hub refused the token, or it is an organization's token.
        TokenServiceUnavailable: the Hub could not be reached, failed, or rate-limited us.
    """
    from huggingface_hub import HfApi  # imported late: importing kit.auth stays cheap
    from huggingface_hub.errors import HfHubHTTPError

    url = hub_endpoint(endpoint)
    if not hf_token:
        raise InvalidHubToken(f"no Hugging Face access token was given - help: {TOKEN_HELP}")
    try:
        info = HfApi(endpoint=url).whoami(token=hf_token)
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            raise InvalidHubToken(
                f"the Hugging Face Hub at {url} refused this access token (unknown, deleted or "
                f"expired) - help: {TOKEN_HELP}"
            ) from None
        raise TokenServiceUnavailable(
            f"the Hugging Face Hub at {url} answered HTTP {status} to whoami - help: retry in a "
            "minute (429 means too many logins at once); check https://status.huggingface.co"
        ) from None
    except Exception as e:  # connection errors of the HTTP client (several unrelated types)
        raise TokenServiceUnavailable(
            f"cannot reach the Hugging Face Hub at {url}: {type(e).__name__} - help: check the "
            "coordinator's Internet connection, its proxy settings and HF_ENDPOINT"
        ) from None
    return _parse_whoami(info, url)


def _parse_whoami(info: Any, url: str) -> HubUser:
    if not isinstance(info, dict) or not isinstance(info.get("name"), str):
        raise TokenServiceUnavailable(f"the Hub at {url} sent a whoami answer without a name")
    if info.get("type") != "user":
        raise InvalidHubToken(
            f"this access token belongs to a Hub {info.get('type')!r}, not to a user - help: "
            f"{TOKEN_HELP}"
        )
    name = info["name"]
    if name.startswith("@") or not NAME_PATTERN.match(name):
        raise TokenServiceUnavailable(f"the Hub at {url} sent an invalid user name {name[:100]!r}")
    orgs = info.get("orgs")
    if not isinstance(orgs, list):
        orgs = []
    names = tuple(
        org["name"] for org in orgs if isinstance(org, dict) and isinstance(org.get("name"), str)
    )
    return HubUser(name, names)


def _names(value: Iterable[str] | str, what: str) -> frozenset[str]:
    if isinstance(value, str):
        raise ConfigError(f"Allowlist.{what} must be a list of names, got the string {value!r}")
    names = frozenset(value)
    for name in names:
        if not isinstance(name, str) or name.startswith("@") or not NAME_PATTERN.match(name):
            raise ConfigError(
                f"Allowlist.{what}: {name!r} is not a Hugging Face name - help: use the name "
                "as in the profile URL, e.g. 'alice' for https://huggingface.co/alice"
            )
    return names


@dataclass(frozen=True)
class Allowlist:
    """Who may join a run, by Hugging Face identity. Empty admits nobody unless ``open``.

    Example::

        Allowlist(usernames={"alice", "bob"}, organizations={"neuropark"})
    """

    usernames: frozenset[str] = field(default_factory=frozenset)  # Hub users who may join
    organizations: frozenset[str] = field(
        default_factory=frozenset
    )  # members of these Hub orgs may join (any role)
    open: bool = False  # True: any Hub user may join (still named in tokens, so revocable)

    def __post_init__(self) -> None:
        # Accept any iterable of names (lists from a YAML file), store them frozen.
        object.__setattr__(self, "usernames", _names(self.usernames, "usernames"))
        object.__setattr__(self, "organizations", _names(self.organizations, "organizations"))
        if not isinstance(self.open, bool):
            raise ConfigError(f"Allowlist.open must be True or False, got {self.open!r}")

    def admits(self, user: HubUser) -> bool:
        return (
            self.open
            or user.username in self.usernames
            or not self.organizations.isdisjoint(user.organizations)
        )

    def check(self, user: HubUser) -> None:
        """Return if ``user`` may join.

        Raises:
            NotAllowlisted: with the user's exact Hub name, for the organizer to add.
        """
        if self.admits(user):
            return
        orgs = ", ".join(sorted(self.organizations))
        join_org = f", or join the Hub organization {orgs} and retry" if orgs else ""
        raise NotAllowlisted(
            f"Hugging Face user {user.username!r} is not on the allowlist of this run - help: "
            f"ask the organizer to add you (your Hub user name is {user.username!r}){join_org}"
        )


class TokenIssuer:
    """The run's authority: signs access tokens and the revocation list (pure: takes ``now``).

    The authority key should outlive coordinator restarts (volunteers configure its public key),
    so load it from a file: ``identity, lock = kit.p2p.identity.load_identity(path)``.

    Args:
        authority: the authority's Ed25519 key; never leaves the coordinator.
        run_id: the run the tokens admit to.
        lifetime: seconds a token stays valid. Shorter means a user removed from the allowlist is
            out sooner (without a revocation) but more token requests; increase this if the
            coordinator sees too many token requests.
    """

    def __init__(self, authority: Identity, run_id: str, *, lifetime: float = 30 * 60.0) -> None:
        if not 0 < len(run_id) <= MAX_RUN_ID:
            raise ConfigError(f"TokenIssuer: run_id must have 1..{MAX_RUN_ID} characters")
        if not (math.isfinite(lifetime) and lifetime > 0):
            raise ConfigError(
                f"TokenIssuer: lifetime={lifetime!r} must be > 0 seconds - help: keep the "
                "default (1800 s)"
            )
        self.authority = authority
        self.run_id = run_id
        self.lifetime = lifetime
        self.revocations: RevocationList = RevocationList(run_id, 0.0).sign(authority, 0.0)

    @property
    def authority_public_key(self) -> bytes:
        """What peers verify tokens with (publish it with the run's config)."""
        return self.authority.public_key

    def issue(self, username: str, peer_public_key: bytes, *, now: float) -> AccessToken:
        """A token for ``username``'s peer key, valid for ``lifetime`` seconds from ``now``.

        Raises:
            Revoked: the user or the key is on the revocation list.
            MalformedToken: a bad user name or key size.
        """
        reason = self.revocations.reason(username, peer_public_key, now)
        if reason is not None:
            raise Revoked(f"{reason} - help: ask the organizer why")
        return AccessToken.sign(
            self.authority, username, peer_public_key, self.run_id, now + self.lifetime
        )

    def revoke(
        self,
        *,
        usernames: Iterable[str] = (),
        peer_public_keys: Iterable[bytes] = (),
        duration: float = 24 * 3600.0,
        now: float,
    ) -> RevocationList:
        """Ban users and/or peer keys for ``duration`` seconds; returns the new signed list.

        Give the list to every authorizer: ``authorizer.update_revocations(list)`` in process,
        ``publish_revocations(node, authority, list, ...)`` through the DHT.

        Raises:
            ConfigError: a bad name or key, or too many bans for one record.
        """
        if not duration > 0:
            raise ConfigError(f"revoke: duration={duration!r} must be > 0 seconds")
        updated = self.revocations.pruned(now).revoke(
            usernames=usernames, peer_public_keys=peer_public_keys, until=now + duration
        )
        return self._replace(updated, now)

    def reinstate(
        self, *, usernames: Iterable[str] = (), peer_public_keys: Iterable[bytes] = (), now: float
    ) -> RevocationList:
        """Lift bans early; returns the new signed list (distribute it like :meth:`revoke`'s)."""
        names, keys = set(usernames), set(peer_public_keys)
        current = self.revocations.pruned(now)
        updated = RevocationList(
            self.run_id,
            current.issued_at,
            tuple(entry for entry in current.usernames if entry[0] not in names),
            tuple(entry for entry in current.peer_public_keys if entry[0] not in keys),
        )
        return self._replace(updated, now)

    def _replace(self, updated: RevocationList, now: float) -> RevocationList:
        # Strictly later than the previous list even if the clock stepped back, or peers would
        # keep the previous list (they accept only newer ones, against replays).
        issued_at = max(now, self.revocations.issued_at + 0.001)
        self.revocations = updated.sign(self.authority, issued_at)
        logger.info(
            "revocation list of %r now bans %d users and %d peer keys",
            self.run_id,
            len(self.revocations.usernames),
            len(self.revocations.peer_public_keys),
        )
        return self.revocations

"""An allowlisted run on loopback for the auth tests: a fake Hub, a coordinator peer serving the
token endpoint, and volunteers that join with their Hugging Face tokens.

Hub users: ``alice`` (allowlisted by name), ``bob`` (member of the allowlisted org
``neuropark``), ``mallory`` (in the org ``elsewhere`` only: not allowlisted).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from kit.auth import (
    Allowlist,
    AllowlistAuthorizer,
    TokenEndpoint,
    TokenIssuer,
    authorizer_from_coordinator,
    serve_token_endpoint,
)
from kit.p2p.identity import Identity
from kit.p2p.peer import Peer, create_peer
from kit.testing.fake_hub import FakeHub

RUN_ID = "auth-test"
TOKENS = {"alice": "hf_alice_token", "bob": "hf_bob_token", "mallory": "hf_mallory_token"}
ALLOWLIST = Allowlist(usernames=frozenset({"alice"}), organizations=frozenset({"neuropark"}))


@dataclass
class AllowlistedRun:
    hub: FakeHub
    issuer: TokenIssuer
    coordinator: Peer
    endpoint: TokenEndpoint
    peers: list[Peer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.coordinator.listen_port}"

    @property
    def coordinator_authorizer(self) -> AllowlistAuthorizer:
        return self.coordinator.authorizer  # type: ignore[return-value]

    async def authorizer(
        self, hf_token: str, identity: Identity, **settings: Any
    ) -> AllowlistAuthorizer:
        return await authorizer_from_coordinator(
            self.url,
            hf_token,
            identity,
            authority_public_key=self.issuer.authority_public_key,
            **settings,
        )

    async def join(self, user: str, *, connect: bool = True, **settings: Any) -> Peer:
        """A volunteer peer of ``user`` (connected to the coordinator if ``connect``)."""
        identity = Identity.generate()
        authorizer = await self.authorizer(TOKENS[user], identity, **settings)
        return await self.start_peer(identity, authorizer, connect=connect)

    async def start_peer(
        self, identity: Identity, authorizer: Any, *, connect: bool = False
    ) -> Peer:
        peer = await create_peer(
            self.coordinator.get_visible_addresses() if connect else (),
            identity=identity,
            authorizer=authorizer,
            run_id=RUN_ID,
        )
        self.peers.append(peer)
        return peer


@asynccontextmanager
async def allowlisted_run(
    *, lifetime: float = 1800.0, allowlist: Allowlist = ALLOWLIST, **authorizer_settings: Any
) -> AsyncIterator[AllowlistedRun]:
    with FakeHub() as hub:
        hub.add_user("alice", token=TOKENS["alice"], token_role="read")
        hub.add_user("bob", token=TOKENS["bob"], orgs=["neuropark"], token_role="read")
        hub.add_user("mallory", token=TOKENS["mallory"], orgs=["elsewhere"])
        issuer = TokenIssuer(Identity.generate(), RUN_ID, lifetime=lifetime)
        identity = Identity.generate()
        authorizer = AllowlistAuthorizer.for_coordinator(identity, issuer, **authorizer_settings)
        coordinator = await create_peer(identity=identity, authorizer=authorizer, run_id=RUN_ID)
        endpoint = serve_token_endpoint(coordinator, issuer, allowlist, hf_endpoint=hub.endpoint)
        run = AllowlistedRun(hub, issuer, coordinator, endpoint)
        try:
            yield run
        finally:
            for peer in [*run.peers, coordinator]:
                await peer.shutdown()
                close = getattr(peer.authorizer, "close", None)
                if close is not None:
                    await close()

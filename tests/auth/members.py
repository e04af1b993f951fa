"""Users' peers on the runtime loop, each logged in through the coordinator's join endpoint
(``authorizer_from_coordinator``: the Hugging Face token ``hf_<user>``, a fresh identity or a
given one), as a member's ``kit.join`` would; the revocation tests ban and watch them."""

from __future__ import annotations

from kit.auth import authorizer_from_coordinator
from kit.coordinator import Coordinator
from kit.p2p.identity import Identity
from kit.p2p.peer import Peer, create_peer


class CoordinatorMembers:
    """Each user's peer (``peers``), with a token from ``coordinator`` re-checked every second."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.peers: dict[str, Peer] = {}

    async def join(self, user: str, identity: Identity | None = None) -> Peer:
        """Log ``user`` in and start its peer (raises what the coordinator refuses with)."""
        identity = identity or Identity.generate()
        issuer = self.coordinator.issuer
        assert issuer is not None, "the coordinator issues no tokens (no access section)"
        authorizer = await authorizer_from_coordinator(
            self.coordinator.join_url,
            f"hf_{user}",
            identity,
            authority_public_key=issuer.authority_public_key,
            check_period=1.0,
        )
        run_id = self.coordinator.config.collaboration.run_id
        self.peers[user] = await create_peer(
            identity=identity, authorizer=authorizer, run_id=run_id
        )
        return self.peers[user]

    async def leave(self) -> None:
        for peer in self.peers.values():
            await peer.shutdown()
            await peer.authorizer.close()  # type: ignore[attr-defined]

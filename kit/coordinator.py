"""The organizer's coordinator (``notebooks/config.ipynb``, ``kit coordinator --config run.yaml``).

One process that runs everything a collaboration needs besides the volunteers (DeDLOC's
sahajBERT ran these as five separate scripts): a public bootstrap DHT peer that also relays for
volunteers behind NAT, the token endpoint of allowlisted runs (``kit.auth``; the authority's key
and ban list are ``kit.run_authority``'s), the run info and what volunteers fetch when they join
(``kit.handout``: tokenizer, the organizer's files as token shards, the wheel of this kit, the
join notebook), a start-up check that a remote volunteer could
train (``kit.preflight``; it refuses to start otherwise), the metrics collector and its dashboard
(``kit.metrics``, ``kit.dashboard``), an auxiliary averaging peer, and periodic checkpoints pushed
to the Hub (``kit.training.checkpoints``). It survives its own restart: volunteers keep training
through the DHT meanwhile; it reloads its identity, the leaderboard and the newest checkpoint,
and serves that checkpoint to peers when the collaboration has nothing newer.

Volunteers' peers only ever dial out to it: give it a public address (``announce``) and serve
``wss://`` with ``tls_certfile``/``tls_keyfile``, or put it behind a TLS reverse proxy on 443.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kit.config import RunConfig
from kit.dht.config import get_dht_time
from kit.errors import ConfigError, KitError, KitUsageError
from kit.p2p.identity import load_identity
from kit.remote_run import RUN_INFO_PATH
from kit.run_authority import (
    apply_revocations,
    create_authority,
    load_revocations,
    open_issuer,
    save_revocations,
)

if TYPE_CHECKING:  # imported late where used: the services load only when the coordinator starts
    from kit.auth import AllowlistAuthorizer, TokenIssuer
    from kit.auth.endpoint import TokenEndpoint
    from kit.dht import DHT, DHTNode
    from kit.handout import Handout
    from kit.metrics import MetricsCollector
    from kit.p2p.identity import Identity, IdentityLock
    from kit.p2p.peer import Peer
    from kit.p2p.transport import HttpRequest, HttpResponse
    from kit.preflight import PreflightReport
    from kit.relay_directory import RelayDirectory
    from kit.training.auxiliary import AuxiliaryPeer

logger = logging.getLogger(__name__)

#: The ``access:`` fields /api/run shows anyone who asks: what a volunteer's peer needs. The
#: allowlist (user and organization names) stays with the coordinator.
PUBLIC_ACCESS_FIELDS = (
    "open",
    "authority_public_key",
    "coordinator",
    "bootstrap_peers",
    "token_lifetime",
    "check_seconds",
)


@dataclasses.dataclass(frozen=True)
class CoordinatorOptions:
    """What differs between coordinator machines (run.yaml holds what the run is)."""

    # fmt: off
    host: str = "0.0.0.0"  # where to listen; the default accepts volunteers on every interface
    port: int = 0  # listening port; 0 = any free one (fix it on a server: volunteers need it)
    announce: tuple[str, ...] = ()  # public addresses to hand out, e.g. /dns/run.example.org/tcp/443/wss
    tls_certfile: str | None = None  # serve wss:// with this certificate chain (PEM)
    tls_keyfile: str | None = None  # ... and this private key (PEM)
    state_dir: str = "coordinator"  # identity, authority key, leaderboard and checkpoints live here
    tokenizer_dir: str | None = None  # a tokenizer folder to hand to volunteers (no Hub repo needed)
    hub_token: str | None = None  # Hub token with write access, for checkpoint pushes (None: $HF_TOKEN)
    hf_endpoint: str | None = None  # the Hub to talk to (None: $HF_ENDPOINT or huggingface.co)
    auxiliary_peer: bool = True  # run an auxiliary averaging peer (and the checkpointer) here
    metrics_period: float = 10.0  # seconds between metrics collections (and member-relay reads); lower it for demos
    preflight: bool = True  # refuse to start when a remote volunteer could not train (kit preflight)
    shard_tokens: int = 1 << 22  # token ids per served data shard; lower it for small corpora
    # fmt: on

    def __post_init__(self) -> None:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ConfigError(
                "coordinator: tls_certfile and tls_keyfile go together - help: give both or neither"
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"coordinator: port {self.port} - help: use 1-65535, or 0 for any")
        if self.shard_tokens < 1:
            raise ConfigError(
                f"coordinator: shard_tokens {self.shard_tokens} - help: use e.g. 4194304 (4M)"
            )


class Coordinator:
    """Everything the organizer runs, started by :meth:`start`, stopped by :meth:`shutdown`.

    Example::

        coordinator = Coordinator(RunConfig.from_file("run.yaml"), CoordinatorOptions(port=8765))
        coordinator.start()
        print(coordinator.join_url)       # hand this to volunteers
    """

    def __init__(self, config: RunConfig, options: CoordinatorOptions | None = None) -> None:
        self.config = config
        self.options = options or CoordinatorOptions()
        self.state_dir = Path(self.options.state_dir)
        self.dht: DHT | None = None
        self.collector: MetricsCollector | None = None
        self.issuer: TokenIssuer | None = None
        self.authorizer: AllowlistAuthorizer | None = None  # our own peer's, in private runs
        self.token_endpoint: TokenEndpoint | None = None
        self.auxiliary: AuxiliaryPeer | None = None
        self.handout: Handout | None = None  # tokenizer, data shards, kit wheel, join notebook
        self.preflight: PreflightReport | None = None  # the start-up check's report
        self.relays: RelayDirectory | None = None  # member relays, read from the DHT
        self._listen_port: int | None = None
        self._locks: list[IdentityLock] = []
        self._addresses: list[str] = []
        self._started = False

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the DHT peer, the services and the auxiliary peer; returns when all are up."""
        from kit.dht import DHT

        if self._started:
            raise KitError("this coordinator is already running - help: create a new one")
        from kit.public_address import check_public_address, check_tls_files

        # Before anything starts: what volunteers will be handed, and the TLS files.
        check_public_address(self.options.host, self.options.announce)
        if self.options.tls_certfile and self.options.tls_keyfile:
            check_tls_files(self.options.tls_certfile, self.options.tls_keyfile)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        identity, lock = load_identity(self.state_dir / "identity.key")
        self._locks.append(lock)
        self.authorizer = authorizer = self._load_authority(identity)
        from kit.handout import Handout

        self.handout = handout = Handout(
            self.config,
            self.state_dir,
            tokenizer_dir=self.options.tokenizer_dir,
            hub_token=self.options.hub_token,
            hf_endpoint=self.options.hf_endpoint,
            shard_tokens=self.options.shard_tokens,
        )
        try:
            handout.prepare()  # before the port opens: a failure leaves nothing running
        except BaseException:
            self.shutdown()
            raise
        peer_options: dict[str, Any] = dict(
            identity=identity,
            run_id=self.config.collaboration.run_id,
            config_hash=self.config.config_hash(),
            relay_service=True,
            tls_certfile=self.options.tls_certfile,
            tls_keyfile=self.options.tls_keyfile,
        )
        if authorizer is not None:
            peer_options["authorizer"] = authorizer
        self.dht = dht = DHT(
            host=self.options.host,
            port=self.options.port,
            announce=list(self.options.announce) or None,
            client_mode=False,
            peer_options=peer_options,
        )
        self._started = True
        try:
            # Cached: the run-info route answers on the loop, where blocking calls are not allowed.
            self._addresses = list(dht.get_visible_maddrs())
            dht.run_coroutine(self._start_services)
            if self.options.auxiliary_peer:
                from kit.training.auxiliary import AuxiliaryPeer

                self.auxiliary = AuxiliaryPeer(
                    self.config,
                    dht,
                    checkpoint_root=self.state_dir,
                    hub_token=self.options.hub_token,
                    hf_endpoint=self.options.hf_endpoint,
                    tokenizer_dir=handout.tokenizer_dir,
                    loss=self.latest_loss,
                )
                self.auxiliary.start()
            if self.options.preflight:
                self._check_as_a_volunteer()
            from kit.coordinator_file import write_coordinator_file

            # How `kit revoke --state-dir` finds us on this machine (removed by shutdown()).
            secure = self.options.tls_certfile is not None
            write_coordinator_file(
                self.state_dir, self.config, self.options.host, self._listen_port, secure=secure
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info("coordinator of %r is up: %s", self.config.collaboration.run_id, self.join_url)
        logger.info("dashboard: %s", self.dashboard_url)

    def _check_as_a_volunteer(self) -> None:
        """``kit preflight`` against ourselves at the link and addresses we hand out, not a
        loopback rewrite of them: an address nobody can reach fails here (PreflightFailed)."""
        from kit.preflight import check_own_link
        from kit.runtime import get_runtime

        authorizer = self.authorizer
        if authorizer is not None:  # a private run's data wants a token: our own peer's
            get_runtime().call(authorizer.credentials(), timeout=30.0)
        self.preflight = report = check_own_link(
            self.join_url,
            self.addresses,
            authorization=None if authorizer is None else authorizer.bearer,
        )
        for line in report.text().splitlines():
            logger.info("preflight: %s", line)
        report.raise_if_failed()

    def _load_authority(self, peer_identity: Identity) -> AllowlistAuthorizer | None:
        issuer = open_issuer(self.config, self.state_dir, self._locks)
        if issuer is None:
            return None
        from kit.auth import AllowlistAuthorizer

        self.issuer = issuer
        load_revocations(self.state_dir, issuer)
        # The coordinator's own peer needs a token too: issued by itself.
        authorizer = AllowlistAuthorizer.for_coordinator(
            peer_identity, issuer, check_period=self.config.access.check_seconds
        )
        authorizer.update_revocations(issuer.revocations)
        return authorizer

    # --- revocations ---------------------------------------------------------------------------

    def revoke(
        self,
        *,
        usernames: Sequence[str] = (),
        peer_public_keys: Sequence[bytes] = (),
        duration: float = 24 * 3600.0,
    ) -> None:
        """Ban Hub users and/or peer keys from the run for ``duration`` seconds.

        Their connections to the coordinator close now and no new token is issued to them; they
        are credited nothing more on the leaderboard (what they did before stays); every other
        peer learns the ban from the DHT within its poll period and refuses them too. The list
        is kept in ``state_dir``, so a restarted coordinator keeps the bans.

        Raises:
            KitUsageError: the run has no authority (open runs without one cannot ban).
            ConfigError: a name no Hub account can have, or a key of the wrong size.
        """
        issuer, dht = self.issuer, self.dht
        if issuer is None or dht is None:
            raise KitUsageError(
                "revoke() needs a started coordinator of a run with an authority - help: set "
                "access.authority_public_key (kit coordinator --create-authority)"
            )
        revocations = issuer.revoke(
            usernames=usernames,
            peer_public_keys=peer_public_keys,
            duration=duration,
            now=get_dht_time(),
        )
        save_revocations(self.state_dir, issuer)
        dht.run_coroutine(
            lambda _, node: apply_revocations(node, self.authorizer, issuer, revocations)
        )

    async def _start_services(self, dht: DHT, node: DHTNode) -> None:
        from kit.dashboard import register_dashboard
        from kit.metrics import MetricsCollector

        peer = cast("Peer", node.peer)  # the coordinator's DHT runs on kit's websocket peer
        access = self.config.access
        issuer, authorizer, handout = self.issuer, self.authorizer, self.handout
        assert handout is not None  # prepared by start() before the peer starts
        if issuer is not None:
            from kit.auth import Allowlist, serve_token_endpoint

            allowlist = Allowlist(
                usernames=frozenset(access.usernames),
                organizations=frozenset(access.organizations),
                open=access.open,
            )
            self.token_endpoint = serve_token_endpoint(
                peer, issuer, allowlist, hf_endpoint=self.options.hf_endpoint
            )
            # Our peer's session guard (kit.auth.sessions) follows the list like every peer's.
            if issuer.revocations.usernames or issuer.revocations.peer_public_keys:
                await apply_revocations(node, authorizer, issuer, issuer.revocations)  # kept
        run_id = self.config.collaboration.run_id
        self.collector = collector = MetricsCollector(
            node,
            run_id,
            authority_public_key=None if issuer is None else issuer.authority_public_key,
            revocations=None if authorizer is None else lambda: authorizer.revocations(run_id),
            state_path=self.state_dir / "leaderboard.json",
            period=self.options.metrics_period,
        )
        collector.start()
        from kit.relay_directory import RelayDirectory

        def banned_keys() -> frozenset[bytes]:
            revoked = None if authorizer is None else authorizer.revocations(run_id)
            if revoked is None:
                return frozenset()
            now = time.time()
            return frozenset(key for key, until in revoked.peer_public_keys if until > now)

        # Member relays (`kit dht --join`): /api/run hands them out to NAT'd volunteers.
        from kit.p2p.interfaces import is_loopback_only

        local = is_loopback_only(self.options.host)
        self.relays = relays = RelayDirectory(
            node, run_id, banned_keys, local=local, period=self.options.metrics_period
        )
        relays.start()
        register_dashboard(
            peer,
            collector,
            title=f"kit · {self.config.collaboration.run_id}",
            run_info=self.run_info,
        )
        peer.add_http_route(RUN_INFO_PATH, self._serve_run_info)
        handout.register(peer, lambda: self.join_url, authorizer=authorizer)
        from kit.revocation_admin import serve_revocation_admin

        serve_revocation_admin(peer, run_id, issuer, self.revoke)  # kit revoke, GET /api/bans
        self._listen_port = peer.listen_port

    def shutdown(self) -> None:
        """Stop the auxiliary peer, the services and the DHT peer (idempotent)."""
        if self._started:  # never one that did not start: another may run from this state dir
            from kit.coordinator_file import remove_coordinator_file

            remove_coordinator_file(self.state_dir)  # first: `kit revoke` finds nobody now
        if self.auxiliary is not None:
            self.auxiliary.stop()
            self.auxiliary = None
        if self.dht is not None:
            collector, relays = self.collector, self.relays

            async def stop(_: DHT, __: DHTNode) -> None:
                if collector is not None:
                    await collector.shutdown()
                if relays is not None:
                    await relays.shutdown()

            if self.dht.is_alive():
                try:
                    self.dht.run_coroutine(stop)
                except KitError as error:
                    logger.warning("stopping the metrics collector: %s", error)
            self.dht.shutdown()
            self.dht = None
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        self._started = False

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Block until ``stop`` is set or Ctrl+C, then shut down."""
        stop = stop or threading.Event()
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            logger.info("Ctrl+C: stopping the coordinator")
        finally:
            self.shutdown()

    def latest_loss(self) -> float | None:
        """The collaboration's latest loss (samples-weighted over peers), if any was reported."""
        if self.collector is None:
            return None
        summary = self.collector.summary()
        loss = summary.get("loss")
        return None if loss is None else float(loss)

    # --- what volunteers see -----------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """The peer addresses volunteers bootstrap from."""
        return list(self._addresses)

    @property
    def http_url(self) -> str:
        """``http(s)://host:port`` of the coordinator's port (dashboard, token, run info)."""
        from kit.address import parse_address

        address = parse_address(self.addresses[0])
        scheme = "https" if address.secure else "http"
        host = f"[{address.host}]" if ":" in address.host else address.host
        port = "" if address.port == (443 if address.secure else 80) else f":{address.port}"
        return f"{scheme}://{host}{port}{address.path.rstrip('/')}"  # a proxy's location too

    @property
    def join_url(self) -> str:
        """What volunteers pass to ``kit.join`` / ``kit join``."""
        return self.http_url

    @property
    def dashboard_url(self) -> str:
        return self.http_url + "/"

    def run_info(self, base: str | None = None) -> dict[str, Any]:
        """``GET /api/run``: what a volunteer needs to join, and nothing else: not the allowlist
        (``base``: the ``scheme://host`` it used)."""
        authority = self.config.access.authority_public_key
        own = self.addresses + list(self.config.access.bootstrap_peers)
        members = self.relays.shuffled() if self.relays is not None else []
        config = self.config.to_dict()
        config["access"] = {k: v for k, v in config["access"].items() if k in PUBLIC_ACCESS_FIELDS}
        return {
            "run_id": self.config.collaboration.run_id,
            "config": config,
            "config_hash": self.config.config_hash(),
            "initial_peers": [*own, *(a for a in members if a not in own)],
            # Whom NAT'd volunteers register with: member relays first, in a fresh order each
            # time (spread over them), then ours and the bootstrap peers.
            "relays": [*(a for a in members if a not in own), *own],
            "authority_public_key": authority,
            **(self.handout.describe(base or self.join_url) if self.handout else {}),
            "time": time.time(),
        }

    async def _serve_run_info(self, request: HttpRequest) -> HttpResponse:
        from kit.handout import base_url
        from kit.p2p.transport import HttpResponse

        secure = self.options.tls_certfile is not None
        info = self.run_info(base_url(request, self.join_url, secure=secure))
        body = json.dumps(info).encode()
        return HttpResponse(200, body, "application/json", (("Cache-Control", "no-store"),))


# create_authority lives in kit.run_authority; the config notebook and scripts import it from here.
__all__ = ["PUBLIC_ACCESS_FIELDS", "Coordinator", "CoordinatorOptions", "create_authority"]

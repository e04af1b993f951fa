"""``kit.dht.DHT``: the blocking, hivemind-compatible facade over a :class:`DHTNode`.

The node and its peer run as coroutines on kit's one runtime loop (``kit.runtime``); every
method here submits a coroutine there and waits for it with a timeout, or returns a
``concurrent.futures.Future`` with ``return_future=True``. Nothing is forked: unlike hivemind's
``DHT`` this is not a process, so it works the same in scripts, notebooks and tests.

hivemind scripts pass libp2p-style keyword arguments. Those that mean something here are mapped
(``host_maddrs``, ``announce_maddrs``, ``no_listen``, ``dht_mode``, ``startup_timeout`` and the
``DHTNode`` settings such as ``num_replicas`` or ``wait_timeout``); the other hivemind options are
ignored with one warning line; unknown names raise ``ConfigError``.

What this module does not do: the DHT logic (``node``), the transport (``kit.p2p``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import re
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from kit.dht.node import DHTConfig, DHTNode
from kit.dht.validation import RecordValidator
from kit.errors import ConfigError, DHTNotRunning, KitTimeout
from kit.p2p.api import PeerAPI
from kit.p2p.identity import PeerID
from kit.runtime import Runtime, get_runtime

logger = logging.getLogger(__name__)

T = TypeVar("T")
PeerFactory = Callable[..., Awaitable[PeerAPI]]

#: hivemind options with no meaning in kit (libp2p daemon, process and gRPC-era settings).
IGNORED_HIVEMIND_OPTIONS = frozenset(
    {
        "use_relay", "use_auto_relay", "nat_port_map", "auto_nat", "conn_manager",
        "force_reachability", "idle_timeout", "relay_hop_limit", "tls", "use_ipfs",
        "persistent_conn_max_msg_size", "quic", "use_relay_hop", "use_relay_discovery",
        "check_if_identity_free", "trusted_relays", "p2p", "daemon", "num_workers",
        "shutdown_timeout", "ensure_bootstrap_success", "strict", "authorizer",
        "reuse_get_requests", "chunk_size", "cache_refresh_before_expiry", "node_id",
    }
)  # fmt: skip
#: hivemind ``DHTNode.create`` settings and their :class:`DHTConfig` fields.
HIVEMIND_NODE_OPTIONS = {
    "bucket_size": "bucket_size",
    "num_replicas": "num_replicas",
    "depth_modulo": "depth_modulo",
    "parallel_rpc": "parallel_rpc",
    "wait_timeout": "rpc_timeout",
    "bootstrap_timeout": "bootstrap_timeout",
    "refresh_timeout": "refresh_period",
    "cache_locally": "cache_locally",
    "cache_nearest": "cache_nearest",
    "cache_size": "cache_size",
    "cache_on_store": "cache_on_store",
    "blacklist_time": "blacklist_time",
    "backoff_rate": "backoff_rate",
}
_MADDR_RE = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)(/p2p/[^/]+)?/?$")


def parse_maddr(maddr: object) -> tuple[str, int]:
    """``/ip4/<addr>/tcp/<port>`` (or ip6/dns, optionally ``/p2p/<id>``) → ``(host, port)``.

    Raises:
        ConfigError: not a TCP multiaddr.
    """
    match = _MADDR_RE.match(str(maddr))
    if match is None or int(match.group(3)) > 65535:
        raise ConfigError(
            f"{maddr!r} is not a TCP multiaddr - help: write /ip4/<address>/tcp/<port>, e.g. "
            "/ip4/0.0.0.0/tcp/31337, or pass host= and port= instead"
        )
    return match.group(2), int(match.group(3))


async def default_peer_factory(initial_peers: Sequence[str], **options: Any) -> PeerAPI:
    """Start kit's websocket peer (``kit.p2p.peer.create_peer``) with ``options``."""
    from kit.p2p.peer import create_peer  # imported late: tests run the DHT on MemoryNetwork

    peer: PeerAPI = await create_peer(initial_peers, **options)
    return peer


class DHT:
    """A DHT node for user code: blocking ``store`` / ``get`` with hivemind's semantics.

    Example::

        first = kit.dht.DHT(host="0.0.0.0", port=31337, announce="/ip4/203.0.113.5/tcp/31337")
        dht = kit.dht.DHT(initial_peers=first.get_visible_maddrs())
        dht.store("greeting", "hello", kit.dht.get_dht_time() + 60)
        value, expiration_time = dht.get("greeting")

    Args:
        initial_peers: addresses of running DHT peers (what their ``get_visible_maddrs()``
            returns); empty or None for the first peer of a swarm.
        start: start at once; else call :meth:`run_in_background`.
        await_ready: with ``start``, block until joined (False: return at once and call
            :meth:`wait_until_ready` later, as hivemind's ``DHT(await_ready=False)``).
        client_mode: True: only query (peers behind NAT: Colab, Kaggle); False: serve the DHT
            (needs a reachable host/port); None: the peer finds out, by asking an initial peer
            to dial it back, and falls back to client mode if that fails.
        host, port: where the peer listens (e.g. "0.0.0.0", 31337; port 0 picks a free one).
        announce: address(es) others should dial, if not the listening one (behind NAT or
            port forwarding), e.g. "/ip4/203.0.113.5/tcp/31337".
        identity_path: key file for a stable peer id across restarts (created if missing).
        record_validators: validators, e.g. ``Ed25519SignatureValidator(identity)`` to write
            owner-signed records, ``SchemaValidator(prefix, check)``.
        config: node settings (:class:`DHTConfig`); hivemind's node options override fields.
        peer_factory: coroutine function creating the peer, called as ``peer_factory(
            initial_peers, host=..., port=..., ...)`` with the options that were given
            (default: ``kit.p2p.peer.create_peer``); tests pass ``MemoryNetwork().create_peer``.
        peer_options: more options for the peer factory (e.g. ``run_id``, ``relay_service``).
        runtime: the runtime whose loop runs the node (default: the process-wide one).
        **hivemind_options: hivemind keyword arguments (see the module docstring).

    Raises:
        ConfigError: an unknown option or a malformed address.
        BootstrapFailed: ``initial_peers`` were given and none answered.
    """

    def __init__(
        self,
        initial_peers: Sequence[object] | str | None = None,
        *,
        start: bool = True,
        await_ready: bool = True,
        client_mode: bool | None = None,
        host: str | None = None,
        port: int | None = None,
        announce: str | Sequence[str] | None = None,
        identity_path: str | os.PathLike[str] | None = None,
        record_validators: Iterable[RecordValidator] = (),
        config: DHTConfig | None = None,
        peer_factory: PeerFactory | None = None,
        peer_options: Mapping[str, Any] | None = None,
        runtime: Runtime | None = None,
        **hivemind_options: Any,
    ) -> None:
        if isinstance(initial_peers, str):
            initial_peers = [initial_peers]
        self.initial_peers: tuple[str, ...] = tuple(str(p) for p in initial_peers or ())
        self.startup_timeout = 60.0
        config = config or DHTConfig()
        config_changes: dict[str, Any] = {}
        ignored = []
        for name, value in hivemind_options.items():
            if name == "host_maddrs":
                if host is not None or port is not None:
                    raise ConfigError("pass either host/port or host_maddrs - help: drop one")
                maddrs = [value] if isinstance(value, str) else list(value)
                host, port = parse_maddr(maddrs[0])
                if len(maddrs) > 1:
                    logger.warning("kit listens on one address; using %s of host_maddrs", maddrs[0])
            elif name == "announce_maddrs":
                maddrs = [value] if isinstance(value, str) else [str(m) for m in value or ()]
                for maddr in maddrs:
                    parse_maddr(maddr)  # kit.p2p reads these multiaddrs as they are
                announce = maddrs or announce
            elif name == "no_listen":
                client_mode = True if value else client_mode
            elif name == "dht_mode":
                client_mode = {"client": True, "server": False}.get(value, client_mode)
            elif name == "startup_timeout":
                self.startup_timeout = float(value)
            elif name == "record_validator":
                record_validators = [*record_validators, *([value] if value else [])]
            elif name in HIVEMIND_NODE_OPTIONS:
                if value is not None:
                    config_changes[HIVEMIND_NODE_OPTIONS[name]] = value
            elif name in IGNORED_HIVEMIND_OPTIONS:
                ignored.append(name)
            else:
                raise ConfigError(
                    f"kit.dht.DHT got an unknown option {name!r} - help: see "
                    "help(kit.dht.DHT); hivemind's options are mapped or ignored"
                )
        if ignored:
            logger.warning("kit.dht.DHT ignores these hivemind options: %s", ", ".join(ignored))
        self.config = dataclasses.replace(config, **config_changes) if config_changes else config
        if isinstance(announce, str):
            announce = [announce]
        self._peer_options: dict[str, Any] = dict(peer_options or {})
        given = {
            "host": host,
            "port": port,
            "announce": None if announce is None else tuple(announce),
            "identity_path": identity_path,
            "client_mode": client_mode,
        }
        self._peer_options.update({k: v for k, v in given.items() if v is not None})
        self._peer_options["client_mode"] = client_mode  # None: the peer detects reachability
        self._client_mode_request = client_mode
        self._record_validators = list(record_validators)
        self._peer_factory = peer_factory or default_peer_factory
        self._runtime = runtime or get_runtime()
        self._peer: PeerAPI | None = None
        self._node: DHTNode | None = None
        self._starting: concurrent.futures.Future[None] | None = None
        if start:
            self.run_in_background(await_ready=await_ready)

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        return f"DHT({self._node!r}, {state})"

    # --- lifecycle --------------------------------------------------------------------------

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Start the peer and the node (hivemind's name); waits until joined if ``await_ready``."""
        if self._starting is None:
            self._starting = self._runtime.call(self._start(), return_future=True)
        if await_ready:
            self.wait_until_ready(timeout)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until the node has joined (or raise what stopped it from joining).

        Raises:
            KitTimeout: not joined within ``timeout`` (it goes on starting, as in hivemind).
            DHTNotRunning: not joined within ``startup_timeout`` (``timeout=None``): stopped.
        """
        if self._starting is None:
            raise DHTNotRunning("this DHT was not started - help: call run_in_background()")
        try:
            self._starting.result(self.startup_timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            if timeout is not None:
                raise KitTimeout(
                    f"the DHT has not joined within {timeout} s (it is still starting) - help: "
                    "call wait_until_ready() again, or with a longer timeout"
                ) from None
            self._starting.cancel()
            raise DHTNotRunning(
                f"the DHT did not start within {self.startup_timeout} s - help: check that "
                "initial_peers are reachable, or raise startup_timeout"
            ) from None

    async def _start(self) -> None:
        peer = await self._peer_factory(self.initial_peers, **self._peer_options)
        try:
            node = await DHTNode.create(
                peer,
                self.initial_peers,
                config=self.config,
                record_validators=self._record_validators,
                client_mode=self._client_mode_request,
            )
        except BaseException:
            await _shutdown_peer(peer)
            raise
        self._peer = peer
        self._node = node

    def shutdown(self) -> None:
        """Stop the node and its peer; safe to call twice."""
        if self._starting is None:
            return
        starting, self._starting = self._starting, None
        if not starting.done():
            starting.cancel()
        if self._node is not None or self._peer is not None:
            self._runtime.call(self._stop(), timeout=30.0)

    async def _stop(self) -> None:
        node, self._node = self._node, None
        peer, self._peer = self._peer, None
        if node is not None:
            await node.shutdown()
        if peer is not None:
            await _shutdown_peer(peer)

    def is_alive(self) -> bool:
        return self._node is not None and self._node.is_running

    def __enter__(self) -> DHT:
        if self._starting is None:
            self.run_in_background(await_ready=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --- the API ----------------------------------------------------------------------------

    @property
    def node(self) -> DHTNode:
        """The running :class:`DHTNode` (use it from coroutines, e.g. in :meth:`run_coroutine`)."""
        if self._node is None:
            raise DHTNotRunning(
                "this DHT is not running - help: create it with start=True, call "
                "run_in_background(), or create a new DHT after shutdown()"
            )
        return self._node

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    @property
    def client_mode(self) -> bool:
        return self.node.client_mode

    def store(
        self,
        key: Any,
        value: Any,
        expiration_time: float,
        subkey: Any = None,
        return_future: bool = False,
    ) -> Any:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time`` (absolute).

        Returns:
            True if at least one replica accepted it (False: a later record is held, or it is
            already expired); a ``concurrent.futures.Future`` of that with ``return_future``.

        Raises:
            ValueNotSerializable, RecordTooLarge, ForgedRecord, SchemaViolation: bad record.
        """
        coroutine = self.node.store(key, value, expiration_time, subkey=subkey)
        return self._call(coroutine, return_future, self._operation_timeout)

    def get(self, key: Any, latest: bool = False, return_future: bool = False) -> Any:
        """The value under ``key`` as ``ValueWithExpiration(value, expiration_time)``, or None.

        Args:
            latest: search all replicas on the way for the newest value (slower).
        """
        coroutine = self.node.get(key, latest=latest)
        return self._call(coroutine, return_future, self._operation_timeout)

    def run_coroutine(
        self, coro_fn: Callable[[DHT, DHTNode], Awaitable[T]], return_future: bool = False
    ) -> Any:
        """Run ``await coro_fn(dht, node)`` on the runtime loop and return its result.

        ``coro_fn`` must bound its own waits (it runs without a timeout here).
        """
        node = self.node

        async def run() -> T:
            return await coro_fn(self, node)

        return self._call(run(), return_future, None)

    def add_validators(self, record_validators: Iterable[RecordValidator]) -> None:
        """Add record validators to the running node."""
        self.node.add_validators(record_validators)

    def get_visible_addresses(self) -> list[str]:
        """Addresses other peers can pass as ``initial_peers`` to join through this one."""
        node = self.node

        async def addresses() -> list[str]:
            return list(node.peer.get_visible_addresses())

        result: list[str] = self._call(addresses(), False, 10.0)
        return result

    def get_visible_maddrs(self, latest: bool = False) -> list[str]:
        """hivemind's name for :meth:`get_visible_addresses` (``latest`` is accepted, unused)."""
        return self.get_visible_addresses()

    @property
    def _operation_timeout(self) -> float:
        return self.config.lookup_timeout + self.config.rpc_timeout + 5.0

    def _call(
        self, coroutine: Coroutine[Any, Any, T], return_future: bool, timeout: float | None
    ) -> Any:
        if return_future:
            return self._runtime.call(coroutine, return_future=True)
        return self._runtime.call(coroutine, timeout=timeout)


async def _shutdown_peer(peer: PeerAPI) -> None:
    # PeerAPI has no shutdown(): the peer classes do (MemoryPeer, kit.p2p.peer.Peer).
    shutdown = getattr(peer, "shutdown", None)
    if shutdown is not None:
        await shutdown()

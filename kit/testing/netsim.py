"""Internet conditions on one machine: network namespaces, shaped links and NAT'd hosts.

Holds :class:`NetSim`, a context manager that builds a small private network out of Linux network
namespaces (needs root, iproute2 and nftables). It does not hold peers or scenarios (tests and
benchmarks start real kit peers as processes inside the namespaces with :meth:`NetSim.popen` /
:meth:`NetSim.python`), nor the delaying proxy itself (:mod:`kit.testing.delay_proxy`, which
:meth:`NetSim.start_delay_proxy` runs inside a namespace).

Topology (every address exists only inside this run's namespaces; the root namespace, its
interfaces and its routes are never touched)::

    public host i (ns <tag>-h<i>, eth0 10.231.0.<10+i>/24) ──veth── br0 (10.231.0.1/24) ┐
                                                                                           router ns
    NAT'd host j  (ns <tag>-h<j>, eth0 10.231.<100+j>.2/24) ──veth── n<j> (10.231.<100+j>.1)┘ <tag>-r

* Public hosts share one bridge (a switch) in the router namespace and reach each other directly.
* Each NAT'd host sits alone on its own "home LAN" with a default route through the router, which
  masquerades it behind 10.231.0.1 (nftables ``masquerade``, as a home router or carrier-grade NAT
  does). Its forward chain drops every connection that was not opened from a home LAN towards the
  public bridge, so nobody can dial a NAT'd host, and NAT'd hosts cannot dial each other either:
  they are outbound-only, like Colab/Kaggle. A peer that asks a public peer to dial it back sees
  the dial go to 10.231.0.1 (the router), which refuses it at once.
* Links are shaped with ``tc tbf`` in both directions (host egress on eth0 = upload; router egress
  on the host's veth = download): rate, burst and queue latency per host (:class:`LinkShape`).
* Every host's TCP uses one congestion control, CUBIC by default, set on its routes
  (``DEFAULT_CONGESTION_CONTROL`` says why it is pinned and why not this machine's BBR).

Latency and loss: this kernel has no ``sch_netem``, so delay cannot be added in the kernel. Instead
:meth:`NetSim.start_delay_proxy` places a :class:`kit.testing.delay_proxy.DelayProxy` in a host:
it terminates TCP and holds every chunk ``delay`` seconds each way (rare extra "stalls" stand in for
loss). Peers dial the proxy's address instead of the target's. Bandwidth comes from tbf only.

Cleanup: namespaces are named ``ksim<pid>x<n>-...``; deleting a namespace removes its veth ends and
bridge, so :meth:`NetSim.down` kills this run's processes and deletes its namespaces. It runs on
``__exit__`` (also when the body raised) and, through :func:`weakref.finalize`, at interpreter exit.
At start-up, namespaces left by dead processes (the pid in the name is gone) are deleted. The
namespace housekeeping and the processes' plumbing are :mod:`kit.testing.netns`.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from kit.errors import ConfigError, NetnsUnavailable
from kit.testing.netns import (
    COMMAND_TIMEOUT,
    check_available,
    clean_environment,
    clean_stale,
    list_namespaces,
    read_line,
    run_tag,
    teardown,
)

logger = logging.getLogger(__name__)

PUBLIC_LAN = "10.231.0"  # the "Internet" bridge; router = .1, public host i = .(10 + i)
ROUTER_ADDRESS = f"{PUBLIC_LAN}.1"
# The TCP congestion control of every simulated host, set on its routes (``ip route ... congctl``,
# per namespace, so it holds for kit, plain TCP and hivemind's daemon alike; the namespace's
# default cannot be set: outside the root namespace only the root's "allowed" list may be used).
# Why pin it: a new namespace inherits this machine's default (bbr on these VMs), so the figures
# would depend on how the CI machine is configured. Why CUBIC: it is the kernel's own default and
# what volunteers' Linux, Windows and macOS machines run. And BBR is not a faithful model on these
# links: with no added delay (no netem) its minimum RTT is the veth's ~0.1 ms, so its window
# (about 2 x bandwidth x min RTT, plus allowances) stays tiny while flows sharing a shaped link
# queue behind each other (seen: min RTT 0.07-0.25 ms, window ~50 packets at 20 ms RTT). Measured,
# plain TCP all-to-all between 4 hosts on 100 Mbit/s links, steady rounds: 1.10-1.34x the bandwidth
# bound with bbr, 1.05x with cubic (= the TCP/IP headers: 1514 bytes on the wire per 1448 of
# payload).
DEFAULT_CONGESTION_CONTROL = "cubic"
_counter = itertools.count()


@dataclass(frozen=True)
class LinkShape:
    """A host's access link, shaped with ``tc tbf`` in both directions (no added delay: no netem)."""

    rate_mbit: float = 100.0  # line rate up and down, Mbit/s (1e6 bit/s)
    burst_bytes: int = 256 * 1024  # bucket size; increase if you see goodput well under the rate
    latency_ms: float = 200.0  # queue a packet may wait before tbf drops it (the buffer depth)

    def __post_init__(self) -> None:
        if self.rate_mbit <= 0 or self.burst_bytes < 1600 or self.latency_ms <= 0:
            raise ConfigError(
                f"invalid link shape {self} - help: use rate_mbit > 0, burst_bytes >= 1600 "
                "(one full packet) and latency_ms > 0"
            )

    def tbf_arguments(self) -> list[str]:
        return [
            "tbf",
            "rate",
            f"{self.rate_mbit * 1000:.0f}kbit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.latency_ms:g}ms",
        ]


@dataclass(frozen=True)
class HostSpec:
    """One machine of the simulated network."""

    name: str  # how tests refer to it, e.g. "relay" or "alice"
    nat: bool = False  # behind a NAT: outbound connections only, nobody can dial it
    shape: LinkShape | None = None  # None = unshaped (veth speed)
    home_router: bool = False  # nat: behind a home router of its own (own public address)
    symmetric: bool = False  # home_router: a new public port per destination (punches fail)
    global_address: str | None = (
        None  # public host: also this global-scope IP (a server's public IP), routed by the router
    )


@dataclass(frozen=True)
class Host:
    """A host of a running :class:`NetSim`: its namespace and the address others see."""

    name: str
    netns: str  # pass to ``ip netns exec``
    address: str  # its own address (private 10.231.<100+j>.2 for a NAT'd host)
    nat: bool
    shape: LinkShape | None
    gateway: str | None = None  # a home router's public address (HostSpec.home_router)

    @property
    def public_address(self) -> str:
        """The address a public peer sees connections from: the NAT's, for a NAT'd host."""
        if not self.nat:
            return self.address
        return self.gateway or ROUTER_ADDRESS


class NetSim:
    """A private network of namespaces; use as ``with NetSim([HostSpec("a"), ...]) as sim:``.

    Args:
        hosts: the machines; public ones get 10.231.0.10, .11, ... in order.
        congestion_control: every host's TCP congestion control (see
            ``DEFAULT_CONGESTION_CONTROL`` for why it is pinned); None keeps this machine's.

    Raises:
        NetnsUnavailable: not root, or ip/tc/nft missing or failing.
        ConfigError: duplicate host names, or more than 90 hosts of a kind.
    """

    def __init__(
        self,
        hosts: Sequence[HostSpec],
        *,
        congestion_control: str | None = DEFAULT_CONGESTION_CONTROL,
    ) -> None:
        names = [spec.name for spec in hosts]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate host names in {names} - help: name each host once")
        if sum(s.nat for s in hosts) > 90 or sum(not s.nat for s in hosts) > 90:
            raise ConfigError("at most 90 public and 90 NAT'd hosts - help: use fewer hosts")
        if congestion_control is not None and not congestion_control.replace("_", "").isalnum():
            raise ConfigError(
                f"congestion control {congestion_control!r:.40} - help: a kernel name such as"
                " 'cubic' or 'reno', or None for this machine's default"
            )
        self.specs = list(hosts)
        self.congctl = "" if congestion_control is None else f" congctl {congestion_control}"
        self.tag = run_tag(os.getpid(), next(_counter))
        self.router = f"{self.tag}-r"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._finalizer = weakref.finalize(self, teardown, self._namespaces, self._processes)

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> NetSim:
        self.up()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the router, the hosts, their links, shaping and NAT (undone on failure)."""
        check_available()
        clean_stale()
        try:
            self._add_namespace(self.router)
            self._sh(self.router, "ip link add br0 type bridge && ip link set br0 up")
            self._sh(self.router, f"ip addr add {ROUTER_ADDRESS}/24 dev br0")
            self._sh(self.router, "echo 1 > /proc/sys/net/ipv4/ip_forward")
            public, nat = 0, 0
            for index, spec in enumerate(self.specs):
                if spec.nat and spec.home_router:
                    self._add_home_router_host(index, nat, spec)
                    nat += 1
                elif spec.nat:
                    self._add_nat_host(index, nat, spec)
                    nat += 1
                else:
                    self._add_public_host(index, public, spec)
                    public += 1
            for spec in self.specs:
                for other in self.hosts.values():
                    if spec.global_address and not other.nat and other.name != spec.name:
                        route = f"ip route add {spec.global_address}/32 via {ROUTER_ADDRESS}"
                        self._sh(other.netns, route)
            self._sh(self.router, "nft -f -", stdin=self._nat_ruleset())
        except BaseException:
            self.down()
            raise
        logger.info("netsim %s up: %s", self.tag, ", ".join(f"{h}" for h in self.hosts.values()))

    def down(self) -> None:
        """Kill this run's processes and delete its namespaces (idempotent)."""
        teardown(self._namespaces, self._processes)

    def leftovers(self) -> list[str]:
        """Namespaces of this run that still exist (empty after :meth:`down`)."""
        return [name for name in list_namespaces() if name.startswith(f"{self.tag}-")]

    # --- building ----------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        self._run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        self._run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _add_host_namespace(self, index: int, spec: HostSpec, router_end: str) -> str:
        netns = f"{self.tag}-h{index}"
        self._add_namespace(netns)
        # Both ends are created straight inside their namespaces: nothing appears in the root one.
        self._run(
            ["ip", "link", "add", router_end, "netns", self.router, "type", "veth"]
            + ["peer", "name", "eth0", "netns", netns]
        )
        if spec.shape is not None:
            tbf = " ".join(spec.shape.tbf_arguments())
            self._sh(netns, f"tc qdisc add dev eth0 root {tbf}")  # upload
            self._sh(self.router, f"tc qdisc add dev {router_end} root {tbf}")  # download
        return netns

    def _add_public_host(self, index: int, public_index: int, spec: HostSpec) -> None:
        end = f"p{public_index}"
        netns = self._add_host_namespace(index, spec, end)
        self._sh(self.router, f"ip link set {end} master br0 && ip link set {end} up")
        address = f"{PUBLIC_LAN}.{10 + public_index}"
        self._sh(netns, f"ip addr add {address}/24 dev eth0 && ip link set eth0 up")
        if self.congctl:
            route = f"{PUBLIC_LAN}.0/24 dev eth0 proto kernel scope link src {address}"
            self._sh(netns, f"ip route replace {route}{self.congctl}")
        if spec.global_address is not None:
            # On the host's interface, as a server's public IP is; the router (every NAT'd
            # host's gateway) routes it; the other public hosts reach it through the router.
            self._sh(netns, f"ip addr add {spec.global_address}/32 dev eth0")
            self._sh(self.router, f"ip route add {spec.global_address}/32 via {address}")
        self.hosts[spec.name] = Host(spec.name, netns, address, False, spec.shape)

    def _add_nat_host(self, index: int, nat_index: int, spec: HostSpec) -> None:
        end = f"n{nat_index}"
        netns = self._add_host_namespace(index, spec, end)
        lan = f"10.231.{100 + nat_index}"
        self._sh(self.router, f"ip addr add {lan}.1/24 dev {end} && ip link set {end} up")
        self._sh(netns, f"ip addr add {lan}.2/24 dev eth0 && ip link set eth0 up")
        self._sh(netns, f"ip route add default via {lan}.1{self.congctl}")
        self.hosts[spec.name] = Host(spec.name, netns, f"{lan}.2", True, spec.shape)

    def _add_home_router_host(self, index: int, nat_index: int, spec: HostSpec) -> None:
        """A NAT'd host behind a home router of its own: a namespace with a WAN end on the
        public bridge (10.231.0.<150+j>) and a LAN end to the host (10.231.<100+j>.1), which
        masquerades the host behind its WAN address and drops what nobody inside asked for, as
        home routers do (``_home_router_ruleset``). Two such hosts are behind two NATs: a
        connection between them needs both to open it at once (hole punching)."""
        gateway = f"{self.tag}-g{nat_index}"
        self._add_namespace(gateway)
        wan_end, wan = f"w{nat_index}", f"{PUBLIC_LAN}.{150 + nat_index}"
        self._run(
            ["ip", "link", "add", wan_end, "netns", self.router, "type", "veth"]
            + ["peer", "name", "wan", "netns", gateway]
        )
        self._sh(self.router, f"ip link set {wan_end} master br0 && ip link set {wan_end} up")
        self._sh(gateway, f"ip addr add {wan}/24 dev wan && ip link set wan up")
        netns = f"{self.tag}-h{index}"
        self._add_namespace(netns)
        self._run(
            ["ip", "link", "add", "lan", "netns", gateway, "type", "veth"]
            + ["peer", "name", "eth0", "netns", netns]
        )
        lan = f"10.231.{100 + nat_index}"
        self._sh(gateway, f"ip addr add {lan}.1/24 dev lan && ip link set lan up")
        self._sh(gateway, "echo 1 > /proc/sys/net/ipv4/ip_forward")
        self._sh(netns, f"ip addr add {lan}.2/24 dev eth0 && ip link set eth0 up")
        self._sh(netns, f"ip route add default via {lan}.1{self.congctl}")
        if spec.shape is not None:
            tbf = " ".join(spec.shape.tbf_arguments())
            self._sh(netns, f"tc qdisc add dev eth0 root {tbf}")  # upload
            self._sh(gateway, f"tc qdisc add dev lan root {tbf}")  # download
        self._sh(gateway, "nft -f -", stdin=self._home_router_ruleset(symmetric=spec.symmetric))
        self.hosts[spec.name] = Host(spec.name, netns, f"{lan}.2", True, spec.shape, wan)

    @staticmethod
    def _home_router_ruleset(*, symmetric: bool = False) -> str:
        # Masquerade keeps the host's source port where it is free (endpoint-independent
        # mapping, as most home routers and cloud NATs do); inbound, only what conntrack knows
        # passes (address- and port-dependent filtering): a connection opened from inside, or a
        # SYN that arrives while the host's own SYN to that same address and port is out (TCP
        # simultaneous open). Anything else addressed to the router is dropped, not refused.
        # ``symmetric``: a random public port for every connection (fully-random), as symmetric
        # NATs (some carrier-grade and corporate ones) map: the port a relay saw is not the one
        # a punch leaves from, so punches fail and the peer stays relayed.
        mapping = "masquerade fully-random" if symmetric else "masquerade"
        return (
            "table ip home {\n"
            "  chain postrouting {\n"
            "    type nat hook postrouting priority srcnat;\n"
            f'    oifname "wan" {mapping}\n'
            "  }\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter; policy drop;\n"
            "    ct state established,related accept\n"
            '    iifname "lan" oifname "wan" accept\n'
            "  }\n"
            "  chain input {\n"
            "    type filter hook input priority filter; policy accept;\n"
            '    iifname "wan" ct state new drop\n'
            "  }\n"
            "}\n"
        )

    @staticmethod
    def _nat_ruleset() -> str:
        # Home LANs (veth n*) may open connections to the bridge only; replies come back through
        # conntrack. Everything else that would be forwarded is dropped: no inbound route. With
        # br_netfilter, packets switched between public hosts also meet this chain (br0 -> br0).
        return (
            "table ip ksim {\n"
            "  chain postrouting {\n"
            "    type nat hook postrouting priority srcnat;\n"
            '    oifname "br0" ip saddr 10.231.0.0/16 ip saddr != 10.231.0.0/24 masquerade\n'
            "  }\n"
            "  chain forward {\n"
            "    type filter hook forward priority filter; policy drop;\n"
            "    ct state established,related accept\n"
            '    iifname "br0" oifname "br0" accept\n'  # switched public<->public (br_netfilter)
            '    iifname "n*" oifname "br0" accept\n'
            "  }\n"
            "}\n"
        )

    # --- running things inside -----------------------------------------------------------------

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise ConfigError(f"no host {name!r} - help: one of {sorted(self.hosts)}") from None

    def run(self, host: str, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host``'s namespace and wait (bounded) for it to finish."""
        return subprocess.run(
            ["ip", "netns", "exec", self.host(host).netns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=clean_environment(),
        )

    def popen(self, host: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``'s namespace (stdout piped); killed by :meth:`down`."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.host(host).netns, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=clean_environment(),
        )
        self._processes.append(process)
        return process

    def python(self, host: str, module: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``python -m module args...`` inside ``host``'s namespace."""
        return self.popen(host, [sys.executable, "-m", module, *args])

    def start_delay_proxy(
        self,
        host: str,
        target: tuple[str, int],
        *,
        delay: float,
        port: int = 0,
        stall_probability: float = 0.0,
        stall: float = 0.2,
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Run a :class:`DelayProxy` in ``host`` that forwards to ``target`` with added delay.

        Returns:
            The proxy process and the port it listens on (on every address of ``host``).
        """
        process = self.python(
            host,
            "kit.testing.delay_proxy",
            f"--port={port}",
            f"--target={target[0]}:{target[1]}",
            f"--delay={delay}",
            f"--stall-probability={stall_probability}",
            f"--stall={stall}",
        )
        line = read_line(process, timeout=COMMAND_TIMEOUT)
        if not line.isdigit():
            raise NetnsUnavailable(f"the delay proxy did not start (printed {line!r})")
        return process, int(line)

    # --- helpers -------------------------------------------------------------------------------

    def _run(self, argv: list[str], stdin: str | None = None) -> None:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT
        )
        if done.returncode != 0:
            raise NetnsUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")

    def _sh(self, netns: str, script: str, stdin: str | None = None) -> None:
        self._run(["ip", "netns", "exec", netns, "sh", "-ec", script], stdin)


__all__ = ["Host", "HostSpec", "LinkShape", "NetSim"]

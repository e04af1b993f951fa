"""Settings of a DHT node (:class:`DHTConfig`) and the DHT's clock (:func:`get_dht_time`).

Every node of a swarm should share ``limits`` and the replica settings; the comments say when
to change the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from kit.dht.protocol import MAX_CONTACTS
from kit.dht.values import RecordLimits
from kit.errors import ConfigError

#: Clocks of nodes further apart than this make short-lived records unreliable (hivemind: 3 s).
MAX_DHT_TIME_DISCREPANCY_SECONDS = 3.0
#: Bytes of values one find response may carry; more keys get only nearest nodes.
RESPONSE_VALUE_BUDGET = 3 * 1024 * 1024


def get_dht_time() -> float:
    """The DHT's clock: absolute wall-clock seconds (``time.time()``), as in hivemind.

    An event loop on virtual time (``kit.testing.virtual_time``) supplies its own through a
    ``dht_time()`` method: the wall clock when it started plus the virtual seconds since, so
    record expirations advance with the simulated links rather than with the CPU.
    """
    loop = asyncio._get_running_loop()
    clock = getattr(loop, "dht_time", None) if loop is not None else None
    return clock() if clock is not None else time.time()


@dataclasses.dataclass(frozen=True)
class DHTConfig:
    """Settings of one DHT node; every node of a swarm should share ``limits`` and replicas."""

    # fmt: off
    bucket_size: int = 20  # k: contacts per k-bucket (Kademlia §2.2); increase if lookups fail under heavy churn
    num_replicas: int = 5  # nodes storing each record (hivemind: 5); increase if records vanish as peers leave
    beam_size: int = 10  # closest nodes a lookup keeps querying (>= num_replicas); increase if gets miss fresh values
    parallel_rpc: int = 3  # alpha: requests in flight per lookup (Kademlia §2.3)
    depth_modulo: int = 5  # b of Kademlia §4.2: also split buckets whose depth is not a multiple of b
    rpc_timeout: float = 3.0  # seconds for one request; increase if you see peers blacklisted on slow links
    lookup_timeout: float = 15.0  # seconds for one whole lookup (store or get)
    bootstrap_timeout: float = 15.0  # seconds to fill the routing table after reaching the initial peers
    refresh_period: float = 600.0  # refresh buckets with no lookup for this long (Kademlia §2.3: one hour)
    republish_period: float = 300.0  # re-store this node's own records on the current nearest nodes
    rejoin_period: float = 15.0  # ping the initial peers this often, so a restarted bootstrap peer is found again; 0 = never
    cache_locally: bool = True  # keep values this node found, to answer repeated gets at once
    cache_on_store: bool = True  # keep values this node stored in its cache too
    cache_nearest: int = 1  # after a get, cache the value on this many nearest nodes that lacked it (§2.3)
    cache_size: int = 10_000  # records in the local cache
    max_records: int = 100_000  # records held for others; the earliest-expiring is evicted past it
    max_subkeys: int = 10_000  # subkeys held under one key
    max_dictionary_bytes: int = 2 * 1024 * 1024  # bytes held under one key with subkeys; must fit one message
    blacklist_time: float = 5.0  # seconds an unresponsive peer is skipped after its first failure
    backoff_rate: float = 2.0  # each further failure multiplies the ban by this
    max_background_tasks: int = 64  # pings and record transfers in flight; more are skipped
    limits: RecordLimits = RecordLimits()  # sizes and lifetime of records (the same on every node)
    # fmt: on

    def __post_init__(self) -> None:
        positive_ints = (
            "bucket_size",
            "num_replicas",
            "beam_size",
            "parallel_rpc",
            "depth_modulo",
            "cache_size",
            "max_records",
            "max_subkeys",
            "max_dictionary_bytes",
            "max_background_tasks",
        )
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"DHTConfig.{name} must be >= 1 - help: keep the default")
        for name in ("rpc_timeout", "lookup_timeout", "bootstrap_timeout", "refresh_period"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"DHTConfig.{name} must be > 0 seconds - help: keep the default")
        if not self.republish_period > 0 or self.blacklist_time < 0 or self.backoff_rate < 1:
            raise ConfigError(
                "DHTConfig: republish_period must be > 0, blacklist_time >= 0, backoff_rate >= 1"
                " - help: keep the defaults"
            )
        if self.bucket_size > MAX_CONTACTS:
            raise ConfigError(
                f"DHTConfig.bucket_size must be <= {MAX_CONTACTS}, the contacts one find answer "
                "may carry - help: keep the default (20)"
            )
        if self.beam_size < self.num_replicas:
            raise ConfigError(
                f"DHTConfig.beam_size ({self.beam_size}) must be >= num_replicas "
                f"({self.num_replicas}) - help: raise beam_size with num_replicas"
            )
        if self.max_dictionary_bytes > RESPONSE_VALUE_BUDGET:
            raise ConfigError(
                f"DHTConfig.max_dictionary_bytes must be <= {RESPONSE_VALUE_BUDGET} to fit one "
                "message - help: keep the default"
            )

"""kit: train one large model together over the Internet, on donated GPUs.

Map of the package (data flows down this list; each room imports only rooms above it; the
full map, checked by tests/test_architecture.py, is ARCHITECTURE.md):

    errors.py        the one exception tree (whose fault? transient or permanent?)
    address.py       PeerIDs and peer addresses (stdlib only)
    config/          RunConfig and its sections (frozen dataclasses, torch-free)
    runtime.py       the one asyncio loop in one background thread + blocking facade
    http_client.py   the bounded blocking HTTP GET volunteers use to talk to a coordinator
    p2p/             websocket peer-to-peer layer: identity, wire format, handshake,
                     multiplexed streams, the websocket transport, relays for peers behind NAT
                     (torch-free)
    dht/             Kademlia DHT with hivemind's store/get semantics (torch-free)
    auth/            allowlist auth: access tokens, revocation (a DHT record), token endpoint
                     (torch-free)
    averaging/       butterfly all-reduce, load-balancing LP, compression codecs
    optim/           kit.Optimizer: DeDLOC's collaborative optimizer, progress, state sharing
    metrics/         contribution records and their aggregation (leaderboard, loss curve)
    data/            streaming tokenization pipeline, ALBERT MLM+SOP examples, tokenizer recipe,
                     the organizer's files served as token shards
    hardware/        detect the machine, plan device / precision / micro-batch
    training/        model and optimizer from a RunConfig, the training loop, checkpoints
    dashboard/       the coordinator's web page and JSON API (torch-free)
    ui/              notebook widgets (login, live panel) and the console reporter
    remote_run.py    a run as a remote volunteer sees it: /api/run, tokenizer, served data
    join_notebook.py the one-cell join notebook (served by the coordinator at /join.ipynb)
    wheel.py         the wheel of the running kit (volunteers install the organizer's version)
    handout.py       what the coordinator hands to volunteers besides the swarm
    preflight.py     `kit preflight URL`, also the coordinator's start-up check
    run_authority.py the run's authority kept by the coordinator: key, token issuer, bans
    volunteer_session.py  a volunteer's session (Volunteer): login, peer, model, data, training
    volunteer.py     the volunteer's entry module: kit.join / `kit join` (join.ipynb)
    coordinator.py   the organizer's entry module (config.ipynb); coordinator_cli.py:
                     `kit coordinator`
    demo.py          `kit demo`: a coordinator and 3 volunteers on this machine
    evaluation/      the researcher's room (checkpoints, tasks, fine-tuning, reports)
    evaluate.py      the researcher's entry module (evaluate.ipynb); evaluate_cli.py:
                     `kit evaluate ...`
    testing/         fake Hugging Face Hub, network namespaces (tests and dry runs)
    cli.py           the ``kit`` command
    utils.py,        hivemind's ``hivemind.utils`` / ``hivemind.compression`` names, re-exported
    compression.py   for ported scripts (``import kit as hivemind``)

Importing kit does nothing global: no threads, no logging configuration, no network.
"""

from typing import Any

__version__ = "0.1.0"

# hivemind's top-level names, so a hivemind script ports by changing its imports. Loaded lazily
# (PEP 562): ``import kit`` imports neither torch nor the network stack.
_EXPORTS = {
    "join": "kit.volunteer",
    "Volunteer": "kit.volunteer",
    "Coordinator": "kit.coordinator",
    "CoordinatorOptions": "kit.coordinator",
    "RunConfig": "kit.config",
    "DHT": "kit.dht",
    "PeerID": "kit.p2p.identity",
    "get_dht_time": "kit.dht",
    "Optimizer": "kit.optim",
    "GradScaler": "kit.optim",
    "DecentralizedAverager": "kit.averaging.averager",
    "NoCompression": "kit.averaging.compression",
    "Float16Compression": "kit.averaging.compression",
    "ScaledFloat16Compression": "kit.averaging.compression",
    "Uniform8BitQuantization": "kit.averaging.compression",
    "Quantile8BitQuantization": "kit.averaging.compression",
    "BlockwiseQuantization": "kit.averaging.compression",
    "SizeAdaptiveCompression": "kit.averaging.adaptive_compression",
}
# hivemind's subpackages, reachable as attributes right after ``import kit as hivemind``
# (``hivemind.optim.Optimizer``, ``hivemind.utils.get_dht_time``), imported on first use.
_SUBMODULES = frozenset({"averaging", "compression", "dht", "optim", "p2p", "utils"})


def __getattr__(name: str) -> Any:
    import importlib

    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"kit.{name}")
    raise AttributeError(f"module 'kit' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)

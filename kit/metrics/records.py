"""The contribution record: what one training peer publishes about its own work (pure).

Every training peer stores one owner-signed :class:`ContributionRecord` under
:func:`metrics_key` (``f"{run_id}_metrics"``), subkey = its ``[owner:...]`` marker, so nobody can
forge or overwrite another peer's record (``kit.dht.validation``). The coordinator reads them all
and turns them into a loss curve and a leaderboard (``kit.metrics.book``), like the DeDLOC
sahajBERT dashboard that credited each volunteer with the samples its GPUs processed (DeDLOC §4.2).

Counters are cumulative per *session* (one reporter, i.e. one run of a peer process): a restarted
peer starts a new session at zero, and the book keeps the maximum per session, so restarts and
repeated records never count twice.

Everything here arrives from other machines: :meth:`ContributionRecord.from_dict` checks types,
finite numbers, string lengths and sizes, and returns None for anything malformed.

What this module does not do: publishing (``reporter``), aggregation (``book``), fetching
(``collector``), token checks (``verification.token_verifier``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Limits on fields that come from other peers (a record is a few hundred bytes).
MAX_PEER_ID_BYTES = 64
MAX_SESSION_CHARS = 64
MAX_USERNAME_CHARS = 96
MAX_DEVICE_CHARS = 64
MAX_TOKEN_BYTES = 1024  # kit.auth.tokens.MAX_TOKEN_BYTES: an access token is ~200 bytes
MAX_EPOCH = 2**40
MAX_SAMPLES = 2**53  # exact in a float64, beyond anything a run can process
MAX_SECONDS = 1e12
MAX_LOSS = 1e9
_FIELDS = (
    "peer_id",
    "session",
    "username",
    "token",
    "epoch",
    "loss",
    "samples_total",
    "compute_seconds",
    "samples_per_second",
    "time",
    "client_mode",
    "auxiliary",
    "device",
)


def metrics_key(run_id: str) -> str:
    """The DHT key under which the peers of ``run_id`` publish their contribution records."""
    return f"{run_id}_metrics"


@dataclass(frozen=True)
class ContributionRecord:
    """What one peer says about its own training work (hivemind's sahajBERT ``LocalMetrics``)."""

    peer_id: bytes  # raw PeerID of the publishing peer (must match its owner key)
    session: str  # random per reporter: a restarted peer process is a new session
    username: str  # self-declared; the coordinator trusts only the one in ``token``
    token: bytes | None  # the peer's kit.auth AccessToken bytes (authenticated runs), else None
    epoch: int  # the global step this peer is at
    loss: float | None  # mean training loss of its recent local steps; None before the first
    samples_total: int  # samples processed since this session started (cumulative)
    compute_seconds: float  # seconds spent in forward/backward since this session started
    samples_per_second: float  # this peer's recent throughput
    time: float  # DHT time (time.time()) when the record was made
    client_mode: bool  # the peer is behind NAT (dials out only)
    auxiliary: bool  # the peer only helps averaging (the coordinator's), trains nothing
    device: str  # short description, e.g. "Tesla T4 (fp16)" or "cpu"

    def to_dict(self) -> dict[str, Any]:
        """The DHT value (msgpack-friendly: bytes, str, int, float, bool, None)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, body: Any) -> ContributionRecord | None:
        """Parse a record that came from the DHT; None (and a debug line) for anything malformed.

        Strict on types (no bool for an int, no str for bytes) and ranges; extra keys are
        ignored, so a newer kit may add fields.
        """
        try:
            return _parse(body)
        except (KeyError, TypeError, ValueError) as e:
            logger.debug("ignoring a malformed contribution record (%s): %.200r", e, body)
            return None


def _parse(body: Any) -> ContributionRecord:
    if not isinstance(body, dict):
        raise TypeError(f"a record is a map, not {type(body).__name__}")
    peer_id = _bytes(body["peer_id"], "peer_id", MAX_PEER_ID_BYTES)
    if not peer_id:
        raise ValueError("empty peer_id")
    token = body["token"]
    if token is not None:
        token = _bytes(token, "token", MAX_TOKEN_BYTES)
    loss = body["loss"]
    if loss is not None:
        loss = _number(loss, "loss", -MAX_LOSS, MAX_LOSS)
    session = _text(body["session"], "session", MAX_SESSION_CHARS)
    if not session:
        raise ValueError("empty session")
    return ContributionRecord(
        peer_id=peer_id,
        session=session,
        username=_text(body["username"], "username", MAX_USERNAME_CHARS),
        token=token,
        epoch=_integer(body["epoch"], "epoch", MAX_EPOCH),
        loss=loss,
        samples_total=_integer(body["samples_total"], "samples_total", MAX_SAMPLES),
        compute_seconds=_number(body["compute_seconds"], "compute_seconds", 0.0, MAX_SECONDS),
        samples_per_second=_number(body["samples_per_second"], "samples_per_second", 0.0, 1e9),
        time=_number(body["time"], "time", 0.0, MAX_SECONDS),
        client_mode=_flag(body["client_mode"], "client_mode"),
        auxiliary=_flag(body["auxiliary"], "auxiliary"),
        device=_text(body["device"], "device", MAX_DEVICE_CHARS),
    )


def _bytes(value: Any, name: str, limit: int) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"{name} of {len(value)} bytes > {limit}")
    return bytes(value)


def _text(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, got {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"{name} of {len(value)} characters > {limit}")
    if not value.isprintable():  # no control characters in what the dashboard shows
        raise ValueError(f"{name} has control characters")
    return value


def _integer(value: Any, name: str, limit: int) -> int:
    if type(value) is not int:  # exact: bool is an int subclass
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise ValueError(f"{name}={value} out of [0, {limit}]")
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name}={value!r} is not finite in [{low}, {high}]")
    return value


def _flag(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value

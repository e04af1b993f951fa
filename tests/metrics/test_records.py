"""ContributionRecord: round trip, and strict parsing of what other peers publish."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from kit.metrics.records import (
    MAX_TOKEN_BYTES,
    MAX_USERNAME_CHARS,
    ContributionRecord,
    metrics_key,
)


def make_record(**changes: Any) -> ContributionRecord:
    fields: dict[str, Any] = {
        "peer_id": b"\x00\x24" + bytes(range(32)),
        "session": "a1b2c3d4",
        "username": "alice",
        "token": b"\x86" + b"t" * 150,
        "epoch": 12,
        "loss": 3.25,
        "samples_total": 4096,
        "compute_seconds": 123.5,
        "samples_per_second": 17.5,
        "time": 1_790_000_000.25,
        "client_mode": True,
        "auxiliary": False,
        "device": "Tesla T4 (fp16)",
    }
    fields.update(changes)
    return ContributionRecord(**fields)


def test_metrics_key_names_the_run() -> None:
    assert metrics_key("sahaj-xl") == "sahaj-xl_metrics"
    assert metrics_key("a") != metrics_key("b")


@pytest.mark.parametrize(
    "changes", [{}, {"token": None, "loss": None}, {"loss": -0.5, "samples_per_second": 0.0}]
)
def test_round_trip_through_msgpack(changes: dict[str, Any]) -> None:
    record = make_record(**changes)
    wire = msgpack.unpackb(msgpack.packb(record.to_dict(), use_bin_type=True), raw=False)
    assert ContributionRecord.from_dict(wire) == record


def test_integers_are_accepted_for_float_fields_and_extra_keys_ignored() -> None:
    body = make_record().to_dict() | {"compute_seconds": 7, "from_a_newer_kit": [1, 2]}
    parsed = ContributionRecord.from_dict(body)
    assert parsed is not None
    assert parsed.compute_seconds == 7.0 and isinstance(parsed.compute_seconds, float)


@pytest.mark.parametrize(
    "changes",
    [
        {"epoch": True},  # bool is not an int here
        {"epoch": -1},
        {"epoch": 2**41},
        {"epoch": 1.0},
        {"samples_total": "12"},
        {"samples_total": -5},
        {"loss": math.nan},
        {"loss": math.inf},
        {"loss": "low"},
        {"compute_seconds": -1.0},
        {"samples_per_second": math.inf},
        {"time": math.nan},
        {"peer_id": "not bytes"},
        {"peer_id": b""},
        {"peer_id": b"x" * 65},
        {"token": "a string token"},
        {"token": b"x" * (MAX_TOKEN_BYTES + 1)},
        {"username": "x" * (MAX_USERNAME_CHARS + 1)},
        {"username": "evil\nname"},
        {"username": 42},
        {"session": ""},
        {"session": "s" * 65},
        {"device": "d" * 1000},
        {"client_mode": 1},
        {"auxiliary": None},
    ],
)
def test_malformed_fields_are_rejected(changes: dict[str, Any]) -> None:
    assert ContributionRecord.from_dict(make_record().to_dict() | changes) is None


@pytest.mark.parametrize("missing", ["peer_id", "session", "token", "loss", "time", "device"])
def test_missing_fields_are_rejected(missing: str) -> None:
    body = make_record().to_dict()
    del body[missing]
    assert ContributionRecord.from_dict(body) is None


@pytest.mark.parametrize("body", [None, [], "record", b"\x80", 3, {"peer_id": b"x"}])
def test_non_records_are_rejected(body: Any) -> None:
    assert ContributionRecord.from_dict(body) is None

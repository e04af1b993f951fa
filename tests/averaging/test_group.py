"""The group and join messages on the wire: round trips, hashes, and every check on receipt."""

from __future__ import annotations

import msgpack
import pytest

from kit.averaging.declarations import Declaration, MemberInfo, Refusal
from kit.averaging.group import (
    GroupInfo,
    decode_join_request,
    decode_leader_message,
    encode_answer,
    encode_begin,
    encode_join_request,
    encode_release,
    schema_hash,
)
from kit.errors import GroupMismatch, MalformedFrame
from kit.p2p.identity import PeerID

SCHEMA = schema_hash([((10, 3), "float32", 4096)])


def pid(n: int) -> PeerID:
    return PeerID(bytes([n]) * 32)


def members() -> list[MemberInfo]:
    return [
        MemberInfo(pid(1), False, False, 2.0, 10.0, ("memory://1",)),
        MemberInfo(pid(2), True, False, 1.0, None, ()),
        MemberInfo(pid(3), False, True, 0.0, 5.0, ("memory://3", "memory://3b")),
    ]


def group() -> GroupInfo:
    return GroupInfo.assemble(b"g" * 16, SCHEMA, members(), [20, 0, 10])


def receive(body: object, me: MemberInfo | None = None, **kwargs: object) -> GroupInfo:
    options: dict = {"leader": pid(1), "me": me or members()[1], "schema": SCHEMA, "total_size": 30}
    options.update(kwargs)
    return GroupInfo.from_wire(body, **options)


def test_schema_hash_covers_shape_dtype_and_chunking() -> None:
    assert schema_hash([((10, 3), "float32", 4096)]) == SCHEMA
    assert schema_hash([((3, 10), "float32", 4096)]) != SCHEMA
    assert schema_hash([((10, 3), "float16", 4096)]) != SCHEMA
    assert schema_hash([((10, 3), "float32", 2048)]) != SCHEMA


def test_group_round_trips_and_every_member_computes_the_same_hash() -> None:
    sent = group()
    wire = msgpack.unpackb(msgpack.packb(sent.to_wire(), use_bin_type=True), raw=False)
    for me in members():
        received = receive(wire, me)
        assert received == sent and received.hash == sent.hash
    assert sent.weights == (2.0, 1.0, 0.0) and sent.senders == (0, 1)
    assert sent.index(pid(3)) == 2 and sent.index(pid(9)) is None and len(sent) == 3
    other = GroupInfo.assemble(b"h" * 16, SCHEMA, members(), [20, 0, 10])
    assert other.hash != sent.hash  # another round: another hash
    scaled = GroupInfo.assemble(b"g" * 16, SCHEMA, members(), [20, 0, 10], chunk_scale=4)
    assert receive(scaled.to_wire()).chunk_scale == 4 and scaled.hash != sent.hash


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"schema_hash": b"x" * 20}, "another tensor schema"),
        ({"group_id": b"short"}, "group id"),
        ({"part_sizes": [20, 0, 11]}, "summing to 31"),
        ({"part_sizes": [20, 5, 5]}, "member 1 aggregating 5"),
        ({"weights": [2.0, 0.0, 0.0]}, "member 1 with weight 0.0"),
        ({"weights": [2.0, 1.0, 1.0]}, "member 2 with weight 1.0"),
        ({"weights": [2.0, float("nan"), 0.0]}, "weight nan"),
        ({"client_mode": [False, False, False]}, "role misdescribed"),
        ({"peers": [pid(1).to_bytes(), pid(9).to_bytes(), pid(3).to_bytes()]}, "no place"),
        ({"peers": [pid(3).to_bytes(), pid(2).to_bytes(), pid(1).to_bytes()]}, "not its first"),
        ({"peers": [pid(1).to_bytes()] * 3}, "duplicates"),
        ({"weights": [1.0]}, "different lengths"),
        ({"chunk_scale": 0}, "chunks scaled by 0"),
        ({"chunk_scale": 64}, "chunks scaled by 64"),
        ({"chunk_scale": True}, "chunks scaled by -1"),
    ],
)
def test_received_groups_are_checked(change: dict, problem: str) -> None:
    body = {**group().to_wire(), **change}
    with pytest.raises(GroupMismatch, match=problem):
        receive(body)


@pytest.mark.parametrize(
    "body", [None, [], {"peers": [b"short"]}, {**group().to_wire(), "client_mode": [1, 0, 0]}]
)
def test_malformed_groups_are_rejected(body: object) -> None:
    with pytest.raises(GroupMismatch):
        receive(body)


def test_join_request_round_trip_and_checks() -> None:
    me = members()[2]
    raw = encode_join_request("run_grads", "run_grads.0b", SCHEMA, me)
    prefix, key, schema, decoded = decode_join_request(raw, pid(3))
    assert (prefix, key, schema, decoded) == ("run_grads", "run_grads.0b", SCHEMA, me)
    # The caller's id comes from the authenticated stream, never from the message.
    assert decode_join_request(raw, pid(7))[3].peer_id == pid(7)
    for field, value in [
        ("weight", -1.0),
        ("weight", float("inf")),
        ("bandwidth", -3.0),
        ("addresses", ["x" * 5000]),
        ("auxiliary", "yes"),
    ]:
        body = msgpack.unpackb(raw, raw=False)
        body[field] = value
        with pytest.raises(MalformedFrame):
            decode_join_request(msgpack.packb(body, use_bin_type=True), pid(3))
    body = msgpack.unpackb(raw, raw=False)
    body["client_mode"] = True  # an auxiliary client cannot aggregate anything
    with pytest.raises(MalformedFrame):
        decode_join_request(msgpack.packb(body, use_bin_type=True), pid(3))


def test_leader_messages() -> None:
    suggested = Declaration(pid(4), 123.5, ("memory://4",))
    assert decode_leader_message(encode_answer(None)) == ("accepted", None, None)
    code, refusal, _ = decode_leader_message(encode_answer(Refusal("following", suggested)))
    assert code == "refused" and refusal == Refusal("following", suggested)
    code, refusal, _ = decode_leader_message(encode_release(None))
    assert code == "released" and refusal == Refusal("released", None)
    # A leader that keeps leading points a follower of another chunk to that chunk's leader.
    code, refusal, _ = decode_leader_message(encode_release(suggested, "misplaced"))
    assert code == "released" and refusal == Refusal("misplaced", suggested)
    code, _, body = decode_leader_message(encode_begin(group()))
    assert code == "begin" and receive(body) == group()
    with pytest.raises(MalformedFrame):
        decode_leader_message(msgpack.packb({"code": "surprise"}))
    bad = msgpack.packb({"code": "refused", "reason": "full", "suggested": {"peer_id": b"x"}})
    assert decode_leader_message(bad)[1] == Refusal("full", None)  # bad suggestion: ignored

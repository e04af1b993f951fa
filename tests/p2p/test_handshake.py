"""The pure handshake: mutual proof of key possession, refusals with a reason, no replays."""

from __future__ import annotations

import pytest

from kit.errors import BadSignature, HandshakeRefused, MalformedFrame
from kit.p2p import wire
from kit.p2p.handshake import DialerHandshake, HandshakeSettings, ListenerHandshake
from kit.p2p.identity import Identity
from kit.p2p.wire import FrameType


def frame(data: bytes) -> wire.Frame:
    return wire.decode_frame(data, 0)


def run(dialer: DialerHandshake, listener: ListenerHandshake) -> tuple[object, object]:
    remote_dialer, listener_hello = listener.receive_hello(frame(dialer.hello()))
    remote_listener, auth = dialer.receive_hello(frame(listener_hello))
    dialer.receive_welcome(frame(listener.receive_auth(frame(auth))))
    return remote_dialer, remote_listener


def test_both_sides_learn_the_verified_identity() -> None:
    a, b = Identity.generate(), Identity.generate()
    settings = HandshakeSettings(run_id="r", credentials=b"token", features=("relay",))
    remote_a, remote_b = run(
        DialerHandshake(a, settings, b.peer_id), ListenerHandshake(b, settings)
    )
    assert remote_a.peer_id == a.peer_id and remote_a.credentials == b"token"  # type: ignore[attr-defined]
    assert remote_b.peer_id == b.peer_id and remote_b.features == ("relay",)  # type: ignore[attr-defined]


def test_other_run_is_refused_with_help() -> None:
    a, b = Identity.generate(), Identity.generate()
    dialer = DialerHandshake(a, HandshakeSettings(run_id="bengali"))
    with pytest.raises(HandshakeRefused) as info:
        ListenerHandshake(b, HandshakeSettings(run_id="dalle")).receive_hello(frame(dialer.hello()))
    assert info.value.reason == "wrong_run" and "help:" in info.value.message


def test_other_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Identity.generate(), Identity.generate()
    monkeypatch.setattr(wire, "PROTOCOL_VERSION", 2)
    hello = DialerHandshake(a, HandshakeSettings(run_id="r")).hello()
    monkeypatch.setattr(wire, "PROTOCOL_VERSION", 1)
    with pytest.raises(HandshakeRefused) as info:
        ListenerHandshake(b, HandshakeSettings(run_id="r")).receive_hello(frame(hello))
    assert info.value.reason == "version_mismatch" and "upgrade kit" in info.value.message


def test_config_hash_mismatch_is_refused() -> None:
    a, b = Identity.generate(), Identity.generate()
    dialer = DialerHandshake(a, HandshakeSettings(run_id="r", config_hash="aaa"))
    with pytest.raises(HandshakeRefused, match="config"):
        ListenerHandshake(b, HandshakeSettings(run_id="r", config_hash="bbb")).receive_hello(
            frame(dialer.hello())
        )


def test_wrong_peer_answering_is_refused() -> None:
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    dialer = DialerHandshake(a, HandshakeSettings(run_id="r"), expected_peer=c.peer_id)
    _, hello = ListenerHandshake(b, HandshakeSettings(run_id="r")).receive_hello(
        frame(dialer.hello())
    )
    with pytest.raises(HandshakeRefused) as info:
        dialer.receive_hello(frame(hello))
    assert info.value.reason == "identity_mismatch"


def test_listener_cannot_claim_another_key() -> None:
    """A listener that signs with another key than the one in its hello is caught."""
    a, b, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    settings = HandshakeSettings(run_id="r")
    dialer = DialerHandshake(a, settings)
    listener = ListenerHandshake(b, settings)
    listener._identity = mallory  # signs with mallory's key but its hello carries...
    _, hello = listener.receive_hello(frame(dialer.hello()))
    body = wire.unpackb(frame(hello).payload, "x")
    inner = wire.unpackb(body["body"], "x")
    inner["pk"] = b.public_key  # ...b's public key
    forged = wire.encode_control(
        FrameType.HELLO, 0, {"body": wire.packb(inner), "sig": body["sig"]}
    )
    with pytest.raises(BadSignature):
        dialer.receive_hello(frame(forged))


def test_replayed_auth_is_rejected() -> None:
    """An AUTH recorded from one handshake does not open another (fresh listener nonce)."""
    a, b = Identity.generate(), Identity.generate()
    settings = HandshakeSettings(run_id="r")
    dialer = DialerHandshake(a, settings)
    first = ListenerHandshake(b, settings)
    _, hello = first.receive_hello(frame(dialer.hello()))
    _, auth = dialer.receive_hello(frame(hello))
    second = ListenerHandshake(b, settings)
    second.receive_hello(frame(dialer.hello()))  # the attacker replays the dialer's hello...
    with pytest.raises(BadSignature):
        second.receive_auth(frame(auth))  # ...and its AUTH


def test_refusal_from_remote_surfaces_as_handshake_refused() -> None:
    from kit.p2p.handshake import refusal_frame

    dialer = DialerHandshake(Identity.generate(), HandshakeSettings(run_id="r"))
    refusal = refusal_frame(HandshakeRefused("unauthorized", "not on the allowlist"))
    with pytest.raises(HandshakeRefused, match="allowlist"):
        dialer.receive_hello(frame(refusal))


def test_malformed_hello() -> None:
    listener = ListenerHandshake(Identity.generate(), HandshakeSettings(run_id="r"))
    with pytest.raises(MalformedFrame):
        listener.receive_hello(frame(wire.encode_control(FrameType.HELLO, 0, {"v": 1})))
    with pytest.raises(MalformedFrame):
        listener.receive_auth(frame(wire.encode_control(FrameType.AUTH, 0, {"sig": b""})))


def test_session_keys_match_across_sides_and_differ_per_connection() -> None:
    a, b = Identity.generate(), Identity.generate()
    settings = HandshakeSettings(run_id="r", frame_auth=True)
    dialer, listener = DialerHandshake(a, settings), ListenerHandshake(b, settings)
    remote_dialer, _ = run(dialer, listener)
    assert remote_dialer.frame_auth  # type: ignore[attr-defined]
    assert dialer.session_keys is not None and listener.session_keys is not None
    assert dialer.session_keys.send == listener.session_keys.receive
    assert dialer.session_keys.receive == listener.session_keys.send
    assert dialer.session_keys.send != dialer.session_keys.receive
    again = DialerHandshake(a, settings)
    run(again, ListenerHandshake(b, settings))
    assert again.session_keys != dialer.session_keys  # fresh ephemeral keys every connection

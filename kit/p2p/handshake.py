"""The connection handshake, as a pure core: hellos in, frames and a verified remote identity out.

Three messages and an acknowledgement (1.5 round trips before the dialer may send streams)::

    dialer                                             listener
      HELLO  {v, run, cfg, pk, nonce_d, creds, ...}  ──►  checks version, run id, config hash
             ◄──  HELLO {body: {v, run, cfg, pk, nonce_l, ...}, sig_l}
      checks the same, and sig_l = Sign_l("kit-p2p listener" ‖ H(dialer hello) ‖ body)
      AUTH   {sig_d = Sign_d("kit-p2p dialer" ‖ H(dialer hello) ‖ H(listener hello))}  ──►
             ◄──  WELCOME                                checks sig_d

Each side proves possession of the private key behind its PeerID by signing a transcript that
contains the other side's fresh nonce, so a recorded handshake cannot be replayed and nobody
can claim a PeerID without its key. The authorizer hook (``kit.p2p.peer.Authorizer``) sees the
verified remote identity and its credentials between these steps; the driver calls it.

Each hello also carries a fresh X25519 key. Both sides derive per-direction session keys from
the exchange, salted with the transcript (HKDF-SHA256); when either side asks for it
(``frame_auth``, private runs), every later frame carries a MAC under those keys
(``kit.p2p.frame_auth``), so a frame modified or injected on the path is rejected.

A refusal (another protocol version, another run, another run config, a failed authorization)
travels as a GOAWAY frame with a :class:`~kit.p2p.wire.Refusal` code and a message that says
what to do, and surfaces as :class:`~kit.errors.HandshakeRefused` on both sides.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kit.errors import BadSignature, HandshakeRefused, MalformedFrame
from kit.p2p import wire
from kit.p2p.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, Identity, PeerID, verify_signature
from kit.p2p.wire import Frame, FrameType, Refusal

NONCE_SIZE = 32
MAX_CREDENTIALS = 16 * 1024
_LISTENER_CONTEXT = b"kit-p2p listener\0"
_DIALER_CONTEXT = b"kit-p2p dialer\0"

# Accepted ranges for the flow-control settings a peer announces (a peer announcing values
# outside them is refused as malformed: tiny windows would make us send millions of frames).
WINDOW_RANGE = (64 * 1024, 1024**3)
FRAME_RANGE = (16 * 1024, 16 * 1024**2)


@dataclass(frozen=True)
class HandshakeSettings:
    """What this side announces in its hello."""

    run_id: str  # peers of another run are refused
    config_hash: str = ""  # hash of the run config; "" = do not check
    credentials: bytes = b""  # from the authorizer (e.g. a signed access token)
    features: tuple[str, ...] = ()  # e.g. ("relay",) when this peer relays for others
    receive_window: int = 8 * 1024**2  # per-stream receive window (bytes)
    max_frame: int = 4 * 1024**2 + 16 * 1024  # largest DATA payload this side accepts (bytes)
    frame_auth: bool = False  # require a MAC on every frame after the handshake (private runs)


@dataclass(frozen=True)
class RemoteHello:
    """The remote side's verified identity and settings."""

    peer_id: PeerID
    public_key: bytes
    version: int
    run_id: str
    config_hash: str
    credentials: bytes
    features: tuple[str, ...]
    receive_window: int
    max_frame: int
    frame_auth: bool  # the remote side asks for authenticated frames
    ephemeral_key: bytes  # its X25519 key for this connection only


@dataclass(frozen=True)
class SessionKeys:
    """Per-connection keys derived from the handshake (ephemeral X25519 + HKDF over the transcript)."""

    send: bytes  # authenticates the frames this side sends
    receive: bytes  # authenticates the frames the remote side sends


_HELLO_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "run": str,
    "cfg": str,
    "pk": bytes,
    "nonce": bytes,
    "creds": bytes,
    "features": list,
    "window": int,
    "max_frame": int,
    "eph": bytes,
    "fauth": bool,
}


def _hello_body(
    identity: Identity, settings: HandshakeSettings, nonce: bytes, ephemeral: X25519PrivateKey
) -> dict[str, object]:
    return {
        "eph": ephemeral.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        ),
        "fauth": settings.frame_auth,
        "v": wire.PROTOCOL_VERSION,
        "run": settings.run_id,
        "cfg": settings.config_hash,
        "pk": identity.public_key,
        "nonce": nonce,
        "creds": settings.credentials,
        "features": list(settings.features),
        "window": settings.receive_window,
        "max_frame": settings.max_frame,
    }


def _parse_hello(
    payload: bytes | memoryview, settings: HandshakeSettings, what: str
) -> RemoteHello:
    body = wire.decode_map(payload, what, _HELLO_SCHEMA)
    if body["v"] != wire.PROTOCOL_VERSION:
        local, remote = (
            ("listening", "dialing") if what.startswith("dialer") else ("dialing", "listening")
        )
        older = local if body["v"] > wire.PROTOCOL_VERSION else remote
        raise HandshakeRefused(
            Refusal.VERSION.value,
            f"kit protocol mismatch: the {local} peer speaks version {wire.PROTOCOL_VERSION}, the "
            f"{remote} peer version {body['v']} - help: upgrade kit on the {older} peer "
            "(pip install -U kit-collab)",
        )
    if body["run"] != settings.run_id:
        raise HandshakeRefused(
            Refusal.RUN_ID.value,
            f"this peer is in run {settings.run_id!r}, the remote peer in run {body['run']!r} - "
            "help: use the run id (and initial peers) that the organizer published",
        )
    if body["cfg"] and settings.config_hash and body["cfg"] != settings.config_hash:
        raise HandshakeRefused(
            Refusal.CONFIG.value,
            f"run config {settings.config_hash[:12]} here, {body['cfg'][:12]} there - help: fetch the "
            "current run config from the coordinator and restart",
        )
    if (
        len(body["pk"]) != PUBLIC_KEY_SIZE
        or len(body["nonce"]) != NONCE_SIZE
        or len(body["eph"]) != 32
    ):
        raise MalformedFrame(f"{what}: bad public key or nonce size")
    if len(body["creds"]) > MAX_CREDENTIALS:
        raise MalformedFrame(f"{what}: credentials of {len(body['creds'])} bytes")
    features = body["features"]
    if len(features) > 32 or not all(isinstance(f, str) and len(f) <= 64 for f in features):
        raise MalformedFrame(f"{what}: bad feature list")
    for key, (low, high) in (("window", WINDOW_RANGE), ("max_frame", FRAME_RANGE)):
        if not low <= body[key] <= high:
            raise MalformedFrame(f"{what}: {key}={body[key]} outside [{low}, {high}]")
    return RemoteHello(
        peer_id=PeerID.from_public_key(body["pk"]),
        public_key=body["pk"],
        version=body["v"],
        run_id=body["run"],
        config_hash=body["cfg"],
        credentials=body["creds"],
        features=tuple(features),
        receive_window=body["window"],
        max_frame=body["max_frame"],
        frame_auth=body["fauth"],
        ephemeral_key=body["eph"],
    )


def _expect(frame: Frame, frame_type: FrameType) -> None:
    if frame.type is FrameType.GOAWAY:
        code, message = wire.decode_reason(frame.payload, "GOAWAY")
        raise HandshakeRefused(code, f"refused by the remote peer: {message}")
    if frame.type is not frame_type:
        raise MalformedFrame(
            f"expected {frame_type.name} during the handshake, got {frame.type.name}"
        )


def _session_keys(
    ephemeral: X25519PrivateKey, remote_ephemeral: bytes, transcript: bytes, *, dialer: bool
) -> SessionKeys:
    try:
        shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(remote_ephemeral))
    except ValueError:
        raise MalformedFrame("invalid ephemeral key in HELLO") from None
    material = HKDF(
        algorithm=hashes.SHA256(), length=64, salt=transcript, info=b"kit-p2p/1 frame keys"
    ).derive(shared)
    dialer_key, listener_key = material[:32], material[32:]
    return (
        SessionKeys(dialer_key, listener_key) if dialer else SessionKeys(listener_key, dialer_key)
    )


def refusal_frame(error: HandshakeRefused) -> bytes:
    """The GOAWAY frame that tells the remote side why it was refused."""
    return wire.encode_control(
        FrameType.GOAWAY, 0, {"code": error.reason, "message": error.message}
    )


class DialerHandshake:
    """The dialing side: ``hello()``, then ``receive_hello(frame)``, then ``receive_welcome(frame)``."""

    def __init__(
        self, identity: Identity, settings: HandshakeSettings, expected_peer: PeerID | None = None
    ) -> None:
        self._identity = identity
        self._settings = settings
        self._expected_peer = expected_peer
        self._ephemeral = X25519PrivateKey.generate()
        self._hello = wire.packb(
            _hello_body(identity, settings, os.urandom(NONCE_SIZE), self._ephemeral)
        )
        self.session_keys: SessionKeys | None = None  # set once the listener's hello verified

    def hello(self) -> bytes:
        return wire.encode_frame(FrameType.HELLO, 0, self._hello)

    def receive_hello(self, frame: Frame) -> tuple[RemoteHello, bytes]:
        """Verify the listener's hello; returns it and the AUTH frame to send."""
        _expect(frame, FrameType.HELLO)
        envelope = wire.decode_map(frame.payload, "listener HELLO", {"body": bytes, "sig": bytes})
        body, signature = envelope["body"], envelope["sig"]
        remote = _parse_hello(body, self._settings, "listener HELLO")
        if self._expected_peer is not None and remote.peer_id != self._expected_peer:
            raise HandshakeRefused(
                Refusal.IDENTITY.value,
                f"dialed {self._expected_peer} but {remote.peer_id} answered - help: the address is "
                "stale or points to another peer; look the peer up again",
            )
        signed = _LISTENER_CONTEXT + hashlib.sha256(self._hello).digest() + body
        if len(signature) != SIGNATURE_SIZE or not verify_signature(
            remote.public_key, signature, signed
        ):
            raise BadSignature("the listener's handshake signature does not verify")
        transcript = (
            hashlib.sha256(self._hello).digest() + hashlib.sha256(bytes(frame.payload)).digest()
        )
        self.session_keys = _session_keys(
            self._ephemeral, remote.ephemeral_key, transcript, dialer=True
        )
        auth = wire.encode_control(
            FrameType.AUTH, 0, {"sig": self._identity.sign(_DIALER_CONTEXT + transcript)}
        )
        return remote, auth

    def receive_welcome(self, frame: Frame) -> None:
        _expect(frame, FrameType.WELCOME)


class ListenerHandshake:
    """The listening side: ``receive_hello(frame)``, then ``receive_auth(frame)``."""

    def __init__(self, identity: Identity, settings: HandshakeSettings) -> None:
        self._identity = identity
        self._settings = settings
        self._dialer_hello = b""
        self._own_hello = b""
        self._remote: RemoteHello | None = None
        self._ephemeral = X25519PrivateKey.generate()
        self.session_keys: SessionKeys | None = None  # set once the dialer's AUTH verified

    def receive_hello(self, frame: Frame) -> tuple[RemoteHello, bytes]:
        """Check the dialer's hello; returns it and this side's signed HELLO frame."""
        _expect(frame, FrameType.HELLO)
        self._dialer_hello = bytes(frame.payload)
        self._remote = _parse_hello(self._dialer_hello, self._settings, "dialer HELLO")
        body = wire.packb(
            _hello_body(self._identity, self._settings, os.urandom(NONCE_SIZE), self._ephemeral)
        )
        signature = self._identity.sign(
            _LISTENER_CONTEXT + hashlib.sha256(self._dialer_hello).digest() + body
        )
        self._own_hello = wire.packb({"body": body, "sig": signature})
        return self._remote, wire.encode_frame(FrameType.HELLO, 0, self._own_hello)

    def receive_auth(self, frame: Frame) -> bytes:
        """Verify the dialer's proof of key possession; returns the WELCOME frame."""
        if self._remote is None:
            raise MalformedFrame("AUTH before HELLO")
        _expect(frame, FrameType.AUTH)
        signature = wire.decode_map(frame.payload, "AUTH", {"sig": bytes})["sig"]
        transcript = (
            hashlib.sha256(self._dialer_hello).digest() + hashlib.sha256(self._own_hello).digest()
        )
        if not verify_signature(self._remote.public_key, signature, _DIALER_CONTEXT + transcript):
            raise BadSignature("the dialer's handshake signature does not verify")
        self.session_keys = _session_keys(
            self._ephemeral, self._remote.ephemeral_key, transcript, dialer=False
        )
        return wire.encode_frame(FrameType.WELCOME, 0)

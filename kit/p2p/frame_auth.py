"""Authenticated frames: a 16-byte tag on every frame of an established connection (private runs).

After the handshake, both sides hold per-direction keys (``kit.p2p.handshake.SessionKeys``). With
frame authentication on, each websocket message is ``frame ‖ tag`` where ``tag`` is AES-GCM's
GMAC over the frame with the frame's sequence number as the nonce. The receiver expects the
sequence numbers in order, so a frame that was modified, injected, replayed, reordered or dropped
on the path fails verification, and the connection is dropped with ``FrameAuthenticationFailed``.
The keys come from an ephemeral X25519 exchange bound to both peers' signed hellos, so a relay
(or anyone on the path) cannot compute valid tags.

Why GMAC: it runs at 17-27 GB/s here (HMAC-SHA256: 1.4 GB/s), so it costs tensor traffic nothing
measurable. Frames are authenticated, not encrypted: use wss:// where confidentiality matters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kit.errors import FrameAuthenticationFailed
from kit.p2p.connection import Channel
from kit.p2p.handshake import SessionKeys
from kit.p2p.stream import Message, message_parts

TAG_SIZE = 16


class FrameAuthenticator:
    """Pure tagging and verification with per-direction sequence numbers."""

    def __init__(self, keys: SessionKeys) -> None:
        self._send_key = keys.send
        self._receive = AESGCM(keys.receive)
        self._send_sequence = 0
        self._receive_sequence = 0

    def tag(self, parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
        """The tag of the next frame to send, given as parts (GMAC over them, no joining copy)."""
        nonce = self._send_sequence.to_bytes(12, "big")
        self._send_sequence += 1
        encryptor = Cipher(algorithms.AES(self._send_key), modes.GCM(nonce)).encryptor()
        for part in parts:
            encryptor.authenticate_additional_data(part)
        encryptor.finalize()
        return bytes(encryptor.tag)

    def seal(self, frame: bytes) -> bytes:
        return frame + self.tag((frame,))

    def open(self, message: bytes) -> bytes:
        if len(message) < TAG_SIZE:
            raise FrameAuthenticationFailed("frame shorter than its authentication tag")
        view = memoryview(message)
        frame, tag = view[:-TAG_SIZE], view[-TAG_SIZE:]
        nonce = self._receive_sequence.to_bytes(12, "big")
        try:
            self._receive.decrypt(nonce, bytes(tag), frame)
        except InvalidTag:
            raise FrameAuthenticationFailed(
                f"frame {self._receive_sequence} failed authentication (modified, injected or replayed on the path)"
            ) from None
        self._receive_sequence += 1
        return frame  # type: ignore[return-value]  # a memoryview: kit.p2p.wire decodes bytes-likes


class AuthenticatedChannel:
    """Wraps a channel so that every message carries and is checked for its tag."""

    def __init__(self, channel: Channel, keys: SessionKeys) -> None:
        self._channel = channel
        self._authenticator = FrameAuthenticator(keys)
        self.remote_address = channel.remote_address
        self.remote_host = getattr(channel, "remote_host", None)

    async def send(self, data: Message) -> None:
        parts = message_parts(data)
        await self._channel.send((*parts, self._authenticator.tag(parts)))

    async def recv(self) -> bytes:
        return self._authenticator.open(await self._channel.recv())

    def send_now(self, data: Message) -> bool:
        """Send at once if the inner channel can (``kit.p2p.connection.Connection.enqueue``);
        the tag is made only then, so tags stay in the order frames go out."""
        can_send_now = getattr(self._channel, "can_send_now", None)
        if can_send_now is None or not can_send_now():
            return False
        parts = message_parts(data)
        return bool(self._channel.send_now((*parts, self._authenticator.tag(parts))))  # type: ignore[attr-defined]

    def set_receiver(self, receiver: Callable[[bytes | bytearray | memoryview], None]) -> bool:
        """Have the inner channel hand each message over checked, as it arrives (see
        ``FastWebSocketChannel.set_receiver``); False when it cannot (use ``recv``)."""
        set_receiver = getattr(self._channel, "set_receiver", None)
        if set_receiver is None:
            return False
        return bool(set_receiver(lambda raw: receiver(self._authenticator.open(raw))))

    async def close(self) -> None:
        await self._channel.close()

    @property
    def inner(self) -> Channel:
        return self._channel

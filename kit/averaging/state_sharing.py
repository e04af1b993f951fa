"""``DecentralizedAverager``'s state sharing (hivemind's ``load_state_from_peers``), over kit.p2p.

Holds ``StateSharing`` (a donor: it declares this peer under ``{prefix}.all_averagers`` in the
DHT with its ``state_sharing_priority``, and serves what ``get_current_state()`` returns on
``kit/averaging/state/1``), ``load_state`` (a downloader: it asks the declared donors, highest
priority first, and returns the first complete state) and the torch side of tensors on the wire
(``tensor_header``, ``tensor_bytes``, ``tensor_from_bytes``; kit.optim's snapshots use them too).
It does not hold the averager (``kit.averaging.averager``) nor kit.Optimizer's own state
download (``kit.optim.state``: several donors in parallel, digest agreed by a majority).

On the wire nothing is unpickled (hivemind pickles nothing here either, but its metadata
serializer accepts custom types): the downloader sends ``{prefix}``; the donor answers
``{code: "declined"}`` (sharing switched off, or no such averager) or ``{code: "state",
metadata, tensors: [headers], sha256}`` where ``metadata`` must be plain msgpack data, then each
tensor as a header and raw bytes (``kit.p2p.tensors``). The downloader checks each header against
the announced one and its limits before allocating, and the SHA-256 over all bytes at the end:
a donor that sends anything else is skipped for the next one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kit.averaging.allreduce import cancel_and_wait
from kit.dht.node import DHTNode, get_dht_time
from kit.errors import (
    ConfigError,
    InvalidTensor,
    KitError,
    KitTimeout,
    MalformedFrame,
    PeerError,
    RemoteProtocolError,
)
from kit.p2p import wire
from kit.p2p.api import PeerAPI, StreamAPI
from kit.p2p.identity import PeerID
from kit.p2p.tensors import DTYPE_SIZES, TensorHeader, TensorLimits, receive_tensor, send_tensor

logger = logging.getLogger(__name__)

PROTOCOL = "kit/averaging/state/1"
MAX_STATE_HEADER = 16 * 1024**2  # bytes of the metadata and tensor headers
MAX_STATE_TENSORS = 100_000  # tensors of one state
_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES}
_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}

CurrentState = tuple[Any, Sequence[torch.Tensor]]  # (msgpack-able metadata, tensors)


# --- torch tensors <-> kit.p2p.tensors ---------------------------------------------------------


def tensor_header(tensor: torch.Tensor) -> TensorHeader:
    """The wire header of ``tensor``.

    Raises:
        KitError: a dtype that cannot travel (complex, quantized...).
    """
    if tensor.dtype not in _DTYPE_NAMES:
        raise KitError(f"cannot share tensors of dtype {tensor.dtype}")
    return TensorHeader(_DTYPE_NAMES[tensor.dtype], tuple(tensor.shape))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` (a CPU copy if it is elsewhere or not contiguous)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def tensor_from_bytes(header: TensorHeader, buffer: bytearray | memoryview) -> torch.Tensor:
    """A new tensor of ``header``'s dtype and shape from received bytes (already validated)."""
    dtype = _TORCH_DTYPES[header.dtype]
    if header.numel == 0:
        return torch.empty(header.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(header.shape).clone()


def empty_tensor(header: TensorHeader) -> torch.Tensor:
    """A tensor of ``header`` (validated) to receive its bytes into (through ``tensor_bytes``):
    no copy afterwards and no zero-filling before (``receive_tensor(allocate=...)``)."""
    return torch.empty(header.shape, dtype=_TORCH_DTYPES[header.dtype])


# --- the donor --------------------------------------------------------------------------------


class _Router:
    """Serves the state protocol of one peer for every sharing averager on it (by prefix)."""

    _routers: weakref.WeakKeyDictionary[Any, _Router] = weakref.WeakKeyDictionary()

    def __init__(self, peer: PeerAPI) -> None:
        self.donors: dict[str, StateSharing] = {}
        peer.add_stream_handler(PROTOCOL, self._serve)

    @classmethod
    def of(cls, peer: PeerAPI) -> _Router:
        router = cls._routers.get(peer)
        if router is None:
            router = cls._routers[peer] = cls(peer)
        return router

    async def _serve(self, stream: StreamAPI) -> None:
        raw = await stream.receive_message(max_size=1024, timeout=10.0)
        if raw is None:
            return
        request = wire.decode_map(raw, "state request", {"prefix": str})
        donor = self.donors.get(request["prefix"])
        if donor is None:
            await stream.send_message(wire.packb({"code": "declined"}), timeout=5.0)
            return
        await donor.serve(stream)


class StateSharing:
    """One averager's donor side: its DHT declaration and the state it serves.

    Args:
        node: the DHT node (its peer serves the state).
        prefix: the averager's prefix; donors are declared under ``{prefix}.all_averagers``.
        get_state: returns ``(metadata, tensors)`` or ``(metadata, tensors, infos)``; called in
            a worker thread (it may take the averager's tensor lock).
        allow: serve the state now; priority: donors with higher priority are asked first.
        declare_period: seconds a declaration lives (renewed at half of it).
        answer_timeout: how long a downloader waits for each message (and ``get_state``).
    """

    def __init__(
        self,
        node: DHTNode,
        prefix: str,
        get_state: Callable[[], Sequence[Any]],
        *,
        allow: bool,
        priority: float,
        declare_period: float,
        answer_timeout: float,
    ) -> None:
        self.node, self.peer, self.prefix = node, node.peer, prefix
        self.key = f"{prefix}.all_averagers"
        self.get_state = get_state
        self.allow, self.priority = allow, priority
        self.declare_period, self.answer_timeout = declare_period, answer_timeout
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._router: _Router | None = None

    def start(self) -> None:
        """Serve and declare (on the runtime loop)."""
        self._router = _Router.of(self.peer)
        self._router.donors[self.prefix] = self
        self._task = asyncio.ensure_future(self._declare_periodically())

    async def shutdown(self) -> None:
        if self._router is not None and self._router.donors.get(self.prefix) is self:
            del self._router.donors[self.prefix]
        if self._task is not None:  # cancelled again until it ends (see cancel_and_wait)
            await cancel_and_wait([self._task], 5.0)

    def configure(self, *, allow: bool | None = None, priority: float | None = None) -> None:
        """Change what is declared (from any thread); the DHT is updated at once."""
        if allow is not None:
            self.allow = allow
        if priority is not None:
            self.priority = priority
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._changed.set)

    async def _declare_periodically(self) -> None:
        declared_allow = False
        while True:
            self._changed.clear()
            allow, priority = self.allow, self.priority
            if allow or declared_allow:  # a switch-off is declared too (None: not a donor)
                try:
                    await asyncio.wait_for(
                        self.node.store(
                            self.key,
                            float(priority) if allow else None,
                            get_dht_time() + self.declare_period,
                            subkey=self.peer.peer_id.to_bytes(),
                        ),
                        self.declare_period / 2,
                    )
                    declared_allow = allow
                except (KitError, asyncio.TimeoutError) as e:
                    logger.debug("%s: declaring the state donor failed: %r", self.prefix, e)
            try:
                await asyncio.wait_for(self._changed.wait(), self.declare_period / 2)
            except asyncio.TimeoutError:
                pass

    async def serve(self, stream: StreamAPI) -> None:
        """Send the current state on ``stream`` (or decline)."""
        if not self.allow:
            await stream.send_message(wire.packb({"code": "declined"}), timeout=5.0)
            return
        try:
            state = await asyncio.wait_for(asyncio.to_thread(self.get_state), self.answer_timeout)
            metadata, tensors = _checked_state(state)
            headers = [tensor_header(t) for t in tensors]
            payloads = [tensor_bytes(t) for t in tensors]
            header = wire.packb(
                {
                    "code": "state",
                    "metadata": metadata,
                    "tensors": [h.to_dict() for h in headers],
                    "sha256": _digest(payloads),
                }
            )
        except (KitError, TypeError, ValueError, asyncio.TimeoutError) as e:
            logger.warning("%s: cannot share the state: %s", self.prefix, e)
            await stream.send_message(wire.packb({"code": "declined"}), timeout=5.0)
            return
        timeout = self.answer_timeout
        await stream.send_message(header, timeout=timeout)
        for tensor_head, payload in zip(headers, payloads, strict=True):
            await send_tensor(stream, tensor_head, payload, timeout=timeout)
        await stream.close()


def _checked_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``get_current_state()``'s answer as (metadata, tensors).

    Raises:
        KitError: not (metadata, tensors[, infos]), or metadata that is not plain msgpack data.
    """
    if not isinstance(state, tuple | list) or not 2 <= len(state) <= 3:
        raise ConfigError(
            "get_current_state() must return (metadata, tensors) or (metadata, tensors, infos)"
            " - help: see DecentralizedAverager.get_current_state"
        )
    metadata, tensors = state[0], list(state[1])
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError("get_current_state() returned tensors that are not torch tensors")
    try:
        wire.packb(metadata)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(
            f"the state's metadata is not plain msgpack data ({e}) - help: use dicts, lists, "
            "str, bytes, numbers, None (kit never pickles what peers send)"
        ) from None
    return metadata, tensors


def _digest(payloads: Sequence[memoryview | bytes | bytearray]) -> bytes:
    digest = hashlib.sha256()
    for payload in payloads:
        digest.update(payload)
    return digest.digest()


# --- the downloader -------------------------------------------------------------------------


async def find_donors(node: DHTNode, prefix: str) -> list[PeerID]:
    """Declared donors of ``prefix`` (this peer excluded), highest priority first (ties random)."""
    found = await node.get(f"{prefix}.all_averagers", latest=True)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    ranked: list[tuple[float, float, PeerID]] = []
    for subkey, item in entries.items():
        priority = getattr(item, "value", None)
        if not isinstance(subkey, bytes) or len(subkey) != PeerID.SIZE:
            continue
        if isinstance(priority, bool) or not isinstance(priority, int | float):
            continue  # None: sharing switched off
        if not math.isfinite(priority) or subkey == node.peer_id.to_bytes():
            continue
        ranked.append((float(priority), random.random(), PeerID(subkey)))
    return [peer_id for _, _, peer_id in sorted(ranked, reverse=True)]


async def load_state(
    node: DHTNode,
    prefix: str,
    *,
    answer_timeout: float,
    deadline: float | None = None,
    limits: TensorLimits | None = None,
) -> CurrentState | None:
    """The state of the best donor that serves it: ``(metadata, tensors)``, or None if none does.

    Args:
        answer_timeout: a donor silent this long (per message) is skipped for the next one.
        deadline: loop time after which no donor is asked (None: every donor is tried).
        limits: the largest tensor accepted.
    """
    loop = asyncio.get_running_loop()
    try:
        donors = await asyncio.wait_for(find_donors(node, prefix), answer_timeout)
    except (KitError, asyncio.TimeoutError) as e:
        logger.info("%s: cannot read the donors from the DHT: %r", prefix, e)
        return None
    for donor in donors:
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            break
        try:
            state = await asyncio.wait_for(
                _download(node.peer, donor, prefix, answer_timeout, limits or TensorLimits()),
                left,
            )
        except (PeerError, KitTimeout, asyncio.TimeoutError) as e:
            logger.info("%s: no state from %s: %s", prefix, donor.short(), e)
            continue
        if state is not None:
            logger.info("%s: downloaded the state from %s", prefix, donor.short())
            return state
    return None


async def _download(
    peer: PeerAPI, donor: PeerID, prefix: str, timeout: float, limits: TensorLimits
) -> CurrentState | None:
    stream = await peer.open_stream(donor, PROTOCOL, timeout=timeout)
    try:
        await stream.send_message(wire.packb({"prefix": prefix}), timeout=timeout)
        raw = await stream.receive_message(max_size=MAX_STATE_HEADER, timeout=timeout)
        if raw is None:
            raise RemoteProtocolError("the donor closed the stream")
        header = wire.decode_map(raw, "state header", {"code": str})
        if header["code"] == "declined":
            return None
        described = header.get("tensors")
        digest = header.get("sha256")
        if (
            header["code"] != "state"
            or not isinstance(described, list)
            or not isinstance(digest, bytes)
        ):
            raise MalformedFrame("state header: needs code 'state', tensors and sha256")
        if len(described) > MAX_STATE_TENSORS:
            raise MalformedFrame(f"state header: {len(described)} tensors")
        expected = [TensorHeader.from_dict(d, limits) for d in described]
        tensors, payloads = [], []
        for want in expected:
            received = await receive_tensor(stream, limits=limits, expected=want, timeout=timeout)
            if received is None:
                raise RemoteProtocolError("the donor ended the stream early")
            payloads.append(received[1])
            tensors.append(tensor_from_bytes(*received))
        if _digest(payloads) != digest:
            raise RemoteProtocolError("the state's bytes do not match its SHA-256")
        return header.get("metadata"), tensors
    except InvalidTensor as e:
        raise RemoteProtocolError(f"the donor sent a wrong tensor: {e}") from e
    finally:
        stream.reset()

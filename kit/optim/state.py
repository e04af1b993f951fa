"""Training state on the wire: snapshot, serve, and download it from peers (hot join).

A peer that joins late, or fell behind, downloads parameters, optimizer statistics, scheduler
state and epoch from peers that are up to date. hivemind downloads everything from one donor,
retries forever on failure (#653) and breaks on a donor that leaves mid-way (#504, #169). Here:

* every up-to-date peer keeps a **snapshot** of its state, taken right after each global step
  (so serving never races with training) and advertises it in the DHT (owner-signed:
  ``{run_id}_state_donors``);
* a joiner takes the newest epoch, fetches the metadata (structure, tensor headers, SHA-256
  digest) from up to three donors and keeps the digest most of them agree on (ties broken the
  same way on every peer); donors that are in sync (their last round was full and exact) are
  asked before *drifted* ones (a failed round left them with their own gradient applied);
* it downloads the tensors **in parallel** from those donors, each tensor validated against the
  announced header (dtype, shape, size) before allocation; a donor that fails or disappears costs
  its share being reassigned to another donor, never a hang past ``timeout``;
* the assembled state must match the digest, or it is rejected and nothing is loaded.

Nothing is unpickled: metadata is msgpack, tensors are raw bytes (``kit.p2p.tensors``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from kit.averaging.state_sharing import empty_tensor, tensor_bytes, tensor_header
from kit.dht.node import DHTNode, get_dht_time
from kit.dht.validation import Ed25519SignatureValidator
from kit.errors import (
    InvalidTensor,
    KitError,
    KitTimeout,
    RemoteProtocolError,
    StateDownloadFailed,
    StateNotHeld,
)
from kit.p2p.api import PeerAPI, StreamAPI
from kit.p2p.identity import PeerID
from kit.p2p.tensors import TensorHeader, TensorLimits, receive_tensor, send_tensor

logger = logging.getLogger(__name__)

MAX_META_BYTES = 16 * 1024**2
MAX_DONORS = 3
META_TIMEOUT = (
    5.0  # a donor must send the state's metadata within this (else the next one is asked)
)
META_GRACE = 0.3  # after the first donor answered, wait this long for others to compare digests
_DIGEST_LOCK = threading.Lock()


# --- flattening torch state into (msgpack metadata, tensors) --------------------------------


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace tensors by ``{"__tensor__": index}``; everything else must be plain data."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().clone())
        return {"__tensor__": len(tensors) - 1}
    if isinstance(value, dict):
        return {
            "__dict__": [[_flatten(k, tensors), _flatten(v, tensors)] for k, v in value.items()]
        }
    if isinstance(value, (list, tuple)):
        return {
            "__list__": [_flatten(v, tensors) for v in value],
            "tuple": isinstance(value, tuple),
        }
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise KitError(f"cannot share state values of type {type(value).__name__}")


def _unflatten(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            index = value["__tensor__"]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise RemoteProtocolError("state metadata refers to a missing tensor")
            return tensors[index]
        if "__dict__" in value:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in value["__dict__"]}
        if "__list__" in value:
            items = [_unflatten(v, tensors) for v in value["__list__"]]
            return tuple(items) if value.get("tuple") else items
        raise RemoteProtocolError("malformed state metadata")
    return value


@dataclass
class StateSnapshot:
    """One consistent copy of a peer's training state."""

    epoch: int
    structure: Any  # msgpack-able, tensors replaced by indices
    tensors: list[torch.Tensor]
    digest: str = ""

    @classmethod
    def capture(cls, epoch: int, state: dict[str, Any], *, digest: bool = True) -> StateSnapshot:
        """Copy ``state`` (tensors cloned). ``digest=False`` leaves the SHA-256 to the first
        ``ensure_digest`` call: a training peer snapshots after every global step, and hashing
        the whole state each time would cost it ~0.1 s per 5M parameters that no joiner may need.
        """
        tensors: list[torch.Tensor] = []
        structure = _flatten(state, tensors)
        snapshot = cls(epoch, structure, tensors)
        if digest:
            snapshot.digest = snapshot.compute_digest()
        return snapshot

    def ensure_digest(self) -> str:
        """The digest, computed now if ``capture`` left it out (thread-safe: it runs off the loop)."""
        with _DIGEST_LOCK:
            if not self.digest:
                self.digest = self.compute_digest()
        return self.digest

    def headers(self) -> list[TensorHeader]:
        return [tensor_header(t) for t in self.tensors]

    def compute_digest(self) -> str:
        digest = hashlib.sha256(msgpack.packb([self.epoch, self.structure], use_bin_type=True))
        for tensor in self.tensors:
            digest.update(tensor_bytes(tensor))
        return digest.hexdigest()

    def meta(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "structure": self.structure,
            "headers": [h.to_dict() for h in self.headers()],
            "digest": self.digest,
        }

    def state(self) -> Any:
        return _unflatten(self.structure, self.tensors)


# --- serving ----------------------------------------------------------------------------------


class StateServer:
    """Serves this peer's latest snapshot on ``{prefix}/state/1`` and advertises it in the DHT."""

    def __init__(
        self, peer: PeerAPI, node: DHTNode, prefix: str, identity: Any, *, expiration: float = 60.0
    ):
        self.peer = peer
        self.node = node
        self.protocol = f"kit/{prefix}/state/1"
        self.key = f"{prefix}_state_donors"
        self.expiration = expiration
        self.snapshot: StateSnapshot | None = None
        # The snapshot before the current one, kept while someone may be downloading it: a
        # joiner reads the metadata on one stream and the tensors on others, and with global
        # steps a second apart the donor often publishes in between (every download failed its
        # first try in the churn scenario). Kept only if its digest was asked for, and only
        # one: it costs one more copy of the training state.
        self.previous: StateSnapshot | None = None
        self._validator = Ed25519SignatureValidator(identity)
        node.add_validators([self._validator])
        peer.add_stream_handler(self.protocol, self._serve)

    async def publish(self, snapshot: StateSnapshot, *, drifted: bool = False) -> None:
        """Serve ``snapshot`` and advertise it (``drifted``: it may differ from the others')."""
        old = self.snapshot
        if old is not None and old is not snapshot and old.digest:
            self.previous = old
        self.snapshot = snapshot
        value = {
            "peer_id": self.peer.peer_id.to_bytes(),
            "epoch": snapshot.epoch,
            "drifted": drifted,
            "addresses": self.peer.get_visible_addresses()[:4],
        }
        try:
            await self.node.store(
                self.key,
                value,
                get_dht_time() + self.expiration,
                subkey=self._validator.local_owner,
            )
        except (KitError, KitTimeout) as e:
            logger.debug("could not advertise state: %s", e)

    async def _serve(self, stream: StreamAPI) -> None:
        snapshot = self.snapshot
        if snapshot is not None and not snapshot.digest:
            # hashlib releases the GIL: hashing in a thread keeps the event loop (and training) going
            await asyncio.get_running_loop().run_in_executor(None, snapshot.ensure_digest)
            if self.snapshot is not snapshot:
                # A new one was published while we hashed (epochs can be that short): the
                # downloader asks for this one next, keep it (publish kept only hashed ones).
                self.previous = snapshot
        while (raw := await stream.receive_message(max_size=1024 * 1024, timeout=30.0)) is not None:
            request = msgpack.unpackb(raw, raw=False)
            if snapshot is None:
                raise StateNotHeld("this peer has no state to share yet")
            if request.get("want") == "meta":
                await stream.send_message(
                    msgpack.packb(snapshot.meta(), use_bin_type=True), timeout=30.0
                )
                continue
            indices = request.get("tensors")
            wanted = request.get("digest")
            held = [s for s in (self.snapshot, snapshot, self.previous) if s is not None]
            serving = next((s for s in held if s.digest and s.digest == wanted), None)
            if serving is None or not isinstance(indices, list):
                raise StateNotHeld("requested state is not the one this peer holds (it moved on)")
            for index in indices:
                tensor = serving.tensors[int(index)]
                await send_tensor(stream, tensor_header(tensor), tensor_bytes(tensor), timeout=30.0)


# --- downloading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Donor:
    peer_id: PeerID
    epoch: int
    drifted: bool = False  # its parameters may differ from the collaboration's


async def find_donors(node: DHTNode, peer: PeerAPI, prefix: str) -> list[Donor]:
    """Peers advertising state, newest epoch first (their addresses are added to ``peer``)."""
    result = await node.get(f"{prefix}_state_donors", latest=True)
    donors = []
    if result is not None and isinstance(result.value, dict):
        for entry in result.value.values():
            body: Any = getattr(entry, "value", None)
            try:
                peer_id = PeerID(bytes(body["peer_id"]))
                epoch = int(body["epoch"])
                drifted = bool(body.get("drifted", False))
                addresses = [str(a) for a in body.get("addresses", [])][:4]
            except (KeyError, TypeError, ValueError):
                continue
            if peer_id == peer.peer_id:
                continue
            for address in addresses:
                try:
                    peer.add_address(peer_id, address)
                except ValueError:
                    pass
            donors.append(Donor(peer_id, epoch, drifted))
    return sorted(donors, key=lambda d: (-d.epoch, d.drifted))


async def download_state(
    peer: PeerAPI,
    donors: Sequence[Donor],
    prefix: str,
    *,
    timeout: float,
    limits: TensorLimits | None = None,
) -> StateSnapshot:
    """Download and verify the newest state from ``donors`` (see the module docstring).

    Raises:
        StateDownloadFailed: no donor could provide a state matching the agreed digest in time.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    protocol = f"kit/{prefix}/state/1"
    limits = limits or TensorLimits()
    metas: dict[PeerID, dict[str, Any]] = {}
    for epoch in sorted({d.epoch for d in donors}, reverse=True):
        # The newest state first; if all its donors are gone (their records outlive them for a
        # while), the next newest rather than nothing.
        candidates = [d for d in donors if d.epoch == epoch]
        # In-sync donors hold the collaboration's state; a drifted one only its own: ask it
        # only if no in-sync donor answers.
        for drifted in (False, True):
            group = [d for d in candidates if d.drifted == drifted][: MAX_DONORS * 2]
            if group:
                metas = await _fetch_metas(peer, group, protocol, loop, deadline)
            if metas or _left(loop, deadline) <= 0:
                break
        if metas or _left(loop, deadline) <= 0:
            break
    if not metas:
        raise StateDownloadFailed(
            "no peer could share its state - help: check that other peers are running"
        )
    digests = [m["digest"] for m in metas.values()]
    # The most common digest; on a tie the smallest, so that peers asking the same donors pick
    # the same state (a random pick let two halves of a split collaboration swap states).
    digest = min(set(digests), key=lambda d: (-digests.count(d), d))
    meta = next(m for m in metas.values() if m["digest"] == digest)
    headers = [TensorHeader.from_dict(h, limits) for h in meta["headers"]]
    sources = [p for p, m in metas.items() if m["digest"] == digest]

    async def assemble(donors: list[PeerID]) -> StateSnapshot | None:
        tensors = await _download_tensors(peer, donors, protocol, digest, headers, limits, deadline)
        snapshot = StateSnapshot(int(meta["epoch"]), meta["structure"], tensors)
        if snapshot.compute_digest() != digest:
            return None
        snapshot.digest = digest
        return snapshot

    snapshot = await assemble(sources)
    if snapshot is not None:
        return snapshot
    # Some donor sent well-formed but wrong bytes: find one whose whole state verifies.
    for donor in sources:
        logger.info("state failed its digest; downloading it from %s alone", donor.short())
        try:
            snapshot = await assemble([donor])
        except StateDownloadFailed:
            continue
        if snapshot is not None:
            return snapshot
    raise StateDownloadFailed("no donor's state matched the agreed digest; nothing was loaded")


async def _download_tensors(
    peer: PeerAPI,
    sources: list[PeerID],
    protocol: str,
    digest: str,
    headers: list[TensorHeader],
    limits: TensorLimits,
    deadline: float,
) -> list[torch.Tensor]:
    """Every tensor, in parallel from ``sources``; a failing donor's share goes to the others."""
    loop = asyncio.get_running_loop()
    tensors: list[torch.Tensor | None] = [None] * len(headers)
    pending = list(range(len(headers)))
    failed: set[PeerID] = set()
    while pending:
        usable = [p for p in sources if p not in failed]
        if not usable:
            raise StateDownloadFailed(
                "every donor failed during the download - help: retry in a minute"
            )
        shares: dict[PeerID, list[int]] = {p: [] for p in usable}
        loads = dict.fromkeys(usable, 0)
        for index in sorted(
            pending, key=lambda i: -headers[i].nbytes
        ):  # biggest first, least loaded donor
            donor = min(usable, key=lambda p: loads[p])
            shares[donor].append(index)
            loads[donor] += headers[index].nbytes
        jobs = {
            p: asyncio.ensure_future(
                _fetch_tensors(peer, p, protocol, digest, idx, headers, tensors, limits, deadline)
            )
            for p, idx in shares.items()
            if idx
        }
        try:
            await asyncio.wait(jobs.values(), timeout=max(0.0, _left(loop, deadline)))
        finally:  # cancelled (the joiner shuts down): the jobs are ours to stop
            for job in jobs.values():
                job.cancel()
        for donor, job in jobs.items():
            if not job.done():
                job.cancel()
                failed.add(donor)
            elif job.exception() is not None:
                logger.info(
                    "state donor %s failed: %s; reassigning its share",
                    donor.short(),
                    job.exception(),
                )
                failed.add(donor)
        pending = [i for i in range(len(headers)) if tensors[i] is None]
        if pending and _left(loop, deadline) <= 0:
            raise StateDownloadFailed("state download did not finish in time")
    return [t for t in tensors if t is not None]


def _left(loop: asyncio.AbstractEventLoop, deadline: float) -> float:
    return deadline - loop.time()


async def _fetch_metas(
    peer: PeerAPI,
    candidates: Sequence[Donor],
    protocol: str,
    loop: asyncio.AbstractEventLoop,
    deadline: float,
) -> dict[PeerID, dict[str, Any]]:
    """Ask every candidate at once; keep up to MAX_DONORS answers. A dead donor (its record
    outlives it for up to a minute) costs nothing once a live one answered, instead of a timeout
    per dead donor in turn."""
    timeout = max(0.1, min(META_TIMEOUT, _left(loop, deadline)))
    jobs = {
        asyncio.ensure_future(_fetch_meta(peer, c.peer_id, protocol, timeout)): c.peer_id
        for c in candidates
    }
    metas: dict[PeerID, dict[str, Any]] = {}
    give_up = loop.time() + timeout
    try:
        pending = set(jobs)
        while pending and len(metas) < MAX_DONORS and loop.time() < give_up:
            done, pending = await asyncio.wait(
                pending, timeout=give_up - loop.time(), return_when=asyncio.FIRST_COMPLETED
            )
            for job in done:
                error = job.exception()
                if error is None:
                    metas[jobs[job]] = job.result()
                else:
                    logger.info("state donor %s unavailable: %s", jobs[job].short(), error)
            if metas:
                give_up = min(give_up, loop.time() + META_GRACE)
    finally:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
    return metas


async def _fetch_meta(
    peer: PeerAPI, donor: PeerID, protocol: str, timeout: float
) -> dict[str, Any]:
    stream = await peer.open_stream(donor, protocol, timeout=timeout)
    try:
        await stream.send_message(msgpack.packb({"want": "meta"}), timeout=timeout)
        raw = await stream.receive_message(max_size=MAX_META_BYTES, timeout=timeout)
    finally:
        stream.reset()
    if raw is None:
        raise RemoteProtocolError("donor closed the stream without metadata")
    meta = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if not isinstance(meta, dict) or not {"epoch", "structure", "headers", "digest"} <= set(meta):
        raise RemoteProtocolError("malformed state metadata")
    if not isinstance(meta["headers"], list) or not isinstance(meta["digest"], str):
        raise RemoteProtocolError("malformed state metadata")
    return meta


async def _fetch_tensors(
    peer: PeerAPI,
    donor: PeerID,
    protocol: str,
    digest: str,
    indices: list[int],
    headers: list[TensorHeader],
    out: list[torch.Tensor | None],
    limits: TensorLimits,
    deadline: float,
) -> None:
    loop = asyncio.get_running_loop()
    stream = await peer.open_stream(donor, protocol, timeout=max(0.1, _left(loop, deadline)))
    try:
        await stream.send_message(
            msgpack.packb({"digest": digest, "tensors": indices}), timeout=10.0
        )
        received_into: list[torch.Tensor] = []

        def allocate(header: TensorHeader) -> memoryview:
            received_into.append(empty_tensor(header))  # the bytes land in the tensor itself
            return tensor_bytes(received_into[-1])

        for index in indices:
            received = await receive_tensor(
                stream,
                limits=limits,
                expected=headers[index],
                timeout=max(0.1, min(30.0, _left(loop, deadline))),
                allocate=allocate,
            )
            if received is None:
                raise RemoteProtocolError("donor ended the stream early")
            out[index] = received_into.pop()
    except InvalidTensor as e:
        raise RemoteProtocolError(f"donor sent a wrong tensor: {e}") from e
    finally:
        stream.reset()


__all__ = ["Donor", "StateServer", "StateSnapshot", "download_state", "find_donors"]

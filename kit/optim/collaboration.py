"""What ``kit.Optimizer`` starts to train with its collaboration: the progress tracker, the state
server and the two averagers (gradients, state), built from its arguments.

Holds :func:`start_tracker` / :func:`stop_tracker` (the :class:`~kit.optim.progress.ProgressTracker`
on the DHT's loop, with kit's options overridden by the user's ``tracker_opts``),
:func:`start_state_server` (what late joiners download from, ``kit.optim.state``),
:func:`averaging_options` (the keyword arguments both ``DecentralizedAverager`` get, overridden
by ``averager_opts``) and :func:`build_averagers` (the gradient averager with its
:class:`~kit.optim.rounds.GradientRounds`, none with ``use_local_updates``, and the state
averager). It does not run rounds (``kit.optim.rounds``, ``kit.optim.driver``), nor average
parameters (``kit.optim.state_averaging``), nor hold the public API (``kit.optim.optimizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kit.averaging.averager import DecentralizedAverager
from kit.averaging.compression import (
    CompressionBase,
    CompressionInfo,
    NoCompression,
    TensorRole,
)
from kit.averaging.deadlines import Deadlines
from kit.optim.progress import ProgressTracker
from kit.optim.rounds import GradientRounds
from kit.optim.state import StateServer


@dataclass(frozen=True)
class OptimizerAveragers:
    """What :func:`build_averagers` started; the optimizer shuts them down."""

    grads: DecentralizedAverager | None  # None with use_local_updates (as hivemind's)
    rounds: GradientRounds | None  # one gradient round per epoch, on ``grads``
    state: DecentralizedAverager  # parameters (and statistics, extra tensors)

    def shutdown(self) -> None:
        if self.grads is not None:
            self.grads.shutdown()
        self.state.shutdown()


def start_tracker(
    dht: Any,
    run_id: str,
    target_batch_size: int,
    *,
    client_mode: bool,
    auxiliary: bool,
    performance_ema_alpha: float,
    tracker_opts: dict[str, Any] | None,
    drifted: bool,
) -> ProgressTracker:
    """Start this peer's progress tracker on the DHT's loop (blocks until it runs)."""
    identity = dht.node.peer.identity

    async def track(_: Any, node: Any) -> ProgressTracker:
        options: dict[str, Any] = {
            "identity": identity,
            "client_mode": client_mode,
            "auxiliary": auxiliary,
            "performance_ema_alpha": performance_ema_alpha,
            "measure_reports": False,  # step() measures: several reports come per step
            **(tracker_opts or {}),  # the user's options win over kit's defaults
        }
        tracker = ProgressTracker(node, run_id, target_batch_size, **options)
        tracker.set_drifted(drifted)
        tracker.start()
        return tracker

    tracker: ProgressTracker = dht.run_coroutine(track)
    return tracker


def stop_tracker(dht: Any, tracker: ProgressTracker) -> None:
    """Stop the tracker on the DHT's loop; nothing to do once the DHT is down."""

    async def stop(_: Any, node: Any) -> None:
        await tracker.shutdown()

    if dht.is_alive():
        dht.run_coroutine(stop)


def start_state_server(dht: Any, run_id: str) -> StateServer:
    """Serve this peer's state to late joiners (``kit.optim.state``), on the DHT's loop."""
    identity = dht.node.peer.identity

    async def serve(_: Any, node: Any) -> StateServer:
        return StateServer(node.peer, node, run_id, identity)

    server: StateServer = dht.run_coroutine(serve)
    return server


def averaging_options(
    matchmaking_time: float,
    averaging_timeout: float,
    allreduce_timeout: float | None,
    next_chunk_timeout: float | None,
    client_mode: bool,
    auxiliary: bool,
    averager_opts: dict[str, Any] | None,
) -> dict[str, Any]:
    """Keyword arguments of both averagers: kit's defaults, then the user's ``averager_opts``."""
    return {
        "min_matchmaking_time": matchmaking_time,
        "request_timeout": min(3.0, matchmaking_time),
        "allreduce_timeout": allreduce_timeout or averaging_timeout,
        "next_chunk_timeout": next_chunk_timeout,
        "client_mode": client_mode,
        "auxiliary": auxiliary,
        # kit's optimizer shares its state itself (optim/state.py: several donors, digest)
        "allow_state_sharing": False,
        **(averager_opts or {}),  # the user's options win over kit's defaults
    }


def build_averagers(
    dht: Any,
    run_id: str,
    params: Sequence[torch.Tensor],
    state_tensors: Sequence[torch.Tensor],
    *,
    state_roles: Sequence[TensorRole] | None = None,
    tracker: ProgressTracker,
    deadlines: Deadlines,
    use_local_updates: bool,
    target_group_size: int | None,
    grad_compression: CompressionBase | None,
    state_averaging_compression: CompressionBase | None,
    averaging: dict[str, Any],
) -> OptimizerAveragers:
    """Start the gradient averager (unless ``use_local_updates``) and the state averager."""
    # With local updates parameters are averaged, never gradients: no gradient averager
    # (hivemind's grad_averager is None then too).
    grads = rounds = None
    if not use_local_updates:
        grads = DecentralizedAverager(
            [torch.zeros(p.shape, dtype=torch.float32) for p in params],
            dht,
            prefix=f"{run_id}_grad_averager",
            compression=grad_compression or NoCompression(),
            # gradients of different batches: one shared average has the smaller error
            # with a lossy codec, and every member steps with the same bytes (averages.py)
            **{"lossy_deltas": False, **averaging},
        )
        # Bit-identical averaged gradients on every member (state_averaging.py): an exact
        # codec, or one shared lossy average that every member decodes alike.
        exact = not grads.settings.lossy_deltas or grad_compression is None
        exact = exact or isinstance(grad_compression, NoCompression)
        rounds = GradientRounds(
            grads,
            tracker,
            deadlines=deadlines,
            target_group_size=target_group_size,
            me=dht.peer_id,
            exact_gradients=exact,
        )
    buffers = [torch.zeros(t.shape, dtype=torch.float32) for t in state_tensors]
    roles = state_roles or [TensorRole.UNSPECIFIED] * len(buffers)
    state = DecentralizedAverager(
        buffers,
        dht,
        prefix=f"{run_id}_state_averager",
        compression=state_averaging_compression or NoCompression(),
        # each tensor's role, for a RoleAdaptiveCompression (hivemind's TrainingStateAverager)
        tensor_infos=[
            CompressionInfo.from_tensor(t, key=i, role=role)
            for i, (t, role) in enumerate(zip(buffers, roles, strict=True))
        ],
        **averaging,
    )
    return OptimizerAveragers(grads, rounds, state)

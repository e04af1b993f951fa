"""What a training peer is doing, as one immutable snapshot the UI can draw (torch-free).

Holds :class:`TrainingState` (the peer's lifecycle, as the volunteer reads it) and
:class:`TrainingStatus` (one snapshot: state, epochs, global progress, this peer's speed and
contribution, recent losses). The trainer produces snapshots; the notebook panel and the console
renderer (``kit.ui``) only draw them. It holds no logic that decides anything.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class TrainingState(str, enum.Enum):
    """Where a volunteer's peer is in its life; shown as is in the panel."""

    STARTING = "starting"
    LOGGING_IN = "logging in"
    JOINING = "joining"
    DOWNLOADING_STATE = "downloading state"
    TRAINING = "training"
    AVERAGING = "averaging"
    RECONNECTING = "reconnecting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TrainingState.STOPPED, TrainingState.FAILED)


#: The loss history a snapshot carries at most (older points are dropped first).
LOSS_HISTORY_LIMIT = 2_000


@dataclass(frozen=True)
class TrainingStatus:
    """One snapshot of a training peer, for the panel, the console and the tests."""

    # fmt: off
    state: TrainingState  # the lifecycle state
    local_epoch: int = 0  # global steps this peer has applied
    global_epoch: int = 0  # the collaboration's global step
    samples_accumulated: int = 0  # samples of all peers toward the next global step
    target_batch_size: int = 1  # samples per global step
    eta_next_step: float = math.inf  # seconds until the next global step; inf = unknown
    peers_online: int = 0  # peers whose progress records are fresh
    samples_per_second: float = 0.0  # this peer's training speed
    samples_total: int = 0  # samples this peer processed since it started
    rollbacks: int = 0  # steps undone because they left a parameter inf/NaN (never shared)
    loss_history: tuple[tuple[int, float], ...] = ()  # (local step, loss), newest last, bounded
    username: str | None = None  # the Hugging Face user this peer trains as
    rank: int | None = None  # this user's place on the leaderboard (1 = top); None = unknown
    leaderboard_size: int = 0  # users on the leaderboard
    message: str = ""  # the last line for the volunteer; errors end with what to do
    device: str = "cpu"  # e.g. "Tesla T4 (fp16)"
    time: float = 0.0  # time.time() of this snapshot
    # fmt: on

    @property
    def progress_fraction(self) -> float:
        """Fraction of the next global batch gathered, in [0, 1]."""
        return min(1.0, max(0.0, self.samples_accumulated / max(1, self.target_batch_size)))

    @property
    def last_loss(self) -> float | None:
        return self.loss_history[-1][1] if self.loss_history else None

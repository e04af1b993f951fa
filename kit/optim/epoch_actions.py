"""What the epoch machine (``kit.optim.epochs``) returns for its drivers to do, and the
judgement of a gradient round it takes in.

Each action is a small frozen record; ``kit.optim.driver`` carries them out. Pure: no torch,
no I/O.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Publish:
    """Report this progress to the tracker."""

    epoch: int
    samples: int


@dataclasses.dataclass(frozen=True)
class ReportProgress:
    """Publish our progress now, as :meth:`EpochLife.report_now` says with the tracker's view."""


@dataclasses.dataclass(frozen=True)
class FlagDrift:
    """Publish the drift flag (the tracker publishes it with the progress)."""

    drifted: bool


@dataclasses.dataclass(frozen=True)
class DropAccumulated:
    """Start accumulating afresh (``clear_grads``: and clear ``.grad``)."""

    clear_grads: bool = True


@dataclasses.dataclass(frozen=True)
class CancelPrefetch:
    """The state prefetched while the optimizer was built is moot now."""


@dataclasses.dataclass(frozen=True)
class StartRefresh:
    """Download the collaboration's state (of ``min_epoch`` or newer) in the background; keep
    a copy of the parameters now, for a delta should we step on meanwhile. ``donors``: only
    from these peers (ids; None: any, the verified majority's state)."""

    min_epoch: int
    donors: frozenset[bytes] | None = None


@dataclasses.dataclass(frozen=True)
class LoadRefresh:
    """Load the landed download (then :meth:`EpochLife.state_loaded`)."""

    keep_accumulated: bool


@dataclasses.dataclass(frozen=True)
class AddRefreshDelta:
    """Move the parameters by (landed state - parameters when the download began)."""


@dataclasses.dataclass(frozen=True)
class AverageGradients:
    """Average this epoch's mean gradient (weighted by ``samples``), then step with it; in the
    optimizer's thread while the next batches compute if ``background``."""

    epoch: int
    samples: int
    background: bool


@dataclasses.dataclass(frozen=True)
class StepWithoutRound:
    """Step the scheduler (and the optimizer on local updates): no gradient round this epoch."""


Action = (
    Publish
    | ReportProgress
    | FlagDrift
    | DropAccumulated
    | CancelPrefetch
    | StartRefresh
    | LoadRefresh
    | AddRefreshDelta
    | AverageGradients
    | StepWithoutRound
)


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What a finished gradient round means for this peer (from ``rounds.RoundOutcome``)."""

    averaged: bool  # our gradient was averaged with someone's
    identical: bool  # every peer expected got the same exact average: nobody drifted
    failed_or_partial: bool  # (part of) our gradient stayed local
    group_size: int  # peers the round averaged over (0: none), expected at the next epoch

"""Where a volunteer is in its data, kept on its disk so that a restart goes on from there.

A Colab kernel restart or a home PC coming back keeps the peer's identity file (so the same
shuffle seed: ``kit.data.sources.peer_shuffle_seed``) and, without this, would replay the same
first documents. :class:`DataPosition` writes the pipeline's ``state_dict()`` (small JSON: stream
positions and counters, no text) next to the identity, at most every ``every_seconds`` and when
training stops, and :meth:`DataPosition.restore` continues from it. A fresh machine has a new
identity, hence its own order and no saved position. A position saved with other data settings,
another tokenizer or another identity is refused by the pipeline and the stream starts afresh.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit.errors import ConfigError

logger = logging.getLogger(__name__)

#: Seconds between two saves of the data position (a crash loses at most this much of it).
SAVE_EVERY_SECONDS = 30.0


def data_position_path(state_dir: str | os.PathLike[str], run_id: str, peer_id: str) -> Path:
    """The file of one peer's data position in one run (beside its identity key)."""
    return Path(state_dir) / f"data-position-{run_id}-{peer_id[:16]}.json"


class DataPosition:
    """Saves and restores a pipeline's position (anything with ``state_dict``/``load_state_dict``).

    Args:
        pipeline: the peer's ``kit.data.PretrainingPipeline``.
        path: the JSON file (``data_position_path``).
        every_seconds: least time between two saves by :meth:`on_step`.
        clock: monotonic time (tests).
    """

    def __init__(
        self,
        pipeline: Any,
        path: str | os.PathLike[str],
        *,
        every_seconds: float = SAVE_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self.path = Path(path)
        self.every_seconds = every_seconds
        self._clock = clock
        self._last_save = clock()

    def restore(self) -> bool:
        """Continue from the saved position, if there is a usable one; True if it did."""
        try:
            state = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as error:
            logger.warning(
                "cannot read the data position %s (%s): starting afresh", self.path, error
            )
            return False
        try:
            self.pipeline.load_state_dict(state)
        except (ConfigError, KeyError, TypeError, ValueError) as error:
            logger.warning("the saved data position does not fit (%s): starting afresh", error)
            return False
        logger.info("resuming the data stream where this peer left it (%s)", self.path)
        return True

    def save(self) -> None:
        """Write the current position atomically (a crash mid-write keeps the previous one)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".part")
        try:
            partial.write_text(json.dumps(self.pipeline.state_dict()), encoding="utf-8")
            os.replace(partial, self.path)
        except OSError as error:
            logger.warning("cannot save the data position to %s: %s", self.path, error)
        self._last_save = self._clock()

    def on_step(self, samples: int, loss: float, compute_seconds: float) -> None:
        """A trainer step listener: save when ``every_seconds`` have passed."""
        if self._clock() - self._last_save >= self.every_seconds:
            self.save()

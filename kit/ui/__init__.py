"""kit.ui: what the volunteer sees, in a notebook (ipywidgets) and on a terminal (torch-free).

Read in this order:

* ``login``: :func:`find_cached_hf_token` (``HF_TOKEN`` env var → Kaggle secret → Colab secret →
  cached ``huggingface-cli login``) and :class:`LoginWidget` (token field, "Log in" button,
  one readable status line; the token is checked by a callback and never echoed or logged).
* ``panel``: :class:`TrainingPanel`, the live notebook panel (loss plot updated in place, state
  badge, progress toward the next global step, speed, contribution, device, last message, Stop).
* ``leaderboard``: :func:`leaderboard_html` and :class:`LeaderboardWidget` (the run's
  contributors, best first, with a Refresh button).
* ``console``: :class:`ConsoleReporter`, a ``tqdm`` bar plus one log line per state change,
  message and global step, for ``kit join`` on the command line.

This package only draws :class:`~kit.training.status.TrainingStatus` snapshots and calls the
callbacks it is given; it decides nothing about training (that is ``kit.training`` and
``kit.volunteer``). The widgets used exist in both ipywidgets 7.7 (Colab) and 8.x; ipywidgets is
imported only where a widget is made, so ``kit join`` runs on a server that does not have it.
"""

from kit.ui.console import ConsoleReporter
from kit.ui.leaderboard import LeaderboardWidget, leaderboard_html
from kit.ui.login import LoginWidget, find_cached_hf_token
from kit.ui.panel import TrainingPanel

__all__ = [
    "ConsoleReporter",
    "LeaderboardWidget",
    "LoginWidget",
    "TrainingPanel",
    "find_cached_hf_token",
    "leaderboard_html",
]

"""Contribution accounting: who trained how much, and the collaboration's loss curve (torch-free).

Map of the package (data flows down this list):

    records.py     ContributionRecord: what one peer publishes about its own work (pure,
                   validated parsing), and metrics_key(run_id) = f"{run_id}_metrics"
    reporter.py    MetricsReporter: a training peer publishes its owner-signed record to the DHT
    book.py        MetricsBook: the pure accounting core (sessions, verified users, loss curve,
                   leaderboard, summary, JSON state); token_verifier for authenticated runs
    collector.py   MetricsCollector: the coordinator fetches the records, feeds and saves the book

The web page showing all this is ``kit.dashboard``.
"""

from kit.metrics.book import LossPoint, MetricsBook, Verifier, token_verifier
from kit.metrics.collector import MetricsCollector, owned_records
from kit.metrics.records import ContributionRecord, metrics_key
from kit.metrics.reporter import MetricsReporter

__all__ = [
    "ContributionRecord",
    "LossPoint",
    "MetricsBook",
    "MetricsCollector",
    "MetricsReporter",
    "Verifier",
    "metrics_key",
    "owned_records",
    "token_verifier",
]

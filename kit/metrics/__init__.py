"""Contribution accounting: who trained how much, and the collaboration's loss curve (torch-free).

Map of the package (data flows down this list):

    records.py     ContributionRecord: what one peer publishes about its own work (pure,
                   validated parsing), and metrics_key(run_id) = f"{run_id}_metrics"
    attestations.py  AttestationRecord: the weights a round's member saw (pure parsing), and
                   RoundAttestor, which publishes them after each round
    reporter.py    MetricsReporter: a training peer publishes its owner-signed record to the DHT
    verification.py  token_verifier: the user a record's access token names (authenticated runs)
    ledger.py      AttestationLedger: credit = what the OTHER members of a peer's rounds attested
    book.py        MetricsBook: the pure accounting core (sessions, verified users, loss curve,
                   leaderboard capped at the attested credit, summary, JSON state)
    collector.py   MetricsCollector: the coordinator fetches the records, feeds and saves the book

The web page showing all this is ``kit.dashboard``.
"""

from kit.metrics.attestations import AttestationRecord, RoundAttestor, attestations_key
from kit.metrics.book import LossPoint, MetricsBook
from kit.metrics.collector import MetricsCollector, owned_records
from kit.metrics.ledger import AttestationLedger
from kit.metrics.records import ContributionRecord, metrics_key
from kit.metrics.reporter import MetricsReporter
from kit.metrics.verification import Verifier, token_verifier

__all__ = [
    "AttestationLedger",
    "AttestationRecord",
    "ContributionRecord",
    "LossPoint",
    "MetricsBook",
    "MetricsCollector",
    "MetricsReporter",
    "RoundAttestor",
    "Verifier",
    "attestations_key",
    "metrics_key",
    "owned_records",
    "token_verifier",
]

"""The coordinator's side of contribution accounting: fetch records, keep the book, persist it.

:class:`MetricsCollector` is a task on the runtime loop that every ``period`` seconds reads all
contribution records under ``f"{run_id}_metrics"`` from the DHT, hands them (with the public key
that signed each one, read from its ``[owner:...]`` subkey) to its pure
:class:`~kit.metrics.book.MetricsBook`, and writes the book to ``state_path`` (atomically: a
temporary file, then ``os.replace``) so a restarted coordinator resumes the counts. The dashboard
(``kit.dashboard``) reads its properties.

What this module does not do: the accounting rules (``book``), publishing (``reporter``), HTTP.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit.auth.revocation import RevocationList
from kit.dht.node import DHTNode, get_dht_time
from kit.dht.validation import owned_values
from kit.errors import ConfigError, MetricsStateError
from kit.metrics.attestations import AttestationRecord, attestations_key
from kit.metrics.book import LossPoint, MetricsBook
from kit.metrics.history import MetricsHistory
from kit.metrics.ledger import AttestationLedger
from kit.metrics.records import ContributionRecord, metrics_key
from kit.metrics.verification import token_verifier
from kit.runtime import PeriodicTask

logger = logging.getLogger(__name__)


def owned_records(value: Any) -> list[tuple[bytes, ContributionRecord]]:
    """The well-formed records of a ``node.get(metrics_key)`` answer, each with its signer's key.

    The DHT has verified each owner signature already; records without exactly one owner
    marker, or malformed, are skipped.
    """
    return owned_values(value, ContributionRecord.from_dict)


def owned_attestations(value: Any) -> list[tuple[bytes, AttestationRecord]]:
    """The well-formed records of a ``node.get(attestations_key)`` answer, with their signers."""
    return owned_values(value, AttestationRecord.from_dict)


class MetricsCollector(PeriodicTask):
    """Reads every peer's contribution record and keeps the run's :class:`MetricsBook`.

    Create and :meth:`start` it on the runtime loop (the coordinator does).

    Args:
        node: the coordinator's running DHT node.
        run_id: the run whose records to read.
        authority_public_key: the run's token authority key; records are credited only to the
            user their access token names. None = open run (self-declared names, unverified).
        revocations: the run's current revocation list (the coordinator's authorizer holds it):
            revoked users and keys are credited nothing more.
        attested: credit users at most what the other members of their averaging rounds
            attested (``kit.metrics.ledger``); None = in authenticated runs (open runs have no
            verified users to tell the members apart: claims are shown as unverified).
        state_path: where to keep the book across restarts (JSON); None = in memory only.
        period: seconds between fetches. Increase this on very large swarms.
        book: a preconfigured book (tests, custom windows); default: a new one.

    Raises:
        ConfigError: a period that is not positive.
    """

    def __init__(
        self,
        node: DHTNode,
        run_id: str,
        *,
        authority_public_key: bytes | None,
        revocations: Callable[[], RevocationList | None] | None = None,
        state_path: Path | None = None,
        period: float = 10.0,
        book: MetricsBook | None = None,
        attested: bool | None = None,
    ) -> None:
        if not period > 0:
            raise ConfigError(f"MetricsCollector: period={period!r} must be > 0 seconds")
        self.node = node
        self.key = metrics_key(run_id)
        self.attestations_key = attestations_key(run_id)
        self.period = period
        self.state_path = Path(state_path) if state_path is not None else None
        verify = None
        if authority_public_key is not None:
            verify = token_verifier(authority_public_key, run_id, revocations=revocations)
        self.book = book or MetricsBook(verify)
        if book is not None and verify is not None:
            self.book.verify = verify
        if attested is None:
            attested = authority_public_key is not None
        if attested and self.book.ledger is None:
            self.book.ledger = AttestationLedger()
        self.fetches = 0  # completed fetches (diagnostics, tests)
        self.history = MetricsHistory()  # peers online and samples/s over time (the charts)
        self._load()

    # --- lifecycle ------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop fetching and save the book one last time."""
        await super().shutdown()
        self._save()

    async def collect(self) -> int:
        """Fetch the records once and feed the book; returns how many were new.

        Raises:
            KitError: the DHT lookup failed (the background loop logs it and retries).
        """
        result = await self.node.get(self.key, latest=True)
        records = owned_records(result.value if result is not None else None)
        now = get_dht_time()
        accepted = self.book.add(records, now)
        if self.book.ledger is not None:
            found = await self.node.get(self.attestations_key, latest=True)
            attestations = owned_attestations(found.value if found is not None else None)
            accepted += self.book.add_attestations(attestations, get_dht_time())
        self.fetches += 1
        summary = self.book.summary(now)
        self.history.add(now, summary["peers_online"], summary["samples_per_second"])
        return accepted

    async def once(self) -> None:
        """One fetch (every ``period`` once started), then save (the charts move every time)."""
        self._save(book=await self.collect() > 0)

    # --- what the dashboard reads ---------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """:meth:`MetricsBook.summary` now."""
        return self.book.summary(get_dht_time())

    def loss_curve(self) -> list[LossPoint]:
        return self.book.loss_curve()

    def leaderboard(self) -> list[dict[str, Any]]:
        """:meth:`MetricsBook.leaderboard` now."""
        return self.book.leaderboard(get_dht_time())

    # --- persistence ----------------------------------------------------------------------

    @property
    def history_path(self) -> Path | None:
        """Where the charts' series is saved: beside the book (``metrics.json.history``)."""
        if self.state_path is None:
            return None
        return self.state_path.with_name(self.state_path.name + ".history")

    def _load(self) -> None:
        history = self.history_path
        if history is not None and history.exists():
            try:
                self.history.load_json(history.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, MetricsStateError) as e:
                logger.warning("the charts start afresh: %s", e)  # only the charts are lost
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            self.book.load_json(self.state_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, MetricsStateError) as e:
            aside = self.state_path.with_name(self.state_path.name + ".unreadable")
            logger.warning(
                "cannot read the metrics state %s (%s); starting from zero and keeping the old "
                "file as %s - help: restore it from a backup if the counts matter",
                self.state_path,
                e,
                aside,
            )
            try:
                os.replace(self.state_path, aside)
            except OSError:
                pass
            return
        logger.info("resumed the contribution counts from %s", self.state_path)

    def _save(self, *, book: bool = True) -> None:
        """Save the book (unless ``book`` is False) and the charts' series."""
        if self.state_path is None or self.history_path is None:
            return
        saves = [(self.history_path, self.history.to_json())]
        if book:
            saves.append((self.state_path, self.book.to_json()))
        for path, text in saves:
            temporary = path.with_name(path.name + ".tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary.write_text(text, encoding="utf-8")
                os.replace(temporary, path)  # atomic: a crash leaves the old or the new
            except OSError as e:
                logger.warning(
                    "cannot save the metrics state to %s: %s - help: check free disk space and "
                    "permissions of that folder",
                    path,
                    e,
                )

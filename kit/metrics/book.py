"""The contribution book: who trained how much, and the collaboration's loss curve (pure).

:class:`MetricsBook` ingests the contribution records the coordinator fetched from the DHT
(``kit.metrics.records``) and keeps, per *session* (one peer key, one reporter run), the largest
cumulative counters it has seen: samples and compute seconds never decrease, a record seen twice
counts once, and a restarted peer process (a new session, counting from zero) adds to its user's
total instead of replacing it. From that it answers three questions:

* :meth:`MetricsBook.loss_curve`: one point per global step (epoch): the loss of the records at
  that step, weighted by the samples each session processed during it, total samples/s, peers.
* :meth:`MetricsBook.leaderboard`: users by samples processed (DeDLOC §4.2 credited volunteers
  this way), with compute hours and peers online.
* :meth:`MetricsBook.summary`: peers online, samples/s, global step, time per step and an ETA.

Who a record belongs to is decided by a *verifier* the driver passes: in authenticated runs
:func:`token_verifier` checks the record's access token (authority signature, run id, and that it
was issued to the very key that signed the record), so nobody is credited under another user's
name; records failing it are dropped. In open runs the self-declared name is used and shown as
unverified.

How much a user is credited with is, in authenticated runs, not what its peers claim: a book
with an :class:`~kit.metrics.ledger.AttestationLedger` (the collector's) caps each user's
claimed samples at what the other members of its peers' averaging rounds attested
(:meth:`MetricsBook.add_attestations`), and flags a claim that exceeds that by more than about
three rounds' worth (rounds in flight, records not yet read). A peer claiming 777 samples it
never averaged is credited nothing for them, and the leaderboard row says ``"flagged": true``.

No I/O and no clock here: every method that needs the time takes ``now``. The book serializes
to JSON (:meth:`MetricsBook.to_json`) so the coordinator resumes counts after a restart.

What this module does not do: fetching records (``collector``), HTTP (``kit.dashboard``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kit.errors import MetricsStateError
from kit.metrics.attestations import AttestationRecord
from kit.metrics.ledger import AttestationLedger
from kit.metrics.records import ContributionRecord
from kit.metrics.verification import Verifier
from kit.p2p.identity import PeerID

logger = logging.getLogger(__name__)

#: A claim is flagged when it exceeds the attested credit by more than this many of the user's
#: largest rounds (one accumulating, one or two not yet attested or read) ...
FLAG_ROUNDS = 3.0
#: ... plus this many samples (a margin for the first round of a peer).
FLAG_MARGIN = 64.0
STATE_VERSION = 2
ANONYMOUS = "anonymous"  # shown for open-run records that declare no user name


@dataclass
class _Session:
    """What the book knows about one session (mutable, internal)."""

    username: str
    verified: bool
    auxiliary: bool
    samples: int  # the largest samples_total seen
    compute_seconds: float  # the largest compute_seconds seen
    record_time: float  # time of the newest accepted record (the peer's clock)
    seen: float  # the book's `now` when that record was accepted (online = seen recently)
    epoch: int
    epoch_base: int  # samples_total when the session entered `epoch`
    samples_per_second: float
    device: str


@dataclass
class _OpenEpoch:
    """A recent epoch whose point may still change: each session's latest contribution to it."""

    first_time: float
    entries: dict[str, tuple[float | None, int, float]]  # session key → (loss, weight, samples/s)


@dataclass(frozen=True)
class LossPoint:
    """One point of the loss curve (one global step)."""

    epoch: int
    time: float  # when the first record at this epoch was made
    loss: float | None  # samples-weighted mean loss; None if no peer reported one
    samples_per_second: float  # total throughput of the peers at this epoch
    peers: int  # training peers that reported this epoch

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "time": self.time,
            "loss": self.loss,
            "samples_per_second": self.samples_per_second,
            "peers": self.peers,
        }


class MetricsBook:
    """Contribution accounting from records (pure; see the module docstring).

    Args:
        verify: maps ``(owner_public_key, record, now)`` to the user to credit, or None to drop
            the record; None = open run: the self-declared name, marked unverified.
        online_window: seconds since a session's last new record during which it counts as
            online. Increase this if peers flicker offline on the dashboard (slow DHT).
        max_clock_skew: records dated further in the future are dropped. Increase this if you
            see honest peers missing, and their clocks are wrong.
        max_record_age: records older than this (by their own date) are dropped.
        open_epochs: how many epochs below the global one still accept loss records (peers
            that lag behind while downloading the state).
        max_points: loss-curve points kept (the oldest are dropped).
        max_sessions: sessions kept; beyond it the least recently seen are folded into their
            user's totals (a folded session that comes back would count again from zero).
        ledger: round attestations (authenticated runs): users are credited at most what the
            other members of their rounds attested. None = claims are credited as they are.
    """

    def __init__(
        self,
        verify: Verifier | None = None,
        *,
        online_window: float = 60.0,
        max_clock_skew: float = 60.0,
        max_record_age: float = 900.0,
        open_epochs: int = 2,
        max_points: int = 20_000,
        max_sessions: int = 50_000,
        ledger: AttestationLedger | None = None,
    ) -> None:
        self.verify = verify
        self.ledger = ledger
        self.online_window = online_window
        self.max_clock_skew = max_clock_skew
        self.max_record_age = max_record_age
        self.open_epochs = open_epochs
        self.max_points = max_points
        self.max_sessions = max_sessions
        self._sessions: dict[str, _Session] = {}
        self._retired: dict[str, tuple[int, float, bool]] = {}  # user → samples, compute, verified
        self._open: dict[int, _OpenEpoch] = {}
        self._closed: dict[int, LossPoint] = {}
        self._top_epoch = 0

    # --- ingest ---------------------------------------------------------------------------

    def add(self, records: Iterable[tuple[bytes, ContributionRecord]], now: float) -> int:
        """Ingest fetched records, each with the public key that signed it (its owner).

        Returns:
            How many records were new and accepted (stale, duplicate, unverified ones are not).
        """
        accepted = 0
        for owner, record in records:
            if self._accept(owner, record, now):
                accepted += 1
        self._close_old_epochs()
        self._retire_sessions()
        return accepted

    def _accept(self, owner: bytes, record: ContributionRecord, now: float) -> bool:
        if PeerID.from_public_key(owner).to_bytes() != record.peer_id:
            logger.debug("dropping a metrics record whose peer id is not its signer's")
            return False
        if record.time > now + self.max_clock_skew or record.time < now - self.max_record_age:
            return False  # from the future, or stale
        key = _session_key(record)
        session = self._sessions.get(key)
        if session is not None and record.time <= session.record_time:
            return False  # seen already (the DHT holds each record for minutes)
        if self.verify is None:
            username, verified = record.username or ANONYMOUS, False
        else:
            verified_name = self.verify(owner, record, now)
            if verified_name is None:
                return False
            username, verified = verified_name, True
            if self.ledger is not None:
                self.ledger.note_user(record.peer_id, username)
        if session is None:
            session = _Session(
                username, verified, record.auxiliary, 0, 0.0, 0.0, now, record.epoch, 0, 0.0, ""
            )
            self._sessions[key] = session
        elif record.epoch != session.epoch:
            session.epoch_base = session.samples  # what it had done before entering this epoch
        session.username, session.verified, session.auxiliary = username, verified, record.auxiliary
        session.samples = max(session.samples, record.samples_total)
        session.compute_seconds = max(session.compute_seconds, record.compute_seconds)
        session.record_time, session.seen = record.time, now
        session.epoch = record.epoch
        session.samples_per_second = record.samples_per_second
        session.device = record.device
        self._add_to_curve(key, session, record)
        return True

    def add_attestations(
        self, records: Iterable[tuple[bytes, AttestationRecord]], now: float
    ) -> int:
        """Ingest round attestations, each with the public key that signed it; returns how many
        round attestations were new (none without a ledger, or from unverified peers)."""
        if self.ledger is None or self.verify is None:
            return 0
        added = 0
        for owner, record in records:
            if PeerID.from_public_key(owner).to_bytes() != record.peer_id:
                continue
            user = self.verify(owner, record, now)
            if user is not None:
                added += self.ledger.add(record.peer_id, user, record, now)
        return added

    def _add_to_curve(self, key: str, session: _Session, record: ContributionRecord) -> None:
        self._top_epoch = max(self._top_epoch, record.epoch)
        if record.auxiliary or record.epoch in self._closed:
            return
        if record.epoch < self._top_epoch - self.open_epochs:
            return  # a straggler: its epoch's point is final
        point = self._open.setdefault(record.epoch, _OpenEpoch(record.time, {}))
        point.first_time = min(point.first_time, record.time)
        weight = max(0, session.samples - session.epoch_base)
        point.entries[key] = (record.loss, weight, record.samples_per_second)

    def _close_old_epochs(self) -> None:
        for epoch in [e for e in self._open if e < self._top_epoch - self.open_epochs]:
            self._closed[epoch] = _point(epoch, self._open.pop(epoch))
        if len(self._closed) > self.max_points:
            for epoch in sorted(self._closed)[: len(self._closed) - self.max_points]:
                del self._closed[epoch]

    def _retire_sessions(self) -> None:
        if len(self._sessions) <= self.max_sessions:
            return
        by_age = sorted(self._sessions, key=lambda k: self._sessions[k].seen)
        for key in by_age[: len(self._sessions) - self.max_sessions]:
            session = self._sessions.pop(key)
            samples, compute, verified = self._retired.get(session.username, (0, 0.0, True))
            self._retired[session.username] = (
                samples + session.samples,
                compute + session.compute_seconds,
                verified and session.verified,
            )

    # --- outputs --------------------------------------------------------------------------

    def loss_curve(self) -> list[LossPoint]:
        """One point per global step, oldest first."""
        points = dict(self._closed)
        for epoch, open_epoch in self._open.items():
            points[epoch] = _point(epoch, open_epoch)
        return [points[epoch] for epoch in sorted(points)][-self.max_points :]

    def leaderboard(self, now: float) -> list[dict[str, Any]]:
        """Users by samples processed, most first (ties by name).

        Returns:
            Rows ``{"rank", "username", "samples", "compute_hours", "peers_online",
            "last_seen", "verified"}``; users whose peers are all auxiliary are left out.
        """
        users: dict[str, dict[str, Any]] = {}
        for name, (samples, compute, verified) in self._retired.items():
            users[name] = _row(name, samples, compute, 0, None, verified)
        for session in self._sessions.values():
            if session.auxiliary:
                continue
            row = users.setdefault(session.username, _row(session.username, 0, 0.0, 0, None, True))
            row["samples"] += session.samples
            row["compute_hours"] += session.compute_seconds / 3600.0
            row["peers_online"] += int(self._online(session, now))
            row["last_seen"] = max(row["last_seen"] or 0.0, session.seen)
            row["verified"] = row["verified"] and session.verified
        for row in users.values():
            row["claimed"] = row["samples"]
        self._cap_at_attested(users)
        rows = sorted(users.values(), key=lambda row: (-row["samples"], row["username"]))
        for rank, row in enumerate(rows, start=1):
            row["rank"] = rank
        return rows

    def _cap_at_attested(self, users: dict[str, dict[str, Any]]) -> None:
        """Credit each user at most what others attested; flag claims well beyond it."""
        if self.ledger is None:
            return
        attested: dict[str, float] = {}
        largest: dict[str, float] = {}
        for peer_id, user in self.ledger.users().items():
            attested[user] = attested.get(user, 0.0) + self.ledger.credit(peer_id)
            largest[user] = max(largest.get(user, 0.0), self.ledger.largest_round(peer_id))
        for name, row in users.items():
            claimed, credit = row["samples"], attested.get(name, 0.0)
            row["samples"] = int(min(claimed, credit))
            row["attested"] = int(credit)
            row["flagged"] = claimed > credit + FLAG_ROUNDS * largest.get(name, 0.0) + FLAG_MARGIN

    def summary(self, now: float) -> dict[str, Any]:
        """The collaboration at a glance (JSON-ready: unknown values are None, never inf)."""
        online = [s for s in self._sessions.values() if self._online(s, now)]
        trainers = [s for s in online if not s.auxiliary]
        epoch = max((s.epoch for s in online), default=self._top_epoch)
        curve = self.loss_curve()
        step_seconds = _seconds_per_step(curve)
        eta = None
        starts = {point.epoch: point.time for point in curve}
        if step_seconds is not None and epoch in starts:
            eta = max(0.0, starts[epoch] + step_seconds - now)
        last_loss = next((p.loss for p in reversed(curve) if p.loss is not None), None)
        board = self.leaderboard(now)
        return {
            "time": now,
            "global_epoch": epoch,
            "peers_online": len(trainers),
            "auxiliary_online": len(online) - len(trainers),
            "samples_per_second": sum(s.samples_per_second for s in trainers),
            "samples_total": sum(row["samples"] for row in board),
            "compute_hours": sum(row["compute_hours"] for row in board),
            "users": len(board),
            "loss": last_loss,
            "seconds_per_step": step_seconds,
            "eta_next_step": eta,
        }

    def _online(self, session: _Session, now: float) -> bool:
        return now - session.seen < self.online_window

    # --- persistence ----------------------------------------------------------------------

    def to_json(self) -> str:
        """The book's state (sessions, retired totals, curve) as JSON, for :meth:`from_json`."""
        state = {
            "version": STATE_VERSION,
            "top_epoch": self._top_epoch,
            "sessions": {key: vars(session) for key, session in self._sessions.items()},
            "retired": {name: list(values) for name, values in self._retired.items()},
            "open": {
                str(epoch): {"first_time": p.first_time, "entries": p.entries}
                for epoch, p in self._open.items()
            },
            "closed": [point.to_dict() for point in self._closed.values()],
            "ledger": self.ledger.to_state() if self.ledger is not None else None,
        }
        return json.dumps(state, separators=(",", ":"), allow_nan=False)

    def load_json(self, text: str) -> None:
        """Replace this book's state with one saved by :meth:`to_json` (settings are kept).

        Raises:
            MetricsStateError: not a state this kit wrote (corrupt, truncated, other version).
        """
        try:
            state = json.loads(text)
            if state.get("version") not in (1, STATE_VERSION):  # 1: before attestations
                raise ValueError(f"version {state.get('version')!r}, expected {STATE_VERSION}")
            sessions = {str(k): _Session(**v) for k, v in state["sessions"].items()}
            retired = {
                str(name): (int(s), float(c), bool(v))
                for name, (s, c, v) in state["retired"].items()
            }
            open_epochs = {
                int(epoch): _OpenEpoch(
                    float(p["first_time"]),
                    {str(k): (e[0], int(e[1]), float(e[2])) for k, e in p["entries"].items()},
                )
                for epoch, p in state["open"].items()
            }
            closed = {int(p["epoch"]): LossPoint(**p) for p in state["closed"]}
            top_epoch = int(state["top_epoch"])
            ledger_state = state.get("ledger")
            if self.ledger is not None and ledger_state is not None:
                self.ledger.load_state(ledger_state)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise MetricsStateError(
                f"the saved metrics state is unreadable ({type(e).__name__}: {e}) - help: move "
                "the file away to start counting afresh, or restore it from a backup"
            ) from None
        self._sessions, self._retired = sessions, retired
        self._open, self._closed, self._top_epoch = open_epochs, closed, top_epoch

    @classmethod
    def from_json(cls, text: str, verify: Verifier | None = None, **settings: Any) -> MetricsBook:
        """A book with the state saved by :meth:`to_json` (raises MetricsStateError)."""
        book = cls(verify, **settings)
        book.load_json(text)
        return book


def _session_key(record: ContributionRecord) -> str:
    return f"{record.peer_id.hex()}/{record.session}"


def _row(
    name: str, samples: int, compute: float, online: int, seen: float | None, verified: bool
) -> dict[str, Any]:
    return {
        "rank": 0,
        "username": name,
        "samples": samples,  # credited (capped at "attested" when the book has a ledger)
        "claimed": samples,  # what the user's peers said they processed
        "attested": None,  # what the other members of their rounds attested (ledger only)
        "flagged": False,  # the claim exceeds what was attested (see FLAG_ROUNDS)
        "compute_hours": compute / 3600.0,
        "peers_online": online,
        "last_seen": seen,
        "verified": verified,
    }


def _point(epoch: int, open_epoch: _OpenEpoch) -> LossPoint:
    entries = list(open_epoch.entries.values())
    losses = [(loss, weight) for loss, weight, _ in entries if loss is not None]
    loss = None
    if losses:
        total = sum(weight for _, weight in losses)
        if total > 0:
            loss = sum(value * weight for value, weight in losses) / total
        else:  # nobody has processed samples in this epoch yet: a plain mean
            loss = sum(value for value, _ in losses) / len(losses)
    throughput = sum(rate for _, _, rate in entries)
    return LossPoint(epoch, open_epoch.first_time, loss, throughput, len(entries))


def _seconds_per_step(curve: list[LossPoint], window: int = 10) -> float | None:
    """The median time between consecutive recent steps (robust to one slow step)."""
    recent = curve[-(window + 1) :]
    gaps = [
        (later.time - earlier.time) / (later.epoch - earlier.epoch)
        for earlier, later in zip(recent, recent[1:], strict=False)
        if later.time > earlier.time
    ]
    if not gaps:
        return None
    value = statistics.median(gaps)
    return value if math.isfinite(value) else None

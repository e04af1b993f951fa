"""Chunks: how looking peers split into would-be groups, and whom each of them asks. Pure.

The computations the ``Matchmaker`` (``kit.averaging.matchmaking``) decides with, as functions of
what its search saw (declarations, refusals) and of ``now``:

* Peers are ranked by ``(expiration, peer id)``: whoever became ready first comes first.
  Client-mode peers declare too (with no address): they count, but cannot lead.
* Each peer cuts the ranked list it sees into consecutive *chunks* of ``target_group_size``
  (one chunk if it is None). The first peer of a chunk that can lead is its leader; the others
  ask it to join. So 1,000 peers do not all ask the one best leader (hivemind's scheme: with
  N peers and groups of G, O(N^2 / G) refused requests, and at 128 peers most of them failed):
  they split into N / G groups at once, every group full but the last.
* When some peers cannot lead (behind NATs that cannot be punched), every chunk keeps a place
  for one that can, and a few of those beyond one per chunk are held back to begin the next
  chunks (``cut_chunks``): consecutive chunks of G would leave some without a leader, and
  their peers without a group.
* Which chunk a peer is in depends only on the peers ranked before it: a latecomer only
  appends, and chunks already cut stay as they were; and a group that formed and withdrew
  leaves the other chunks as they were (nearly). Views of the DHT differ for a moment after a
  burst of arrivals, so nothing relies on them being exact: a peer refused as ``full`` tries
  the leader of the next chunk (an earlier peer that saw too short a list took its place); a
  chunk's leader that is gone or follows someone else is skipped for the next peer of its
  chunk that can lead; a leader points a peer that its view puts in another chunk to that
  chunk's leader (``their_leader``).
* A peer whose chunk gathered nobody by its expiration asks any other leader, nearest chunks
  first (``anywhere``). Until then, a peer whose chunk shows no peer that can lead waits for
  one (its store is late) rather than take the place of another chunk's peer.

It does not hold the state machine, its phases or its actions (``matchmaking``,
``declarations``), nor any I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from kit.averaging.declarations import Declaration
from kit.p2p.identity import PeerID

#: Refusals worth asking again after a while: the peer may lead by then.
TRANSIENT_REFUSALS = frozenset({"following", "joining", "released", "duplicate"})
#: Who refused a search, when and why.
Refusals = Mapping[PeerID, tuple[float, str]]
#: Leaders a cut holds back at most to begin the next chunks (``cut_chunks``). The last chunks
#: of 1,024 peers in groups of 16, 10% of them able to lead, found no leader in 28% of random
#: orders with none held back, 2.5% with two, 0.1% with four, none with six (256 peers: 27%,
#: 1.3%, none). More would make more of them wait at the end of a cut, and the cut depend
#: on more of the groups that formed before it (how many are held depends on them).
DEFERRED_LEADERS = 6


@dataclasses.dataclass(frozen=True)
class Cut:
    """A ranked view cut into chunks (``cut_chunks``)."""

    chunks: list[list[Declaration]]
    #: Leaders the cut held back to begin chunks, and placed at its end (none needed them
    #: yet): peers that come later may need them, so they wait (``Matchmaker``).
    deferred: frozenset[PeerID] = frozenset()


def unreachable(refused: Refusals) -> tuple[PeerID, ...]:
    """The peers found unreachable (crashed: their declarations stay until they expire)."""
    return tuple(p for p, (_, reason) in refused.items() if reason == "unreachable")


def ranked_chunks(
    view: Iterable[Declaration],
    me: Declaration,
    gone: Collection[PeerID],
    target_group_size: int | None,
) -> tuple[Cut, int]:
    """The ranked view (``me`` included) cut into chunks, and the index of ``me``'s chunk.

    Peers ``gone`` are left out: a crashed peer's declaration stays in the DHT until it
    expires, and would hold a place in a chunk that nobody fills."""
    alive = [d for d in view if d.peer_id not in gone]
    ranked = sorted([*alive, me], key=lambda d: d.rank)
    cut = Cut([ranked]) if target_group_size is None else cut_chunks(ranked, target_group_size)
    return cut, chunk_of(cut.chunks, me.peer_id)


def chunk_of(chunks: Sequence[Sequence[Declaration]], peer_id: PeerID) -> int:
    """The index of the chunk holding ``peer_id`` (which must be in one)."""
    return next(i for i, chunk in enumerate(chunks) if any(d.peer_id == peer_id for d in chunk))


def cut_chunks(ranked: Sequence[Declaration], size: int) -> Cut:
    """``ranked`` cut into chunks of ``size``, each with a place for a peer that can lead.

    Peers are placed one by one in rank order, in the chunk being filled, with two exceptions
    for the peers that can lead (*leaders*), when some peers of the view cannot:

    * a chunk whose first ``size - 1`` peers cannot lead keeps its last place for the next
      leader; the peers ranked in between fill the next chunk;
    * a leader that comes while the chunk being filled has one is held back (up to
      ``DEFERRED_LEADERS`` of them): the next chunk to open begins with the earliest one held.
      Placed in the chunk being filled, it would lead nothing, and when leaders are few the
      last chunks would find none left. Leaders still held when the list ends fill the last
      chunk, then chunks of their own (``Cut.deferred``).

    When every peer can lead, these are consecutive chunks of ``size``. Every rule looks only
    at the chunk being filled and at peers ranked before, so which chunk a peer is in depends
    only on the peers ranked before it (but for the leaders held to the end), and when the
    first chunks form and withdraw their declarations, the chunks after them stay as they were.
    That is what lets views that differ agree: a peer's view of those ranked before it settles
    (``Matchmaker.observe``), its view of those after it does not, and a peer that comes late
    never saw the groups that formed before.
    """
    mixed = not all(d.can_lead for d in ranked)
    chunks: list[list[Declaration]] = []
    led: list[bool] = []  # whether chunks[i] holds a leader
    kept: collections.deque[int] = collections.deque()  # chunks keeping their last place
    held: collections.deque[Declaration] = collections.deque()  # leaders held back, in rank order
    filling: int | None = None  # the chunk the next peer joins

    def place(declaration: Declaration) -> None:
        nonlocal filling
        if filling is None:
            chunks.append([])
            led.append(False)
            filling = len(chunks) - 1
        chunks[filling].append(declaration)
        led[filling] = led[filling] or declaration.can_lead
        if len(chunks[filling]) == size:
            filling = None
        elif len(chunks[filling]) == size - 1 and not led[filling]:
            kept.append(filling)
            filling = None

    for declaration in ranked:
        if declaration.can_lead and kept:
            chunks[kept.popleft()].append(declaration)
            continue
        if filling is None and held:
            place(held.popleft())
        leads_one = filling is not None and led[filling]
        if mixed and declaration.can_lead and leads_one and len(held) < DEFERRED_LEADERS:
            held.append(declaration)
            continue
        place(declaration)
    deferred = frozenset(d.peer_id for d in held)
    while held:
        place(held.popleft())
    for chunk in chunks:  # the leaders held to the end rank before the last chunk's latest
        chunk.sort(key=lambda d: d.rank)
    return Cut(chunks, deferred)


def settle_horizon(
    chunk: Sequence[Declaration], me: Declaration, can_lead: bool
) -> tuple[float, bytes]:
    """The rank up to which a peer's view must have settled before it decides (``me`` is in
    ``chunk``). A leader's own: later peers only append to the chunks. A peer that cannot lead
    asks the leader of its chunk, which may rank after it, and which peer that is depends on
    the peers ranked before that one: so that leader's (every peer's, while the chunk shows
    none)."""
    if can_lead:
        return me.rank
    leader = next((d for d in chunk if d.can_lead), None)
    return (math.inf, b"") if leader is None else max(me.rank, leader.rank)


def their_leader(
    chunks: Sequence[Sequence[Declaration]], mine: int, peer_id: PeerID
) -> Declaration | None:
    """The leader of ``peer_id``'s chunk, if that is not chunk ``mine`` (the asker's).

    A leader points a peer that asks it there (``Matchmaker``). Views differ after a burst of
    arrivals: a peer that cannot lead asks the leader of its chunk, often ranked after it, so
    its view may lack that leader, or a peer ranked in between, and pick another; the leader's
    view of the peers ranked before it has settled, and tells.
    """
    theirs = chunk_of(chunks, peer_id)
    if theirs == mine:
        return None
    return next((d for d in chunks[theirs] if d.can_lead and d.peer_id != peer_id), None)


def standing_refusal(
    refused: tuple[float, str] | None, now: float, request_timeout: float
) -> str | None:
    """Why a peer refused us (``refused``: when and why, or None), if that still holds (None:
    ask it). A peer that follows another may lead later (its leader may release it): asked
    again after request_timeout. Any other refusal (full, gone, not looking, went away) holds
    for the rest of the search."""
    if refused is None or refused[1] == "misplaced":  # a pointer elsewhere: may come back
        return None
    retry = request_timeout / (4 if refused[1] == "joining" else 1)
    if refused[1] in TRANSIENT_REFUSALS and now - refused[0] >= retry:
        return None
    return refused[1]


def chunk_leader(
    chunk: Iterable[Declaration],
    me: PeerID,
    may_lead: bool,
    refusal: Callable[[PeerID], str | None],
) -> Declaration | None:
    """The leader of ``chunk`` to ask (``me`` itself if it ``may_lead``), or None.

    Its first peer that can lead; if that one refused us (``refusal``: its standing reason)
    because it follows someone else, is no longer looking (its group began; or it was not our
    chunk's leader after all) or could not be reached, the next one. A chunk whose leader is
    ``full`` has formed its group without us: None. A leader that was itself asking someone a
    moment ago is asked again soon, never walked past (whoever walks past it would lead the
    same chunk a second time): None meanwhile.
    """
    for declaration in chunk:
        if declaration.peer_id == me:
            if may_lead:
                return declaration
            continue
        if not declaration.can_lead:
            continue
        reason = refusal(declaration.peer_id)
        if reason is None:
            return declaration
        if reason in ("full", "joining"):
            return None
    return None


def chunk_target(
    chunks: list[list[Declaration]],
    mine: int,
    me: PeerID,
    *,
    can_lead: bool,
    anywhere: bool,
    min_group_size: int,
    refusal: Callable[[PeerID], str | None],
) -> Declaration | None:
    """Whom to ask: the leader of chunk ``mine``, else of the next chunks; ``anywhere`` (nobody
    came to ``me`` in time) also the chunks before it, nearest first, and chunks too small to
    begin a round by themselves last (their peers look elsewhere too). None: lead (or wait)."""
    # The last chunk, too small to begin a round (the remainder), looks in the others at once.
    anywhere = anywhere or (mine == len(chunks) - 1 and len(chunks[mine]) < min_group_size)
    if not anywhere and not can_lead and not any(d.can_lead for d in chunks[mine]):
        # Its chunk keeps a place for a leader not seen yet (its store is late): wait for it.
        # Asking another chunk's leader would take the place of one of that chunk's peers.
        return None
    order = list(range(mine, len(chunks)))
    if anywhere or not can_lead:
        order += list(range(mine - 1, -1, -1))
    if anywhere:
        order.sort(key=lambda index: index != mine and len(chunks[index]) < min_group_size)
    for index in order:
        leader = chunk_leader(chunks[index], me, can_lead and not anywhere, refusal)
        if leader is None:
            continue
        if leader.peer_id == me:
            return None  # this peer leads its chunk: wait for the others
        return leader
    return None

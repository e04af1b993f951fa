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
* Because peers are ranked by when they became ready, a latecomer only appends to the list:
  chunks already cut stay as they were. Views of the DHT differ for a moment after a burst of
  arrivals, so nothing relies on them being exact: a peer refused as ``full`` tries the leader
  of the next chunk (an earlier peer that saw too short a list took its place); a chunk's
  leader that is gone or follows someone else is skipped for the next peer of its chunk that
  can lead.
* A peer whose chunk gathered nobody by its expiration asks any other leader, nearest chunks
  first (``anywhere``).

It does not hold the state machine, its phases or its actions (``matchmaking``,
``declarations``), nor any I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from kit.averaging.declarations import Declaration
from kit.p2p.identity import PeerID

#: Refusals worth asking again after a while: the peer may lead by then.
TRANSIENT_REFUSALS = frozenset({"following", "joining", "released", "duplicate"})
#: Who refused a search, when and why.
Refusals = Mapping[PeerID, tuple[float, str]]


def unreachable(refused: Refusals) -> tuple[PeerID, ...]:
    """The peers found unreachable (crashed: their declarations stay until they expire)."""
    return tuple(p for p, (_, reason) in refused.items() if reason == "unreachable")


def ranked_chunks(
    view: Iterable[Declaration],
    me: Declaration,
    gone: Collection[PeerID],
    target_group_size: int | None,
) -> tuple[list[list[Declaration]], int]:
    """The ranked view (``me`` included) cut into chunks, and the index of ``me``'s chunk.

    Peers ``gone`` are left out: a crashed peer's declaration stays in the DHT until it
    expires, and would hold a place in a chunk that nobody fills."""
    alive = [d for d in view if d.peer_id not in gone]
    ranked = sorted([*alive, me], key=lambda d: d.rank)
    size = target_group_size or len(ranked)
    chunks = [ranked[i : i + size] for i in range(0, len(ranked), size)]
    position = next(i for i, d in enumerate(ranked) if d.peer_id == me.peer_id)
    return chunks, position // size


def standing_refusal(
    refused: tuple[float, str] | None, now: float, request_timeout: float
) -> str | None:
    """Why a peer refused us (``refused``: when and why, or None), if that still holds (None:
    ask it). A peer that follows another may lead later (its leader may release it): asked
    again after request_timeout. Any other refusal (full, gone, not looking, went away) holds
    for the rest of the search."""
    if refused is None:
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
    came to ``me`` in time) also the chunks before it, nearest first. None: lead (or wait)."""
    order = list(range(mine, len(chunks)))
    # A chunk too small to begin a round (the remainder) looks in the others at once.
    anywhere = anywhere or len(chunks[mine]) < min_group_size
    if anywhere or not can_lead:
        order += list(range(mine - 1, -1, -1))
    for index in order:
        leader = chunk_leader(chunks[index], me, can_lead and not anywhere, refusal)
        if leader is None:
            continue
        if leader.peer_id == me:
            return None  # this peer leads its chunk: wait for the others
        return leader
    return None

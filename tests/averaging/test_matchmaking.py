"""The matchmaking state machine, pure: explicit ``now``, no I/O, every transition by hand.

Then swarms of pure matchmakers on a simulated DHT (stores that land late, polls that see
part of the key): up to 1,000 peers form groups of G/2..G, all full but one remainder.
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Collection, Iterable

import pytest

from kit.averaging.chunking import Cut, cut_chunks, standing_refusal
from kit.averaging.declarations import (
    Action,
    AskLeader,
    Begin,
    Declaration,
    Invite,
    MatchmakingSettings,
    MemberInfo,
    Pool,
    Refusal,
    Release,
)
from kit.averaging.matchmaking import FINAL_PHASES, TRANSITIONS, Matchmaker, Phase, Trigger
from kit.errors import ConfigError, LocalProtocolError
from kit.p2p.identity import PeerID

SETTINGS = MatchmakingSettings(
    target_group_size=4, min_group_size=2, min_matchmaking_time=5.0, request_timeout=1.0
)


def pid(n: int) -> PeerID:
    return PeerID(n.to_bytes(4, "big") * 8)


def member(n: int, *, client: bool = False, aux: bool = False, weight: float = 1.0) -> MemberInfo:
    addresses = () if client else (f"memory://{n}",)
    return MemberInfo(pid(n), client, aux, 0.0 if aux else weight, None, addresses)


def started(
    n: int,
    now: float = 100.0,
    deadline: float = 130.0,
    settings: MatchmakingSettings = SETTINGS,
    **roles: bool,
) -> Matchmaker:
    matchmaker = Matchmaker(member(n, **roles), settings)
    matchmaker.start(now, deadline)
    return matchmaker


def declaration(n: int, expiration: float, *, client: bool = False) -> Declaration:
    return Declaration(pid(n), expiration, () if client else (f"memory://{n}",))


def settle(matchmaker: Matchmaker, now: float, view: list[Declaration]) -> list[Action]:
    """Two polls in a row with the same view: the matchmaker decides on the second."""
    assert matchmaker.observe(now, view) == [] or matchmaker.first_view < float("inf")
    return matchmaker.observe(now, view)


def test_table_covers_every_phase_and_final_phases_have_no_exit() -> None:
    assert set(TRANSITIONS) == set(Phase)
    for phase in FINAL_PHASES:
        assert TRANSITIONS[phase] == {}
    for phase, moves in TRANSITIONS.items():
        if phase not in FINAL_PHASES and phase is not Phase.IDLE:
            assert moves[Trigger.DEADLINE] is Phase.FAILED  # nobody waits past its deadline


def test_start_declares_with_the_matchmaking_expiration() -> None:
    matchmaker = Matchmaker(member(1), SETTINGS)
    declared = matchmaker.start(100.0, 130.0)
    assert matchmaker.phase is Phase.LOOKING
    assert declared == Declaration(pid(1), 105.0, ("memory://1",))
    short = Matchmaker(member(2), SETTINGS)
    assert short.start(100.0, 102.0).expiration == 102.0  # never after the deadline
    with pytest.raises(LocalProtocolError):
        short.start(100.0, 130.0)  # no transition looking --start-->


def test_client_mode_peers_declare_without_address_and_never_lead() -> None:
    client = Matchmaker(member(1, client=True), SETTINGS)
    declared = client.start(100.0, 130.0)
    assert declared.addresses == () and not declared.can_lead  # counted in chunks, never asked
    refusal, actions = client.join_request(100.0, member(2))
    assert refusal == Refusal("not_a_leader") and actions == []
    # A client joins the leader of its chunk, even one that declared after it.
    assert settle(client, 101.0, [declaration(9, 200.0)]) == [AskLeader(declaration(9, 200.0))]


def test_a_peer_decides_only_when_two_polls_agree_on_who_is_ahead() -> None:
    matchmaker = started(5)  # expiration 105
    best, tie = declaration(7, 104.0), declaration(6, 104.0)
    assert matchmaker.observe(100.1, [best]) == []  # first look: others may still be storing
    assert matchmaker.observe(100.2, [best, tie]) == []  # someone new ahead: look again
    # Same peers ahead (a later peer does not count): decide. Ties go to the smaller id.
    actions = matchmaker.observe(100.3, [best, tie, declaration(3, 106.0)])
    assert actions == [AskLeader(tie)] and matchmaker.phase is Phase.JOINING
    assert matchmaker.first_view == 100.3
    assert matchmaker.observe(100.4, [declaration(1, 90.0)]) == []  # busy joining


def test_a_poll_of_lagging_replicas_does_not_settle_the_view() -> None:
    """A poll that lacked this peer's own declaration read replicas behind the stores: the
    peers ahead it shows may be incomplete, so it cannot confirm the view (the driver says so)."""
    matchmaker = started(5)
    best = declaration(7, 104.0)
    assert matchmaker.observe(100.1, [best]) == []
    assert matchmaker.observe(100.3, [best], confirms=False) == []  # lagging: wait
    assert matchmaker.first_view == float("inf") and matchmaker.phase is Phase.LOOKING
    assert matchmaker.observe(100.4, [best]) == [AskLeader(best)]  # a confirming poll decides


def test_peers_split_into_chunks_of_the_target_size_in_rank_order() -> None:
    view = [declaration(n, 100.0 + n) for n in range(10)]  # ranks 0..9; target 4
    chosen = {}
    for n in range(10):
        matchmaker = started(n, now=95.0 + n)
        actions = settle(matchmaker, 101.0, view)
        chosen[n] = actions[0].declaration.peer_id if actions else None
    # Chunks [0 1 2 3] [4 5 6 7] [8 9]: the first of each leads, the others ask it.
    assert chosen == {0: None, 1: pid(0), 2: pid(0), 3: pid(0), 4: None, 5: pid(4), 6: pid(4),
                      7: pid(4), 8: None, 9: pid(8)}  # fmt: skip


def test_a_remainder_too_small_to_begin_asks_the_chunks_before_it() -> None:
    view = [declaration(n, 100.0 + n) for n in range(9)]  # [0..3] [4..7] [8]
    last = started(8, now=103.0)
    assert settle(last, 101.0, view) == [AskLeader(view[4])]  # the nearest chunk first
    assert last.join_answered(101.1, pid(4), Refusal("full")) == [AskLeader(view[0])]


def test_a_sharded_search_fills_its_chunk_or_moves_the_shards_remainder_to_the_pool() -> None:
    view = [declaration(n, 100.0 + n) for n in range(10)]  # the shard: [0..3] [4..7] [8 9]

    def sharded(n: int) -> Matchmaker:
        matchmaker = Matchmaker(member(n), SETTINGS, sharded=True)
        matchmaker.start(95.0 + n, 130.0)  # its expiration is 100 + n, as in the view
        return matchmaker

    full = sharded(5)
    assert settle(full, 101.0, view) == [AskLeader(view[4])]  # a full chunk forms as before
    last = sharded(9)
    assert settle(last, 101.0, view) == []  # the shard's last chunk: others may still append
    assert last.tick(108.9) == [] and last.next_wakeup(108.9) == 109.0
    [pool] = last.tick(109.0)  # they had their matchmaking time: to the pool, ranked anew
    assert pool == Pool(Declaration(pid(9), 114.0, ("memory://9",)))
    assert last.phase is Phase.LOOKING and not last.sharded and last.view == {}
    assert settle(last, 109.5, [declaration(40, 113.0)]) == [AskLeader(declaration(40, 113.0))]
    # A shard's leader whose chunk stayed short at its begin time takes its followers along.
    leader = sharded(8)
    leader.join_request(100.5, member(9))
    settle(leader, 101.0, view)
    assert leader.tick(107.9) == []
    actions = leader.tick(108.0)  # its expiration: nobody else came
    assert actions[0] == Release((pid(9),), None) and isinstance(actions[1], Pool)
    # A chunk that formed without this peer (its leader is full): the pool at once.
    late = sharded(6)
    assert settle(late, 101.0, view) == [AskLeader(view[4])]
    [pool] = late.join_answered(101.1, pid(4), Refusal("full"))
    assert isinstance(pool, Pool)


def test_a_client_first_in_its_chunk_leaves_the_lead_to_the_next_peer() -> None:
    view = [declaration(0, 100.0, client=True), *(declaration(n, 100.0 + n) for n in (1, 2))]
    assert settle(started(0, now=95.0, client=True), 101.0, view[1:]) == [AskLeader(view[1])]
    # Peer 2 can lead too, but is deferred (peer 1 leads the chunk, and more peers that
    # cannot lead may come and need 2 to begin theirs): it waits while polls show new peers.
    second = started(2, now=97.0)
    assert settle(second, 101.0, view[:2]) == []
    assert second.observe(101.2, view[:2]) == [AskLeader(view[1])]  # nobody new: it asks 1


def chunk_ids(cut: Cut) -> list[list[int]]:
    return [[index(d.peer_id) for d in chunk] for chunk in cut.chunks]


def test_chunks_keep_a_place_for_a_leader_and_spread_the_leaders() -> None:
    """Target 4. Peers 0-2 cannot lead: the first chunk keeps its last place for leader 4, and
    peer 3 begins the next chunk. Leader 6 comes while that chunk has leader 5: it is deferred,
    and begins the chunk after (in the second chunk it would lead nothing). Leader 13 is still
    deferred when the list ends: it fills the last chunk."""
    leads = {4, 5, 6, 12, 13}
    ranked = [declaration(n, 100.0 + n, client=n not in leads) for n in range(14)]
    cut = cut_chunks(ranked, 4)
    assert chunk_ids(cut) == [[0, 1, 2, 4], [3, 5, 7, 8], [6, 9, 10, 11], [12, 13]]
    assert cut.deferred == {pid(13)}
    # Which chunk a peer is in depends on the peers ranked before it only, and a group that
    # formed and withdrew leaves the other chunks as they were.
    assert chunk_ids(cut_chunks(ranked[:10], 4))[:2] == [[0, 1, 2, 4], [3, 5, 7, 8]]
    gone = {0, 1, 2, 4}
    left = cut_chunks([d for d in ranked if index(d.peer_id) not in gone], 4)
    assert chunk_ids(left) == [[3, 5, 7, 8], [6, 9, 10, 11], [12, 13]]
    # When every peer can lead, chunks are consecutive (as before peers could be NAT'd).
    plain = [declaration(n, 100.0 + n) for n in range(6)]
    assert chunk_ids(cut_chunks(plain, 4)) == [[0, 1, 2, 3], [4, 5]]
    assert cut_chunks(plain, 4).deferred == frozenset()


@pytest.mark.parametrize("seed", range(300))
def test_chunks_in_random_orders(seed: int) -> None:
    """Random orders, 0-100% of the peers unable to lead. Every chunk is in rank order, full
    but the last when each holds a leader; with a leader per group or more, each does (groups
    of 16 or 32: only a few leaders are held back, so in rare orders, about one in 30,000, the
    last chunk still finds none). When the first chunks form and withdraw, the chunks after
    them stay as they were (those of leaders held to the end aside: they wait)."""
    rng = random.Random(seed)
    n, size = rng.randint(2, 300), rng.choice([2, 3, 4, 8, 16, 32])
    share = rng.random()
    ranked = [declaration(i, 100.0 + i, client=rng.random() < share) for i in range(n)]
    cut = cut_chunks(ranked, size)
    assert all(chunk == sorted(chunk, key=lambda d: d.rank) for chunk in cut.chunks)
    assert sorted(d.rank for chunk in cut.chunks for d in chunk) == [d.rank for d in ranked]
    assert all(len(chunk) <= size for chunk in cut.chunks)
    led = all(any(d.can_lead for d in chunk) for chunk in cut.chunks)
    if size >= 16 and sum(d.can_lead for d in ranked) >= math.ceil(n / size):
        assert led
    if led:  # (chunks that keep a place for a leader nobody brings are short)
        assert [len(chunk) for chunk in cut.chunks[:-1]] == [size] * (n // size - (n % size == 0))

    def settled(cut: Cut) -> list[list[Declaration]]:
        return [c for c in cut.chunks if not any(d.peer_id in cut.deferred for d in c)]

    formed = rng.randint(0, len(settled(cut)))
    gone = {d.peer_id for chunk in settled(cut)[:formed] for d in chunk}
    rest = [d for d in ranked if d.peer_id not in gone]
    if any(not d.can_lead for d in rest):  # (with only leaders left, none is held back)
        assert settled(cut_chunks(rest, size)) == settled(cut)[formed:]


def test_refusals_walk_the_chunk_or_move_to_the_next_chunk() -> None:
    view = [declaration(n, 100.0 + n) for n in range(8)]
    matchmaker = started(3, now=98.0)
    assert settle(matchmaker, 101.0, view) == [AskLeader(view[0])]
    # Peer 0 follows someone else: its leader is asked, if it says who; else the next peer.
    actions = matchmaker.join_answered(101.1, pid(0), Refusal("following", view[7]))
    assert actions == [AskLeader(view[7])]
    actions = matchmaker.join_answered(101.1, pid(7), Refusal("following"))
    assert actions == [AskLeader(view[1])]
    # Peer 1's group is full: this chunk formed without us, the next chunk's leader is asked.
    assert matchmaker.join_answered(101.2, pid(1), Refusal("full")) == [AskLeader(view[4])]
    # A refusal for following is worth asking again after request_timeout; full is not.
    actions = matchmaker.join_answered(101.3, pid(4), Refusal("not_looking"))
    assert actions == [AskLeader(view[5])]  # 4 is not looking: the next of its chunk
    matchmaker.join_answered(101.3, pid(5), Refusal("full"))
    assert matchmaker.phase is Phase.LOOKING
    assert matchmaker.observe(101.5, view) == []  # 0 and 7 follow, 1 and 5 are full: lead
    assert matchmaker.observe(102.2, view) == [AskLeader(view[0])]  # 0 may lead by now


def test_unreachable_peers_leave_the_count_and_chunk_mates_are_told() -> None:
    dead = [declaration(n, 10.0 + n) for n in (80, 81)]  # crashed: their declarations linger
    live = [declaration(n, 100.0 + n) for n in range(4)]
    first = started(0, now=95.0)
    assert settle(first, 101.0, dead + live[1:]) == [AskLeader(dead[0])]
    assert first.join_answered(101.1, pid(80), Refusal("unreachable")) == [AskLeader(dead[1])]
    # Both gone: [0 1 2 3] is one chunk, peer 0 leads it, and tells 2 and 3 (who counted
    # themselves in the next chunk) about the dead; 1 was in its chunk anyway but is told too.
    actions = first.join_answered(101.2, pid(81), Refusal("unreachable"))
    assert {a.peer.peer_id for a in actions if isinstance(a, Invite)} == {pid(1), pid(2), pid(3)}
    assert all(isinstance(a, Invite) and set(a.gone) == {pid(80), pid(81)} for a in actions)
    assert first.observe(101.3, dead + live[1:]) == []  # each is told once
    third = started(2, now=97.0)
    assert settle(third, 101.0, dead + [live[0], live[1], live[3]]) == []  # [80 81 0 1] [2 3]
    assert third.invited_by(101.4, live[0], [pid(80), pid(81)]) == [AskLeader(live[0])]


def test_leader_accepts_until_target_size_then_begins_at_once() -> None:
    leader = started(1)
    settle(leader, 100.05, [])
    for n in (2, 3):
        refusal, actions = leader.join_request(100.5, member(n))
        assert refusal is None and actions == []
        assert leader.phase is Phase.LEADING
    refusal, actions = leader.join_request(100.6, member(4, aux=True))
    assert refusal is None
    assert actions == [Begin((member(1), member(2), member(3), member(4, aux=True)))]
    assert leader.phase is Phase.ASSEMBLED
    refusal, _ = leader.join_request(100.7, member(5))
    assert refusal == Refusal("not_looking")


def test_a_full_leader_begins_once_its_view_settled_and_lets_misplaced_followers_go() -> None:
    """Peer 4 leads [4 5 6 7] (target 4) and is asked by 1, 5 and 6 before its view settled:
    full, it waits for its view, which puts 1 in chunk [0 1 2 3]: 1 is pointed to 0."""
    view = [declaration(n, 100.0 + n) for n in range(8)]
    leader = started(4, now=99.0)  # expiration 104
    for n in (1, 5, 6):
        assert leader.join_request(100.2, member(n)) == (None, [])  # full, but unsettled
    assert leader.phase is Phase.LEADING and leader.tick(100.3) == []
    others = [d for d in view if d.peer_id != pid(4)]
    assert settle(leader, 100.4, others) == [Release((pid(1),), view[0], "misplaced")]
    assert leader.followers.keys() == {pid(5), pid(6)}
    refusal, actions = leader.join_request(100.5, member(7))
    assert refusal is None and actions == [Begin(tuple(member(n) for n in (4, 5, 6, 7)))]


def test_a_leader_points_a_peer_of_another_chunk_to_its_leader_once() -> None:
    """Client 2 saw too short a view and asks 4, the leader of [4 5 6 7]: 4 points it to 0,
    which leads 2's chunk. A peer pointed away may come back (0 may be full): taken then."""
    view = [declaration(n, 100.0 + n, client=n in (2, 3)) for n in range(8)]
    leader = started(4, now=99.0)  # expiration 104
    settle(leader, 100.5, [d for d in view if d.peer_id != pid(4)])
    pointed = (Refusal("misplaced", view[0]), [])
    assert leader.join_request(100.6, member(2, client=True)) == pointed
    assert leader.join_request(100.8, member(2, client=True))[0] is None  # the second time
    client = started(2, now=97.0, client=True)
    settle(client, 100.5, view[2:])  # the view of a client whose polls lag behind
    assert client.phase is Phase.JOINING and client.leader == view[4]
    actions = client.join_answered(100.6, pid(4), Refusal("misplaced", view[0]))
    assert actions == [AskLeader(view[0])]
    assert standing_refusal(client.refused[pid(4)], 100.6, 1.0) is None  # 4 may be asked again
    # Released as misplaced, a follower may come back too; any other release holds a while.
    follower = started(2, now=97.0, client=True)
    settle(follower, 100.5, view[2:])
    follower.join_answered(100.6, pid(4), None)
    assert follower.leader_lost(100.7, pid(4), view[0], "misplaced") == [AskLeader(view[0])]
    assert follower.refused[pid(4)] == (100.7, "misplaced")
    other = started(2, now=97.0, client=True)
    settle(other, 100.5, view[2:])
    other.join_answered(100.6, pid(4), None)
    other.leader_lost(100.7, pid(4), view[0], "unreachable")  # from the wire: not trusted
    assert other.refused[pid(4)] == (100.7, "released")


def test_a_peer_that_cannot_lead_waits_until_its_view_up_to_its_leader_settled() -> None:
    """Client 0 ranks first: nobody is ahead of it, but which peer leads its chunk depends on
    the peers ranked before that leader, whose stores may land late."""
    client = started(0, now=95.0, client=True)  # expiration 100
    five, three, four = (
        declaration(5, 105.0),
        declaration(3, 103.0, client=True),
        declaration(4, 104.0),
    )
    assert client.observe(100.1, [five]) == []
    assert client.observe(100.2, [five, three]) == []  # someone new before 5: wait
    assert client.observe(100.3, [five, three, four]) == []  # 4 leads the chunk now: wait
    assert client.observe(100.4, [five, three, four]) == [AskLeader(four)]


def test_a_leader_waits_for_the_leaders_deferred_to_its_chunk() -> None:
    """[c0 1 c2 3] (target 4): 3 comes while 1 leads the chunk, and is deferred to the end. It
    joins once polls show nobody new, at its expiration at the latest: 1 waits for it."""
    view = [declaration(n, 100.0 + n, client=n in (0, 2)) for n in range(4)]
    leader = started(1, now=96.0, deadline=130.0)  # expiration 101
    settle(leader, 96.5, [view[0], view[2], view[3]])
    leader.join_request(100.6, member(0, client=True))
    leader.join_request(100.6, member(2, client=True))
    assert leader.tick(102.0) == [] and leader.next_wakeup(102.0) == 104.0  # 3's expiration + 1
    assert leader.join_request(102.5, member(3))[1] == [
        Begin((member(1), member(0, client=True), member(2, client=True), member(3)))
    ]


def test_full_group_refuses_and_duplicates_are_refused() -> None:
    leader = started(1, settings=MatchmakingSettings(target_group_size=None, min_group_size=3))
    assert leader.join_request(100.0, member(2))[0] is None
    assert leader.join_request(100.0, member(2))[0] == Refusal("duplicate")
    capped = started(1, settings=MatchmakingSettings(target_group_size=3, min_group_size=3))
    capped.join_request(100.0, member(2))
    capped.followers[pid(3)] = member(3)  # as if full: a target of 3 with 2 followers
    assert capped.join_request(100.0, member(4))[0] == Refusal("full")


def test_leader_begins_once_settled_and_only_with_enough_members() -> None:
    settings = MatchmakingSettings(None, 3, min_matchmaking_time=5, request_timeout=1)
    leader = started(1, settings=settings)
    leader.join_request(101.0, member(2))
    # Without a view of the DHT yet, it waits past its expiration (others may not see it yet).
    assert leader.next_wakeup(101.0) == 129.0  # until the deadline less a request_timeout
    settle(leader, 104.5, [declaration(2, 105.5)])
    assert leader.next_wakeup(104.5) == 105.5  # its first view + request_timeout
    assert leader.tick(105.5) == []  # 2 < min_group_size: keep waiting for more
    assert leader.phase is Phase.LEADING
    refusal, actions = leader.join_request(106.0, member(3))
    assert refusal is None and actions == [Begin((member(1), member(2), member(3)))]
    early = started(4, settings=settings)
    settle(early, 100.1, [])
    assert early.next_wakeup(100.1) == 105.0  # seen early: its expiration holds


def test_deadline_fails_and_releases_followers() -> None:
    settings = MatchmakingSettings(target_group_size=None, min_group_size=3)
    leader = started(1, deadline=110.0, settings=settings)
    leader.join_request(101.0, member(2))
    assert leader.tick(109.9) == []
    assert leader.tick(110.0) == [Release((pid(2),), None)]
    assert leader.phase is Phase.FAILED and "no group" in leader.failure
    assert leader.next_wakeup(110.0) == float("inf")
    lonely = started(3, deadline=110.0)
    assert lonely.tick(110.0) == [] and lonely.phase is Phase.FAILED


def test_giving_up_stops_only_a_search_nobody_counts_on() -> None:
    """The caller gives up (the others stepped past its epoch): a looking peer stops, a leader
    whose group has not begun releases its followers; a peer that asked a leader does not (the
    leader may be announcing a group with it right now: leaving then cost that group a member's
    parts), nor one that follows or whose group began."""
    looking = started(5)
    assert looking.give_up("the others moved on") == [] and looking.phase is Phase.FAILED
    leader = started(5)
    settle(leader, 100.05, [])
    leader.join_request(100.1, member(6))
    assert leader.give_up("the others moved on") == [Release((pid(6),), None)]
    assert leader.phase is Phase.FAILED and leader.failure == "the others moved on"
    joining = started(5)
    better = declaration(2, 104.0)
    assert settle(joining, 100.05, [better]) == [AskLeader(better)]
    assert joining.give_up("the others moved on") is None and joining.phase is Phase.JOINING
    assert joining.join_answered(100.1, pid(2), None) == []  # its group may begin: it follows
    assert joining.give_up("the others moved on") is None and joining.phase is Phase.FOLLOWING
    full = started(1, settings=MatchmakingSettings(target_group_size=2, min_group_size=2))
    settle(full, 100.05, [])
    full.join_request(100.1, member(6))  # full: it began
    assert full.phase is Phase.ASSEMBLED and full.give_up("the others moved on") is None


def test_a_leader_that_sees_a_better_leader_of_its_chunk_brings_its_followers() -> None:
    leader = started(5)
    settle(leader, 100.05, [])
    leader.join_request(100.1, member(6))
    better = declaration(2, 104.0)
    actions = leader.observe(100.2, [better, declaration(6, 106.0)])
    assert actions == [Release((pid(6),), better), AskLeader(better)]
    assert leader.phase is Phase.JOINING and leader.followers == {}
    assert leader.join_answered(100.3, pid(2), None) == []
    assert leader.phase is Phase.FOLLOWING
    # While following, join requests are refused with the leader to ask instead.
    assert leader.join_request(100.4, member(7)) == (Refusal("following", better), [])
    # Released with a suggestion: it asks the suggested leader directly.
    suggested = declaration(3, 103.0)
    assert leader.leader_lost(100.5, pid(2), suggested) == [AskLeader(suggested)]


def test_leader_lost_and_followers_leaving() -> None:
    follower = started(5)
    settle(follower, 100.0, [declaration(1, 104.0)])
    follower.join_answered(100.1, pid(1), None)
    assert follower.leader_lost(100.2, pid(9)) == []  # not our leader
    follower.leader_lost(100.2, pid(1))
    assert follower.phase is Phase.LOOKING and follower.leader is None
    leader = started(1)
    leader.join_request(100.0, member(2))
    leader.join_request(100.0, member(3))
    leader.follower_left(100.1, pid(2))
    assert leader.phase is Phase.LEADING
    leader.follower_left(100.1, pid(3))
    assert leader.phase is Phase.LOOKING and leader.followers == {}


def test_group_received_only_from_the_leader_while_following() -> None:
    follower = started(5)
    with pytest.raises(LocalProtocolError):
        follower.group_received(100.0, pid(1))
    settle(follower, 100.0, [declaration(1, 104.0)])
    follower.join_answered(100.1, pid(1), None)
    with pytest.raises(LocalProtocolError):
        follower.group_received(100.2, pid(2))
    follower.group_received(100.2, pid(1))
    assert follower.phase is Phase.ASSEMBLED
    assert follower.cancel("done") == [] and follower.phase is Phase.ASSEMBLED


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="help:"):
        MatchmakingSettings(min_group_size=1)
    with pytest.raises(ConfigError, match="help:"):
        MatchmakingSettings(target_group_size=2, min_group_size=3)
    with pytest.raises(ConfigError, match="help:"):
        MatchmakingSettings(request_timeout=0)


# --- swarms of pure matchmakers ----------------------------------------------------------------


class PureSwarm:
    """Matchmakers on a simulated DHT: a peer's declaration becomes visible a random time in
    ``store_delay`` after it started (stores of a burst land in any order), a poll shows each
    visible declaration with probability ``visibility``, answers arrive at once. Peers poll
    every ``poll_period`` once their own store landed; the rest follows the actions."""

    def __init__(
        self,
        n: int,
        settings: MatchmakingSettings,
        rng: random.Random,
        *,
        spread: float,
        store_delay: tuple[float, float],
        visibility: float = 1.0,
        window: float = 60.0,
        shards: int = 1,
        clients: Collection[int] = (),
    ) -> None:
        self.rng, self.visibility, self.store_delay = rng, visibility, store_delay
        self.starts = {i: 100.0 + rng.random() * spread for i in range(n)}
        self.landed = {i: t + rng.uniform(*store_delay) for i, t in self.starts.items()}
        self.next_poll = dict(self.landed)
        sharded = shards > 1  # shards by a random draw per peer (a hash of its id in the driver)
        self.keys = {i: f"shard{rng.randrange(shards)}" if sharded else "" for i in range(n)}
        self.peers = {
            i: Matchmaker(member(i, client=i in clients), settings, sharded=sharded)
            for i in range(n)
        }
        self.declarations: dict[int, Declaration] = {}
        self.window = window
        self.groups: list[tuple[MemberInfo, ...]] = []

    def run(self, poll_period: float = 0.2, step: float = 0.05) -> None:
        now = min(self.starts.values())
        end = now + self.window + 1.0
        next_poll = self.next_poll
        while now < end:
            for i, started_at in self.starts.items():
                if self.peers[i].phase is Phase.IDLE and started_at <= now:
                    self.declarations[i] = self.peers[i].start(started_at, started_at + self.window)
            for i, peer in self.peers.items():
                if peer.phase in (Phase.LOOKING, Phase.LEADING) and next_poll[i] <= now:
                    next_poll[i] = now + poll_period
                    self.execute(i, peer.observe(now, self.visible(now, i)), now)
            for i, peer in self.peers.items():
                if peer.phase is not Phase.IDLE:
                    self.execute(i, peer.tick(now), now)
            now += step

    def visible(self, now: float, me: int) -> list[Declaration]:
        return [
            d
            for i, d in self.declarations.items()
            if i != me
            and self.keys[i] == self.keys[me]
            and self.landed[i] <= now
            and self.peers[i].phase not in FINAL_PHASES  # withdrawn (or never finished)
            and self.rng.random() < self.visibility
        ]

    def execute(self, actor: int, actions: Iterable[Action], now: float) -> None:
        pending = collections.deque((actor, action) for action in actions)
        while pending:
            actor, action = pending.popleft()
            peer = self.peers[actor]
            if isinstance(action, AskLeader):
                leader = index(action.declaration.peer_id)
                refusal, led = self.peers[leader].join_request(now, peer.me)
                pending += [(leader, a) for a in led]
                pending += [(actor, a) for a in peer.join_answered(now, pid(leader), refusal)]
            elif isinstance(action, Release):
                for follower in action.followers:
                    released = self.peers[index(follower)]
                    lost = released.leader_lost(
                        now, peer.me.peer_id, action.suggested, action.reason
                    )
                    pending += [(index(follower), a) for a in lost]
            elif isinstance(action, Invite):
                target = index(action.peer.peer_id)
                told = self.peers[target].invited_by(now, peer.declaration, action.gone)
                pending += [(target, a) for a in told]
            elif isinstance(action, Pool):  # a new declaration under the pool key, stored anew
                self.keys[actor], self.declarations[actor] = "pool", action.declaration
                self.landed[actor] = now + self.rng.uniform(*self.store_delay)
                self.next_poll[actor] = self.landed[actor]
            elif isinstance(action, Begin):
                self.groups.append(action.members)
                for follower in action.members[1:]:
                    self.peers[index(follower.peer_id)].group_received(now, peer.me.peer_id)


def index(peer_id: PeerID) -> int:
    return int.from_bytes(peer_id.to_bytes()[:4], "big")


def check_groups(swarm: PureSwarm, target: int) -> list[int]:
    sizes = sorted((len(g) for g in swarm.groups), reverse=True)
    failed = [i for i, p in swarm.peers.items() if p.phase is not Phase.ASSEMBLED]
    assert len(failed) < 2, f"{len(failed)} peers failed; groups {sizes}"
    assert sum(sizes) + len(failed) == len(swarm.peers)
    assert all(target // 2 <= s <= target for s in sizes[:-1]), sizes  # all but one remainder
    return sizes


@pytest.mark.parametrize(("n", "target"), [(64, 16), (128, 128), (256, 32), (1000, 32)])
def test_a_burst_of_peers_forms_full_groups_but_one(n: int, target: int) -> None:
    """Every peer steps within one second; stores land 0.5 s late (hundreds at once)."""
    settings = MatchmakingSettings(target, 2, min_matchmaking_time=5.0, request_timeout=1.0)
    swarm = PureSwarm(n, settings, random.Random(n), spread=1.0, store_delay=(0.2, 2.0))
    swarm.run()
    sizes = check_groups(swarm, target)
    assert sizes.count(target) == n // target  # full groups, and the remainder


@pytest.mark.parametrize(("n", "target", "shards"), [(1024, 32, 8), (512, 32, 5), (1000, 32, 8)])
def test_sharded_keys_form_full_groups_but_one(n: int, target: int, shards: int) -> None:
    """Thousands at once over S shard keys (uneven: a random shard per peer); each shard's
    remainder meets the others' in the pool: with N a multiple of G every group is full."""
    settings = MatchmakingSettings(target, 2, min_matchmaking_time=5.0, request_timeout=1.0)
    rng = random.Random(n)
    swarm = PureSwarm(n, settings, rng, spread=1.0, store_delay=(0.2, 2.0), shards=shards)
    swarm.run()
    sizes = check_groups(swarm, target)
    assert sizes.count(target) == n // target
    assert sum(key == "pool" for key in swarm.keys.values()) > 0  # the pool was used


@pytest.mark.parametrize(
    ("seed", "share", "target"),
    [*((seed, 0.9, 16) for seed in range(8)), *((seed, 0.95, 32) for seed in range(8))],
)
def test_groups_form_when_nine_in_ten_peers_or_more_cannot_lead(
    seed: int, share: float, target: int
) -> None:
    """256 peers, 90% of them behind NATs that cannot be punched (they cannot lead): 26
    leaders for 16 groups of 16; or 95%: 13 leaders for 8 groups of 32. Consecutive chunks
    would leave some without a leader, and so would chunks that keep a place for one but
    spend the others as ordinary members (the last chunks find none left in one random order
    in four); spread one per chunk, they form every group full, although views differ (stores
    land up to 2 s late) and groups that formed withdraw while others still form."""
    rng = random.Random(seed)
    n = 256
    clients = set(rng.sample(range(n), int(share * n)))
    settings = MatchmakingSettings(target, 2, min_matchmaking_time=5.0, request_timeout=1.0)
    swarm = PureSwarm(n, settings, rng, spread=1.0, store_delay=(0.2, 2.0), clients=clients)
    swarm.run()
    sizes = check_groups(swarm, target)
    assert sizes == [target] * (n // target)
    assert all(not group[0].client_mode for group in swarm.groups)  # every leader can accept


@pytest.mark.parametrize(
    ("seed", "share"), [(seed, share) for seed in range(3) for share in (0.3, 0.9)]
)
def test_arrivals_over_the_matchmaking_time_with_peers_that_cannot_lead(
    seed: int, share: float
) -> None:
    """Peers arrive over the whole matchmaking time, some of them unable to lead (30%: about
    the benchmark's default NAT, or 90%): groups that formed withdraw their declarations, so a
    late peer never sees them, and every group is full but one."""
    rng = random.Random(seed)
    n, target = 256, 16
    clients = set(rng.sample(range(n), int(share * n)))
    settings = MatchmakingSettings(target, 2, min_matchmaking_time=5.0, request_timeout=1.0)
    swarm = PureSwarm(n, settings, rng, spread=5.0, store_delay=(0.1, 0.3), clients=clients)
    swarm.run()
    assert check_groups(swarm, target) == [target] * (n // target)


@pytest.mark.parametrize("seed", range(8))
def test_arrivals_over_the_matchmaking_time(seed: int) -> None:
    """Peers arrive over the whole matchmaking time, their stores land within 0.3 s."""
    rng = random.Random(seed)
    n, target = rng.randint(40, 300), rng.choice([8, 16, 32])
    settings = MatchmakingSettings(target, 2, min_matchmaking_time=5.0, request_timeout=1.0)
    swarm = PureSwarm(n, settings, rng, spread=5.0, store_delay=(0.1, 0.3))
    swarm.run()
    check_groups(swarm, target)

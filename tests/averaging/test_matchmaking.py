"""The matchmaking state machine, pure: explicit ``now``, no I/O, every transition by hand."""

from __future__ import annotations

import random

import pytest

from kit.averaging.matchmaking import (
    FINAL_PHASES,
    TRANSITIONS,
    AskLeader,
    Begin,
    Declaration,
    Matchmaker,
    MatchmakingSettings,
    MemberInfo,
    Phase,
    Refusal,
    Release,
    Trigger,
)
from kit.errors import ConfigError, LocalProtocolError
from kit.p2p.identity import PeerID

SETTINGS = MatchmakingSettings(
    target_group_size=4, min_group_size=2, min_matchmaking_time=5.0, request_timeout=1.0
)


def pid(n: int) -> PeerID:
    return PeerID(bytes([n]) * 32)


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


def declaration(n: int, expiration: float) -> Declaration:
    return Declaration(pid(n), expiration, (f"memory://{n}",))


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
    declared = short.start(100.0, 102.0)
    assert declared is not None and declared.expiration == 102.0  # never after the deadline
    with pytest.raises(LocalProtocolError):
        short.start(100.0, 130.0)  # no transition looking --start-->


def test_client_mode_peers_never_declare_nor_lead() -> None:
    client = Matchmaker(member(1, client=True), SETTINGS)
    assert client.start(100.0, 130.0) is None
    refusal, actions = client.join_request(100.0, member(2))
    assert refusal == Refusal("not_a_leader") and actions == []
    # A client joins any leader, even one that declared after it.
    actions = client.observe(101.0, [declaration(9, 200.0)])
    assert actions == [AskLeader(declaration(9, 200.0))]


def test_joins_the_best_leader_ranked_by_expiration_then_id() -> None:
    matchmaker = started(5)  # expiration 105
    later = declaration(3, 106.0)
    assert matchmaker.observe(100.1, [later]) == []  # declared later than us: we are better
    best, tie = declaration(7, 104.0), declaration(6, 104.0)
    actions = matchmaker.observe(100.1, [later, best, tie, declaration(5, 105.0)])
    assert actions == [AskLeader(tie)]  # same expiration: the smaller id wins
    assert matchmaker.phase is Phase.JOINING
    assert matchmaker.observe(100.2, [declaration(1, 90.0)]) == []  # busy joining


def test_leader_accepts_until_target_size_then_begins_at_once() -> None:
    leader = started(1)
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


def test_full_group_refuses_and_duplicates_are_refused() -> None:
    leader = started(1, settings=MatchmakingSettings(target_group_size=None, min_group_size=3))
    assert leader.join_request(100.0, member(2))[0] is None
    assert leader.join_request(100.0, member(2))[0] == Refusal("not_looking")
    capped = started(1, settings=MatchmakingSettings(target_group_size=3, min_group_size=3))
    capped.join_request(100.0, member(2))
    capped.followers[pid(3)] = member(3)  # as if full: a target of 3 with 2 followers
    assert capped.join_request(100.0, member(4))[0] == Refusal("full")


def test_leader_begins_at_expiration_only_with_enough_members() -> None:
    settings = MatchmakingSettings(target_group_size=None, min_group_size=3, min_matchmaking_time=5)
    leader = started(1, settings=settings)
    leader.join_request(101.0, member(2))
    assert leader.next_wakeup() == 105.0
    assert leader.tick(105.0) == []  # 2 < min_group_size: keep waiting for more
    assert leader.phase is Phase.LEADING
    refusal, actions = leader.join_request(106.0, member(3))
    assert refusal is None and actions == [Begin((member(1), member(2), member(3)))]


def test_deadline_fails_and_releases_followers() -> None:
    settings = MatchmakingSettings(target_group_size=None, min_group_size=3)
    leader = started(1, deadline=110.0, settings=settings)
    leader.join_request(101.0, member(2))
    assert leader.tick(109.9) == []
    assert leader.tick(110.0) == [Release((pid(2),), None)]
    assert leader.phase is Phase.FAILED and "no group" in leader.failure
    assert leader.next_wakeup() == float("inf")
    lonely = started(3, deadline=110.0)
    assert lonely.tick(110.0) == [] and lonely.phase is Phase.FAILED


def test_a_leader_that_sees_a_better_leader_brings_its_followers() -> None:
    leader = started(5)
    leader.join_request(100.1, member(6))
    better = declaration(2, 104.0)
    actions = leader.observe(100.2, [better])
    assert actions == [Release((pid(6),), better), AskLeader(better)]
    assert leader.phase is Phase.JOINING and leader.followers == {}
    assert leader.join_answered(100.3, pid(2), None) == []
    assert leader.phase is Phase.FOLLOWING
    # While following, join requests are refused with the leader to ask instead.
    assert leader.join_request(100.4, member(7)) == (Refusal("following", better), [])


def test_refused_leaders_are_not_asked_again_for_request_timeout() -> None:
    matchmaker = started(5)
    leader = declaration(2, 104.0)
    matchmaker.observe(100.0, [leader])
    assert matchmaker.join_answered(100.1, pid(2), Refusal("full")) == []
    assert matchmaker.phase is Phase.LOOKING
    assert matchmaker.observe(100.5, [leader]) == []  # refused 0.4 s ago
    assert matchmaker.observe(101.2, [leader]) == [AskLeader(leader)]


def test_a_refusal_naming_another_leader_goes_there_directly() -> None:
    matchmaker = started(5)
    matchmaker.observe(100.0, [declaration(3, 104.0)])
    suggested = declaration(1, 103.0)
    actions = matchmaker.join_answered(100.1, pid(3), Refusal("following", suggested))
    assert actions == [AskLeader(suggested)] and matchmaker.phase is Phase.JOINING
    # An answer from someone we did not ask changes nothing.
    assert matchmaker.join_answered(100.2, pid(3), None) == []


def test_leader_lost_and_followers_leaving() -> None:
    follower = started(5)
    follower.observe(100.0, [declaration(1, 104.0)])
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
    follower.observe(100.0, [declaration(1, 104.0)])
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


def _deliver(peers: dict[int, Matchmaker], actor: int, action: object, now: float) -> list:
    """What the driver would do with one action, on a network where answers arrive at once."""
    if isinstance(action, AskLeader):
        leader = action.declaration.peer_id.to_bytes()[0]
        refusal, actions = peers[leader].join_request(now, peers[actor].me)
        answered = peers[actor].join_answered(now, action.declaration.peer_id, refusal)
        return [(leader, a) for a in actions] + [(actor, a) for a in answered]
    if isinstance(action, Release):
        follow_ups = []
        for follower in action.followers:
            released = peers[follower.to_bytes()[0]]
            follow_ups += [
                (follower.to_bytes()[0], a) for a in released.leader_lost(now, pid(actor))
            ]
            if action.suggested is not None:
                suggested = released.observe(now, [action.suggested])
                follow_ups += [(follower.to_bytes()[0], a) for a in suggested]
        return follow_ups
    return []


@pytest.mark.parametrize("seed", range(20))
def test_peers_with_stale_views_converge_on_one_group(seed: int) -> None:
    """Peers poll random subsets of the DHT (stale views); they still end in one group."""
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    settings = MatchmakingSettings(min_group_size=2, min_matchmaking_time=5)
    peers = {i: Matchmaker(member(i), settings) for i in range(n)}
    declarations = [m.start(100.0 + rng.random(), 200.0) for m in peers.values()]
    now = 101.0
    for _ in range(300):
        now += 0.005
        poller = rng.randrange(n)
        visible = [d for d in declarations if d is not None and rng.random() < 0.6]
        pending = [(poller, a) for a in peers[poller].observe(now, visible)]
        while pending:
            pending += _deliver(peers, *pending.pop(0), now)
    leaders = [m for m in peers.values() if m.phase is Phase.LEADING]
    best = min((d for d in declarations if d is not None), key=lambda d: d.rank)
    assert [m.me.peer_id for m in leaders] == [best.peer_id]
    assert all(
        m.phase is Phase.FOLLOWING and m.leader == best for m in peers.values() if m not in leaders
    )
    actions = leaders[0].tick(leaders[0].expiration)
    assert len(actions) == 1 and isinstance(actions[0], Begin) and len(actions[0].members) == n

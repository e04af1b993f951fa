"""What a login may cost the Hub (pure): rationed lookups and cached answers."""

from __future__ import annotations

import pytest

from kit.auth.authority import HubUser
from kit.auth.login_limits import LoginLimits, WhoamiCache
from kit.errors import ConfigError, InvalidHubToken


def test_a_client_gets_a_burst_then_a_steady_rate() -> None:
    limits = LoginLimits(per_client_burst=5, per_client_per_minute=5, burst=100, per_minute=600)
    assert [limits.admit("mallory", 0.0) for _ in range(5)] == [0.0] * 5
    wait = limits.admit("mallory", 0.0)
    assert wait == pytest.approx(12.0)  # 5 per minute: one every 12 s
    assert limits.admit("mallory", 6.0) == pytest.approx(6.0)  # nothing was taken meanwhile
    assert limits.admit("mallory", 12.0) == 0.0
    assert limits.admit("alice", 12.0) == 0.0  # another address has its own burst


def test_all_clients_together_are_rationed_too() -> None:
    limits = LoginLimits(per_client_burst=5, per_client_per_minute=5, burst=10, per_minute=60)
    admitted = [limits.admit(f"10.0.0.{i}", 0.0) == 0.0 for i in range(30)]
    assert sum(admitted) == 10  # a botnet of 30 addresses makes 10 lookups, not 150
    assert limits.admit("10.0.0.99", 0.5) == pytest.approx(0.5)
    assert limits.admit("10.0.0.99", 1.0) == 0.0


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigError, match="help:"):
        LoginLimits(per_client_burst=0)


def test_users_are_cached_for_the_token_lifetime_refusals_for_less() -> None:
    cache = WhoamiCache(valid_ttl=1800.0, invalid_ttl=300.0)
    alice, refused = HubUser("alice"), InvalidHubToken("unknown token")
    cache.put(b"a", alice, 0.0)
    cache.put(b"x", refused, 0.0)
    assert cache.get(b"a", 1799.0) == alice and cache.get(b"x", 299.0) is refused
    assert cache.get(b"a", 1800.0) is None and cache.get(b"x", 300.0) is None
    assert cache.get(b"never", 0.0) is None
    cache.valid_ttl = 0.0  # off: nothing is kept, and what was kept is not used
    cache.put(b"b", alice, 0.0)
    assert cache.get(b"b", 0.0) is None

"""The token endpoint on a real coordinator peer, asked over HTTP, with the fake Hub behind it."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import urllib.error
import urllib.request

import pytest

from kit.auth import Allowlist, HttpTokenSource, verify_token
from kit.errors import (
    BadSignature,
    ConfigError,
    InvalidHubToken,
    NotAllowlisted,
    Revoked,
    TokenServiceUnavailable,
)
from kit.p2p.identity import Identity, b58encode
from tests.auth.allowlisted import RUN_ID, TOKENS, allowlisted_run

pytestmark = pytest.mark.sockets


def get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def test_allowlisted_users_get_a_token_for_their_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with allowlisted_run() as run:
        for user in ("alice", "bob"):  # alice by name, bob as a member of neuropark
            identity = Identity.generate()
            source = HttpTokenSource(run.url, TOKENS[user])
            answer = await source.request(identity.public_key)
            assert (answer.username, answer.run_id) == (user, RUN_ID)
            assert answer.authority_public_key == run.issuer.authority_public_key
            token = answer.token
            assert token.expiration_time == answer.expires_at
            verify_token(
                token,
                run.issuer.authority_public_key,
                now=token.expiration_time - 1,
                peer_public_key=identity.public_key,
                run_id=RUN_ID,
            )
            again = await source(identity.public_key)  # a token source for the authorizer
            assert (again.username, again.peer_public_key) == (user, identity.public_key)
            assert "hf_" not in repr(source)
    assert caplog.text and not any(secret in caplog.text for secret in TOKENS.values())


async def test_refusals_are_json_a_volunteer_can_act_on() -> None:
    async with allowlisted_run() as run:
        key = b58encode(Identity.generate().public_key)
        url = f"{run.url}/api/token?peer_public_key={key}"
        cases = [
            ({}, 401, "missing_hf_token"),
            ({"Authorization": "Basic abc"}, 401, "missing_hf_token"),
            ({"Authorization": "Bearer hf_nobody"}, 401, "invalid_hf_token"),
            ({"Authorization": f"Bearer {TOKENS['mallory']}"}, 403, "not_allowlisted"),
        ]
        for headers, status, code in cases:
            answer = await asyncio.to_thread(get, url, headers)
            assert answer[0] == status and answer[1]["error"] == code
            assert "help:" in str(answer[1]["message"])
        answer = await asyncio.to_thread(get, url, {"Authorization": f"Bearer {TOKENS['mallory']}"})
        assert "ask the organizer to add you" in str(answer[1]["message"])
        bad_key = f"{run.url}/api/token?peer_public_key=0OIl"
        answer = await asyncio.to_thread(get, bad_key, {"Authorization": "Bearer hf_alice_token"})
        assert answer == (400, answer[1]) and answer[1]["error"] == "bad_peer_key"


async def test_the_client_raises_the_servers_refusal_as_a_typed_error() -> None:
    async with allowlisted_run() as run:
        key = Identity.generate().public_key
        with pytest.raises(
            NotAllowlisted, match="'mallory' is not on the allowlist.*ask the organizer"
        ):
            await HttpTokenSource(run.url, TOKENS["mallory"])(key)
        with pytest.raises(InvalidHubToken, match="refused this access token"):
            await HttpTokenSource(run.url, "hf_typo")(key)
        run.issuer.revoke(usernames=["bob"], now=0.0, duration=1e12)
        with pytest.raises(Revoked, match="'bob' is revoked"):
            await HttpTokenSource(run.url, TOKENS["bob"])(key)
        run.endpoint.allowlist = Allowlist(usernames=frozenset({"alice", "mallory"}))  # live update
        assert (await HttpTokenSource(run.url, TOKENS["mallory"])(key)).username == "mallory"
        with pytest.raises(ConfigError, match="clock_skew.*help:"):
            await run.authorizer(TOKENS["alice"], Identity.generate(), clock_skew=-1)


async def test_whoami_answers_are_cached_by_token_hash() -> None:
    async with allowlisted_run() as run:
        source = HttpTokenSource(run.url, TOKENS["alice"])
        for _ in range(3):
            await source(Identity.generate().public_key)
        whoamis = [r for r in run.hub.requests if r.path == "/api/whoami-v2"]
        assert len(whoamis) == 1
        run.endpoint.whoami_cache_ttl = 0.0
        await source(Identity.generate().public_key)
        assert len([r for r in run.hub.requests if r.path == "/api/whoami-v2"]) == 2


async def test_a_hub_that_is_down_or_hangs_is_a_transient_503() -> None:
    async with allowlisted_run() as run:
        key = Identity.generate().public_key
        with socket.socket() as hanging:
            hanging.bind(("127.0.0.1", 0))
            hanging.listen(8)  # accepts TCP connections (backlog) but never answers
            run.endpoint.hf_endpoint = f"http://127.0.0.1:{hanging.getsockname()[1]}"
            run.endpoint.whoami_timeout = 0.3
            with pytest.raises(TokenServiceUnavailable, match="did not answer whoami within 0.3 s"):
                await HttpTokenSource(run.url, TOKENS["alice"])(key)
        # closed now: connections are refused
        with pytest.raises(TokenServiceUnavailable, match="cannot reach the Hugging Face Hub"):
            await HttpTokenSource(run.url, TOKENS["bob"])(key)


async def test_an_unreachable_coordinator_is_transient() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(TokenServiceUnavailable, match="cannot reach the token endpoint.*help:"):
        await HttpTokenSource(url, "hf_x", timeout=2)(Identity.generate().public_key)


def test_the_hf_token_is_not_sent_in_clear_over_the_network() -> None:
    with pytest.raises(ConfigError, match="unencrypted - help: use the coordinator's https://"):
        HttpTokenSource("http://203.0.113.5:31337", "hf_x")
    assert HttpTokenSource("http://203.0.113.5:31337", "hf_x", allow_insecure_http=True)
    assert HttpTokenSource("wss://coord.example.org:443/", "hf_x").url == (
        "https://coord.example.org:443/api/token"
    )
    assert HttpTokenSource("ws://localhost:8000", "hf_x").url == "http://localhost:8000/api/token"
    with pytest.raises(ConfigError, match="not an http"):
        HttpTokenSource("/ip4/1.2.3.4/tcp/1/ws", "hf_x")


async def test_a_coordinator_with_another_authority_key_is_not_trusted() -> None:
    async with allowlisted_run() as run:
        from kit.auth import authorizer_from_coordinator

        published = Identity.generate().public_key
        with pytest.raises(BadSignature, match="not the published"):
            await authorizer_from_coordinator(
                run.url, TOKENS["alice"], Identity.generate(), authority_public_key=published
            )
        trusting = await authorizer_from_coordinator(run.url, TOKENS["alice"], Identity.generate())
        assert trusting.authority_public_key == run.issuer.authority_public_key
        assert trusting.token is not None and trusting.token.username == "alice"


def get_with_headers(url: str, headers: dict[str, str]) -> tuple[int, dict[str, object], str]:
    """(status, JSON body, Retry-After header)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status, json.loads(answer.read()), answer.headers.get("Retry-After", "")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Retry-After", "")


def whoami_calls(run) -> int:  # type: ignore[no-untyped-def]
    return len([r for r in run.hub.requests if r.path == "/api/whoami-v2"])


async def test_bogus_tokens_cost_the_hub_a_handful_of_calls_and_logins_go_on() -> None:
    """50 bogus tokens from one address used to make 50 Hub calls, and could get the coordinator
    rate-limited by the Hub (everyone's logins and renewals with it)."""
    async with allowlisted_run() as run:
        key = b58encode(Identity.generate().public_key)
        url = f"{run.url}/api/token?peer_public_key={key}"
        attacker = {"X-Forwarded-For": "203.0.113.66"}  # via a reverse proxy on this machine
        answers = [
            await asyncio.to_thread(
                get_with_headers, url, {**attacker, "Authorization": f"Bearer hf_bogus_{i}"}
            )
            for i in range(50)
        ]
        assert whoami_calls(run) == 5  # the per-address burst
        assert [status for status, _, _ in answers[:5]] == [401] * 5
        for status, body, retry_after in answers[5:]:
            assert (status, body["error"]) == (429, "rate_limited")
            assert int(retry_after) >= 1 and "help: retry in" in str(body["message"])
        # A bogus token repeated is answered from the cache (after its address' limit too).
        for _ in range(20):
            answer = await asyncio.to_thread(
                get_with_headers,
                url,
                {"X-Forwarded-For": "198.51.100.7", "Authorization": "Bearer hf_bogus_0"},
            )
            assert answer[0] == 401
        assert whoami_calls(run) == 5
        # alice logs in meanwhile (another address), and renews without asking the Hub again.
        source = HttpTokenSource(run.url, TOKENS["alice"])
        for _ in range(5):
            assert (await source(Identity.generate().public_key)).username == "alice"
        assert whoami_calls(run) == 6
        # The client raises a transient error for a 429 (the authorizer retries those).
        errors = []
        for i in range(8):  # this address (the test's) spent one lookup on alice
            try:
                await HttpTokenSource(run.url, f"hf_more_{i}")(Identity.generate().public_key)
            except (InvalidHubToken, TokenServiceUnavailable) as e:
                errors.append(e)
        assert [type(e) for e in errors] == [InvalidHubToken] * 4 + [TokenServiceUnavailable] * 4
        assert "retry in" in str(errors[-1])


async def test_lookups_at_once_are_bounded_and_one_token_is_looked_up_once(monkeypatch) -> None:
    import concurrent.futures
    import threading
    import time

    from kit.auth import endpoint as endpoint_module
    from kit.auth.authority import HubUser

    running, most, calls, answered = [0], [0], [], []
    lock = threading.Lock()
    release = threading.Event()  # the Hub answers once the test lets it

    def slow_whoami(hf_token: str, *, endpoint: str | None = None) -> HubUser:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            calls.append(hf_token)
        release.wait(10)
        with lock:
            running[0] -= 1
        return HubUser("alice")

    monkeypatch.setattr(endpoint_module, "hub_user", slow_whoami)
    async with allowlisted_run() as run:
        key = b58encode(Identity.generate().public_key)
        url = f"{run.url}/api/token?peer_public_key={key}"

        def ask(client: int, token: str) -> int:
            headers = {"X-Forwarded-For": f"10.1.0.{client}", "Authorization": f"Bearer {token}"}
            status = get_with_headers(url, headers)[0]
            answered.append(status)
            return status

        # The clients' threads of their own: the endpoint's lookups use the loop's executor.
        clients = concurrent.futures.ThreadPoolExecutor(max_workers=28)
        loop = asyncio.get_running_loop()
        # 20 requests with one HF token at once: one lookup.
        asked = asyncio.gather(
            *(loop.run_in_executor(clients, ask, 1, "hf_same") for _ in range(20))
        )
        await asyncio.sleep(0.5)  # all 20 are in
        release.set()
        assert await asked == [200] * 20 and calls == ["hf_same"]
        # 28 addresses with a token each, at once: 4 lookups run, 16 wait, and 8 are told at
        # once to come back later (429), without reaching the Hub.
        calls.clear()
        answered.clear()
        release.clear()
        asked = asyncio.gather(
            *(loop.run_in_executor(clients, ask, 2 + i, f"hf_distinct_{i}") for i in range(28))
        )
        deadline = time.monotonic() + 10
        while answered.count(429) < 8:
            assert time.monotonic() < deadline, f"answered so far: {answered}"
            await asyncio.sleep(0.05)
        assert len(calls) == 4 and answered == [429] * 8  # the Hub sees 4, the others wait
        release.set()
        assert sorted(await asked) == [200] * 20 + [429] * 8
        assert most[0] == 4 and len(calls) == 20
        clients.shutdown()

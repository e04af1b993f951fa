"""Hub identity (against the fake Hub over real HTTP), the allowlist, and the token issuer."""

from __future__ import annotations

import socket

import pytest

from kit.auth import Allowlist, HubUser, TokenIssuer, hub_endpoint, hub_user, verify_token
from kit.auth.authority import _parse_whoami
from kit.errors import ConfigError, InvalidHubToken, NotAllowlisted, TokenServiceUnavailable
from kit.p2p.identity import Identity
from kit.testing.fake_hub import FakeHub

pytestmark = pytest.mark.sockets


def test_the_hub_says_who_owns_a_token_and_refuses_unknown_ones() -> None:
    with FakeHub() as hub:
        hub.add_user("alice", token="hf_alice", orgs=["neuropark", "bengali"], token_role="read")
        assert hub_user("hf_alice", endpoint=hub.endpoint) == HubUser(
            "alice", ("bengali", "neuropark")
        )
        with pytest.raises(InvalidHubToken, match="refused this access token.*help: create"):
            hub_user("hf_unknown", endpoint=hub.endpoint)
        with pytest.raises(InvalidHubToken, match="no Hugging Face access token"):
            hub_user("", endpoint=hub.endpoint)
        assert all("hf_" not in request.path + request.query for request in hub.requests)


def test_hf_endpoint_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert hub_endpoint() == "https://huggingface.co"
    with FakeHub() as hub:
        hub.add_user("bob", token="hf_bob")
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint + "/")
        assert hub_endpoint() == hub.endpoint
        assert hub_user("hf_bob").username == "bob"
        assert hub_endpoint("http://explicit") == "http://explicit"


def test_an_unreachable_hub_is_transient() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(TokenServiceUnavailable, match="cannot reach the Hugging Face Hub.*help:"):
        hub_user("hf_x", endpoint=f"http://127.0.0.1:{port}")


@pytest.mark.parametrize(
    "answer, error",
    [
        ({"type": "org", "name": "neuropark"}, InvalidHubToken),
        ({"type": "user"}, TokenServiceUnavailable),
        ({"type": "user", "name": "@coordinator"}, TokenServiceUnavailable),
        ([], TokenServiceUnavailable),
    ],
)
def test_whoami_answers_that_are_not_a_user(answer: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        _parse_whoami(answer, "http://hub")


def test_whoami_ignores_malformed_orgs() -> None:
    answer = {"type": "user", "name": "carol", "orgs": [{"name": "ok"}, {"name": 3}, "x"]}
    assert _parse_whoami(answer, "http://hub") == HubUser("carol", ("ok",))


def test_the_allowlist_admits_listed_users_and_org_members_only() -> None:
    allowlist = Allowlist(usernames=["alice"], organizations=["neuropark"])  # type: ignore[arg-type]
    assert allowlist.usernames == frozenset({"alice"})
    allowlist.check(HubUser("alice"))
    allowlist.check(HubUser("bob", ("other", "neuropark")))
    with pytest.raises(NotAllowlisted) as refused:
        allowlist.check(HubUser("Alice", ("other",)))  # names are exact
    message = str(refused.value)
    assert "'Alice' is not on the allowlist" in message
    assert (
        "help: ask the organizer to add you" in message
        and "join the Hub organization neuropark" in message
    )
    with pytest.raises(NotAllowlisted):
        Allowlist().check(HubUser("alice"))  # empty admits nobody
    Allowlist(open=True).check(HubUser("anyone"))


@pytest.mark.parametrize(
    "arguments",
    [{"usernames": "alice"}, {"usernames": ["not a name"]}, {"organizations": ["@x"]}, {"open": 1}],
)
def test_bad_allowlists_are_config_errors(arguments: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Allowlist(**arguments)  # type: ignore[arg-type]


def test_the_issuer_signs_short_lived_tokens_for_one_key() -> None:
    authority, peer = Identity.generate(), Identity.generate()
    issuer = TokenIssuer(authority, "run", lifetime=120)
    token = issuer.issue("alice", peer.public_key, now=1000.0)
    assert (token.username, token.run_id, token.expiration_time) == ("alice", "run", 1120.0)
    verify_token(token, issuer.authority_public_key, now=1100.0, peer_public_key=peer.public_key)
    for bad in ({"lifetime": 0}, {"lifetime": float("inf")}, {"run_id": ""}):
        with pytest.raises(ConfigError):
            TokenIssuer(authority, **{"run_id": "run", **bad})  # type: ignore[arg-type]

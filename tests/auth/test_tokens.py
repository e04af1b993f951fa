"""Access tokens, pure: signing, the strict wire format, every check of verify_token, and the
bearer form that HTTP requests carry."""

from __future__ import annotations

import base64

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit.auth.tokens import (
    MAX_BEARER_CHARS,
    MAX_TOKEN_BYTES,
    AccessToken,
    bearer_header,
    token_from_bearer,
    verify_token,
)
from kit.errors import BadSignature, MalformedToken, MissingToken, TokenExpired, TokenMismatch
from kit.p2p.identity import Identity

AUTHORITY = Identity.generate()
PEER = Identity.generate()
NOW = 1_700_000_000.0


def token(**changes: object) -> AccessToken:
    fields: dict[str, object] = {
        "authority": AUTHORITY,
        "username": "alice",
        "peer_public_key": PEER.public_key,
        "run_id": "run",
        "expiration_time": NOW + 1800,
    }
    fields.update(changes)
    return AccessToken.sign(**fields)  # type: ignore[arg-type]


def wire(**changes: object) -> bytes:
    body = msgpack.unpackb(token().to_bytes())
    body.update(changes)
    return msgpack.packb(body, use_bin_type=True)


def check(received: AccessToken, **changes: object) -> None:
    options: dict[str, object] = {
        "now": NOW,
        "clock_skew": 60.0,
        "peer_public_key": PEER.public_key,
        "run_id": "run",
    }
    options.update(changes)
    verify_token(received, AUTHORITY.public_key, **options)  # type: ignore[arg-type]


def test_a_signed_token_survives_the_wire_and_verifies() -> None:
    original = token()
    data = original.to_bytes()
    assert len(data) < 250  # small enough for every handshake hello
    received = AccessToken.from_bytes(data)
    assert received == original and received.peer_id == PEER.peer_id
    check(received)
    assert "alice" in repr(received) and original.signature.hex() not in repr(received)


def test_a_token_signed_by_another_key_is_forged() -> None:
    with pytest.raises(BadSignature, match="not signed by this run's authority.*help:"):
        check(token(authority=Identity.generate()))


@pytest.mark.parametrize(
    "field, value",
    [
        ("user", "mallory"),
        ("pk", Identity.generate().public_key),
        ("run", "other"),
        ("exp", NOW + 9e9),
    ],
    ids=["user", "pk", "run", "exp"],  # (not the random key: pytest-xdist's workers must agree)
)
def test_changing_any_signed_field_breaks_the_signature(field: str, value: object) -> None:
    tampered = AccessToken.from_bytes(wire(**{field: value}))
    with pytest.raises(BadSignature):
        check(tampered, peer_public_key=None, run_id=None)


def test_the_signature_is_domain_separated() -> None:
    # The same fields signed without the domain prefix (e.g. some other kit message) do not
    # make a valid token.
    fields = ["alice", PEER.public_key, "run", NOW + 1800]
    undomained = AUTHORITY.sign(msgpack.packb(fields, use_bin_type=True))
    with pytest.raises(BadSignature):
        check(AccessToken.from_bytes(wire(sig=undomained)))


def test_a_token_for_another_peer_or_run_is_refused() -> None:
    with pytest.raises(TokenMismatch, match="issued to peer.*help: each peer gets its own"):
        check(token(), peer_public_key=Identity.generate().public_key)
    with pytest.raises(TokenMismatch, match="for run 'run', not 'other'"):
        check(token(), run_id="other")


def test_expiry_allows_the_clock_skew_and_no_more() -> None:
    check(token(expiration_time=NOW - 59))
    with pytest.raises(TokenExpired, match="expired 61 s ago.*raise clock_skew"):
        check(token(expiration_time=NOW - 61))
    with pytest.raises(TokenExpired):
        check(token(expiration_time=NOW - 1), clock_skew=0.0)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1garbage",
        msgpack.packb([1, 2, 3]),
        wire(extra=1),
        msgpack.packb({"v": 1}),
        wire(v=2),
        wire(v=True),
        wire(exp=int(NOW)),
        wire(exp=float("nan")),
        wire(exp=-1.0),
        wire(user=b"alice"),
        wire(user="not a name!"),
        wire(user="x" * 200),
        wire(pk=b"short"),
        wire(sig=b"short"),
        wire(run=""),
        wire(run="r" * 300),
        token().to_bytes() + b"\x00",  # trailing bytes
        msgpack.packb(msgpack.ExtType(1, b"x")),
        b"\x91" * 100_000,  # deep nesting, and over the size limit
        wire(user="a" * 90, run="r" * 256) + b" " * MAX_TOKEN_BYTES,
    ],
    ids=[
        "empty", "garbage", "list", "extra-key", "missing-keys", "version", "bool-version",
        "int-exp", "nan-exp", "negative-exp", "bytes-user", "bad-user", "long-user", "short-key",
        "short-sig", "empty-run", "long-run", "trailing", "ext-type", "nested", "oversized",
    ],
)  # fmt: skip
def test_malformed_tokens_get_a_typed_error(data: bytes) -> None:
    with pytest.raises(MalformedToken):
        AccessToken.from_bytes(data)


@given(st.binary(max_size=400))
def test_random_bytes_never_raise_anything_but_malformed_token(data: bytes) -> None:
    try:
        AccessToken.from_bytes(data)
    except MalformedToken:
        pass


def test_signing_refuses_bad_fields() -> None:
    with pytest.raises(MalformedToken):
        token(username="")
    with pytest.raises(MalformedToken):
        token(peer_public_key=b"x" * 31)


def test_the_bearer_form_round_trips_and_is_url_safe() -> None:
    original = token()
    header = bearer_header(original)
    scheme, value = header.split(" ")
    assert scheme == "Bearer" and set(value) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_="
    )
    assert base64.urlsafe_b64decode(value) == original.to_bytes()
    assert token_from_bearer(header) == original
    assert token_from_bearer(f"  bearer {value.rstrip('=')}  ") == original  # case, padding


@pytest.mark.parametrize("header", [None, "", "   "])
def test_no_bearer_header_is_a_missing_token_with_help(header: str | None) -> None:
    with pytest.raises(MissingToken, match="allowlisted users only - help:"):
        token_from_bearer(header)


@pytest.mark.parametrize(
    "header",
    [
        "Bearer",  # no token
        "Basic " + base64.b64encode(b"alice:secret").decode(),  # another scheme
        "Bearer abc+/def",  # standard base64, not base64url
        "Bearer a",  # not a whole byte
        "Bearer ab=c",  # padding inside
        "Bearer " + "é" * 10,  # not ASCII
        "Bearer two words",
        "Bearer " + base64.urlsafe_b64encode(b"garbage").decode(),  # base64url, not a token
        "Bearer " + base64.urlsafe_b64encode(wire(user=b"alice")).decode(),  # a bad token
        "Bearer " + "A" * (MAX_BEARER_CHARS + 1),  # oversize: refused before decoding
        "Bearer " + "A" * 10_000_000,
    ],
    ids=[
        "empty", "basic", "std-base64", "one-char", "inner-padding", "non-ascii", "two-words",
        "garbage", "bad-token", "oversize", "huge",
    ],
)  # fmt: skip
def test_malformed_bearer_headers_get_a_typed_error_with_help(header: str) -> None:
    with pytest.raises(MalformedToken) as refused:
        token_from_bearer(header)
    assert "help:" in str(refused.value)


def test_an_oversize_bearer_header_is_refused_before_decoding(monkeypatch) -> None:
    decoded: list[object] = []
    monkeypatch.setattr(base64, "urlsafe_b64decode", lambda data: decoded.append(data))
    with pytest.raises(MalformedToken, match="more than the"):
        token_from_bearer("Bearer " + "A" * (MAX_BEARER_CHARS + 1))
    assert decoded == []
    # The longest real token fits.
    longest = token(username="a" * 96, run_id="r" * 256)
    assert len(bearer_header(longest)) <= MAX_BEARER_CHARS


@given(st.text(max_size=300))
def test_random_headers_never_raise_anything_but_missing_or_malformed(header: str) -> None:
    try:
        token_from_bearer(header)
    except (MissingToken, MalformedToken):
        pass

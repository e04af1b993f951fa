"""Plain HTTP GETs to a coordinator: bounded in size and time, with typed errors.

Volunteers talk to the coordinator's port over plain HTTP(S) for everything that is not a peer
connection: ``/api/run``, the tokenizer, the served data shards (by byte range), the kit wheel,
the leaderboard. This module holds the one blocking GET they all use (``urllib``: nothing to
install, proxies from the environment except for loopback) and its answer. Call it from a
worker thread, never from the runtime loop. It doesn't know what is fetched: the callers
(``kit.remote_run``, ``kit.data.remote``) parse and validate the bodies.
"""

from __future__ import annotations

import dataclasses
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

from kit.errors import AccessRefused, CoordinatorUnreachable

#: Answers larger than this from a coordinator are refused (run info, tokenizer, leaderboard).
MAX_ANSWER_BYTES = 64 * 1024 * 1024
#: How much of a refusal's body (its reason) is read.
MAX_REASON_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class HttpAnswer:
    """One answer: the status, the headers (lower-case names) and the body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


def _opener(url: str, ssl_context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = []
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("localhost", "::1") or host.startswith("127."):
        handlers.append(urllib.request.ProxyHandler({}))  # a proxy cannot reach our loopback
    if ssl_context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ssl_context))
    return urllib.request.build_opener(*handlers)


def http_request(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 15.0,
    limit: int = MAX_ANSWER_BYTES,
    ssl_context: ssl.SSLContext | None = None,
) -> HttpAnswer:
    """GET ``url`` and read at most ``limit`` bytes of its body.

    Raises:
        AccessRefused: the answer is 401 or 403 (no valid access token); the server's reason.
        CoordinatorUnreachable: no answer, another HTTP error status, or a body over ``limit``;
            the message says what to do.
    """
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with _opener(url, ssl_context).open(request, timeout=timeout) as answer:
            body: bytes = answer.read(limit + 1)
            status = int(answer.status)
            names = {name.lower(): value for name, value in answer.headers.items()}
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise AccessRefused(_refusal_reason(url, error), error.code) from None
        raise CoordinatorUnreachable(
            f"{url} answered HTTP {error.code} - help: check the address with the organizer"
        ) from None
    except (OSError, ValueError) as error:
        raise CoordinatorUnreachable(
            f"cannot reach {url}: {getattr(error, 'reason', error)} - help: check the address "
            "and your connection; the coordinator may be restarting, try again in a minute"
        ) from None
    if len(body) > limit:
        raise CoordinatorUnreachable(
            f"{url} sent more than {limit} bytes - help: check the address"
        )
    return HttpAnswer(status, names, body)


def _refusal_reason(url: str, error: urllib.error.HTTPError) -> str:
    """The reason a 401/403 gives (``{"error": ...}`` or plain text), bounded; else a default."""
    try:
        body = error.read(MAX_REASON_BYTES)
    except (OSError, ValueError):
        body = b""
    text = body.decode("utf-8", "replace").strip()
    try:
        answer = json.loads(text)
        text = str(answer["error"]) if isinstance(answer, dict) and "error" in answer else text
    except ValueError:
        pass
    text = "".join(c if c.isprintable() else " " for c in text)[:1000]
    if "help:" not in text:
        text = (f"{text} - " if text else "") + (
            "help: this needs an access token of an allowlisted user; log in with your Hugging "
            "Face token"
        )
    return f"{url} answered HTTP {error.code}: {text}"


def http_get(
    url: str,
    *,
    timeout: float = 15.0,
    limit: int = MAX_ANSWER_BYTES,
    ssl_context: ssl.SSLContext | None = None,
) -> bytes:
    """The body of ``GET url`` (see :func:`http_request`)."""
    return http_request(url, timeout=timeout, limit=limit, ssl_context=ssl_context).body

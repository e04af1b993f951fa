"""What a login may cost the Hugging Face Hub: cached answers and rate limits (pure).

The token endpoint (``kit.auth.endpoint``) asks the Hub's ``whoami`` who owns a Hugging Face
token. The Hub rate-limits its callers by IP address, so a stranger who could make the
coordinator call ``whoami`` at will (50 bogus tokens, 50 calls) would get the coordinator
rate-limited, and with it every volunteer's login, token renewal and the checkpoint pushes.
Two things stop that:

* :class:`WhoamiCache`: answers kept by the SHA-256 of the HF token (never the token): a valid
  user for as long as the tokens issued to it are valid (``TokenIssuer.lifetime``), so renewals
  never reach the Hub, and a refused token for ``invalid_ttl`` seconds, so repeating a bogus
  token costs nothing.
* :class:`LoginLimits`: lookups that do reach the Hub are rationed by token buckets, one per
  client address (a burst, then a steady rate) and one for the whole endpoint. A request over
  either limit is answered 429 with ``Retry-After`` and costs the Hub nothing.

The endpoint also bounds how many lookups run at once and how many may wait (its driver holds
the semaphore). Everything here takes ``now``; nothing reads a clock or does I/O.

What this module does not do: HTTP (``kit.auth.endpoint``), asking the Hub
(``kit.auth.authority.hub_user``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from kit.auth.authority import HubUser
from kit.errors import ConfigError, InvalidHubToken

MAX_CLIENTS = 10_000  # client buckets kept (the least recently used are forgotten)
MAX_CACHED = 4096  # whoami answers kept


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled at ``per_second``; one token per Hub lookup."""

    burst: float
    per_second: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, burst: float, per_second: float, now: float) -> TokenBucket:
        return cls(burst, per_second, burst, now)

    def wait(self, now: float) -> float:
        """Seconds until a token is available (0: one is available now)."""
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.updated) * self.per_second)
        self.updated = now
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.per_second

    def take(self) -> None:
        self.tokens -= 1.0


class LoginLimits:
    """Rations the Hub lookups of the token endpoint, per client and in total.

    Args:
        per_client_burst: lookups one client address may make at once. Increase this if
            volunteers behind one NAT (a classroom) get 429 while logging in together.
        per_client_per_minute: lookups one client address may make per minute after its burst.
        burst: lookups the endpoint makes at once, all clients together.
        per_minute: lookups per minute, all clients together (the Hub allows a few hundred per
            five minutes per IP address).
    """

    def __init__(
        self,
        *,
        per_client_burst: int = 5,
        per_client_per_minute: float = 5.0,
        burst: int = 30,
        per_minute: float = 60.0,
    ) -> None:
        for name, value in (
            ("per_client_burst", per_client_burst),
            ("per_client_per_minute", per_client_per_minute),
            ("burst", burst),
            ("per_minute", per_minute),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 1):
                raise ConfigError(
                    f"LoginLimits: {name}={value!r} must be >= 1 - help: keep the default"
                )
        self.per_client_burst = float(per_client_burst)
        self.per_client_rate = per_client_per_minute / 60.0
        self._total = TokenBucket.full(float(burst), per_minute / 60.0, -math.inf)
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()

    def admit(self, client: str, now: float) -> float:
        """Take a lookup for ``client`` at ``now``: 0.0 if it may ask the Hub, else the seconds
        to wait (nothing is taken then)."""
        bucket = self._clients.get(client)
        if bucket is None:
            bucket = TokenBucket.full(self.per_client_burst, self.per_client_rate, now)
            self._clients[client] = bucket
            while len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)
        self._clients.move_to_end(client)
        if self._total.updated == -math.inf:
            self._total.updated = now
        wait = max(bucket.wait(now), self._total.wait(now))
        if wait == 0.0:
            bucket.take()
            self._total.take()
        return wait


class WhoamiCache:
    """Hub answers by HF-token digest: users for ``valid_ttl`` s, refusals for ``invalid_ttl`` s."""

    def __init__(self, valid_ttl: float, invalid_ttl: float) -> None:
        if not (valid_ttl >= 0 and invalid_ttl >= 0):
            raise ConfigError("WhoamiCache: cache times must be >= 0 s - help: keep the defaults")
        self.valid_ttl = valid_ttl
        self.invalid_ttl = invalid_ttl
        self._answers: OrderedDict[bytes, tuple[HubUser | InvalidHubToken, float]] = OrderedDict()

    def get(self, digest: bytes, now: float) -> HubUser | InvalidHubToken | None:
        """The cached answer for this token digest, or None (unknown or expired)."""
        held = self._answers.get(digest)
        if held is None:
            return None
        answer, stored = held
        ttl = self.valid_ttl if isinstance(answer, HubUser) else self.invalid_ttl
        if not 0 <= now - stored < ttl:  # (ttl read now: changing it applies to held answers)
            del self._answers[digest]
            return None
        return answer

    def put(self, digest: bytes, answer: HubUser | InvalidHubToken, now: float) -> None:
        ttl = self.valid_ttl if isinstance(answer, HubUser) else self.invalid_ttl
        if ttl <= 0:
            return
        self._answers[digest] = (answer, now)
        self._answers.move_to_end(digest)
        while len(self._answers) > MAX_CACHED:
            self._answers.popitem(last=False)

"""kit.auth: who may join an allowlisted run, proved with Hugging Face accounts (torch-free).

Read in this order: ``tokens`` (the signed access token, pure) → ``revocation`` (the signed ban
list and its DHT transport) → ``authority`` (Hub identity, the allowlist, the coordinator's
token issuer) → ``sessions`` (every peer re-checks its established connections: bans, expired
tokens) → ``authorizer`` (the ``kit.p2p`` handshake hook every peer runs) → ``login_limits``
(what a login may cost the Hub, pure) → ``endpoint`` (``GET /api/token`` on the coordinator)
→ ``token_client`` (the volunteer's client of it).

The flow::

    volunteer                         coordinator                          Hugging Face Hub
    GET /api/token  (HF token, peer key) ──►  whoami(HF token) ───────────────►
                                        ◄── user name, orgs
                                        allowlist? revoked? sign AccessToken(user, key, run, exp)
    ◄── token (+ authority key)
    handshake hello carries the token ──► every peer checks: authority signature, token key ==
                                          the key the handshake proved, not expired, not revoked

Public runs need none of this: ``kit.p2p`` admits everyone by default (``OpenAuthorizer``).
"""

from kit.auth.authority import (
    COORDINATOR_USERNAME,
    Allowlist,
    HubUser,
    TokenIssuer,
    hub_endpoint,
    hub_user,
)
from kit.auth.authorizer import (
    AllowlistAuthorizer,
    IssuerTokenSource,
    TokenSource,
    enforce_revocations,
)
from kit.auth.endpoint import TOKEN_PATH, TokenEndpoint, serve_token_endpoint
from kit.auth.login_limits import LoginLimits
from kit.auth.revocation import (
    RevocationList,
    fetch_revocations,
    publish_revocations,
    revocation_key,
)
from kit.auth.sessions import SessionGuard
from kit.auth.token_client import HttpTokenSource, TokenResponse, authorizer_from_coordinator
from kit.auth.tokens import AccessToken, verify_token

__all__ = [
    "COORDINATOR_USERNAME",
    "TOKEN_PATH",
    "AccessToken",
    "Allowlist",
    "AllowlistAuthorizer",
    "HttpTokenSource",
    "HubUser",
    "IssuerTokenSource",
    "LoginLimits",
    "RevocationList",
    "SessionGuard",
    "TokenEndpoint",
    "TokenIssuer",
    "TokenResponse",
    "TokenSource",
    "authorizer_from_coordinator",
    "enforce_revocations",
    "fetch_revocations",
    "hub_endpoint",
    "hub_user",
    "publish_revocations",
    "revocation_key",
    "serve_token_endpoint",
    "verify_token",
]

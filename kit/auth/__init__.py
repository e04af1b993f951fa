"""kit.auth: who may join an allowlisted run, proved with Hugging Face accounts (torch-free).

Read in this order: ``tokens`` (the signed access token, pure) → ``revocation`` (the signed ban
list and its DHT transport) → ``authority`` (Hub identity, the allowlist, the coordinator's
token issuer) → ``authorizer`` (the ``kit.p2p`` handshake hook every peer runs) → ``endpoint``
(``GET /api/token`` on the coordinator, and the volunteer's client).

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
    follow_revocations,
)
from kit.auth.endpoint import (
    TOKEN_PATH,
    HttpTokenSource,
    TokenEndpoint,
    TokenResponse,
    authorizer_from_coordinator,
    serve_token_endpoint,
)
from kit.auth.revocation import (
    RevocationList,
    fetch_revocations,
    publish_revocations,
    revocation_key,
)
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
    "RevocationList",
    "TokenEndpoint",
    "TokenIssuer",
    "TokenResponse",
    "TokenSource",
    "authorizer_from_coordinator",
    "enforce_revocations",
    "fetch_revocations",
    "follow_revocations",
    "hub_endpoint",
    "hub_user",
    "publish_revocations",
    "revocation_key",
    "serve_token_endpoint",
    "verify_token",
]

"""A fake Hugging Face Hub served over real HTTP on loopback, for tests and notebook dry runs.

Holds :class:`FakeHub`: users with access tokens, organizations, and model/dataset repos whose
branch ``main`` has a linear commit history, all in memory, served by a background thread on
``127.0.0.1`` so that the REAL ``huggingface_hub`` client (and ``transformers``, which calls it)
talks to it through ``HfApi(endpoint=hub.endpoint)`` or ``HF_ENDPOINT``. It does not hold kit
logic (allowlists live with the authorizer), nor LFS/Xet storage, pull requests, tags, other
branches, Spaces, pagination, byte ranges or rate limits: asking for those gets a 400 or a 404.

Hub API subset, shapes read from huggingface_hub 2.4 (``hf_api.py``, ``_commit_api.py``,
``_upload_pipeline.py``, ``file_download.py``, ``utils/_http.py``)::

    GET  /api/whoami-v2                       whoami(): name, type "user", orgs[].roleInOrg,
                                              auth.accessToken.role ("read" or "write")
    GET  /api/organizations/{org}/members     list_organization_members()
    POST /api/repos/create                    create_repo(): 409 if it exists, 403 if no rights
    POST /api/validate-yaml                   README.md check of create_commit(): always valid
    GET  /api/{models|datasets}/{id}          model_info / dataset_info / repo_info: sha,
    GET  /api/{models|datasets}/{id}/revision/{rev}        siblings (+ size, blobId if ?blobs)
    GET  /api/{type}s/{id}/tree/{rev}[/{dir}] list_repo_tree / list_repo_files (?recursive)
    GET  /api/{type}s/{id}/commits/{rev}      list_repo_commits: newest first, in one page
    GET  /api/{type}s/{id}/refs               list_repo_refs: the branch main only
    POST /api/{type}s/{id}/preupload/{rev}    uploadMode "regular" for every file, never LFS
    POST /api/{type}s/{id}/commit/{rev}       NDJSON lines: header, file (base64), deletedFile,
                                              deletedFolder
    HEAD /[datasets/]{id}/resolve/{rev}/{path}   hf_hub_download / snapshot_download: ETag (git
    GET  /[datasets/]{id}/resolve/{rev}/{path}   blob sha1), X-Repo-Commit, Content-Length

``{rev}`` is ``main`` or a full 40-hex-digit commit oid (short oids are refused, so that kit
never comes to depend on them); pushes go to ``main`` only. Failures are sent the way the real Hub
sends them, so the client raises its usual types: 404 with ``X-Error-Code`` ``RepoNotFound`` /
``RevisionNotFound`` / ``EntryNotFound`` (RepositoryNotFoundError, RevisionNotFoundError,
EntryNotFoundError); 401 "Invalid credentials in Authorization header" for an unknown token; 403
for a push or a repo creation without write rights; 412 when the commit's ``parentCommit`` is not
the head (these three raise HfHubHTTPError).

Like the real Hub, a new repo starts with an "initial commit" holding ``.gitattributes``, and
preupload returns each file's current blob oid, so the client leaves unchanged files out of a
commit (and makes no commit at all when nothing changed).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from kit.errors import ConfigError, KitTimeout, KitUsageError

logger = logging.getLogger(__name__)

_REPO_TYPES = {"models": "model", "datasets": "dataset"}  # URL part -> repo_type
_ORG_ROLES = ("admin", "write", "contributor", "read")  # Hub docs, "Organization roles"
_PUSH_ROLES = ("admin", "write")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_MAX_BODY = 256 * 1024 * 1024  # regular files travel base64 in the commit: tiny test data only
_GITATTRIBUTES = b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs -text\n"
_BAD_TOKEN = "Invalid credentials in Authorization header"  # the client special-cases this text

_API = r"^/api/(?P<kind>models|datasets)/(?P<ns>[^/]+)/(?P<name>[^/]+)"
_ROUTES = [  # (methods, path pattern, name of the FakeHub method that answers)
    (methods.split(), re.compile(pattern), answer)
    for methods, pattern, answer in [
        ("GET", r"^/api/whoami-v2$", "_whoami"),
        ("GET", r"^/api/organizations/(?P<org>[^/]+)/members$", "_members"),
        ("POST", r"^/api/repos/create$", "_create"),
        ("POST", r"^/api/validate-yaml$", "_validate_yaml"),
        ("GET", _API + r"(?:/revision/(?P<rev>[^/]+))?$", "_info"),
        ("GET", _API + r"/tree/(?P<rev>[^/]+)(?:/(?P<sub>.+))?$", "_tree"),
        ("GET", _API + r"/commits/(?P<rev>[^/]+)$", "_commits"),
        ("GET", _API + r"/refs$", "_refs"),
        ("POST", _API + r"/preupload/(?P<rev>[^/]+)$", "_preupload"),
        ("POST", _API + r"/commit/(?P<rev>[^/]+)$", "_commit"),
        (
            "HEAD GET",
            r"^/(?:(?P<kind>datasets)/)?(?P<ns>[^/]+)/(?P<name>[^/]+)"
            r"/resolve/(?P<rev>[^/]+)/(?P<file>.+)$",
            "_resolve",
        ),
    ]
]


def git_blob_oid(data: bytes) -> str:
    """Git's blob id of ``data``: the Hub's ETag and ``blobId`` of a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _iso(timestamp: float) -> str:  # the one date format huggingface_hub's parse_datetime reads
    milliseconds = int(timestamp % 1 * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(timestamp)) + f".{milliseconds:03d}Z"


def _short_id(text: str) -> str:  # stands in for the Hub's 24-hex-digit object ids
    return hashlib.sha1(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Commit:
    """One commit on ``main``, with the full snapshot of the repo's files after it."""

    oid: str  # 40 hex digits
    title: str  # the summary line, e.g. "step 10, loss 3.21"
    message: str  # the summary, then a blank line and the description if there is one
    files: Mapping[str, bytes]  # path in repo -> content (read-only)
    timestamp: float  # seconds since the epoch, from the hub's clock
    author: str  # user name of the pusher ("hub" for commits made with FakeHub.commit)


@dataclass(frozen=True)
class RecordedRequest:
    """One request the fake hub answered; tests assert on ``hub.requests``."""

    method: str  # "GET", "HEAD", "POST", ...
    path: str  # URL path, percent-decoded, without the query
    query: str  # raw query string, "" if none
    status: int  # HTTP status sent back
    user: str | None  # user behind the bearer token; None if anonymous or the token was unknown


@dataclass
class _Repo:
    repo_type: str  # "model" or "dataset"
    repo_id: str  # "namespace/name"
    private: bool
    created: float
    commits: list[Commit] = field(default_factory=list)  # oldest first; commits[-1] is main


def _repo_path(repo_type: str, repo_id: str) -> str:  # the repo's page, after the endpoint
    return ("/datasets/" if repo_type == "dataset" else "/") + repo_id


@dataclass(frozen=True)
class _Request:
    method: str
    query: dict[str, list[str]]
    body: bytes
    user: str | None
    role: str | None  # role of the token: "read" or "write"

    def flag(self, name: str) -> bool:
        return self.query.get(name, [""])[0].lower() in ("1", "true")


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


def _json(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> _Response:
    body = json.dumps(payload).encode()
    return _Response(status, body, {"Content-Type": "application/json", **(headers or {})})


class _HubError(Exception):
    """An error answer shaped like the real Hub's: JSON ``error`` plus ``X-Error-*`` headers."""

    def __init__(self, status: int, message: str, code: str = "", commit: str = "", **body: str):
        super().__init__(message)
        headers = {"X-Error-Message": message, "X-Error-Code": code, "X-Repo-Commit": commit}
        headers = {key: value for key, value in headers.items() if value}
        self.response = _json(status, {"error": message, **body}, headers)


class FakeHub:
    """An in-memory Hugging Face Hub at ``http://127.0.0.1:PORT``; use it as a context manager.

    Example::

        with FakeHub() as hub:
            hub.add_user("alice", token="hf_alice", orgs=["neuropark"])
            api = HfApi(endpoint=hub.endpoint, token="hf_alice")
            api.create_repo("neuropark/albert", exist_ok=True)

    Args:
        port: TCP port on 127.0.0.1; 0 lets the OS pick one (see :attr:`endpoint`).
        clock: returns seconds since the epoch; commit dates come from it.
        io_timeout: seconds a connection may stall mid-request before it is dropped (this also
            bounds :meth:`stop`); increase this if a very slow client sees dropped connections.
    """

    def __init__(
        self, *, port: int = 0, clock: Callable[[], float] = time.time, io_timeout: float = 10.0
    ) -> None:
        if not 0 <= port <= 65535 or io_timeout <= 0:
            hint = "use a port in 0..65535 (0: any free port) and io_timeout > 0"
            raise ConfigError(f"FakeHub(port={port}, io_timeout={io_timeout}) help: {hint}")
        self._port, self._clock, self._io_timeout = port, clock, io_timeout
        self._lock = threading.Lock()  # guards the state below: handler threads run concurrently
        self._users: set[str] = set()
        self._tokens: dict[str, tuple[str, str]] = {}  # token -> (user, "read" | "write")
        self._orgs: dict[str, dict[str, str]] = {}  # org -> {member: org role}
        self._repos: dict[tuple[str, str], _Repo] = {}  # (repo_type, repo_id) -> repo
        self._log: list[RecordedRequest] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Bind 127.0.0.1 and serve from a background thread named "fake-hub"."""
        if self._server is not None:
            raise KitUsageError("FakeHub is already running help: start it once, e.g. `with`")
        handler = type("_BoundHandler", (_Handler,), {"hub": self, "timeout": self._io_timeout})
        self._server = _Server(("127.0.0.1", self._port), handler)
        serve = self._server.serve_forever
        self._thread = threading.Thread(target=serve, args=(0.05,), name="fake-hub", daemon=True)
        self._thread.start()
        logger.debug("fake hub serving on %s", self.endpoint)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, close the socket and join the serving thread.

        Args:
            timeout: seconds to wait for the serving thread once the socket is closed.

        Raises:
            KitTimeout: the serving thread was still alive after ``timeout`` seconds.
        """
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None or thread is None:
            return
        server.shutdown()  # serve_forever polls every 50 ms; requests run on their own threads
        server.server_close()  # joins the handler threads, each bounded by io_timeout
        thread.join(timeout)
        if thread.is_alive():
            raise KitTimeout(
                f"fake hub thread alive {timeout}s after stop() help: a request "
                "handler is stuck; run with log level DEBUG to see which one"
            )

    @property
    def endpoint(self) -> str:
        """The base URL to give the client, e.g. ``"http://127.0.0.1:51234"`` (no final slash)."""
        if self._server is None:
            raise KitUsageError("FakeHub is not running help: use it inside `with FakeHub():`")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- setting up state directly (no HTTP) ----------------------------------------------------

    def add_user(
        self, name: str, *, token: str, orgs: Iterable[str] = (), token_role: str = "write"
    ) -> None:
        """Create a user with one access token, and make it a "write" member of ``orgs``.

        Args:
            name: user name, which is also the namespace of the user's repos.
            token: the access token the client will send as ``Authorization: Bearer <token>``.
            orgs: organizations to join; missing ones are created.
            token_role: "write" (may push) or "read" (may only read), as on hf.co/settings/tokens.

        Raises:
            ConfigError: bad or taken name, token already used, or unknown role.
        """
        _check_name(name)
        with self._lock:
            if name in self._orgs or name in self._users:
                raise ConfigError(f"the name {name!r} is taken help: pick another user name")
            self._users.add(name)
        self.add_token(name, token, role=token_role)
        for org in orgs:
            self.add_org_member(org, name)

    def add_token(self, user: str, token: str, *, role: str = "read") -> None:
        """Give ``user`` one more access token, with role "read" or "write"."""
        with self._lock:
            if (
                role not in ("read", "write")
                or not token
                or token in self._tokens
                or user not in self._users
            ):
                hint = "call add_user() first, use role 'read' or 'write' and a new token string"
                raise ConfigError(f"cannot add token for {user!r} (role {role!r}) help: {hint}")
            self._tokens[token] = (user, role)

    def add_org_member(self, org: str, user: str, *, role: str = "write") -> None:
        """Put ``user`` in ``org`` (created if missing) as admin, write, contributor or read."""
        _check_name(org)
        with self._lock:
            if role not in _ORG_ROLES or org in self._users or user not in self._users:
                hint = f"add_user() first, use a role in {_ORG_ROLES}, and no user's name for orgs"
                raise ConfigError(f"cannot add {user!r} to org {org!r} as {role!r} help: {hint}")
            self._orgs.setdefault(org, {})[user] = role

    def create_repo(
        self, repo_id: str, *, repo_type: str = "model", private: bool = False
    ) -> Commit:
        """Create a repo (any namespace, no user needed) and return its initial commit."""
        names = repo_id.split("/")
        with self._lock:
            if (
                repo_type not in _REPO_TYPES.values()
                or len(names) != 2
                or not all(map(_NAME.match, names))
                or (repo_type, repo_id) in self._repos
            ):
                hint = "use a new 'namespace/name' and repo_type 'model' or 'dataset'"
                raise ConfigError(f"cannot create {repo_type} repo {repo_id!r} help: {hint}")
            return self._new_repo(repo_type, repo_id, private, "hub")

    def commit(
        self,
        repo_id: str,
        files: Mapping[str, bytes],
        message: str,
        *,
        repo_type: str = "model",
        delete: Iterable[str] = (),
    ) -> Commit:
        """Commit to ``main`` directly: add or replace ``files``, remove the paths in ``delete``."""
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
            if repo is None:
                raise KitUsageError(f"no {repo_type} repo {repo_id!r} help: create_repo() first")
            gone = set(delete)
            kept = {path: data for path, data in repo.commits[-1].files.items() if path not in gone}
            return self._append(repo, {**kept, **files}, message, "", "hub")

    def commits(self, repo_id: str, *, repo_type: str = "model") -> list[Commit]:
        """The history of ``main``, newest first like ``list_repo_commits``; [] if no such repo."""
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
            return [] if repo is None else repo.commits[::-1]

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every request answered so far, oldest first."""
        with self._lock:
            return list(self._log)

    # --- pointing clients at the hub ------------------------------------------------------------

    def client_env(self, hf_home: str | os.PathLike[str]) -> dict[str, str]:
        """Environment variables that make a child process or notebook kernel use this hub.

        ``huggingface_hub`` reads them once, at import: the child must get them before that.
        ``HF_HOME`` moves the cache, the token file and the Xet logs away from ``~/.cache``.
        Remove ``HF_TOKEN`` from the child's environment too, so no real token is sent.
        """
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HOME": str(hf_home),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",  # else the client fetches an agent list for its UA
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "TRANSFORMERS_OFFLINE": "0",
        }

    @contextlib.contextmanager
    def patched_client(self, hf_home: str | os.PathLike[str]) -> Iterator[None]:
        """Point THIS process's already-imported ``huggingface_hub`` at the hub, then restore it.

        ``huggingface_hub.constants`` froze ``HF_ENDPOINT`` and ``HF_HOME`` at import, so code
        that calls the client without ``endpoint=`` (``transformers`` does) needs them patched.
        Also puts :meth:`client_env` in ``os.environ`` (for child processes and hf_xet) and hides
        ``HF_TOKEN``. Not thread-safe: wrap a whole test with it, not a thread.
        """
        from huggingface_hub import constants

        home, resolve_url = Path(hf_home), "/{repo_id}/resolve/{revision}/{filename}"
        patches = {
            "ENDPOINT": self.endpoint,
            "HUGGINGFACE_CO_URL_TEMPLATE": self.endpoint + resolve_url,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_XET_CACHE": str(home / "xet"),
            "HF_TOKEN_PATH": str(home / "token"),
            "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
            "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_OFFLINE": False,
        }
        saved = {name: getattr(constants, name) for name in patches}
        env: dict[str, str | None] = {**self.client_env(home), "HF_TOKEN": None}
        saved_env = {name: os.environ.get(name) for name in env}
        # transformers keeps one HfApi, built with the endpoint of its time: make it build anew.
        transformers_hub = sys.modules.get("transformers.utils.hub")
        saved_api = getattr(transformers_hub, "_hf_api", None)
        try:
            for name, value in patches.items():
                setattr(constants, name, value)
            _set_env(env)
            if transformers_hub is not None:
                transformers_hub._hf_api = None  # type: ignore[attr-defined]
            yield
        finally:
            for name, value in saved.items():
                setattr(constants, name, value)
            _set_env(saved_env)
            if transformers_hub is not None:
                transformers_hub._hf_api = saved_api  # type: ignore[attr-defined]

    # --- answering requests (no sockets here: _Handler below only adapts http.server) -----------

    def handle(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> _Response:
        """Answer one request and log it in :attr:`requests`. ``headers`` keys are lower-case."""
        url = urlsplit(target)
        user: str | None = None
        try:
            user, role = self._authenticate(headers.get("authorization", ""))
            answer, args = _route(method, url.path)
            request = _Request(method, parse_qs(url.query), body, user, role)
            with self._lock:
                response = getattr(self, answer)(request, **args)
        except _HubError as error:
            response = error.response
        except Exception as error:  # a FakeHub bug: log it, answer, and keep serving
            logger.exception("fake hub failed on %s %s", method, target)
            response = _HubError(500, f"FakeHub bug: {error!r}").response
        with self._lock:
            path = unquote(url.path)
            self._log.append(RecordedRequest(method, path, url.query, response.status, user))
        return response

    def _authenticate(self, authorization: str) -> tuple[str | None, str | None]:
        if not authorization:
            return None, None
        with self._lock:
            found = self._tokens.get(authorization.removeprefix("Bearer ").strip())
        if found is None:  # the real Hub refuses a bad token even where no token is needed
            raise _HubError(401, _BAD_TOKEN)
        return found

    def _is_member(
        self, user: str | None, namespace: str, roles: tuple[str, ...] = _ORG_ROLES
    ) -> bool:
        return user is not None and (
            user == namespace or self._orgs.get(namespace, {}).get(user) in roles
        )

    def _repo(self, request: _Request, kind: str | None, ns: str, name: str) -> _Repo:
        repo = self._repos.get((_REPO_TYPES[kind or "models"], f"{ns}/{name}"))
        if repo is None or (repo.private and not self._is_member(request.user, ns)):
            raise _HubError(404, "Repository not found", "RepoNotFound")
        return repo

    @staticmethod
    def _at(repo: _Repo, rev: str, *, branch_only: bool = False) -> Commit:
        if rev == "main":
            return repo.commits[-1]
        found = [commit for commit in repo.commits if commit.oid == rev]
        if not found or branch_only:
            raise _HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return found[0]

    def _new_repo(self, repo_type: str, repo_id: str, private: bool, author: str) -> Commit:
        repo = self._repos[(repo_type, repo_id)] = _Repo(repo_type, repo_id, private, self._clock())
        return self._append(repo, {".gitattributes": _GITATTRIBUTES}, "initial commit", "", author)

    def _append(
        self, repo: _Repo, files: Mapping[str, bytes], summary: str, description: str, author: str
    ) -> Commit:
        timestamp, parent = self._clock(), repo.commits[-1].oid if repo.commits else ""
        blobs = sorted((path, git_blob_oid(data)) for path, data in files.items())
        seed = [parent, len(repo.commits), summary, description, timestamp, author, blobs]
        oid = hashlib.sha1(json.dumps(seed).encode()).hexdigest()
        message = f"{summary}\n\n{description}" if description else summary
        snapshot = MappingProxyType(dict(files))
        repo.commits.append(Commit(oid, summary, message, snapshot, timestamp, author))
        return repo.commits[-1]

    def _whoami(self, request: _Request) -> _Response:
        if request.user is None:
            raise _HubError(401, "Invalid username or password.")
        orgs = [
            {"type": "org", "name": org, "fullname": org, "roleInOrg": members[request.user]}
            for org, members in sorted(self._orgs.items())
            if request.user in members
        ]
        return _json(
            200,
            {
                "type": "user",
                "id": _short_id(request.user),
                "name": request.user,
                "fullname": request.user.title(),
                "isPro": False,
                "orgs": orgs,
                "auth": {
                    "type": "access_token",
                    "accessToken": {"displayName": "fake", "role": request.role},
                },
            },
        )

    def _members(self, request: _Request, org: str) -> _Response:
        if org not in self._orgs:
            raise _HubError(404, f"Organization {org} not found")
        users = sorted(self._orgs[org])
        return _json(
            200, [{"user": user, "fullname": user.title(), "type": "user"} for user in users]
        )

    def _validate_yaml(self, request: _Request) -> _Response:
        return _json(200, {"errors": [], "warnings": []})

    def _create(self, request: _Request) -> _Response:
        payload = _json_body(request.body)
        namespace, name = payload.get("organization") or request.user, str(payload.get("name"))
        repo_type, repo_id = payload.get("type") or "model", f"{namespace}/{name}"
        if request.user is None or namespace is None:
            raise _HubError(401, "You must be authenticated to create a repo")
        if repo_type not in _REPO_TYPES.values() or not _NAME.match(name):
            raise _HubError(400, f"FakeHub cannot create a {repo_type} repo named {name!r}")
        if request.role != "write" or not self._is_member(request.user, namespace, _PUSH_ROLES):
            raise _HubError(
                403, f"You don't have the rights to create a {repo_type} in {namespace}"
            )
        url = self.endpoint + _repo_path(repo_type, repo_id)
        if (repo_type, repo_id) in self._repos:  # create_repo(exist_ok=True) expects 409 + url
            raise _HubError(409, f"You already created this {repo_type} repo", url=url)
        self._new_repo(repo_type, repo_id, payload.get("visibility") == "private", request.user)
        return _json(200, {"url": url, "name": repo_id, "id": _short_id(repo_id)})

    def _info(
        self, request: _Request, kind: str, ns: str, name: str, rev: str = "main"
    ) -> _Response:
        repo = self._repo(request, kind, ns, name)
        commit = self._at(repo, rev)
        siblings = [
            {"rfilename": path, "size": len(data), "blobId": git_blob_oid(data)}
            if request.flag("blobs")  # files_metadata=True
            else {"rfilename": path}
            for path, data in sorted(commit.files.items())
        ]
        info = {
            "_id": _short_id(repo.repo_id),
            "id": repo.repo_id,
            "author": ns,
            "sha": commit.oid,
            "lastModified": _iso(commit.timestamp),
            "createdAt": _iso(repo.created),
            "private": repo.private,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
        }
        return _json(200, {**info, "modelId": repo.repo_id} if repo.repo_type == "model" else info)

    def _tree(
        self, request: _Request, kind: str, ns: str, name: str, rev: str, sub: str = ""
    ) -> _Response:
        commit = self._at(self._repo(request, kind, ns, name), rev)
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        recursive = request.flag("recursive")
        entries: dict[str, dict[str, Any]] = {}
        for path, data in sorted(commit.files.items()):
            parts = path.removeprefix(prefix).split("/") if path.startswith(prefix) else []
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folder = prefix + "/".join(parts[:depth])  # a folder between prefix and the file
                tree_oid = git_blob_oid((commit.oid + folder).encode())
                entries.setdefault(
                    folder, {"type": "directory", "oid": tree_oid, "size": 0, "path": folder}
                )
            if parts and (recursive or len(parts) == 1):
                entries[path] = {
                    "type": "file",
                    "oid": git_blob_oid(data),
                    "size": len(data),
                    "path": path,
                }
        if prefix and not entries:
            raise _HubError(404, f"{sub} does not exist on {rev}", "EntryNotFound")
        return _json(200, list(entries.values()))

    def _commits(self, request: _Request, kind: str, ns: str, name: str, rev: str) -> _Response:
        repo = self._repo(request, kind, ns, name)
        newest = repo.commits.index(self._at(repo, rev))
        return _json(
            200,
            [
                {
                    "id": c.oid,
                    "title": c.title,
                    "message": c.message,
                    "date": _iso(c.timestamp),
                    "authors": [{"user": c.author}],
                }
                for c in repo.commits[newest::-1]
            ],
        )

    def _refs(self, request: _Request, kind: str, ns: str, name: str) -> _Response:
        head = self._repo(request, kind, ns, name).commits[-1].oid
        main = {"name": "main", "ref": "refs/heads/main", "targetCommit": head}
        return _json(200, {"branches": [main], "converts": [], "tags": [], "pullRequests": []})

    def _head_to_push(
        self, request: _Request, kind: str, ns: str, name: str, rev: str
    ) -> tuple[_Repo, Commit]:
        repo = self._repo(request, kind, ns, name)
        if "create_pr" in request.query:
            raise _HubError(400, "FakeHub does not support pull requests (create_pr=True)")
        if request.user is None:
            raise _HubError(401, "You must be authenticated to push")
        if request.role != "write" or not self._is_member(request.user, ns, _PUSH_ROLES):
            raise _HubError(403, f"You don't have write access to {repo.repo_id}")
        return repo, self._at(repo, rev, branch_only=True)

    def _preupload(self, request: _Request, kind: str, ns: str, name: str, rev: str) -> _Response:
        _, head = self._head_to_push(request, kind, ns, name, rev)
        # "regular" for every file: the content then travels base64 inside the commit, which
        # spares the LFS-batch and Xet storage protocols; huggingface_hub obeys the mode we give.
        answers = []
        for file in _json_body(request.body).get("files", []):
            current = head.files.get(file["path"])  # the client skips a file whose oid matches
            oid = None if current is None else git_blob_oid(current)
            answers.append(
                {"path": file["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid}
            )
        return _json(200, {"files": answers, "commitOid": head.oid})

    def _commit(self, request: _Request, kind: str, ns: str, name: str, rev: str) -> _Response:
        repo, head = self._head_to_push(request, kind, ns, name, rev)
        try:
            lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        except ValueError as error:
            raise _HubError(400, f"malformed NDJSON commit payload: {error}") from None
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "the commit payload must start with a header line")
        header, files = lines[0]["value"], dict(head.files)
        if header.get("parentCommit") not in (None, head.oid):
            raise _HubError(412, "A commit has happened since. Please refresh and try again.")
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file" and value.get("encoding") == "base64":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile" and value.get("path") in files:
                del files[value["path"]]
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {path: data for path, data in files.items() if not path.startswith(folder)}
            elif key == "deletedFile":
                raise _HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            else:
                raise _HubError(400, f"FakeHub does not support the commit operation {key!r}")
        summary, description = header.get("summary") or "Update", header.get("description") or ""
        commit = self._append(repo, files, summary, description, request.user or "")
        url = f"{self.endpoint}{_repo_path(repo.repo_type, repo.repo_id)}/commit/{commit.oid}"
        return _json(
            200,
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": url,
                "hookOutput": "",
                "pullRequestUrl": None,
            },
        )

    def _resolve(
        self, request: _Request, ns: str, name: str, rev: str, file: str, kind: str = ""
    ) -> _Response:
        commit = self._at(self._repo(request, kind, ns, name), rev)
        if file not in commit.files:  # X-Repo-Commit lets the client cache the absence
            raise _HubError(404, "Entry not found", "EntryNotFound", commit=commit.oid)
        data = commit.files[file]
        etag = f'"{git_blob_oid(data)}"'
        headers = {
            "ETag": etag,
            "X-Repo-Commit": commit.oid,
            "Content-Type": "application/octet-stream",
        }
        return _Response(200, data, headers)


def _route(method: str, path: str) -> tuple[str, dict[str, str]]:
    """The name of the FakeHub method that answers ``method path``, and its URL arguments."""
    for methods, pattern, answer in _ROUTES:
        match = pattern.match(path)
        if match and method in methods:
            return answer, {
                key: unquote(value) for key, value in match.groupdict().items() if value
            }
    raise _HubError(404, f"Sorry, we can't find the page you are looking for: {path}")


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body or b"{}")
    except ValueError as error:
        raise _HubError(400, f"malformed JSON body: {error}") from None
    if not isinstance(payload, dict):
        raise _HubError(400, "the JSON body must be an object")
    return payload


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ConfigError(f"bad user/org name {name!r} help: use letters, digits, '-', '_', '.'")


def _set_env(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # so server_close() joins the handler threads (bounded by io_timeout)
    block_on_close = True


class _Handler(BaseHTTPRequestHandler):
    """Adapts http.server to :meth:`FakeHub.handle`; HTTP/1.0, so one request per connection."""

    hub: FakeHub  # set on the per-hub subclass that FakeHub.start() makes

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if "chunked" in self.headers.get("Transfer-Encoding", "") or length > _MAX_BODY:
            self.send_error(413, f"FakeHub takes bodies with a Content-Length <= {_MAX_BODY}")
            return
        body = self.rfile.read(length) if length else b""
        headers = {key.lower(): value for key, value in self.headers.items()}
        response = self.hub.handle(self.command, self.path, headers, body)
        self.send_response(response.status)
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(response.body)))  # also on HEAD: the file size
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fake hub: " + format, *args)

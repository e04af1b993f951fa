"""The fake Hub's HTTP API, answered in memory: the routes and answers of huggingface.co.

Holds :class:`HubAPI`: one request (method, URL, headers, body) in, one :class:`Response` out,
read from and written to a ``kit.testing.hub_state.HubState``; no sockets (``kit.testing.fake_hub``
serves it over HTTP). It does not hold kit logic (allowlists live with the authorizer), nor
LFS/Xet storage, pull requests, tags, other branches, Spaces, pagination, byte ranges or rate
limits: asking for those gets a 400 or a 404.

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
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from kit.testing.hub_state import (
    NAME,
    PUSH_ROLES,
    REPO_TYPES,
    Commit,
    HubState,
    RecordedRequest,
    Repo,
    git_blob_oid,
)

logger = logging.getLogger(__name__)

_BAD_TOKEN = "Invalid credentials in Authorization header"  # the client special-cases this text

_API = r"^/api/(?P<kind>models|datasets)/(?P<ns>[^/]+)/(?P<name>[^/]+)"
_ROUTES = [  # (methods, path pattern, name of the HubAPI method that answers)
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


def _iso(timestamp: float) -> str:  # the one date format huggingface_hub's parse_datetime reads
    milliseconds = int(timestamp % 1 * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(timestamp)) + f".{milliseconds:03d}Z"


def _short_id(text: str) -> str:  # stands in for the Hub's 24-hex-digit object ids
    return hashlib.sha1(text.encode()).hexdigest()[:24]


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
class Response:
    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


def _json(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Response:
    body = json.dumps(payload).encode()
    return Response(status, body, {"Content-Type": "application/json", **(headers or {})})


class HubError(Exception):
    """An error answer shaped like the real Hub's: JSON ``error`` plus ``X-Error-*`` headers."""

    def __init__(self, status: int, message: str, code: str = "", commit: str = "", **body: str):
        super().__init__(message)
        headers = {"X-Error-Message": message, "X-Error-Code": code, "X-Repo-Commit": commit}
        headers = {key: value for key, value in headers.items() if value}
        self.response = _json(status, {"error": message, **body}, headers)


class HubAPI:
    """Answers the Hub API requests of the module docstring from ``state``.

    Args:
        state: the users, tokens and repos to answer from (and to change on pushes).
        endpoint: returns the base URL clients use (repo URLs in answers name it).
    """

    def __init__(self, state: HubState, endpoint: Callable[[], str]) -> None:
        self.state = state
        self.endpoint = endpoint

    def handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Response:
        """Answer one request and log it in :attr:`requests`. ``headers`` keys are lower-case."""
        url = urlsplit(target)
        user: str | None = None
        try:
            user, role = self._authenticate(headers.get("authorization", ""))
            answer, args = _route(method, url.path)
            request = _Request(method, parse_qs(url.query), body, user, role)
            with self.state.lock:
                response = getattr(self, answer)(request, **args)
        except HubError as error:
            response = error.response
        except Exception as error:  # a FakeHub bug: log it, answer, and keep serving
            logger.exception("fake hub failed on %s %s", method, target)
            response = HubError(500, f"FakeHub bug: {error!r}").response
        with self.state.lock:
            path = unquote(url.path)
            self.state.log.append(RecordedRequest(method, path, url.query, response.status, user))
        return response

    def _authenticate(self, authorization: str) -> tuple[str | None, str | None]:
        if not authorization:
            return None, None
        with self.state.lock:
            found = self.state.tokens.get(authorization.removeprefix("Bearer ").strip())
        if found is None:  # the real Hub refuses a bad token even where no token is needed
            raise HubError(401, _BAD_TOKEN)
        return found

    def _repo(self, request: _Request, kind: str | None, ns: str, name: str) -> Repo:
        repo = self.state.repos.get((REPO_TYPES[kind or "models"], f"{ns}/{name}"))
        if repo is None or (repo.private and not self.state.is_member(request.user, ns)):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    @staticmethod
    def _at(repo: Repo, rev: str, *, branch_only: bool = False) -> Commit:
        if rev == "main":
            return repo.commits[-1]
        found = [commit for commit in repo.commits if commit.oid == rev]
        if not found or branch_only:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return found[0]

    def _whoami(self, request: _Request) -> Response:
        if request.user is None:
            raise HubError(401, "Invalid username or password.")
        orgs = [
            {"type": "org", "name": org, "fullname": org, "roleInOrg": members[request.user]}
            for org, members in sorted(self.state.orgs.items())
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

    def _members(self, request: _Request, org: str) -> Response:
        if org not in self.state.orgs:
            raise HubError(404, f"Organization {org} not found")
        users = sorted(self.state.orgs[org])
        return _json(
            200, [{"user": user, "fullname": user.title(), "type": "user"} for user in users]
        )

    def _validate_yaml(self, request: _Request) -> Response:
        return _json(200, {"errors": [], "warnings": []})

    def _create(self, request: _Request) -> Response:
        payload = _json_body(request.body)
        namespace, name = payload.get("organization") or request.user, str(payload.get("name"))
        repo_type, repo_id = payload.get("type") or "model", f"{namespace}/{name}"
        if request.user is None or namespace is None:
            raise HubError(401, "You must be authenticated to create a repo")
        if repo_type not in REPO_TYPES.values() or not NAME.match(name):
            raise HubError(400, f"FakeHub cannot create a {repo_type} repo named {name!r}")
        if request.role != "write" or not self.state.is_member(request.user, namespace, PUSH_ROLES):
            raise HubError(403, f"You don't have the rights to create a {repo_type} in {namespace}")
        url = self.endpoint() + _repo_path(repo_type, repo_id)
        if (repo_type, repo_id) in self.state.repos:  # create_repo(exist_ok=True) expects 409 + url
            raise HubError(409, f"You already created this {repo_type} repo", url=url)
        self.state.new_repo(
            repo_type, repo_id, payload.get("visibility") == "private", request.user
        )
        return _json(200, {"url": url, "name": repo_id, "id": _short_id(repo_id)})

    def _info(
        self, request: _Request, kind: str, ns: str, name: str, rev: str = "main"
    ) -> Response:
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
    ) -> Response:
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
            raise HubError(404, f"{sub} does not exist on {rev}", "EntryNotFound")
        return _json(200, list(entries.values()))

    def _commits(self, request: _Request, kind: str, ns: str, name: str, rev: str) -> Response:
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

    def _refs(self, request: _Request, kind: str, ns: str, name: str) -> Response:
        head = self._repo(request, kind, ns, name).commits[-1].oid
        main = {"name": "main", "ref": "refs/heads/main", "targetCommit": head}
        return _json(200, {"branches": [main], "converts": [], "tags": [], "pullRequests": []})

    def _head_to_push(
        self, request: _Request, kind: str, ns: str, name: str, rev: str
    ) -> tuple[Repo, Commit]:
        repo = self._repo(request, kind, ns, name)
        if "create_pr" in request.query:
            raise HubError(400, "FakeHub does not support pull requests (create_pr=True)")
        if request.user is None:
            raise HubError(401, "You must be authenticated to push")
        if request.role != "write" or not self.state.is_member(request.user, ns, PUSH_ROLES):
            raise HubError(403, f"You don't have write access to {repo.repo_id}")
        return repo, self._at(repo, rev, branch_only=True)

    def _preupload(self, request: _Request, kind: str, ns: str, name: str, rev: str) -> Response:
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

    def _commit(self, request: _Request, kind: str, ns: str, name: str, rev: str) -> Response:
        repo, head = self._head_to_push(request, kind, ns, name, rev)
        try:
            lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        except ValueError as error:
            raise HubError(400, f"malformed NDJSON commit payload: {error}") from None
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the commit payload must start with a header line")
        header, files = lines[0]["value"], dict(head.files)
        if header.get("parentCommit") not in (None, head.oid):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
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
                raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            else:
                raise HubError(400, f"FakeHub does not support the commit operation {key!r}")
        summary, description = header.get("summary") or "Update", header.get("description") or ""
        commit = self.state.append(repo, files, summary, description, request.user or "")
        url = f"{self.endpoint()}{_repo_path(repo.repo_type, repo.repo_id)}/commit/{commit.oid}"
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
    ) -> Response:
        commit = self._at(self._repo(request, kind, ns, name), rev)
        if file not in commit.files:  # X-Repo-Commit lets the client cache the absence
            raise HubError(404, "Entry not found", "EntryNotFound", commit=commit.oid)
        data = commit.files[file]
        etag = f'"{git_blob_oid(data)}"'
        headers = {
            "ETag": etag,
            "X-Repo-Commit": commit.oid,
            "Content-Type": "application/octet-stream",
        }
        return Response(200, data, headers)


def _route(method: str, path: str) -> tuple[str, dict[str, str]]:
    """The name of the HubAPI method that answers ``method path``, and its URL arguments."""
    for methods, pattern, answer in _ROUTES:
        match = pattern.match(path)
        if match and method in methods:
            return answer, {
                key: unquote(value) for key, value in match.groupdict().items() if value
            }
    raise HubError(404, f"Sorry, we can't find the page you are looking for: {path}")


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body or b"{}")
    except ValueError as error:
        raise HubError(400, f"malformed JSON body: {error}") from None
    if not isinstance(payload, dict):
        raise HubError(400, "the JSON body must be an object")
    return payload

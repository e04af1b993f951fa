"""What a fake Hugging Face Hub holds: users, tokens, organizations, repos and their history.

Holds :class:`HubState`, the in-memory data behind ``kit.testing.fake_hub.FakeHub``: users with
access tokens ("read" or "write"), organizations with roles, and model/dataset repos whose branch
``main`` is a linear list of :class:`Commit` snapshots. Tests set it up directly (``add_user``,
``create_repo``, ``commit``) and read it back (``commits``, ``requests``); the HTTP answers
(``kit.testing.hub_api``) read and change it under :attr:`HubState.lock`.

What this module does not do: HTTP (``kit.testing.hub_api`` answers, ``kit.testing.fake_hub``
serves).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kit.errors import ConfigError, KitUsageError

REPO_TYPES = {"models": "model", "datasets": "dataset"}  # URL part -> repo_type
ORG_ROLES = ("admin", "write", "contributor", "read")  # Hub docs, "Organization roles"
PUSH_ROLES = ("admin", "write")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
GITATTRIBUTES = b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs -text\n"


def git_blob_oid(data: bytes) -> str:
    """Git's blob id of ``data``: the Hub's ETag and ``blobId`` of a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


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
class Repo:
    repo_type: str  # "model" or "dataset"
    repo_id: str  # "namespace/name"
    private: bool
    created: float
    commits: list[Commit] = field(default_factory=list)  # oldest first; commits[-1] is main


class HubState:
    """The hub's users, tokens, organizations and repos (see the module docstring).

    Args:
        clock: returns seconds since the epoch; commit dates come from it.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.lock = threading.Lock()  # guards the state below: handler threads run concurrently
        self.users: set[str] = set()
        self.tokens: dict[str, tuple[str, str]] = {}  # token -> (user, "read" | "write")
        self.orgs: dict[str, dict[str, str]] = {}  # org -> {member: org role}
        self.repos: dict[tuple[str, str], Repo] = {}  # (repo_type, repo_id) -> repo
        self.log: list[RecordedRequest] = []

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
        check_name(name)
        with self.lock:
            if name in self.orgs or name in self.users:
                raise ConfigError(f"the name {name!r} is taken help: pick another user name")
            self.users.add(name)
        self.add_token(name, token, role=token_role)
        for org in orgs:
            self.add_org_member(org, name)

    def add_token(self, user: str, token: str, *, role: str = "read") -> None:
        """Give ``user`` one more access token, with role "read" or "write"."""
        with self.lock:
            if (
                role not in ("read", "write")
                or not token
                or token in self.tokens
                or user not in self.users
            ):
                hint = "call add_user() first, use role 'read' or 'write' and a new token string"
                raise ConfigError(f"cannot add token for {user!r} (role {role!r}) help: {hint}")
            self.tokens[token] = (user, role)

    def add_org_member(self, org: str, user: str, *, role: str = "write") -> None:
        """Put ``user`` in ``org`` (created if missing) as admin, write, contributor or read."""
        check_name(org)
        with self.lock:
            if role not in ORG_ROLES or org in self.users or user not in self.users:
                hint = f"add_user() first, use a role in {ORG_ROLES}, and no user's name for orgs"
                raise ConfigError(f"cannot add {user!r} to org {org!r} as {role!r} help: {hint}")
            self.orgs.setdefault(org, {})[user] = role

    def create_repo(
        self, repo_id: str, *, repo_type: str = "model", private: bool = False
    ) -> Commit:
        """Create a repo (any namespace, no user needed) and return its initial commit."""
        names = repo_id.split("/")
        with self.lock:
            if (
                repo_type not in REPO_TYPES.values()
                or len(names) != 2
                or not all(map(NAME.match, names))
                or (repo_type, repo_id) in self.repos
            ):
                hint = "use a new 'namespace/name' and repo_type 'model' or 'dataset'"
                raise ConfigError(f"cannot create {repo_type} repo {repo_id!r} help: {hint}")
            return self.new_repo(repo_type, repo_id, private, "hub")

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
        with self.lock:
            repo = self.repos.get((repo_type, repo_id))
            if repo is None:
                raise KitUsageError(f"no {repo_type} repo {repo_id!r} help: create_repo() first")
            gone = set(delete)
            kept = {path: data for path, data in repo.commits[-1].files.items() if path not in gone}
            return self.append(repo, {**kept, **files}, message, "", "hub")

    def commits(self, repo_id: str, *, repo_type: str = "model") -> list[Commit]:
        """The history of ``main``, newest first like ``list_repo_commits``; [] if no such repo."""
        with self.lock:
            repo = self.repos.get((repo_type, repo_id))
            return [] if repo is None else repo.commits[::-1]

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every request answered so far, oldest first."""
        with self.lock:
            return list(self.log)

    def is_member(
        self, user: str | None, namespace: str, roles: tuple[str, ...] = ORG_ROLES
    ) -> bool:
        return user is not None and (
            user == namespace or self.orgs.get(namespace, {}).get(user) in roles
        )

    def new_repo(self, repo_type: str, repo_id: str, private: bool, author: str) -> Commit:
        """Create a repo with its initial commit (the caller holds :attr:`lock`)."""
        repo = self.repos[(repo_type, repo_id)] = Repo(repo_type, repo_id, private, self.clock())
        return self.append(repo, {".gitattributes": GITATTRIBUTES}, "initial commit", "", author)

    def append(
        self, repo: Repo, files: Mapping[str, bytes], summary: str, description: str, author: str
    ) -> Commit:
        """Add a commit to ``repo``'s ``main`` (the caller holds :attr:`lock`)."""
        timestamp, parent = self.clock(), repo.commits[-1].oid if repo.commits else ""
        blobs = sorted((path, git_blob_oid(data)) for path, data in files.items())
        seed = [parent, len(repo.commits), summary, description, timestamp, author, blobs]
        oid = hashlib.sha1(json.dumps(seed).encode()).hexdigest()
        message = f"{summary}\n\n{description}" if description else summary
        snapshot = MappingProxyType(dict(files))
        repo.commits.append(Commit(oid, summary, message, snapshot, timestamp, author))
        return repo.commits[-1]


def check_name(name: str) -> None:
    if not NAME.match(name):
        raise ConfigError(f"bad user/org name {name!r} help: use letters, digits, '-', '_', '.'")

"""FakeHub against the REAL huggingface_hub client (and transformers), over loopback HTTP.

Every test runs with the client's constants pointed at the fake hub and HF_HOME in tmp_path, and
with DNS refused for any host but loopback, so a call that tried to leave the machine fails the
test instead of hanging or touching the user's cache.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from kit.errors import ConfigError
from kit.testing.fake_hub import FakeHub, git_blob_oid
from tests.conftest import MS

pytestmark = pytest.mark.sockets

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_START = 1_700_000_000  # 2023-11-14T22:13:20Z, the fake clock's first reading


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Refuse name resolution for any other host, and fail the test if one was tried."""
    real_getaddrinfo = socket.getaddrinfo
    tried: list[str] = []

    def guarded(host: object, *args: object, **kwargs: object) -> object:
        if str(host) not in _LOOPBACK:
            tried.append(str(host))
            raise OSError(f"test guard: no network beyond loopback (tried {host})")
        return real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    yield tried
    assert tried == [], f"the client tried to reach other hosts: {tried}"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    clock = itertools.count(_START, 60).__next__  # one minute per reading: distinct dates
    with FakeHub(clock=clock) as fake:
        fake.add_user("alice", token="hf_alice", orgs=["neuropark"])
        fake.add_user("bob", token="hf_bob")
        with fake.patched_client(tmp_path / "hf_home"):
            yield fake


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _read_tree(folder: str) -> dict[str, bytes]:
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_whoami_lists_user_orgs_and_token_role(hub: FakeHub) -> None:
    me = HfApi(endpoint=hub.endpoint, token="hf_alice").whoami()
    assert (me["type"], me["name"]) == ("user", "alice")
    assert [org["name"] for org in me["orgs"]] == ["neuropark"]
    assert me["auth"]["accessToken"]["role"] == "write"
    assert HfApi(endpoint=hub.endpoint, token="hf_bob").whoami()["orgs"] == []


def test_whoami_with_unknown_token_raises_the_client_401(hub: FakeHub) -> None:
    with pytest.raises(HfHubHTTPError) as caught:
        HfApi(endpoint=hub.endpoint, token="hf_wrong").whoami()
    assert caught.value.response.status_code == 401
    assert "Invalid user token" in str(caught.value)
    assert [(r.path, r.status, r.user) for r in hub.requests] == [("/api/whoami-v2", 401, None)]


def test_org_members_support_an_allowlist_check(hub: FakeHub) -> None:
    hub.add_user("carol", token="hf_carol")
    hub.add_org_member("neuropark", "carol", role="read")
    api = HfApi(endpoint=hub.endpoint, token="hf_bob")
    assert [user.username for user in api.list_organization_members("neuropark")] == [
        "alice",
        "carol",
    ]
    with pytest.raises(HfHubHTTPError) as caught:
        list(api.list_organization_members("nobody-org"))
    assert caught.value.response.status_code == 404


def test_two_uploads_make_two_commits_each_downloadable_by_revision(
    hub: FakeHub, tmp_path: Path
) -> None:
    api = HfApi(endpoint=hub.endpoint, token="hf_alice")
    assert api.create_repo("neuropark/albert", exist_ok=True).repo_id == "neuropark/albert"
    api.create_repo("neuropark/albert", exist_ok=True)  # 409 from the hub, accepted by the client
    first_files = {"config.json": b'{"step": 10}', "weights/model.safetensors": bytes(range(256))}
    folder = _write(tmp_path / "checkpoint", first_files)
    first = api.upload_folder(
        repo_id="neuropark/albert", folder_path=folder, commit_message="step 10, loss 3.21"
    )
    second_files = {**first_files, "config.json": b'{"step": 20}'}
    _write(folder, second_files)
    second = api.upload_folder(
        repo_id="neuropark/albert", folder_path=folder, commit_message="step 20, loss 2.50"
    )

    commits = api.list_repo_commits("neuropark/albert")
    assert [c.title for c in commits] == [
        "step 20, loss 2.50",
        "step 10, loss 3.21",
        "initial commit",
    ]
    assert [c.commit_id for c in commits[:2]] == [second.oid, first.oid]
    assert [c.commit_id for c in commits] == [c.oid for c in hub.commits("neuropark/albert")]
    assert [c.created_at.timestamp() for c in commits] == [_START + 180, _START + 120, _START + 60]

    expected = {".gitattributes": hub.commits("neuropark/albert")[-1].files[".gitattributes"]}
    cache = tmp_path / "cache"
    old = snapshot_download("neuropark/albert", revision=first.oid, cache_dir=cache)
    assert _read_tree(old) == {**expected, **first_files}
    new = snapshot_download("neuropark/albert", cache_dir=cache)
    assert _read_tree(new) == {**expected, **second_files}
    assert Path(new).name == second.oid

    assert sorted(api.list_repo_files("neuropark/albert")) == sorted([*expected, *second_files])
    info = api.model_info("neuropark/albert", files_metadata=True)
    assert info.sha == second.oid
    sizes = {s.rfilename: (s.size, s.blob_id) for s in info.siblings or []}
    assert sizes["config.json"] == (len(b'{"step": 20}'), git_blob_oid(b'{"step": 20}'))


def test_unchanged_upload_makes_no_commit(hub: FakeHub, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub.endpoint, token="hf_alice")
    api.create_repo("alice/notes")
    folder = _write(tmp_path / "notes", {"a.txt": b"same"})
    first = api.upload_folder(repo_id="alice/notes", folder_path=folder, commit_message="one")
    again = api.upload_folder(repo_id="alice/notes", folder_path=folder, commit_message="two")
    assert again.oid == first.oid
    assert [c.title for c in hub.commits("alice/notes")] == ["one", "initial commit"]


def test_missing_file_repo_and_revision_raise_the_client_errors(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.create_repo("neuropark/albert")
    head = hub.commit("neuropark/albert", {"config.json": b"{}"}, "add config")
    cache = tmp_path / "cache"
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("neuropark/albert", "missing.bin", cache_dir=cache)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("neuropark/nothing", "config.json", cache_dir=cache)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("neuropark/albert", "config.json", revision="0" * 40, cache_dir=cache)
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.endpoint).list_repo_commits("neuropark/albert", revision="v9")
    with pytest.raises(RevisionNotFoundError):  # short oids are refused: kit must not use them
        hf_hub_download("neuropark/albert", "config.json", revision=head.oid[:8], cache_dir=cache)
    # No `endpoint=` here: the constants patched by FakeHub.patched_client lead to the fake hub.
    path = hf_hub_download("neuropark/albert", "config.json", revision=head.oid, cache_dir=cache)
    assert Path(path).read_bytes() == b"{}"


def test_push_without_write_rights_is_refused(hub: FakeHub) -> None:
    hub.add_token("alice", "hf_alice_read", role="read")
    HfApi(endpoint=hub.endpoint, token="hf_alice").create_repo("neuropark/albert")
    before = hub.commits("neuropark/albert")

    def push(token: str | None) -> int:
        api = HfApi(endpoint=hub.endpoint, token=token if token else False)
        with pytest.raises(HfHubHTTPError) as caught:
            api.upload_file(
                path_or_fileobj=b"x",
                path_in_repo="x.txt",
                repo_id="neuropark/albert",
                commit_message="should not land",
            )
        return caught.value.response.status_code

    assert push("hf_bob") == 403  # not a member of neuropark
    assert push("hf_alice_read") == 403  # a member, but a read token
    assert push(None) == 401
    with pytest.raises(HfHubHTTPError) as caught:
        HfApi(endpoint=hub.endpoint, token="hf_bob").create_repo("neuropark/other")
    assert caught.value.response.status_code == 403
    assert hub.commits("neuropark/albert") == before


def test_stale_parent_commit_is_refused(hub: FakeHub) -> None:
    initial = hub.create_repo("alice/run")
    hub.commit("alice/run", {"log.txt": b"1"}, "someone else pushed")
    with pytest.raises(HfHubHTTPError) as caught:
        HfApi(endpoint=hub.endpoint, token="hf_alice").upload_file(
            path_or_fileobj=b"2",
            path_in_repo="log.txt",
            repo_id="alice/run",
            commit_message="late",
            parent_commit=initial.oid,
        )
    assert caught.value.response.status_code == 412


def test_private_repo_is_hidden_from_non_members(hub: FakeHub) -> None:
    hub.create_repo("neuropark/secret", private=True)
    assert HfApi(endpoint=hub.endpoint, token="hf_alice").repo_info("neuropark/secret").private
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint, token="hf_bob").repo_info("neuropark/secret")


def test_dataset_repos_use_their_own_urls(hub: FakeHub, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub.endpoint, token="hf_alice")
    api.create_repo("alice/shards", repo_type="dataset")
    api.upload_file(
        path_or_fileobj=b"a,b\n1,2\n",
        path_in_repo="data/train.csv",
        repo_id="alice/shards",
        repo_type="dataset",
        commit_message="add train",
    )
    path = hf_hub_download(
        "alice/shards", "data/train.csv", repo_type="dataset", cache_dir=tmp_path
    )
    assert Path(path).read_bytes() == b"a,b\n1,2\n"
    assert [f.path for f in api.list_repo_tree("alice/shards", repo_type="dataset")] == [
        ".gitattributes",
        "data",
    ]
    assert hub.commits("alice/shards") == []  # a model repo of that name does not exist
    assert any(r.path == "/datasets/alice/shards/resolve/main/data/train.csv" for r in hub.requests)


def test_stop_joins_the_thread_and_closes_the_port() -> None:
    with FakeHub() as fake:
        port = int(fake.endpoint.rsplit(":", 1)[1])
        assert any(t.name == "fake-hub" for t in threading.enumerate())
    assert not any(t.name == "fake-hub" for t in threading.enumerate())
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1000 * MS).close()


def test_bad_setup_values_raise_config_errors() -> None:
    fake = FakeHub()
    fake.add_user("alice", token="hf_alice")
    for call in [
        lambda: fake.add_user("alice", token="hf_other"),  # name taken
        lambda: fake.add_user("bob", token="hf_alice"),  # token taken
        lambda: fake.add_user("no spaces", token="hf_x"),
        lambda: fake.add_token("alice", "hf_y", role="admin"),
        lambda: fake.add_org_member("org", "alice", role="owner"),
        lambda: fake.create_repo("no-namespace"),
        lambda: FakeHub(io_timeout=0),
    ]:
        with pytest.raises(ConfigError, match="help: "):
            call()


_TRANSFORMERS_CHILD = """
import json, socket, sys
real_getaddrinfo, tried = socket.getaddrinfo, []
def guarded(host, *args, **kwargs):
    if str(host) not in ("127.0.0.1", "localhost", "::1"):
        tried.append(str(host))
        raise OSError("no network beyond loopback")
    return real_getaddrinfo(host, *args, **kwargs)
socket.getaddrinfo = guarded

import torch
from huggingface_hub import HfApi
from transformers import AlbertConfig, AlbertModel

folder, repo_id = sys.argv[1:3]
torch.manual_seed(0)
config = AlbertConfig(vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=1,
                      num_attention_heads=2, intermediate_size=32, max_position_embeddings=16)
model = AlbertModel(config)
model.save_pretrained(folder)
api = HfApi(token="hf_alice")  # no endpoint: HF_ENDPOINT from the environment
api.create_repo(repo_id, exist_ok=True)
first = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="step 10, loss 3.21")
oid = first.oid
api.upload_file(path_or_fileobj=b"later", path_in_repo="later.txt", repo_id=repo_id,
                commit_message="step 20, loss 2.50")
loaded = AlbertModel.from_pretrained(repo_id, revision=oid)
expected, got = model.state_dict(), loaded.state_dict()
same = expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
result = {"oid": oid, "same": same, "hidden_size": loaded.config.hidden_size, "tried": tried}
print(json.dumps(result))
"""


@pytest.mark.processes
def test_transformers_round_trip_through_hf_endpoint(tmp_path: Path) -> None:
    with FakeHub() as fake:
        fake.add_user("alice", token="hf_alice", orgs=["neuropark"])
        env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
        env.update(fake.client_env(tmp_path / "hf_home"))
        script = tmp_path / "child.py"
        script.write_text(_TRANSFORMERS_CHILD)
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "tiny"), "neuropark/tiny-albert"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180_000 * MS,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result == {"oid": result["oid"], "same": True, "hidden_size": 16, "tried": []}
        commits = fake.commits("neuropark/tiny-albert")
        assert [c.title for c in commits] == [
            "step 20, loss 2.50",
            "step 10, loss 3.21",
            "initial commit",
        ]
        assert commits[1].oid == result["oid"]
        downloads = {r.path for r in fake.requests if r.method == "GET" and "/resolve/" in r.path}
        assert downloads == {
            f"/neuropark/tiny-albert/resolve/{result['oid']}/config.json",
            f"/neuropark/tiny-albert/resolve/{result['oid']}/model.safetensors",
        }

"""The served data of a private run over real HTTP on loopback: only a valid access token of this
run (``Authorization: Bearer``) gets the manifest or a shard range; strangers, forged, foreign,
expired and banned tokens are refused with the right status and reason before any file is read,
and the volunteer's side sees a typed AccessRefused at once, not a coordinator to wait for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kit.auth import AccessToken
from kit.auth.tokens import bearer_header
from kit.data import serving
from kit.data.manifest import DataManifest, ShardEntry, SourceShards, file_sha256
from kit.data.remote import ServedData, ServedShardSource, download_shard
from kit.data.serving import DataServer
from kit.data.shards import ShardWriter
from kit.errors import AccessRefused
from kit.http_client import HttpAnswer, http_request
from kit.p2p.identity import Identity
from kit.p2p.peer import create_peer
from tests.auth.allowlisted import RUN_ID, TOKENS, AllowlistedRun, allowlisted_run

pytestmark = pytest.mark.sockets

VOCAB, FINGERPRINT = 100, "test-tokenizer"


def shards(folder: Path) -> tuple[DataManifest, dict[str, Path]]:
    """One source of two small shards, written like the coordinator writes them."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    entries, paths = [], {}
    for index in range(2):
        path = folder / f"shard-{index}.kitshard.zst"
        with ShardWriter(path, vocab_size=VOCAB, tokenizer=FINGERPRINT) as writer:
            for _ in range(50):
                writer.write(rng.integers(5, VOCAB, size=int(rng.integers(10, 60))).tolist())
        digest = file_sha256(path)
        entries.append(ShardEntry(digest, path.stat().st_size, writer.documents, writer.tokens))
        paths[digest] = path
    source = SourceShards("files", FINGERPRINT, VOCAB, tuple(entries))
    return DataManifest({"files": source}), paths


def guarded(run: AllowlistedRun, folder: Path) -> tuple[DataServer, str]:
    """The coordinator's data routes with its authorizer's guard; (server, manifest URL)."""
    manifest, paths = shards(folder)
    server = DataServer(manifest, paths, guard=run.coordinator_authorizer.request_guard(RUN_ID))
    server.register(run.coordinator)
    return server, f"{run.url}/api/data/manifest.json"


def shard_url(server: DataServer, manifest_url: str) -> tuple[str, ShardEntry]:
    entry = server.manifest.sources["files"].shards[0]
    return manifest_url.replace("manifest.json", "shard") + f"?sha256={entry.sha256}", entry


async def get(url: str, authorization: str | None, **headers: str) -> HttpAnswer:
    if authorization is not None:
        headers["Authorization"] = authorization
    return await asyncio.to_thread(http_request, url, headers=headers, timeout=10.0)


async def refusal(url: str, authorization: str | None, **headers: str) -> AccessRefused:
    with pytest.raises(AccessRefused) as refused:
        await get(url, authorization, **headers)
    return refused.value


async def test_only_a_valid_token_of_this_run_gets_the_manifest_and_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[Path] = []
    read = serving._read
    monkeypatch.setattr(serving, "_read", lambda path, *a: reads.append(path) or read(path, *a))
    async with allowlisted_run() as run:
        server, manifest_url = guarded(run, tmp_path)
        url, entry = shard_url(server, manifest_url)
        issuer, now = run.issuer, time.time()
        alice = await run.authorizer(TOKENS["alice"], Identity.generate())
        bob_identity = Identity.generate()
        bob = await run.authorizer(TOKENS["bob"], bob_identity)
        carol_key = Identity.generate().public_key  # alice's second machine, banned by key
        key = Identity.generate().public_key
        tokens: dict[str, tuple[str | None, int, str]] = {  # header, status, reason
            "stranger": (None, 401, "allowlisted users only - help:"),
            "garbage": ("Bearer not*base64", 401, "is not 'Bearer <base64url"),
            "other scheme": ("Basic YWxpY2U6c2VjcmV0", 401, "is not 'Bearer <base64url"),
            "oversize": (
                "Bearer " + "A" * 5_000,
                401,
                "more than the",
            ),  # the transport refuses 8 KiB
            "forged": (
                bearer_header(
                    AccessToken.sign(Identity.generate(), "alice", key, RUN_ID, now + 600)
                ),
                403,
                "not signed by this run's authority",
            ),
            "other run": (
                bearer_header(AccessToken.sign(issuer.authority, "alice", key, "other", now + 600)),
                403,
                "is for run 'other', not 'auth-test'",
            ),
            "expired": (
                bearer_header(issuer.issue("alice", key, now=now - 2 * issuer.lifetime)),
                401,
                "expired",
            ),
            "banned user": (bob.bearer(), 403, "'bob' is revoked"),
            "banned key": (
                bearer_header(issuer.issue("alice", carol_key, now=now)),
                403,
                "revoked",
            ),
        }
        run.coordinator_authorizer.update_revocations(
            issuer.revoke(usernames=["bob"], peer_public_keys=[carol_key], now=now)
        )
        for name, (header, status, reason) in tokens.items():
            for target, extra in ((manifest_url, {}), (url, {"Range": "bytes=0-99"})):
                refused = await refusal(target, header, **extra)
                assert refused.status == status, (name, target, refused)
                assert reason in str(refused) and "help:" in str(refused), (name, str(refused))
        assert reads == []  # every refusal came before any file was read
        # A refusal says why in a short JSON body, and a 401 names the scheme to use.
        raw = await refusal(manifest_url, None)
        assert f"{manifest_url} answered HTTP 401: no access token" in str(raw)

        # alice, allowlisted and logged in, gets both; her token is checked again each time.
        header = alice.bearer()
        assert header is not None and header.startswith("Bearer ")
        listed = await get(manifest_url, header)
        assert listed.status == 200 and b'"files"' in listed.body
        part = await get(url, header, Range="bytes=0-99")
        assert part.status == 206 and part.body == server._paths[entry.sha256].read_bytes()[:100]
        assert reads == [server._paths[entry.sha256]]


async def test_the_volunteers_side_sends_its_current_token_and_stops_at_a_refusal(
    tmp_path: Path,
) -> None:
    async with allowlisted_run() as run:
        server, manifest_url = guarded(run, tmp_path / "served")
        url, entry = shard_url(server, manifest_url)
        alice = await run.authorizer(TOKENS["alice"], Identity.generate())
        asked: list[str | None] = []

        def authorization() -> str | None:  # asked per request: a renewed token is used at once
            asked.append(alice.bearer())
            return asked[-1]

        data = await asyncio.to_thread(
            ServedData.fetch, manifest_url, tmp_path / "cache", authorization=authorization
        )
        assert len(asked) == 1 and "files" in data
        ranges = -(-entry.bytes // 1000)
        target = tmp_path / "one.kitshard.zst"
        await asyncio.to_thread(
            download_shard, url, entry, target, chunk_bytes=1000, authorization=authorization
        )
        assert len(asked) == 1 + ranges and file_sha256(target) == entry.sha256

        # Without a token the manifest is refused with the reason, as a typed AuthError.
        with pytest.raises(AccessRefused, match="allowlisted users only - help:"):
            await asyncio.to_thread(ServedData.fetch, manifest_url, tmp_path / "c2")

        # A volunteer banned mid-run: its source stops at once with the reason, no retries.
        run.coordinator_authorizer.update_revocations(
            run.issuer.revoke(usernames=["alice"], now=time.time())
        )
        sleeps: list[float] = []
        source = ServedShardSource(
            data.manifest.sources["files"],
            ServedData(manifest_url, data.manifest, tmp_path / "c3", authorization=authorization),
            probability=1.0,
            seed=0,
            sleep=sleeps.append,
        )
        with pytest.raises(AccessRefused, match="'alice' is revoked") as refused:
            await asyncio.to_thread(source.next_document)
        assert refused.value.status == 403 and sleeps == []


async def test_an_open_run_serves_its_data_without_tokens(tmp_path: Path) -> None:
    peer = await create_peer(host="127.0.0.1")
    try:
        manifest, paths = shards(tmp_path)
        server = DataServer(manifest, paths)  # no guard: an open run
        server.register(peer)
        manifest_url = f"http://127.0.0.1:{peer.listen_port}/api/data/manifest.json"
        url, entry = shard_url(server, manifest_url)
        for header in (None, "Bearer garbage!"):  # a header is not even looked at
            assert (await get(manifest_url, header)).status == 200
            answer = await get(url, header, Range="bytes=0-9")
            assert answer.status == 206 and len(answer.body) == 10
        fetched: Callable[..., Any] = ServedData.fetch
        data = await asyncio.to_thread(fetched, manifest_url, tmp_path / "cache")
        assert data.manifest == manifest
    finally:
        await peer.shutdown()

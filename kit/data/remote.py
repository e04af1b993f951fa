"""The volunteer's side of served data: shards downloaded by range, verified, read in its own order.

:class:`ServedData` is the coordinator's manifest (``kit.data.manifest``) plus a small local
cache of shards. :class:`ServedShardSource` is a pipeline source over one served source: each
peer walks the shards in its own order (seeded by its identity, a new order every pass), so
volunteers spread over the shards instead of all reading the first one. A shard is downloaded
in ranges of a few MB (:func:`download_shard`): a broken transfer resumes where it stopped, one
range is in memory at a time, every request has a timeout and the whole download a deadline.
The file is checked against the manifest's SHA-256 before it is read; a mismatch is a
:class:`~kit.errors.ShardDigestMismatch`, and the source moves on to its next shard and fetches
that one again at the end of the pass. While the coordinator is unreachable (a restart) the
source waits and retries, up to ``unreachable_timeout``, and training goes on from the shard at
hand meanwhile.

In a private run every request carries the volunteer's access token (``authorization``: a
callable giving the current ``Authorization`` value, asked per request since tokens renew). A
401/403 is a :class:`~kit.errors.AccessRefused` with the coordinator's reason: it stops the
source at once instead of being retried like an unreachable coordinator.

It doesn't serve anything (``kit.data.serving``) nor parse shard contents (``kit.data.shards``).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kit.config import SourceConfig
from kit.errors import (
    CoordinatorUnreachable,
    DataSourceNotFound,
    DataSourceUnreachable,
    InvalidShard,
    ShardDigestMismatch,
)
from kit.http_client import http_request

from .manifest import DataManifest, ShardEntry, SourceShards, file_sha256
from .shards import SUFFIX, ShardSource, read_shard

logger = logging.getLogger(__name__)

#: Bytes asked for per request (the coordinator answers at most 4 MiB per request).
CHUNK_BYTES = 4 << 20
#: Seconds one range request may take. Increase this on a very slow link.
REQUEST_TIMEOUT = 60.0
#: A shard's download may take 60 s plus this many seconds per MB before it is abandoned.
SECONDS_PER_MB = 16.0
#: How long to keep retrying while the coordinator does not answer (it may be restarting).
UNREACHABLE_TIMEOUT = 300.0
#: Downloaded shards kept on disk (the oldest is deleted first).
KEEP_SHARDS = 4

#: ``authorization() -> "Bearer ..."`` (the current access token) or None (an open run).
Authorization = Callable[[], "str | None"]


def _headers(authorization: Authorization | None, **headers: str) -> dict[str, str]:
    value = authorization() if authorization is not None else None
    return {**headers, "Authorization": value} if value else headers


def download_shard(
    url: str,
    entry: ShardEntry,
    target: Path,
    *,
    ssl_context: ssl.SSLContext | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    clock: Callable[[], float] = time.monotonic,
    authorization: Authorization | None = None,
) -> Path:
    """Fetch one shard into ``target`` by ranges, resuming ``target.part``; verify its digest.

    ``authorization`` gives the ``Authorization`` header of each request (private runs).

    Raises:
        AccessRefused: the coordinator wants a valid access token (401/403), with its reason.
        CoordinatorUnreachable: a request failed (the partial file is kept for a resume).
        DataSourceUnreachable: the download ran past its deadline.
        ShardDigestMismatch: the bytes are not the published ones (the partial is deleted).
    """
    if target.is_file() and target.stat().st_size == entry.bytes:
        return target
    partial = target.with_name(target.name + ".part")
    have = partial.stat().st_size if partial.is_file() else 0
    if have > entry.bytes:
        partial.unlink()
        have = 0
    deadline = clock() + 60.0 + SECONDS_PER_MB * entry.bytes / 1e6
    with partial.open("ab") as file:
        while have < entry.bytes:
            if clock() > deadline:
                raise DataSourceUnreachable(
                    f"shard {entry.sha256[:12]} did not arrive in time ({have} of {entry.bytes} "
                    "bytes) - help: check your connection; the download resumes on the next try"
                )
            end = min(have + chunk_bytes, entry.bytes) - 1
            answer = http_request(
                url,
                headers=_headers(authorization, Range=f"bytes={have}-{end}"),
                timeout=REQUEST_TIMEOUT,
                limit=chunk_bytes,
                ssl_context=ssl_context,
            )
            body = answer.body
            if answer.status == 206:
                if not answer.headers.get("content-range", "").startswith(f"bytes {have}-"):
                    raise CoordinatorUnreachable(
                        f"{url} answered another byte range than asked - help: retry later"
                    )
            elif not (answer.status == 200 and have == 0 and len(body) == entry.bytes):
                raise CoordinatorUnreachable(f"{url} answered HTTP {answer.status} to a range")
            if not body or have + len(body) > entry.bytes:
                raise CoordinatorUnreachable(f"{url} sent {len(body)} bytes for a range")
            file.write(body)
            have += len(body)
    if file_sha256(partial) != entry.sha256:
        partial.unlink()
        raise ShardDigestMismatch(
            f"shard {entry.sha256[:12]} arrived with other bytes than the manifest publishes - "
            "help: nothing to do, kit fetches it again later (tell the organizer if it recurs)"
        )
    os.replace(partial, target)
    return target


class ServedData:
    """The data a coordinator serves: its manifest, where it is, and this peer's shard cache.

    Args:
        manifest_url: the manifest's absolute URL (shard URLs are relative to it).
        manifest: the parsed manifest.
        cache_dir: where downloaded shards are kept (at most :data:`KEEP_SHARDS`).
        ssl_context: how to check the coordinator's certificate (None: the system CAs).
        authorization: gives the ``Authorization`` header of each request (private runs: the
            current access token as ``Bearer ...``); None sends none (open runs).
    """

    def __init__(
        self,
        manifest_url: str,
        manifest: DataManifest,
        cache_dir: Path,
        *,
        ssl_context: ssl.SSLContext | None = None,
        keep_shards: int = KEEP_SHARDS,
        authorization: Authorization | None = None,
    ) -> None:
        self.manifest_url = manifest_url
        self.manifest = manifest
        self.cache_dir = Path(cache_dir)
        self.ssl_context = ssl_context
        self.keep_shards = keep_shards
        self.authorization = authorization

    @classmethod
    def fetch(
        cls,
        manifest_url: str,
        cache_dir: Path,
        *,
        ssl_context: ssl.SSLContext | None = None,
        authorization: Authorization | None = None,
    ) -> ServedData:
        """Download and check the manifest.

        Raises:
            AccessRefused: a private run's coordinator refused the (missing) access token.
            CoordinatorUnreachable: no answer. InvalidShard: not a valid manifest.
        """
        headers = _headers(authorization)
        body = http_request(
            manifest_url, headers=headers, timeout=30.0, ssl_context=ssl_context
        ).body
        try:
            data = json.loads(body)
        except ValueError as error:
            raise InvalidShard(
                f"{manifest_url} is not JSON ({error}) - help: check the coordinator's address"
            ) from None
        manifest = DataManifest.from_dict(data)
        return cls(
            manifest_url, manifest, cache_dir, ssl_context=ssl_context, authorization=authorization
        )

    def __contains__(self, name: object) -> bool:
        return name in self.manifest.sources

    def open_source(
        self, config: SourceConfig, *, seed: int, vocab_size: int, tokenizer: str
    ) -> ServedShardSource:
        """A pipeline source over the served shards of ``config``.

        Raises:
            DataSourceNotFound: the coordinator does not serve this source.
            InvalidShard: its shards were written with another tokenizer than ``tokenizer``.
        """
        shards = self.manifest.sources.get(config.name)
        if shards is None:
            raise DataSourceNotFound(
                f"the coordinator serves no source {config.name!r} - help: tell the organizer"
            )
        if shards.tokenizer != tokenizer or shards.vocab_size != vocab_size:
            raise InvalidShard(
                f"the coordinator's shards of {config.name!r} were written with tokenizer "
                f"{shards.tokenizer} ({shards.vocab_size} pieces), this peer has {tokenizer} "
                f"({vocab_size}) - help: delete this peer's cached tokenizer (.kit folder) and join again"
            )
        return ServedShardSource(shards, self, probability=config.probability, seed=seed)

    def local_shard(self, entry: ShardEntry) -> Path:
        """The shard on disk (downloaded now if needed); older cached shards are deleted."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        target = self.cache_dir / f"{entry.sha256}{SUFFIX}"
        url = urllib.parse.urljoin(self.manifest_url, entry.url)
        download_shard(
            url, entry, target, ssl_context=self.ssl_context, authorization=self.authorization
        )
        os.utime(target)  # most recently used
        kept = sorted(
            self.cache_dir.glob(f"*{SUFFIX}"), key=lambda path: path.stat().st_mtime, reverse=True
        )
        for old in kept[self.keep_shards :]:
            if old != target:
                old.unlink(missing_ok=True)
        return target


class ServedShardSource(ShardSource):
    """A pipeline source over one served source, in this peer's shard order; resumable.

    A :class:`~kit.data.shards.ShardSource` whose shards are fetched from the coordinator
    first; a shard whose digest is wrong is put at the end of the pass (tried once more there)
    and the next position is read meanwhile.

    Args:
        shards: the source's entry of the manifest.
        data: where to get the shards.
        probability: share of documents drawn from this source.
        seed: this peer's seed for the shard order (a new order every pass).
        unreachable_timeout: seconds to keep retrying a coordinator that does not answer.
        sleep: how to wait between retries (tests pass a fake).
    """

    def __init__(
        self,
        shards: SourceShards,
        data: ServedData,
        *,
        probability: float,
        seed: int,
        unreachable_timeout: float = UNREACHABLE_TIMEOUT,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(
            shards.name,
            [shard.sha256 for shard in shards.shards],
            probability=probability,
            seed=seed,
            vocab_size=shards.vocab_size,
            tokenizer=shards.tokenizer,
        )
        self._entries = shards.shards
        self._data = data
        self._unreachable_timeout = unreachable_timeout
        self._sleep = sleep
        self._deferred: list[int] = []  # shards that failed their digest in this pass
        self.digest_failures = 0  # shards thrown away for a wrong digest (diagnostics)

    def _order(self) -> list[int]:
        return super()._order() + self._deferred

    def _pass_length(self) -> int:
        return len(self._entries) + len(self._deferred)

    def _open(self, index: int) -> Iterator[np.ndarray]:
        try:
            path = self._fetch(self._entries[index])
        except ShardDigestMismatch as error:  # read another position first; this one again last
            self.digest_failures += 1
            if index in self._deferred:
                logger.warning("%s again; leaving it out of this pass", error)
            else:
                self._deferred.append(index)
                logger.warning("%s; reading another shard first", error)
            return iter(())
        return read_shard(path, vocab_size=self._vocab_size, tokenizer=self._tokenizer)

    def _fetch(self, entry: ShardEntry) -> Path:
        """Download, waiting (bounded) through a coordinator that does not answer."""
        started, pause = time.monotonic(), 1.0
        while True:
            try:
                return self._data.local_shard(entry)
            except (CoordinatorUnreachable, DataSourceUnreachable) as error:
                if time.monotonic() - started > self._unreachable_timeout:
                    raise DataSourceUnreachable(
                        f"source {self.name!r}: the coordinator has not served shard "
                        f"{entry.sha256[:12]} for {self._unreachable_timeout:.0f} s ({error}) - "
                        "help: check your connection, or ask the organizer whether it runs"
                    ) from None
                logger.info("shard %s: %s; retrying in %.0f s", entry.sha256[:12], error, pause)
                self._sleep(pause)
                pause = min(pause * 2, 30.0)

    def start_next_epoch(self) -> None:
        super().start_next_epoch()
        self._deferred = []

    def state_dict(self) -> dict[str, Any]:
        """The position (:class:`ShardSource`'s) and the shards deferred in this pass."""
        return {**super().state_dict(), "deferred": list(self._deferred)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._deferred = [int(index) for index in state["deferred"]]

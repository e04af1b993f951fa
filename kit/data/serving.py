"""The organizer's files, served: tokenized once into shards, listed in a manifest, sent by range.

A source of files on the organizer's disk (``SourceConfig.served``) is something no remote
volunteer can open. The coordinator therefore reads it once, with the run's tokenizer and the
data filters, into zstd token shards (``kit.data.shards``, a few MB each), and serves them on
its own port: ``/api/data/manifest.json`` (:mod:`kit.data.manifest`) and
``/api/data/shard?sha256=...`` with HTTP byte ranges of at most :data:`MAX_RANGE_BYTES`, so
volunteers download resumably and neither side holds more than a chunk in memory. Shards the
organizer already made (``pretokenized: true``) are checked and served as they are.

The work is cached in the coordinator's state folder under a key of everything it depends on
(the source's settings, the filters, the tokenizer, each file's size and time), so a restart
serves at once and a changed corpus is tokenized again.

In a private run the coordinator passes a *request guard* (``kit.auth``'s bearer-token check,
as a callable: this room knows nothing of tokens): both routes then answer 401 or 403 with the
reason to a request without a valid access token, before any file is read.

It doesn't hold the shard format (``kit.data.shards``), the volunteer's side
(``kit.data.remote``) or the coordinator's other routes.
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tqdm.auto import tqdm

from kit.config import DataConfig, SourceConfig
from kit.errors import DataSourceNotFound
from kit.p2p.transport import HttpRequest, HttpResponse

from .manifest import (
    MANIFEST_PATH,
    SHARD_PATH,
    DataManifest,
    ShardEntry,
    SourceShards,
    file_sha256,
)
from .shards import SUFFIX, ShardWriter, read_shard
from .sources import TextSource
from .tokenizer import tokenizer_fingerprint

logger = logging.getLogger(__name__)

#: Token ids per shard (~8 MB of uint16 before zstd). Lower it for small corpora, so that
#: volunteers start on different shards; raise it if a corpus makes tens of thousands.
DEFAULT_SHARD_TOKENS = 1 << 22
#: The largest byte range one request gets: what the coordinator holds in memory per download.
MAX_RANGE_BYTES = 4 << 20
#: Shard requests answered at once (each holds one range in memory while it is sent).
MAX_CONCURRENT_RANGES = 8
#: Bumped when the way shards are made changes, so old caches are not served.
_CACHE_VERSION = 1
_TOKENIZE_BATCH = 1_000
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")

#: ``guard(request) -> None`` to serve it, or ``(status, reason)`` to refuse it (401 or 403).
RequestGuard = Callable[[HttpRequest], "tuple[int, str] | None"]


def resolve_files(source: SourceConfig) -> list[str]:
    """The files a served source names: globs expanded (relative to the current folder), URLs kept.

    Raises:
        DataSourceNotFound: a path or pattern matches no file.
    """
    files: list[str] = []
    for pattern in source.data_files:
        if "://" in pattern:
            files.append(pattern)
            continue
        matches = sorted(
            path for path in glob.glob(pattern, recursive=True) if Path(path).is_file()
        )
        if not matches:
            raise DataSourceNotFound(
                f"source {source.name!r}: no file matches {pattern!r} (relative paths start at "
                f"{os.getcwd()}) - help: fix data_files, or run the coordinator from the folder "
                "that holds the files"
            )
        files.extend(matches)
    return files


def _cache_key(source: SourceConfig, data: DataConfig, files: list[str], fingerprint: str,
               shard_tokens: int) -> str:  # fmt: skip
    stats: list[list[Any]] = []
    for file in files:
        if "://" in file:
            stats.append([file])
        else:
            info = os.stat(file)
            stats.append([os.path.abspath(file), info.st_size, info.st_mtime_ns])
    key = {
        "version": _CACHE_VERSION,
        "source": source.to_dict(),
        "filters": [data.min_chars, data.on_invalid_text],
        "tokenizer": fingerprint,
        "shard_tokens": shard_tokens,
        "files": stats,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _folder_name(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:40]
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _tokenized(source: SourceConfig, data: DataConfig, tokenizer: Tokenizer) -> Iterator[list[int]]:
    """One pass over a text source, filtered like the pipeline, as token ids (no specials)."""
    text = TextSource(source, min_chars=data.min_chars, on_invalid_text=data.on_invalid_text)
    batch: list[str] = []
    while True:
        document = text.next_document()
        if document is not None:
            batch.append(document)
        if batch and (document is None or len(batch) >= _TOKENIZE_BATCH):
            for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
                yield encoding.ids
            batch = []
        if document is None:
            return


def _write_text_shards(
    source: SourceConfig, data: DataConfig, tokenizer: Tokenizer, folder: Path,
    shard_tokens: int, progress: bool,
) -> list[tuple[Path, int, int]]:  # fmt: skip
    """Tokenize ``source`` into shards of about ``shard_tokens`` ids; (path, documents, tokens)."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    tokenizer = Tokenizer.from_str(tokenizer.to_str())  # the examples decide lengths, not it
    tokenizer.no_padding()
    tokenizer.no_truncation()
    written: list[tuple[Path, int, int]] = []
    writer: ShardWriter | None = None

    def close() -> None:
        if writer is not None:
            writer.close()
            written.append((writer.path, writer.documents, writer.tokens))

    with tqdm(desc=f"shards of {source.name}", unit="doc", disable=not progress) as bar:
        for ids in _tokenized(source, data, tokenizer):
            if writer is None or writer.tokens >= shard_tokens:
                close()
                path = folder / f"shard-{len(written):05d}{SUFFIX}"
                writer = ShardWriter(
                    path, vocab_size=tokenizer.get_vocab_size(), tokenizer=fingerprint
                )
            writer.write(ids)
            bar.update(1)
    close()
    return written


def _check_pretokenized(files: list[str], tokenizer: Tokenizer) -> list[tuple[Path, int, int]]:
    """Read every organizer shard through (validating it); (path, documents, tokens)."""
    checked = []
    for file in files:
        if "://" in file:
            raise DataSourceNotFound(
                f"shard {file!r} is a URL in a source of the organizer's files - help: list "
                "shards on the Hub in a source of their own (every peer reads URLs itself)"
            )
        documents = tokens = 0
        for ids in read_shard(
            file,
            vocab_size=tokenizer.get_vocab_size(),
            tokenizer=tokenizer_fingerprint(tokenizer),
        ):
            documents += 1
            tokens += len(ids)
        checked.append((Path(file), documents, tokens))
    return checked


def prepare_source(
    source: SourceConfig,
    data: DataConfig,
    tokenizer: Tokenizer,
    root: Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
) -> tuple[SourceShards, dict[str, Path]]:
    """The shards of one served source (made, or found in the cache); and where each file is.

    Raises:
        DataSourceNotFound, EmptySource, InvalidText, InvalidShard: the organizer's files
            cannot be served as they are (the message says how to fix them).
    """
    files = resolve_files(source)
    fingerprint = tokenizer_fingerprint(tokenizer)
    key = _cache_key(source, data, files, fingerprint, shard_tokens)
    home = root / _folder_name(source.name)
    folder = home / key[:16]
    manifest_file = folder / "manifest.json"
    if manifest_file.is_file():
        try:
            cached = json.loads(manifest_file.read_text("utf-8"))
            paths = {digest: Path(path) for digest, path in cached["paths"].items()}
            shards = DataManifest.from_dict(cached["manifest"]).sources[source.name]
            if all(path.is_file() for path in paths.values()):
                logger.info("serving %d cached shards of %r", len(shards.shards), source.name)
                return shards, paths
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning(
                "the shard cache of %r is unreadable (%s): rebuilding it", source.name, error
            )
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    if source.pretokenized:
        made = _check_pretokenized(files, tokenizer)
    else:
        made = _write_text_shards(source, data, tokenizer, folder, shard_tokens, progress)
    if not made or not any(documents for _, documents, _ in made):
        raise DataSourceNotFound(
            f"source {source.name!r} gave no document to serve - help: check its data_files"
        )
    entries, paths = [], {}
    for path, documents, tokens in made:
        digest = file_sha256(path)
        entries.append(ShardEntry(digest, path.stat().st_size, documents, tokens))
        paths[digest] = path
    shards = SourceShards(source.name, fingerprint, tokenizer.get_vocab_size(), tuple(entries))
    record = {
        "manifest": DataManifest({source.name: shards}).to_dict(),
        "paths": {digest: str(path.resolve()) for digest, path in paths.items()},
    }
    partial = manifest_file.with_suffix(".partial")
    partial.write_text(json.dumps(record), "utf-8")
    os.replace(partial, manifest_file)
    for old in home.iterdir():  # caches of earlier versions of the corpus
        if old != folder and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    logger.info(
        "serving %r: %d documents in %d shards (%.1f MB)",
        source.name, shards.documents, len(entries), shards.bytes / 1e6,
    )  # fmt: skip
    return shards, paths


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end)`` inclusive for a one-range ``Range`` header, clamped to the file and to
    :data:`MAX_RANGE_BYTES`; None if there is no header. Raises ValueError if unsatisfiable."""
    if header is None:
        return None
    found = _RANGE.match(header.strip())
    if found is None or found.groups() == ("", ""):
        raise ValueError(f"unsupported range {header!r}")
    first, last = found.groups()
    if first == "":  # the last N bytes
        start, end = max(0, size - int(last)), size - 1
    else:
        start = int(first)
        end = size - 1 if last == "" else min(int(last), size - 1)
    if start >= size or end < start:
        raise ValueError(f"range {header!r} is outside the {size} bytes")
    return start, min(end, start + MAX_RANGE_BYTES - 1)


def _read(path: Path, start: int, length: int) -> bytes:
    with path.open("rb") as file:
        file.seek(start)
        return file.read(length)


class DataServer:
    """Answers ``/api/data/manifest.json`` and ``/api/data/shard`` for the served sources.

    Args:
        manifest, paths: the served shards and where each file is.
        guard: checks each request first (private runs); None serves everyone (open runs).
    """

    def __init__(
        self, manifest: DataManifest, paths: dict[str, Path], guard: RequestGuard | None = None
    ) -> None:
        self.manifest = manifest
        self.guard = guard
        self._paths = paths
        self._sizes = {
            shard.sha256: shard.bytes
            for source in manifest.sources.values()
            for shard in source.shards
        }
        self._body = json.dumps(manifest.to_dict(), separators=(",", ":")).encode()
        self._slots: asyncio.Semaphore | None = None

    def register(self, peer: Any) -> None:
        """Add the two routes to the coordinator's peer."""
        peer.add_http_route(MANIFEST_PATH, self.serve_manifest)
        peer.add_http_route(SHARD_PATH, self.serve_shard)

    def _refusal(self, request: HttpRequest) -> HttpResponse | None:
        if self.guard is None:
            return None
        refused = self.guard(request)
        if refused is None:
            return None
        status, reason = refused
        body = json.dumps({"error": reason}).encode()
        headers = [("Cache-Control", "no-store")]
        if status == 401:
            headers.append(("WWW-Authenticate", 'Bearer realm="kit"'))
        logger.debug("refused %s from %s: %s", request.path, request.remote_host, reason)
        return HttpResponse(status, body, "application/json", tuple(headers))

    async def serve_manifest(self, request: HttpRequest) -> HttpResponse:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        return HttpResponse(200, self._body, "application/json", (("Cache-Control", "no-store"),))

    async def serve_shard(self, request: HttpRequest) -> HttpResponse:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        digest = request.query.get("sha256", "")
        if digest not in self._sizes:
            return HttpResponse(404, b"no such shard", "text/plain")
        size = self._sizes[digest]
        try:
            span = parse_range(request.headers.get("range"), size)
        except ValueError as error:
            unsatisfiable = (("Content-Range", f"bytes */{size}"),)
            return HttpResponse(416, str(error).encode(), "text/plain", unsatisfiable)
        if span is None and size > MAX_RANGE_BYTES:
            message = f"ask with Range: bytes=START-END, at most {MAX_RANGE_BYTES} bytes at once"
            return HttpResponse(400, message.encode(), "text/plain")
        start, end = span if span is not None else (0, size - 1)
        if self._slots is None:  # made on the loop that serves
            self._slots = asyncio.Semaphore(MAX_CONCURRENT_RANGES)
        async with self._slots:
            body = await asyncio.to_thread(_read, self._paths[digest], start, end - start + 1)
        headers: list[tuple[str, str]] = [("Accept-Ranges", "bytes"), ("ETag", f'"{digest}"')]
        if span is None:
            return HttpResponse(200, body, "application/octet-stream", tuple(headers))
        headers.append(("Content-Range", f"bytes {start}-{end}/{size}"))
        return HttpResponse(206, body, "application/octet-stream", tuple(headers))


def prepare_served_data(
    config: DataConfig,
    tokenizer: Tokenizer,
    root: Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
) -> DataServer | None:
    """Shards of every served source of ``config`` (None when the run has none).

    Raises:
        DataError: a source cannot be served (see :func:`prepare_source`).
    """
    sources, paths = {}, {}
    for source in config.sources:
        if source.served:
            shards, files = prepare_source(
                source, config, tokenizer, root, shard_tokens=shard_tokens, progress=progress
            )
            sources[source.name] = shards
            paths.update(files)
    return DataServer(DataManifest(sources), paths) if sources else None

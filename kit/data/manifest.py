"""The manifest of the data a coordinator serves: which shards each source has, and their digests.

The coordinator publishes it at ``/api/data/manifest.json``; every volunteer reads it before its
first shard. For each served source it names the tokenizer that wrote the shards (its
fingerprint and vocabulary size, so a volunteer with another tokenizer stops at once) and, per
shard, the SHA-256, byte size, documents and tokens. A volunteer checks each downloaded shard
against its SHA-256 before reading a byte of it.

It holds the dataclasses and their strict JSON (de)serialization only: bounded counts and sizes,
exact types, hex digests. It doesn't build shards (``kit.data.serving``) nor download them
(``kit.data.remote``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kit.errors import InvalidShard

MANIFEST_VERSION = 1
#: Where the coordinator publishes the manifest, and where it serves shards (``?sha256=...``).
MANIFEST_PATH = "/api/data/manifest.json"
SHARD_PATH = "/api/data/shard"
#: Limits a volunteer applies to a manifest it receives (a huge one is refused, not allocated).
MAX_SOURCES = 64
MAX_SHARDS_PER_SOURCE = 1_000_000
MAX_SHARD_BYTES = 1 << 34
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One served shard."""

    sha256: str  # hex digest of the file's bytes
    bytes: int  # file size
    documents: int  # documents in the shard
    tokens: int  # token ids in the shard

    @property
    def url(self) -> str:
        """Its address on the coordinator (relative to the coordinator's link)."""
        return f"{SHARD_PATH}?sha256={self.sha256}"


@dataclasses.dataclass(frozen=True)
class SourceShards:
    """The shards of one served source, and the tokenizer that wrote them."""

    name: str  # the source's name in data.sources
    tokenizer: str  # fingerprint (kit.data.tokenizer.tokenizer_fingerprint)
    vocab_size: int  # the tokenizer's vocabulary size
    shards: tuple[ShardEntry, ...]

    @property
    def documents(self) -> int:
        return sum(shard.documents for shard in self.shards)

    @property
    def bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)


@dataclasses.dataclass(frozen=True)
class DataManifest:
    """Every served source of a run."""

    sources: Mapping[str, SourceShards]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": MANIFEST_VERSION,
            "sources": {
                name: {
                    "tokenizer": source.tokenizer,
                    "vocab_size": source.vocab_size,
                    "shards": [
                        {**dataclasses.asdict(shard), "url": shard.url} for shard in source.shards
                    ],
                }
                for name, source in self.sources.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "data manifest") -> DataManifest:
        """Parse and check a manifest (raises InvalidShard naming what is wrong)."""
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise _invalid(where, f"is not a version-{MANIFEST_VERSION} kit data manifest")
        sources = data.get("sources")
        if not isinstance(sources, dict) or len(sources) > MAX_SOURCES:
            raise _invalid(where, "has no valid sources mapping")
        parsed = {}
        for name, body in sources.items():
            label = f"{where}: source {name!r}"
            if not isinstance(name, str) or not isinstance(body, dict):
                raise _invalid(label, "is not a mapping")
            tokenizer, vocab_size = body.get("tokenizer"), body.get("vocab_size", -1)
            shards = body.get("shards")
            if not isinstance(tokenizer, str) or not _is_count(vocab_size, 1 << 32):
                raise _invalid(label, "names no valid tokenizer fingerprint and vocab_size")
            if not isinstance(shards, list) or not 0 < len(shards) <= MAX_SHARDS_PER_SOURCE:
                raise _invalid(label, "lists no shards")
            parsed[name] = SourceShards(
                name, tokenizer, int(vocab_size), tuple(_shard(item, label) for item in shards)
            )
        return cls(parsed)


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes (read 1 MiB at a time)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _is_count(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= limit


def _shard(item: Any, where: str) -> ShardEntry:
    if not isinstance(item, dict):
        raise _invalid(where, "has a shard that is not a mapping")
    digest = item.get("sha256")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise _invalid(where, f"has a shard without a hex SHA-256: {digest!r}")
    size, documents, tokens = (item.get(key, -1) for key in ("bytes", "documents", "tokens"))
    if (
        not all(_is_count(count, MAX_SHARD_BYTES) for count in (size, documents, tokens))
        or not size
    ):
        raise _invalid(where, f"has shard {digest[:12]} with bad bytes/documents/tokens")
    return ShardEntry(digest, int(size), int(documents), int(tokens))


def _invalid(where: str, problem: str) -> InvalidShard:
    return InvalidShard(
        f"{where} {problem} - help: the coordinator and this kit may differ; install the "
        "organizer's kit (its join notebook does), or tell the organizer"
    )

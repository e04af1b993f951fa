"""Streaming document sources, interleaved, filtered and shuffled per peer, all resumable.

It holds the stages between "a dataset on the Hub or on disk" and "this peer's next document":

* :class:`TextSource` opens one source with ``datasets.load_dataset(..., streaming=True)``. Hub
  names and local ``data_files`` take the same code path. It drops empty, short and undecodable
  lines, and counts each one.
* :class:`DocumentStream` draws sources with their probabilities (sahajBERT: Wikipedia 0.23, OSCAR
  0.77) and shuffles through a window of documents, with seeds derived from the peer's identity,
  so every volunteer sees its own order (DeDLOC §4.2 found independent shuffling "important
  for quality").

Every stage resumes from a small JSON-serializable state. The shuffle is a *window* shuffle
(fill, permute, drain) rather than a sliding buffer. Its state is then where the window started
plus a position, a few hundred bytes, not the buffered documents themselves. On resume the
window is re-read, at most ``shuffle_buffer_size`` documents. Random draws come from counters
hashed with the seed, not from a stateful generator, so replaying a window gives the same draws.

It doesn't hold tokenization or example construction (kit.data.examples), the pre-tokenized
shard format (kit.data.shards), or the wiring of all stages (kit.data.pipeline).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from kit.config import SourceConfig, config_error
from kit.errors import DataSourceNotFound, DataSourceUnreachable, EmptySource, InvalidText

logger = logging.getLogger(__name__)

#: A document is text (from a text source) or token ids (from pre-tokenized shards).
Document = str | np.ndarray

#: Builders whose files ``datasets`` decodes itself; they take ``encoding_errors``.
_DECODING_BUILDERS = ("text", "json", "csv")
_MASK64 = (1 << 64) - 1


# --- seeds ------------------------------------------------------------------------------------


def derive_seed(*parts: int | str | bytes) -> int:
    """A 64-bit seed from labelled parts (SHA-256), stable across processes and machines.

    Unlike ``hash()``, which sahajBERT used and which Python salts per process, the same parts
    always give the same seed, so a restarted peer can replay its own order.
    """
    digest = hashlib.sha256()
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode("utf-8")
        digest.update(len(raw).to_bytes(4, "little") + raw)
    return int.from_bytes(digest.digest()[:8], "little")


def peer_shuffle_seed(peer_identity: bytes, shuffle_seed: int) -> int:
    """The seed of one peer's data order: its identity bytes (e.g. ``PeerID.to_bytes()``) + the run's seed."""
    return derive_seed("kit.data.shuffle", bytes(peer_identity), shuffle_seed)


def counter_uniform(seed: int, counter: int) -> float:
    """A uniform float in [0, 1) for draw number ``counter`` (SplitMix64 of seed and counter)."""
    value = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    value ^= value >> 31
    return (value >> 11) * (1.0 / (1 << 53))


# --- one source ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SourceCounts:
    """What one source has read and dropped so far (nothing is dropped without a count)."""

    name: str  # the source's name in data.sources
    read: int = 0  # documents read from the stream
    used: int = 0  # documents passed on to the pipeline
    empty: int = 0  # dropped: empty or whitespace-only (or a null value)
    too_short: int = 0  # dropped: fewer than data.min_chars characters
    invalid_text: int = 0  # dropped: not valid UTF-8 (decoded with replacement characters)
    epochs_completed: int = 0  # full passes over the source so far


class DocumentSource(Protocol):
    """What DocumentStream needs from a source (TextSource and kit.data.shards.ShardSource)."""

    name: str
    probability: float

    def next_document(self) -> Document | None:
        """The next usable document, or None at the end of the current pass."""

    def start_next_epoch(self) -> None:
        """Begin another pass over the source."""

    def counts(self) -> SourceCounts:
        """Counters so far."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position and counters."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position returned by state_dict()."""


class TextSource:
    """One text source streamed through ``datasets``, with filtering and counters.

    Args:
        config: the source (Hub name or file builder + data_files, split, column, ...).
        min_chars: documents shorter than this after stripping are dropped (and counted).
        on_invalid_text: "skip" drops lines with undecodable bytes (counted); "raise" stops.
        shard_seed: seed of this peer's shard order (used when the source has several shards).

    Raises:
        DataSourceNotFound: a data file or the Hub dataset does not exist or can't be reached.
    """

    def __init__(
        self,
        config: SourceConfig,
        *,
        min_chars: int = 1,
        on_invalid_text: str = "skip",
        shard_seed: int = 0,
    ) -> None:
        self.name = config.name
        self.probability = config.probability
        self._config = config
        self._min_chars = min_chars
        self._raise_on_invalid = on_invalid_text == "raise"
        self._shard_seed = shard_seed
        self._dataset = _open_dataset(config, shard_seed)
        self._pristine = True  # opened and never iterated nor positioned
        self._iterator: Iterator[dict[str, Any]] | None = None
        self._epoch = 0
        self._counts = SourceCounts(config.name)
        self._used_this_epoch = 0

    def next_document(self) -> str | None:
        """The next document that passes the filters, or None at the end of this pass.

        Raises:
            EmptySource: a full pass ended without a single usable document.
            InvalidText: undecodable bytes and ``on_invalid_text="raise"``.
        """
        if self._iterator is None:
            self._iterator = iter(self._dataset)
            self._pristine = False
        column = self._config.text_column
        read = empty = too_short = invalid = 0
        try:
            for example in self._iterator:
                read += 1
                text = example.get(column)
                if text is None and column not in example:
                    raise config_error(
                        f"data.sources[{self.name}].text_column",
                        f"{column!r} is not a column (columns: {', '.join(example)})",
                        "set text_column to the column that holds the text",
                    )
                if not isinstance(text, str) or not text.strip():
                    empty += 1
                elif "\ufffd" in text:
                    # Files are decoded with errors="replace", so U+FFFD marks bytes that were not
                    # UTF-8 (here or upstream): the line is damaged, not just oddly spelled.
                    if self._raise_on_invalid:
                        raise InvalidText(
                            f"source {self.name!r} has a line that is not valid UTF-8 (document "
                            f"{self._counts.read + read} of pass {self._epoch + 1}): {text[:60]!r} - "
                            "help: re-encode the file as UTF-8, or set data.on_invalid_text: skip"
                        )
                    invalid += 1
                elif len(text.strip()) < self._min_chars:
                    too_short += 1
                else:
                    self._used_this_epoch += 1
                    self._add(read, 1, empty, too_short, invalid)
                    read = 0
                    return text
        except UnicodeDecodeError as error:
            # Builders that parse bytes themselves (pyarrow's JSON reader) can't skip one line.
            raise InvalidText(
                f"source {self.name!r} holds bytes that are not UTF-8 ({error.reason} at byte "
                f"{error.start} of a chunk), and its reader cannot skip a single line - help: "
                "re-encode the file as UTF-8 (e.g. iconv -c), or convert it to a text file"
            ) from None
        except FileNotFoundError as error:
            raise DataSourceNotFound(
                f"source {self.name!r}: a data file disappeared while streaming ({error}) - help: "
                "keep the files in place while training"
            ) from None
        except ConnectionError as error:  # datasets retries first; this is after its retries
            raise DataSourceUnreachable(
                f"source {self.name!r}: lost the connection while streaming ({error}) - help: "
                "check your network; the pipeline resumes from its last state_dict()"
            ) from None
        finally:
            if read:
                self._add(read, 0, empty, too_short, invalid)
        self._finish_pass()
        return None

    def _add(self, read: int, used: int, empty: int, too_short: int, invalid: int) -> None:
        counts = self._counts
        self._counts = dataclasses.replace(
            counts,
            read=counts.read + read,
            used=counts.used + used,
            empty=counts.empty + empty,
            too_short=counts.too_short + too_short,
            invalid_text=counts.invalid_text + invalid,
        )

    def _finish_pass(self) -> None:
        self._counts = dataclasses.replace(
            self._counts, epochs_completed=self._counts.epochs_completed + 1
        )
        if self._used_this_epoch == 0:
            counts = self._counts
            raise EmptySource(
                f"source {self.name!r} gave no usable document in a full pass (read {counts.read}, "
                f"empty {counts.empty}, shorter than min_chars={self._min_chars}: {counts.too_short}, "
                f"invalid UTF-8: {counts.invalid_text}) - help: check data_files/split/text_column, "
                "or lower data.min_chars"
            )

    def start_next_epoch(self) -> None:
        """Begin another pass (on several shards, in a new order: datasets reshuffles per epoch)."""
        self._epoch += 1
        self._used_this_epoch = 0
        self._dataset.set_epoch(self._epoch)
        self._iterator = None

    def counts(self) -> SourceCounts:
        """Counters so far."""
        return self._counts

    def state_dict(self) -> dict[str, Any]:
        """Position within the stream (datasets' own state_dict) and the counters."""
        position = copy.deepcopy(self._dataset.state_dict()) if self._iterator is not None else None
        return {
            "epoch": self._epoch,
            "position": position,
            "used_this_epoch": self._used_this_epoch,
            "counts": dataclasses.asdict(self._counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the next document is the one after the saved position."""
        self._epoch = int(state["epoch"])
        self._used_this_epoch = int(state["used_this_epoch"])
        self._counts = SourceCounts(**state["counts"])
        if state["position"] is None:
            if not self._pristine:  # datasets keeps a loaded position around: start clean
                self._dataset = _open_dataset(self._config, self._shard_seed)
                self._pristine = True
            self._dataset.set_epoch(self._epoch)
            self._iterator = None
        else:
            self._dataset.set_epoch(self._epoch)
            self._dataset.load_state_dict(copy.deepcopy(state["position"]))
            self._iterator = iter(self._dataset)
            self._pristine = False


def _open_dataset(config: SourceConfig, shard_seed: int) -> Any:
    """``datasets.load_dataset(..., streaming=True)`` with kit's typed errors; shards in peer order."""
    import datasets  # heavy import (pyarrow, fsspec): only when a source is opened

    kwargs: dict[str, Any] = {"split": config.split, "streaming": True}
    if config.data_files:
        kwargs["data_files"] = list(config.data_files)
    if config.subset is not None:
        kwargs["name"] = config.subset
    if config.revision is not None:
        kwargs["revision"] = config.revision
    if config.path in _DECODING_BUILDERS:
        # Decode with replacement so one bad line is counted (or reported) instead of killing
        # the whole stream with a UnicodeDecodeError that names no line.
        kwargs["encoding_errors"] = "replace"
    try:
        dataset = datasets.load_dataset(config.path, **kwargs)
    except datasets.exceptions.DatasetNotFoundError as error:  # before FileNotFoundError, its base
        raise DataSourceNotFound(
            f"source {config.name!r}: {error} - help: check the Hub dataset name (and that your "
            "token may read it), or set path to a file builder such as 'text'"
        ) from None
    except FileNotFoundError as error:
        raise DataSourceNotFound(
            f"source {config.name!r}: {error} - help: check data_files (relative paths start at "
            "the current directory)"
        ) from None
    except ConnectionError as error:
        raise DataSourceUnreachable(
            f"source {config.name!r}: {error} - help: check your network (or HF_ENDPOINT), then "
            "retry; use local data_files to work offline"
        ) from None
    except ValueError as error:
        raise config_error(
            f"data.sources[{config.name}]",
            f"cannot be opened: {error}",
            "check path, subset and split",
        ) from None
    if dataset.num_shards > 1:
        # datasets shuffles the order of shards (files) only with buffer_size=1: each peer
        # starts on another file; the window shuffle in DocumentStream mixes documents.
        dataset = dataset.shuffle(seed=shard_seed, buffer_size=1, max_buffer_input_shards=1)
    return dataset


# --- interleave + window shuffle ----------------------------------------------------------------


class DocumentStream:
    """Several sources drawn by probability, then shuffled window by window, for one peer.

    Args:
        sources: the opened sources (their ``probability`` attributes sum to 1).
        seed: this peer's seed (:func:`peer_shuffle_seed`).
        window_size: documents per shuffle window (``data.shuffle_buffer_size``).
        repeat: start a new pass when a source ends (forever); False drops ended sources and
            stops once all have ended.
    """

    def __init__(
        self, sources: Sequence[DocumentSource], *, seed: int, window_size: int, repeat: bool = True
    ) -> None:
        if not sources:
            raise config_error(
                "data.sources", "is empty", "list at least one source under data.sources"
            )
        self._sources = list(sources)
        self._seed = seed
        self._window_size = window_size
        self._repeat = repeat
        self._active = [True] * len(sources)
        self._draws = 0
        self._window_index = -1  # no window read yet
        self._window: list[Document] = []
        self._position = 0
        self._window_start: dict[str, Any] | None = None
        self._initial = self._snapshot()

    def __iter__(self) -> Iterator[Document]:
        while (document := self.next_document()) is not None:
            yield document

    def next_document(self) -> Document | None:
        """The next document in this peer's order, or None when every source has ended."""
        if self._position >= len(self._window):
            self._fill_window(self._window_index + 1)
            if not self._window:
                return None
        document = self._window[self._position]
        self._position += 1
        return document

    def _draw(self) -> Document | None:
        """One document from a source picked by probability (None when all sources ended)."""
        while any(self._active):
            weights = [
                source.probability if active else 0.0
                for source, active in zip(self._sources, self._active, strict=True)
            ]
            threshold = counter_uniform(self._seed, self._draws) * sum(weights)
            self._draws += 1
            chosen = len(weights) - 1
            cumulative = 0.0
            for index, weight in enumerate(weights):
                cumulative += weight
                if threshold < cumulative and weight > 0:
                    chosen = index
                    break
            while not self._active[chosen]:  # float round-off at the top end
                chosen -= 1
            source = self._sources[chosen]
            document = source.next_document()
            if document is not None:
                return document
            if self._repeat:
                source.start_next_epoch()
                document = source.next_document()
                if document is not None:
                    return document
            self._active[chosen] = False
            logger.info(
                "data: source %r ended after %d passes",
                source.name,
                source.counts().epochs_completed,
            )
        return None

    def _fill_window(self, window_index: int) -> None:
        self._window_index = window_index
        self._window_start = self._snapshot()
        documents: list[Document] = []
        while len(documents) < self._window_size:
            document = self._draw()
            if document is None:
                break
            documents.append(document)
        order = np.random.default_rng([self._seed, 0x57494E, window_index]).permutation(
            len(documents)
        )
        self._window = [documents[i] for i in order]
        self._position = 0

    def _snapshot(self) -> dict[str, Any]:
        return {
            "window_index": self._window_index,
            "draws": self._draws,
            "active": list(self._active),
            "sources": [source.state_dict() for source in self._sources],
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        if len(snapshot["sources"]) != len(self._sources):
            raise config_error(
                "data state",
                "was saved with another number of sources",
                "resume with the same data.sources",
            )
        self._window_index = int(snapshot["window_index"])
        self._draws = int(snapshot["draws"])
        self._active = [bool(flag) for flag in snapshot["active"]]
        for source, state in zip(self._sources, snapshot["sources"], strict=True):
            source.load_state_dict(state)
        self._window = []
        self._position = 0

    def state_dict(self) -> dict[str, Any]:
        """Where this peer is: the state at the start of the current window + the position in it."""
        if self._window_start is None:
            return {"window_start": None, "position": 0}
        return {"window_start": copy.deepcopy(self._window_start), "position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: re-read the saved window (same draws, same permutation)."""
        if state["window_start"] is None:
            self._restore(self._initial)
            self._window_start = None
            return
        start = state["window_start"]
        self._restore(start)
        self._fill_window(int(start["window_index"]))
        self._position = int(state["position"])
        if self._position > len(self._window):
            raise config_error(
                "data state",
                "points past the end of its window",
                "resume with the same data settings",
            )

    def statistics(self) -> tuple[SourceCounts, ...]:
        """Counters of every source, in configuration order."""
        return tuple(source.counts() for source in self._sources)

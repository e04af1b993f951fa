"""Every exception kit raises, in one tree.

Two questions decide how a caller should react to a failure, and the tree answers both:

* **Whose fault is it?** ``LocalProtocolError`` means kit itself broke its protocol (our bug:
  please report it). ``RemoteProtocolError`` means a remote peer sent something it must not
  (the connection to it is dropped; it may be banned). ``ConfigError`` / ``KitUsageError``
  mean the person running kit gave a bad value or called an API the wrong way.
* **Will trying again help?** Everything that derives from ``TransientError`` may succeed on
  a retry (a timeout, a peer that went away, an expired token). Retry loops catch
  ``TransientError`` and nothing else, so a real bug is never retried silently.

::

    KitError
    ├── ConfigError                  bad configuration value (permanent)
    ├── KitUsageError                API misuse, e.g. a blocking call from the runtime thread
    ├── IdentityError                identity key file unreadable or invalid
    │   └── IdentityInUse            another running peer holds the same identity file
    ├── EvaluationError              kit.evaluate got a bad checkpoint, dataset or task
    │   ├── UnknownTask
    │   ├── DatasetSchemaError       missing columns / splits / labels
    │   └── CheckpointError          not found, unreadable metadata
    │       └── VocabularyMismatch   tokenizer does not fit the embedding table
    ├── AuthError                    refused by the authorizer (permanent unless noted)
    │   ├── NotAllowlisted
    │   ├── BadSignature
    │   ├── TokenExpired             (transient: refresh the token and retry)
    │   ├── MissingToken, MalformedToken, TokenMismatch, Revoked, InvalidHubToken
    │   ├── AccessRefused            a coordinator's HTTP route answered 401/403 (its reason)
    │   └── TokenServiceUnavailable  (transient: the Hub or the coordinator is unreachable)
    ├── PeerError                    something went wrong with a remote peer
    │   ├── HandshakeRefused         other protocol version, other run, auth failure
    │   ├── RemoteProtocolError      the remote peer misbehaved (malformed frame, limits)
    │   │   ├── MalformedFrame
    │   │   ├── FrameTooLarge
    │   │   ├── FlowControlViolation
    │   │   ├── TooManyStreams
    │   │   ├── FrameAuthenticationFailed  a frame modified or injected on the path
    │   │   └── InvalidTensor        bad dtype / shape / size in a tensor header
    │   ├── LocalProtocolError       kit broke its own protocol (our bug)
    │   ├── RemoteError              the remote handler failed and told us so
    │   │   └── UnknownProtocol      the remote peer has no handler for that protocol
    │   └── PeerUnavailable          (transient) cannot dial, connection lost, relay gone
    │       ├── ConnectionLost
    │       └── StreamReset          the remote side abandoned one stream
    └── TransientError               a retry may help; retry loops catch only this
        ├── KitTimeout               a wait ran out of time (also a builtin TimeoutError)
        ├── PeerUnavailable, TokenExpired   (see above; they inherit from both)
        ├── AveragingFailed          a step found no group, or its rounds failed (kit.averaging)
        └── ...                      state downloads, a state a donor no longer holds (kit.optim)

User-facing messages end with ``help:`` and the fix, so that a volunteer in a notebook can act
on a single line.
"""

from __future__ import annotations


class KitError(Exception):
    """Root of every exception raised by kit."""


class TransientError(KitError):
    """A failure that may go away on a retry (timeouts, peers leaving, expired tokens)."""


class ConfigError(KitError, ValueError):
    """A configuration value is invalid; the message names the field and a valid range."""


class KitUsageError(KitError, RuntimeError):
    """kit's API was called in a way that cannot work (the message says how to call it)."""


class KitTimeout(TransientError, TimeoutError):
    """A wait ran out of time. Every wait in kit has a timeout and raises this when it ends."""


# --- identity ---------------------------------------------------------------------------------


class IdentityError(KitError):
    """An identity key file cannot be read, written or parsed."""


class IdentityInUse(IdentityError):
    """Another running peer already uses this identity file."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path

    def __str__(self) -> str:
        return (
            f"identity file {self.path!r} is in use by another running peer; two peers can never "
            "share one identity - help: stop the other peer, or pass another identity_path "
            "(or none, for a fresh identity)"
        )


# --- auth ---------------------------------------------------------------------------------------


class AuthError(KitError):
    """The authorizer refused a peer or a credential."""


class NotAllowlisted(AuthError):
    """The user is not on the run's allowlist."""


class BadSignature(AuthError):
    """A signature or an access token does not verify."""


class TokenExpired(AuthError, TransientError):
    """An access token has expired; refresh it and try again."""


# --- peers and the wire -------------------------------------------------------------------------


class PeerError(KitError):
    """Something went wrong while talking to a remote peer."""


class HandshakeRefused(PeerError):
    """The handshake was refused: other protocol version, other run id, or authorization.

    Raised on both sides; ``reason`` is a short machine-readable code (see ``kit.p2p.wire.Refusal``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"handshake refused ({self.reason}): {self.message}"


class RemoteProtocolError(PeerError):
    """The remote peer broke the protocol; the connection to it is dropped."""


class MalformedFrame(RemoteProtocolError):
    """A frame could not be parsed (truncated, garbage, unknown type)."""


class FrameTooLarge(RemoteProtocolError):
    """A frame or a message exceeds the configured size limit."""


class FlowControlViolation(RemoteProtocolError):
    """The remote peer sent more data than the receive window allowed."""


class TooManyStreams(RemoteProtocolError):
    """The remote peer opened more concurrent streams than allowed."""


class FrameAuthenticationFailed(RemoteProtocolError):
    """A frame's authentication tag did not verify: it was modified or injected on the path."""


class InvalidTensor(RemoteProtocolError):
    """A tensor header names a forbidden dtype, a bad shape, or a size that does not match."""


class LocalProtocolError(PeerError):
    """kit broke its own protocol. This is a bug in kit: please report it."""


class RemoteError(PeerError):
    """The remote peer's handler failed and reported it; ``code`` says how."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class UnknownProtocol(RemoteError):
    """The remote peer has no handler for the requested protocol."""


class PeerUnavailable(PeerError, TransientError):
    """A peer cannot be reached right now (not dialable, gone, relay lost)."""


class ConnectionLost(PeerUnavailable):
    """The connection to a peer closed while something was still waiting on it."""


class StreamReset(PeerUnavailable):
    """The remote side abandoned a stream (it was cancelled, timed out or shut down)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"stream reset by peer ({code}): {message}")
        self.code = code
        self.message = message


# --- evaluation ---------------------------------------------------------------------------------


class EvaluationError(KitError):
    """Evaluating a checkpoint failed because of its input: checkpoint, tokenizer, dataset or task."""


class UnknownTask(EvaluationError, ValueError):
    """The task name is not one that ``kit.evaluate`` can fine-tune on."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return (
            f"unknown evaluation task {self.name!r}; kit knows {', '.join(self.known)} - help: "
            "pass one of those names, e.g. tasks=('ner', 'ncc')"
        )


class DatasetSchemaError(EvaluationError, ValueError):
    """A dataset lacks the columns, splits or labels its task needs (the message names them)."""


class CheckpointError(EvaluationError):
    """A checkpoint cannot be found, read or loaded (the message says which and why)."""


class VocabularyMismatch(CheckpointError):
    """The tokenizer's vocabulary does not fit the checkpoint's embedding table."""

    def __init__(self, checkpoint: str, model_vocab: int, tokenizer_vocab: int) -> None:
        super().__init__(checkpoint)
        self.checkpoint = checkpoint
        self.model_vocab = model_vocab
        self.tokenizer_vocab = tokenizer_vocab

    def __str__(self) -> str:
        return (
            f"checkpoint {self.checkpoint!r} has {self.model_vocab} token embeddings but its "
            f"tokenizer has {self.tokenizer_vocab} tokens, so this is not the tokenizer the model "
            "was trained with - help: pass the run's own tokenizer (tokenizer=...), or save it "
            "next to the checkpoint with tokenizer.save_pretrained(folder)"
        )


# --- dht ----------------------------------------------------------------------------------------


class InvalidRecord(KitError, ValueError):
    """A DHT record (key, subkey, value, expiration) is not acceptable; the message says why.

    Raised locally by ``DHT.store`` before anything is sent, and reported by storing nodes (as
    the name of the subclass) when a remote peer sends such a record.
    """


class ValueNotSerializable(InvalidRecord):
    """A DHT key, subkey or value is not plain msgpack data (or bytes that do not decode)."""


class RecordTooLarge(InvalidRecord):
    """A DHT key, subkey or value exceeds its size limit."""


class ForgedRecord(InvalidRecord):
    """A record names an ``[owner:...]`` key but carries no valid signature by that key."""


class SchemaViolation(InvalidRecord):
    """A schema validator rejected the decoded value stored under one of its key prefixes."""


class MalformedDHTMessage(MalformedFrame):
    """A DHT RPC message failed strict decoding (wrong types, missing fields, limits)."""


class DHTNotRunning(KitUsageError):
    """The DHT (or DHT node) was not started yet, or was shut down already."""


class BootstrapFailed(PeerUnavailable):
    """None of the initial peers answered, so the node could not join the DHT."""


# --- averaging: codecs, load balancing, partition ---------------------------------------------


class NonFiniteTensor(InvalidTensor):
    """A received tensor holds NaN or ±inf values, so it is dropped and never averaged."""


class NonFiniteLocalTensor(KitError, ValueError):
    """A local tensor about to be sent holds NaN or ±inf (training diverged?); nothing is sent."""


class InvalidChunk(RemoteProtocolError):
    """A sender's chunk of an all-reduce part was rejected; ``reason`` names the failed check.

    Reasons: ``sender`` (unknown or excluded), ``round``, ``part``, ``order`` (duplicate or gap),
    ``size``, ``dtype``. For the last two the chunk is averaged without this sender, and
    ``completed`` lists the chunks that became complete by that. (NaN/inf values are not
    refused here: the reducer leaves them out of the average, ``kit.averaging.reducer``.)
    """

    def __init__(self, reason: str, message: str, completed: tuple[int, ...] = ()) -> None:
        super().__init__(f"chunk rejected ({reason}): {message}")
        self.reason = reason
        self.message = message
        self.completed = completed  # chunk indices this rejection completed (PartReducer)


class InvalidBandwidth(ConfigError):
    """A bandwidth given to load balancing is negative, NaN, infinite, or zero for an aggregator."""


class NoAggregators(TransientError):
    """No peer of the group can aggregate a part (all are client-mode), so the round cannot run."""


# --- data ---------------------------------------------------------------------------------------


class DataError(KitError):
    """A data source, a data file or a tokenizer cannot be used as configured (permanent unless noted)."""


class DataSourceNotFound(DataError):
    """A data file, a Hub dataset or a tokenizer folder does not exist (or may not be read)."""


class EmptySource(DataError):
    """A source gave no usable document in a full pass: it is empty, or every line was filtered."""


class InvalidText(DataError):
    """A line is not valid UTF-8 (raised when ``data.on_invalid_text`` is "raise")."""


class InvalidShard(DataError):
    """A pre-tokenized shard is corrupt, truncated, or was written with another tokenizer."""


class DataSourceUnreachable(DataError, TransientError):
    """(transient) The Hub or the server holding a data file could not be reached; retry later."""


class ShardDigestMismatch(InvalidShard, TransientError):
    """(transient) A downloaded shard's SHA-256 is not the one its manifest publishes.

    The download is thrown away and the shard is fetched again later (another position of the
    peer's order comes first), so a corrupted transfer never reaches the model.
    """


# --- joining a run (kit.remote_run, kit.preflight) ----------------------------------------------


class CoordinatorUnreachable(TransientError):
    """The coordinator's address did not answer (or answered nonsense)."""


class PreflightFailed(ConfigError):
    """A remote volunteer could not train in this run; ``problems`` lists why, each with help."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


# --- auth (kit.auth) ----------------------------------------------------------------------------


class MissingToken(AuthError):
    """A peer presented no access token in its handshake, but this run admits token holders only."""


class MalformedToken(AuthError):
    """An access token or a revocation list is not valid msgpack of the expected shape or size."""


class TokenMismatch(AuthError):
    """An access token was issued for another peer key (a stolen token) or for another run."""


class Revoked(AuthError):
    """The organizer revoked this user or this peer key."""


class InvalidHubToken(AuthError):
    """The Hugging Face Hub refused the user access token (unknown, expired, or not a user's)."""


class AccessRefused(AuthError):
    """A coordinator's HTTP route (the served data of a private run) answered 401 or 403: no
    valid access token of an allowlisted user came with the request. The message is its reason."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


class TokenServiceUnavailable(AuthError, TransientError):
    """The Hub or the coordinator's token endpoint could not be reached or timed out."""


# --- averaging: matchmaking and all-reduce ------------------------------------------------------


class AveragingFailed(TransientError):
    """An averaging step found no group before its deadline, or every round it tried failed.

    Nothing was averaged: the tensors are as they were (hivemind's ``AllreduceException``).
    """


class GroupMismatch(RemoteProtocolError):
    """Members of an averaging group disagree on it (another hash, schema or membership).

    The round is aborted on the peer that sees it: its tensors stay as they were.
    """


# --- optimizer ------------------------------------------------------------------------------


class StateDownloadFailed(TransientError):
    """The training state could not be downloaded from peers (in time, or verified)."""


class StateNotHeld(TransientError):
    """A donor does not hold the state asked for: none yet, or it moved on to a newer one since
    it was announced (the downloader asks again, or another donor). Expected, not a fault."""


# --- netsim (kit.testing.netsim) ----------------------------------------------------------------


class NetnsUnavailable(KitError):
    """Network namespaces cannot be built here (not root, or iproute2/nftables missing/failing)."""


# --- robust aggregation (kit.averaging.robust) --------------------------------------------------


class NothingToAggregate(KitError, ValueError):
    """Robust aggregation got no finite vector with a positive weight (or overflowed)."""


# --- checkpoints (kit.training.checkpoints) ---------------------------------------------------


class MalformedTrainingState(CheckpointError):
    """A checkpoint's ``training_state`` files are missing, unreadable or wrongly structured."""


class CheckpointRestoreFailed(CheckpointError, TransientError):
    """(transient) The newest checkpoint could not be fetched from the Hub; retry later."""


# --- metrics (kit.metrics) ----------------------------------------------------------------------


class MetricsStateError(KitError, ValueError):
    """The coordinator's saved contribution book (metrics state file) cannot be read."""

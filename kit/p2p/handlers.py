"""The protocol handlers a peer serves, and how each incoming stream meets its handler.

Holds :class:`Handlers`: the table (one handler per protocol), the unary adapter (a unary
handler runs on a stream with one request message in and one response out, each bounded by
``request_timeout``) and :meth:`Handlers.serve`, which runs the handler of an incoming stream
and ends the stream by how the handler ended: closed after success; reset with
``unknown_protocol`` (no handler), ``handler_error`` (it raised: the caller learns the class and
message) or ``shutdown`` (cancelled). A failure the remote peer caused (``PeerError``) or an
expected, transient one (``TransientError``: a timeout, a state the donor no longer holds) is
one DEBUG line; any other is a WARNING: a bug of ours.

Separate from ``peer`` (dialing, accepting, the registry of connections) because serving is per
stream, the same on whichever connection (direct or relayed) carries it.
"""

from __future__ import annotations

import asyncio
import logging

from kit.errors import KitUsageError, PeerError, RemoteProtocolError, TransientError
from kit.p2p.api import DEFAULT_MAX_MESSAGE, StreamHandler, UnaryHandler
from kit.p2p.stream import Stream
from kit.p2p.wire import ResetCode

logger = logging.getLogger(__name__)


class Handlers:
    """A peer's protocol handlers (``request_timeout``: per message of a unary call)."""

    def __init__(self, request_timeout: float) -> None:
        self._request_timeout = request_timeout
        self._stream_handlers: dict[str, StreamHandler] = {}

    def add_stream(self, protocol: str, handler: StreamHandler) -> None:
        """Serve ``protocol``'s streams with ``handler``.

        Raises:
            KitUsageError: ``protocol`` already has a handler.
        """
        if protocol in self._stream_handlers:
            raise KitUsageError(f"protocol {protocol!r} already has a handler")
        self._stream_handlers[protocol] = handler

    def add_unary(
        self, protocol: str, handler: UnaryHandler, *, max_request: int = DEFAULT_MAX_MESSAGE
    ) -> None:
        """Serve ``protocol``'s calls with ``handler`` (request bytes in, response bytes out)."""

        async def serve(stream: Stream) -> None:
            request = await stream.receive_message(
                max_size=max_request, timeout=self._request_timeout
            )
            if request is None:
                raise RemoteProtocolError(f"{protocol}: the caller closed without a request")
            response = await handler(stream.remote_peer, request)
            await stream.send_message(response, timeout=self._request_timeout)

        self.add_stream(protocol, serve)  # type: ignore[arg-type]

    def remove(self, protocol: str) -> None:
        """Serve ``protocol`` no more (nothing if it has no handler)."""
        self._stream_handlers.pop(protocol, None)

    async def serve(self, stream: Stream) -> None:
        """Run the handler of ``stream``'s protocol on it, then close or reset the stream."""
        handler = self._stream_handlers.get(stream.protocol)
        if handler is None:
            stream.reset(ResetCode.UNKNOWN_PROTOCOL, f"no handler for {stream.protocol!r}")
            return
        try:
            await handler(stream)
        except asyncio.CancelledError:
            stream.reset(ResetCode.SHUTDOWN, "handler cancelled")
            raise
        except (PeerError, TransientError) as e:  # the remote's fault, or expected (a timeout)
            logger.debug("%s handler: %s: %s", stream.protocol, type(e).__name__, e)
            stream.reset(ResetCode.HANDLER_ERROR, f"{type(e).__name__}: {e}")
        except Exception as e:
            logger.warning(
                "%s handler failed for %s: %r", stream.protocol, stream.remote_peer.short(), e
            )
            stream.reset(ResetCode.HANDLER_ERROR, f"{type(e).__name__}: {e}")
        else:
            await stream.close()

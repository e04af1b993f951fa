"""What ``websockets`` may log about a peer's port: one DEBUG line per bad connection, at most.

A public peer (a coordinator, a volunteer with an open port) is dialed by anyone: port scanners,
HTTP clients that pipeline requests, half-closed connections, garbage. Left to itself,
``websockets`` logs every one of them, some at ERROR with a full traceback: a client that sends
its upgrade request and more bytes at once, then hangs up, makes it log "unexpected internal
error" with an ``AssertionError`` traceback (the remote's doing, not a bug here), and with DEBUG
on it writes about ten lines per connection (every header, including ``Authorization``). So a
stranger could fill an organizer's disk or hide real errors in the noise.

:class:`WebsocketsLog` is the logger kit hands to ``websockets`` (its ``logger=`` argument, for
the server and for dialing): ``websockets``' own chatter (DEBUG, INFO: "connection open",
"connection closed", "HTTP response sent", every header) is off, and its warnings and errors
about a connection become one DEBUG line without a traceback on ``kit.p2p.websockets``. Errors
that name kit's own code (a failed HTTP route or connection handler: a bug here) stay ERRORs
with their traceback. kit logs the connections that matter itself (``kit.p2p.transport``,
``kit.p2p.peer``).

What this module does not do: kit's own log lines (each module logs to its ``__name__``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger("kit.p2p.websockets")

#: ``websockets`` messages that report a failure of the code it calls back into: kit's HTTP
#: route (``process_request``) or connection handler. Those are kit's bugs: logged in full.
KIT_CALLBACK_FAILURES = frozenset(
    {"process_request failed", "process_response failed", "connection handler failed"}
)


class WebsocketsLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A ``websockets`` logger that demotes what remote peers cause to one DEBUG line each."""

    def __init__(self) -> None:
        super().__init__(logger, {})

    def isEnabledFor(self, level: int) -> bool:
        # websockets checks DEBUG once per connection (its `debug` flag) and skips its per-frame
        # and per-header lines when it is off; INFO lines are open/closed notices only.
        return level >= logging.WARNING and self.logger.isEnabledFor(logging.DEBUG)

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        exc_info = kwargs.pop("exc_info", None)
        if msg in KIT_CALLBACK_FAILURES:
            logging.getLogger("kit.p2p.transport").log(
                level, msg, *args, exc_info=exc_info, **kwargs
            )
            return
        if level < logging.WARNING or not self.logger.isEnabledFor(logging.DEBUG):
            return
        text = str(msg) % args if args else str(msg)
        error = _exception(exc_info)
        detail = f" ({type(error).__name__}: {str(error)[:200]})" if error is not None else ""
        self.logger.debug("websocket: %s%s", text[:500], detail)

    def process(
        self, msg: object, kwargs: MutableMapping[str, Any]
    ) -> tuple[object, MutableMapping[str, Any]]:
        return msg, kwargs


def _exception(exc_info: object) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        value = exc_info[1]
        return value if isinstance(value, BaseException) else None
    if exc_info:
        return sys.exc_info()[1]
    return None


#: One instance serves every peer (it holds no state).
WEBSOCKETS_LOG = WebsocketsLog()

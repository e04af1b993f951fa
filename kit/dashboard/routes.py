"""The coordinator's dashboard: one web page and its JSON API, on the coordinator peer's port.

:func:`register_dashboard` adds three GET routes to a running ``kit.p2p.peer.Peer`` (which answers
plain HTTP on its websocket port, so the dashboard shares the coordinator's address and TLS):

* ``/``: the page (``page.html`` in this package): plain HTML, inline CSS and vanilla JS, no
  CDN and no external fetch; it polls the two JSON routes every few seconds and draws the loss
  curve and the charts of peers online and samples/s over time (inline SVG), the tiles (peers
  online, samples/s, global step, ETA), the leaderboard, and, when the coordinator serves
  ``/join.ipynb``, the one cell volunteers paste (with a copy button and the notebook to
  download), and, when the coordinator serves ``/api/bans`` (``kit.revocation_admin``: the
  organizer's bans, public in the DHT anyway), who is banned until when. Times are human
  ("updated 12 s ago").
* ``/api/metrics``: ``{"summary": ..., "loss_curve": [...], "history": [...], "run": run_info()}``
  (``history``: peers online and samples/s over time, ``kit.metrics.history``).
* ``/api/leaderboard``: ``{"leaderboard": [...]}``.

User names come from peers: the page only ever sets them with ``textContent``, and the page is
served with a Content-Security-Policy that runs nothing but its own inline script (by nonce) and
lets it fetch only from its own origin.

What this module does not do: the numbers (``kit.metrics``), ``/api/run`` (the coordinator).
"""

from __future__ import annotations

import html
import importlib.resources
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from kit.metrics.collector import MetricsCollector
from kit.p2p.transport import HttpHandler, HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

PAGE_RESOURCE = "page.html"
_NO_CACHE = ("Cache-Control", "no-store")
_SECURITY_HEADERS = (("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"))


class HttpRoutes(Protocol):
    """What the dashboard needs of a peer (``kit.p2p.peer.Peer`` has it)."""

    def add_http_route(self, path: str, handler: HttpHandler) -> None: ...


def load_page() -> str:
    """The page template (``{{TITLE}}`` and ``{{NONCE}}`` are filled in per response)."""
    return importlib.resources.files("kit.dashboard").joinpath(PAGE_RESOURCE).read_text("utf-8")


def render_page(template: str, title: str, nonce: str) -> bytes:
    """The page with the escaped ``title`` and the script ``nonce`` filled in."""
    return template.replace("{{TITLE}}", html.escape(title)).replace("{{NONCE}}", nonce).encode()


def json_response(body: Any) -> HttpResponse:
    """``body`` as JSON (NaN and infinities are refused: the book reports None instead)."""
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return HttpResponse(200, data, "application/json", (_NO_CACHE, *_SECURITY_HEADERS))


def register_dashboard(
    peer: HttpRoutes,
    collector: MetricsCollector,
    *,
    title: str,
    run_info: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Serve the dashboard and its JSON API on ``peer``'s listening port.

    Args:
        peer: the coordinator's running peer.
        collector: the run's metrics collector (started separately).
        title: shown as the page's title, e.g. "sahajBERT-xl: train with us".
        run_info: returns facts shown under the title and sent as ``"run"`` in /api/metrics
            (flat str/number values are shown, e.g. run id, model, target batch size).

    Raises:
        KitUsageError: one of the routes is registered already.
    """
    template = load_page()

    async def page(request: HttpRequest) -> HttpResponse:
        nonce = secrets.token_urlsafe(16)
        policy = (
            "default-src 'none'; "
            f"script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'"
        )
        headers = (("Content-Security-Policy", policy), _NO_CACHE, *_SECURITY_HEADERS)
        body = render_page(template, title, nonce)
        return HttpResponse(200, body, "text/html; charset=utf-8", headers)

    async def metrics(request: HttpRequest) -> HttpResponse:
        info: dict[str, Any] = {}
        if run_info is not None:
            try:
                info = dict(run_info())
            except Exception as e:  # the caller's callback: the metrics are still worth serving
                logger.warning("the dashboard's run_info() failed: %r", e)
        curve = [point.to_dict() for point in collector.loss_curve()]
        history = collector.history.points()
        return json_response(
            {"summary": collector.summary(), "loss_curve": curve, "history": history, "run": info}
        )

    async def leaderboard(request: HttpRequest) -> HttpResponse:
        return json_response({"leaderboard": collector.leaderboard()})

    peer.add_http_route("/", page)
    peer.add_http_route("/api/metrics", metrics)
    peer.add_http_route("/api/leaderboard", leaderboard)

"""A fake Hugging Face Hub served over real HTTP on loopback, for tests and notebook dry runs.

Holds :class:`FakeHub`: users with access tokens, organizations, and model/dataset repos whose
branch ``main`` has a linear commit history, all in memory (``kit.testing.hub_state``), served
by a background thread on ``127.0.0.1`` so that the REAL ``huggingface_hub`` client (and
``transformers``, which calls it) talks to it through ``HfApi(endpoint=hub.endpoint)`` or
``HF_ENDPOINT``. Which parts of the Hub API it answers, and how: ``kit.testing.hub_api``.

Like the real Hub, a new repo starts with an "initial commit" holding ``.gitattributes``, and
preupload returns each file's current blob oid, so the client leaves unchanged files out of a
commit (and makes no commit at all when nothing changed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kit.errors import ConfigError, KitTimeout, KitUsageError
from kit.testing.hub_api import HubAPI, Response
from kit.testing.hub_state import Commit, HubState, RecordedRequest, git_blob_oid

logger = logging.getLogger(__name__)

#: Regular files travel base64 in the commit: tiny test data only.
_MAX_BODY = 256 * 1024 * 1024


class FakeHub(HubState):
    """An in-memory Hugging Face Hub at ``http://127.0.0.1:PORT``; use it as a context manager.

    Set it up with the methods of :class:`~kit.testing.hub_state.HubState` (``add_user``,
    ``create_repo``, ``commit``) and read what happened with ``commits`` and ``requests``.

    Example::

        with FakeHub() as hub:
            hub.add_user("alice", token="hf_alice", orgs=["neuropark"])
            api = HfApi(endpoint=hub.endpoint, token="hf_alice")
            api.create_repo("neuropark/albert", exist_ok=True)

    Args:
        port: TCP port on 127.0.0.1; 0 lets the OS pick one (see :attr:`endpoint`).
        clock: returns seconds since the epoch; commit dates come from it.
        io_timeout: seconds a connection may stall mid-request before it is dropped (this also
            bounds :meth:`stop`); increase this if a very slow client sees dropped connections.
    """

    def __init__(
        self, *, port: int = 0, clock: Callable[[], float] = time.time, io_timeout: float = 10.0
    ) -> None:
        if not 0 <= port <= 65535 or io_timeout <= 0:
            hint = "use a port in 0..65535 (0: any free port) and io_timeout > 0"
            raise ConfigError(f"FakeHub(port={port}, io_timeout={io_timeout}) help: {hint}")
        super().__init__(clock)
        self._port, self._io_timeout = port, io_timeout
        self._api = HubAPI(self, lambda: self.endpoint)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Bind 127.0.0.1 and serve from a background thread named "fake-hub"."""
        if self._server is not None:
            raise KitUsageError("FakeHub is already running help: start it once, e.g. `with`")
        handler = type("_BoundHandler", (_Handler,), {"hub": self, "timeout": self._io_timeout})
        self._server = _Server(("127.0.0.1", self._port), handler)
        serve = self._server.serve_forever
        self._thread = threading.Thread(target=serve, args=(0.05,), name="fake-hub", daemon=True)
        self._thread.start()
        logger.debug("fake hub serving on %s", self.endpoint)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, close the socket and join the serving thread.

        Args:
            timeout: seconds to wait for the serving thread once the socket is closed.

        Raises:
            KitTimeout: the serving thread was still alive after ``timeout`` seconds.
        """
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None or thread is None:
            return
        server.shutdown()  # serve_forever polls every 50 ms; requests run on their own threads
        server.server_close()  # joins the handler threads, each bounded by io_timeout
        thread.join(timeout)
        if thread.is_alive():
            raise KitTimeout(
                f"fake hub thread alive {timeout}s after stop() help: a request "
                "handler is stuck; run with log level DEBUG to see which one"
            )

    @property
    def endpoint(self) -> str:
        """The base URL to give the client, e.g. ``"http://127.0.0.1:51234"`` (no final slash)."""
        if self._server is None:
            raise KitUsageError("FakeHub is not running help: use it inside `with FakeHub():`")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- pointing clients at the hub ------------------------------------------------------------

    def client_env(self, hf_home: str | os.PathLike[str]) -> dict[str, str]:
        """Environment variables that make a child process or notebook kernel use this hub.

        ``huggingface_hub`` reads them once, at import: the child must get them before that.
        ``HF_HOME`` moves the cache, the token file and the Xet logs away from ``~/.cache``.
        Remove ``HF_TOKEN`` from the child's environment too, so no real token is sent.
        """
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HOME": str(hf_home),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",  # else the client fetches an agent list for its UA
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "TRANSFORMERS_OFFLINE": "0",
        }

    @contextlib.contextmanager
    def patched_client(self, hf_home: str | os.PathLike[str]) -> Iterator[None]:
        """Point THIS process's already-imported ``huggingface_hub`` at the hub, then restore it.

        ``huggingface_hub.constants`` froze ``HF_ENDPOINT`` and ``HF_HOME`` at import, so code
        that calls the client without ``endpoint=`` (``transformers`` does) needs them patched.
        Also puts :meth:`client_env` in ``os.environ`` (for child processes and hf_xet) and hides
        ``HF_TOKEN``. Not thread-safe: wrap a whole test with it, not a thread.
        """
        from huggingface_hub import constants

        home, resolve_url = Path(hf_home), "/{repo_id}/resolve/{revision}/{filename}"
        patches = {
            "ENDPOINT": self.endpoint,
            "HUGGINGFACE_CO_URL_TEMPLATE": self.endpoint + resolve_url,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_XET_CACHE": str(home / "xet"),
            "HF_TOKEN_PATH": str(home / "token"),
            "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
            "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_OFFLINE": False,
        }
        saved = {name: getattr(constants, name) for name in patches}
        env: dict[str, str | None] = {**self.client_env(home), "HF_TOKEN": None}
        saved_env = {name: os.environ.get(name) for name in env}
        # transformers keeps one HfApi, built with the endpoint of its time: make it build anew.
        transformers_hub = sys.modules.get("transformers.utils.hub")
        saved_api = getattr(transformers_hub, "_hf_api", None)
        try:
            for name, value in patches.items():
                setattr(constants, name, value)
            _set_env(env)
            if transformers_hub is not None:
                transformers_hub._hf_api = None  # type: ignore[attr-defined]
            yield
        finally:
            for name, value in saved.items():
                setattr(constants, name, value)
            _set_env(saved_env)
            if transformers_hub is not None:
                transformers_hub._hf_api = saved_api  # type: ignore[attr-defined]

    def handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Response:
        """Answer one request and log it in :attr:`requests`. ``headers`` keys are lower-case."""
        return self._api.handle(method, target, headers, body)


def _set_env(values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # so server_close() joins the handler threads (bounded by io_timeout)
    block_on_close = True


class _Handler(BaseHTTPRequestHandler):
    """Adapts http.server to :meth:`FakeHub.handle`; HTTP/1.0, so one request per connection."""

    hub: FakeHub  # set on the per-hub subclass that FakeHub.start() makes

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if "chunked" in self.headers.get("Transfer-Encoding", "") or length > _MAX_BODY:
            self.send_error(413, f"FakeHub takes bodies with a Content-Length <= {_MAX_BODY}")
            return
        body = self.rfile.read(length) if length else b""
        headers = {key.lower(): value for key, value in self.headers.items()}
        response = self.hub.handle(self.command, self.path, headers, body)
        self.send_response(response.status)
        for key, value in response.headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(response.body)))  # also on HEAD: the file size
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fake hub: " + format, *args)


__all__ = ["Commit", "FakeHub", "RecordedRequest", "git_blob_oid"]

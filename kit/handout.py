"""What a coordinator hands to volunteers besides the swarm: tokenizer, data, kit, join notebook.

A volunteer arrives with a link and an empty folder; everything it needs to train comes from the
coordinator's port. :class:`Handout` prepares it before the coordinator opens that port and then
serves it:

* the **tokenizer**: a folder given to the coordinator, else the folder ``kit tokenizer train``
  wrote (``tokenizer.output_dir``), else the config's Hub repo (downloaded once); served at
  ``/api/tokenizer.json`` with its SHA-256 in ``/api/run``, and pushed to the run's Hub repos
  (``tokenizer.hub_repo``, ``checkpoint.hub_repo``) when it was made here;
* the **data**: the organizer's files, tokenized into shards (``kit.data.serving``); in a
  private run for allowlisted users only (an access token as ``Authorization: Bearer``);
* the **kit**: the wheel of the organizer's own kit (``kit.wheel``), under ``/install/``, with
  its SHA-256 in ``/api/run`` (``install_sha256``): the join cell hands it to pip, which refuses
  a wheel with other bytes (a cache, a proxy or a mirror that changed it on the way);
* the **join notebook** with the link in it, at ``/join.ipynb`` (``kit.join_notebook``).

:meth:`Handout.describe` is what ``/api/run`` adds for these. The coordinator wires it; this
module decides nothing about the swarm.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kit
from kit.config import RunConfig
from kit.errors import ConfigError
from kit.join_notebook import JOIN_NOTEBOOK_PATH, join_notebook_bytes
from kit.remote_run import TOKENIZER_PATH

if TYPE_CHECKING:
    from kit.auth.authorizer import AllowlistAuthorizer

logger = logging.getLogger(__name__)

#: Where the wheel of the organizer's kit is served (its file name follows).
INSTALL_PREFIX = "/install/"
_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")


def base_url(request: Any, default: str, *, secure: bool = False) -> str:
    """``scheme://host`` as the volunteer reached us (its Host header), else ``default``.

    Behind a TLS proxy the scheme comes from ``X-Forwarded-Proto``; a Host header that is not a
    plain host name (or IP) and port is ignored.
    """
    headers = getattr(request, "headers", None) or {}
    host = headers.get("host", "")
    if not _HOST.match(host):
        return default
    https = secure or default.startswith("https:") or headers.get("x-forwarded-proto") == "https"
    return f"{'https' if https else 'http'}://{host}"


def install_extras(config: RunConfig) -> list[str]:
    """The kit extras a volunteer of this run installs with the wheel (setup.cfg's names).

    A ``lamb8bit`` run (TTT's recipe) builds bitsandbytes' 8-bit statistics on every peer: without
    the ``eightbit`` extra a volunteer's first step would stop with a ConfigError.
    """
    return ["eightbit"] if config.optimizer.name == "lamb8bit" else []


class Handout:
    """Prepares (blocking) and serves what volunteers fetch from the coordinator.

    Args:
        config: the run.
        state_dir: the coordinator's folder (tokenizer copy, shard cache, wheel cache).
        tokenizer_dir: a tokenizer folder to serve; None = ``tokenizer.output_dir`` if it holds
            one, else ``tokenizer.hub_repo``.
        hub_token, hf_endpoint: for the tokenizer's download and push (None: the environment).
        shard_tokens: token ids per served shard.
        progress: show progress bars while tokenizing the organizer's files.
    """

    def __init__(
        self,
        config: RunConfig,
        state_dir: Path,
        *,
        tokenizer_dir: str | None = None,
        hub_token: str | None = None,
        hf_endpoint: str | None = None,
        shard_tokens: int = 1 << 22,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.state_dir = Path(state_dir)
        self._given_tokenizer = tokenizer_dir
        self._hub_token = hub_token
        self._hf_endpoint = hf_endpoint
        self._shard_tokens = shard_tokens
        self._progress = progress
        self.tokenizer_dir: Path | None = None  # the folder served (and copied into checkpoints)
        self.tokenizer_sha256: str | None = None
        self._tokenizer_json = b""  # served from memory: the folder may move while the run goes on
        self.data: Any = None  # kit.data.serving.DataServer, when the run has served sources
        self.wheel: Path | None = None
        self.wheel_sha256: str | None = None  # volunteers' pip checks it (the join cell pins it)

    # --- before the port opens ------------------------------------------------------------

    def prepare(self) -> None:
        """Find the tokenizer, make the data shards, build the wheel.

        Raises:
            ConfigError: a tokenizer folder without tokenizer.json.
            DataError: the organizer's files cannot be served (the message says why).
            KitError: the wheel cannot be built.
        """
        from kit.wheel import kit_wheel

        self.tokenizer_dir = self._find_tokenizer()
        if self.tokenizer_dir is not None:
            self._tokenizer_json = (self.tokenizer_dir / "tokenizer.json").read_bytes()
            self.tokenizer_sha256 = hashlib.sha256(self._tokenizer_json).hexdigest()
            self._prepare_data()
        self.wheel = kit_wheel(self.state_dir / "wheel")
        self.wheel_sha256 = hashlib.sha256(self.wheel.read_bytes()).hexdigest()

    def _find_tokenizer(self) -> Path | None:
        settings = self.config.tokenizer
        if self._given_tokenizer is not None:
            folder = Path(self._given_tokenizer)
            if not (folder / "tokenizer.json").is_file():
                raise ConfigError(
                    f"coordinator: no tokenizer.json in {folder} - help: train one with "
                    "`kit tokenizer train` or leave tokenizer_dir unset"
                )
            self._publish(folder)
            return folder
        trained = Path(settings.output_dir)
        if (trained / "tokenizer.json").is_file():
            self._publish(trained)
            return trained
        if settings.hub_repo:
            from kit.data.tokenizer import load_tokenizer, save_tokenizer

            folder = self.state_dir / "tokenizer"
            save_tokenizer(
                load_tokenizer(settings.hub_repo),
                folder,
                model_max_length=settings.model_max_length,
            )
            logger.info("serving the tokenizer of Hub repo %s", settings.hub_repo)
            return folder
        return None  # the preflight says what to do

    def _publish(self, folder: Path) -> None:
        """Push a tokenizer made here to the run's Hub repos (a no-op when they hold it)."""
        from kit.data.tokenizer import push_tokenizer_to_hub

        repos = {self.config.tokenizer.hub_repo, self.config.checkpoint.hub_repo} - {None}
        for repo in sorted(str(repo) for repo in repos):
            try:
                push_tokenizer_to_hub(
                    folder,
                    repo,
                    token=self._hub_token,
                    endpoint=self._hf_endpoint,
                    commit_message="tokenizer of the run",
                )
            except Exception as error:  # the Hub's own errors: the run can go on without it
                logger.warning(
                    "could not push the tokenizer to %s (%s) - help: check the Hub token's "
                    "write access; volunteers get it from the coordinator meanwhile",
                    repo,
                    error,
                )

    def _prepare_data(self) -> None:
        from kit.data.serving import prepare_served_data
        from kit.data.tokenizer import load_tokenizer

        assert self.tokenizer_dir is not None
        self.data = prepare_served_data(
            self.config.data,
            load_tokenizer(self.tokenizer_dir),
            self.state_dir / "data",
            shard_tokens=self._shard_tokens,
            progress=self._progress,
        )

    # --- on the port --------------------------------------------------------------------------

    def register(
        self,
        peer: Any,
        link: Callable[[], str],
        *,
        authorizer: AllowlistAuthorizer | None = None,
    ) -> None:
        """Serve the prepared files on ``peer`` (call on the runtime loop).

        With ``authorizer`` (a private run) the data routes answer only requests that carry a
        valid access token of this run (``Authorization: Bearer``); the tokenizer, the wheel
        and the join notebook stay public (a stranger may look at how to join, not at the data).
        """
        from kit.p2p.transport import HttpRequest, HttpResponse

        if self.tokenizer_dir is not None:
            tokenizer = self._tokenizer_json

            async def serve_tokenizer(request: HttpRequest) -> HttpResponse:
                return HttpResponse(200, tokenizer, "application/json")

            peer.add_http_route(TOKENIZER_PATH, serve_tokenizer)
        if self.data is not None:
            if authorizer is not None:
                self.data.guard = authorizer.request_guard(self.config.collaboration.run_id)
            self.data.register(peer)
        if self.wheel is not None:
            wheel = self.wheel.read_bytes()  # from memory: the bytes whose sha256 is handed out

            async def serve_wheel(request: HttpRequest) -> HttpResponse:
                return HttpResponse(200, wheel, "application/octet-stream")

            peer.add_http_route(INSTALL_PREFIX + self.wheel.name, serve_wheel)

        async def serve_notebook(request: HttpRequest) -> HttpResponse:
            body = join_notebook_bytes(base_url(request, link()))
            disposition = ("Content-Disposition", 'attachment; filename="join.ipynb"')
            return HttpResponse(200, body, "application/x-ipynb+json", (disposition,))

        peer.add_http_route(JOIN_NOTEBOOK_PATH, serve_notebook)

    def describe(self, base: str) -> dict[str, Any]:
        """What ``/api/run`` says about these files (``base``: how the volunteer reached us)."""
        from kit.data.manifest import MANIFEST_PATH

        return {
            "tokenizer_url": TOKENIZER_PATH if self.tokenizer_dir is not None else None,
            "tokenizer_sha256": self.tokenizer_sha256,
            "data_manifest": MANIFEST_PATH if self.data is not None else None,
            "install": f"{base}{INSTALL_PREFIX}{self.wheel.name}" if self.wheel else None,
            "install_sha256": self.wheel_sha256,
            "install_extras": install_extras(self.config),
            "kit_version": kit.__version__,
            "join_notebook": JOIN_NOTEBOOK_PATH,
        }

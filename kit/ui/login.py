"""Finding the volunteer's Hugging Face token, and the notebook login form.

Holds :func:`find_cached_hf_token` (the token the volunteer already stored somewhere: an
environment variable, a Kaggle or Colab secret, a cached ``huggingface-cli login``) and
:class:`LoginWidget` (a password field, a button and one status line). It does not check tokens
itself and decides nothing about training: the caller passes ``check`` (token → username, e.g.
the coordinator's token endpoint) and ``on_success`` (what to do once logged in).

The token is a secret: it is never logged, never echoed into a widget other than the password
field, and scrubbed from any error text that is shown (see :func:`_redact`).
"""

from __future__ import annotations

import html
import importlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kit.errors import KitError
from kit.hardware.detect import Platform, detect_platform

if TYPE_CHECKING:  # ipywidgets is imported where a widget is made: `kit join` runs without it
    import ipywidgets as widgets

logger = logging.getLogger(__name__)

#: The secret / environment variable name every platform uses for a Hugging Face token.
TOKEN_NAME = "HF_TOKEN"
#: Where a volunteer makes a token (shown when the field is empty).
TOKENS_PAGE = "https://huggingface.co/settings/tokens"
#: Colors of the status line (readable on Colab's light and dark themes).
ERROR_COLOR = "#d32f2f"
OK_COLOR = "#2e7d32"

Importer = Callable[[str], ModuleType]


def _clean(token: Any) -> str | None:
    """A usable token string or None (secrets stores return '' or None for missing values)."""
    if not isinstance(token, str):
        return None
    token = token.strip()
    return token or None


def _from_kaggle(import_module: Importer) -> str | None:
    """The Kaggle secret ``HF_TOKEN`` (Add-ons → Secrets), or None."""
    try:
        secrets = import_module("kaggle_secrets")
        return _clean(secrets.UserSecretsClient().get_secret(TOKEN_NAME))
    except Exception as error:  # not attached, not granted, backend down: all mean "no token"
        logger.debug("no Kaggle secret %s (%s)", TOKEN_NAME, type(error).__name__)
        return None


def _from_colab(import_module: Importer) -> str | None:
    """The Colab secret ``HF_TOKEN`` (the key icon), or None.

    ``userdata.get`` raises ``SecretNotFoundError`` when the secret is missing and
    ``NotebookAccessError`` when the volunteer did not grant this notebook access to it.
    """
    try:
        userdata = import_module("google.colab.userdata")
        return _clean(userdata.get(TOKEN_NAME))
    except Exception as error:
        logger.debug("no Colab secret %s (%s)", TOKEN_NAME, type(error).__name__)
        return None


def _from_hub_cache(import_module: Importer) -> str | None:
    """The token a previous ``huggingface-cli login`` / ``notebook_login()`` stored, or None."""
    try:
        hub = import_module("huggingface_hub")
        return _clean(hub.get_token())
    except Exception as error:
        logger.debug("no cached Hugging Face login (%s)", type(error).__name__)
        return None


def find_cached_hf_token(
    env: Mapping[str, str] = os.environ,
    *,
    import_module: Importer = importlib.import_module,
) -> str | None:
    """The Hugging Face token the volunteer already stored, so they need not paste it again.

    Looks, in this order, at: the ``HF_TOKEN`` environment variable; on Kaggle, the Kaggle secret
    ``HF_TOKEN``; on Colab, the Colab secret ``HF_TOKEN`` (Kaggle is detected first because its
    image is built on Colab's and sets ``COLAB_RELEASE_TAG`` too, and Colab's secret API must not
    be asked there); then the token cached by ``huggingface-cli login``. Never raises: a probe
    that fails counts as "no token there". The token itself is never logged.

    Args:
        env: the environment, e.g. ``os.environ``.
        import_module: imports a module by name (tests pass fakes for ``kaggle_secrets``,
            ``google.colab.userdata`` and ``huggingface_hub``).

    Returns:
        The token, or None when none was found.
    """
    token = _clean(env.get(TOKEN_NAME))
    if token is not None:
        logger.debug("using the Hugging Face token from the %s environment variable", TOKEN_NAME)
        return token
    # Decided from the environment only: ``userdata.get`` waits for an answer from Colab's
    # frontend, so asking it where ``google-colab`` is merely installed could hang.
    platform = detect_platform(env)
    if platform is Platform.KAGGLE:
        token = _from_kaggle(import_module)
    elif platform is Platform.COLAB:
        token = _from_colab(import_module)
    if token is not None:
        logger.debug(
            "using the Hugging Face token from the %s secret %s", platform.value, TOKEN_NAME
        )
        return token
    token = _from_hub_cache(import_module)
    if token is not None:
        logger.debug("using the Hugging Face token cached by huggingface-cli login")
    return token


def _redact(text: str, token: str) -> str:
    """``text`` without the token in it (an error message may quote what it was given)."""
    if token and token in text:
        return text.replace(token, "hf_…")
    return text


def _status_html(text: str, color: str | None = None) -> str:
    escaped = html.escape(text)
    if color is None:
        return f"<span>{escaped}</span>"
    return f'<span style="color: {color}">{escaped}</span>'


class LoginWidget:
    """A Hugging Face login form for a notebook: token field, "Log in" button, status line.

    ``check`` runs in the click handler (the kernel is busy meanwhile, but the "Checking…" line
    and the disabled button are sent to the browser before it starts). Errors are shown as one
    readable line, never a traceback.

    Args:
        check: takes the token and returns the Hugging Face username, or raises a
            :class:`~kit.errors.KitError` whose message ends with ``help: ...``.
        on_success: called once with ``(username, token)`` after ``check`` accepted the token.
            A :class:`~kit.errors.KitError` it raises is shown like a failed check.

    Example::

        login = LoginWidget(check=endpoint.username_for, on_success=start_training)
        display(login.widget)
    """

    def __init__(
        self,
        check: Callable[[str], str],
        on_success: Callable[[str, str], None],
    ) -> None:
        self._check = check
        self._on_success = on_success
        self._lock = threading.Lock()
        self._busy = False
        self._username: str | None = None
        import ipywidgets as widgets

        self.password = widgets.Password(
            value="",
            placeholder="hf_...",
            description="HF token",
            layout=widgets.Layout(width="420px"),
        )
        self.button = widgets.Button(description="Log in", button_style="primary")
        self.status = widgets.HTML(
            value=_status_html(f"Paste a Hugging Face access token ({TOKENS_PAGE}).")
        )
        self.button.on_click(self._on_click)
        self._box = widgets.VBox([widgets.HBox([self.password, self.button]), self.status])

    @property
    def widget(self) -> widgets.VBox:
        """The form to ``display()``."""
        return self._box

    @property
    def username(self) -> str | None:
        """The Hugging Face username once logged in, else None."""
        return self._username

    def _show(self, text: str, color: str | None = None) -> None:
        self.status.value = _status_html(text, color)

    def _on_click(self, _button: Any = None) -> None:
        with self._lock:  # a double click must not run two checks
            if self._busy or self._username is not None:
                return
            self._busy = True
        try:
            self._log_in(self.password.value.strip())
        finally:
            with self._lock:
                self._busy = False

    def _log_in(self, token: str) -> None:
        if not token:
            self._show(
                f"The token field is empty. help: create a token at {TOKENS_PAGE} and paste it.",
                ERROR_COLOR,
            )
            return
        self.button.disabled = True
        self._show("Checking the token…")
        try:
            username = self._check(token)
            self._on_success(username, token)
        except KitError as error:
            self._show(_redact(str(error), token), ERROR_COLOR)
            self.button.disabled = False
            return
        except Exception as error:  # a bug in check/on_success: still one line, token scrubbed
            logger.warning("login failed unexpectedly: %s", type(error).__name__)
            message = _redact(f"Login failed: {type(error).__name__}: {error}", token)
            self._show(f"{message} help: try again; if it persists, report it.", ERROR_COLOR)
            self.button.disabled = False
            return
        self._username = username
        self.button.description = "Logged in"
        self.password.disabled = True
        self._show(f"Logged in as {username}", OK_COLOR)
        logger.info("logged in to Hugging Face as %s", username)

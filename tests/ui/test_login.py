"""The login form and the cached-token lookup, driven like a volunteer would (no network)."""

from __future__ import annotations

import logging
from types import ModuleType, SimpleNamespace
from typing import Any

import ipywidgets as widgets
import pytest

from kit.errors import InvalidHubToken
from kit.ui.login import LoginWidget, find_cached_hf_token

TOKEN = "hf_SecretValue1234567890"


def all_widgets(root: widgets.Widget) -> list[widgets.Widget]:
    found = [root]
    for child in getattr(root, "children", ()):
        found.extend(all_widgets(child))
    return found


def displayed_text(login: LoginWidget) -> str:
    """Everything a volunteer could read in the form, apart from the password field."""
    parts = []
    for widget in all_widgets(login.widget):
        if widget is login.password:
            continue
        for name in ("value", "description", "placeholder", "tooltip"):
            value = getattr(widget, name, None)
            if isinstance(value, str):
                parts.append(value)
    return "\n".join(parts)


class Recorder:
    def __init__(self) -> None:
        self.checked: list[str] = []
        self.successes: list[tuple[str, str]] = []

    def check_ok(self, token: str) -> str:
        self.checked.append(token)
        return "alice"

    def check_refused(self, token: str) -> str:
        self.checked.append(token)
        raise InvalidHubToken(
            f"the Hub refused the token {token}. help: create a new token at "
            "https://huggingface.co/settings/tokens"
        )

    def on_success(self, username: str, token: str) -> None:
        self.successes.append((username, token))


def test_success_calls_on_success_once_and_never_echoes_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    calls = Recorder()
    login = LoginWidget(check=calls.check_ok, on_success=calls.on_success)
    assert login.password.placeholder == "hf_..."
    login.password.value = f"  {TOKEN}\n"
    login.button.click()
    login.button.click()  # a second click after success does nothing
    assert calls.checked == [TOKEN]
    assert calls.successes == [("alice", TOKEN)]
    assert login.username == "alice"
    assert "Logged in as alice" in login.status.value
    assert TOKEN not in displayed_text(login)
    assert TOKEN not in caplog.text
    assert login.button.disabled


def test_wrong_token_shows_a_readable_red_line_and_allows_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    calls = Recorder()
    login = LoginWidget(check=calls.check_refused, on_success=calls.on_success)
    login.password.value = TOKEN
    login.button.click()
    status = login.status.value
    assert "the Hub refused the token" in status
    assert "help: create a new token" in status
    assert "color" in status and "#d32f2f" in status
    assert "Traceback" not in status and "File " not in status
    assert TOKEN not in displayed_text(login)  # the message quoted the token: it is scrubbed
    assert TOKEN not in caplog.text
    assert calls.successes == []
    assert not login.button.disabled  # the volunteer can fix the token and try again
    login.button.click()
    assert calls.checked == [TOKEN, TOKEN]


def test_unexpected_exception_is_one_line_without_traceback() -> None:
    def broken(token: str) -> str:
        raise RuntimeError(f"boom while checking {token}")

    successes: list[tuple[str, str]] = []
    login = LoginWidget(check=broken, on_success=lambda u, t: successes.append((u, t)))
    login.password.value = TOKEN
    login.button.click()
    assert "RuntimeError" in login.status.value
    assert "help:" in login.status.value
    assert "Traceback" not in login.status.value
    assert TOKEN not in displayed_text(login)
    assert successes == []


def test_empty_token_is_refused_immediately_without_calling_check() -> None:
    calls = Recorder()
    login = LoginWidget(check=calls.check_ok, on_success=calls.on_success)
    login.password.value = "   "
    login.button.click()
    assert calls.checked == []
    assert "empty" in login.status.value and "help:" in login.status.value
    assert not login.button.disabled


def test_button_is_disabled_while_checking_and_username_is_escaped() -> None:
    seen: list[bool] = []
    login: LoginWidget

    def check(token: str) -> str:
        seen.append(login.button.disabled)
        return "<script>x</script>"

    login = LoginWidget(check=check, on_success=lambda u, t: None)
    login.password.value = TOKEN
    login.button.click()
    assert seen == [True]
    assert "<script>" not in login.status.value
    assert "&lt;script&gt;" in login.status.value


# --- find_cached_hf_token --------------------------------------------------------------------


class FakeImporter:
    """Imports from a dict of fake modules; records what was asked for."""

    def __init__(self, modules: dict[str, Any]) -> None:
        self.modules = modules
        self.asked: list[str] = []

    def __call__(self, name: str) -> ModuleType:
        self.asked.append(name)
        if name not in self.modules:
            raise ModuleNotFoundError(name)
        module = self.modules[name]
        if isinstance(module, Exception):
            raise module
        return module


def kaggle_module(value: str | None = "hf_kaggle") -> Any:
    class Client:
        def get_secret(self, label: str) -> str:
            if value is None or label != "HF_TOKEN":
                raise RuntimeError("no secret attached")
            return value

    return SimpleNamespace(UserSecretsClient=Client)


def colab_module(value: str | None = "hf_colab", error: Exception | None = None) -> Any:
    def get(name: str) -> str | None:
        if error is not None:
            raise error
        return value if name == "HF_TOKEN" else None

    return SimpleNamespace(get=get)


def hub_module(value: str | None = "hf_cached") -> Any:
    return SimpleNamespace(get_token=lambda: value)


KAGGLE_ENV = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "COLAB_RELEASE_TAG": "release"}
COLAB_ENV = {"COLAB_RELEASE_TAG": "release"}


def test_env_var_wins_and_nothing_is_imported() -> None:
    importer = FakeImporter({"huggingface_hub": hub_module()})
    assert find_cached_hf_token({"HF_TOKEN": " hf_env "}, import_module=importer) == "hf_env"
    assert importer.asked == []


def test_kaggle_is_detected_before_colab() -> None:
    importer = FakeImporter(
        {
            "kaggle_secrets": kaggle_module("hf_kaggle"),
            "google.colab.userdata": colab_module("hf_colab"),
            "huggingface_hub": hub_module(),
        }
    )
    assert find_cached_hf_token(KAGGLE_ENV, import_module=importer) == "hf_kaggle"
    assert "google.colab.userdata" not in importer.asked


def test_kaggle_without_the_secret_falls_back_to_the_hub_cache_not_colab() -> None:
    importer = FakeImporter(
        {
            "kaggle_secrets": kaggle_module(None),
            "google.colab.userdata": colab_module("hf_colab"),
            "huggingface_hub": hub_module("hf_cached"),
        }
    )
    assert find_cached_hf_token(KAGGLE_ENV, import_module=importer) == "hf_cached"
    assert "google.colab.userdata" not in importer.asked


def test_colab_secret_is_used_on_colab() -> None:
    importer = FakeImporter(
        {"google.colab.userdata": colab_module("hf_colab"), "huggingface_hub": hub_module()}
    )
    assert find_cached_hf_token(COLAB_ENV, import_module=importer) == "hf_colab"
    assert "kaggle_secrets" not in importer.asked


@pytest.mark.parametrize(
    "error",
    [RuntimeError("SecretNotFoundError"), PermissionError("NotebookAccessError")],
)
def test_colab_userdata_raising_falls_back_to_the_hub_cache(error: Exception) -> None:
    importer = FakeImporter(
        {
            "google.colab.userdata": colab_module(error=error),
            "huggingface_hub": hub_module("hf_cached"),
        }
    )
    assert find_cached_hf_token(COLAB_ENV, import_module=importer) == "hf_cached"


def test_nothing_anywhere_gives_none() -> None:
    broken_hub = SimpleNamespace(get_token=lambda: (_ for _ in ()).throw(OSError("disk")))
    assert find_cached_hf_token({}, import_module=FakeImporter({})) is None
    assert (
        find_cached_hf_token({}, import_module=FakeImporter({"huggingface_hub": broken_hub}))
        is None
    )
    empty = FakeImporter(
        {"google.colab.userdata": colab_module(""), "huggingface_hub": hub_module(None)}
    )
    assert find_cached_hf_token({"HF_TOKEN": ""}, import_module=empty) is None


def test_local_machine_uses_the_hub_cache_and_never_asks_colab() -> None:
    # google-colab installed off Colab: its secret API would wait for a frontend forever.
    importer = FakeImporter(
        {
            "google.colab.userdata": colab_module("hf_colab"),
            "huggingface_hub": hub_module("hf_cached"),
        }
    )
    assert find_cached_hf_token({}, import_module=importer) == "hf_cached"
    assert importer.asked == ["huggingface_hub"]

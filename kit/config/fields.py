"""Validation helpers and file loading shared by every section of the run configuration.

Holds the ``check_*`` functions (each returns the value or raises :class:`~kit.errors.ConfigError`
naming the field, the problem and a ``help:`` fix), the key check with a did-you-mean used by
every ``from_dict``, the conversion of sections to plain dicts, and reading ``.yaml``/``.json``
files. It doesn't hold any section: those live in ``kit.config.data``, ``.model``, ``.training``,
``.access`` and ``.run``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kit.errors import ConfigError

#: Hugging Face user, organization and repository names (as in the profile URL).
HUB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

# --- validation helpers (shared by every section) ----------------------------------------------


def config_error(where: str, problem: str, hint: str) -> ConfigError:
    """A ConfigError whose message names the field, the problem and the fix.

    Args:
        where: dotted path of the field, e.g. ``"data.sources[wiki].probability"``.
        problem: what is wrong, e.g. ``"must be between 0 and 1, got 1.5"``.
        hint: what to do about it (the text after ``help:``).
    """
    return ConfigError(f"{where} {problem} - help: {hint}")


def check_int(
    where: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    """Return ``value`` if it is an int (not a bool) within [minimum, maximum]; else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(
            where, f"must be an integer, got {value!r}", hint or "write a whole number"
        )
    if minimum is not None and value < minimum:
        raise config_error(
            where, f"must be >= {minimum}, got {value}", hint or f"use {minimum} or more"
        )
    if maximum is not None and value > maximum:
        raise config_error(
            where, f"must be <= {maximum}, got {value}", hint or f"use {maximum} or less"
        )
    return value


def check_probability(
    where: str, value: object, *, allow_zero: bool = True, hint: str = ""
) -> float:
    """Return ``value`` as a float if it is a number in [0, 1] (or (0, 1]); else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise config_error(
            where, f"must be a number between 0 and 1, got {value!r}", hint or "write e.g. 0.15"
        )
    low_ok = value >= 0 if allow_zero else value > 0
    if not low_ok or value > 1:
        bounds = "[0, 1]" if allow_zero else "(0, 1]"
        raise config_error(where, f"must be in {bounds}, got {value}", hint or "write e.g. 0.15")
    return float(value)


def check_bool(where: str, value: object) -> bool:
    """Return ``value`` if it is a bool (YAML ``true``/``false``); else ConfigError."""
    if not isinstance(value, bool):
        raise config_error(where, f"must be true or false, got {value!r}", "write true or false")
    return value


def check_text(where: str, value: object, *, allow_empty: bool = False, hint: str = "") -> str:
    """Return ``value`` if it is a string (non-empty unless allowed); else ConfigError."""
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise config_error(
            where, f"must be a non-empty string, got {value!r}", hint or "write a name"
        )
    return value


def check_choice(where: str, value: object, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``; else ConfigError listing them."""
    if value not in choices:
        options = ", ".join(repr(choice) for choice in choices)
        raise config_error(
            where, f"must be one of {options}, got {value!r}", f"pick one of {options}"
        )
    return str(value)


def check_number(
    where: str,
    value: object,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    hint: str = "",
) -> float:
    """Return ``value`` as a float if it is a finite number in range; else ConfigError.

    Args:
        where: dotted path of the field.
        value: what the configuration holds (ints are accepted: YAML writes ``1`` for 1.0).
        minimum: smallest allowed value (inclusive).
        above: the value must be strictly greater than this.
        maximum: largest allowed value (inclusive).
        hint: the ``help:`` text; a generic one if empty.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise config_error(where, f"must be a number, got {value!r}", hint or "write e.g. 1.0")
    if minimum is not None and value < minimum:
        raise config_error(
            where, f"must be >= {minimum}, got {value}", hint or f"use {minimum} or more"
        )
    if above is not None and value <= above:
        raise config_error(
            where, f"must be > {above}, got {value}", hint or f"use a value above {above}"
        )
    if maximum is not None and value > maximum:
        raise config_error(
            where, f"must be <= {maximum}, got {value}", hint or f"use {maximum} or less"
        )
    return float(value)


def check_hub_name(where: str, value: object, *, repo: bool = False) -> str:
    """Return ``value`` if it is a Hub name (``repo``: ``"owner/name"``); else ConfigError."""
    parts = value.split("/") if isinstance(value, str) else []
    if repo:
        ok = len(parts) == 2 and all(HUB_NAME_PATTERN.match(part) for part in parts)
        hint = 'write "owner/name" as in the Hub URL, or null'
    else:
        ok = len(parts) == 1 and HUB_NAME_PATTERN.match(parts[0]) is not None
        hint = "use the name as in the profile URL, e.g. 'alice' for https://huggingface.co/alice"
    if not ok:
        raise config_error(
            where, f"is not a Hugging Face {'repo id' if repo else 'name'}: {value!r}", hint
        )
    return str(value)


def store_normalized(section: object, name: str, value: object) -> None:
    """Store a validated, normalized value on a frozen section while it validates itself.

    Used so that ``lr: 1`` from YAML becomes ``1.0``: a section then compares equal to, and
    hashes like, the one it round-trips to.
    """
    object.__setattr__(section, name, value)


def _check_keys(cls: type, data: object, where: str) -> dict[str, Any]:
    """Check that ``data`` is a mapping whose keys are fields of ``cls``; return it as a dict."""
    if not isinstance(data, Mapping):
        raise config_error(
            where, f"must be a mapping, got {type(data).__name__}", "write `key: value` lines"
        )
    names = [field.name for field in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(names)}"
            raise config_error(f"{where}.{key}", "is not a known setting", hint)
    return dict(data)


def _as_tuple(where: str, value: object) -> tuple[Any, ...]:
    """YAML lists become tuples (frozen dataclasses hold tuples); a single string is one item."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise config_error(where, f"must be a list, got {value!r}", "write a YAML list: [a, b]")


# --- files --------------------------------------------------------------------------------------


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a run configuration file (``.yaml``/``.yml`` or ``.json``) into a dict.

    Raises:
        ConfigError: the file is missing, unreadable, not valid YAML/JSON, or not a mapping.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as error:
        raise config_error(
            str(file), f"cannot be read ({error.strerror or error})", "check the path"
        ) from None
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise config_error(
            str(file), f"is not valid YAML/JSON: {error}", "fix the syntax at that line"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise config_error(str(file), "must hold a mapping of sections", "start with e.g. `data:`")
    return data


def read_section(path: str | Path, section: str) -> dict[str, Any]:
    """The ``section:`` mapping of a run configuration file (empty if the section is absent)."""
    data = load_config_file(path).get(section) or {}
    if not isinstance(data, dict):
        raise config_error(
            f"{path}: {section}", "must be a mapping", f"write `{section}:` then indented keys"
        )
    return data


def _to_plain(section: object) -> dict[str, Any]:
    """A dataclass as plain dicts/lists, the shape YAML and JSON write."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {
                field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)
            }
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value

    result = plain(section)
    assert isinstance(result, dict)
    return result

"""One checkpoint's training state on disk: optimizer and scheduler, without pickle.

Holds :func:`write_training_state` and :func:`load_training_state`: every tensor of the
optimizer/scheduler state dicts goes into ``training_state.safetensors`` under a stable name
(``optimizer/state/0/exp_avg``), the rest of their structure (numbers, strings, tuples, int keys,
special floats) into ``training_state.json`` with the step, loss, time and config hash. Reading
validates everything (version, step, dtypes, that every referenced tensor exists and none is left
over, sizes) before anything is used: a checkpoint may come from the Hub. Folder layout, saving
and pushing live in ``checkpoints``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file as save_safetensors

from kit.errors import KitUsageError, MalformedTrainingState

TRAINING_STATE_TENSORS = "training_state.safetensors"
TRAINING_STATE_JSON = "training_state.json"
#: Bumped when the layout of training_state.json changes; readers refuse other versions.
TRAINING_STATE_VERSION = 1
_MAX_JSON_BYTES = 64 * 1024**2  # the structure of an optimizer state is kilobytes; refuse junk
_ALLOWED_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool}
    | {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
)
_TAGS = ("__tensor__", "__float__", "__tuple__", "__dict__")  # one-key JSON objects = encoded


class SavedTrainingState(NamedTuple):
    """What :func:`load_training_state` returns; unpacks as ``step, optimizer, scheduler, info``."""

    step: int  # the global optimizer step (hivemind's "epoch") the state belongs to
    optimizer_state: dict[str, Any]  # for optimizer.load_state_dict(...)
    scheduler_state: dict[str, Any] | None  # for scheduler.load_state_dict(...), None if none
    info: dict[str, Any]  # loss, time, config_hash, version (training_state.json minus structure)


def load_training_state(folder: str | os.PathLike[str]) -> SavedTrainingState:
    """Read and validate the optimizer/scheduler state of one checkpoint folder.

    Only safetensors and JSON are read (never pickle): a checkpoint fetched from the Hub cannot
    run code. Tensors come back on the CPU; ``optimizer.load_state_dict`` moves them.

    Args:
        folder: a folder written by :func:`save_checkpoint`.

    Returns:
        ``(step, optimizer_state, scheduler_state, info)``.

    Raises:
        MalformedTrainingState: a file is missing or unreadable, or the structure, the tensor
            names or the dtypes are not what :func:`save_checkpoint` writes.
    """
    path = Path(folder)
    meta_path, tensors_path = path / TRAINING_STATE_JSON, path / TRAINING_STATE_TENSORS
    hint = "help: restore another checkpoint (delete this folder), or save this one again"
    try:
        if meta_path.stat().st_size > _MAX_JSON_BYTES:
            raise MalformedTrainingState(
                f"{meta_path} is larger than {_MAX_JSON_BYTES} bytes - {hint}"
            )
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        tensors = load_safetensors(tensors_path.read_bytes())
    except FileNotFoundError as exc:
        raise MalformedTrainingState(
            f"{path} is not a complete checkpoint: {Path(exc.filename or '').name or exc} is "
            f"missing - {hint}"
        ) from None
    except (OSError, ValueError, RecursionError, SafetensorError) as exc:
        raise MalformedTrainingState(
            f"cannot read the training state in {path} ({type(exc).__name__}: {exc}) - {hint}"
        ) from exc
    if not isinstance(meta, dict) or meta.get("version") != TRAINING_STATE_VERSION:
        raise MalformedTrainingState(
            f"{meta_path} is not a version-{TRAINING_STATE_VERSION} kit training state - {hint}"
        )
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MalformedTrainingState(f"{meta_path}: 'step' must be an int >= 0 - {hint}")
    for name, tensor in tensors.items():
        if tensor.dtype not in _ALLOWED_DTYPES:
            raise MalformedTrainingState(
                f"{tensors_path}: {name} has dtype {tensor.dtype} - {hint}"
            )
    used: set[str] = set()
    try:
        optimizer_state = _decode(meta.get("optimizer"), tensors, used)
        scheduler_state = _decode(meta.get("scheduler"), tensors, used)
    except RecursionError:
        raise MalformedTrainingState(f"{meta_path} is nested too deeply - {hint}") from None
    except MalformedTrainingState as exc:
        raise MalformedTrainingState(f"{meta_path}: {exc} - {hint}") from None
    if not isinstance(optimizer_state, dict) or not (
        scheduler_state is None or isinstance(scheduler_state, dict)
    ):
        raise MalformedTrainingState(
            f"{meta_path}: 'optimizer' must be a mapping and 'scheduler' a mapping or null - {hint}"
        )
    if used != set(tensors):
        extra = ", ".join(sorted(set(tensors) - used)[:5])
        raise MalformedTrainingState(f"{tensors_path} holds tensors nothing uses: {extra} - {hint}")
    info = {key: value for key, value in meta.items() if key not in ("optimizer", "scheduler")}
    return SavedTrainingState(step, optimizer_state, scheduler_state, info)


def write_training_state(
    folder: Path,
    step: int,
    optimizer_state: Mapping[str, Any],
    scheduler_state: Mapping[str, Any] | None,
    loss: float | None,
    saved_at: float,
    config_hash: str | None,
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}  # id(tensor) -> name: one tensor referenced twice is stored once
    meta = {
        "version": TRAINING_STATE_VERSION,
        "step": step,
        "loss": loss if loss is not None and math.isfinite(loss) else None,
        "time": saved_at,
        "config_hash": config_hash,
        "optimizer": _encode(dict(optimizer_state), ("optimizer",), tensors, seen),
        "scheduler": None
        if scheduler_state is None
        else _encode(dict(scheduler_state), ("scheduler",), tensors, seen),
    }
    save_safetensors(tensors, folder / TRAINING_STATE_TENSORS, metadata={"format": "pt"})
    text = json.dumps(meta, indent=1, allow_nan=False)
    (folder / TRAINING_STATE_JSON).write_text(text + "\n", encoding="utf-8")


def _encode(
    value: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor], seen: dict[int, str]
) -> Any:
    """Plain JSON for ``value``; tensors go to ``tensors`` under their path, e.g.
    ``optimizer/state/0/exp_avg``, so names are stable across saves of the same optimizer."""
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            name = "/".join(path)
            while name in tensors:  # keys that differ only by type ({0: .., "0": ..})
                name += "_"
            # clone: safetensors refuses tensors that share storage, and the optimizer keeps going
            tensors[name] = value.detach().to("cpu", copy=True).contiguous()
            seen[id(value)] = name
        return {"__tensor__": seen[id(value)]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}  # "inf", "-inf", "nan": JSON has none of them
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(item, (*path, str(i)), tensors, seen) for i, item in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        if all(isinstance(key, str) and key not in _TAGS for key in value):
            return {key: _encode(item, (*path, key), tensors, seen) for key, item in value.items()}
        pairs = []  # optimizer state is keyed by int parameter index: keep the key's type
        for key, item in value.items():
            if key is not None and not isinstance(key, (bool, int, float, str)):
                raise KitUsageError(
                    f"cannot save the key {key!r} at {'/'.join(path)}: only str/int keys - help: "
                    "pass optimizer.state_dict() / scheduler.state_dict() as they are"
                )
            pairs.append([key, _encode(item, (*path, str(key)), tensors, seen)])
        return {"__dict__": pairs}
    raise KitUsageError(
        f"cannot save a {type(value).__name__} at {'/'.join(path)} in a checkpoint: only tensors, "
        "numbers, strings, lists and dicts - help: pass optimizer.state_dict() and "
        "scheduler.state_dict(), and make the LR lambda a plain function (not a callable object)"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], used: set[str]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors, used) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and next(iter(value)) in _TAGS:
        tag, inner = next(iter(value.items()))
        if tag == "__tensor__":
            if not isinstance(inner, str) or inner not in tensors:
                raise MalformedTrainingState(f"it refers to a missing tensor {inner!r}")
            used.add(inner)
            return tensors[inner]
        if tag == "__float__":
            if inner not in ("inf", "-inf", "nan"):
                raise MalformedTrainingState(f"bad special float {inner!r}")
            return float(inner)
        if tag == "__tuple__" and isinstance(inner, list):
            return tuple(_decode(item, tensors, used) for item in inner)
        if tag == "__dict__" and isinstance(inner, list):
            decoded = {}
            for pair in inner:
                if not (
                    isinstance(pair, list) and len(pair) == 2 and not isinstance(pair[0], list)
                ):
                    raise MalformedTrainingState("a __dict__ entry is not a [key, value] pair")
                if isinstance(pair[0], dict):
                    raise MalformedTrainingState("a __dict__ key is an object")
                decoded[pair[0]] = _decode(pair[1], tensors, used)
            return decoded
        raise MalformedTrainingState(f"malformed {tag} entry")
    return {key: _decode(item, tensors, used) for key, item in value.items()}

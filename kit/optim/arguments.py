"""Which of hivemind.Optimizer's arguments ``kit.Optimizer`` accepts, and the combinations it refuses.

Holds :func:`validate` (raises ``ConfigError`` with a hint at construction, where hivemind would
hang or fail later: hivemind#443) and :func:`resolve_defaults` (hivemind's ``None`` defaults made
explicit). It does not hold the optimizer (``kit.optim.optimizer``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kit.averaging.compression import NoCompression
from kit.errors import ConfigError


def resolve_defaults(arguments: dict[str, Any]) -> tuple[bool, bool]:
    """``(delay_optimizer_step, offload_optimizer)`` with their ``None`` defaults resolved.

    As in hivemind, ``delay_optimizer_step=None`` means ``delay_grad_averaging``.
    ``offload_optimizer=None`` means False here (hivemind turns it on with an optimizer factory):
    a copy of the parameters costs memory, so ask for it.
    """
    delay = arguments["delay_optimizer_step"]
    if delay is None:
        delay = arguments["delay_grad_averaging"]
    offload = arguments["offload_optimizer"]
    return bool(delay), bool(offload)


def validate(arguments: dict[str, Any]) -> None:
    """Refuse argument combinations that cannot work, at construction.

    Raises:
        ConfigError: the combination, and what to do instead.
    """
    if arguments["grad_averager_factory"] is not None:
        raise ConfigError(
            "grad_averager_factory is not supported: kit.Optimizer has one gradient averager "
            "(codecs via grad_compression) - help: leave it at None"
        )
    compression = arguments["load_state_compression"]
    if compression is not None and not isinstance(compression, NoCompression):
        raise ConfigError(
            "load_state_compression is not supported: the state travels exactly, verified by its "
            "digest (a lossy codec would fail the check) - help: leave load_state_compression=None"
        )
    if not isinstance(arguments["target_batch_size"], int) or arguments["target_batch_size"] <= 0:
        raise ConfigError("target_batch_size must be a positive integer - help: e.g. 4096")
    if arguments["client_mode"] and arguments["auxiliary"]:
        raise ConfigError(
            "an auxiliary peer aggregates for others, so it cannot be in client mode - help: drop one"
        )
    if arguments["auxiliary"] and arguments["batch_size_per_step"] is not None:
        raise ConfigError("auxiliary peers bring no samples - help: leave batch_size_per_step=None")
    optimizer = arguments["optimizer"]
    factory = callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        if arguments["params"] is not None:
            raise ConfigError(
                "params= goes with an optimizer factory - help: pass optimizer=lambda p: Opt(p)"
            )
    elif callable(optimizer):
        if arguments["params"] is None:
            raise ConfigError(
                "an optimizer factory needs params= - help: params=model.parameters()"
            )
    else:
        raise ConfigError("optimizer must be a torch optimizer or a factory of one")
    delay, offload = resolve_defaults(arguments)
    if (delay or offload) and not factory:
        raise ConfigError(
            "delay_optimizer_step and offload_optimizer keep the optimizer on copies of the "
            "parameters, so kit must create it - help: pass optimizer=lambda p: Opt(p, ...) "
            "and params=model.parameters()"
        )
    if arguments["delay_grad_averaging"] and not delay:
        raise ConfigError(
            "delay_grad_averaging runs the round and then the optimizer step in the background, "
            "so it needs delay_optimizer_step - help: drop delay_optimizer_step=False"
        )
    if arguments["use_local_updates"]:
        for name in (
            "reuse_grad_buffers",
            "delay_optimizer_step",
            "delay_grad_averaging",
            "offload_optimizer",
        ):
            if arguments[name]:
                raise ConfigError(
                    f"use_local_updates steps on every local gradient, so {name} does not apply"
                    f" - help: drop {name}, or use_local_updates"
                )
    if arguments["auxiliary"] and arguments["use_local_updates"]:
        raise ConfigError(
            "auxiliary peers help with gradient rounds, and use_local_updates has none - "
            "help: drop auxiliary=True (or use_local_updates)"
        )
    if arguments["auxiliary"] and (arguments["reuse_grad_buffers"] or delay or offload):
        raise ConfigError(
            "auxiliary peers have no gradients or optimizer steps - help: drop "
            "reuse_grad_buffers / delay_optimizer_step / offload_optimizer"
        )
    if arguments["average_state_every"] < 0 or arguments["load_state_timeout"] <= 0:
        raise ConfigError(
            "average_state_every must be >= 0 and load_state_timeout > 0 - help: e.g. 1 and 600"
        )
    names = arguments["average_opt_statistics"]
    if names is not None and (
        isinstance(names, str) or not all(isinstance(n, str) and n for n in names)
    ):
        raise ConfigError(
            "average_opt_statistics must be a sequence of names of optimizer statistics - "
            "help: e.g. ('exp_avg_sq',) for Adam"
        )
    if not all(isinstance(t, torch.Tensor) for t in arguments["extra_tensors"]):
        raise ConfigError("extra_tensors must be torch tensors - help: pass a list of tensors")
    if not isinstance(arguments["run_id"], str) or not arguments["run_id"]:
        raise ConfigError(
            "run_id must be a non-empty string - help: the run's name, e.g. 'sahajbert'"
        )
    timeout = arguments["shutdown_timeout"]
    if isinstance(timeout, bool) or not 0 <= timeout < math.inf:
        raise ConfigError(f"shutdown_timeout={timeout!r} - help: seconds, e.g. 5")

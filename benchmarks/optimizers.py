"""Optimizer state per parameter and step time on the CPU: kit's LAMB, its 8-bit LAMB, and the
recipe's reference ``torch_optimizer.Lamb``, on sahajBERT's ALBERT-large (~18M parameters).

Prints one JSON line: per optimizer, bytes of optimizer state per parameter (every state tensor,
shared quantization maps once) and the median and best step time over ``--steps`` steps with
random gradients (the first step, which allocates the state, is not counted), plus the ratios
of lamb8bit to lamb. On the CPU is where TTT ran its 8-bit LAMB (statistics offloaded).

    python benchmarks/optimizers.py [--steps 5] [--threads 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from kit.config import RunConfig
from kit.hardware.memory import optimizer_state_bytes
from kit.training.components import build_inner_optimizer, build_model, parameter_groups


def measure(name: str, model: torch.nn.Module, config: RunConfig, steps: int) -> dict[str, Any]:
    groups = parameter_groups(model, config.optimizer.weight_decay)
    if name == "torch_optimizer":
        import torch_optimizer

        optimizer: torch.optim.Optimizer = torch_optimizer.Lamb(
            groups, lr=config.optimizer.lr, weight_decay=0.01, clamp_value=10_000.0, debias=True
        )
    else:
        optimizer = build_inner_optimizer(groups, config.optimizer, name=name)
    generator = torch.Generator().manual_seed(0)
    times = []
    parameters = [p for group in groups for p in group["params"]]
    for step in range(steps + 1):
        for param in parameters:
            param.grad = torch.randn(param.shape, generator=generator) * 1e-3
        started = time.perf_counter()
        optimizer.step()
        if step:  # the first step allocates the state
            times.append(time.perf_counter() - started)
    count = sum(p.numel() for p in parameters)
    state = optimizer_state_bytes(optimizer)
    return {
        "parameters": count,
        "state_bytes": state,
        "state_bytes_per_parameter": round(state / count, 3),
        "step_seconds_median": round(statistics.median(times), 4),
        "step_seconds_best": round(min(times), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = RunConfig.sahajbert()
    results: dict[str, Any] = {
        "model": "albert-large (sahajBERT)",
        "threads": torch.get_num_threads(),
    }
    names = ["lamb", "lamb8bit"]
    try:
        import torch_optimizer  # noqa: F401
    except ImportError:
        pass
    else:
        names.append("torch_optimizer")
    for name in names:
        model = build_model(config)  # a fresh model each: steps change the weights
        results[name] = measure(name, model, config, args.steps)
    lamb, eight = results["lamb"], results["lamb8bit"]
    results["lamb8bit_over_lamb"] = {
        "state_bytes": round(eight["state_bytes"] / lamb["state_bytes"], 3),
        "step_time": round(eight["step_seconds_median"] / lamb["step_seconds_median"], 2),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""kit's volunteer loop against a plain PyTorch loop: the same model, micro-batch, precision and
optimizer, on whatever device is here.

    python benchmarks/volunteer_loop.py --recipe tiny --duration 20            # this CPU
    python benchmarks/volunteer_loop.py --recipe sahajbert                     # a GPU
    python benchmarks/volunteer_loop.py --recipe ttt --precision fp16          # a T4's plan

kit's side is the volunteer's own path: ``plan_training`` (memory and speed probes) →
``build_training`` → ``Trainer``, one peer with its own DHT on loopback (nobody else: it steps
without averaging rounds), on synthetic MLM+SOP batches of the run's shape. The plain side is
the loop a researcher would write around the same model and forward: forward, backward of
``loss / accumulation``, and every ``target_batch_size`` samples clipping (the recipe's),
``optimizer.step()`` (``torch_optimizer.Lamb`` for a LAMB recipe, as sahajBERT ran it; kit's
8-bit LAMB for TTT's), ``zero_grad``; fp16 through ``torch.amp.GradScaler``. With
``--hf-baseline`` a third loop runs transformers' own ``AlbertForPreTraining(**batch).loss``
(gelu_new, logits at every position), to show what kit's forward saves.

Each loop warms up (compiling, if the run compiles), then runs ``--duration`` seconds. Prints
one JSON line: ``device``, ``precision``, ``micro_batch``, ``kit_samples_per_s``,
``plain_samples_per_s``, ``vs_plain_loop``, ``fraction_outside_fwd_bwd`` (kit's: wall time
not spent between a step's first forward and last backward, by CUDA events on a GPU),
``peak_memory_bytes``, ``mfu`` (model FLOPs per second, counted from the model's shapes by
``kit.training.albert_speed.pretraining_flops_per_sample``, over the GPU's dense bf16/fp16 peak
from its datasheet, or over a measured matmul where the GPU is not in the table), and the same
for the plain loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

import kit
from kit.config import RunConfig
from kit.hardware import detect
from kit.hardware.plan import TrainingPlan
from kit.training.albert_speed import compile_layers, pretraining_flops_per_sample
from kit.training.assembly import (
    build_fast_model,
    build_training,
    compiles_here,
    plan_training,
    synthetic_batch,
    training_loss,
)
from kit.training.clipping import clip_grad_norm
from kit.training.components import (
    build_inner_optimizer,
    build_model,
    lamb_arguments,
    parameter_groups,
)
from kit.training.trainer import Trainer

#: Dense (no sparsity) tensor-core peaks from the vendors' datasheets, FLOP/s: bf16 where the
#: GPU has it, else fp16 with fp32 accumulation. Matched by substring of torch's device name.
DATASHEET_PEAKS = {
    "H200": 989.4e12,
    "H100 SXM": 989.4e12,
    "H100 80GB HBM3": 989.4e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,
    "A100": 312.0e12,
    "L40S": 362.1e12,
    "L4": 121.0e12,
    "A10G": 70.0e12,
    "A10": 125.0e12,
    "RTX 4090": 165.2e12,
    "RTX 3090": 71.0e12,
    "V100": 125.0e12,
    "T4": 65.0e12,
}
POOL = 16  # distinct batches cycled through (made once: the loop, not the data, is measured)


def recipe_config(name: str, compile_option: str, model_name: str) -> RunConfig:
    if name == "tiny":
        config = RunConfig.tiny_demo()
    elif name == "sahajbert":
        config = RunConfig.sahajbert(run_id="bench-volunteer-loop")
    elif name == "ttt":
        config = RunConfig.sahajbert(run_id="bench-volunteer-loop").with_recipe("ttt")
    else:
        raise SystemExit(f"unknown recipe {name!r}")
    run_id = f"bench-{name}-{int(time.time())}"  # nobody else's progress records
    config = dataclasses.replace(
        config, collaboration=dataclasses.replace(config.collaboration, run_id=run_id)
    )
    if model_name == "tiny":  # the recipe's optimizer and collaboration on the demo's model
        tiny = RunConfig.tiny_demo()
        config = dataclasses.replace(
            config, model=tiny.model, data=tiny.data, tokenizer=tiny.tokenizer
        )
    if compile_option != "recipe":
        model = dataclasses.replace(config.model, compile=compile_option == "on")
        config = dataclasses.replace(config, model=model)
    return config


def batches(config: RunConfig, micro_batch: int) -> Iterator[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    pool = [synthetic_batch(config, micro_batch, generator) for _ in range(POOL)]
    return itertools.cycle(pool)


def predicted_fraction(config: RunConfig, micro_batch: int) -> float:
    sample = next(batches(config, micro_batch))
    return float((sample["labels"] != -100).float().mean())


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """The GPU's dense bf16/fp16 peak: from the datasheet table, else a measured matmul."""
    if device.type != "cuda":
        return None, "none (not a GPU)"
    name = torch.cuda.get_device_name(device)
    for key, flops in DATASHEET_PEAKS.items():
        if key in name:
            return flops, f"datasheet ({key})"
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 10 * 2 * size**3 / (time.perf_counter() - started), "measured bf16 matmul"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


# --- kit's loop ---------------------------------------------------------------------------------


def run_kit(
    config: RunConfig, plan: TrainingPlan, model: torch.nn.Module, args: argparse.Namespace
) -> dict[str, Any]:
    device = torch.device(plan.device)
    reset_peak(device)
    records: list[tuple[float, int, float]] = []  # (read at, samples, compute seconds)
    with kit.DHT(host="127.0.0.1", client_mode=False) as dht:
        parts = build_training(config, plan, model, dht)
        trainer = Trainer(
            parts.model,
            parts.optimizer,
            batches(config, plan.micro_batch),
            plan,
            clip_grad_norm=config.optimizer.clip_grad_norm,
            replicas=parts.replicas,
        )
        trainer.add_step_listener(
            lambda samples, _loss, compute: records.append((time.perf_counter(), samples, compute))
        )
        trainer.start(max_seconds=args.max_seconds)
        try:
            deadline = time.monotonic() + args.max_seconds
            while trainer.running and time.monotonic() < deadline:
                time.sleep(0.2)
                if records and records[-1][0] - records[0][0] >= args.warmup + args.duration:
                    break
        finally:
            trainer.stop(timeout=120)
            epochs = parts.optimizer.local_epoch
            parts.optimizer.shutdown()
    if trainer.error is not None:
        raise trainer.error
    begin = records[0][0] + args.warmup
    inside = [record for record in records if record[0] >= begin]
    if len(inside) < 2:
        raise SystemExit(f"kit's loop made {len(records)} steps: raise --duration")
    first, last = inside[0], inside[-1]
    wall = last[0] - first[0]
    samples = sum(record[1] for record in inside[1:])
    compute = sum(record[2] for record in inside[1:])
    return {
        "samples_per_s": samples / wall,
        "fraction_outside_fwd_bwd": max(0.0, 1.0 - compute / wall),
        "peak_memory_bytes": peak_memory(device),
        "global_steps": epochs,
        "local_steps": len(records),
    }


# --- the plain loop -----------------------------------------------------------------------------


def plain_optimizer(config: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The recipe's optimizer as a single-process user builds it (torch_optimizer.Lamb for
    sahajBERT's LAMB, as its trainer did; kit's 8-bit LAMB for TTT's)."""
    groups = parameter_groups(model, config.optimizer.weight_decay)
    settings = config.optimizer
    if settings.name == "lamb" and settings.max_grad_norm is None:
        try:
            import torch_optimizer
        except ImportError:
            pass
        else:
            arguments = lamb_arguments(settings)
            del arguments["max_grad_norm"]  # (None here: the loop clips, not the optimizer)
            return torch_optimizer.Lamb(groups, **arguments)  # type: ignore[no-any-return]
    return build_inner_optimizer(groups, settings)


def run_plain(
    config: RunConfig, plan: TrainingPlan, args: argparse.Namespace, *, stock: bool
) -> dict[str, Any]:
    """The plain loop, in a thread of its own as kit's ``Trainer`` runs (``Trainer.start``: a
    notebook stays responsive): a CPU's OpenMP teams run a non-main thread's ops ~20% slower
    on this 2-core machine, so both loops run under the same conditions."""
    result: dict[str, Any] = {}
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.update(_plain_loop(config, plan, args, stock=stock))
        except BaseException as error:  # re-raised in the caller
            errors.append(error)

    thread = threading.Thread(target=target, name="plain-loop")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result


def _plain_loop(
    config: RunConfig, plan: TrainingPlan, args: argparse.Namespace, *, stock: bool
) -> dict[str, Any]:
    device = torch.device(plan.device)
    reset_peak(device)
    torch.manual_seed(0)
    model = (build_model(config) if stock else build_fast_model(config)).to(device).train()
    if not stock and config.model.compile and compiles_here(plan):
        compile_layers(model)
    optimizer = plain_optimizer(config, model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
    scaler = torch.amp.GradScaler(device.type) if plan.precision == "fp16" else None
    accumulation = max(1, math.ceil(config.collaboration.target_batch_size / plan.micro_batch))
    source = batches(config, plan.micro_batch)
    cuda = device.type == "cuda"

    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not stock:
            return training_loss(model, batch, device)
        moved = {
            name: (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)
            for name, t in batch.items()
        }
        return model(**moved).loss

    marks: list[tuple[Any, Any]] = []
    count = steps = samples = 0
    phase_start = time.perf_counter()
    window_start: float | None = None
    while True:
        now = time.perf_counter()
        if window_start is None and now - phase_start >= args.warmup_plain:
            synchronize(device)
            window_start, samples, marks = time.perf_counter(), 0, []
        if window_start is not None and now - window_start >= args.duration:
            break
        if now - phase_start > args.max_seconds:
            raise SystemExit("the plain loop ran out of time: lower --duration")
        batch = next(source)
        start = _mark(cuda)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_of(batch) / accumulation
        (scaler.scale(loss) if scaler is not None else loss).backward()
        marks.append((start, _mark(cuda)))
        samples += plan.micro_batch
        count += 1
        if count == accumulation:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if config.optimizer.clip_grad_norm is not None:
                clip_grad_norm(model.parameters(), config.optimizer.clip_grad_norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            float(loss.detach())  # the loop logs its loss once per optimizer step
            count, steps = 0, steps + 1
    synchronize(device)
    assert window_start is not None
    wall = time.perf_counter() - window_start
    compute = sum(_seconds(start, end, cuda) for start, end in marks)
    return {
        "samples_per_s": samples / wall,
        "fraction_outside_fwd_bwd": max(0.0, 1.0 - compute / wall),
        "peak_memory_bytes": peak_memory(device),
        "optimizer_steps": steps,
    }


def _mark(cuda: bool) -> Any:
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(start: Any, end: Any, cuda: bool) -> float:
    return float(start.elapsed_time(end)) / 1000.0 if cuda else float(end - start)


# --- main ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=("tiny", "sahajbert", "ttt"), default="tiny")
    parser.add_argument("--model", choices=("recipe", "tiny"), default="recipe")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per loop")
    parser.add_argument(
        "--warmup", type=float, default=5.0, help="kit: seconds after its first step"
    )
    parser.add_argument("--warmup-plain", type=float, default=None, help="default: --warmup + 5")
    parser.add_argument("--micro-batch", type=int, default=0, help="0: the plan's")
    parser.add_argument("--target-batch-size", type=int, default=0, help="0: the recipe's")
    parser.add_argument("--matchmaking-time", type=float, default=0.0, help="0: the recipe's")
    parser.add_argument("--compile", choices=("recipe", "on", "off"), default="recipe")
    parser.add_argument("--hf-baseline", action="store_true", help="also time transformers' loss")
    parser.add_argument("--no-probe", action="store_true", help="plan from estimates only")
    parser.add_argument(
        "--bracket",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the plain loop in two halves, before and after kit's, so that a machine "
        "whose speed drifts (a shared CPU) biases neither (default: on the CPU)",
    )
    parser.add_argument("--max-seconds", type=float, default=600.0, help="per loop, at most")
    args = parser.parse_args()
    if args.warmup_plain is None:
        args.warmup_plain = args.warmup + 5.0
    logging.basicConfig(level=logging.WARNING)

    config = recipe_config(args.recipe, args.compile, args.model)
    collaboration = config.collaboration
    if args.target_batch_size:
        collaboration = dataclasses.replace(collaboration, target_batch_size=args.target_batch_size)
    if args.matchmaking_time:
        timeout = max(float(collaboration.averaging_timeout or 0.0), 3 * args.matchmaking_time)
        collaboration = dataclasses.replace(
            collaboration, matchmaking_time=args.matchmaking_time, averaging_timeout=timeout
        )
    config = dataclasses.replace(config, collaboration=collaboration)
    hardware = detect()
    began = time.perf_counter()
    model, plan = plan_training(config, hardware, probe=not args.no_probe)
    planning_seconds = time.perf_counter() - began
    if plan.auxiliary:
        raise SystemExit(f"this machine would join as an auxiliary peer: {plan.reasons}")
    if args.precision != "auto":
        plan = dataclasses.replace(
            plan, precision=args.precision, grad_scaler=args.precision == "fp16"
        )
    if args.micro_batch:
        plan = dataclasses.replace(plan, micro_batch=args.micro_batch, accumulation_steps=1)
    device = torch.device(plan.device)
    if args.bracket is None:
        args.bracket = device.type == "cpu"

    def progress(phase: str, figures: dict[str, Any]) -> None:  # survives a timeout
        print(
            json.dumps({"phase": phase, "micro_batch": plan.micro_batch, **figures}),
            file=sys.stderr,
        )

    progress("plan", {"planning_seconds": planning_seconds, "plan": list(plan.reasons)})
    if args.bracket:  # the plain loop's time in two halves, before and after kit's
        half = argparse.Namespace(**{**vars(args), "duration": args.duration / 2})
        before = run_plain(config, plan, half, stock=False)
        progress("plain (before)", before)
        ours = run_kit(config, plan, model, args)
        after = run_plain(config, plan, half, stock=False)
        progress("plain (after)", after)
        plain = {
            "samples_per_s": (before["samples_per_s"] + after["samples_per_s"]) / 2,
            "fraction_outside_fwd_bwd": (
                before["fraction_outside_fwd_bwd"] + after["fraction_outside_fwd_bwd"]
            )
            / 2,
            "peak_memory_bytes": max(
                before["peak_memory_bytes"] or 0, after["peak_memory_bytes"] or 0
            )
            or None,
            "optimizer_steps": before["optimizer_steps"] + after["optimizer_steps"],
        }
    else:
        plain = run_plain(config, plan, args, stock=False)
        progress("plain", plain)
        ours = run_kit(config, plan, model, args)
    progress("kit", ours)
    stock = run_plain(config, plan, args, stock=True) if args.hf_baseline else None

    flops = pretraining_flops_per_sample(
        config.model, config.data.max_seq_length, predicted_fraction(config, plan.micro_batch)
    )
    peak, peak_source = peak_flops(device)

    def mfu(rate: float) -> float | None:
        return None if peak is None else round(rate * flops / peak, 4)

    result: dict[str, Any] = {
        "benchmark": "volunteer_loop",
        "recipe": args.recipe,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": plan.precision,
        "micro_batch": plan.micro_batch,
        "accumulation_steps": plan.accumulation_steps,
        "target_batch_size": config.collaboration.target_batch_size,
        "compiled": bool(config.model.compile and compiles_here(plan)),
        "kit_samples_per_s": round(ours["samples_per_s"], 2),
        "plain_samples_per_s": round(plain["samples_per_s"], 2),
        "vs_plain_loop": round(ours["samples_per_s"] / plain["samples_per_s"], 3),
        "fraction_outside_fwd_bwd": round(ours["fraction_outside_fwd_bwd"], 4),
        "plain_fraction_outside_fwd_bwd": round(plain["fraction_outside_fwd_bwd"], 4),
        "peak_memory_bytes": ours["peak_memory_bytes"],
        "plain_peak_memory_bytes": plain["peak_memory_bytes"],
        "mfu": mfu(ours["samples_per_s"]),
        "plain_mfu": mfu(plain["samples_per_s"]),
        "model_flops_per_sample": flops,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "kit_global_steps": ours["global_steps"],
        "kit_local_steps": ours["local_steps"],
        "plain_optimizer_steps": plain["optimizer_steps"],
        "planning_seconds": round(planning_seconds, 1),
        "plan": list(plan.reasons),
        "duration_s": args.duration,
        "torch": torch.__version__,
    }
    if stock is not None:
        result["hf_plain_samples_per_s"] = round(stock["samples_per_s"], 2)
        result["hf_plain_mfu"] = mfu(stock["samples_per_s"])
        result["hf_plain_peak_memory_bytes"] = stock["peak_memory_bytes"]
        result["kit_vs_hf_plain"] = round(ours["samples_per_s"] / stock["samples_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

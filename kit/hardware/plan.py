"""The plan: device, precision, micro-batch, accumulation and memory savers for this machine."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

from kit.config import config_error
from kit.hardware.detect import (
    ACCELERATOR_MAX_MICRO_BATCH,
    CPU_FLOPS_PER_CORE,
    CPU_MAX_MICRO_BATCH,
    CPU_SPEED_PROBE_MAX_MICRO_BATCH,
    CUDA_CONTEXT_BYTES,
    ESTIMATE_OVERHEAD,
    FALLBACK_RAM_BYTES,
    GLOBAL_BATCH_SHARE,
    GPU,
    MIN_USEFUL_MICRO_BATCH,
    MPS_SHARE_OF_RAM,
    SPEED_MARGIN,
    Hardware,
    MemoryProbe,
    SpeedProbe,
    _size,
)
from kit.hardware.memory import (
    MemoryEstimate,
    TrainingNeeds,
    _precision,
    estimate_memory,
    largest_fitting_batch,
    training_flops_per_sample,
)

logger = logging.getLogger(__name__)


# --- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingPlan:
    """How this peer trains; ``reasons`` explains every choice to the volunteer."""

    device: str = "cpu"  # torch device of the main model: "cuda", "cuda:0", "mps" or "cpu"
    devices: tuple[str, ...] = ()  # with several GPUs: one model replica per device (device first)
    precision: str = "fp32"  # "bf16" or "fp16" autocast, or "fp32" (no autocast)
    grad_scaler: bool = False  # fp16 only: scale the loss so small gradients don't underflow
    micro_batch: int = 0  # samples per forward/backward on each device (0 for an auxiliary peer)
    accumulation_steps: int = 0  # micro-batches summed per peer step (0 for an auxiliary peer)
    optimizer_8bit: bool = False  # 8-bit LAMB statistics (bitsandbytes; ~2, not 8 bytes/param)
    offload_optimizer: bool = False  # optimizer runs on CPU copies (hivemind offload_optimizer)
    gradient_checkpointing: bool = False  # recompute activations in backward: ~1/3 slower
    auxiliary: bool = False  # only help averaging, compute no gradients (hivemind auxiliary)
    estimated_peak_bytes: int | None = None  # device (RAM on CPU) bytes expected at micro_batch
    memory_source: str = "estimate"  # "probe", "probe+estimate" (calibrated) or "estimate"
    estimated_samples_per_second: float | None = None  # CPU plans: the speed estimate used
    reasons: tuple[str, ...] = ()  # one human-readable line per decision

    @property
    def replicas(self) -> int:
        """Model replicas trained in parallel, one per device (1 without ``devices``)."""
        return max(1, len(self.devices))

    @property
    def batch_size_per_step(self) -> int:
        """Samples per peer step: micro_batch x accumulation_steps x replicas (>= the target)."""
        return self.micro_batch * self.accumulation_steps * self.replicas


@dataclass(frozen=True)
class _Layout:
    optimizer_8bit: bool = False
    offload: bool = False
    checkpointing: bool = False


def plan(
    needs: TrainingNeeds,
    hw: Hardware,
    *,
    probe: MemoryProbe | None = None,
    max_memory_fraction: float = 0.9,
    min_samples_per_second: float = 1.0,
    speed: SpeedProbe | None = None,
) -> TrainingPlan:
    """Decide how this peer trains (see the module docstring for the order of decisions).

    Args:
        needs: what the run asks of a peer.
        hw: what :func:`detect` found.
        probe: ``probe(micro_batch) -> peak_bytes or None`` measuring one forward/backward on
            the GPU (see :func:`make_torch_probe`); without it, or on CPU, memory is estimated.
        speed: ``speed(micro_batch) -> samples/s or None`` measuring training at that size
            (``TorchMemoryProbe.samples_per_second``): the micro-batch is then the fastest that
            fits, up to the run's global batch, and steps accumulate up to
            ``batch_size_per_step``; without it, the fewest micro-batches that make
            ``batch_size_per_step``.
        max_memory_fraction: share of GPU memory (or RAM on CPU) the plan may fill. Lower it if
            you see "CUDA out of memory" after joining; raise it if the GPU stays half empty.
        min_samples_per_second: a CPU-only machine estimated slower than this joins as an
            auxiliary peer. Lower it if a capable CPU machine is turned away.

    Returns:
        The frozen :class:`TrainingPlan`.

    Raises:
        ConfigError: a fraction outside (0, 1] or a negative speed floor.
    """
    if not 0.0 < max_memory_fraction <= 1.0:
        raise config_error(
            "max_memory_fraction", f"must be in (0, 1], got {max_memory_fraction}", "use 0.8-0.95"
        )
    if not min_samples_per_second >= 0.0:
        raise config_error(
            "min_samples_per_second", f"must be >= 0, got {min_samples_per_second}", "use 1.0"
        )
    reasons: list[str] = []
    if needs.shared_parameters:
        reasons.append(
            f"{needs.shared_parameters / 1e6:.1f}M of the {needs.parameters / 1e6:.1f}M parameters"
            f" are shared across {needs.num_layers} layers: weights are small, but activations "
            "and compute scale with every layer."
        )
    gpus = _usable_gpus(hw, reasons)
    if gpus:
        gpu = gpus[0]
        device = "cuda" if len(hw.gpus or ()) == 1 else f"cuda:{gpu.index}"
        devices = tuple(f"cuda:{g.index}" for g in gpus) if len(gpus) > 1 else ()
        budget = max_memory_fraction * gpu.total_memory - CUDA_CONTEXT_BYTES
        return _plan_accelerator(
            needs, hw, device, gpu.capability, budget, probe, speed, reasons, devices=devices
        )
    if hw.mps:
        ram = hw.ram_bytes or FALLBACK_RAM_BYTES
        budget = max_memory_fraction * MPS_SHARE_OF_RAM * ram
        reasons.append(f"Apple GPU (MPS): up to {_size(budget)} of the shared {_size(ram)} RAM.")
        return _plan_accelerator(needs, hw, "mps", None, budget, probe, speed, reasons)
    return _plan_cpu(needs, hw, max_memory_fraction, min_samples_per_second, speed, reasons)


def _usable_gpus(hw: Hardware, reasons: list[str]) -> list[GPU]:
    """The GPUs to train on: the first one torch can run, and every other of the same model.

    One peer trains on all of them (a model replica per GPU, gradients summed locally, samples
    counted once: ``kit.training.replicas``), so Kaggle's "GPU T4 x2" is one peer on 2 x T4.
    GPUs of another model stay idle: the slower one would hold the faster one back.
    """
    usable: list[GPU] = []
    for gpu in hw.gpus or ():
        sm = "sm_{}{}".format(*gpu.capability)
        if gpu.supported is False:
            reasons.append(
                f"GPU {gpu.index} ({gpu.name}, {sm}) cannot be used: the installed torch was not "
                f"built for {sm} (current CUDA builds dropped it) - help: pick another GPU "
                "runtime (Kaggle: 'GPU T4 x2'), or install an older torch built for it."
            )
            continue
        if usable:
            if (gpu.name, gpu.total_memory, gpu.capability) == (
                usable[0].name,
                usable[0].total_memory,
                usable[0].capability,
            ):
                usable.append(gpu)
            continue
        if gpu.supported is None and gpu.capability < (7, 5):
            reasons.append(
                f"warning: {gpu.name} is {sm}; recent CUDA builds of torch need sm_75 or newer "
                "and may fail on it."
            )
        usable.append(gpu)
    if not usable:
        return []
    first = usable[0]
    sm = "sm_{}{}".format(*first.capability)
    idle = len(hw.gpus or ()) - len(usable)
    if len(usable) > 1:
        where = f"{len(usable)} × {first.name} ({_size(first.total_memory)} each, {sm})"
        reasons.append(
            f"training on {where}: one model replica per GPU, gradients summed on GPU "
            f"{first.index}, one peer in the swarm."
        )
    else:
        reasons.append(
            f"training on GPU {first.index}: {first.name} ({_size(first.total_memory)}, {sm})."
        )
    if idle > 0:
        reasons.append(f"{idle} GPU(s) of another model (or unusable) stay idle.")
    return usable


def _plan_accelerator(
    needs: TrainingNeeds,
    hw: Hardware,
    device: str,
    capability: tuple[int, int] | None,
    budget: float,
    probe: MemoryProbe | None,
    speed: SpeedProbe | None,
    reasons: list[str],
    *,
    devices: tuple[str, ...] = (),
) -> TrainingPlan:
    precision, scaler = _precision(capability, reasons)
    replicas = max(1, len(devices))
    # Each replica trains its share of the peer's samples per step.
    target = -(-needs.batch_size_per_step // replicas)
    # With a speed probe the micro-batch may exceed the samples per step (up to the global
    # batch): the fastest that fits is taken, and a step is then one micro-batch.
    limit = (
        target if speed is None else _largest_useful(needs, replicas, ACCELERATOR_MAX_MICRO_BATCH)
    )
    is_cuda = capability is not None
    measured: dict[int, int | None] = {}

    def probed(micro_batch: int) -> int | None:
        if micro_batch not in measured:
            measured[micro_batch] = probe(micro_batch) if probe else None
            logger.debug("memory probe: micro-batch %d -> %s", micro_batch, measured[micro_batch])
        return measured[micro_batch]

    def device_bytes(micro_batch: int, layout: _Layout) -> float:
        estimate = estimate_memory(
            needs,
            micro_batch,
            precision=precision,
            optimizer_8bit=layout.optimizer_8bit,
            offload=layout.offload,
            checkpointing=layout.checkpointing,
        )
        if probe is None:
            return estimate.device_bytes
        if not layout.checkpointing:  # the probe measures weights, gradients and activations
            peak = probed(micro_batch)
            return math.inf if peak is None else peak + estimate.optimizer
        # No probe of the checkpointed model: scale the estimate by measured/estimated at 1.
        peak_one = probed(1)
        plain = _without_optimizer(estimate_memory(needs, 1, precision=precision))
        scale = 1.0 if peak_one is None else peak_one / plain
        return scale * _without_optimizer(estimate) + estimate.optimizer

    def largest(layout: _Layout) -> int:
        return largest_fitting_batch(lambda b: device_bytes(b, layout) <= budget, limit)

    layout = _Layout(optimizer_8bit=needs.optimizer == "lamb8bit")
    best = largest(layout)
    goal = min(target, MIN_USEFUL_MICRO_BATCH)
    savers = _memory_savers(needs, hw, is_cuda, reasons) if best < goal else iter(())
    for saver, why in savers:  # lazily: a saver not needed is neither tried nor explained
        candidate = dataclasses.replace(layout, **{saver: True})
        fitted = largest(candidate)
        if fitted > best:
            reasons.append(f"{why}: micro-batch {best} -> {fitted}.")
            layout, best = candidate, fitted
        else:
            reasons.append(f"{why} would not help (still micro-batch {best}); not used.")
        if best >= goal:
            break
    source = "estimate" if probe is None else "probe+estimate" if layout.checkpointing else "probe"
    if best == 0:
        reasons.append(
            f"not even one sample fits in {_size(budget)} of device memory: joining as an "
            "auxiliary peer (helps average, computes no gradients) - help: use a GPU with more "
            "memory, or lower sequence_length in the run config."
        )
        return TrainingPlan(auxiliary=True, memory_source=source, reasons=tuple(reasons))
    if speed is None:
        micro, accumulation = _split_batch(target, best)
    else:
        micro = _fastest(best, speed, reasons)
        accumulation = -(-target // micro)
    peak = int(device_bytes(micro, layout))
    per_gpu = f" x {replicas} GPUs" if replicas > 1 else ""
    reasons.append(
        f"micro-batch {micro} x {accumulation} accumulation step(s){per_gpu} = "
        f"{micro * accumulation * replicas} samples per step (target "
        f"{needs.batch_size_per_step}); up to {best} fit under "
        f"{_size(budget)} ({_SOURCE_WORDS[source]}), "
        f"expected peak {_size(peak)}."
    )
    return TrainingPlan(
        device=device,
        devices=devices,
        precision=precision,
        grad_scaler=scaler,
        micro_batch=micro,
        accumulation_steps=accumulation,
        optimizer_8bit=layout.optimizer_8bit,
        offload_optimizer=layout.offload,
        gradient_checkpointing=layout.checkpointing,
        estimated_peak_bytes=peak,
        memory_source=source,
        reasons=tuple(reasons),
    )


def _memory_savers(
    needs: TrainingNeeds, hw: Hardware, is_cuda: bool, reasons: list[str]
) -> Iterator[tuple[str, str]]:
    """Memory savers in the order they are tried, cheapest first (see the module docstring).

    A generator, so a skipped saver is explained only if the plan got that far.
    """
    # 8-bit statistics only where kit will build them: an 8-bit LAMB needs bitsandbytes and a
    # LAMB run (kit has no 8-bit AdamW); "lamb8bit" runs have them from the start.
    if is_cuda and needs.optimizer == "lamb" and hw.bitsandbytes:
        yield "optimizer_8bit", "8-bit LAMB statistics (bitsandbytes) save GPU memory"
    elif is_cuda and needs.optimizer == "lamb":
        reasons.append("8-bit optimizer unavailable (pip install bitsandbytes to enable it).")
    if is_cuda:
        host = estimate_memory(needs, 1, offload=True).host_bytes
        ram = hw.ram_available_bytes or hw.ram_bytes
        if ram is None or host <= 0.8 * ram:
            yield "offload", f"optimizer offloaded to CPU RAM ({_size(host)})"
        else:
            reasons.append(f"optimizer offload needs {_size(host)} of RAM, only {_size(ram)} free.")
    if needs.supports_checkpointing:
        yield "checkpointing", "gradient checkpointing (recompute activations, ~1/3 slower)"
    else:
        reasons.append("gradient checkpointing would save memory, but this model refuses it.")


def _without_optimizer(estimate: MemoryEstimate) -> float:
    """Device bytes of weights, gradients and activations (what a probe measures)."""
    return estimate.device_bytes - estimate.optimizer * ESTIMATE_OVERHEAD


def _largest_useful(needs: TrainingNeeds, replicas: int, cap: int) -> int:
    """The largest micro-batch worth trying: ``cap``, and a local step of at most
    1/``GLOBAL_BATCH_SHARE`` of the run's global batch (DeDLOC counts whole local steps: peers
    overshoot the target by up to one step each, so steps stay small next to it)."""
    if needs.target_batch_size > 0:
        share = needs.target_batch_size // (GLOBAL_BATCH_SHARE * replicas)
        cap = min(cap, max(share, needs.batch_size_per_step // replicas))
    return max(cap, 1)


def _fastest(largest: int, speed: SpeedProbe, reasons: list[str]) -> int:
    """The micro-batch up to ``largest`` that trains the most samples per second, measured:
    powers of two, then ``largest``, smallest first; a larger one is taken only if it is
    ``SPEED_MARGIN`` faster. Stops at the first size that fails (memory, or the probe's time)."""
    sizes = sorted({1 << k for k in range(largest.bit_length()) if 1 << k <= largest} | {largest})
    chosen, best = 0, 0.0
    measured: list[str] = []
    for size in sizes:
        rate = speed(size)
        if rate is None:
            break
        measured.append(f"{size}: {rate:.1f}")
        if chosen == 0 or rate > best * SPEED_MARGIN:
            chosen, best = size, rate
    if chosen == 0:  # nothing measured: the largest that fits, as without a speed probe
        return largest
    reasons.append(
        f"micro-batch {chosen} is the fastest measured (samples/s by micro-batch: "
        f"{', '.join(measured)})."
    )
    return chosen


def _split_batch(target: int, largest: int) -> tuple[int, int]:
    """(micro, accumulation) with micro <= largest, the fewest micro-steps, least overshoot."""
    accumulation = -(-target // largest)
    return -(-target // accumulation), accumulation


def _plan_cpu(
    needs: TrainingNeeds,
    hw: Hardware,
    max_memory_fraction: float,
    min_samples_per_second: float,
    speed: SpeedProbe | None,
    reasons: list[str],
) -> TrainingPlan:
    cores = hw.cpu_cores or 1
    estimated = cores * CPU_FLOPS_PER_CORE / training_flops_per_sample(needs)
    ram = hw.ram_available_bytes or hw.ram_bytes or FALLBACK_RAM_BYTES
    budget = max_memory_fraction * ram
    limit = (
        min(needs.batch_size_per_step, CPU_MAX_MICRO_BATCH)
        if speed is None
        else _largest_useful(needs, 1, CPU_SPEED_PROBE_MAX_MICRO_BATCH)
    )
    best = largest_fitting_batch(lambda b: estimate_memory(needs, b).device_bytes <= budget, limit)
    reasons.append(
        f"no usable GPU: CPU with {cores} core(s), fp32; estimated {estimated:.2f} samples/s."
    )
    if estimated < min_samples_per_second or best == 0:
        why = (
            f"{estimated:.2f} samples/s is below the {min_samples_per_second:g} samples/s floor"
            if best
            else f"not even one sample fits in {_size(budget)} of RAM"
        )
        reasons.append(
            f"{why}: joining as an auxiliary peer (helps average, computes no gradients) - help: "
            "to train, switch to a GPU runtime (Colab: Runtime > Change runtime type > T4 GPU)."
        )
        return TrainingPlan(
            auxiliary=True, estimated_samples_per_second=estimated, reasons=tuple(reasons)
        )
    if speed is None:
        micro, accumulation = _split_batch(needs.batch_size_per_step, best)
        limits = f"CPU micro-batches stay at most {CPU_MAX_MICRO_BATCH}"
    else:
        micro = _fastest(best, speed, reasons)
        accumulation = -(-needs.batch_size_per_step // micro)
        limits = f"up to {best} fit"
    peak = estimate_memory(needs, micro).device_bytes
    reasons.append(
        f"micro-batch {micro} x {accumulation} accumulation step(s) = {micro * accumulation} "
        f"samples per step (target {needs.batch_size_per_step}); {limits}; estimated "
        f"{_size(peak)} of RAM."
    )
    return TrainingPlan(
        micro_batch=micro,
        accumulation_steps=accumulation,
        optimizer_8bit=needs.optimizer == "lamb8bit",
        estimated_peak_bytes=peak,
        estimated_samples_per_second=estimated,
        reasons=tuple(reasons),
    )


_SOURCE_WORDS = {
    "probe": "measured by a probe",
    "probe+estimate": "estimated, calibrated by a probe",
    "estimate": "estimated",
}

"""What this machine can do for the run, and how it should train: ``detect()`` then ``plan()``.

Holds :func:`detect` (platform, GPUs, CPU cores, RAM, free disk; every probe fault-tolerant and
injectable for tests), :class:`TrainingNeeds` (what one run asks of a peer), :func:`plan` (device,
precision, micro-batch and accumulation, 8-bit optimizer, offload, checkpointing, or auxiliary),
the analytic memory model :func:`estimate_memory`, and :func:`make_torch_probe`, which measures
the real peak memory of one forward/backward. It does not build the model, the optimizer or the
training loop: the volunteer flow reads the :class:`TrainingPlan` and does that.

How a plan is made, in order:

1. Device. The first CUDA GPU the installed torch can run (its arch list is checked, so a Kaggle
   P100, sm_60, is refused by current builds with a reason), else Apple MPS, else the CPU.
2. Precision. bf16 on compute capability >= 8.0 (Ampere and newer); fp16 autocast with a
   GradScaler below that (T4, V100, P100). ``torch.cuda.is_bf16_supported()`` is not used: it
   says True on a T4, where bf16 only runs by slow emulation. fp32 on CPU and on MPS (see
   :data:`MPS_PRECISION`).
3. Micro-batch. On a GPU, the largest micro-batch whose peak memory fits under
   ``max_memory_fraction`` of the device, found by doubling then bisecting (powers of two are
   tried first) with a memory probe if one is given, else with :func:`estimate_memory`.
   If fewer than :data:`MIN_USEFUL_MICRO_BATCH` samples fit, memory savers are tried in this
   order and each is kept only if it helps: 8-bit optimizer states (bitsandbytes, CUDA only, no
   speed cost), optimizer offload to CPU RAM (cheap in collaborative training: the optimizer steps
   once per global step), then gradient checkpointing (costs ~1/3 more compute per step; never
   for models that refuse it, such as ALBERT in transformers 5).
4. Accumulation. ``accumulation = ceil(target / max_micro)``, then the micro-batch is lowered to
   ``ceil(target / accumulation)``: the fewest micro-steps, and at most ``accumulation - 1``
   samples above the target (never fewer samples than asked).
5. Auxiliary. A CPU-only machine whose estimated speed is under ``min_samples_per_second``, or a
   GPU where not even one sample fits, joins as an auxiliary peer: it helps average and
   brings no gradients (DeDLOC's auxiliary peers; hivemind ``auxiliary=True``).

Symptoms, for volunteers:

* "CUDA out of memory" after joining: lower ``max_memory_fraction`` (e.g. 0.8); other programs
  on the GPU, or memory fragmentation, took more than the plan left free.
* GPU memory mostly idle while the plan accumulates several micro-batches: raise
  ``max_memory_fraction`` (at most 0.95), or give ``plan`` a probe from :func:`make_torch_probe`
  (measured peaks are tighter than the analytic estimate, which errs on the safe side).
* "joining as an auxiliary peer" on a laptop that should train: lower
  ``min_samples_per_second``; your gradients then arrive slowly but do count.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kit.config import check_choice, check_int, config_error

__all__ = [
    "GPU",
    "Hardware",
    "MemoryEstimate",
    "Platform",
    "TorchMemoryProbe",
    "TrainingNeeds",
    "TrainingPlan",
    "detect",
    "detect_platform",
    "estimate_memory",
    "largest_fitting_batch",
    "make_torch_probe",
    "needs_from_model",
    "plan",
    "supports_gradient_checkpointing",
]

logger = logging.getLogger(__name__)

GIB = 1024**3
#: fp32 state tensors per parameter for each optimizer kind (Adam/AdamW/LAMB keep m and v).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "lamb": 2, "sgd": 1}
#: Device memory the CUDA context and kernels take outside torch's allocator (not in the probe).
CUDA_CONTEXT_BYTES = GIB // 2
#: Analytic estimates are multiplied by this: the TTT memory calculator notes that real PyTorch
#: usage runs 20-30% above the formula (allocator rounding, workspaces, fragmentation).
ESTIMATE_OVERHEAD = 1.25
#: Below this many samples per micro-batch a GPU idles between kernels, so memory savers are tried.
MIN_USEFUL_MICRO_BATCH = 4
#: CPU micro-batches stay small: CPU throughput barely grows with batch, and RAM stays free.
CPU_MAX_MICRO_BATCH = 8
#: Effective fp32 training FLOP/s per CPU core. This machine measured 7-40 GFLOP/s per core on
#: ALBERT configs (small layers are overhead-bound); Colab/Kaggle vCPUs are hyperthreads.
CPU_FLOPS_PER_CORE = 20e9
#: Apple GPUs share RAM; Metal's recommended working set is about two thirds of it.
MPS_SHARE_OF_RAM = 0.66
#: fp32 on MPS: GradScaler support for MPS came only in recent torch releases (kit's floor is
#: 2.1) and bf16 needs macOS 14+; fp32 is correct everywhere, and MPS memory is the large RAM.
MPS_PRECISION = "fp32"
#: When RAM cannot be read, plan as if this much were free (a small laptop).
FALLBACK_RAM_BYTES = 4 * GIB

T = TypeVar("T")
#: A memory probe: peak device bytes of one forward/backward at this micro-batch, None on OOM.
MemoryProbe = Callable[[int], "int | None"]


# --- detection ----------------------------------------------------------------------------------


class Platform(str, enum.Enum):
    """Where the notebook runs; decides the defaults of the join flow (e.g. no inbound ports)."""

    COLAB = "colab"
    KAGGLE = "kaggle"
    BINDER = "binder"
    LOCAL = "local"


@dataclass(frozen=True)
class GPU:
    """One CUDA device as torch sees it."""

    name: str  # e.g. "Tesla T4"
    total_memory: int  # bytes, as torch.cuda.get_device_properties reports
    capability: tuple[int, int]  # compute capability, e.g. (7, 5) for a T4
    index: int = 0  # CUDA device index
    supported: bool | None = None  # does this torch build have kernels for it? None: unknown


@dataclass(frozen=True)
class Hardware:
    """What :func:`detect` found. A probe that failed leaves its field None (logged at DEBUG)."""

    platform: Platform = Platform.LOCAL  # Colab, Kaggle, Binder or a local machine
    gpus: tuple[GPU, ...] | None = ()  # CUDA devices; () none, None: the CUDA probe failed
    mps: bool | None = False  # Apple Metal (MPS) available
    cpu_cores: int | None = None  # cores this process may run on (affinity-aware)
    ram_bytes: int | None = None  # total RAM
    ram_available_bytes: int | None = None  # RAM free for new allocations
    free_disk_bytes: int | None = None  # free space where the working directory is
    bitsandbytes: bool = False  # bitsandbytes importable (8-bit optimizers)

    @property
    def accelerator(self) -> str:
        """``"cuda"``, ``"mps"`` or ``"cpu"``: the best device present (usable or not)."""
        return "cuda" if self.gpus else "mps" if self.mps else "cpu"

    def describe(self) -> str:
        """One line for volunteers, e.g. ``colab · Tesla T4 (15.0 GiB, sm_75) · 2 CPU cores``."""
        parts = [self.platform.value]
        for gpu in self.gpus or ():
            major, minor = gpu.capability
            parts.append(f"{gpu.name} ({_size(gpu.total_memory)}, sm_{major}{minor})")
        if self.mps:
            parts.append("Apple GPU (MPS)")
        parts.append(f"{self.cpu_cores or '?'} CPU cores")
        parts.append(f"{_size(self.ram_bytes)} RAM")
        parts.append(f"{_size(self.free_disk_bytes)} free disk")
        return " · ".join(parts)


def detect_platform(env: Mapping[str, str], *, colab_importable: bool = False) -> Platform:
    """Name the notebook platform from environment variables.

    Kaggle is checked first: its image is built on Colab's and sets ``COLAB_RELEASE_TAG`` too.

    Args:
        env: the environment, e.g. ``os.environ``.
        colab_importable: ``google.colab`` can be imported (only true on Colab).
    """
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return Platform.KAGGLE
    if colab_importable or "COLAB_RELEASE_TAG" in env:
        return Platform.COLAB
    if any(name in env for name in ("BINDER_REPO_URL", "BINDER_LAUNCH_HOST", "BINDER_REQUEST")):
        return Platform.BINDER
    return Platform.LOCAL


def detect(
    *,
    env: Mapping[str, str] | None = None,
    cuda: Any = None,
    mps_available: bool | None = None,
    colab_importable: bool | None = None,
    bitsandbytes_available: bool | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> Hardware:
    """Look at this machine. Never raises: a probe that fails gives None and a DEBUG log line.

    Every keyword replaces one probe (tests inject fakes; callers normally pass nothing).

    Args:
        env: environment variables (default ``os.environ``).
        cuda: an object shaped like ``torch.cuda`` (``is_available``, ``device_count``,
            ``get_device_properties``, optionally ``get_arch_list``); default imports torch.
        mps_available: whether Apple MPS is usable (default asks torch).
        colab_importable: whether ``google.colab`` exists (default: look it up, no import).
        bitsandbytes_available: whether bitsandbytes is installed (default: look it up).
        workdir: the folder whose disk is measured (default the working directory).

    Returns:
        The frozen :class:`Hardware` description.
    """
    env = os.environ if env is None else env
    if colab_importable is None:
        colab_importable = bool(_safely("colab", lambda: _module_exists("google.colab")))
    if bitsandbytes_available is None:
        bitsandbytes_available = bool(_safely("bnb", lambda: _module_exists("bitsandbytes")))
    ram_total, ram_available = _safely("ram", _read_ram) or (None, None)
    return Hardware(
        platform=detect_platform(env, colab_importable=colab_importable),
        gpus=_safely("cuda", lambda: _read_gpus(cuda)),
        mps=mps_available if mps_available is not None else _safely("mps", _read_mps),
        cpu_cores=_safely("cpu", _read_cpu_cores),
        ram_bytes=ram_total,
        ram_available_bytes=ram_available,
        free_disk_bytes=_safely("disk", lambda: shutil.disk_usage(workdir or os.getcwd()).free),
        bitsandbytes=bitsandbytes_available,
    )


def _safely(name: str, probe: Callable[[], T]) -> T | None:
    """Run one detection probe; a failure is logged at DEBUG and becomes None."""
    try:
        return probe()
    except Exception as exc:  # any failure of one probe must not stop the others
        logger.debug("hardware probe %r failed: %r", name, exc)
        return None


def _module_exists(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _read_gpus(cuda: Any) -> tuple[GPU, ...]:
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available():
        return ()
    arch_list = tuple(getattr(cuda, "get_arch_list", list)())
    gpus = []
    for index in range(cuda.device_count()):
        props = cuda.get_device_properties(index)
        capability = (int(props.major), int(props.minor))
        supported = _build_supports(capability, arch_list)
        gpus.append(GPU(str(props.name), int(props.total_memory), capability, index, supported))
    return tuple(gpus)


def _build_supports(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool | None:
    """Whether a torch build compiled for ``arch_list`` (e.g. ``sm_75``, ``compute_90``) runs here.

    Binary code for sm_XY runs on the same major version with minor >= Y; PTX (compute_XY) is
    compiled on load for any device >= XY. An empty list (CPU build, fake) means unknown.
    """
    if not arch_list:
        return None
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        digits = digits.rstrip("abcdefghijklmnopqrstuvwxyz")  # sm_90a -> 90
        if len(digits) < 2 or not digits.isdigit():
            continue
        built = (int(digits[:-1]), int(digits[-1]))
        if kind == "sm" and built[0] == capability[0] and built[1] <= capability[1]:
            return True
        if kind == "compute" and built <= capability:
            return True
    return False


def _read_mps() -> bool:
    import torch

    return bool(torch.backends.mps.is_available())


def _read_cpu_cores() -> int | None:
    if hasattr(os, "sched_getaffinity"):  # respects taskset/cgroup cpusets (Linux)
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _read_ram(meminfo: str = "/proc/meminfo") -> tuple[int | None, int | None]:
    """(total, available) RAM in bytes: psutil if installed, else /proc/meminfo, else sysconf."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        memory = psutil.virtual_memory()
        return int(memory.total), int(memory.available)
    if os.path.exists(meminfo):
        with open(meminfo, encoding="ascii") as file:
            fields = _parse_meminfo(file.read())
        if "MemTotal" in fields:
            return fields["MemTotal"], fields.get("MemAvailable")
    page = os.sysconf("SC_PAGE_SIZE")
    return page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")


def _parse_meminfo(text: str) -> dict[str, int]:
    """``MemTotal: 16384 kB`` lines of /proc/meminfo as {name: bytes}."""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            fields[name.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    return fields


# --- what a run needs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingNeeds:
    """What one training run asks of a peer; build it with :func:`needs_from_model` or by hand."""

    parameters: int  # trainable parameters, each shared tensor counted once (ALBERT-large: 18M)
    hidden_size: int  # width d of the transformer layers
    num_layers: int  # layers run per forward (a shared layer run 24 times counts 24)
    attention_heads: int  # heads per layer (attention scores cost heads x seq^2 per layer)
    sequence_length: int  # tokens per sample
    vocab_size: int  # output vocabulary (the MLM logits are seq x vocab per sample)
    batch_size_per_step: int  # samples this peer contributes per step (micro x accumulation)
    intermediate_size: int = 0  # FFN width; 0 means 4 x hidden_size
    shared_parameters: int = 0  # of `parameters`, those reused across layers (ALBERT: the layer)
    supports_checkpointing: bool = True  # False for models that refuse it (ALBERT, transformers 5)
    optimizer: str = "lamb"  # adam, adamw, lamb (2 fp32 states per parameter) or sgd (1)

    def __post_init__(self) -> None:
        positive = ("parameters", "hidden_size", "num_layers", "attention_heads")
        for name in (*positive, "sequence_length", "vocab_size", "batch_size_per_step"):
            check_int(f"needs.{name}", getattr(self, name), minimum=1)
        check_int("needs.intermediate_size", self.intermediate_size, minimum=0)
        check_int(
            "needs.shared_parameters",
            self.shared_parameters,
            minimum=0,
            maximum=self.parameters,
            hint="shared parameters are part of `parameters`, counted once",
        )
        check_choice("needs.optimizer", self.optimizer, tuple(OPTIMIZER_STATES))

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def optimizer_states(self) -> int:
        """fp32 state tensors the optimizer keeps per parameter."""
        return OPTIMIZER_STATES[self.optimizer]


def supports_gradient_checkpointing(model: Any) -> bool:
    """Whether a transformers model accepts activation checkpointing.

    transformers 5 raises "AlbertForPreTraining does not support activation checkpointing" when
    asked, and says so up front in the class attribute this reads.
    """
    return bool(getattr(model, "supports_gradient_checkpointing", False))


def needs_from_model(
    model: Any, *, sequence_length: int, batch_size_per_step: int, optimizer: str = "lamb"
) -> TrainingNeeds:
    """Read :class:`TrainingNeeds` off a transformers model (its ``config`` and parameters).

    Shared parameters are found for ALBERT-style configs (``num_hidden_groups`` below
    ``num_hidden_layers``): the parameters of the ``layer_groups`` modules.
    """
    config = model.config
    layers = int(config.num_hidden_layers)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shared = 0
    if int(getattr(config, "num_hidden_groups", layers)) < layers:
        named = model.named_parameters()
        shared = sum(p.numel() for name, p in named if "layer_groups." in name and p.requires_grad)
    return TrainingNeeds(
        parameters=parameters,
        hidden_size=int(config.hidden_size),
        num_layers=layers,
        attention_heads=int(config.num_attention_heads),
        sequence_length=sequence_length,
        vocab_size=int(config.vocab_size),
        batch_size_per_step=batch_size_per_step,
        intermediate_size=int(getattr(config, "intermediate_size", 0) or 0),
        shared_parameters=shared,
        supports_checkpointing=supports_gradient_checkpointing(model),
        optimizer=optimizer,
    )


# --- the analytic memory model ------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training step needs, by kind (the TTT memory calculator's breakdown)."""

    weights: int  # fp32 parameters, plus autocast's 16-bit copy of each weight
    gradients: int  # fp32 gradients
    optimizer: int  # optimizer statistics kept on the device (0 when offloaded)
    activations: int  # saved for backward, for the whole micro-batch
    device_bytes: int  # (sum of the above) x ESTIMATE_OVERHEAD
    host_bytes: int  # CPU RAM for offloaded optimizer: master weights, gradients, statistics


def estimate_memory(
    needs: TrainingNeeds,
    micro_batch: int,
    *,
    precision: str = "fp32",
    optimizer_8bit: bool = False,
    offload: bool = False,
    checkpointing: bool = False,
) -> MemoryEstimate:
    """Estimate the device memory of one forward/backward/optimizer step.

    The breakdown follows the training-transformers-together memory calculator: weights,
    gradients, optimizer statistics (Adam/LAMB: 8 bytes/param in fp32, 2 in 8-bit; offload moves
    them, with a master copy of weights and gradients, to CPU RAM), and activations. Activations
    per layer and sample, in bytes at 16-bit, follow Korthikanti et al. 2022 §4.1 ("Reducing
    Activation Recomputation"), generalised to an FFN of width f: ``18·s·d + 4·s·f + 5·a·s²``
    (34·s·d + 5·a·s² when f = 4d); fp32 doubles it. Checkpointing keeps each layer's 16-bit input
    (2·s·d) and recomputes one layer at a time. The MLM head adds ``s·V`` logits kept in 16/32 bit
    plus an fp32 softmax and its gradient. Sharing (ALBERT) does not change activations: they
    scale with ``num_layers``, weights with ``parameters``.
    """
    half = precision in ("fp16", "bf16")
    element = 2 if half else 4
    s, d, f = needs.sequence_length, needs.hidden_size, needs.ffn_size
    layer = (18 * s * d + 4 * s * f + 5 * needs.attention_heads * s * s) * (element // 2)
    if checkpointing:
        layers = needs.num_layers * 2 * s * d * (element // 2) + layer
    else:
        layers = needs.num_layers * layer
    head = s * needs.vocab_size * (element + 8) + 4 * s * d * element
    p = needs.parameters
    state_bytes = needs.optimizer_states * (1 if optimizer_8bit else 4) * p
    weights = 4 * p + (2 * p if half else 0)
    gradients = 4 * p
    optimizer = 0 if offload else state_bytes
    activations = micro_batch * (layers + head)
    total = weights + gradients + optimizer + activations
    host = (8 * p + state_bytes) if offload else 0
    return MemoryEstimate(
        weights, gradients, optimizer, activations, int(total * ESTIMATE_OVERHEAD), host
    )


def training_flops_per_sample(needs: TrainingNeeds) -> float:
    """FLOPs of one forward+backward per sample (Kaplan et al. 2020 §2.1: 2N + 2·L·s·d forward,
    ~3x that for training), with N from the architecture, so a shared layer counts every time."""
    s, d = needs.sequence_length, needs.hidden_size
    per_token = needs.num_layers * (4 * d * d + 2 * d * needs.ffn_size) + d * needs.vocab_size
    return 6.0 * s * per_token + 6.0 * needs.num_layers * s * s * d


def largest_fitting_batch(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``b`` in [1, limit] with ``fits(b)``, or 0; assumes fits is monotone.

    Doubles from 1 (so powers of two are probed first), then bisects between the last fit and
    the first failure: about 2·log2(limit) calls to ``fits``.
    """
    fit, fail, batch = 0, limit + 1, 1
    while batch <= limit:
        if not fits(batch):
            fail = batch
            break
        fit, batch = batch, batch * 2
    while fail - fit > 1:
        middle = (fit + fail) // 2
        fit, fail = (middle, fail) if fits(middle) else (fit, middle)
    return fit


# --- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingPlan:
    """How this peer trains; ``reasons`` explains every choice to the volunteer."""

    device: str = "cpu"  # torch device: "cuda", "cuda:0" (kit uses one GPU), "mps" or "cpu"
    precision: str = "fp32"  # "bf16" or "fp16" autocast, or "fp32" (no autocast)
    grad_scaler: bool = False  # fp16 only: scale the loss so small gradients don't underflow
    micro_batch: int = 0  # samples per forward/backward (0 for an auxiliary peer)
    accumulation_steps: int = 0  # micro-batches summed per peer step (0 for an auxiliary peer)
    optimizer_8bit: bool = False  # bitsandbytes 8-bit optimizer statistics (2, not 8 bytes/param)
    offload_optimizer: bool = False  # optimizer runs on CPU copies (hivemind offload_optimizer)
    gradient_checkpointing: bool = False  # recompute activations in backward: ~1/3 slower
    auxiliary: bool = False  # only help averaging, compute no gradients (hivemind auxiliary)
    estimated_peak_bytes: int | None = None  # device (RAM on CPU) bytes expected at micro_batch
    memory_source: str = "estimate"  # "probe", "probe+estimate" (calibrated) or "estimate"
    estimated_samples_per_second: float | None = None  # CPU plans: the speed estimate used
    reasons: tuple[str, ...] = ()  # one human-readable line per decision

    @property
    def batch_size_per_step(self) -> int:
        """Samples per peer step: micro_batch x accumulation_steps (>= the target)."""
        return self.micro_batch * self.accumulation_steps


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
) -> TrainingPlan:
    """Decide how this peer trains (see the module docstring for the order of decisions).

    Args:
        needs: what the run asks of a peer.
        hw: what :func:`detect` found.
        probe: ``probe(micro_batch) -> peak_bytes or None`` measuring one forward/backward on
            the GPU (see :func:`make_torch_probe`); without it, or on CPU, memory is estimated.
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
    gpu = _usable_gpu(hw, reasons)
    if gpu is not None:
        device = "cuda" if len(hw.gpus or ()) == 1 else f"cuda:{gpu.index}"
        budget = max_memory_fraction * gpu.total_memory - CUDA_CONTEXT_BYTES
        return _plan_accelerator(needs, hw, device, gpu.capability, budget, probe, reasons)
    if hw.mps:
        ram = hw.ram_bytes or FALLBACK_RAM_BYTES
        budget = max_memory_fraction * MPS_SHARE_OF_RAM * ram
        reasons.append(f"Apple GPU (MPS): up to {_size(budget)} of the shared {_size(ram)} RAM.")
        return _plan_accelerator(needs, hw, "mps", None, budget, probe, reasons)
    return _plan_cpu(needs, hw, max_memory_fraction, min_samples_per_second, reasons)


def _usable_gpu(hw: Hardware, reasons: list[str]) -> GPU | None:
    for gpu in hw.gpus or ():
        sm = "sm_{}{}".format(*gpu.capability)
        if gpu.supported is False:
            reasons.append(
                f"GPU {gpu.index} ({gpu.name}, {sm}) cannot be used: the installed torch was not "
                f"built for {sm} (current CUDA builds dropped it) - help: pick another GPU "
                "runtime (Kaggle: 'GPU T4 x2'), or install an older torch built for it."
            )
            continue
        if gpu.supported is None and gpu.capability < (7, 5):
            reasons.append(
                f"warning: {gpu.name} is {sm}; recent CUDA builds of torch need sm_75 or newer "
                "and may fail on it."
            )
        count = len(hw.gpus or ())
        reasons.append(
            f"training on GPU {gpu.index}: {gpu.name} ({_size(gpu.total_memory)}, {sm})"
            + (f"; kit uses one GPU per peer, {count - 1} more stay idle." if count > 1 else ".")
        )
        return gpu
    return None


def _precision(capability: tuple[int, int] | None, reasons: list[str]) -> tuple[str, bool]:
    if capability is None:
        reasons.append(f"{MPS_PRECISION} on MPS: mixed precision there is not yet reliable.")
        return MPS_PRECISION, False
    sm = "sm_{}{}".format(*capability)
    if capability >= (8, 0):
        reasons.append(f"bf16 autocast: {sm} computes bf16 natively (fp32 range, no loss scaling).")
        return "bf16", False
    reasons.append(
        f"fp16 autocast with a GradScaler: {sm} has no native bf16 (needs sm_80+; torch's "
        "is_bf16_supported() says True only through slow emulation)."
    )
    return "fp16", True


def _plan_accelerator(
    needs: TrainingNeeds,
    hw: Hardware,
    device: str,
    capability: tuple[int, int] | None,
    budget: float,
    probe: MemoryProbe | None,
    reasons: list[str],
) -> TrainingPlan:
    precision, scaler = _precision(capability, reasons)
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
        return largest_fitting_batch(
            lambda b: device_bytes(b, layout) <= budget, needs.batch_size_per_step
        )

    layout = _Layout()
    best = largest(layout)
    goal = min(needs.batch_size_per_step, MIN_USEFUL_MICRO_BATCH)
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
    micro, accumulation = _split_batch(needs.batch_size_per_step, best)
    peak = int(device_bytes(micro, layout))
    reasons.append(
        f"micro-batch {micro} x {accumulation} accumulation step(s) = {micro * accumulation} "
        f"samples per step (target {needs.batch_size_per_step}); up to {best} fit under "
        f"{_size(budget)} ({_SOURCE_WORDS[source]}), "
        f"expected peak {_size(peak)}."
    )
    return TrainingPlan(
        device=device,
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
    if is_cuda and hw.bitsandbytes:
        yield "optimizer_8bit", "8-bit optimizer statistics (bitsandbytes) save GPU memory"
    elif is_cuda:
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


def _split_batch(target: int, largest: int) -> tuple[int, int]:
    """(micro, accumulation) with micro <= largest, the fewest micro-steps, least overshoot."""
    accumulation = -(-target // largest)
    return -(-target // accumulation), accumulation


def _plan_cpu(
    needs: TrainingNeeds,
    hw: Hardware,
    max_memory_fraction: float,
    min_samples_per_second: float,
    reasons: list[str],
) -> TrainingPlan:
    cores = hw.cpu_cores or 1
    speed = cores * CPU_FLOPS_PER_CORE / training_flops_per_sample(needs)
    ram = hw.ram_available_bytes or hw.ram_bytes or FALLBACK_RAM_BYTES
    budget = max_memory_fraction * ram
    limit = min(needs.batch_size_per_step, CPU_MAX_MICRO_BATCH)
    best = largest_fitting_batch(lambda b: estimate_memory(needs, b).device_bytes <= budget, limit)
    reasons.append(
        f"no usable GPU: CPU with {cores} core(s), fp32; estimated {speed:.2f} samples/s."
    )
    if speed < min_samples_per_second or best == 0:
        why = (
            f"{speed:.2f} samples/s is below the {min_samples_per_second:g} samples/s floor"
            if best
            else f"not even one sample fits in {_size(budget)} of RAM"
        )
        reasons.append(
            f"{why}: joining as an auxiliary peer (helps average, computes no gradients) - help: "
            "to train, switch to a GPU runtime (Colab: Runtime > Change runtime type > T4 GPU)."
        )
        return TrainingPlan(
            auxiliary=True, estimated_samples_per_second=speed, reasons=tuple(reasons)
        )
    micro, accumulation = _split_batch(needs.batch_size_per_step, best)
    peak = estimate_memory(needs, micro).device_bytes
    reasons.append(
        f"micro-batch {micro} x {accumulation} accumulation step(s) = {micro * accumulation} "
        f"samples per step (target {needs.batch_size_per_step}); CPU micro-batches stay at "
        f"most {CPU_MAX_MICRO_BATCH}; estimated {_size(peak)} of RAM."
    )
    return TrainingPlan(
        micro_batch=micro,
        accumulation_steps=accumulation,
        estimated_peak_bytes=peak,
        estimated_samples_per_second=speed,
        reasons=tuple(reasons),
    )


_SOURCE_WORDS = {
    "probe": "measured by a probe",
    "probe+estimate": "estimated, calibrated by a probe",
    "estimate": "estimated",
}


def _size(size: float | None) -> str:
    if size is None:
        return "? GiB"
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.0f} MiB"


# --- the torch memory probe ---------------------------------------------------------------------


class TorchMemoryProbe:
    """``probe(micro_batch) -> peak bytes or None``: one real forward/backward at that size.

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
    (weights, gradients, activations, workspaces; not the CUDA context, not optimizer states,
    which :func:`plan` adds). On CPU and MPS there is no peak counter, so the probe counts what
    training keeps: parameters, gradients and every tensor autograd saves for backward (via
    ``torch.autograd.graph.saved_tensors_hooks``); transient buffers are missed (~10-20%).
    Out-of-memory gives None and frees the cache. The probe holds one model on the device:
    call :meth:`close` (or use ``with``) before building the training model.
    """

    def __init__(
        self,
        model_factory: Callable[[], Any],
        needs: TrainingNeeds,
        device: str,
        *,
        precision: str | None = None,
    ) -> None:
        self._factory = model_factory
        self._needs = needs
        self._device = device
        self._precision = precision
        self._model: Any = None

    def __enter__(self) -> TorchMemoryProbe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the model (and, on CUDA, return cached blocks to the driver)."""
        self._model = None
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    def __call__(self, micro_batch: int) -> int | None:
        import torch

        device = torch.device(self._device)
        if self._model is None:
            self._model = self._factory().to(device).train()
            if self._precision is None:
                cuda = device.type == "cuda"
                capability = torch.cuda.get_device_capability(device) if cuda else None
                self._precision = _precision(capability, [])[0] if cuda else "fp32"
        model = self._model
        shape = (micro_batch, self._needs.sequence_length)
        inputs = torch.randint(0, self._needs.vocab_size, shape, device=device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self._precision or "")
        saved: dict[int, int] = {}
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(tensor: Any) -> Any:  # count each storage autograd keeps once
            key = tensor.untyped_storage().data_ptr()
            if key not in params:
                saved[key] = tensor.untyped_storage().nbytes()
            return tensor

        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        logits = loss = None
        try:
            with (
                torch.autocast(device.type, dtype=dtype, enabled=dtype is not None),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            ):
                logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs))[0]
                # Like cross-entropy: a softmax over the vocabulary in fp32.
                loss = logits.float().logsumexp(-1).mean()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                return int(torch.cuda.max_memory_allocated(device))
            tensors = list(model.parameters())
            tensors += [p.grad for p in tensors if p.grad is not None]
            return sum(t.numel() * t.element_size() for t in tensors) + sum(saved.values())
        except (RuntimeError, MemoryError) as exc:  # torch's OutOfMemoryError is a RuntimeError
            # CUDA and MPS say "out of memory"; the CPU allocator "can't allocate memory".
            words = ("out of memory", "can't allocate memory")
            if not isinstance(exc, MemoryError) and not any(w in str(exc) for w in words):
                raise
            logger.debug("memory probe: micro-batch %d does not fit: %s", micro_batch, exc)
            return None
        finally:
            logits = loss = None  # free the activations before handing blocks back
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            elif device.type == "mps":
                torch.mps.empty_cache()


def make_torch_probe(
    model_factory: Callable[[], Any],
    needs: TrainingNeeds,
    device: str,
    *,
    precision: str | None = None,
) -> TorchMemoryProbe:
    """Build a memory probe for :func:`plan` from a model factory.

    Args:
        model_factory: builds the model to train (e.g. ``lambda: AlbertForPreTraining(config)``);
            called once, on the first probe. Its first output must be the logits.
        needs: gives the sequence length and the vocabulary for random inputs.
        device: where to measure, e.g. ``"cuda"``.
        precision: autocast dtype to probe with; default the one :func:`plan` picks for the
            device ("bf16" on sm_80+, "fp16" below, "fp32" elsewhere).

    Returns:
        A :class:`TorchMemoryProbe`; ``probe(micro_batch)`` gives peak bytes or None on OOM.
    """
    return TorchMemoryProbe(model_factory, needs, device, precision=precision)

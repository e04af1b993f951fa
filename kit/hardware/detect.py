"""What machine this is: platform (Colab/Kaggle/Binder/local), accelerators, CPU, RAM, disk.

Every probe is fault-tolerant: a failing probe yields None and a debug line, never an exception.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)


GIB = 1024**3
#: fp32 state tensors per parameter for each optimizer kind (Adam/AdamW/LAMB keep m and v).
#: "lamb8bit" keeps the same two, in 8 bits (kit.training.lamb8bit).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "lamb": 2, "lamb8bit": 2, "sgd": 1}
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

#: The largest micro-batch a plan tries on a GPU: past it, GPU kernels run no faster per sample.
ACCELERATOR_MAX_MICRO_BATCH = 256
#: The largest micro-batch a speed probe tries on a CPU.
CPU_SPEED_PROBE_MAX_MICRO_BATCH = 64
#: A local step is at most this share of the global batch (1/8): peers overshoot the target
#: by up to one local step each, and a step of half the global batch would double it.
GLOBAL_BATCH_SHARE = 8
#: Seconds a plan may spend measuring the speed of micro-batches (after the memory probe).
SPEED_PROBE_SECONDS = 20.0
#: A larger micro-batch is taken only if it is this much faster (else the smaller one, which
#: leaves memory free and reports to the collaboration more often).
SPEED_MARGIN = 1.02

T = TypeVar("T")
#: A memory probe: peak device bytes of one forward/backward at this micro-batch, None on OOM.
MemoryProbe = Callable[[int], "int | None"]
#: A speed probe: training samples/s at this micro-batch; None when it does not fit or the
#: probe's time is spent.
SpeedProbe = Callable[[int], "float | None"]


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


def _size(size: float | None) -> str:
    """A byte count for people: "15.0 GiB" or "512 MiB"."""
    if size is None:
        return "? GiB"
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.0f} MiB"

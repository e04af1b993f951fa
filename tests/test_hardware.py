"""Tests for kit.hardware: platform and device detection with injected fakes, and training plans
for simulated GPUs (no GPU here), with fake memory probes and one real CPU probe."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit.errors import ConfigError
from kit.hardware import (
    GPU,
    Hardware,
    Platform,
    TrainingNeeds,
    detect,
    detect_platform,
    estimate_memory,
    largest_fitting_batch,
    make_torch_probe,
    needs_from_model,
    plan,
    supports_gradient_checkpointing,
)
from kit.hardware.detect import (
    CPU_MAX_MICRO_BATCH,
    CUDA_CONTEXT_BYTES,
    MIN_USEFUL_MICRO_BATCH,
    _build_supports,
    _parse_meminfo,
    _read_ram,
)

GIB = 1024**3
#: A current CUDA 12.8 build: no Pascal (sm_60) and no Volta (sm_70) kernels.
CU128_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")
#: An older CUDA 12.6 build that still ships Volta kernels.
CU126_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")

# sahajBERT: ALBERT-large shapes, one layer shared by 24, seq 512, 4 x 2 samples per step.
ALBERT_LARGE = TrainingNeeds(
    parameters=18_000_000,
    hidden_size=1024,
    num_layers=24,
    attention_heads=16,
    sequence_length=512,
    vocab_size=32_000,
    batch_size_per_step=8,
    shared_parameters=12_600_000,
    supports_checkpointing=False,
)
# An unshared BERT-large-like model: its optimizer state alone crowds a 6 GB GPU.
BERT_LARGE = TrainingNeeds(
    parameters=335_000_000,
    hidden_size=1024,
    num_layers=24,
    attention_heads=16,
    sequence_length=128,
    vocab_size=30_000,
    batch_size_per_step=32,
    optimizer="lamb",
)
TINY = TrainingNeeds(
    parameters=100_000,
    hidden_size=32,
    num_layers=1,
    attention_heads=2,
    sequence_length=128,
    vocab_size=1000,
    batch_size_per_step=16,
)


def one_gpu(name: str, memory: int, capability: tuple[int, int], **hw: object) -> Hardware:
    gpu = GPU(name, memory, capability, supported=hw.pop("supported", True))  # type: ignore[arg-type]
    defaults: dict[str, object] = {"cpu_cores": 2, "ram_bytes": 13 * GIB}
    return Hardware(gpus=(gpu,), **{**defaults, **hw})  # type: ignore[arg-type]


def budget_of(hw: Hardware, fraction: float = 0.9) -> float:
    assert hw.gpus
    return fraction * hw.gpus[0].total_memory - CUDA_CONTEXT_BYTES


class FakeCuda:
    """Shaped like ``torch.cuda`` for detect(): devices as (name, bytes, major, minor)."""

    def __init__(self, devices: list[tuple[str, int, int, int]], archs: tuple[str, ...] = ()):
        self.devices = devices
        self.archs = archs

    def is_available(self) -> bool:
        return bool(self.devices)

    def device_count(self) -> int:
        return len(self.devices)

    def get_device_properties(self, index: int) -> SimpleNamespace:
        name, memory, major, minor = self.devices[index]
        return SimpleNamespace(name=name, total_memory=memory, major=major, minor=minor)

    def get_arch_list(self) -> list[str]:
        return list(self.archs)


class LinearProbe:
    """Peak memory a + b * micro_batch; out of memory (None) above ``capacity`` bytes."""

    def __init__(self, a: float, b: float, capacity: float = math.inf) -> None:
        self.a, self.b, self.capacity = a, b, capacity
        self.calls: list[int] = []

    def __call__(self, micro_batch: int) -> int | None:
        self.calls.append(micro_batch)
        peak = self.a + self.b * micro_batch
        return None if peak > self.capacity else int(peak)


# --- detection ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "colab", "expected"),
    [
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "COLAB_RELEASE_TAG": "x"}, False, "kaggle"),
        ({"KAGGLE_URL_BASE": "https://www.kaggle.com"}, True, "kaggle"),
        ({"COLAB_RELEASE_TAG": "release-colab_20260801"}, False, "colab"),
        ({}, True, "colab"),
        ({"BINDER_REPO_URL": "https://github.com/x/y"}, False, "binder"),
        ({"BINDER_LAUNCH_HOST": "https://mybinder.org/"}, False, "binder"),
        ({"BINDER_REQUEST": "v2/gh/x/y/main"}, False, "binder"),
        ({"HOME": "/root"}, False, "local"),
    ],
)
def test_detect_platform(env: dict[str, str], colab: bool, expected: str) -> None:
    assert detect_platform(env, colab_importable=colab) is Platform(expected)
    hw = detect(env=env, cuda=FakeCuda([]), mps_available=False, colab_importable=colab)
    assert hw.platform is Platform(expected)


def test_detect_reads_injected_cuda(tmp_path: object) -> None:
    cuda = FakeCuda([("Tesla T4", 15_828_320_256, 7, 5), ("Tesla T4", 15_828_320_256, 7, 5)])
    cuda.archs = CU128_ARCHS
    hw = detect(env={}, cuda=cuda, mps_available=False, colab_importable=False, workdir=tmp_path)  # type: ignore[arg-type]
    assert hw.gpus == (
        GPU("Tesla T4", 15_828_320_256, (7, 5), 0, True),
        GPU("Tesla T4", 15_828_320_256, (7, 5), 1, True),
    )
    assert hw.accelerator == "cuda"
    assert hw.cpu_cores is not None and hw.cpu_cores >= 1
    assert hw.ram_bytes is not None and hw.ram_bytes > 0
    assert hw.free_disk_bytes is not None and hw.free_disk_bytes > 0
    assert "Tesla T4 (14.7 GiB, sm_75)" in hw.describe()


def test_detect_marks_gpus_the_torch_build_cannot_run() -> None:
    cuda = FakeCuda([("Tesla P100-PCIE-16GB", 17 * 10**9, 6, 0)], archs=CU128_ARCHS)
    hw = detect(env={}, cuda=cuda, mps_available=False, colab_importable=False)
    assert hw.gpus is not None and hw.gpus[0].supported is False


def test_a_failing_probe_gives_none_and_a_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenCuda(FakeCuda):
        def device_count(self) -> int:
            raise RuntimeError("CUDA driver initialization failed")

    with caplog.at_level(logging.DEBUG, logger="kit.hardware"):
        hw = detect(env={}, cuda=BrokenCuda([("x", 1, 8, 0)]), mps_available=False)
    assert hw.gpus is None
    assert hw.accelerator == "cpu"
    assert hw.cpu_cores is not None  # the other probes still ran
    assert any("driver initialization" in record.getMessage() for record in caplog.records)
    assert "cpu" in plan(TINY, hw).device


def test_detect_with_no_gpu_and_mps() -> None:
    hw = detect(env={}, cuda=FakeCuda([]), mps_available=True, colab_importable=False)
    assert hw.gpus == ()
    assert hw.accelerator == "mps"


@pytest.mark.parametrize(
    ("capability", "archs", "expected"),
    [
        ((7, 5), CU128_ARCHS, True),
        ((8, 6), ("sm_80",), True),  # sm_80 binaries run on sm_86
        ((8, 9), ("sm_80", "sm_90a"), True),
        ((7, 0), CU128_ARCHS, False),  # V100 on a CUDA 12.8 build
        ((7, 0), CU126_ARCHS, True),
        ((6, 0), CU128_ARCHS, False),  # Kaggle's P100
        ((12, 1), ("sm_90", "compute_90"), True),  # PTX compiles for newer GPUs
        ((8, 0), ("sm_90",), False),
        ((7, 5), (), None),  # a CPU build or a fake: unknown
    ],
)
def test_build_supports(
    capability: tuple[int, int], archs: tuple[str, ...], expected: bool | None
) -> None:
    assert _build_supports(capability, archs) is expected


def test_ram_falls_back_to_meminfo_then_sysconf(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    meminfo = tmp_path / "meminfo"  # type: ignore[operator]
    meminfo.write_text("MemTotal:       16384 kB\nMemFree: 100 kB\nMemAvailable:    8192 kB\n")
    assert _read_ram(str(meminfo)) == (16384 * 1024, 8192 * 1024)
    total, available = _read_ram(str(tmp_path / "missing"))  # type: ignore[operator]
    assert total is not None and available is not None and 0 < available <= total
    assert _parse_meminfo("HugePages_Total:       0\nbad line\n") == {"HugePages_Total": 0}


# --- precision and device table -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "memory", "capability", "precision"),
    [
        ("Tesla T4", 16 * GIB, (7, 5), "fp16"),
        ("Tesla V100-SXM2-16GB", 16 * GIB, (7, 0), "fp16"),
        ("Tesla V100-SXM2-32GB", 32 * GIB, (7, 0), "fp16"),
        ("A100-SXM4-40GB", 40 * GIB, (8, 0), "bf16"),
        ("A100-SXM4-80GB", 80 * GIB, (8, 0), "bf16"),
        ("NVIDIA GeForce RTX 3090", 24 * GIB, (8, 6), "bf16"),
    ],
)
def test_gpu_precision_and_batch(
    name: str, memory: int, capability: tuple[int, int], precision: str
) -> None:
    hw = one_gpu(name, memory, capability)
    result = plan(ALBERT_LARGE, hw)
    assert (result.device, result.precision) == ("cuda", precision)
    assert result.grad_scaler is (precision == "fp16")  # GradScaler only for fp16
    assert not result.auxiliary and not result.gradient_checkpointing  # ALBERT refuses it
    assert result.batch_size_per_step >= ALBERT_LARGE.batch_size_per_step
    assert result.estimated_peak_bytes is not None
    assert result.estimated_peak_bytes <= budget_of(hw)
    assert result.memory_source == "estimate"
    assert any(precision in line for line in result.reasons)


def test_more_gpu_memory_never_gives_a_smaller_micro_batch() -> None:
    needs = TrainingNeeds(
        **{**BERT_LARGE.__dict__, "sequence_length": 512, "batch_size_per_step": 256}
    )
    micro = [plan(needs, one_gpu("x", gib * GIB, (8, 0))).micro_batch for gib in (16, 24, 40, 80)]
    assert micro == sorted(micro) and micro[0] < micro[-1]


def test_p100_is_refused_by_current_builds_with_a_reason() -> None:
    hw = one_gpu("Tesla P100-PCIE-16GB", 16 * GIB, (6, 0), supported=False, cpu_cores=4)
    result = plan(ALBERT_LARGE, hw)
    assert result.device == "cpu" and result.auxiliary
    assert any("sm_60" in line and "help:" in line for line in result.reasons)
    tiny = plan(TINY, hw)  # a tiny model still trains, on the CPU
    assert (tiny.device, tiny.precision, tiny.auxiliary) == ("cpu", "fp32", False)


def test_p100_with_an_unknown_build_is_used_with_a_warning() -> None:
    result = plan(ALBERT_LARGE, one_gpu("Tesla P100", 16 * GIB, (6, 0), supported=None))
    assert (result.device, result.precision, result.grad_scaler) == ("cuda", "fp16", True)
    assert any(line.startswith("warning:") and "sm_60" in line for line in result.reasons)


def test_several_gpus_use_the_first_usable_one() -> None:
    t4 = GPU("Tesla T4", 16 * GIB, (7, 5), 0, True)
    p100 = GPU("Tesla P100", 16 * GIB, (6, 0), 0, False)
    assert plan(TINY, Hardware(gpus=(t4, GPU("Tesla T4", 16 * GIB, (7, 5), 1, True)))).device == (
        "cuda:0"
    )
    t4_second = GPU("Tesla T4", 16 * GIB, (7, 5), 1, True)
    assert plan(TINY, Hardware(gpus=(p100, t4_second))).device == "cuda:1"
    assert plan(TINY, Hardware(gpus=(t4,))).device == "cuda"


# --- memory savers on small GPUs ----------------------------------------------------------------


def test_6gb_laptop_gpu_uses_8bit_and_offload_when_short() -> None:
    hw = one_gpu("NVIDIA GeForce RTX 2060", 6 * GIB, (7, 5), bitsandbytes=True, ram_bytes=16 * GIB)
    budget = budget_of(hw)
    goal = MIN_USEFUL_MICRO_BATCH
    # The premise: with fp32 optimizer statistics on the GPU, not even one sample fits.
    assert estimate_memory(BERT_LARGE, 1, precision="fp16").device_bytes > budget
    # kit builds 8-bit statistics for LAMB only (kit.training.lamb8bit): an Adam run never
    # gets them, however short the GPU is.
    adam = plan(dataclasses.replace(BERT_LARGE, optimizer="adam"), hw)
    assert not adam.optimizer_8bit and adam.offload_optimizer
    result = plan(BERT_LARGE, hw)
    assert result.precision == "fp16" and result.grad_scaler
    assert result.optimizer_8bit and result.offload_optimizer
    assert 1 <= result.micro_batch <= goal
    used = estimate_memory(
        BERT_LARGE, result.micro_batch, precision="fp16", optimizer_8bit=True, offload=True
    )
    assert used.device_bytes <= budget
    assert result.batch_size_per_step >= BERT_LARGE.batch_size_per_step


def test_without_bitsandbytes_only_offload() -> None:
    hw = one_gpu("NVIDIA GeForce RTX 2060", 6 * GIB, (7, 5), ram_bytes=16 * GIB)
    result = plan(BERT_LARGE, hw)
    assert not result.optimizer_8bit and result.offload_optimizer
    assert any("pip install bitsandbytes" in line for line in result.reasons)


def test_offload_needs_enough_ram() -> None:
    hw = one_gpu("NVIDIA GeForce RTX 2060", 6 * GIB, (7, 5), bitsandbytes=True, ram_bytes=2 * GIB)
    result = plan(BERT_LARGE, hw)
    assert result.optimizer_8bit and not result.offload_optimizer
    assert any("optimizer offload needs" in line for line in result.reasons)


def test_no_memory_saver_when_the_gpu_is_roomy() -> None:
    result = plan(BERT_LARGE, one_gpu("A100", 80 * GIB, (8, 0), bitsandbytes=True))
    assert not (result.optimizer_8bit or result.offload_optimizer or result.gradient_checkpointing)


def test_checkpointing_only_when_supported_and_needed() -> None:
    long = {**BERT_LARGE.__dict__, "parameters": 30_000_000, "sequence_length": 2048}
    hw = one_gpu("Tesla T4", 16 * GIB, (7, 5))
    assert plan(TrainingNeeds(**long), hw).gradient_checkpointing
    refused = plan(TrainingNeeds(**{**long, "supports_checkpointing": False}), hw)
    assert not refused.gradient_checkpointing
    assert any("refuses" in line for line in refused.reasons)
    assert not plan(TrainingNeeds(**{**long, "sequence_length": 128}), hw).gradient_checkpointing


def test_a_gpu_too_small_for_one_sample_becomes_auxiliary() -> None:
    result = plan(BERT_LARGE, one_gpu("GT 1030", 2 * GIB, (7, 5), ram_bytes=GIB))
    assert result.auxiliary and result.micro_batch == 0 and result.accumulation_steps == 0
    assert any("auxiliary" in line and "help:" in line for line in result.reasons)


def test_mps_is_fp32_and_never_8bit_or_offload() -> None:
    needs = TrainingNeeds(**{**BERT_LARGE.__dict__, "sequence_length": 512})
    hw = Hardware(mps=True, cpu_cores=8, ram_bytes=16 * GIB, bitsandbytes=True)
    result = plan(needs, hw)
    assert (result.device, result.precision, result.grad_scaler) == ("mps", "fp32", False)
    assert not result.optimizer_8bit and not result.offload_optimizer
    assert result.gradient_checkpointing  # memory was short, and only this saver works on MPS
    assert not result.auxiliary and result.batch_size_per_step >= needs.batch_size_per_step
    # A CUDA GPU of the same size would have used the 8-bit optimizer for the same run.
    cuda = plan(needs, one_gpu("x", int(0.66 * 16 * GIB), (7, 5), bitsandbytes=True))
    assert cuda.optimizer_8bit


# --- CPU and auxiliary peers --------------------------------------------------------------------


def test_cpu_only_large_model_is_auxiliary() -> None:
    result = plan(ALBERT_LARGE, Hardware(cpu_cores=2, ram_bytes=12 * GIB))
    assert result.auxiliary and result.device == "cpu"
    assert result.estimated_samples_per_second is not None
    assert result.estimated_samples_per_second < 1.0
    assert any("auxiliary" in line for line in result.reasons)
    # The floor is a knob: without it the same machine trains, slowly.
    slow = plan(ALBERT_LARGE, Hardware(cpu_cores=2, ram_bytes=12 * GIB), min_samples_per_second=0)
    assert not slow.auxiliary and slow.micro_batch >= 1


def test_cpu_only_tiny_model_trains_fp32_with_small_micro_batches() -> None:
    result = plan(TINY, Hardware(cpu_cores=2, ram_bytes=12 * GIB))
    assert (result.device, result.precision, result.auxiliary) == ("cpu", "fp32", False)
    assert 1 <= result.micro_batch <= CPU_MAX_MICRO_BATCH
    assert result.batch_size_per_step >= TINY.batch_size_per_step
    assert not (result.optimizer_8bit or result.offload_optimizer or result.gradient_checkpointing)


def test_more_cores_estimate_more_speed() -> None:
    two = plan(TINY, Hardware(cpu_cores=2)).estimated_samples_per_second
    eight = plan(TINY, Hardware(cpu_cores=8)).estimated_samples_per_second
    assert two is not None and eight is not None and eight == pytest.approx(4 * two)


# --- the memory probe and the search ------------------------------------------------------------


@given(fit_up_to=st.integers(0, 300), limit=st.integers(1, 256))
def test_largest_fitting_batch(fit_up_to: int, limit: int) -> None:
    calls: list[int] = []

    def fits(batch: int) -> bool:
        calls.append(batch)
        return batch <= fit_up_to

    assert largest_fitting_batch(fits, limit) == min(fit_up_to, limit)
    assert max(calls) <= limit
    assert len(calls) <= 2 * math.log2(limit) + 2


@pytest.mark.parametrize("target", [1, 7, 8, 24, 100, 4096])
def test_probe_binary_search_and_accumulation(target: int) -> None:
    hw = one_gpu("Tesla T4", 16 * GIB, (7, 5))
    needs = TrainingNeeds(**{**ALBERT_LARGE.__dict__, "batch_size_per_step": target})
    probe = LinearProbe(a=1.5 * GIB, b=0.7 * GIB)
    result = plan(needs, hw, probe=probe)
    optimizer = estimate_memory(needs, 1).optimizer
    largest = max(
        b for b in range(1, target + 1) if probe.a + probe.b * b + optimizer <= budget_of(hw)
    )
    assert result.memory_source == "probe"
    assert max(probe.calls) <= target
    assert len(set(probe.calls)) <= 2 * math.log2(target) + 2
    # Fewest micro-steps, then the smallest micro-batch that still reaches the target.
    assert result.accumulation_steps == math.ceil(target / largest)
    assert result.micro_batch <= largest
    assert target <= result.batch_size_per_step < target + result.accumulation_steps
    assert result.estimated_peak_bytes == int(probe.a + probe.b * result.micro_batch) + optimizer


def test_probe_out_of_memory_counts_as_not_fitting() -> None:
    hw = one_gpu("Tesla T4", 16 * GIB, (7, 5))
    needs = TrainingNeeds(**{**ALBERT_LARGE.__dict__, "batch_size_per_step": 64})
    result = plan(needs, hw, probe=LinearProbe(a=GIB, b=0.25 * GIB, capacity=4 * GIB))
    assert result.micro_batch * result.accumulation_steps >= 64
    assert result.micro_batch <= 12  # 1 + 0.25 * 12 = 4 GiB: above that the probe OOMs


def test_lower_memory_fraction_gives_smaller_micro_batches() -> None:
    hw = one_gpu("Tesla T4", 16 * GIB, (7, 5))
    needs = TrainingNeeds(**{**ALBERT_LARGE.__dict__, "batch_size_per_step": 1024})
    micro = [
        plan(needs, hw, probe=LinearProbe(GIB, 0.1 * GIB), max_memory_fraction=f).micro_batch
        for f in (0.5, 0.7, 0.9)
    ]
    assert micro == sorted(micro) and micro[0] < micro[-1]


def test_probe_calibrates_checkpointing_estimate() -> None:
    needs = TrainingNeeds(
        **{**BERT_LARGE.__dict__, "parameters": 30_000_000, "sequence_length": 2048}
    )
    probe = LinearProbe(a=GIB, b=6 * GIB)  # two samples fit without checkpointing
    result = plan(needs, one_gpu("Tesla T4", 16 * GIB, (7, 5)), probe=probe)
    assert result.gradient_checkpointing and result.memory_source == "probe+estimate"
    assert result.micro_batch > 2


def test_bad_inputs_raise_config_errors_with_help() -> None:
    with pytest.raises(ConfigError, match="help:"):
        TrainingNeeds(**{**TINY.__dict__, "optimizer": "adagrad"})
    with pytest.raises(ConfigError, match="shared_parameters"):
        TrainingNeeds(**{**TINY.__dict__, "shared_parameters": TINY.parameters + 1})
    with pytest.raises(ConfigError, match="batch_size_per_step"):
        TrainingNeeds(**{**TINY.__dict__, "batch_size_per_step": 0})
    with pytest.raises(ConfigError, match="max_memory_fraction"):
        plan(TINY, Hardware(), max_memory_fraction=1.5)


# --- real torch models on the CPU ---------------------------------------------------------------


def tiny_albert(layers: int = 1) -> object:
    from transformers import AlbertConfig, AlbertForPreTraining

    config = AlbertConfig(
        vocab_size=500,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
    )
    return AlbertForPreTraining(config)


def test_albert_refuses_checkpointing_and_shares_its_layer() -> None:
    from transformers import BertConfig, BertForMaskedLM

    albert = tiny_albert(layers=3)
    assert not supports_gradient_checkpointing(albert)
    bert = BertForMaskedLM(
        BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    assert supports_gradient_checkpointing(bert)
    needs = needs_from_model(albert, sequence_length=64, batch_size_per_step=8)
    layer = sum(p.numel() for n, p in albert.named_parameters() if "albert_layer_groups" in n)  # type: ignore[attr-defined]
    assert (needs.num_layers, needs.shared_parameters) == (3, layer)
    assert needs.parameters == sum(p.numel() for p in albert.parameters())  # type: ignore[attr-defined]
    assert not needs.supports_checkpointing


def test_torch_probe_measures_a_real_forward_backward_on_cpu() -> None:
    import torch

    torch.manual_seed(0)
    needs = needs_from_model(tiny_albert(), sequence_length=64, batch_size_per_step=8)
    with make_torch_probe(tiny_albert, needs, "cpu") as probe:
        peaks = {batch: probe(batch) for batch in (1, 2, 4)}
    weights_and_grads = 2 * 4 * needs.parameters
    assert all(peak is not None for peak in peaks.values())
    one, two, four = peaks[1], peaks[2], peaks[4]
    assert one is not None and two is not None and four is not None
    assert weights_and_grads < one < two < four
    # Saved activations grow linearly with the micro-batch, from zero: weights that autograd
    # saves for backward are counted once, as weights, not again as activations.
    assert four - two == pytest.approx(2 * (two - one), rel=0.1)
    assert one - weights_and_grads == pytest.approx(two - one, rel=0.1)
    # The analytic estimate stays on the safe side of the measurement.
    for batch, peak in peaks.items():
        estimate = estimate_memory(needs, batch)
        assert estimate.device_bytes - estimate.optimizer > peak  # type: ignore[operator]


def test_torch_probe_turns_out_of_memory_into_none_and_raises_other_errors() -> None:
    import torch

    class Picky(torch.nn.Module):
        """Embeds tokens; fails like an allocator above two samples, or like a bug at seven."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(TINY.vocab_size, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
            if input_ids.shape[0] == 7:
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
            if input_ids.shape[0] > 2:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return (self.embed(input_ids),)

    with make_torch_probe(Picky, TINY, "cpu") as probe:
        assert probe(2) is not None
        assert probe(3) is None
        assert probe(1) is not None  # the probe still works after an OOM
        with pytest.raises(RuntimeError, match="shapes"):
            probe(7)


# --- the micro-batch by speed -------------------------------------------------------------------


class CurveSpeed:
    """samples/s by micro-batch from a table (sizes not in it run as fast as the largest below)."""

    def __init__(self, rates: dict[int, float], stop_above: int = 10**9) -> None:
        self.rates, self.stop_above = rates, stop_above
        self.calls: list[int] = []

    def __call__(self, micro_batch: int) -> float | None:
        self.calls.append(micro_batch)
        if micro_batch > self.stop_above:
            return None  # out of memory, or the probe's time is spent
        return self.rates[max(size for size in self.rates if size <= micro_batch)]


def test_a_speed_probe_picks_the_fastest_micro_batch_past_batch_size_per_step() -> None:
    needs = dataclasses.replace(ALBERT_LARGE, batch_size_per_step=8, target_batch_size=4096)
    hw = one_gpu("NVIDIA H200", 140 * GIB, (9, 0))
    speed = CurveSpeed({1: 20.0, 2: 40.0, 4: 70.0, 8: 110.0, 16: 150.0, 32: 180.0, 64: 181.0})
    result = plan(needs, hw, probe=LinearProbe(GIB, 0.5 * GIB), speed=speed)
    # 64 is not 2% faster than 32: the smaller one leaves memory free.
    assert (result.micro_batch, result.accumulation_steps) == (32, 1)
    assert result.batch_size_per_step == 32 > needs.batch_size_per_step
    assert any("fastest measured" in reason and "32: 180.0" in reason for reason in result.reasons)
    assert max(speed.calls) <= 256  # never past what the memory probe says fits


def test_a_speed_probe_accumulates_up_to_batch_size_per_step_and_respects_the_global_batch() -> (
    None
):
    hw = one_gpu("Tesla T4", 15 * GIB, (7, 5))
    needs = dataclasses.replace(ALBERT_LARGE, batch_size_per_step=64, target_batch_size=4096)
    fast_small = CurveSpeed({1: 10.0, 2: 30.0, 4: 30.5})
    result = plan(needs, hw, probe=LinearProbe(GIB, 0.5 * GIB), speed=fast_small)
    assert (result.micro_batch, result.accumulation_steps) == (2, 32)
    # A local step stays within 1/8 of the global batch (peers overshoot it by a step each).
    tiny_run = dataclasses.replace(needs, batch_size_per_step=2, target_batch_size=48)
    growing = CurveSpeed({1: 10.0, 2: 20.0, 4: 40.0, 6: 60.0, 8: 80.0})
    result = plan(
        tiny_run, one_gpu("x", 80 * GIB, (8, 0)), probe=LinearProbe(GIB, GIB), speed=growing
    )
    assert result.micro_batch == 6 and max(growing.calls) == 6


def test_a_speed_probe_that_runs_out_stops_the_search() -> None:
    needs = dataclasses.replace(ALBERT_LARGE, batch_size_per_step=8, target_batch_size=4096)
    speed = CurveSpeed({1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0}, stop_above=4)
    result = plan(needs, one_gpu("x", 80 * GIB, (8, 0)), probe=LinearProbe(GIB, GIB), speed=speed)
    assert result.micro_batch == 4 and speed.calls == [1, 2, 4, 8]
    nothing = CurveSpeed({1: 1.0}, stop_above=0)  # nothing measured: the largest that fits
    result = plan(needs, one_gpu("x", 80 * GIB, (8, 0)), probe=LinearProbe(GIB, GIB), speed=nothing)
    assert result.micro_batch > 8 and nothing.calls == [1]  # all that fits (70 GiB / 1 GiB)


def test_a_cpu_speed_probe_picks_the_fastest_under_the_ram_estimate() -> None:
    needs = dataclasses.replace(TINY, batch_size_per_step=16, target_batch_size=64)
    hw = Hardware(cpu_cores=2, ram_bytes=8 * GIB)
    speed = CurveSpeed({1: 50.0, 4: 200.0, 16: 260.0, 32: 262.0})
    result = plan(needs, hw, speed=speed)
    assert (result.micro_batch, result.accumulation_steps) == (16, 1)
    assert max(speed.calls) <= 64


def test_torch_probe_measures_the_speed_of_training_within_its_time_budget() -> None:
    import torch

    torch.manual_seed(0)
    needs = needs_from_model(tiny_albert(), sequence_length=64, batch_size_per_step=8)
    with make_torch_probe(tiny_albert, needs, "cpu") as probe:
        rate = probe.samples_per_second(2)
        assert rate is not None and rate > 0
        assert probe.time_spent > 0
        probe.time_budget = probe.time_spent  # spent: larger sizes are not measured
        assert probe.samples_per_second(4) is None

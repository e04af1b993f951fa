"""What a run needs and what it costs: TrainingNeeds, the analytic memory model, and the torch
memory probe that measures a real forward/backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kit.config import check_choice, check_int
from kit.hardware.detect import (
    ESTIMATE_OVERHEAD,
    MPS_PRECISION,
    OPTIMIZER_STATES,
    SPEED_PROBE_SECONDS,
)

logger = logging.getLogger(__name__)


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
    optimizer: str = (
        "lamb"  # adam, adamw, lamb (2 fp32 states per parameter), lamb8bit (2 in 8 bits) or sgd (1)
    )
    target_batch_size: int = (
        0  # samples per global step (micro-batches never exceed it); 0: unknown
    )

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
        check_int("needs.target_batch_size", self.target_batch_size, minimum=0)

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
    model: Any,
    *,
    sequence_length: int,
    batch_size_per_step: int,
    optimizer: str = "lamb",
    supports_checkpointing: bool | None = None,
    target_batch_size: int = 0,
) -> TrainingNeeds:
    """Read :class:`TrainingNeeds` off a transformers model (its ``config`` and parameters).

    Shared parameters are found for ALBERT-style configs (``num_hidden_groups`` below
    ``num_hidden_layers``): the parameters of the ``layer_groups`` modules.
    ``supports_checkpointing``: whether the trainer can checkpoint this model (kit checkpoints
    ALBERT itself, ``kit.training.checkpointing``); None = ask transformers.
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
        supports_checkpointing=supports_gradient_checkpointing(model)
        if supports_checkpointing is None
        else supports_checkpointing,
        optimizer=optimizer,
        target_batch_size=target_batch_size,
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
    # 8-bit statistics: 1 byte per state and parameter; the fp32 scale per 4096-element block
    # and the fp32 statistics of small tensors (biases, norms) add ~1% on transformers.
    eight_bit = optimizer_8bit or needs.optimizer == "lamb8bit"
    state_bytes = needs.optimizer_states * (1 if eight_bit else 4) * p
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


# --- the torch memory probe ---------------------------------------------------------------------


class TorchMemoryProbe:
    """``probe(micro_batch) -> peak bytes or None``: one real forward/backward at that size; and
    :meth:`samples_per_second`, the speed of training at that size.

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
    (weights, gradients, activations, workspaces; not the CUDA context, not optimizer states,
    which :func:`plan` adds). On CPU and MPS there is no peak counter, so the probe counts what
    training keeps: parameters, gradients and every tensor autograd saves for backward (via
    ``torch.autograd.graph.saved_tensors_hooks``); transient buffers are missed (~10-20%).
    Out-of-memory gives None and frees the cache. The probe holds one model on the device:
    call :meth:`close` (or use ``with``) before building the training model.

    With ``batch`` and ``loss`` it runs what training runs (e.g. kit's ALBERT pretraining loss,
    which computes the MLM head only where a token is masked); without them, the model's logits
    and a softmax over the vocabulary in fp32, as a cross-entropy would.
    """

    def __init__(
        self,
        model_factory: Callable[[], Any],
        needs: TrainingNeeds,
        device: str,
        *,
        precision: str | None = None,
        batch: Callable[[int], dict[str, Any]] | None = None,
        loss: Callable[[Any, dict[str, Any], Any], Any] | None = None,
        time_budget: float = SPEED_PROBE_SECONDS,
    ) -> None:
        self._factory = model_factory
        self._needs = needs
        self._device = device
        self._precision = precision
        self._batch = batch
        self._loss = loss
        self._model: Any = None
        self.time_budget = time_budget  # seconds samples_per_second may spend in all
        self.time_spent = 0.0

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

    def _ready_model(self) -> Any:
        import torch

        device = torch.device(self._device)
        if self._model is None:
            self._model = self._factory().to(device).train()
            if self._precision is None:
                cuda = device.type == "cuda"
                capability = torch.cuda.get_device_capability(device) if cuda else None
                self._precision = _precision(capability, [])[0] if cuda else "fp32"
        return self._model

    def _forward_backward(self, model: Any, micro_batch: int, hooks: Any) -> None:
        """One training forward/backward at ``micro_batch`` (``hooks``: saved-tensor hooks)."""
        import torch

        device = torch.device(self._device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self._precision or "")
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None), hooks:
            if self._batch is not None and self._loss is not None:
                loss = self._loss(model, self._batch(micro_batch), device)
            else:
                shape = (micro_batch, self._needs.sequence_length)
                inputs = torch.randint(0, self._needs.vocab_size, shape, device=device)
                logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs))[0]
                # Like cross-entropy: a softmax over the vocabulary in fp32.
                loss = logits.float().logsumexp(-1).mean()
        loss.backward()

    def __call__(self, micro_batch: int) -> int | None:
        import contextlib

        import torch

        model = self._ready_model()
        device = torch.device(self._device)
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
        hooks: Any = (
            contextlib.nullcontext()
            if device.type == "cuda"
            else torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        )
        try:
            self._forward_backward(model, micro_batch, hooks)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                return int(torch.cuda.max_memory_allocated(device))
            tensors = list(model.parameters())
            tensors += [p.grad for p in tensors if p.grad is not None]
            return sum(t.numel() * t.element_size() for t in tensors) + sum(saved.values())
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            logger.debug("memory probe: micro-batch %d does not fit: %s", micro_batch, exc)
            return None
        finally:
            self._clean(model)

    def samples_per_second(self, micro_batch: int) -> float | None:
        """Training samples per second at ``micro_batch``: forward and backward, one warm-up
        then up to three timed (fewer if one takes long). None if it does not fit in memory,
        or once ``time_budget`` seconds went into measuring (the plan then stops trying larger
        micro-batches)."""
        import contextlib
        import time

        import torch

        if self.time_spent >= self.time_budget:
            return None
        model = self._ready_model()
        device = torch.device(self._device)

        def synchronize() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elif device.type == "mps":
                torch.mps.synchronize()

        began = time.perf_counter()
        try:
            self._forward_backward(model, micro_batch, contextlib.nullcontext())  # warm-up
            synchronize()
            warm = time.perf_counter() - began
            repeats = max(1, min(3, int((self.time_budget - self.time_spent) / (2 * warm + 1e-9))))
            started = time.perf_counter()
            for _ in range(repeats):
                self._forward_backward(model, micro_batch, contextlib.nullcontext())
            synchronize()
            elapsed = time.perf_counter() - started
        except (RuntimeError, MemoryError) as exc:
            if not _out_of_memory(exc):
                raise
            logger.debug("speed probe: micro-batch %d does not fit: %s", micro_batch, exc)
            return None
        finally:
            self.time_spent += time.perf_counter() - began
            self._clean(model)
        return micro_batch * repeats / max(elapsed, 1e-9)

    def _clean(self, model: Any) -> None:
        import torch

        model.zero_grad(set_to_none=True)
        if self._device.startswith("cuda"):
            torch.cuda.empty_cache()
        elif self._device == "mps":
            torch.mps.empty_cache()


def _out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError is a RuntimeError; CUDA and MPS say "out of memory", the CPU
    allocator "can't allocate memory"."""
    words = ("out of memory", "can't allocate memory")
    return isinstance(exc, MemoryError) or any(word in str(exc) for word in words)


def make_torch_probe(
    model_factory: Callable[[], Any],
    needs: TrainingNeeds,
    device: str,
    *,
    precision: str | None = None,
    batch: Callable[[int], dict[str, Any]] | None = None,
    loss: Callable[[Any, dict[str, Any], Any], Any] | None = None,
) -> TorchMemoryProbe:
    """Build a memory (and speed) probe for :func:`plan` from a model factory.

    Args:
        model_factory: builds the model to train (e.g. ``lambda: AlbertForPreTraining(config)``);
            called once, on the first probe. Its first output must be the logits.
        needs: gives the sequence length and the vocabulary for random inputs.
        device: where to measure, e.g. ``"cuda"``.
        precision: autocast dtype to probe with; default the one :func:`plan` picks for the
            device ("bf16" on sm_80+, "fp16" below, "fp32" elsewhere).
        batch, loss: ``batch(micro_batch)`` makes a CPU training batch and ``loss(model, batch,
            device)`` the training loss on it (both, or neither: see :class:`TorchMemoryProbe`).

    Returns:
        A :class:`TorchMemoryProbe`; ``probe(micro_batch)`` gives peak bytes or None on OOM,
        ``probe.samples_per_second(micro_batch)`` the training speed at that size.
    """
    return TorchMemoryProbe(
        model_factory, needs, device, precision=precision, batch=batch, loss=loss
    )


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


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor in a torch optimizer's state, each storage counted once (shared
    quantization maps of 8-bit optimizers once): what its statistics really take, to compare
    with :func:`estimate_memory`'s ``optimizer``."""
    import torch

    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in _tensors_in(state):
            if isinstance(value, torch.Tensor):
                key = value.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total


def _tensors_in(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors_in(item)]
    return [value]

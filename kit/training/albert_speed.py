"""ALBERT pretraining at the GPU's speed: the same loss as ``AlbertForPreTraining``, less waste.

A plain ``model(**batch).loss`` leaves most of a GPU idle on ALBERT-large (16-19% of an H200's
bf16 peak). This module holds what a training loop needs to do better, with the same values:

* :func:`speed_up` swaps transformers' ``gelu_new`` (``NewGELUActivation``: ~7 elementwise kernels
  over ``[batch, seq, 4096]`` per layer, each saving a tensor for backward) for
  :class:`TanhGELU` (``torch.nn.functional.gelu(x, approximate="tanh")``: the same tanh formula in
  one kernel, saving only its input), and selects PyTorch's ``scaled_dot_product_attention``;
* :func:`prepare_batch` copies a collated batch to the device in one pinned, non-blocking
  transfer, after computing ON THE CPU what would otherwise need the device's answer: which
  positions carry an MLM label, and whether the attention mask can be dropped;
* :func:`pretraining_loss` runs the MLM head only at the labelled positions (~15% of them)
  instead of building ``[batch x seq, vocab]`` logits and their fp32 copy (gigabytes per
  ALBERT-large micro-batch), so nothing inside a micro-batch's forward/backward waits for the
  device (no ``.item()``, no ``mask.all()``, no data-dependent shapes);
* :func:`compile_layers` (opt-in) compiles the shared layer with ``torch.compile``, which fuses
  the elementwise work that remains;
* :func:`pretraining_flops_per_sample` counts the model FLOPs of one sample, for MFU.

Measured on one H200 (ALBERT-large, bf16 autocast, seq 512, forward + backward, no optimizer
step): a plain ``model(**batch).loss`` reaches 18-19% MFU with one host sync per micro-batch;
``speed_up`` + ``prepare_batch`` + ``pretraining_loss`` 37.5% (micro-batch 64) to 39% (128) with
none, at less than half the memory per sample; ``compile_layers`` on top 45-47%.

Transformers versions: the no-sync guarantee holds where ALBERT builds its mask with
``masking_utils.create_bidirectional_mask`` (transformers 5), which returns a 4D mask as it is
and accepts ``None``. Older ALBERT reads a 2D mask itself, so the mask stays 2D there (and is
never dropped: ALBERT would then build one and look at ``input_ids`` for padding). Its SDPA path
(4.45-4.57, chosen when the model is built, as kit builds it) calls ``torch.all(mask == 1)``, one
sync per forward that only patching transformers could avoid; 4.40-4.44 have no SDPA for ALBERT
(eager, sync-free, slower). Eager attention, the fallback, keeps the 2D mask everywhere; on
transformers 5 that path calls ``mask.all()`` on the device when the batch has padding.

It holds no training loop (``trainer.py``), no device placement of the model and no optimizer.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Mapping
from typing import Any, TypedDict

import torch
import torch.nn.functional as F

from kit.data.examples import IGNORE_INDEX
from kit.errors import KitUsageError

logger = logging.getLogger(__name__)

#: The keys of a collated batch (kit.data.collate.AlbertCollator); the first three are required.
REQUIRED_KEYS = ("input_ids", "labels", "sentence_order_label")
OPTIONAL_KEYS = ("attention_mask", "token_type_ids")


# --- the model ----------------------------------------------------------------------------------


class TanhGELU(torch.nn.Module):
    """``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` in one kernel (and one in backward).

    The formula of transformers' ``gelu_new`` (Hendrycks & Gimpel 2016, the tanh approximation
    of BERT and GPT-2), computed by ``torch.nn.functional.gelu(approximate="tanh")``: results
    agree to float rounding, and autograd keeps one tensor instead of ~5 per call.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    def extra_repr(self) -> str:
        return 'approximate="tanh"'


def _new_gelu_class() -> type | None:
    try:
        from transformers.activations import NewGELUActivation
    except ImportError:  # transformers renamed it: nothing of ours to swap
        return None
    return NewGELUActivation  # type: ignore[no-any-return]


def _swap_gelu_new(model: torch.nn.Module) -> list[str]:
    """Replace every ``NewGELUActivation`` submodule by a :class:`TanhGELU`; their holders'
    class names (``AlbertLayer``, ``AlbertMLMHead``)."""
    new_gelu = _new_gelu_class()
    if new_gelu is None:
        return []
    holders = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, new_gelu)
    ]
    for parent, name in holders:
        setattr(parent, name, TanhGELU())
    return [type(parent).__name__ for parent, _ in holders]


def _modeling_module(model: torch.nn.Module) -> Any:
    return sys.modules.get(type(model).__module__)


def uses_sdpa(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention is PyTorch's ``scaled_dot_product_attention``.

    Pass it as ``prepare_batch(..., sdpa=uses_sdpa(model))``.
    """
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == "sdpa"


def _select_sdpa(model: torch.nn.Module) -> str:
    """Make the attention SDPA where transformers can; the line that says what it is."""
    if uses_sdpa(model):
        return "attention: PyTorch scaled_dot_product_attention"
    module = _modeling_module(model)
    config: Any = getattr(model, "config", None)
    was = getattr(config, "_attn_implementation", None)
    set_attention: Any = getattr(model, "set_attn_implementation", None)
    if hasattr(module, "ALL_ATTENTION_FUNCTIONS"):  # transformers 5: chosen at every forward
        try:
            if set_attention is not None:
                set_attention("sdpa")
            else:
                setattr(config, "_attn_implementation", "sdpa")  # noqa: B010
        except (ValueError, ImportError, AttributeError) as error:
            reason = f"transformers refused SDPA: {error}"
        else:
            if uses_sdpa(model):
                return f"attention: PyTorch scaled_dot_product_attention (was {was})"
            reason = "transformers kept another attention"
    elif "sdpa" in getattr(module, "ALBERT_ATTENTION_CLASSES", {}):
        # transformers 4.4x-4.5x pick the attention class when the model is built
        reason = "this transformers picks attention when the model is built; build it with SDPA"
    else:
        reason = "this transformers has no SDPA for ALBERT"
    logger.warning("ALBERT keeps %s attention (%s): slower, same results", was, reason)
    return f"attention: {was} (no SDPA: {reason})"


def speed_up(model: torch.nn.Module) -> tuple[str, ...]:
    """Make an ``AlbertForPreTraining`` faster in place, with the same outputs.

    Swaps every ``gelu_new`` activation module (the shared layer's FFN, the MLM head) for
    :class:`TanhGELU` and selects SDPA attention where transformers supports it for this model
    (eager otherwise, with a log line). Parameters, their order, ``state_dict`` keys and
    ``model.config`` stay as they are (checkpoints still say ``gelu_new``: the same function).
    Calling it again changes nothing.

    Returns:
        Lines for the volunteer's training plan: the activations it swapped (only when it
        swapped some), and the attention the model uses.
    """
    lines: list[str] = []
    swapped = _swap_gelu_new(model)
    if swapped:
        where = ", ".join(sorted(set(swapped)))
        lines.append(f"activation: gelu_new as one fused tanh-GELU kernel (in {where})")
    lines.append(_select_sdpa(model))
    return tuple(lines)


def _albert_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """ALBERT's layers with weights (one, shared by all ``num_hidden_layers`` uses)."""
    base = getattr(model, "albert", model)
    groups = getattr(getattr(base, "encoder", None), "albert_layer_groups", [])
    return [layer for group in groups for layer in getattr(group, "albert_layers", [])]


def compile_layers(model: torch.nn.Module, **options: Any) -> tuple[str, ...]:
    """Compile ALBERT's shared layer with ``torch.compile`` in place (opt-in, after speed_up).

    Fuses what stays elementwise (residual adds, LayerNorms, autocast's casts, the GELU) with
    its neighbours. Measured on one H200 (ALBERT-large, bf16 autocast, seq 512, forward and
    backward through :func:`pretraining_loss`, MFU by :func:`pretraining_flops_per_sample`):
    37.5% -> 44.8% at micro-batch 64, 39.0% -> 46.7% at 128; still no host sync.

    The price: the first micro-batch of each new shape compiles (8-14 s there); after a second
    sequence length torch compiles one dynamic-shape version. Needs torch >= 2.2 and a Triton
    (CUDA) or C++ (CPU) toolchain. A ``copy.deepcopy`` of the model is not compiled: compile
    each replica. A layer already compiled is left as it is.

    Args:
        model: an ``AlbertForPreTraining`` (or ``AlbertModel``).
        **options: passed to ``torch.compile`` (``mode``, ``dynamic``, ``backend``...).

    Returns:
        A line for the training plan, or none when there was nothing to compile.
    """
    layers = [
        layer
        for layer in _albert_layers(model)
        if getattr(layer, "_compiled_call_impl", None) is None  # torch's mark of .compile()
    ]
    if not layers:
        return ()
    if not hasattr(layers[0], "compile"):
        logger.warning("torch %s cannot compile a module in place (2.2+ can)", torch.__version__)
        return ("compile: skipped (needs torch >= 2.2)",)
    for layer in layers:
        layer.compile(**options)
    return (f"compile: ALBERT's shared layer with torch.compile ({len(layers)} module)",)


# --- the batch ----------------------------------------------------------------------------------


class DeviceBatch(TypedDict):
    """A micro-batch on the device, with what :func:`pretraining_loss` must not ask it."""

    input_ids: torch.Tensor  # (batch, seq) int64
    token_type_ids: torch.Tensor | None  # (batch, seq) int64, or None (all segment A)
    attention_mask: torch.Tensor | None  # None (no padding), (batch, seq) or (batch, 1, seq, seq)
    sentence_order_label: torch.Tensor  # (batch,) int64
    predicted_positions: torch.Tensor  # (count,) int64: flat indices into batch x seq
    predicted_labels: torch.Tensor  # (count,) int64: the MLM targets at those positions
    predicted_count: int  # labelled positions in the whole batch (known on the host)


@functools.cache
def masks_pass_through() -> bool:
    """Whether transformers' ALBERT takes a ready 4D mask, or ``None``, without reading it.

    True where ALBERT calls ``masking_utils.create_bidirectional_mask`` (transformers 5): a 4D
    mask returns early in ``_preprocess_mask_arguments``, and ``None`` skips the mask for SDPA
    without a look at the device. False for older ALBERT (its own 2D-mask code).
    """
    try:
        from transformers.models.albert import modeling_albert
    except ImportError:
        return False
    return hasattr(modeling_albert, "create_bidirectional_mask")


def _check_batch(batch: Mapping[str, torch.Tensor]) -> None:
    missing = [key for key in REQUIRED_KEYS if key not in batch]
    unknown = sorted(set(batch) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if missing or unknown:
        raise KitUsageError(
            f"prepare_batch got a batch with missing keys {missing} or unknown keys {unknown} - "
            "help: pass what kit.data.collate.AlbertCollator returns"
        )
    placed = sorted(key for key, tensor in batch.items() if tensor.device.type != "cpu")
    if placed:
        raise KitUsageError(
            f"prepare_batch got {placed} on a device: reading them there would wait for it - "
            "help: pass the collated batch as it is, on the CPU"
        )


def _copy_packed(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (int64) on ``device`` by one copy: packed into one buffer (pinned on CUDA,
    so the copy is asynchronous), then cut back into views of their shapes."""
    cuda = device.type == "cuda"
    sizes = [tensor.numel() for tensor in tensors]
    buffer = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=cuda)
    torch.cat([tensor.reshape(-1) for tensor in tensors], out=buffer)
    moved = buffer.to(device, non_blocking=cuda)
    pieces = moved.split(sizes)
    return [piece.view(tensor.shape) for piece, tensor in zip(pieces, tensors, strict=True)]


def prepare_batch(
    batch: Mapping[str, torch.Tensor], device: torch.device | str, *, sdpa: bool
) -> DeviceBatch:
    """The collated CPU ``batch`` on ``device``, ready for :func:`pretraining_loss`.

    On the CPU (where reading a tensor costs no device sync) it finds the labelled positions
    (``labels != -100``) and whether every token is real. Then, per attention mask:

    * no padding: the mask is dropped (SDPA then takes its fastest, mask-free kernel);
    * padding and SDPA: a boolean ``(batch, 1, seq, seq)`` mask (True = attend), expanded on the
      device from the copied 2D mask, which transformers 5 passes to SDPA as it is (its own
      ``create_bidirectional_mask`` would call ``mask.all()`` on the device first);
    * padding and eager attention: the 2D mask;
    * transformers before 5 (:func:`masks_pass_through` is False): always the 2D mask, one of
      ones when the batch has none (see the module docstring).

    Args:
        batch: ``AlbertCollator``'s output, on the CPU (``attention_mask`` and ``token_type_ids``
            optional).
        device: where the model is.
        sdpa: whether the model attends with SDPA (:func:`uses_sdpa`).

    Raises:
        KitUsageError: a tensor is already on a device, or keys are missing or unknown.
    """
    _check_batch(batch)
    device = torch.device(device)
    input_ids = batch["input_ids"]
    flat_labels = batch["labels"].reshape(-1)
    positions = (flat_labels != IGNORE_INDEX).nonzero().reshape(-1)
    host = {
        "input_ids": input_ids,
        "sentence_order_label": batch["sentence_order_label"].reshape(-1),
        "predicted_positions": positions,
        "predicted_labels": flat_labels.index_select(0, positions),
    }
    if batch.get("token_type_ids") is not None:
        host["token_type_ids"] = batch["token_type_ids"]
    mask = batch.get("attention_mask")
    pass_through = masks_pass_through()
    if mask is not None and not (pass_through and bool(mask.all())):
        host["attention_mask"] = mask
    elif mask is None and not pass_through:  # older ALBERT would make one and read it
        host["attention_mask"] = torch.ones_like(input_ids)
    names = list(host)
    moved = dict(
        zip(names, _copy_packed([host[n].to(torch.int64) for n in names], device), strict=True)
    )
    device_mask = moved.get("attention_mask")
    if device_mask is not None and sdpa and pass_through:
        rows, length = device_mask.shape
        device_mask = device_mask.bool()[:, None, None, :].expand(rows, 1, length, length)
    return DeviceBatch(
        input_ids=moved["input_ids"],
        token_type_ids=moved.get("token_type_ids"),
        attention_mask=device_mask,
        sentence_order_label=moved["sentence_order_label"],
        predicted_positions=moved["predicted_positions"],
        predicted_labels=moved["predicted_labels"],
        predicted_count=int(positions.numel()),
    )


# --- the loss -----------------------------------------------------------------------------------


def pretraining_loss(model: torch.nn.Module, prepared: DeviceBatch) -> torch.Tensor:
    """``AlbertForPreTraining(**batch).loss``, with the MLM head run at labelled positions only.

    The value is HF's: the mean MLM cross-entropy over the labelled positions plus the SOP
    cross-entropy, both in float32 (as autocast computes HF's). The encoder is ``model.albert``,
    the heads ``model.predictions`` (on ``predicted_count`` rows gathered by ``index_select``, not
    on ``batch x seq``) and ``model.sop_classifier``, called in HF's order (so dropout draws the
    same random numbers). Gradients equal HF's to float rounding.

    A batch with no labelled position at all (HF: NaN, from 0/0) gets an MLM term of exactly 0
    whose gradient is 0 for every parameter: the loss is the SOP loss alone, and one odd batch
    does not poison an accumulated gradient with NaNs.

    Raises:
        KitUsageError: the batch has a 4D mask (prepared for SDPA) but the model attends eagerly.
    """
    mask = prepared["attention_mask"]
    if mask is not None and mask.dim() == 4 and not uses_sdpa(model):
        raise KitUsageError(
            "this batch was prepared for SDPA attention but the model attends eagerly - "
            "help: prepare_batch(batch, device, sdpa=uses_sdpa(model))"
        )
    albert: Any = model.albert
    outputs = albert(
        input_ids=prepared["input_ids"],
        attention_mask=mask,
        token_type_ids=prepared["token_type_ids"],
        return_dict=True,
    )
    sequence = outputs.last_hidden_state
    labelled = sequence.reshape(-1, sequence.shape[-1]).index_select(
        0, prepared["predicted_positions"]
    )
    predictions: Any = model.predictions
    sop_classifier: Any = model.sop_classifier
    logits = predictions(labelled)
    sop_logits = sop_classifier(outputs.pooler_output)
    mlm = F.cross_entropy(logits.float(), prepared["predicted_labels"], reduction="sum")
    mlm = mlm / max(prepared["predicted_count"], 1)  # an empty sum is 0: an MLM term of 0
    sop = F.cross_entropy(
        sop_logits.float().view(-1, sop_logits.shape[-1]),
        prepared["sentence_order_label"].view(-1),
    )
    return mlm + sop


# --- the count ----------------------------------------------------------------------------------


def pretraining_flops_per_sample(
    config: Any, sequence_length: int, predicted_fraction: float
) -> float:
    """Model FLOPs of one training sample (forward + backward) as MFU counts them.

    PaLM's count (Chowdhery et al. 2022, Appendix B): 6 FLOPs per matmul parameter and token
    (2 forward, 4 backward), plus 12·L·H·s per token for attention's two ``s x s`` products;
    elementwise work, norms, softmax and embedding lookups are not counted. With hidden ``H``,
    layers ``L`` (ALBERT's shared layer counts for each of its ``num_hidden_layers`` uses), FFN
    ``F``, embedding ``E``, vocabulary ``V``, sequence ``s`` and ``p = predicted_fraction``::

        6·s·(E·H + L·(4·H² + 2·H·F))     embedding projection, attention and FFN matmuls
        + 6·p·s·(H·E + E·V)              MLM head (dense, decoder), at predicted tokens only
        + 6·(H² + 2·H)                   pooler and SOP classifier, on [CLS] only
        + 12·L·H·s²                      attention scores and their weighted sum

    ALBERT-large at s=512, p=0.15: ~1.0e12 FLOPs per sample.

    Args:
        config: an ``AlbertConfig`` or kit's ``ModelConfig`` (the same field names).
        sequence_length: tokens per sample.
        predicted_fraction: the share of positions with an MLM label (kit's data: ~0.15).
    """
    if sequence_length < 1 or not 0.0 <= predicted_fraction <= 1.0:
        raise ValueError(
            f"need sequence_length >= 1 and 0 <= predicted_fraction <= 1, got "
            f"{sequence_length} and {predicted_fraction}"
        )
    hidden = int(config.hidden_size)
    layers = int(config.num_hidden_layers)
    ffn = int(config.intermediate_size)
    embedding = int(config.embedding_size)
    vocab = int(config.vocab_size)
    sop_labels = int(getattr(config, "num_labels", 2))
    s = float(sequence_length)
    per_token = embedding * hidden + layers * (4 * hidden * hidden + 2 * hidden * ffn)
    head = hidden * embedding + embedding * vocab
    once = hidden * hidden + hidden * sop_labels
    matmuls = s * per_token + predicted_fraction * s * head + once
    return 6.0 * matmuls + 12.0 * layers * hidden * s * s

"""ALBERT at the GPU's speed computes HF's ALBERT: same outputs, same loss, same gradients (CPU)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import AlbertConfig, AlbertForPreTraining
from transformers.activations import NewGELUActivation
from transformers.models.albert import modeling_albert

from kit.config import ModelConfig
from kit.errors import KitUsageError
from kit.training.albert_speed import (
    TanhGELU,
    compile_layers,
    masks_pass_through,
    prepare_batch,
    pretraining_flops_per_sample,
    pretraining_loss,
    speed_up,
    uses_sdpa,
)
from kit.training.checkpointing import enable_checkpointing

VOCAB = 120
#: transformers 5 switches ALBERT to SDPA at any time, 4.45-4.57 build it so, 4.40-4.44 lack it.
ALBERT_HAS_SDPA = hasattr(modeling_albert, "ALL_ATTENTION_FUNCTIONS") or "sdpa" in getattr(
    modeling_albert, "ALBERT_ATTENTION_CLASSES", {}
)
BATCH, LENGTH = 4, 24


def albert_config(**changes: object) -> AlbertConfig:
    # classifier dropout stays on (0.1): the SOP head must draw HF's random numbers in train mode
    values: dict[str, object] = dict(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_act="gelu_new",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    values.update(changes)
    return AlbertConfig(**values)


def build(**changes: object) -> AlbertForPreTraining:
    torch.manual_seed(0)
    return AlbertForPreTraining(albert_config(**changes))


@pytest.fixture(scope="module")
def reference() -> AlbertForPreTraining:
    """The untouched model: eager attention, transformers' gelu_new (tests deep-copy it)."""
    return build()


def to_speed_up(reference: AlbertForPreTraining) -> AlbertForPreTraining:
    """A copy of ``reference`` that speed_up can switch to SDPA. transformers 5 switches any
    ALBERT; 4.4x-4.5x pick the attention class when the model is built (kit builds SDPA)."""
    if not hasattr(modeling_albert, "ALBERT_ATTENTION_CLASSES"):
        return copy.deepcopy(reference)
    model = build(attn_implementation="sdpa")
    model.load_state_dict(reference.state_dict())
    return model


def make_batch(kind: str) -> dict[str, torch.Tensor]:
    """A collated batch: "padded" (row 2 has no label), "full" (no padding), "unlabelled"."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=generator)
    lengths = [LENGTH, 16, 20, 9] if kind != "full" else [LENGTH] * BATCH
    attention_mask = torch.zeros(BATCH, LENGTH, dtype=torch.int64)
    token_type_ids = torch.zeros(BATCH, LENGTH, dtype=torch.int64)
    labels = torch.full((BATCH, LENGTH), -100, dtype=torch.int64)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
        token_type_ids[row, length // 2 : length] = 1
        input_ids[row, length:] = 0
        picked = torch.rand(length, generator=generator) < 0.3
        if kind == "unlabelled" or (kind == "padded" and row == 2):
            continue
        picked[1] = True  # at least one label in the row
        labels[row, :length][picked] = input_ids[row, :length][picked]
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        token_type_ids=token_type_ids,
        labels=labels,
        sentence_order_label=torch.tensor([0, 1, 1, 0]),
    )


def hf_loss_and_grads(
    model: AlbertForPreTraining, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), grads(model)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where backward never reached it)."""
    return {
        name: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for name, p in model.named_parameters()
    }


def assert_same_gradients(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Every parameter's gradient equal to float32 rounding (relative to the largest one)."""
    assert expected.keys() == got.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


# --- speed_up ----------------------------------------------------------------------------------


def test_speed_up_swaps_gelu_new_and_selects_sdpa_with_the_same_outputs(
    reference: AlbertForPreTraining,
) -> None:
    fast = to_speed_up(reference)
    keys = list(fast.state_dict())
    lines = speed_up(fast)
    assert any("tanh-GELU" in line and "AlbertLayer" in line for line in lines), lines
    assert not any(isinstance(m, NewGELUActivation) for m in fast.modules())
    assert sum(isinstance(m, TanhGELU) for m in fast.modules()) == 2  # shared layer, MLM head
    if ALBERT_HAS_SDPA:
        assert uses_sdpa(fast) and "scaled_dot_product_attention" in lines[-1]
    else:  # transformers < 4.45
        assert not uses_sdpa(fast) and "no SDPA" in lines[-1]
    assert list(fast.state_dict()) == keys and fast.config.hidden_act == "gelu_new"

    batch = make_batch("padded")
    reference.eval()
    fast.eval()
    with torch.no_grad():
        expected, got = reference(**batch), fast(**batch)
    torch.testing.assert_close(got.prediction_logits, expected.prediction_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.sop_logits, expected.sop_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=0)


def test_speed_up_twice_changes_nothing(reference: AlbertForPreTraining) -> None:
    fast = to_speed_up(reference)
    speed_up(fast)
    modules = list(fast.modules())
    again = speed_up(fast)
    assert len(again) == 1 and again[0].startswith("attention: ")  # it only says which
    assert speed_up(fast) == again
    assert list(fast.modules()) == modules  # the very same module objects


def test_without_sdpa_speed_up_says_so_and_the_loss_stays_hf(
    reference: AlbertForPreTraining, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = copy.deepcopy(reference).train()

    def refuse(implementation: str) -> None:
        raise ValueError(f"no {implementation} here")

    monkeypatch.setattr(model, "set_attn_implementation", refuse, raising=False)
    lines = speed_up(model)
    assert not uses_sdpa(model) and "no SDPA" in lines[-1], lines
    batch = make_batch("padded")
    prepared = prepare_batch(batch, "cpu", sdpa=uses_sdpa(model))
    assert prepared["attention_mask"] is not None and prepared["attention_mask"].dim() == 2
    expected_loss, expected_grads = hf_loss_and_grads(copy.deepcopy(reference).train(), batch)
    torch.manual_seed(7)
    loss = pretraining_loss(model, prepared)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-6, atol=0)
    assert_same_gradients(expected_grads, grads(model))


def test_speed_up_leaves_other_activations_alone() -> None:
    model = build(hidden_act="gelu")
    lines = speed_up(model)
    assert not any("GELU" in line for line in lines)
    assert not any(isinstance(m, TanhGELU) for m in model.modules())


def test_tanh_gelu_is_gelu_new_to_rounding() -> None:
    x = torch.linspace(-8, 8, 10_001, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    torch.testing.assert_close(TanhGELU()(x), NewGELUActivation()(y), rtol=0, atol=1e-6)
    TanhGELU()(x).sum().backward()
    NewGELUActivation()(y).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-5)


def test_compile_layers_compiles_the_shared_layer_once(reference: AlbertForPreTraining) -> None:
    batch = make_batch("padded")
    expected_loss, expected_grads = hf_loss_and_grads(copy.deepcopy(reference).train(), batch)
    model = to_speed_up(reference).train()
    speed_up(model)
    assert compile_layers(model, backend="eager") == (
        "compile: ALBERT's shared layer with torch.compile (1 module)",
    )
    assert compile_layers(model, backend="eager") == ()  # already compiled
    assert compile_layers(copy.deepcopy(model), backend="eager")  # copies are not compiled
    torch.manual_seed(7)
    loss = pretraining_loss(model, prepare_batch(batch, "cpu", sdpa=True))
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-6, atol=0)
    assert_same_gradients(expected_grads, grads(model))


# --- prepare_batch -----------------------------------------------------------------------------


def test_prepare_batch_finds_the_labelled_positions_on_the_cpu() -> None:
    batch = make_batch("padded")
    prepared = prepare_batch(batch, "cpu", sdpa=True)
    flat = batch["labels"].reshape(-1)
    expected = [i for i, label in enumerate(flat.tolist()) if label != -100]
    assert prepared["predicted_positions"].tolist() == expected
    assert prepared["predicted_labels"].tolist() == flat[expected].tolist()
    assert prepared["predicted_count"] == len(expected) > 0
    assert prepared["input_ids"].equal(batch["input_ids"])
    assert prepared["token_type_ids"] is not None
    assert prepared["token_type_ids"].equal(batch["token_type_ids"])
    assert prepared["sentence_order_label"].equal(batch["sentence_order_label"])


def test_prepare_batch_shapes_the_mask_for_the_attention() -> None:
    padded, full = make_batch("padded"), make_batch("full")
    two_d = prepare_batch(padded, "cpu", sdpa=False)["attention_mask"]
    assert two_d is not None and two_d.equal(padded["attention_mask"])
    four_d = prepare_batch(padded, "cpu", sdpa=True)["attention_mask"]
    if masks_pass_through():  # transformers 5: a boolean (B, 1, S, S) mask, True = attend
        assert four_d is not None and four_d.dtype == torch.bool
        assert four_d.shape == (BATCH, 1, LENGTH, LENGTH)
        rows = padded["attention_mask"].bool()[:, None, None, :]
        assert four_d.equal(rows.expand(BATCH, 1, LENGTH, LENGTH))
        for sdpa in (True, False):  # no padding: no mask at all
            assert prepare_batch(full, "cpu", sdpa=sdpa)["attention_mask"] is None
    else:  # older ALBERT reads 2D masks itself
        assert four_d is not None and four_d.equal(padded["attention_mask"])


def test_prepare_batch_refuses_device_tensors_and_unknown_keys() -> None:
    batch = make_batch("padded")
    with pytest.raises(KitUsageError, match="on the CPU"):
        prepare_batch({**batch, "labels": batch["labels"].to("meta")}, "cpu", sdpa=True)
    with pytest.raises(KitUsageError, match="unknown keys"):
        prepare_batch({**batch, "position_ids": batch["labels"]}, "cpu", sdpa=True)
    with pytest.raises(KitUsageError, match="missing keys"):
        prepare_batch({"input_ids": batch["input_ids"]}, "cpu", sdpa=True)


# --- pretraining_loss --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["padded", "full"])
@pytest.mark.parametrize("variant", ["eager", "sped_up", "checkpointed"])
def test_pretraining_loss_is_hf_loss_with_hf_gradients(
    reference: AlbertForPreTraining, kind: str, variant: str
) -> None:
    batch = make_batch(kind)
    model = (copy.deepcopy(reference) if variant == "eager" else to_speed_up(reference)).train()
    expected_loss, expected_grads = hf_loss_and_grads(copy.deepcopy(reference).train(), batch)
    if variant != "eager":
        speed_up(model)
    if variant == "checkpointed":
        enable_checkpointing(model)
    prepared = prepare_batch(batch, "cpu", sdpa=uses_sdpa(model))
    torch.manual_seed(7)
    loss = pretraining_loss(model, prepared)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-6, atol=0)
    assert_same_gradients(expected_grads, grads(model))


def test_pretraining_loss_without_token_types_or_mask(reference: AlbertForPreTraining) -> None:
    full = make_batch("full")
    del full["token_type_ids"], full["attention_mask"]
    expected_loss, expected_grads = hf_loss_and_grads(copy.deepcopy(reference).train(), full)
    model = to_speed_up(reference).train()
    speed_up(model)
    torch.manual_seed(7)
    loss = pretraining_loss(model, prepare_batch(full, "cpu", sdpa=True))
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-6, atol=0)
    assert_same_gradients(expected_grads, grads(model))


def test_a_batch_without_labels_has_a_zero_mlm_term(reference: AlbertForPreTraining) -> None:
    batch = make_batch("unlabelled")
    hf = copy.deepcopy(reference).eval()
    assert torch.isnan(hf(**batch).loss)  # transformers: 0/0
    outputs = hf(**{k: v for k, v in batch.items() if k != "labels"})
    sop_only = F.cross_entropy(outputs.sop_logits, batch["sentence_order_label"])
    sop_only.backward()
    model = to_speed_up(reference).eval()
    speed_up(model)
    prepared = prepare_batch(batch, "cpu", sdpa=True)
    assert prepared["predicted_count"] == 0
    loss = pretraining_loss(model, prepared)
    loss.backward()
    torch.testing.assert_close(loss.detach(), sop_only.detach(), rtol=1e-6, atol=0)
    for name, param in model.named_parameters():  # the MLM head learns nothing, nothing is NaN
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        if name.startswith("predictions.") and "decoder.weight" not in name:
            assert not param.grad.any(), name
    assert_same_gradients(grads(hf), grads(model))


def test_pretraining_loss_runs_under_bf16_autocast(reference: AlbertForPreTraining) -> None:
    batch = make_batch("padded")
    model = to_speed_up(reference).eval()
    speed_up(model)
    prepared = prepare_batch(batch, "cpu", sdpa=True)
    with torch.no_grad():
        full_precision = pretraining_loss(model, prepared)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pretraining_loss(model, prepared)
    assert loss.dtype == torch.float32  # the cross-entropies run in float32
    loss.backward()
    assert abs(float(loss.detach()) - float(full_precision)) < 0.05
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_pretraining_loss_refuses_a_4d_mask_on_eager_attention(
    reference: AlbertForPreTraining,
) -> None:
    if not masks_pass_through():
        pytest.skip("older transformers: prepare_batch keeps 2D masks")
    prepared = prepare_batch(make_batch("padded"), "cpu", sdpa=True)
    with pytest.raises(KitUsageError, match="sdpa=uses_sdpa"):
        pretraining_loss(copy.deepcopy(reference), prepared)


# --- pretraining_flops_per_sample --------------------------------------------------------------


def test_flops_per_sample_by_hand() -> None:
    config = albert_config(
        hidden_size=8, num_hidden_layers=2, intermediate_size=16, embedding_size=4, vocab_size=10
    )
    s, predicted = 4, 2  # predicted_fraction 0.5
    embedding_projection = 4 * 8  # E x H per token
    layer = 4 * 8 * 8 + 2 * 8 * 16  # Q, K, V, O + FFN in and out, per token and layer use
    head = 8 * 4 + 4 * 10  # dense H x E + decoder E x V, per predicted token
    pooler_and_sop = 8 * 8 + 8 * 2  # per sample
    matmuls = s * (embedding_projection + 2 * layer) + predicted * head + pooler_and_sop
    attention = 12 * 2 * 8 * s * s  # PaLM: 12 x L x H x s per token
    expected = 6 * matmuls + attention
    assert expected == 29_760
    assert pretraining_flops_per_sample(config, s, 0.5) == expected


def test_flops_of_albert_large_from_kit_config() -> None:
    flops = pretraining_flops_per_sample(ModelConfig(), 512, 0.15)
    assert 0.99e12 < flops < 1.02e12
    small = dataclasses.replace(ModelConfig(), num_hidden_layers=12)
    assert pretraining_flops_per_sample(small, 512, 0.15) < 0.6 * flops  # layers dominate
    with pytest.raises(ValueError):
        pretraining_flops_per_sample(ModelConfig(), 512, 1.5)


# --- on a CUDA GPU (skipped elsewhere) ---------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("variant", ["sped_up", "compiled", "compiled_checkpointed"])
def test_pretraining_loss_is_hf_loss_on_cuda(
    reference: AlbertForPreTraining, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 for real
    batch = make_batch("padded")
    hf = copy.deepcopy(reference).cuda().train()
    expected_loss, expected_grads = hf_loss_and_grads(hf, {k: v.cuda() for k, v in batch.items()})
    model = to_speed_up(reference).cuda().train()
    speed_up(model)
    if variant != "sped_up":
        compile_layers(model)
    if variant == "compiled_checkpointed":
        enable_checkpointing(model)
    torch.manual_seed(7)
    loss = pretraining_loss(model, prepare_batch(batch, "cuda", sdpa=uses_sdpa(model)))
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-5, atol=0)
    assert_same_gradients(expected_grads, grads(model))


@cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", ["padded", "full", "unlabelled"])
def test_a_micro_batch_never_waits_for_the_gpu(
    reference: AlbertForPreTraining, kind: str, compiled: bool
) -> None:
    """No host-device sync from the CPU batch to the gradients (sync debug mode raises)."""
    model = to_speed_up(reference).cuda().train()
    speed_up(model)
    if compiled:
        compile_layers(model)
    batch = make_batch(kind)
    half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def micro_step() -> None:
        prepared = prepare_batch(batch, "cuda", sdpa=uses_sdpa(model))
        with torch.autocast("cuda", dtype=half):
            loss = pretraining_loss(model, prepared)
        loss.backward()

    micro_step()  # warm-up: pinned and device allocators, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        micro_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_loss_curve_of_training_is_the_eager_one(reference: AlbertForPreTraining) -> None:
    """Thirty LAMB steps: eager attention, gelu_new and HF's loss on every position, against
    SDPA, the fused GELU and the MLM head at labelled positions only: the same curve."""
    from kit.training.lamb import Lamb

    curves = []
    for fast in (False, True):
        model = to_speed_up(reference) if fast else copy.deepcopy(reference)
        if fast:
            speed_up(model)
        optimizer = Lamb(model.parameters(), lr=0.01, weight_decay=0.01)
        torch.manual_seed(3)  # the SOP head's dropout draws the same numbers in both runs
        curve = []
        for step in range(30):
            batch = make_batch("padded" if step % 2 else "full")
            optimizer.zero_grad()
            if fast:
                loss = pretraining_loss(model, prepare_batch(batch, "cpu", sdpa=uses_sdpa(model)))
            else:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            curve.append(float(loss.detach()))
        curves.append(torch.tensor(curve))
    eager, fast = curves
    assert float(eager[-1]) < float(eager[0])  # it learns
    torch.testing.assert_close(fast, eager, rtol=1e-4, atol=0.0)
